"""Attention of V4.1 (spec §3.2, §4.4, §5.3): RoPE, the window ring, the compressors and their
caches, the two-level indexer, and sparse attention with the sink.

Batch layout shared by every op here: a step holds `num_tokens` rows from `num_seqs` sequences;
`token_seq[t]` is the sequence of row t (rows of one sequence are contiguous and in position
order), `positions[t]` its absolute position, `seq_slots[s]` the state slot of sequence s (window
rings, compressor state), `block_table[s]` the pages of its compressed caches (a page holds
`page_entries` compressed entries). A compressed entry c of ratio r is completed by the row at
position c*r + r - 1; ops give per-row outputs and the cache writers keep the completing rows, so
every shape stays static.

Tie rule (spec notes §4.4d, §16.4): every top-k here picks the highest score and, among equal
scores, the LOWEST position (or block id) first. `stable_topk` is that one rule.
"""
from __future__ import annotations

import math

import torch

from .. import dtypes as dt
from .. import numerics as nm
from .. import shapes as sh
from ..quant import QTensor
from ..registry import REQUIRED, Cost, ShapeError, op
from ..types import TensorType
from .core import want_dims, want_float, want_tensor
from .quantized import dequant_value, want_quant


# ---- shared helpers -----------------------------------------------------------------------------

def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim; equal scores: lowest index first."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]


def seq_rows(token_seq: torch.Tensor):
    """(sequence index, row indices) for each sequence present, in order."""
    ts = token_seq.long()
    for s in torch.unique_consecutive(ts).tolist():
        yield s, (ts == s).nonzero().squeeze(-1)


def want_index(t, what: str, rank: int = 1) -> TensorType:
    t = want_tensor(t, what)
    if t.dtype not in (dt.i32, dt.i64) or t.rank != rank:
        raise ShapeError(f"{what} must be a rank-{rank} i32/i64 tensor, got {t}")
    return t


def want_meta(ins, start: int, names=("positions", "token_seq")):
    """Check the per-row metadata operands that follow the data operands."""
    for i, n in enumerate(names):
        want_index(ins[start + i], n)
    want_dims(ins[start].shape[0], ins[start + 1].shape[0], "positions vs token_seq rows")


def yarn_freqs(rope_dim: int, theta: float, yarn) -> torch.Tensor:
    """f_i = theta^(-2i/d), smoothed towards f_i/factor by the YaRN ramp when `yarn` is given
    as (factor, original_len, beta_fast, beta_slow) (spec §3.2; no magnitude scaling)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn:
        factor, orig, beta_fast, beta_slow = yarn

        def corr(rot):
            return rope_dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


def rotate_tail(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float, yarn, inverse=False):
    """Interleaved (GPT-J) rotation of the last `rope_dim` dims at integer positions `pos`
    (one per leading row), angles and products in fp32, result in x's dtype."""
    freqs = yarn_freqs(rope_dim, theta, yarn)
    ang = pos.float().unsqueeze(1) * freqs.unsqueeze(0)  # fp32 angles
    if inverse:
        ang = -ang
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = torch.cos(ang.double()).float().view(shape), torch.sin(ang.double()).float().view(shape)
    pairs = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    rot = torch.stack([re * cos - im * sin, re * sin + im * cos], -1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rot.to(x.dtype)], dim=-1)


