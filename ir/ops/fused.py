"""Fused ops: what the fusion rules and the MoE-dispatch lowering produce. Each is defined as the
composition of the primitive ops it replaces, so a rewrite keeps the interpreter's output by
construction and a kernel template has one reference to be checked against."""
from __future__ import annotations

import torch

from .. import dtypes as dt
from .. import quant as q
from ..quant import QTensor
from ..registry import REQUIRED, Cost, ShapeError, op
from ..types import TensorType, quantized
from . import attention as at
from . import core, mhc, moe
from .core import want_dims, want_float, want_tensor
from .quantized import expert_weight, grouped_linear, last_dim_block, want_quant


def _infer(name, ins, attrs):
    from ..registry import get_op

    return get_op(name).infer_types(ins, attrs)


# ---- norm + quant -------------------------------------------------------------------------------

def _norm_quant_rule(ins, a):
    (x,) = _infer("rms_norm", ins, {"eps": a["eps"]})
    return [last_dim_block(x, "fp8e4m3", "e8m0", a["block"])]


@op("rms_norm_quant_fp8", infer=_norm_quant_rule, flops=lambda i, o, a: 7 * i[0].numel,
    attrs={"eps": REQUIRED, "block": 32}, n_inputs=2)
def rms_norm_quant_fp8(x, w, *, eps, block):
    """RMSNorm, then per-32 fp8 activation quantisation of its output."""
    return q.quant_fp8_32(core.rms_norm(x, w, eps=eps), block)


# ---- mHC ----------------------------------------------------------------------------------------

def _hc_pre_rule(ins, a):
    r, fn, scale, base, pre_in, norm_w = ins
    mix = _infer("hc_mix_gemm", [r, fn], {"eps": a["eps"]})
    pre, post, m = _infer("hc_sinkhorn", [mix[0], scale, base],
                          {"copies": a["copies"], "iters": a["iters"], "eps": a["hc_eps"], "post_mult": a["post_mult"]})
    (x,) = _infer("hc_collapse", [r, pre_in], {})
    (x,) = _infer("rms_norm", [x, norm_w], {"eps": a["eps"]})
    return [x, pre, post, m]


@op("hc_pre", infer=_hc_pre_rule,
    flops=lambda i, o, a: 2 * i[0].numel * (i[1].shape[0] + 2) + 4 * o[0].numel,
    attrs={"eps": REQUIRED, "copies": REQUIRED, "iters": REQUIRED, "hc_eps": REQUIRED, "post_mult": 2.0},
    n_inputs=6)
def hc_pre(r, fn, scale, base, pre_in, norm_w, *, eps, copies, iters, hc_eps, post_mult):
    """A sub-layer's entry: its mixes from the stream (mix GEMM + Sinkhorn), and its normalised
    input = RMSNorm(collapse of the stream with the previous sub-layer's pre)."""
    raw = mhc.hc_mix_gemm(r, fn, eps=eps)
    pre, post, m = mhc.hc_sinkhorn(raw, scale, base, copies=copies, iters=iters, eps=hc_eps, post_mult=post_mult)
    x = core.rms_norm(mhc.hc_collapse(r, pre_in), norm_w, eps=eps)
    return x, pre, post, m


def _hc_collapse_norm_rule(ins, a):
    (c,) = _infer("hc_collapse", ins[:2], {})
    return _infer("rms_norm", [c, ins[2]], {"eps": a["eps"]})


@op("hc_collapse_norm", infer=_hc_collapse_norm_rule, flops=lambda i, o, a: 2 * i[0].numel + 4 * o[0].numel,
    attrs={"eps": REQUIRED}, n_inputs=3)
def hc_collapse_norm(r, pre_in, norm_w, *, eps):
    """hc_pre's normalised input without its mixes: RMSNorm(collapse of the stream with the
    previous sub-layer's pre). split_hc_pre pairs it with hc_mix, so that the mixes (wanted only
    at the sub-layer's end) can run beside the sub-layer's first GEMMs."""
    return core.rms_norm(mhc.hc_collapse(r, pre_in), norm_w, eps=eps)


