"""Memory planning: activation buffers placed in one arena per bucket, reusing space by liveness.

Views share their input's buffer; in-place cache writes live in the state buffers; params and
step inputs are not in the arena. Placement is first-fit over free intervals, in definition order."""
from __future__ import annotations

from ..ir import shapes as sh
from ..ir.graph import Graph
from ..ir.registry import get_op
from .kernels import VIEW_OPS

ALIGN = 256  # bytes: every buffer starts on a boundary the widest vector loads accept


def _bytes(t, env) -> int:
    parts = (t.data, t.scale) if hasattr(t, "scale") else (t,)
    total = 0
    for p in parts:
        n = 1
        for d in sh.evaluate(p.storage_shape(), env):
            n *= d
        total += -(-n * p.dtype.storage.itemsize // ALIGN) * ALIGN
    return total


def _coalesce(free: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for off, sz in sorted(free):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + sz)
        else:
            out.append((off, sz))
    return out


def plan_memory(g: Graph, env: dict[str, int], resident: set[str] = frozenset()) -> dict:
    """{"peak_bytes", "buffers": {value: [offset, bytes]}, "aliases": {value: value}} for one bucket.

    `resident` values (derived weights made at load) live with the params, not in the arena."""
    prod = g.producers()
    alias: dict[str, str] = {}
    for n in g.nodes:
        if n.op in VIEW_OPS:
            alias[n.outputs[0]] = alias.get(n.inputs[0], n.inputs[0])
        for o, i in get_op(n.op).inplace.items():
            alias[n.outputs[o]] = alias.get(n.inputs[i], n.inputs[i])
    live = g.liveness()
    # a buffer lives from its definition to the last use of it or of any view of it
    end: dict[str, int] = {}
    for v, (start, last) in live.items():
        root = alias.get(v, v)
        end[root] = max(end.get(root, -1), last)
    order = sorted((v for v in live if v in prod and v not in alias and v not in resident),
                   key=lambda v: live[v][0])
    free: list[tuple[int, int]] = []  # (offset, size) of released blocks
    active: list[tuple[int, str]] = []  # (end, value)
    placed: dict[str, list[int]] = {}
    top = 0
    for v in order:
        start = live[v][0]
        for e, w in [a for a in active if a[0] < start]:
            active.remove((e, w))
            free.append(tuple(placed[w]))
        free = _coalesce(free)
        size = _bytes(g.types[v], env)
        slot = next((k for k, (off, sz) in enumerate(free) if sz >= size), None)
        if slot is None:
            off, top = top, top + size
        else:
            off, sz = free.pop(slot)
            if sz > size:
                free.append((off + size, sz - size))
        placed[v] = [off, size]
        active.append((end[v], v))
    return {"peak_bytes": top, "buffers": placed, "aliases": alias}
