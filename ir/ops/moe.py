"""Mixture of experts (spec §4.5): routing, SwiGLU with the limit, and the routed experts.

`moe_experts` is the whole routed-expert computation as one node; the MoE-dispatch lowering
rewrites it into group-by-expert, grouped GEMMs and the weighted combine.
"""
from __future__ import annotations

import torch

from .. import dtypes as dt
from .. import numerics as nm
from .. import quant as q
from ..registry import REQUIRED, Cost, ShapeError, op
from ..types import TensorType
from .attention import stable_topk
from .core import want_dims, want_float, want_tensor
from .quantized import dequant_value, expert_weight, want_quant


def _topk_ids_rule(ins, a):
    s = want_float(ins[0], "scores")
    if s.rank != 2 or not isinstance(s.shape[1], int) or a["k"] > s.shape[1]:
        raise ShapeError(f"need scores [n, experts] with at least k={a['k']} experts, got {s}")
    return [TensorType(dt.i32, (s.shape[0], a["k"]))]


@op("topk_ids", infer=_topk_ids_rule, flops=lambda i, o, a: 2 * i[0].numel, attrs={"k": REQUIRED}, n_inputs=1)
def topk_ids(scores, *, k):
    """The k best experts per row; equal scores: the lower expert id first."""
    return stable_topk(scores.float(), k).to(torch.int32)


def _route_weights_rule(ins, a):
    s = want_float(ins[0], "scores")
    sel = want_tensor(ins[1], "selection")
    want_dims(s.shape[0], sel.shape[0], "rows")
    return [TensorType(dt.f32, sel.shape)]


@op("route_weights", infer=_route_weights_rule, flops=lambda i, o, a: 3 * o[0].numel,
    attrs={"scale": REQUIRED, "renorm": True, "eps": 1e-20}, n_inputs=2)
def route_weights(scores, sel, *, scale, renorm, eps):
    """w = s[sel] / (sum s[sel] + 1e-20) * scale: the bias only selected, it does not weight."""
    w = torch.gather(scores.float(), 1, sel.long())
    if renorm and sel.shape[1] > 1:
        w = w / (w.sum(-1, keepdim=True) + eps)
    return w * scale


def swiglu_limited(g: torch.Tensor, u: torch.Tensor, limit: float, weight=None) -> torch.Tensor:
    """(w * silu(min(g, limit))) * clamp(u, -limit, limit) in fp32, left to right (the gate
    branch is clamped from above only)."""
    s = nm.silu32(g.float().clamp(max=limit))
    if weight is not None:
        s = weight * s
    return s * u.float().clamp(-limit, limit)


def _swiglu_rule(ins, a):
    g, u = want_float(ins[0], "gate"), want_float(ins[1], "up")
    want_dims(g.shape[-1], u.shape[-1], "gate vs up width")
    return [TensorType(dt.bf16, g.shape)]


@op("swiglu", infer=_swiglu_rule, flops=lambda i, o, a: 6 * o[0].numel, attrs={"limit": REQUIRED}, n_inputs=2)
def swiglu(g, u, *, limit):
    return swiglu_limited(g, u, limit).to(torch.bfloat16)


def _experts_rule(ins, a):
    x = want_quant(ins[0], "activation", "fp8e4m3")
    sel, wt = want_tensor(ins[1], "selection"), want_float(ins[2], "weights")
    w1, w3, w2 = (want_quant(t, n, "fp4e2m1") for t, n in zip(ins[3:], ("w1", "w3", "w2")))
    if w1.rank != 3:
        raise ShapeError(f"expert weights must be [experts, out, in], got {w1}")
    want_dims(w1.shape[2], x.shape[1], "w1 in-features vs hidden")
    want_dims(w2.shape[2], w1.shape[1], "w2 in-features vs expert width")
    want_dims(w2.shape[1], x.shape[1], "w2 out-features vs hidden")
    want_dims(sel.shape[0], x.shape[0], "selection rows")
    want_dims(wt.shape[1], sel.shape[1], "weights vs selection")
    return [TensorType(dt.f32, x.shape)]


def _experts_cost(ins, outs, a):
    n, h = ins[0].shape
    k = ins[1].shape[1]
    f = ins[3].shape[1]
    # every expert's weights once (decode touches min(E, n*k) of them; a plan refines per bucket)
    weights = ins[3].nbytes + ins[4].nbytes + ins[5].nbytes
    return Cost(flops=n * k * 6 * h * f, bytes_read=ins[0].nbytes + weights, bytes_written=outs[0].nbytes)


@op("moe_experts", infer=_experts_rule, flops=_experts_cost, attrs={"limit": REQUIRED},
    n_inputs=6)
def moe_experts(x, sel, wt, w1, w3, w2, *, limit):
    """sum over the selected experts e of  lin4(w_e * swiglu(lin4(x, w1_e), lin4(x, w3_e)), w2_e),
    accumulated in fp32 (spec §4.5). The routing weight is applied before w2's activation quant."""
    xf = dequant_value(x)
    out = torch.zeros(xf.shape, dtype=torch.float32)
    sel = sel.long()
    for e in torch.unique(sel).tolist():
        rows, lane = (sel == e).nonzero(as_tuple=True)
        w1e, w3e, w2e = (expert_weight(w, e) for w in (w1, w3, w2))
        g = nm.mm32(xf[rows], w1e).to(torch.bfloat16)
        u = nm.mm32(xf[rows], w3e).to(torch.bfloat16)
        a = swiglu_limited(g, u, limit, wt[rows, lane].float().unsqueeze(-1)).to(torch.bfloat16)
        y = nm.mm32(q.fake_quant_fp8_32(a).float(), w2e).to(torch.bfloat16)
        out.index_add_(0, rows, y.float())
    return out


def _route_bias_rule(ins, a):
    ids = want_tensor(ins[0], "token ids")
    bias, bias_vl = want_float(ins[1], "bias"), want_float(ins[2], "bias_vl")
    want_dims(bias.shape[0], bias_vl.shape[0], "bias vs bias_vl")
    return [TensorType(dt.f32, (ids.shape[0], bias.shape[0]))]


@op("route_bias", infer=_route_bias_rule, flops=lambda i, o, a: 0, attrs={"image_token_id": REQUIRED}, n_inputs=3)
def route_bias(ids, bias, bias_vl, *, image_token_id):
    """The selection bias of each row: `bias_vl` for image tokens, `bias` for text (spec §4.5)."""
    image = (ids.long() == image_token_id).unsqueeze(1)
    return torch.where(image, bias_vl.float().unsqueeze(0), bias.float().unsqueeze(0))