def _hc_collapse_norm_quant_rule(ins, a):
    (x,) = _hc_collapse_norm_rule(ins, a)
    return [x, last_dim_block(x, "fp8e4m3", "e8m0", a["block"])]


@op("hc_collapse_norm_quant_fp8", infer=_hc_collapse_norm_quant_rule,
    flops=lambda i, o, a: 2 * i[0].numel + 7 * o[0].numel, attrs={"eps": REQUIRED, "block": 32}, n_inputs=3)
def hc_collapse_norm_quant_fp8(r, pre_in, norm_w, *, eps, block):
    """hc_collapse_norm and the per-32 fp8 quantisation of its output, both kept: the sub-layer's
    first GEMMs read the quantised input, other readers (the router, the compressor) the bf16
    one. One pass over the row instead of two calls on the sub-layer's critical path."""
    x = hc_collapse_norm(r, pre_in, norm_w, eps=eps)
    return x, q.quant_fp8_32(x, block)


def _hc_mix_rule(ins, a):
    r, fn, scale, base = ins
    (raw,) = _infer("hc_mix_gemm", [r, fn], {"eps": a["eps"]})
    return _infer("hc_sinkhorn", [raw, scale, base],
                  {"copies": a["copies"], "iters": a["iters"], "eps": a["hc_eps"], "post_mult": a["post_mult"]})


@op("hc_mix", infer=_hc_mix_rule, flops=lambda i, o, a: 2 * i[0].numel * (i[1].shape[0] + 1),
    attrs={"eps": REQUIRED, "copies": REQUIRED, "iters": REQUIRED, "hc_eps": REQUIRED, "post_mult": 2.0},
    n_inputs=4)
def hc_mix(r, fn, scale, base, *, eps, copies, iters, hc_eps, post_mult):
    """A sub-layer's mixes from the stream (mix GEMM + Sinkhorn): hc_pre without the collapse and
    norm, for the entry whose input is no collapse of the stream (layer 0's attention reads the
    embedding itself)."""
    raw = mhc.hc_mix_gemm(r, fn, eps=eps)
    return mhc.hc_sinkhorn(raw, scale, base, copies=copies, iters=iters, eps=hc_eps, post_mult=post_mult)


# ---- RoPE + quant -------------------------------------------------------------------------------

def _rope_quant_rule(ins, a):
    (x,) = _infer("rope", ins, {k: a[k] for k in ("rope_dim", "theta", "yarn", "pos_offset")})
    return [last_dim_block(x, "fp8e4m3", "e8m0", a["block"])]


@op("rope_quant_fp8", infer=_rope_quant_rule, flops=lambda i, o, a: 8 * i[0].numel,
    attrs={"rope_dim": REQUIRED, "theta": REQUIRED, "yarn": None, "pos_offset": 0, "block": 32}, n_inputs=2)
def rope_quant_fp8(x, positions, *, rope_dim, theta, yarn, pos_offset, block):
    """RoPE on the tail, then fp8 per-32 quantisation over the whole vector (window keys)."""
    return q.quant_fp8_32(at.rope(x, positions, rope_dim=rope_dim, theta=theta, yarn=yarn, inverse=False,
                                  pos_offset=pos_offset), block)


def _rope_quant_fp4_rule(ins, a):
    (x,) = _infer("rope", ins, {k: a[k] for k in ("rope_dim", "theta", "yarn", "pos_offset")})
    return _infer("quant_fp4", [x], {"block": a["block"], "scale": a["scale"]})


@op("rope_quant_fp4", infer=_rope_quant_fp4_rule, flops=lambda i, o, a: 8 * i[0].numel,
    attrs={"rope_dim": REQUIRED, "theta": REQUIRED, "yarn": None, "pos_offset": 0, "block": REQUIRED,
           "scale": REQUIRED}, n_inputs=2)
