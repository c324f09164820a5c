"""Expert parallelism: the routed-expert rows of a MoE layer travel to the rank holding their
expert and back (spec §4.5 across ranks; slots and replicas as spec §11 places them).

Layout. W = `ep` ranks in `dp` attention groups of G = W / dp consecutive ranks: the ranks of one
group run the same sequences (attention replicated), different groups different ones (data-
parallel attention). Each rank holds S = P / W expert slots (P = experts + redundant replicas);
slot p lives on rank p // S, and `slots[p]` is the logical expert it holds (the EPLB placement).

Routing. Group g's rows of expert e go to the replica  r = replicas(e)[g mod count(e)]  (spec §11
picks a replica per token; per group keeps a group's rows of one expert contiguous, so one
exchange moves them). The member of g at the position of r's rank within its own group sends
them, and every member of g gets the outputs back. With dp = W that is the usual all-to-all
dispatch and combine; with dp = 1 each rank already holds every token, so dispatch moves nothing
(each rank computes its own slots' rows) and combine is an all-gather of the expert outputs,
half the traffic of two all-to-alls at the small batches where every rank holds every token.

Numerics do not change: every row meets the same weights and row-local arithmetic wherever it
runs, and the combine that follows sums each token's experts in logical expert order as in one
process. The exchange itself is a parameter: `SingleProcess` (one rank holds every slot) is the
reference meaning; the runtime passes one over torch.distributed.
"""
from __future__ import annotations

import sympy
import torch

from .. import dtypes as dt
from ..quant import QTensor
from ..registry import REQUIRED, Cost, ShapeError, op
from ..shapes import dim
from ..types import TensorType, quantized
from .attention import want_index
from .core import want_dims, want_float
from .quantized import want_quant


SLOTS_SUFFIX = ".expert_slots"  # `<block>.expert_slots`: a MoE block's placement param


class SingleProcess:
    """The exchange of a world of one rank."""

    rank, world = 0, 1

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0)

    def all_to_all(self, send: list[torch.Tensor], recv_rows: list[int]) -> list[torch.Tensor]:
        return list(send)


SINGLE = SingleProcess()


def initial_slots(n_experts: int, n_slots: int) -> list[int]:
    """Slot p holds expert p, and a redundant slot p expert (p - E) mod E (spec §11)."""
    return [p if p < n_experts else (p - n_experts) % n_experts for p in range(n_slots)]


class Routing:
    """Where each group's rows of each expert go, from the placement and the row counts of every
    rank (`counts[s, e]`: rank s's rows of logical expert e)."""

    def __init__(self, slots: list[int], counts: torch.Tensor, ep: int, dp: int):
        self.world, self.dp, self.group = ep, dp, ep // dp
        self.per_rank = len(slots) // ep
        self.counts = counts.tolist()
        self.n_experts = counts.shape[1]
        replicas: dict[int, list[int]] = {}
        for p, e in enumerate(slots):
            replicas.setdefault(int(e), []).append(p)
        missing = [e for e in range(self.n_experts) if e not in replicas]
        if missing:
            raise ValueError(f"the expert placement holds no slot for expert {missing[0]}")
        # slot[g][e]: the slot serving group g's rows of expert e
        self.slot = [[replicas[e][g % len(replicas[e])] for e in range(self.n_experts)] for g in range(dp)]

    def owner(self, g: int, e: int) -> int:
        return self.slot[g][e] // self.per_rank

    def sender(self, g: int, e: int) -> int:
        return g * self.group + self.owner(g, e) % self.group

    def group_of(self, rank: int) -> int:
        return rank // self.group

    def received(self, rank: int) -> list[tuple[int, int, int]]:
        """(source rank, expert, rows) of each segment `rank` receives, in message order: by
        source, then expert."""
        out = []
        for s in range(self.world):
            g = self.group_of(s)
            out += [(s, e, self.counts[s][e]) for e in range(self.n_experts)
                    if self.sender(g, e) == s and self.owner(g, e) == rank]
        return out

    def local_order(self, rank: int) -> tuple[list[int], list[int]]:
        """The received segments regrouped by local slot (ascending), groups ascending within a
        slot: (segment indices into `received(rank)`, rows per local slot)."""
        segs = self.received(rank)
        order, per_slot = [], []
        for p in range(rank * self.per_rank, (rank + 1) * self.per_rank):
            n = 0
            for i, (s, e, rows) in enumerate(segs):
                if self.slot[self.group_of(s)][e] == p:
                    order.append(i)
                    n += rows
            per_slot.append(n)
        return order, per_slot

    def load(self) -> list[int]:
        """Rows per logical expert over all groups (each group counted once)."""
        return [sum(self.counts[g * self.group][e] for g in range(self.dp)) for e in range(self.n_experts)]


def _segments(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(x, sizes)) if sizes else []


