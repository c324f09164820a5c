"""The state buffers (caches) a model program declares: allocation and clearing a slot."""
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


def slot_buffers(types: dict) -> list[str]:
    """The state buffers indexed by slot (window rings, compressor rings, Engram history); the rest
    are paged. Dim 0 is the slot or page index."""
    return [name for name, t in types.items() if (t.data if isinstance(t, QuantType) else t).shape[0] == sh.num_slots]


def zero_slot(state: dict, names: list[str], slot: int) -> None:
    """Clear one slot of the named buffers before a new sequence takes it. Correctness does not
    depend on it (every op masks history by position), but a clean slot keeps a new sequence's
    state bit-identical whatever ran in the slot before."""
    for name in names:
        buf = state[name]
        for part in ((buf.data, buf.scale) if isinstance(buf, QTensor) else (buf,)):
            part[slot].zero_()