def rope_quant_fp4(x, positions, *, rope_dim, theta, yarn, pos_offset, block, scale):
    """RoPE on the tail, then fp4 quantisation (compressed KV: 16/e4m3; index q/k: 32/ue8m0)."""
    from .quantized import quant_fp4

    return quant_fp4(at.rope(x, positions, rope_dim=rope_dim, theta=theta, yarn=yarn, inverse=False,
                             pos_offset=pos_offset), block=block, scale=scale)


# ---- router -------------------------------------------------------------------------------------

def _router_rule(ins, a):
    if len(ins) not in (2, 4):
        raise ShapeError("moe_router takes logits, bias [, bias_vl, token ids]")
    if (len(ins) == 4) != (a["image_token_id"] is not None):
        raise ShapeError("bias_vl and the token ids go with image_token_id")
    logits, bias = want_float(ins[0], "logits"), want_float(ins[1], "bias")
    want_dims(bias.shape[-1], logits.shape[1], "bias vs experts")  # [E], or [n, E] with image rows
    if len(ins) == 4:
        (row_bias,) = _infer("route_bias", [ins[3], bias, ins[2]], {"image_token_id": a["image_token_id"]})
        want_dims(row_bias.shape[0], logits.shape[0], "token ids vs rows")
    (sel,) = _infer("topk_ids", [logits], {"k": a["k"]})
    return [sel, TensorType(dt.f32, sel.shape)]


@op("moe_router", infer=_router_rule, flops=lambda i, o, a: 8 * i[0].numel,
    attrs={"k": REQUIRED, "scale": REQUIRED, "renorm": True, "image_token_id": None})
def moe_router(logits, bias, bias_vl=None, ids=None, *, k, scale, renorm, image_token_id=None):
    """s = sqrt(softplus(logits)); the top k of s + bias (lowest id on ties); weights s[sel]
    renormalised and scaled (noaux_tc: the bias only selects). With bias_vl and the token ids,
    the bias of each row is route_bias's: bias_vl for image tokens."""
    from ..registry import get_op

    if ids is not None:
        bias = moe.route_bias(ids, bias, bias_vl, image_token_id=image_token_id)
    s = get_op("sqrt").ref(get_op("softplus").ref(logits))
    sel = moe.topk_ids(get_op("add").ref(s, bias), k=k)
    return sel, moe.route_weights(s, sel, scale=scale, renorm=renorm, eps=1e-20)


# ---- SwiGLU + quant -----------------------------------------------------------------------------

def _swiglu_quant_rule(ins, a):
    (y,) = _infer("swiglu", ins, {"limit": a["limit"]})
    return [last_dim_block(y, "fp8e4m3", "e8m0", a["block"])]


@op("swiglu_quant_fp8", infer=_swiglu_quant_rule, flops=lambda i, o, a: 9 * o[0].numel,
    attrs={"limit": REQUIRED, "block": 32}, n_inputs=2)
def swiglu_quant_fp8(g, u, *, limit, block):
    """The shared expert's SwiGLU with the limit, then fp8 per-32 quantisation."""
    return q.quant_fp8_32(moe.swiglu(g, u, limit=limit), block)


