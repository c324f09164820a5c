"""Every kernel template; importing a module registers its templates."""
from . import torch_ref  # noqa: F401
from . import triton_ops  # noqa: F401
