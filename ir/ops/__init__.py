"""Importing this package registers every op with ir.registry (one module per family)."""
from . import attention, core, engram, expert_parallel, fused, heads, mhc, moe, quantized  # noqa: F401