def dispatch_rows(rows: QTensor, wt: torch.Tensor, pairs: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
                  *, ep: int, dp: int, exchange=SINGLE):
    """(rows_ep, weight_ep [R, 1], pairs_ep [R], offsets_ep [S + 1], counts [W, E]): the rows this
    rank's slots serve, grouped by local slot, with their routing weights; `pairs_ep` numbers them
    0..R-1 (row i's weight is weight_ep[i, 0]), so the weighted SwiGLU runs on them with k = 1."""
    if exchange.world != ep:
        raise ValueError(f"the plan's layout has {ep} expert-parallel ranks; this process group has {exchange.world}")
    offs = offsets.long()
    counts = exchange.all_gather((offs[1:] - offs[:-1]).to(torch.int32))
    route = Routing(slots.tolist(), counts, ep, dp)
    rank, g = exchange.rank, route.group_of(exchange.rank)
    width, sw = rows.data.shape[1], rows.scale.shape[1]
    weight = wt.float().flatten()[pairs.long()]
    # one byte row per pair: fp8 data | e8m0 scales | f32 routing weight
    packed = torch.cat([rows.data.view(torch.uint8), rows.scale.view(torch.uint8),
                        weight.unsqueeze(1).view(torch.uint8)], dim=1)
    per_expert = _segments(packed, (offs[1:] - offs[:-1]).tolist())
    send = []
    for dest in range(ep):
        mine = [per_expert[e] for e in range(route.n_experts) if route.sender(g, e) == rank and route.owner(g, e) == dest]
        send.append(torch.cat(mine) if mine else packed[:0])
    segs = route.received(rank)
    recv_rows = [sum(n for s, _, n in segs if s == src) for src in range(ep)]
    got = torch.cat(exchange.all_to_all(send, recv_rows))
    pieces = _segments(got, [n for _, _, n in segs])
    order, per_slot = route.local_order(rank)
    local = torch.cat([pieces[i] for i in order]) if order else got[:0]
    data = local[:, :width].contiguous().view(rows.data.dtype)
    scale = local[:, width:width + sw].contiguous().view(rows.scale.dtype)
    w = local[:, width + sw:].contiguous().view(torch.float32)
    n = local.shape[0]
    offsets_ep = torch.tensor([0] + per_slot, dtype=torch.long).cumsum(0).to(torch.int32)
    return QTensor(data, scale), w, torch.arange(n, dtype=torch.int32), offsets_ep, counts


def combine_rows(y: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor, pairs: torch.Tensor,
                 *, ep: int, dp: int, exchange=SINGLE) -> torch.Tensor:
    """The expert outputs of this rank's own pairs, back in its expert order: every rank returns
    the outputs of the segments it served to every member of their group."""
    route = Routing(slots.tolist(), counts, ep, dp)
    rank = exchange.rank
    segs = route.received(rank)
    order, _ = route.local_order(rank)
    served = _segments(y, [segs[i][2] for i in order])
    by_segment = dict(zip(order, served))  # received segment index -> its outputs
    where = {(route.group_of(s), e): i for i, (s, e, _) in enumerate(segs)}
    send = []
    for dest in range(ep):
        g = route.group_of(dest)
        mine = [by_segment[where[(g, e)]] for e in range(route.n_experts) if (g, e) in where]
        send.append(torch.cat(mine) if mine else y[:0])
    g = route.group_of(rank)
    own = route.counts[rank]
    recv_rows = [sum(own[e] for e in range(route.n_experts) if route.owner(g, e) == src) for src in range(ep)]
    got = exchange.all_to_all(send, recv_rows)
    by_owner = [_segments(t, [own[e] for e in range(route.n_experts) if route.owner(g, e) == src])
                for src, t in enumerate(got)]
    nxt = [0] * ep
    out = []
    for e in range(route.n_experts):
        src = route.owner(g, e)
        out.append(by_owner[src][nxt[src]])
        nxt[src] += 1
    result = torch.cat(out) if out else y.new_zeros((0, y.shape[1]))
    if result.shape[0] != pairs.shape[0]:
        raise ValueError(f"expert-parallel combine got {result.shape[0]} rows for {pairs.shape[0]} pairs")
    return result


def _check_layout(a):
    ep, dp = a["ep"], a["dp"]
    if ep < 2 or dp < 1 or ep % dp:
        raise ShapeError(f"expert parallelism needs ep >= 2 and dp dividing ep, got ep={ep} dp={dp}")