def _swiglu_gu_quant_rule(ins, a):
    gu = want_float(ins[0], "gate|up")
    if not isinstance(gu.shape[-1], int) or gu.shape[-1] % 2:
        raise ShapeError(f"gate|up must have an even width, got {gu}")
    half = gu.with_shape(gu.shape[:-1] + (gu.shape[-1] // 2,))
    return _swiglu_quant_rule([half, half], a)


@op("swiglu_gu_quant_fp8", infer=_swiglu_gu_quant_rule, flops=lambda i, o, a: 9 * o[0].numel,
    attrs={"limit": REQUIRED, "block": 32}, n_inputs=1)
def swiglu_gu_quant_fp8(gu, *, limit, block):
    """swiglu_quant_fp8 of the two halves of one [gate | up] tensor: the output of one GEMM over
    the gate and up weights stacked by rows (fuse_gate_up_gemms)."""
    f = gu.shape[-1] // 2
    return swiglu_quant_fp8(gu[..., :f], gu[..., f:], limit=limit, block=block)


# ---- compressor pooling + norm ------------------------------------------------------------------

def _pool_norm_rule(ins, a):
    (z,) = _infer("compress_pool", ins[:6], {"ratio": a["ratio"]})
    norm = want_float(ins[6], "norm weight")
    want_dims(norm.shape[0], z.shape[1], "norm width")
    return [TensorType(dt.bf16, z.shape)]


@op("compress_pool_norm", infer=_pool_norm_rule, flops=lambda i, o, a: 10 * i[0].numel,
    attrs={"ratio": REQUIRED, "eps": REQUIRED}, n_inputs=7)
def compress_pool_norm(l, s, state, positions, token_seq, seq_slots, norm_w, *, ratio, eps):
    """Ratio-r softmax pooling over each group (fp32, straddling groups from the state ring), then
    the compressor RMSNorm on the bf16 latent."""
    z = at.compress_pool(l, s, state, positions, token_seq, seq_slots, ratio=ratio)
    return core.rms_norm(z.to(torch.bfloat16), norm_w, eps=eps)


# ---- indexer: scoring + masking + top-k ---------------------------------------------------------

def _indexer_topk_rule(ins, a):
    (score,) = _infer("indexer_scores", ins[:6], {"ratio": a["ratio"]})
    if len(ins) == 7:
        at.want_index(ins[6], "candidate blocks", rank=2)
    outs = _infer("topk_select", [score, ins[3], ins[4]], {"ratio": a["ratio"], "k": a["k"]})
    if a["emit_candidates"]:
        outs += _infer("candidate_blocks", [score, ins[3], ins[4]],
                       {"ratio": a["ratio"], "block_size": a["block_size"], "topk_blocks": a["topk_blocks"]})
    return outs


def _indexer_topk_cost(ins, outs, a):
    n, h, d = ins[0].shape
    cap = ins[5].shape[1] * ins[2].shape[1]
    return Cost(flops=2 * n * h * (d + 1) * cap, bytes_read=ins[0].nbytes + ins[1].nbytes + ins[2].nbytes,
                bytes_written=sum(o.nbytes for o in outs))


@op("indexer_topk", infer=_indexer_topk_rule, flops=_indexer_topk_cost,
    attrs={"ratio": REQUIRED, "k": REQUIRED, "emit_candidates": False, "block_size": 8, "topk_blocks": 0,
           "w_scale": None})
def indexer_topk(qi, w, ik, positions, token_seq, block_table, cand=None, *, ratio, k, emit_candidates,
                 block_size, topk_blocks, w_scale):
    """Index scores, restricted to the candidate pool when `cand` is given, top-k; at the
    candidate source (`emit_candidates`) also the pool built from the same scores. `w_scale`:
    the head weights' constant factor (a `scale` folded in), applied and rounded as `scale` does."""
    if w_scale is not None:
        w = core.scale(w, factor=w_scale)
    score = at.indexer_scores(qi, w, ik, positions, token_seq, block_table, ratio=ratio)
    pool = None
    if emit_candidates:
        pool = at.candidate_blocks(score, positions, token_seq, ratio=ratio, block_size=block_size,
                                   topk_blocks=topk_blocks)
    if cand is not None:
        score = at.candidate_mask(score, cand, block_size=block_size)
    top = at.topk_select(score, positions, token_seq, ratio=ratio, k=k)
    return (top, pool) if emit_candidates else top


# ---- MoE dispatch (what lower_moe_dispatch produces) --------------------------------------------

def _permute_rule(ins, a):
    sel = want_tensor(ins[0], "selection")
    e = a["n_experts"]
    return [TensorType(dt.i32, (sel.numel,)), TensorType(dt.i32, (e + 1,))]


@op("moe_permute", infer=_permute_rule, flops=lambda i, o, a: 2 * i[0].numel, attrs={"n_experts": REQUIRED},
    n_inputs=1)
def moe_permute(sel, *, n_experts):
    """Group the (token, lane) pairs by expert: flat pair ids t*k + lane sorted by expert (stable,
    so token order within an expert), and each expert's [start, end) in that order."""
    flat = sel.long().flatten()
    order = torch.sort(flat, stable=True).indices
    # a scatter, not bincount: bincount sizes its output from the data (a host synchronisation)
    counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=flat.device), counts.cumsum(0)])
    return order.to(torch.int32), offsets.to(torch.int32)


