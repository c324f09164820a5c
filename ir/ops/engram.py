"""Engram n-gram memory (spec §4.3): n-gram ids with history, the multiplicative-XOR hash, the
table row gather, and the gate into each residual copy."""
from __future__ import annotations

import torch

from .. import dtypes as dt
from .. import numerics as nm
from ..quant import QTensor
from ..registry import REQUIRED, Cost, ShapeError, op
from ..types import TensorType, quantized
from .attention import ring_keep, seq_span, want_index, want_meta
from .core import want_dims, want_float, want_tensor
from .quantized import want_quant

DEAD = -1  # compressed id of an image token: it blocks n-grams through it


def block_ngrams(sources: torch.Tensor, source_pos: torch.Tensor, pad: int, dead: int = DEAD) -> torch.Tensor:
    """g[r] for look-backs r = 0..: a slot whose source is before the sequence start or DEAD is
    blocked, and so is every longer look-back; blocked slots take the compressed pad id."""
    unusable = (source_pos < 0) | (sources == dead)
    blocked = torch.cummax(unusable.long(), dim=-1).values.bool()
    return torch.where(blocked, torch.full_like(sources, pad), sources)


def hash_columns(grams: torch.Tensor, multipliers, primes, offsets, heads: int) -> torch.Tensor:
    """Table rows of every (n-gram size, head) column: acc = g0*m0 ^ g1*m1 ^ ..., then
    acc mod prime + offset per head; int64 throughout (every product < 2^63)."""
    p = grams.long() * torch.tensor(multipliers, dtype=torch.int64)
    primes = torch.tensor(primes, dtype=torch.int64).view(-1, heads)
    offsets = torch.tensor(offsets, dtype=torch.int64).view(-1, heads)
    acc = p[..., 0]
    cols = []
    for o in range(1, grams.shape[-1]):
        acc = torch.bitwise_xor(acc, p[..., o])
        cols.append(torch.remainder(acc.unsqueeze(-1), primes[o - 1]) + offsets[o - 1])
    return torch.cat(cols, dim=-1)


def _ngram_rule(ins, a):
    cids = want_index(ins[0], "compressed ids")
    hist = want_tensor(ins[1], "history")
    if hist.dtype != dt.i64 or hist.rank != 2:
        raise ShapeError(f"history must be i64 [slots, ring], got {hist}")
    want_meta(ins, 2)
    want_index(ins[4], "seq_slots")
    return [TensorType(dt.i64, (cids.shape[0], a["max_ngram"]))]


@op("engram_ngram_ids", infer=_ngram_rule, flops=lambda i, o, a: o[0].numel,
    attrs={"max_ngram": REQUIRED, "pad": REQUIRED}, n_inputs=5)
def engram_ngram_ids(cids, hist, positions, token_seq, seq_slots, *, max_ngram, pad):
    """g[t, r] = compressed id at position pos_t - r (r = 0..max_ngram-1), from this step's rows
    or from the history ring of earlier steps (slot pos mod ring length), blocked per §4.3c."""
    n = cids.shape[0]
    pos = positions.long()
    r = torch.arange(max_ngram, device=pos.device)
    src_pos = pos.unsqueeze(1) - r.unsqueeze(0)
    first, _ = seq_span(positions, token_seq)
    ring = hist.shape[1]
    slot = seq_slots.long()[token_seq.long()].unsqueeze(1)
    from_ring = hist[slot, src_pos.clamp_min(0) % ring]
    # a sequence's rows are contiguous and in position order: position p - r is row t - r
    step_row = (torch.arange(n, device=pos.device).unsqueeze(1) - r.unsqueeze(0)).clamp(0, max(n - 1, 0))
    from_step = cids.long()[step_row]
    src = torch.where(src_pos >= first.unsqueeze(1), from_step, from_ring)
    return block_ngrams(src, src_pos, pad)


def _hist_write_rule(ins, a):
    hist = want_tensor(ins[0], "history")
    want_index(ins[1], "compressed ids")
    want_meta(ins, 2)
    want_index(ins[4], "seq_slots")
    return [hist]


@op("engram_hist_write", infer=_hist_write_rule, flops=lambda i, o, a: Cost(0, i[1].nbytes, i[1].nbytes),
    inplace={0: 0}, n_inputs=5)
def engram_hist_write(hist, cids, positions, token_seq, seq_slots):
    out = hist.clone()
    keep = ring_keep(positions, token_seq, out.shape[1])
    out[seq_slots.long()[token_seq.long()][keep], positions.long()[keep] % out.shape[1]] = cids.long()[keep]
    return out


