"""TileLang-Ascend vector-core templates for ascend950's quantising ops and RoPE: fp8 activation
quantisation (alone, after RMSNorm, after SwiGLU, after the routed experts' weighted SwiGLU), RoPE,
and RoPE followed by fp8 or fp4 quantisation. The kernel shape (row tiles over a persistent grid of
AI cores, SIMT regions on the UB, the buffer plan recorded by the allocations) is `ascend_vector`'s.

Numerics follow the references (ir/quant.py, spec §3.3-§3.4) and the Triton kernels:
- every value is rounded to its storage dtype where the reference rounds it (the normed, SwiGLU'd
  and rotated rows are bf16 before they are quantised);
- the ue8m0 scale 2^ceil(log2(amax / max)) and its exact reciprocal come from the bits of
  amax / max (`T.reinterpret` and integer shifts), not from log2;
- fp8 e4m3 values come from the SIMT cast to `float8_e4m3fn` of values clamped to +-448 (TileLang
  lowers it to the AscendC saturating conversion); fp4 e2m1 codes are counted against the grid's
  midpoints with the spec's tie rule, in integer code (TileLang has no e2m1 cast), two per byte,
  the even element in the low nibble; the e4m3 scale of the compressed KV is the fp8 cast of
  amax / 6 and divides the values;
- RoPE frequencies are theta^(-2i/d) with the YaRN ramp, computed by the kernel in fp32; angles
  are the fp32 products pos * f_i, reduced mod 2*pi in three exact steps before the fp32 cos/sin
  (Ascend's SIMT has no fp64), so angles below 2^20 rad keep their reduction exact to ~1e-7.
TileLang 0.1.15's Ascend backend cannot run a kernel on the CPU, so none of this has run: rendered
and capacity-checked here, built only where CANN's `bisheng` exists, never run on an Ascend 950,
nothing about them is verified.
"""
# no `from __future__ import annotations`: TileLang evaluates the prim_funcs' tensor hints

import functools
import math

from ...ir import quant as q
from ..targets import building
from ..template import KernelSource, KernelSpec, Template, register
from .ascend_common import BYTES, TL_DTYPE
from .ascend_vector import THREADS, UbPlan, default_threads, fsum, lowered, row_tiles, rows_width, source, static

FP8 = "float8_e4m3fn"


def _split(value: float, bits: int) -> float:
    """`value` rounded to `bits` significant bits (products with small integers stay exact)."""
    m, e = math.frexp(value)
    return math.ldexp(round(m * 2 ** bits), e - bits)


TWO_PI = 2 * math.pi
_C1 = _split(TWO_PI, 12)
_C2 = _split(TWO_PI - _C1, 12)
_C3 = TWO_PI - _C1 - _C2


# ---- quantisation steps, shared by every kernel below ------------------------------------------