def _gather_q_rule(ins, a):
    x = want_quant(ins[0], "activation", "fp8e4m3")
    pairs = at.want_index(ins[1], "pair ids")
    return [quantized("fp8e4m3", (pairs.shape[0], x.shape[1]), "e8m0", x.block)]


@op("moe_gather_rows", infer=_gather_q_rule, flops=lambda i, o, a: Cost(0, o[0].nbytes, o[0].nbytes),
    attrs={"k": REQUIRED}, n_inputs=2)
def moe_gather_rows(x, pairs, *, k):
    """The quantised token rows of each (token, lane) pair, in expert order."""
    tok = pairs.long() // k
    return QTensor(x.data[tok], x.scale[tok])


def _grouped_rule(ins, a):
    x = want_quant(ins[0], "rows", "fp8e4m3")
    w = want_quant(ins[1], "expert weights", "fp4e2m1")
    offs = at.want_index(ins[2], "expert offsets")
    if w.rank != 3:
        raise ShapeError(f"expert weights must be [experts, out, in], got {w}")
    want_dims(w.shape[2], x.shape[1], "weight in-features vs row width")
    want_dims(offs.shape[0], w.shape[0] + 1, "offsets vs experts + 1")
    return [TensorType(dt.bf16, (x.shape[0], w.shape[1]))]


def _grouped_cost(ins, outs, a):
    m, k = ins[0].shape
    return Cost(flops=2 * m * k * ins[1].shape[1], bytes_read=ins[0].nbytes + ins[1].nbytes,
                bytes_written=outs[0].nbytes)


@op("grouped_gemm_fp4", infer=_grouped_rule, flops=_grouped_cost, n_inputs=3)
def grouped_gemm_fp4(x, w, offsets):
    """Rows [offsets[e], offsets[e+1]) times expert e's fp4 weight: fp8 activation x fp4 weight,
    fp32 accumulation, bf16 out (lin4 of spec §3.6)."""
    from .. import numerics as nm

    xf = at.dequant_value(x)
    out = torch.zeros(xf.shape[0], w.data.shape[1], dtype=torch.bfloat16)
    offs = offsets.long().tolist()
    for e in range(len(offs) - 1):
        a, b = offs[e], offs[e + 1]
        if b > a:
            out[a:b] = nm.mm32(xf[a:b], expert_weight(w, e)).to(torch.bfloat16)
    return out