def _hash_rule(ins, a):
    g = want_tensor(ins[0], "n-gram ids")
    if len(a["multipliers"]) != g.shape[1] or len(a["primes"]) != (g.shape[1] - 1) * a["heads"] \
            or len(a["offsets"]) != len(a["primes"]):
        raise ShapeError("multipliers / primes / offsets do not match the n-gram size and heads")
    return [TensorType(dt.i64, (g.shape[0], len(a["primes"])))]


@op("engram_hash", infer=_hash_rule, flops=lambda i, o, a: 4 * o[0].numel,
    attrs={"multipliers": REQUIRED, "primes": REQUIRED, "offsets": REQUIRED, "heads": REQUIRED}, n_inputs=1)
def engram_hash(grams, *, multipliers, primes, offsets, heads):
    return hash_columns(grams, multipliers, primes, offsets, heads)


def _gather_rule(ins, a):
    cols = want_index(ins[0], "hash columns", rank=2)
    table = want_quant(ins[1], "table", "fp8e4m3")
    if table.rank != 2 or table.block != (1, 32):
        raise ShapeError(f"table must be fp8 [rows, dim] with per-row per-32 scales, got {table}")
    width = cols.shape[1] * table.shape[1]
    return [quantized("fp8e4m3", (cols.shape[0], width), "e8m0", (1, 32))]


def _gather_cost(ins, outs, a):
    return Cost(0, ins[0].nbytes + outs[0].nbytes, outs[0].nbytes)


@op("engram_gather", infer=_gather_rule, flops=_gather_cost, n_inputs=2)
def engram_gather(cols, table):
    """The fp8 rows of every column, concatenated in column order, with their ue8m0 scales: the
    re-quantisation of HF-REF's dequantised rows is lossless, so these feed the fp8 GEMM."""
    n = cols.shape[0]
    idx = cols.long().flatten()
    return QTensor(table.data[idx].reshape(n, -1), table.scale[idx].reshape(n, -1))


def _gate_rule(ins, a):
    if len(ins) not in (4, 5):
        raise ShapeError("engram_gate takes stream, kv, q_weight, k_weight [, token ids]")
    if (len(ins) == 5) != (a["image_token_id"] is not None):
        raise ShapeError("token ids go with image_token_id")
    r, kv, qw, kw = (want_float(t, n) for t, n in zip(ins, ("stream", "kv", "q_weight", "k_weight")))
    if r.rank != 3:
        raise ShapeError(f"stream must be [n, C, H], got {r}")
    want_dims(kv.shape[1], (r.shape[1] + 1) * r.shape[2], "kv width vs (C+1)*H")
    want_dims(qw.shape[0], r.shape[1], "q_weight rows vs copies")
    want_dims(kw.shape[1], r.shape[2], "k_weight width vs H")
    return [r]


@op("engram_gate", infer=_gate_rule, flops=lambda i, o, a: 8 * i[0].numel,
    attrs={"eps": REQUIRED, "image_token_id": None})
def engram_gate(r, kv, q_weight, k_weight, ids=None, *, eps, image_token_id=None):
    """R[c] += sigmoid(signed sqrt of the normalised (q_w * k_w)-weighted dot of R[c] and key[c])
    * value; per-copy normalisation over H (spec §4.3e), fp32 math, result in the stream dtype."""
    n, c, h = r.shape
    key = kv[:, : c * h].float().view(n, c, h)
    val = kv[:, c * h:].float()
    rf = r.float()
    w = q_weight.float() * k_weight.float()
    dot = nm.sum32(rf * w * key, -1) * nm.rsqrt32(nm.mean_sq32(rf, keepdim=False) + eps) \
        * nm.rsqrt32(nm.mean_sq32(key, keepdim=False) + eps) * h ** -0.5
    gate = nm.sigmoid32(torch.copysign(torch.sqrt(dot.abs().clamp_min(1e-6)), dot))
    if ids is not None:  # image tokens take no part in Engram: their gate is 0
        gate = gate.masked_fill((ids.long() == image_token_id).unsqueeze(1), 0.0)
    return (rf + gate.unsqueeze(-1) * val.unsqueeze(1)).to(r.dtype)


def _lookup_rule(ins, a):
    want_index(ins[0], "table")
    ids = want_index(ins[1], "ids")
    return [TensorType(dt.i64, ids.shape)]


@op("lookup", infer=_lookup_rule, flops=lambda i, o, a: 0, attrs={"dead_ids": ()}, n_inputs=2)
def lookup(table, ids, *, dead_ids):
    """out[t] = table[ids[t]] for an integer table (the Engram token map); ids outside it and
    `dead_ids` (the image token) -> DEAD."""
    ids = ids.long()
    inside = (ids >= 0) & (ids < table.shape[0])
    for d in dead_ids:
        inside &= ids != d
    return torch.where(inside, table.long()[ids.clamp(0, table.shape[0] - 1)], DEAD)