def _fp8_quant(T, g: int, w: int, block: int, threads: int):
    """v [g, w] fp32 -> q [g, w] e4m3 and s [g, w/block] ue8m0 bytes; inv [g, w/block] fp32 scratch."""
    nb = w // block

    @T.macro
    def fp8_quant(v, qb, sb, inv):
        with T.SimtVF(threads=threads):
            for i, b in T.Parallel(g, nb):
                amax = T.alloc_var("float32", init=q.FP8_AMAX_FLOOR)
                for j in T.serial(block):
                    amax = T.max(amax, T.abs(v[i, b * block + j]))
                bits = T.reinterpret(amax / T.float32(448.0), "uint32")
                e = T.min((bits >> 23) + T.if_then_else((bits & T.uint32(0x7FFFFF)) != 0, T.uint32(1), T.uint32(0)),
                          T.uint32(254))
                sb[i, b] = T.cast(e, "uint8")
                inv[i, b] = T.reinterpret((T.uint32(254) - e) << 23, "float32")  # 1 / 2^(e - 127), exact
        with T.SimtVF(threads=threads):
            for i, j in T.Parallel(g, w):
                qb[i, j] = T.cast(T.max(T.min(v[i, j] * inv[i, j // block], T.float32(448.0)), T.float32(-448.0)), FP8)

    return fp8_quant


def _fp4_code(T, x):
    """e2m1 code (int32) of x: nearest on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even
    code, saturating at 6; bit 3 is the sign."""
    a = T.abs(x)
    c = fsum([T.cast(a > 0.25, "int32"), T.cast(a >= 0.75, "int32"), T.cast(a > 1.25, "int32"),
              T.cast(a >= 1.75, "int32"), T.cast(a > 2.5, "int32"), T.cast(a >= 3.5, "int32"),
              T.cast(a > 5.0, "int32")])
    return c | (T.cast(x < 0, "int32") << 3)


def _fp4_quant(T, g: int, w: int, block: int, e4m3: bool, threads: int):
    """v [g, w] fp32 -> packed codes q [g, w/2] bytes and s [g, w/block] (ue8m0 bytes, or e4m3
    scales that divide the values); inv [g, w/block] fp32 scratch."""
    nb = w // block
    floor = q.FP4_E4M3_AMAX_FLOOR if e4m3 else q.FP4_UE8M0_AMAX_FLOOR

    @T.macro
    def stats_ue8m0(v, sb, inv):
        with T.SimtVF(threads=threads):
            for i, b in T.Parallel(g, nb):
                amax = T.alloc_var("float32", init=floor)
                for j in T.serial(block):
                    amax = T.max(amax, T.abs(v[i, b * block + j]))
                bits = T.reinterpret(amax / T.float32(q.FP4_MAX), "uint32")
                e = T.min((bits >> 23) + T.if_then_else((bits & T.uint32(0x7FFFFF)) != 0, T.uint32(1), T.uint32(0)),
                          T.uint32(254))
                sb[i, b] = T.cast(e, "uint8")
                inv[i, b] = T.reinterpret((T.uint32(254) - e) << 23, "float32")

    @T.macro
    def stats_e4m3(v, sb, inv):
        with T.SimtVF(threads=threads):
            for i, b in T.Parallel(g, nb):
                amax = T.alloc_var("float32", init=floor)
                for j in T.serial(block):
                    amax = T.max(amax, T.abs(v[i, b * block + j]))
                sb[i, b] = T.cast(T.min(amax / T.float32(q.FP4_MAX), T.float32(448.0)), FP8)
                inv[i, b] = T.cast(sb[i, b], "float32")

    @T.macro
    def fp4_quant(v, qb, sb, inv):
        if e4m3:
            stats_e4m3(v, sb, inv)
        else:
            stats_ue8m0(v, sb, inv)
        with T.SimtVF(threads=threads):
            for i, p in T.Parallel(g, w // 2):
                if e4m3:
                    lo = v[i, 2 * p] / inv[i, (2 * p) // block]
                    hi = v[i, 2 * p + 1] / inv[i, (2 * p) // block]
                    qb[i, p] = T.cast(_fp4_code(T, lo) | (_fp4_code(T, hi) << 4), "uint8")
                else:
                    lo = v[i, 2 * p] * inv[i, (2 * p) // block]
                    hi = v[i, 2 * p + 1] * inv[i, (2 * p) // block]
                    qb[i, p] = T.cast(_fp4_code(T, lo) | (_fp4_code(T, hi) << 4), "uint8")

    return fp4_quant


def _quant_out(spec: KernelSpec):
    out = spec.out_types[0]
    return out.data, out.scale, out.block[-1]


def _is_row_quant(t, data: str, scale: str) -> bool:
    return getattr(t, "data", None) is not None and t.data.dtype.name == data and t.scale.dtype.name == scale \
        and all(b == 1 for b in t.block[:-1])


# ---- fp8 quantisation after a row-wise prologue -------------------------------------------------

@functools.lru_cache(maxsize=128)
def _quant_source(op: str, rows: int, w: int, block: int, attrs: tuple, g: int, tiles: int, grid: int,
                  threads: int):
    """quant_fp8: x [rows, w]; rms_norm_quant_fp8: x, norm weight [w]; swiglu_quant_fp8: gate, up;
    swiglu_weighted_quant_fp8: [gate | up] [rows, 2w], routing weights [tokens * k], pair ids."""
    import tilelang.ascend.language as T

    ub = UbPlan()
    a = dict(attrs)
    nb = w // block
    bf, f32 = "bfloat16", "float32"
    quant = _fp8_quant(T, g, w, block, threads)

    if op == "quant_fp8":
        @T.prim_func
        def quant_fp8(X: T.Tensor((rows, w), bf), Q: T.Tensor((rows, w), FP8), S: T.Tensor((rows, nb), "uint8")):
            with T.Kernel(grid) as core:
                xb = ub((g, w), "bf16")
                v = ub((g, w), "f32")
                qb = ub((g, w), "fp8e4m3")
                sb = ub((g, nb), "e8m0")
                inv = ub((g, nb), "f32")
                for t in T.Persistent([tiles], grid, core):
                    T.copy(X[t * g, 0], xb)
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(g, w):
                            v[i, j] = T.cast(xb[i, j], f32)
                    quant(v, qb, sb, inv)
                    T.copy(qb, Q[t * g, 0])
                    T.copy(sb, S[t * g, 0])
        return lowered(quant_fp8, ub)

    if op == "rms_norm_quant_fp8":
        lanes = 32  # partial sums of squares per row, added by one thread

        @T.prim_func
        def rms_norm_quant_fp8(X: T.Tensor((rows, w), bf), W: T.Tensor((w,), bf), Q: T.Tensor((rows, w), FP8),
                               S: T.Tensor((rows, nb), "uint8")):
            with T.Kernel(grid) as core:
                xb = ub((g, w), "bf16")
                v = ub((g, w), "f32")
                wb = ub((w,), "bf16")
                wf = ub((w,), "f32")
                part = ub((g, lanes), "f32")
                stat = ub((g,), "f32")
                qb = ub((g, w), "fp8e4m3")
                sb = ub((g, nb), "e8m0")
                inv = ub((g, nb), "f32")
                T.copy(W[0], wb)
                with T.SimtVF(threads=threads):
                    for j in T.Parallel(w):
                        wf[j] = T.cast(wb[j], f32)
                for t in T.Persistent([tiles], grid, core):
                    T.copy(X[t * g, 0], xb)
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(g, w):
                            v[i, j] = T.cast(xb[i, j], f32)
                    with T.SimtVF(threads=threads):
                        for i, p in T.Parallel(g, lanes):
                            acc = T.alloc_var("float32", init=0.0)
                            for k in T.serial(w // lanes):
                                acc = acc + v[i, k * lanes + p] * v[i, k * lanes + p]
                            part[i, p] = acc
                    with T.SimtVF(threads=threads):
                        for i in T.Parallel(g):
                            stat[i] = T.rsqrt(fsum([part[i, p] for p in range(lanes)]) / T.float32(w)
                                              + T.float32(a["eps"]))
                    # the normed row in x's dtype (bf16) is what the reference quantises
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(g, w):
                            v[i, j] = T.cast(T.cast(wf[j] * (v[i, j] * stat[i]), bf), f32)
                    quant(v, qb, sb, inv)
                    T.copy(qb, Q[t * g, 0])
                    T.copy(sb, S[t * g, 0])
        return lowered(rms_norm_quant_fp8, ub)

    limit = T.float32(a["limit"])

    def swiglu(gv, uv):
        gc = T.min(gv, limit)
        return gc / (T.float32(1.0) + T.exp(-gc)), T.max(T.min(uv, limit), -limit)

    if op == "swiglu_quant_fp8":
        @T.prim_func
        def swiglu_quant_fp8(G: T.Tensor((rows, w), bf), U: T.Tensor((rows, w), bf), Q: T.Tensor((rows, w), FP8),
                             S: T.Tensor((rows, nb), "uint8")):
            with T.Kernel(grid) as core:
                gb = ub((g, w), "bf16")
                ubf = ub((g, w), "bf16")
                v = ub((g, w), "f32")
                qb = ub((g, w), "fp8e4m3")
                sb = ub((g, nb), "e8m0")
                inv = ub((g, nb), "f32")
                for t in T.Persistent([tiles], grid, core):
                    T.copy(G[t * g, 0], gb)
                    T.copy(U[t * g, 0], ubf)
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(g, w):
                            s, uc = swiglu(T.cast(gb[i, j], f32), T.cast(ubf[i, j], f32))
                            v[i, j] = T.cast(T.cast(s * uc, bf), f32)
                    quant(v, qb, sb, inv)
                    T.copy(qb, Q[t * g, 0])
                    T.copy(sb, S[t * g, 0])
        return lowered(swiglu_quant_fp8, ub)

    n_weights = a["n_weights"]

    @T.prim_func
    def swiglu_weighted_quant_fp8(GU: T.Tensor((rows, 2 * w), bf), Wt: T.Tensor((n_weights,), f32),
                                  Pairs: T.Tensor((rows,), "int32"), Q: T.Tensor((rows, w), FP8),
                                  S: T.Tensor((rows, nb), "uint8")):
        with T.Kernel(grid) as core:
            gub = ub((g, 2 * w), "bf16")
            wv = ub((g,), "f32")
            v = ub((g, w), "f32")
            qb = ub((g, w), "fp8e4m3")
            sb = ub((g, nb), "e8m0")
            inv = ub((g, nb), "f32")
            for t in T.Persistent([tiles], grid, core):
                T.copy(GU[t * g, 0], gub)
                # a pair p is (token p // k, lane p % k): its weight is entry p of the [tokens, k] weights
                with T.SimtVF(threads=threads):
                    for i in T.Parallel(g):
                        wv[i] = Wt[Pairs[t * g + i]]
                with T.SimtVF(threads=threads):
                    for i, j in T.Parallel(g, w):
                        s, uc = swiglu(T.cast(gub[i, j], f32), T.cast(gub[i, w + j], f32))
                        v[i, j] = T.cast(T.cast((wv[i] * s) * uc, bf), f32)
                quant(v, qb, sb, inv)
                T.copy(qb, Q[t * g, 0])
                T.copy(sb, S[t * g, 0])
    return lowered(swiglu_weighted_quant_fp8, ub)


def _quant_dims(spec: KernelSpec):
    """(rows, width, block, extra attrs, GM bytes per row, UB bytes per tile row)."""
    data, scale, block = _quant_out(spec)
    rows, w = rows_width(data)
    nb = w // block
    extra = {}
    if spec.op == "rms_norm_quant_fp8":
        extra = {"eps": float(spec.attr["eps"])}
    elif spec.op.startswith("swiglu"):
        extra = {"limit": float(spec.attr["limit"])}
    if spec.op == "swiglu_weighted_quant_fp8":
        extra["n_weights"] = math.prod(spec.in_types[1].shape)
    x_row = {"swiglu_quant_fp8": 2 * w * 2, "swiglu_weighted_quant_fp8": 2 * w * 2}.get(spec.op, w * 2)
    gm = [x_row, w, nb]
    ub_row = x_row + 4 * w + w + nb + 4 * nb + (4 * 32 + 4 if spec.op == "rms_norm_quant_fp8" else 0)
    fixed = 6 * w if spec.op == "rms_norm_quant_fp8" else 0
    return rows, w, block, tuple(sorted(extra.items())), gm, ub_row, fixed


def _quant_supports(target, spec: KernelSpec) -> bool:
    out = spec.out_types[0]
    if not static(*spec.in_types) or not _is_row_quant(out, "fp8e4m3", "e8m0"):
        return False
    if spec.op == "swiglu_weighted_quant_fp8":
        gu, wt, pairs = spec.in_types
        if gu.dtype.name != "bf16" or wt.dtype.name != "f32" or pairs.dtype.name != "i32" or gu.rank != 2:
            return False
        if wt.rank != 2 or wt.shape[1] != spec.attr["k"]:  # pair p's weight is flat entry p of [tokens, k]
            return False
    elif any(t.dtype.name != "bf16" for t in spec.in_types):
        return False
    data, scale, block = _quant_out(spec)
    rows, w, block, extra, gm, ub_row, fixed = _quant_dims(spec)
    return w % block == 0 and w % 32 == 0 and row_tiles(target, rows, gm, ub_row, fixed) is not None


def _quant_render(target, spec: KernelSpec, config) -> KernelSource:
    rows, w, block, extra, gm, ub_row, fixed = _quant_dims(spec)
    g, tiles, grid = row_tiles(target, rows, gm, ub_row, fixed)
    threads = int(config["threads"])
    text = _quant_source(spec.op, rows, w, block, extra, g, tiles, grid, threads)
    return source(spec.op, text, grid, threads, [b * g for b in gm], config)


register(Template(
    name="ascend_quant_fp8", ops=("quant_fp8", "rms_norm_quant_fp8", "swiglu_quant_fp8", "swiglu_weighted_quant_fp8"),
    targets=building("ascendc"), knobs=THREADS, render=_quant_render, default_config=default_threads,
    supports=_quant_supports))


# ---- RoPE, RoPE + fp8 / fp4 ---------------------------------------------------------------------

def _select(T, j, values, lo: int = 0, hi: int | None = None):
    """values[j] for a loop index j, as a balanced tree of selects over constants."""
    hi = len(values) if hi is None else hi
    if hi - lo == 1:
        return T.float32(values[lo])
    mid = (lo + hi) // 2
    return T.if_then_else(j < mid, _select(T, j, values, lo, mid), _select(T, j, values, mid, hi))


@functools.lru_cache(maxsize=128)
def _rope_source(mode: str, rows: int, heads: int, d: int, rope_dim: int, dtype: str, freqs: tuple[float, ...],
                 inverse: bool, pos_offset: int, n_pos: int, pidx: str, block: int, e4m3: bool, g: int,
                 tiles: int, grid: int, threads: int):
    """Rows of d values (row r = token r // heads); the last rope_dim are rotated as interleaved
    pairs at position pos[token] + pos_offset. mode "rope": the rotated rows in x's dtype; "fp8":
    their per-`block` fp8 quantisation; "fp4": their fp4 quantisation (e4m3 or ue8m0 scales)."""
    import tilelang.ascend.language as T

    ub = UbPlan()
    tdt, f32 = TL_DTYPE[dtype], "float32"
    half, first = rope_dim // 2, d - rope_dim
    sign = T.float32(-1.0 if inverse else 1.0)
    nb = d // block

    @T.macro
    def load_freqs(fr):
        # the reference's fp32 frequencies (YaRN included), so the angles are its fp32 products
        with T.SimtVF(threads=threads):
            for j in T.Parallel(half):
                fr[j] = _select(T, j, freqs)

    if mode == "rope":
        def rounded(e):
            return T.cast(e, tdt)
    else:
        def rounded(e):  # the rotated tail in x's dtype is what the reference quantises
            return T.cast(T.cast(e, tdt), f32)

    @T.macro
    def rotate(buf, fr, Pos, t):
        with T.SimtVF(threads=threads):
            for i, p in T.Parallel(g, half):
                pos = T.cast(Pos[(t * g + i) // heads] + pos_offset, f32)
                ang = (pos * fr[p]) * sign
                # ang - k * 2pi in exact steps: k split in 10-bit halves times 12-bit parts of 2pi
                k = T.floor(ang * T.float32(1.0 / TWO_PI) + T.float32(0.5))
                kh = T.floor(k * T.float32(2.0 ** -10)) * T.float32(1024.0)
                kl = k - kh
                r = T.alloc_var("float32")  # held in registers, not re-evaluated per use
                cs = T.alloc_var("float32")
                sn = T.alloc_var("float32")
                r = ((((ang - kh * T.float32(_C1)) - kl * T.float32(_C1)) - kh * T.float32(_C2))
                     - kl * T.float32(_C2)) - k * T.float32(_C3)
                cs = T.cos(r)
                sn = T.sin(r)
                re = T.cast(buf[i, first + 2 * p], f32)
                im = T.cast(buf[i, first + 2 * p + 1], f32)
                buf[i, first + 2 * p] = rounded(re * cs - im * sn)
                buf[i, first + 2 * p + 1] = rounded(re * sn + im * cs)

    if mode == "rope":
        @T.prim_func
        def rope(X: T.Tensor((rows, d), tdt), Pos: T.Tensor((n_pos,), TL_DTYPE[pidx]), Y: T.Tensor((rows, d), tdt)):
            with T.Kernel(grid) as core:
                fr = ub((half,), "f32")
                xb = ub((g, d), dtype)
                load_freqs(fr)
                for t in T.Persistent([tiles], grid, core):
                    T.copy(X[t * g, 0], xb)
                    rotate(xb, fr, Pos, t)
                    T.copy(xb, Y[t * g, 0])
        return lowered(rope, ub)

    fp4 = mode == "fp4"
    quant = _fp4_quant(T, g, d, block, e4m3, threads) if fp4 else _fp8_quant(T, g, d, block, threads)
    qw, qdt = (d // 2, "uint8") if fp4 else (d, FP8)
    sdt = FP8 if e4m3 else "uint8"

    @T.prim_func
    def rope_quant(X: T.Tensor((rows, d), tdt), Pos: T.Tensor((n_pos,), TL_DTYPE[pidx]), Q: T.Tensor((rows, qw), qdt),
                   S: T.Tensor((rows, nb), sdt)):
        with T.Kernel(grid) as core:
            fr = ub((half,), "f32")
            xb = ub((g, d), dtype)
            v = ub((g, d), "f32")
            qb = ub((g, qw), "u8" if fp4 else "fp8e4m3")
            sb = ub((g, nb), "fp8e4m3" if e4m3 else "e8m0")
            inv = ub((g, nb), "f32")
            load_freqs(fr)
            for t in T.Persistent([tiles], grid, core):
                T.copy(X[t * g, 0], xb)
                with T.SimtVF(threads=threads):
                    for i, j in T.Parallel(g, d):
                        v[i, j] = T.cast(xb[i, j], f32)
                rotate(v, fr, Pos, t)
                quant(v, qb, sb, inv)
                T.copy(qb, Q[t * g, 0])
                T.copy(sb, S[t * g, 0])
    return lowered(rope_quant, ub)


def _rope_dims(spec: KernelSpec):
    """(mode, rows, heads, d, x dtype, fp32 frequencies, quant block, e4m3 scale, GM / UB bytes per row)."""
    from ...ir.ops.attention import yarn_freqs

    x, pos = spec.in_types[:2]
    a = spec.attr
    rows, d = rows_width(x)
    heads = rows // x.shape[0]
    freqs = tuple(float(f) for f in yarn_freqs(a["rope_dim"], float(a["theta"]), a["yarn"]).tolist())
    e = BYTES[x.dtype.name]
    if spec.op == "rope":
        return "rope", rows, heads, d, x.dtype.name, freqs, 1, False, [d * e, d * e], d * e
    data, scale, block = _quant_out(spec)
    e4m3 = scale.dtype.name == "fp8e4m3"
    mode = "fp4" if data.dtype.name == "fp4e2m1" else "fp8"
    nb = d // block
    gm = [d * e, d // 2 if mode == "fp4" else d, nb]
    return mode, rows, heads, d, x.dtype.name, freqs, block, e4m3, gm, d * e + 4 * d + gm[1] + nb + 4 * nb


def _rope_supports(target, spec: KernelSpec) -> bool:
    x, pos = spec.in_types[:2]
    a = spec.attr
    if not static(x, pos) or x.dtype.name not in ("bf16", "f16", "f32") or pos.dtype.name not in ("i32", "i64"):
        return False
    if x.rank < 2 or a["rope_dim"] % 2 or a["rope_dim"] > x.shape[-1]:
        return False
    if spec.op == "rope_quant_fp8" and not _is_row_quant(spec.out_types[0], "fp8e4m3", "e8m0"):
        return False
    if spec.op == "rope_quant_fp4":
        out = spec.out_types[0]
        if getattr(out, "data", None) is None or out.data.dtype.name != "fp4e2m1" or any(b != 1 for b in out.block[:-1]):
            return False
        if out.block[-1] % 2 or out.scale.dtype.name not in ("e8m0", "fp8e4m3"):
            return False
    mode, rows, heads, d, dtype, freqs, block, e4m3, gm, per_row = _rope_dims(spec)
    return d % block == 0 and row_tiles(target, rows, gm, per_row, 4 * d) is not None


def _rope_render(target, spec: KernelSpec, config) -> KernelSource:
    mode, rows, heads, d, dtype, freqs, block, e4m3, gm, per_row = _rope_dims(spec)
    g, tiles, grid = row_tiles(target, rows, gm, per_row, 4 * d)
    threads = int(config["threads"])
    a = spec.attr
    pos = spec.in_types[1]
    text = _rope_source(mode, rows, heads, d, a["rope_dim"], dtype, freqs, bool(a.get("inverse", False)),
                        int(a["pos_offset"]), pos.shape[0], pos.dtype.name, block, e4m3, g, tiles, grid, threads)
    return source("rope" if mode == "rope" else "rope_quant", text, grid, threads, [b * g for b in gm], config)


register(Template(
    name="ascend_rope", ops=("rope", "rope_quant_fp8", "rope_quant_fp4"), targets=building("ascendc"), knobs=THREADS,
    render=_rope_render, default_config=default_threads, supports=_rope_supports))