def _swiglu_w_rule(ins, a):
    gu = want_float(ins[0], "gate|up")
    want_float(ins[1], "pair weights")
    if not isinstance(gu.shape[1], int) or gu.shape[1] % 2:
        raise ShapeError(f"gate|up must have an even width, got {gu}")
    return [quantized("fp8e4m3", (gu.shape[0], gu.shape[1] // 2), "e8m0", (1, a["block"]))]


@op("swiglu_weighted_quant_fp8", infer=_swiglu_w_rule, flops=lambda i, o, a: 10 * o[0].numel,
    attrs={"limit": REQUIRED, "k": REQUIRED, "block": 32}, n_inputs=3)
def swiglu_weighted_quant_fp8(gu, wt, pairs, *, limit, k, block):
    """(w * silu(min(g, limit))) * clamp(u) per pair row, with the pair's routing weight applied
    before w2's activation quantisation; `gu` is [gate | up] from the fused w13 GEMM."""
    f = gu.shape[1] // 2
    p = pairs.long()
    weight = wt.float()[p // k, p % k].unsqueeze(-1)
    a = moe.swiglu_limited(gu[:, :f], gu[:, f:], limit, weight).to(torch.bfloat16)
    return q.quant_fp8_32(a, block)


def _combine_rule(ins, a):
    y = want_float(ins[0], "expert outputs")
    at.want_index(ins[1], "pair ids")
    at.want_index(ins[2], "expert offsets")
    rows = want_tensor(ins[3], "token rows")
    return [TensorType(dt.f32, (rows.shape[0], y.shape[1]))]


@op("moe_combine", infer=_combine_rule, flops=lambda i, o, a: i[0].numel, attrs={"k": REQUIRED}, n_inputs=4)
def moe_combine(y, pairs, offsets, like, *, k):
    """Each token's expert outputs summed in fp32, in ascending expert order (a token meets each
    expert at most once, so one segment adds at most one row per token)."""
    out = torch.zeros(like.shape[0], y.shape[1], dtype=torch.float32)
    tok = pairs.long() // k
    offs = offsets.long().tolist()
    for e in range(len(offs) - 1):
        seg = slice(offs[e], offs[e + 1])
        out[tok[seg]] += y[seg].float()
    return out


def _combine_shared_rule(ins, a):
    (out,) = _combine_rule(ins[:4], a)
    sh = want_float(ins[4], "shared expert output")
    if sh.dtype != dt.bf16:
        raise ShapeError(f"the shared expert output must be bf16, got {sh}")
    want_dims(sh.shape[0], out.shape[0], "shared expert rows")
    want_dims(sh.shape[1], out.shape[1], "shared expert width")
    return [TensorType(dt.bf16, out.shape)]


@op("moe_combine_shared", infer=_combine_shared_rule, flops=lambda i, o, a: i[0].numel + o[0].numel,
    attrs={"k": REQUIRED}, n_inputs=5)
def moe_combine_shared(y, pairs, offsets, like, shared, *, k):
    """The routed experts' fp32 combine plus the shared expert's bf16 output, in fp32, rounded to
    bf16: cast(add(moe_combine(...), cast(shared, f32)), bf16), as the MoE block ends (§4.5)."""
    return (moe_combine(y, pairs, offsets, like, k=k) + shared.float()).to(torch.bfloat16)


# ---- decode: RoPE + fp8 quantisation + window-ring write ------------------------------------------

def _rope_quant_write_rule(ins, a):
    (kq,) = _rope_quant_rule(ins[:2], a)
    (ring,) = _infer("swa_write", [ins[2], kq, ins[1], ins[3], ins[4]], {})
    return [kq, ring]


@op("rope_quant_fp8_cache_write", infer=_rope_quant_write_rule, flops=lambda i, o, a: 8 * i[0].numel,
    attrs={"rope_dim": REQUIRED, "theta": REQUIRED, "yarn": None, "pos_offset": 0, "block": 32},
    inplace={1: 2}, n_inputs=5)
def rope_quant_fp8_cache_write(x, positions, ring, token_seq, seq_slots, *, rope_dim, theta, yarn, pos_offset, block):
    """Window keys: RoPE, fp8 quantisation and the ring write in one pass (decode steps, where a
    sequence's few rows cannot evict a key its own queries still read)."""
    kq = rope_quant_fp8(x, positions, rope_dim=rope_dim, theta=theta, yarn=yarn, pos_offset=pos_offset, block=block)
    return kq, at.swa_write(ring, kq, positions, token_seq, seq_slots)


def _norm_rope_quant_write_rule(ins, a):
    (x,) = _infer("rms_norm", ins[:2], {"eps": a["eps"]})
    return _rope_quant_write_rule([x, *ins[2:]], a)


@op("norm_rope_quant_fp8_cache_write", infer=_norm_rope_quant_write_rule, flops=lambda i, o, a: 12 * i[0].numel,
    attrs={"eps": REQUIRED, "rope_dim": REQUIRED, "theta": REQUIRED, "yarn": None, "pos_offset": 0, "block": 32},
    inplace={1: 3}, n_inputs=6)
def norm_rope_quant_fp8_cache_write(x, w, positions, ring, token_seq, seq_slots, *, eps, rope_dim, theta, yarn,
                                    pos_offset, block):
    """The window keys' RMSNorm before rope_quant_fp8_cache_write, in the same pass: a decode
    step's key row is normalised, rotated, quantised and written by one program."""
    return rope_quant_fp8_cache_write(core.rms_norm(x, w, eps=eps), positions, ring, token_seq, seq_slots,
                                      rope_dim=rope_dim, theta=theta, yarn=yarn, pos_offset=pos_offset, block=block)


# ---- decode: the output projection's first half with its quantisation ----------------------------

def _grouped_linear_quant_rule(ins, a):
    (y,) = _infer("grouped_linear", ins, {"groups": a["groups"], "weight_dtype": a["weight_dtype"]})
    return [last_dim_block(y, "fp8e4m3", "e8m0", a["block"])]


@op("grouped_linear_quant_fp8", infer=_grouped_linear_quant_rule,
    flops=lambda i, o, a: 2 * o[0].numel * i[1].shape[1] + 3 * o[0].numel,
    attrs={"groups": REQUIRED, "weight_dtype": "bf16", "block": 32}, n_inputs=2)
def grouped_linear_quant_fp8(x, w, *, groups, weight_dtype, block):
    """grouped_linear's bf16 output quantised to fp8 per `block` (wo_a, then wo_b's input): at
    decode the K split's sum quantises the rows it sums, so the bf16 rows never go to memory."""
    return q.quant_fp8_32(grouped_linear(x, w, groups=groups, weight_dtype=weight_dtype), block)


# ---- the MoE block's end: the combine and the stream expansion in one pass ------------------------

def _combine_expand_rule(ins, a):
    (y,) = _infer("moe_combine_shared", ins[:5], {"k": a["k"]})
    return _infer("hc_expand", [y, *ins[5:]], {})


@op("moe_combine_hc_expand", infer=_combine_expand_rule,
    flops=lambda i, o, a: i[0].numel + 2 * o[0].numel * (o[0].shape[1] + 1), attrs={"k": REQUIRED}, n_inputs=8)
def moe_combine_hc_expand(y, pairs, offsets, like, shared, r, post, m, *, k):
    """hc_expand of the MoE block's output (moe_combine_shared, bf16) into the residual streams:
    one program per row chunk sums the row's experts and the shared expert, rounds the sum to
    bf16 and writes the streams, so the block's output row never goes to memory."""
    return mhc.hc_expand(moe_combine_shared(y, pairs, offsets, like, shared, k=k), r, post, m)


# ---- decode: the router's logits GEMM with the router ---------------------------------------------

def _linear_router_rule(ins, a):
    if len(ins) not in (3, 5):
        raise ShapeError("linear_moe_router takes x, the gate weight, bias [, bias_vl, token ids]")
    (logits,) = _infer("linear", ins[:2], {"out_dtype": a["out_dtype"], "compute": a["compute"]})
    return _router_rule([logits, *ins[2:]], a)


@op("linear_moe_router", infer=_linear_router_rule,
    flops=lambda i, o, a: 2 * i[0].numel * i[1].shape[0] + 8 * i[0].shape[0] * i[1].shape[0],
    attrs={"out_dtype": None, "compute": "f32", "k": REQUIRED, "scale": REQUIRED, "renorm": True,
           "image_token_id": None})
def linear_moe_router(x, w, bias, bias_vl=None, ids=None, *, out_dtype, compute, k, scale, renorm,
                      image_token_id=None):
    """moe_router of the gate's logits (linear): at decode the router sums the logits GEMM's K
    split itself, in the split's order, so the logits are never summed by a kernel of their own."""
    logits = core.linear(x, w, out_dtype=out_dtype, compute=compute)
    return moe_router(logits, bias, bias_vl, ids, k=k, scale=scale, renorm=renorm, image_token_id=image_token_id)
