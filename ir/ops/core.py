"""Generic tensor ops: elementwise, casts, norms, matmuls, reductions and layout changes."""
from __future__ import annotations

import sympy
import torch

from .. import dtypes as dt
from .. import numerics as nm
from .. import shapes as sh
from ..registry import REQUIRED, ShapeError, op
from ..types import TensorType


# ---- rule helpers shared by every op family ---------------------------------------------------

def want_tensor(t, what: str) -> TensorType:
    if not isinstance(t, TensorType):
        raise ShapeError(f"{what} must be a plain tensor, got {t}")
    return t


def want_float(t, what: str) -> TensorType:
    t = want_tensor(t, what)
    if not t.dtype.is_float or t.dtype.packed != 1 or t.dtype.name in ("e8m0", "fp8e4m3"):
        raise ShapeError(f"{what} must be bf16/f16/f32, got {t.dtype}")
    return t


def want_dims(a, b, what: str):
    if not sh.equal(a, b):
        raise ShapeError(f"{what}: {sh.dim_str(a)} != {sh.dim_str(b)}")


def broadcast(a: tuple, b: tuple) -> tuple:
    out = []
    for x, y in zip(((1,) * (len(b) - len(a)) + a), ((1,) * (len(a) - len(b)) + b)):
        if sh.equal(x, y) or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ShapeError(f"shapes {sh.shape_str(a)} and {sh.shape_str(b)} do not broadcast")
    return tuple(out)


def norm_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ShapeError(f"axis {axis} out of range for rank {rank}")
    return axis % rank


def numel_flops(per_elem: int = 1):
    return lambda ins, outs, a: per_elem * outs[0].numel


# ---- elementwise ------------------------------------------------------------------------------

def _binary_rule(ins, a):
    x, y = (want_float(t, f"operand {i}") for i, t in enumerate(ins))
    if x.dtype != y.dtype:
        raise ShapeError(f"operand dtypes differ: {x.dtype} vs {y.dtype}")
    return [TensorType(x.dtype, broadcast(x.shape, y.shape))]


for _name, _fn in (("add", torch.add), ("sub", torch.sub), ("mul", torch.mul), ("div", torch.div)):
    # fp32 math, result in the operands' dtype: the spec computes mixes and gates this way
    op(_name, infer=_binary_rule, flops=numel_flops(), n_inputs=2)(
        lambda x, y, _fn=_fn: _fn(x.float(), y.float()).to(x.dtype))


def _unary_rule(ins, a):
    return [want_float(ins[0], "input")]


_UNARY = {  # transcendentals in fp64, rounded once (ir.numerics)
    "silu": nm.silu32,
    "sigmoid": nm.sigmoid32,
    "relu": torch.relu,
    "exp": nm.exp32,
    "neg": torch.neg,
    "sqrt": torch.sqrt,
    "softplus": nm.softplus32,
}
for _name, _fn in _UNARY.items():
    op(_name, infer=_unary_rule, flops=numel_flops(), n_inputs=1)(
        lambda x, _fn=_fn: _fn(x.float()).to(x.dtype))


@op("scale", infer=_unary_rule, flops=numel_flops(), attrs={"factor": REQUIRED}, n_inputs=1)
def scale(x, *, factor):
    return (x.float() * factor).to(x.dtype)


@op("clamp", infer=_unary_rule, flops=numel_flops(), attrs={"min": None, "max": None}, n_inputs=1)
def clamp(x, *, min, max):
    return x.float().clamp(min=min, max=max).to(x.dtype)


def _cast_rule(ins, a):
    x = want_tensor(ins[0], "input")
    return [TensorType(dt.dtype(a["dtype"]), x.shape)]


@op("cast", infer=_cast_rule, flops=numel_flops(), attrs={"dtype": REQUIRED}, n_inputs=1)
def cast(x, *, dtype):
    return x.to(dt.dtype(dtype).storage)


# ---- norms and softmax ------------------------------------------------------------------------

def _rms_norm_rule(ins, a):
    x, w = want_float(ins[0], "input"), want_float(ins[1], "weight")
    if w.rank != 1:
        raise ShapeError(f"weight must be rank 1, got {w}")
    want_dims(x.shape[-1], w.shape[0], "normalised dim vs weight")
    return [x]


@op("rms_norm", infer=_rms_norm_rule, flops=numel_flops(4), attrs={"eps": REQUIRED}, n_inputs=2)
def rms_norm(x, w, *, eps):
    return nm.rms_norm(x, w, eps)


def _softmax_rule(ins, a):
    x = want_float(ins[0], "input")
    norm_axis(a["axis"], x.rank)
    return [x]


@op("softmax", infer=_softmax_rule, flops=numel_flops(5), attrs={"axis": -1}, n_inputs=1)
def softmax(x, *, axis):
    return nm.softmax32(x.float(), axis).to(x.dtype)


# ---- matmuls ----------------------------------------------------------------------------------

