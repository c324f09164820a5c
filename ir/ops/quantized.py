"""Quantise / dequantise and the block-scaled GEMMs (spec §3.3-§3.6).

`quant_fp8` and `quant_fp4` produce a quantised value (data + scales) whose dequantised content is
exactly the spec's fake quantisation, so a graph that stores caches in fp8/fp4 has the same
reference semantics as the spec's fp32 simulation. `gemm_fp8` is the spec's `lin8` with the
activation quantisation as its own node (fusion puts them back together per target).
"""
from __future__ import annotations

import weakref

import torch

from .. import dtypes as dt
from .. import numerics as nm
from .. import quant as q
from ..registry import REQUIRED, ShapeError, op
from ..types import QuantType, TensorType, quantized
from .core import want_dims, want_float, want_tensor

FP4_SCALES = {"ue8m0": "e8m0", "e4m3": "fp8e4m3"}


def want_quant(t, what: str, data: str | None = None) -> QuantType:
    if not isinstance(t, QuantType):
        raise ShapeError(f"{what} must be quantised, got {t}")
    if data and t.dtype.name != data:
        raise ShapeError(f"{what} must hold {data}, got {t.dtype}")
    return t


def last_dim_block(x: TensorType, data: str, scale: str, block: int) -> QuantType:
    if not isinstance(x.shape[-1], int) or x.shape[-1] % block:
        raise ShapeError(f"last dim of {x} is not a multiple of the block {block}")
    return quantized(data, x.shape, scale, (1,) * (x.rank - 1) + (block,))


# fp32 copies of quantised weights, made once by `preload_dequantized` (the cpu target dequantises
# weights at load): keyed by the id of the data tensor, held weakly, dropped when it goes.
_DEQUANTIZED: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def preload_dequantized(params: dict) -> None:
    """Dequantise every quantised param once (and keep fp64 copies of plain float params for the
    fp64-accumulated products); later uses are lookups. Values are identical to converting on
    every use: dequantised fp8/fp4 and bf16 values are exact in fp32 and fp64."""
    for v in params.values():
        if isinstance(v, q.QTensor) and id(v.data) not in _DEQUANTIZED:
            if v.data.dim() == 3 and v.data.dtype in (torch.uint8, torch.int8):
                # stacked fp4 experts: kept in fp64, so each expert slice feeds mm32 unconverted
                full = torch.stack([q.dequant_fp4_weight(v.data[e], v.scale[e]) for e in range(v.data.shape[0])])
                full = full.double()
            else:
                full = _dequant(v)
                nm.keep_f64(full)
            _DEQUANTIZED[id(v.data)] = (weakref.ref(v.data), full)
            weakref.finalize(v.data, _DEQUANTIZED.pop, id(v.data), None)
        elif isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 2:
            nm.keep_f64(v)


def expert_weight(w, e: int) -> torch.Tensor:
    """Weight of expert e of a stacked fp4 expert tensor (fp32 values; fp64 storage when preloaded)."""
    hit = _DEQUANTIZED.get(id(w.data))
    if hit is not None and hit[0]() is w.data:
        return hit[1][e]
    return q.dequant_fp4_weight(w.data[e], w.scale[e])


def dequant_value(v) -> torch.Tensor:
    """fp32 content of a quantised value of any of the formats above (by its storage dtypes)."""
    hit = _DEQUANTIZED.get(id(v[0]))
    if hit is not None and hit[0]() is v[0]:
        return hit[1]
    return _dequant(v)


def _dequant(v) -> torch.Tensor:
    data, scale = v
    if data.dtype == torch.float8_e4m3fn:
        block = data.shape[-1] // scale.shape[-1]
        if data.dim() == 2 and scale.shape[0] != data.shape[0]:  # a 32x32-tiled weight
            return q.dequant_fp8_weight(data, scale)
        return q.dequant_fp8_32(q.QTensor(data, scale), block)
    block = 2 * data.shape[-1] // scale.shape[-1]
    if scale.dtype == torch.float8_e4m3fn:
        return q.dequant_fp4_e4m3(q.QTensor(data, scale), block)
    return q.dequant_fp4_ue8m0(q.QTensor(data, scale), block)


# ---- quantise ---------------------------------------------------------------------------------

def _quant_fp8_rule(ins, a):
    return [last_dim_block(want_float(ins[0], "input"), "fp8e4m3", "e8m0", a["block"])]


@op("quant_fp8", infer=_quant_fp8_rule, flops=lambda i, o, a: 3 * i[0].numel, attrs={"block": 32},
    n_inputs=1)
def quant_fp8(x, *, block):
    """fp8 e4m3 per `block` elements with a power-of-two ue8m0 scale (spec §3.3)."""
    return q.quant_fp8_32(x, block)


def _quant_fp4_rule(ins, a):
    if a["scale"] not in FP4_SCALES:
        raise ShapeError(f"fp4 scale must be one of {sorted(FP4_SCALES)}, got {a['scale']!r}")
    return [last_dim_block(want_float(ins[0], "input"), "fp4e2m1", FP4_SCALES[a["scale"]], a["block"])]


@op("quant_fp4", infer=_quant_fp4_rule, flops=lambda i, o, a: 3 * i[0].numel,
    attrs={"block": REQUIRED, "scale": REQUIRED}, n_inputs=1)