def seq_span(positions: torch.Tensor, token_seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the first and the newest position its sequence has in this step. Scatter
    reductions, no host synchronisation (the references also run inside CUDA graph captures);
    sequence indices are below the row count (every sequence before the last with rows has rows)."""
    pos, ts = positions.long(), token_seq.long()
    n = max(pos.shape[0], 1)
    newest = torch.full((n,), -1, dtype=torch.long, device=pos.device).scatter_reduce(0, ts, pos, "amax")
    first = torch.full((n,), 2**62, dtype=torch.long, device=pos.device).scatter_reduce(0, ts, pos, "amin")
    return first[ts], newest[ts]


def ring_keep(positions: torch.Tensor, token_seq: torch.Tensor, ring_len: int) -> torch.Tensor:
    """Rows that survive in a ring of `ring_len` slots indexed by position: the newest ring_len
    positions of each sequence (a chunk longer than the ring would overwrite its own rows, and
    tensor writes with repeated indices keep an unspecified one)."""
    return positions.long() > seq_span(positions, token_seq)[1] - ring_len


def completes_entry(pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """Rows that complete a compressed entry: entry (pos+1)//r - 1 ends at this position."""
    return (pos + 1) % ratio == 0


def page_rows(block_table_row: torch.Tensor, entries: torch.Tensor, page_entries: int):
    """(page, row-in-page) of compressed entries of one sequence."""
    return block_table_row.long()[entries // page_entries], entries % page_entries


def window_keys(kv_step: torch.Tensor, ring: QTensor, first: torch.Tensor, slot: torch.Tensor,
                pos: torch.Tensor, rows: slice, window: int):
    """fp32 window keys [rows, window, D] and their validity [rows, window] for a range of rows.

    Key j of row t is position kp = pos_t - window + 1 + j: from this step's rows when the step
    holds it (kp >= the first position of t's sequence in the step; a sequence's rows are
    contiguous and in position order, so kp is row t - (pos_t - kp)), else from the ring (slot
    kp mod ring size, as earlier steps left it). `first`, `slot`, `pos`: per row of the step.
    """
    t = torch.arange(rows.start, rows.stop, device=pos.device).unsqueeze(1)
    p = pos[rows].unsqueeze(1)
    kpos = p - window + 1 + torch.arange(window, device=pos.device).unsqueeze(0)
    ring_len = ring.data.shape[1]
    s, r = slot[rows].unsqueeze(1), kpos.clamp_min(0) % ring_len
    ring_keys = dequant_value(QTensor(ring.data[s, r], ring.scale[s, r]))
    step_row = (t - (p - kpos)).clamp(0, max(kv_step.shape[0] - 1, 0))
    from_step = (kpos >= first[rows].unsqueeze(1)).unsqueeze(-1)
    return torch.where(from_step, kv_step[step_row], ring_keys), kpos >= 0


def attend_with_sink(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float):
    """o_h = sum_j bf16(exp(s_j - m)) k_j / (sum_j exp(s_j - m) + exp(sink_h - m)), V = K, fp32:
    the probabilities rounded to bf16 before P.V where the official kernel rounds them, the
    denominator of the unrounded ones; m is the row's max, where that kernel (and ours) round each
    key block against its running max, which differs by one bf16 rounding of a term (ir/numerics.py).

    q [rows, heads, D]; keys [rows, nk, D]; valid [rows, nk]."""
    s = torch.einsum("rhd,rkd->rhk", q.double(), keys.double()).float() * scale
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # the row's max; a row always sees its own key
    p = nm.exp32(s - m)
    denom = nm.sum32(p, -1, keepdim=True) + nm.exp32(sink.float().view(1, -1, 1) - m)
    return torch.einsum("rhk,rkd->rhd", nm.bf16r(p).double(), keys.double()).float() / denom


def _rows(ins_t) -> sh.Dim:
    return ins_t.shape[0]


# ---- RoPE ---------------------------------------------------------------------------------------

def _rope_rule(ins, a):
    x = want_float(ins[0], "input")
    want_index(ins[1], "positions")
    want_dims(x.shape[0], ins[1].shape[0], "rows vs positions")
    if a["rope_dim"] % 2 or not isinstance(x.shape[-1], int) or a["rope_dim"] > x.shape[-1]:
        raise ShapeError(f"rope_dim {a['rope_dim']} must be even and fit the last dim of {x}")
    if a["yarn"] is not None and len(a["yarn"]) != 4:
        raise ShapeError("yarn is (factor, original_len, beta_fast, beta_slow) or null")
    return [x]


@op("rope", infer=_rope_rule, flops=lambda i, o, a: 6 * i[0].numel * a["rope_dim"] // i[0].shape[-1],
    attrs={"rope_dim": REQUIRED, "theta": REQUIRED, "yarn": None, "inverse": False, "pos_offset": 0},
    n_inputs=2)
def rope(x, positions, *, rope_dim, theta, yarn, inverse, pos_offset):
    """Rotate the last `rope_dim` dims at positions + pos_offset (a compressed entry completed at
    position p sits at p + 1 - r, spec §3.2); `inverse` de-rotates the attention output tail."""
    return rotate_tail(x, positions.long() + pos_offset, rope_dim, theta, yarn, inverse)


# ---- window ring --------------------------------------------------------------------------------

def _swa_write_rule(ins, a):
    ring = want_quant(ins[0], "ring", "fp8e4m3")
    kv = want_quant(ins[1], "rows", "fp8e4m3")
    if ring.rank != 3 or kv.rank != 2:
        raise ShapeError(f"expected ring [slots, len, D] and rows [n, D], got {ring} and {kv}")
    want_dims(ring.shape[2], kv.shape[1], "ring width vs row width")
    want_meta(ins, 2)
    want_index(ins[4], "seq_slots")
    return [ring]


def _write_cost(ins, outs, a):
    return Cost(0, ins[1].nbytes, ins[1].nbytes)


@op("swa_write", infer=_swa_write_rule, flops=_write_cost, inplace={0: 0}, n_inputs=5)
def swa_write(ring, kv, positions, token_seq, seq_slots):
    """Write each row's window key into ring slot `pos mod ring length` of its sequence."""
    data, scale = ring.data.clone(), ring.scale.clone()
    keep = ring_keep(positions, token_seq, data.shape[1])
    slots = seq_slots.long()[token_seq.long()][keep]
    idx = positions.long()[keep] % data.shape[1]
    data[slots, idx] = kv.data[keep]
    scale[slots, idx] = kv.scale[keep]
    return QTensor(data, scale)


def _window_attn_rule(ins, a):
    q = want_float(ins[0], "q")
    kv = want_quant(ins[1], "step keys", "fp8e4m3")
    ring = want_quant(ins[2], "ring", "fp8e4m3")
    sink = want_float(ins[3], "sink")
    if q.rank != 3:
        raise ShapeError(f"q must be [n, heads, D], got {q}")
    want_dims(q.shape[2], kv.shape[1], "q width vs key width")
    want_dims(ring.shape[2], kv.shape[1], "ring width vs key width")
    want_dims(sink.shape[0], q.shape[1], "sink entries vs heads")
    want_meta(ins, 4)
    want_index(ins[6], "seq_slots")
    return [q]


def _attn_flops(ins, outs, a):
    keys = a["window"] + a.get("topk", 0)
    return 4 * outs[0].numel * keys


# the attention ops' optional RoPE around them (passes/fuse.py fuse_attention_rope): q's tail
# rotated at each row's position on the way in, the output's de-rotated on the way out
ROPE_ATTRS = {"rope_dim": 0, "rope_theta": 0.0, "rope_yarn": None}


def rope_around(q, positions, rope_dim, rope_theta, rope_yarn, attend):
    """attend(q) between the `rope` op of q and the inverse `rope` op of the output, with the
    same functions (rotate_tail), so a fused graph computes the same bits as the unfused one."""
    if not rope_dim:
        return attend(q)
    pos = positions.long()
    o = attend(rotate_tail(q, pos, rope_dim, rope_theta, rope_yarn))
    return rotate_tail(o, pos, rope_dim, rope_theta, rope_yarn, inverse=True)


@op("window_attn", infer=_window_attn_rule, flops=_attn_flops, attrs={"window": REQUIRED, **ROPE_ATTRS}, n_inputs=7)
def window_attn(q, kv, ring, sink, positions, token_seq, seq_slots, *, window, rope_dim=0, rope_theta=0.0,
                rope_yarn=None):
    """Attention over the last `window` keys only (ratio-0 layers), with the sink."""
    return sparse_attn(q, kv, ring, None, None, sink, positions, token_seq, seq_slots, None,
                       window=window, ratio=0, topk=0, rope_dim=rope_dim, rope_theta=rope_theta, rope_yarn=rope_yarn)


# ---- compressors --------------------------------------------------------------------------------

def _pool_rule(ins, a):
    l, s = want_float(ins[0], "L"), want_float(ins[1], "S")
    st = want_float(ins[2], "state")
    if l.dtype != dt.f32 or s.dtype != dt.f32 or st.dtype != dt.f32:
        raise ShapeError("compressor pooling works in f32")
    if st.rank != 4 or st.shape[2] != 2:
        raise ShapeError(f"state must be [slots, ring, 2, D], got {st}")
    want_dims(st.shape[3], l.shape[1], "state width vs L width")
    want_meta(ins, 3)
    want_index(ins[5], "seq_slots")
    return [l]


@op("compress_pool", infer=_pool_rule, flops=lambda i, o, a: 6 * i[0].numel, attrs={"ratio": REQUIRED},
    n_inputs=6)
def compress_pool(l, s, state, positions, token_seq, seq_slots, *, ratio):
    """z_c[d] = sum over the r tokens of entry c of softmax_i(S[i, d]) * L[i, d] (spec §4.4c); the
    row completing entry c holds it, other rows hold zeros. Tokens of the group that arrived in an
    earlier step are read from the fp32 state ring (slot pos mod ring length)."""
    n = l.shape[0]
    ring_len = state.shape[1]
    pos, ts = positions.long(), token_seq.long()
    first, _ = seq_span(positions, token_seq)
    i = torch.arange(ratio, device=pos.device)
    gpos = pos.unsqueeze(1) - ratio + 1 + i  # [n, r]: the group of each row's entry
    in_step = (gpos >= first.unsqueeze(1)).unsqueeze(-1)
    # a sequence's rows are contiguous and in position order: position g is row t - (pos_t - g)
    step_row = (torch.arange(n, device=pos.device).unsqueeze(1) - ratio + 1 + i).clamp(0, max(n - 1, 0))
    slot = seq_slots.long()[ts].unsqueeze(1)
    li = torch.where(in_step, l[step_row].float(), state[slot, gpos.clamp_min(0) % ring_len, 0])
    si = torch.where(in_step, s[step_row].float(), state[slot, gpos.clamp_min(0) % ring_len, 1])
    z = (nm.softmax32(si, 1) * li).sum(1)
    return torch.where(completes_entry(pos, ratio).unsqueeze(1), z, torch.zeros_like(z))


def _state_write_rule(ins, a):
    st = want_float(ins[0], "state")
    want_float(ins[1], "L")
    want_float(ins[2], "S")
    want_meta(ins, 3)
    want_index(ins[5], "seq_slots")
    return [st]


@op("compress_state_write", infer=_state_write_rule, flops=lambda i, o, a: Cost(0, 2 * i[1].nbytes, 2 * i[1].nbytes),
    inplace={0: 0}, n_inputs=6)
def compress_state_write(state, l, s, positions, token_seq, seq_slots):
    """Keep every row's (L, S) in the fp32 state ring, so a group open at the end of the step can
    be completed by a later one."""
    out = state.clone()
    keep = ring_keep(positions, token_seq, out.shape[1])
    slots = seq_slots.long()[token_seq.long()][keep]
    idx = positions.long()[keep] % out.shape[1]
    out[slots, idx, 0] = l.float()[keep]
    out[slots, idx, 1] = s.float()[keep]
    return out


def _compressed_write_rule(ins, a):
    cache = want_quant(ins[0], "cache", "fp4e2m1")
    rows = want_quant(ins[1], "rows", "fp4e2m1")
    if cache.rank != 3 or rows.rank != 2:
        raise ShapeError(f"expected cache [pages, entries, D] and rows [n, D], got {cache} and {rows}")
    want_dims(cache.shape[2], rows.shape[1], "cache width vs row width")
    if cache.scale.dtype != rows.scale.dtype:
        raise ShapeError("cache and rows have different scale formats")
    want_meta(ins, 2)
    want_index(ins[4], "block_table", rank=2)
    return [cache]


@op("compressed_write", infer=_compressed_write_rule, flops=_write_cost, attrs={"ratio": REQUIRED},
    inplace={0: 0}, n_inputs=5)
def compressed_write(cache, rows_q, positions, token_seq, block_table, *, ratio):
    """Write the entries completed this step into the paged cache (entry c -> page
    block_table[s][c // page_entries], row c % page_entries)."""
    data, scale = cache.data.clone(), cache.scale.clone()
    e = data.shape[1]
    for seq, rows in seq_rows(token_seq):
        pos = positions.long()[rows]
        done = completes_entry(pos, ratio)
        if not done.any():
            continue
        entries = (pos[done] + 1) // ratio - 1
        page, row = page_rows(block_table[seq], entries, e)
        data[page, row] = rows_q.data[rows[done]]
        scale[page, row] = rows_q.scale[rows[done]]
    return QTensor(data, scale)


# ---- indexer ------------------------------------------------------------------------------------

def _scores_rule(ins, a):
    qi = want_quant(ins[0], "index q", "fp4e2m1")
    w = want_float(ins[1], "head weights")
    ik = want_quant(ins[2], "index-K cache", "fp4e2m1")
    if qi.rank != 3 or ik.rank != 3:
        raise ShapeError(f"expected index q [n, heads, dim] and cache [pages, entries, dim], got {qi}, {ik}")
    want_dims(qi.shape[2], ik.shape[2], "index q dim vs index-K dim")
    want_dims(w.shape[1], qi.shape[1], "head weights vs index heads")
    want_meta(ins, 3)
    bt = want_index(ins[5], "block_table", rank=2)
    return [TensorType(dt.f32, (qi.shape[0], sh.dim(bt.shape[1] * ik.shape[1])))]


@op("indexer_scores", infer=_scores_rule,
    flops=lambda i, o, a: 2 * o[0].numel * i[0].shape[1] * (i[0].shape[2] + 1),
    attrs={"ratio": REQUIRED}, n_inputs=6)
def indexer_scores(qi, w, ik, positions, token_seq, block_table, *, ratio, chunk: int = 32):
    """score[t, c] = sum_h w[t, h] * relu(qI[t, h] . kI[c]) for visible entries c < (pos+1)//r,
    -inf elsewhere (spec §4.4d), from the fake-quantised fp4 q and k, in bf16 arithmetic as the
    official model's bf16 einsum, product and sum (ir/numerics.py): each dot rounded to bf16, each
    weighted term rounded to bf16, the head sum rounded to bf16; bf16 values held in fp32. The
    fp4 x fp4 dot products are exact in fp64, so rows are scored in chunks of `chunk` (bounded
    memory) with no dependence on how rows are grouped."""
    n = qi.data.shape[0]
    pe = ik.data.shape[1]
    cap = block_table.shape[1] * pe
    dev = qi.data.device
    vis = (positions.long() + 1) // ratio
    q = dequant_value(qi)
    c = torch.arange(cap, device=dev)
    bt = block_table.long()[token_seq.long()]  # [n, pages] of each row's sequence
    out = torch.full((n, cap), float("-inf"), device=dev)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        page = bt[r0:r1][:, c // pe]  # [R, cap]; unused (-1) pages read garbage that is masked below
        k = dequant_value(QTensor(ik.data[page, c % pe], ik.scale[page, c % pe]))  # [R, cap, dim]
        dots = nm.bf16r(torch.einsum("rhd,rcd->rhc", q[r0:r1].double(), k.double()).float())
        sc = nm.bf16r(nm.sum32(nm.bf16r(w[r0:r1].float().unsqueeze(-1) * torch.relu(dots)), 1))
        out[r0:r1] = sc.masked_fill(c.unsqueeze(0) >= vis[r0:r1].unsqueeze(1), float("-inf"))
    return out


def _cand_rule(ins, a):
    score = want_float(ins[0], "scores")
    want_meta(ins, 1)
    if not isinstance(score.shape[1], int) and a["block_size"] <= 0:
        raise ShapeError("block_size must be positive")
    return [TensorType(dt.i32, (score.shape[0], a["topk_blocks"]))]


@op("candidate_blocks", infer=_cand_rule, flops=lambda i, o, a: 2 * i[0].numel,
    attrs={"ratio": REQUIRED, "block_size": REQUIRED, "topk_blocks": REQUIRED}, n_inputs=3)
def candidate_blocks(score, positions, token_seq, *, ratio, block_size, topk_blocks):
    """The candidate pool of the candidate-source layer (spec §4.4e): block score = max over 8
    consecutive entries, the block of the newest visible entry pinned to +inf, the top blocks
    kept (unreachable -inf picks dropped); ascending block ids, -1 padded."""
    n, cap = score.shape
    nblocks = -(-cap // block_size)
    padded = torch.full((n, nblocks * block_size), float("-inf"))
    padded[:, :cap] = score
    bscore = padded.view(n, nblocks, block_size).amax(-1)
    vis = (positions.long() + 1) // ratio
    has = vis > 0
    newest = ((vis - 1).clamp_min(0) // block_size)
    pinned = torch.where(has.unsqueeze(1), float("inf"), bscore.gather(1, newest.unsqueeze(1)))
    bscore = bscore.scatter(1, newest.unsqueeze(1), pinned)
    k = min(topk_blocks, nblocks)
    top = stable_topk(bscore, k)
    keep = torch.gather(bscore, 1, top) > float("-inf")
    top = torch.where(keep, top, torch.full_like(top, nblocks))  # drop, then sort to the end
    top = torch.sort(top, dim=-1).values
    out = torch.full((n, topk_blocks), -1, dtype=torch.int32)
    out[:, :k] = torch.where(top == nblocks, -1, top).to(torch.int32)
    return out


def _cand_mask_rule(ins, a):
    score = want_float(ins[0], "scores")
    want_index(ins[1], "candidate blocks", rank=2)
    return [score]


@op("candidate_mask", infer=_cand_mask_rule, flops=lambda i, o, a: i[0].numel,
    attrs={"block_size": REQUIRED}, n_inputs=2)
def candidate_mask(score, blocks, *, block_size):
    """REINDEX layers score only inside the candidate pool: -inf outside the kept blocks."""
    n, cap = score.shape
    inside = torch.zeros(n, -(-cap // block_size) + 1, dtype=torch.bool)
    b = blocks.long()
    inside.scatter_(1, torch.where(b < 0, inside.shape[1] - 1, b), True)
    inside = inside[:, :-1].repeat_interleave(block_size, dim=1)[:, :cap]
    return score.masked_fill(~inside, float("-inf"))


def _topk_rule(ins, a):
    score = want_float(ins[0], "scores")
    want_meta(ins, 1)
    return [TensorType(dt.i32, (score.shape[0], a["k"]))]


@op("topk_select", infer=_topk_rule, flops=lambda i, o, a: 2 * i[0].numel, attrs={"ratio": REQUIRED, "k": REQUIRED},
    n_inputs=3)
def topk_select(score, positions, token_seq, *, ratio, k):
    """Top-k compressed entries per row (spec §4.4d): top min(k, clen) of the sequence's clen
    entries, re-sorted ascending, entries not visible to the row replaced by -1, -1 padded.

    Computed over every column at once: columns past the sequence's clen are -inf, and a stable
    top-k ranks -inf columns by index, so the first min(k, clen) picks are the sequence's own and
    any later pick is >= clen >= the row's visible count, which the -1 rule already drops."""
    n, cap = score.shape
    _, newest = seq_span(positions, token_seq)
    clen = (newest + 1) // ratio
    cols = torch.arange(cap, device=score.device).unsqueeze(0)
    kk = min(k, cap)
    top = torch.sort(stable_topk(score.masked_fill(cols >= clen.unsqueeze(1), float("-inf")), kk), dim=-1).values
    vis = ((positions.long() + 1) // ratio).unsqueeze(1)
    out = torch.full((n, k), -1, dtype=torch.int32, device=score.device)
    out[:, :kk] = torch.where(top >= vis, -1, top).to(torch.int32)
    return out


# ---- sparse attention ---------------------------------------------------------------------------

def _sparse_attn_rule(ins, a):
    q = want_float(ins[0], "q")
    kv = want_quant(ins[1], "step keys", "fp8e4m3")
    ring = want_quant(ins[2], "ring", "fp8e4m3")
    ckv = want_quant(ins[3], "compressed cache", "fp4e2m1")
    top = want_index(ins[4], "top-k", rank=2)
    sink = want_float(ins[5], "sink")
    if q.rank != 3:
        raise ShapeError(f"q must be [n, heads, D], got {q}")
    for other, what in ((kv.shape[1], "key"), (ring.shape[2], "ring"), (ckv.shape[2], "compressed cache")):
        want_dims(q.shape[2], other, f"q width vs {what} width")
    want_dims(top.shape[0], q.shape[0], "top-k rows vs q rows")
    want_dims(sink.shape[0], q.shape[1], "sink entries vs heads")
    want_meta(ins, 6)
    want_index(ins[8], "seq_slots")
    want_index(ins[9], "block_table", rank=2)
    return [q]


@op("sparse_attn", infer=_sparse_attn_rule, flops=_attn_flops,
    attrs={"window": REQUIRED, "ratio": REQUIRED, "topk": REQUIRED, **ROPE_ATTRS}, n_inputs=10)
def sparse_attn(q, kv, ring, ckv, top, sink, positions, token_seq, seq_slots, block_table, *, window, ratio, topk,
                rope_dim=0, rope_theta=0.0, rope_yarn=None, chunk: int = 64):
    """Attention of each row over its window keys and the compressed entries of its top-k list
    (not de-duplicated), K = V, the sink in the denominator only, scale D^-1/2 (spec §4.4f).
    `kv` holds this step's window keys; `ring` is the ring as earlier steps left it. Rows are
    independent: they are taken `chunk` at a time (bounded memory), with no host work. With
    `rope_dim`, q's tail is rotated first and the output's de-rotated last (rope_around)."""
    return rope_around(q, positions, rope_dim, rope_theta, rope_yarn,
                       lambda q: _sparse_attn(q, kv, ring, ckv, top, sink, positions, token_seq, seq_slots,
                                              block_table, window, chunk))


def _sparse_attn(q, kv, ring, ckv, top, sink, positions, token_seq, seq_slots, block_table, window, chunk):
    n, heads, d = q.shape
    out = torch.zeros(n, heads, d, device=q.device)
    kv_step = dequant_value(kv)
    pos, ts = positions.long(), token_seq.long()
    first, _ = seq_span(positions, token_seq)
    slot = seq_slots.long()[ts]
    for r0 in range(0, n, chunk):
        rows = slice(r0, min(n, r0 + chunk))
        keys, valid = window_keys(kv_step, ring, first, slot, pos, rows, window)
        if ckv is not None:
            sel = top[rows].long()
            pe = ckv.data.shape[1]
            page = block_table.long()[ts[rows]].gather(1, sel.clamp_min(0) // pe)
            e = sel.clamp_min(0) % pe
            keys = torch.cat([keys, dequant_value(QTensor(ckv.data[page, e], ckv.scale[page, e]))], dim=1)
            valid = torch.cat([valid, sel >= 0], dim=1)
        out[rows] = attend_with_sink(q[rows], keys, valid, sink, d ** -0.5)
    return out.to(q.dtype)


# ---- DSpark block attention ---------------------------------------------------------------------

def _block_attn_rule(ins, a):
    q = want_float(ins[0], "q")
    kv = want_quant(ins[1], "block keys", "fp8e4m3")
    ring = want_quant(ins[2], "ring", "fp8e4m3")
    want_dims(q.shape[2], kv.shape[1], "q width vs key width")
    want_dims(ring.shape[2], kv.shape[1], "ring width vs key width")
    want_float(ins[3], "sink")
    want_meta(ins, 4)
    want_index(ins[6], "seq_slots")
    return [q]


@op("dspark_block_attn", infer=_block_attn_rule, flops=_attn_flops, attrs={"window": REQUIRED, **ROPE_ATTRS},
    n_inputs=7)
def dspark_block_attn(q, kv, ring, sink, positions, token_seq, seq_slots, *, window, rope_dim=0, rope_theta=0.0,
                      rope_yarn=None):
    """Draft-block attention (spec §5.3): every row of a sequence's block sees the valid ring
    entries (the newest `window` main keys, positions <= P = first block position - 1) and all
    keys of its own block (bidirectional inside the block); `rope_dim` as sparse_attn's."""
    return rope_around(q, positions, rope_dim, rope_theta, rope_yarn,
                       lambda q: _dspark_block_attn(q, kv, ring, sink, positions, token_seq, seq_slots, window))


def _dspark_block_attn(q, kv, ring, sink, positions, token_seq, seq_slots, window):
    n, heads, d = q.shape
    out = torch.zeros(n, heads, d)
    block_keys = dequant_value(kv)
    ring_len = ring.data.shape[1]
    for seq, rows in seq_rows(token_seq):
        p_last = int(positions[rows[0]]) - 1
        slot = int(seq_slots[seq])
        kpos = p_last - window + 1 + torch.arange(window)
        ring_vals = dequant_value(QTensor(ring.data[slot], ring.scale[slot]))
        keys = torch.cat([ring_vals[kpos.clamp_min(0) % ring_len], block_keys[rows]], dim=0)
        valid = torch.cat([kpos >= 0, torch.ones(len(rows), dtype=torch.bool)])
        kk = keys.unsqueeze(0).expand(len(rows), -1, -1)
        out[rows] = attend_with_sink(q[rows], kk, valid.unsqueeze(0).expand(len(rows), -1), sink, d ** -0.5)
    return out.to(q.dtype)