def _linear_rule(ins, a):
    x, w = want_float(ins[0], "input"), want_float(ins[1], "weight")
    if w.rank != 2:
        raise ShapeError(f"weight must be [out, in], got {w}")
    want_dims(x.shape[-1], w.shape[1], "input features vs weight [out, in]")
    out = dt.dtype(a["out_dtype"]) if a["out_dtype"] else x.dtype
    return [TensorType(out, x.shape[:-1] + (w.shape[0],))]


def _linear_flops(ins, outs, a):
    return 2 * outs[0].numel * ins[1].shape[1]


@op("linear", infer=_linear_rule, flops=_linear_flops, attrs={"out_dtype": None, "compute": "f32"},
    n_inputs=2)
def linear(x, w, *, out_dtype, compute):
    """y = x @ w^T with fp32 accumulation; `compute` is the operand precision: "f32" (weights
    promoted, spec §3.6) or "bf16" (a bf16 GEMM: bf16 operands, fp32 accumulation)."""
    if compute == "f32":  # a bf16 weight promoted to fp32 is exact, and so is its fp64 copy
        y = nm.mm32(x.float(), w)
    elif compute == "bf16":
        y = nm.mm32(x.bfloat16().float(), w if w.dtype == torch.bfloat16 else w.bfloat16())
    else:
        raise ValueError(f"unknown compute precision {compute!r}")
    return y.to(dt.dtype(out_dtype).storage if out_dtype else x.dtype)


# ---- layout -----------------------------------------------------------------------------------

def _reshape_rule(ins, a):
    """`shape` holds ints and at most one symbolic dim, written as a string ("num_tokens")."""
    x = want_tensor(ins[0], "input")
    if sum(isinstance(d, str) for d in a["shape"]) > 1:
        raise ShapeError("reshape allows one symbolic dim")
    new = sh.shape(a["shape"])
    if not sh.equal(sh.numel(new), x.numel):
        raise ShapeError(f"cannot reshape {x} to {sh.shape_str(new)}")
    return [TensorType(x.dtype, new)]


@op("reshape", infer=_reshape_rule, flops=lambda i, o, a: 0, attrs={"shape": REQUIRED}, n_inputs=1)
def reshape(x, *, shape):
    return x.reshape([d if isinstance(d, int) else -1 for d in shape])


def _concat_rule(ins, a):
    from ..types import QuantType

    if ins and all(isinstance(t, QuantType) for t in ins):
        # quantised operands concatenate data and scales alike; blocks must not straddle the seam
        ax = norm_axis(a["axis"], ins[0].rank)
        if any(t.block != ins[0].block or t.scale.dtype != ins[0].scale.dtype for t in ins):
            raise ShapeError("concat of quantised operands needs one block shape and scale format")
        if any(not isinstance(t.shape[ax], int) or t.shape[ax] % t.block[ax] for t in ins):
            raise ShapeError("concat axis must be a whole number of blocks in every operand")
        (data,) = _concat_rule([t.data for t in ins], a)
        (scale,) = _concat_rule([t.scale for t in ins], a)
        return [QuantType(data, scale, ins[0].block)]
    ts = [want_tensor(t, f"operand {i}") for i, t in enumerate(ins)]
    if not ts:
        raise ShapeError("concat needs at least one operand")
    ax = norm_axis(a["axis"], ts[0].rank)
    for t in ts[1:]:
        if t.dtype != ts[0].dtype or t.rank != ts[0].rank:
            raise ShapeError(f"concat operands differ: {ts[0]} vs {t}")
        for d in range(t.rank):
            if d != ax:
                want_dims(t.shape[d], ts[0].shape[d], f"concat dim {d}")
    total = sh.dim(sum((sympy.sympify(t.shape[ax]) for t in ts), sympy.Integer(0)))
    return [ts[0].with_shape(ts[0].shape[:ax] + (total,) + ts[0].shape[ax + 1:])]


@op("concat", infer=_concat_rule, flops=lambda i, o, a: 0, attrs={"axis": -1})
def concat(*xs, axis):
    from ..quant import QTensor

    if isinstance(xs[0], QTensor):
        return QTensor(torch.cat([x.data for x in xs], dim=axis), torch.cat([x.scale for x in xs], dim=axis))
    return torch.cat(xs, dim=axis)


def _embedding_rule(ins, a):
    ids, table = want_tensor(ins[0], "ids"), want_tensor(ins[1], "table")
    if ids.dtype not in (dt.i32, dt.i64):
        raise ShapeError(f"ids must be i32/i64, got {ids.dtype}")
    if table.rank != 2:
        raise ShapeError(f"table must be [rows, dim], got {table}")
    return [TensorType(table.dtype, ids.shape + (table.shape[1],))]


def _embedding_cost(ins, outs, a):
    from ..registry import Cost

    return Cost(0, ins[0].nbytes + outs[0].nbytes, outs[0].nbytes)


@op("embedding", infer=_embedding_rule, flops=_embedding_cost, n_inputs=2)
def embedding(ids, table):
    return table[ids.long()]