def quant_fp4(x, *, block, scale):
    """fp4 e2m1 per `block` with a ue8m0 (power of two) or e4m3 (nearest) scale (spec §3.4)."""
    return q.quant_fp4_ue8m0(x, block) if scale == "ue8m0" else q.quant_fp4_e4m3(x, block)


def _dequant_rule(ins, a):
    x = want_quant(ins[0], "input")
    return [TensorType(dt.dtype(a["dtype"]), x.shape)]


@op("dequant", infer=_dequant_rule, flops=lambda i, o, a: i[0].numel, attrs={"dtype": "bf16"},
    n_inputs=1)
def dequant(x, *, dtype):
    return dequant_value(x).to(dt.dtype(dtype).storage)


def _row_scales_rule(ins, a):
    w = want_quant(ins[0], "weight", "fp8e4m3")
    if w.rank != 2 or w.block[1] != 32:
        raise ShapeError(f"expected an fp8 weight [out, in] with 32-wide blocks along in, got {w}")
    return [QuantType(w.data, TensorType(w.scale.dtype, (w.data.shape[0], w.scale.shape[1])), (1, 32))]


@op("row_block_scales", infer=_row_scales_rule, flops=lambda i, o, a: 0, n_inputs=1)
def row_block_scales(w):
    """The same fp8 weight with its [out/32, in/32] block scales repeated per row, [out, in/32]:
    the per-row (MX) scale layout block-scaled MMAs read (Ascend's cube). Dequantises to the same
    values; the plan runs it once at load."""
    data, scale = w
    return q.QTensor(data, scale.repeat_interleave(-(-data.shape[0] // scale.shape[0]), 0)[: data.shape[0]].contiguous())


# ---- GEMMs ------------------------------------------------------------------------------------

def _gemm_fp8_rule(ins, a):
    x = want_quant(ins[0], "activation", "fp8e4m3")
    w = want_quant(ins[1], "weight", "fp8e4m3")
    if w.rank != 2:
        raise ShapeError(f"weight must be [out, in], got {w}")
    want_dims(x.shape[-1], w.shape[1], "activation features vs weight [out, in]")
    return [TensorType(dt.dtype(a["out_dtype"]), x.shape[:-1] + (w.shape[0],))]


@op("gemm_fp8", infer=_gemm_fp8_rule, flops=lambda i, o, a: 2 * o[0].numel * i[1].shape[1],
    attrs={"out_dtype": "bf16"}, n_inputs=2)
def gemm_fp8(x, w, *, out_dtype):
    """lin8: fp8 per-32 activation x fp8 32x32-scaled weight, fp32 accumulation (spec §3.6)."""
    return nm.mm32(dequant_value(x), dequant_value(w)).to(dt.dtype(out_dtype).storage)


def _dequant_linear_rule(ins, a):
    x = want_float(ins[0], "input")
    w = want_quant(ins[1], "weight")
    want_dims(x.shape[-1], w.shape[-1], "input features vs weight [out, in]")
    return [TensorType(dt.dtype(a["out_dtype"]) if a["out_dtype"] else x.dtype, x.shape[:-1] + (w.shape[0],))]


@op("linear_dequant", infer=_dequant_linear_rule, flops=lambda i, o, a: 2 * o[0].numel * i[1].shape[1],
    attrs={"out_dtype": None, "weight_dtype": "bf16"}, n_inputs=2)
def linear_dequant(x, w, *, out_dtype, weight_dtype):
    """y = x @ dequant(w)^T with the weight first rounded to `weight_dtype` (HF-REF dequantises some
    fp8 weights to bf16 at load), fp32 accumulation, no activation quantisation."""
    wd = dequant_value(w).to(dt.dtype(weight_dtype).storage).float()
    return nm.mm32(x.float(), wd).to(dt.dtype(out_dtype).storage if out_dtype else x.dtype)


def _grouped_rule(ins, a):
    x = want_float(ins[0], "input")
    w = want_tensor(ins[1], "weight") if not isinstance(ins[1], QuantType) else ins[1]
    g = a["groups"]
    if x.rank < 2:
        raise ShapeError(f"input must be [..., features], got {x}")
    if not isinstance(w.shape[0], int) or w.shape[0] % g:
        raise ShapeError(f"weight rows {w.shape[0]} not divisible into {g} groups")
    want_dims(x.shape[-1], g * w.shape[1], "input features vs groups x weight in-features")
    return [TensorType(x.dtype, x.shape[:-1] + (w.shape[0],))]


@op("grouped_linear", infer=_grouped_rule,
    flops=lambda i, o, a: 2 * o[0].numel * i[1].shape[1], attrs={"groups": REQUIRED, "weight_dtype": "bf16"},
    n_inputs=2)
def grouped_linear(x, w, *, groups, weight_dtype):
    """Block-diagonal projection: group g of the input features meets rows g of the weight
    (the grouped low-rank output projection `wo_a`, spec §4.4g)."""
    wd = (dequant_value(w) if isinstance(w, tuple) else w.float()).to(dt.dtype(weight_dtype).storage).float()
    xg = x.float().reshape(-1, groups, x.shape[-1] // groups)
    wg = wd.view(groups, wd.shape[0] // groups, wd.shape[1])
    y = torch.stack([nm.mm32(xg[:, i], wg[i]) for i in range(groups)], 1)
    return y.reshape(*x.shape[:-1], wd.shape[0]).to(x.dtype)
