"""The state buffers (caches) a model program declares: allocation, clearing a slot, and the copies
of a slot or a page the prefix cache makes."""
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


def paged_buffers(types: dict) -> list[str]:
    """The state buffers indexed by page (compressed KV, index K)."""
    slots = set(slot_buffers(types))
    return [name for name in types if name not in slots]


def zero_slot(state: dict, names: list[str], slot: int) -> None:
    """Clear one slot of the named buffers before a new sequence takes it. Correctness does not
    depend on it (every op masks history by position), but a clean slot keeps a new sequence's
    state bit-identical whatever ran in the slot before."""
    for name in names:
        for part in _parts(state[name]):
            part[slot].zero_()


def _parts(buf) -> tuple:
    return (buf.data, buf.scale) if isinstance(buf, QTensor) else (buf,)


def save_slot(state: dict, names: list[str], slot: int) -> dict:
    """A copy of one slot of the named buffers, where the buffers live (a prefix cache keeps it
    with a page to resume other sequences from)."""
    return {name: tuple(part[slot].clone() for part in _parts(state[name])) for name in names}


def restore_slot(state: dict, names: list[str], slot: int, saved: dict) -> None:
    """Write a `save_slot` copy into a slot (in place: the buffers keep their addresses)."""
    if set(saved) != set(names):
        raise ValueError(f"a saved slot state of {sorted(saved)} does not fit buffers {sorted(names)}")
    for name in names:
        for part, value in zip(_parts(state[name]), saved[name]):
            part[slot].copy_(value)


def copy_page(state: dict, names: list[str], src: int, dst: int) -> None:
    """Copy one page of the named (paged) buffers onto another."""
    for name in names:
        for part in _parts(state[name]):
            part[dst].copy_(part[src])


def saved_bytes(saved: dict) -> int:
    """Bytes a `save_slot` copy holds."""
    return sum(p.numel() * p.element_size() for parts in saved.values() for p in parts)


class SlotStateOps:
    """The slot and page operations an executor offers the engine (runtime/cache.SlotOps), over
    its `state` dict; `slot_names` and `page_names` say which buffers are per slot and per page.
    Copies stay where the state lives (on the device for a device executor)."""

    state: dict
    slot_names: list[str]
    page_names: list[str]

    def reset_slot(self, slot: int) -> None:
        """Clear a state slot before a new sequence takes it."""
        zero_slot(self.state, self.slot_names, slot)

    def save_slot(self, slot: int) -> dict:
        return save_slot(self.state, self.slot_names, slot)

    def restore_slot(self, slot: int, saved: dict) -> None:
        restore_slot(self.state, self.slot_names, slot, saved)

    def copy_page(self, src: int, dst: int) -> None:
        copy_page(self.state, self.page_names, src, dst)
