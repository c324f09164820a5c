"""mHC: single-pass manifold-constrained hyper-connections (spec §4.2).

The residual stream is `C` copies `[n, C, H]`. Each sub-layer computes its mixes from the stream
entering it (`hc_mix_gemm` + `hc_sinkhorn`), collapses the stream with the previous sub-layer's
`pre` (`hc_collapse`) and expands its output back (`hc_expand`).
"""
from __future__ import annotations

from .. import dtypes as dt
from .. import numerics as nm
from ..registry import REQUIRED, ShapeError, op
from ..types import TensorType
from .core import want_dims, want_float


def _mix_gemm_rule(ins, a):
    r, fn = want_float(ins[0], "stream"), want_float(ins[1], "hc fn")
    if r.rank != 3 or fn.rank != 2:
        raise ShapeError(f"expected stream [n, C, H] and fn [mixes, C*H], got {r} and {fn}")
    want_dims(fn.shape[1], r.shape[1] * r.shape[2], "fn columns vs C*H")
    return [TensorType(dt.f32, (r.shape[0], fn.shape[0]))]


@op("hc_mix_gemm", infer=_mix_gemm_rule, flops=lambda i, o, a: 2 * o[0].numel * i[1].shape[1] + 2 * i[0].numel,
    attrs={"eps": REQUIRED}, n_inputs=2)
def hc_mix_gemm(r, fn, *, eps):
    """raw = (R.flat @ fn^T) * rsqrt(mean(R.flat^2) + eps): one RMS statistic over all C*H, fp32."""
    xf = r.float().flatten(1)
    return nm.mm32(xf, fn.float()) * nm.rsqrt32(nm.mean_sq32(xf) + eps)


def _sinkhorn_rule(ins, a):
    raw, scale, base = (want_float(t, n) for t, n in zip(ins, ("raw", "scale", "base")))
    c = a["copies"]
    if raw.rank != 2 or not isinstance(raw.shape[1], int) or raw.shape[1] != 2 * c + c * c:
        raise ShapeError(f"raw mixes must be [n, {2 * c + c * c}], got {raw}")
    want_dims(scale.shape[0], 3, "scale entries")
    want_dims(base.shape[0], raw.shape[1], "base entries")
    n = raw.shape[0]
    return [TensorType(dt.f32, (n, c)), TensorType(dt.f32, (n, c)), TensorType(dt.f32, (n, c, c))]


@op("hc_sinkhorn", infer=_sinkhorn_rule,
    flops=lambda i, o, a: i[0].shape[0] * (a["copies"] ** 2) * (4 * a["iters"] + 8),
    attrs={"copies": REQUIRED, "iters": REQUIRED, "eps": REQUIRED, "post_mult": 2.0}, n_inputs=3)
def hc_sinkhorn(raw, scale, base, *, copies, iters, eps, post_mult):
    """pre, post and the doubly-stochastic mix M (M[i, j]: row i is the source copy); `iters`
    Sinkhorn rounds in all, the first after the softmax being a column step."""
    c = copies
    raw, scale, base = raw.float(), scale.float(), base.float()
    pre = nm.sigmoid32(raw[:, :c] * scale[0] + base[:c]) + eps
    post = post_mult * nm.sigmoid32(raw[:, c:2 * c] * scale[1] + base[c:2 * c])
    m = (raw[:, 2 * c:] * scale[2] + base[2 * c:]).view(-1, c, c)
    m = nm.softmax32(m, -1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return pre, post, m


def _collapse_rule(ins, a):
    r, mix = want_float(ins[0], "stream"), want_float(ins[1], "mix")
    if r.rank != 3 or mix.rank != 2:
        raise ShapeError(f"expected stream [n, C, H] and mix [n, C], got {r} and {mix}")
    want_dims(mix.shape[1], r.shape[1], "mix entries vs copies")
    return [TensorType(r.dtype, (r.shape[0], r.shape[2]))]


@op("hc_collapse", infer=_collapse_rule, flops=lambda i, o, a: 2 * i[0].numel, n_inputs=2)
def hc_collapse(r, mix):
    """sum_c mix[c] * R[c] in fp32, in the stream's dtype."""
    return (mix.float().unsqueeze(-1) * r.float()).sum(1).to(r.dtype)


def _expand_rule(ins, a):
    y, r, post, m = (want_float(t, n) for t, n in zip(ins, ("output", "stream", "post", "M")))
    if r.rank != 3 or y.rank != 2:
        raise ShapeError(f"expected output [n, H] and stream [n, C, H], got {y} and {r}")
    want_dims(y.shape[1], r.shape[2], "output width vs stream width")
    want_dims(post.shape[1], r.shape[1], "post entries vs copies")
    return [r]


@op("hc_expand", infer=_expand_rule, flops=lambda i, o, a: 2 * i[1].numel * (i[1].shape[1] + 1), n_inputs=4)
def hc_expand(y, r, post, m):
    """R'[j] = post[j] * y + sum_i M[i, j] * R[i], fp32 math, in the stream's dtype."""
    mixed = (m.float().unsqueeze(-1) * r.float().unsqueeze(2)).sum(1)  # [n, j, H]
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(r.dtype)


def _repeat_rule(ins, a):
    x = want_float(ins[0], "input")
    return [TensorType(x.dtype, (x.shape[0], a["copies"], x.shape[1]))]


@op("hc_repeat", infer=_repeat_rule, flops=lambda i, o, a: 0, attrs={"copies": REQUIRED}, n_inputs=1)
def hc_repeat(x, *, copies):
    return x.unsqueeze(1).expand(-1, copies, -1).contiguous()


def _mean_rule(ins, a):
    r = want_float(ins[0], "stream")
    return [TensorType(r.dtype, (r.shape[0], r.shape[2]))]


@op("hc_mean", infer=_mean_rule, flops=lambda i, o, a: i[0].numel, n_inputs=1)
def hc_mean(r):
    """Mean over the copies in fp32 (the DSpark taps, spec §4.1)."""
    return r.float().mean(dim=1).to(r.dtype)
