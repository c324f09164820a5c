"""Allocation of the state buffers (caches) a model program declares."""
from __future__ import annotations

import torch

from ..ir import shapes as sh
from ..ir.quant import QTensor
from ..ir.types import QuantType, TensorType


def _zeros(t: TensorType, env: dict) -> torch.Tensor:
    return torch.zeros(sh.evaluate(t.storage_shape(), env), dtype=t.dtype.storage)


def allocate_state(types: dict, **sizes: int) -> dict:
    """Zeroed buffers for every state type, with its size symbols bound (num_slots, num_pages)."""
    out = {}
    for name, t in types.items():
        if isinstance(t, QuantType):
            out[name] = QTensor(_zeros(t.data, sizes), _zeros(t.scale, sizes))
        else:
            out[name] = _zeros(t, sizes)
    return out


def state_bytes(types: dict, **sizes: int) -> int:
    return sum(int(sh.evaluate((t.nbytes,), sizes)[0]) for t in types.values())
