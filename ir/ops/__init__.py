"""Importing this package registers every op with ir.registry (one module per family)."""
from . import core  # noqa: F401