def _dispatch_rule(ins, a):
    _check_layout(a)
    rows = want_quant(ins[0], "rows", "fp8e4m3")
    want_float(ins[1], "routing weights")
    want_index(ins[2], "pair ids")
    want_index(ins[3], "expert offsets")
    slots = want_index(ins[4], "expert slots")
    if not isinstance(slots.shape[0], int) or slots.shape[0] % a["ep"]:
        raise ShapeError(f"{slots.shape[0]} expert slots do not divide over {a['ep']} ranks")
    # at most every group's rows of this rank's experts: dp times this rank's own pairs
    bound = dim(sympy.sympify(rows.shape[0]) * a["dp"])
    return [quantized("fp8e4m3", (bound, rows.shape[1]), "e8m0", rows.block), TensorType(dt.f32, (bound, 1)),
            TensorType(dt.i32, (bound,)), TensorType(dt.i32, (slots.shape[0] // a["ep"] + 1,)),
            TensorType(dt.i32, (a["ep"], ins[3].shape[0] - 1))]


@op("ep_dispatch", infer=_dispatch_rule,
    flops=lambda i, o, a: Cost(0, i[0].nbytes + i[1].nbytes, o[0].nbytes + o[1].nbytes),
    attrs={"ep": REQUIRED, "dp": REQUIRED}, n_inputs=5)
def ep_dispatch(rows, wt, pairs, offsets, slots, *, ep, dp):
    """See dispatch_rows (the reference needs the plan's ranks: the runtime passes their exchange)."""
    return dispatch_rows(rows, wt, pairs, offsets, slots, ep=ep, dp=dp)


def _combine_rule(ins, a):
    _check_layout(a)
    y = want_float(ins[0], "expert outputs")
    counts = want_index(ins[1], "row counts", rank=2)
    want_dims(counts.shape[0], a["ep"], "row counts vs ranks")
    want_index(ins[2], "expert slots")
    pairs = want_index(ins[3], "pair ids")
    return [TensorType(y.dtype, (pairs.shape[0], y.shape[1]))]


@op("ep_combine", infer=_combine_rule, flops=lambda i, o, a: Cost(0, i[0].nbytes, o[0].nbytes),
    attrs={"ep": REQUIRED, "dp": REQUIRED}, n_inputs=4)
def ep_combine(y, counts, slots, pairs, *, ep, dp):
    """See combine_rows."""
    return combine_rows(y, counts, slots, pairs, ep=ep, dp=dp)


EXCHANGE_OPS = {"ep_dispatch": dispatch_rows, "ep_combine": combine_rows}


# ---- Engram tables sharded by rows -----------------------------------------------------------

def table_rows_per_rank(rows: int, ranks: int) -> int:
    """Rank r holds table rows [r * per, (r + 1) * per) (the last rank's share padded)."""
    return -(-rows // ranks)


def gather_table_rows(cols: torch.Tensor, table: QTensor, *, ranks: int, rows: int, exchange=SINGLE) -> QTensor:
    """engram_gather over a table split by rows: each rank asks the owners of its columns' rows
    for them (one all-to-all of row ids, one of the fp8 rows and their scales back)."""
    if exchange.world != ranks:
        raise ValueError(f"the plan's Engram tables are split over {ranks} ranks; this process group has "
                         f"{exchange.world}")
    per = table_rows_per_rank(rows, ranks)
    n = cols.shape[0]
    idx = cols.long().flatten()
    owner = idx // per
    order = torch.sort(owner, stable=True).indices  # my requests grouped by owner
    asked = torch.zeros(ranks, dtype=torch.int32).scatter_add_(0, owner, torch.ones_like(owner, dtype=torch.int32))
    counts = exchange.all_gather(asked).tolist()  # counts[s][o]: rows rank s asks rank o for
    me = exchange.rank
    requests = exchange.all_to_all(list(torch.split(idx[order].to(torch.int32).unsqueeze(1), counts[me])),
                                   [counts[s][me] for s in range(ranks)])
    local = torch.cat(requests).long().flatten() - me * per
    width = table.data.shape[1]
    found = torch.cat([table.data[local].view(torch.uint8), table.scale[local].view(torch.uint8)], dim=1)
    back = exchange.all_to_all(list(torch.split(found, [counts[s][me] for s in range(ranks)])), counts[me])
    got = torch.cat(back)
    rows_out = torch.empty_like(got)
    rows_out[order] = got
    data = rows_out[:, :width].contiguous().view(table.data.dtype).reshape(n, -1)
    scale = rows_out[:, width:].contiguous().view(table.scale.dtype).reshape(n, -1)
    return QTensor(data, scale)


def _sharded_gather_rule(ins, a):
    cols = want_index(ins[0], "hash columns", rank=2)
    table = want_quant(ins[1], "table shard", "fp8e4m3")
    if table.rank != 2 or table.block != (1, 32):
        raise ShapeError(f"table must be fp8 [rows, dim] with per-row per-32 scales, got {table}")
    if a["ranks"] < 2 or table.shape[0] != table_rows_per_rank(a["rows"], a["ranks"]):
        raise ShapeError(f"a table of {a['rows']} rows over {a['ranks']} ranks has "
                         f"{table_rows_per_rank(a['rows'], a['ranks'])} rows per rank, got {table}")
    return [quantized("fp8e4m3", (cols.shape[0], cols.shape[1] * table.shape[1]), "e8m0", (1, 32))]


@op("engram_gather_sharded", infer=_sharded_gather_rule,
    flops=lambda i, o, a: Cost(0, i[0].nbytes + o[0].nbytes, o[0].nbytes), attrs={"ranks": REQUIRED, "rows": REQUIRED},
    n_inputs=2)
def engram_gather_sharded(cols, table, *, ranks, rows):
    """engram_gather of a table whose rows are spread over `ranks` ranks (see gather_table_rows)."""
    return gather_table_rows(cols, table, ranks=ranks, rows=rows)


EXCHANGE_OPS["engram_gather_sharded"] = gather_table_rows
