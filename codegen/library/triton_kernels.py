"""Triton kernels for the row-wise, gather and small ops of V4.1 (their host launchers are in
`triton_launchers`: an instance ships this module's text alone, so a launcher edit rebuilds nothing).

This module imports only torch and triton: the Triton build compiles it from its source text, and
the CPU tests load a second copy of it under TRITON_INTERPRET=1 (whether a `@triton.jit` function
is interpreted is decided when the module is executed).

Numerics (the reference semantics are in ir/ops, pinned by ir/numerics.py):
- reductions and transcendentals run in fp32 (the references accumulate in fp64 and round once);
- every rounding that the reference does bit-exactly is done bit-exactly here, by integer code
  rather than by a dtype cast: fp32 -> bf16 (round to nearest even), fp32 -> fp8 e4m3 (nearest
  even, subnormals included), the power-of-two ue8m0 scales (`2^ceil(log2(v))` from the bits of
  v), fp4 e2m1 codes with the spec's tie rule. The interpreter's own fp8 and bf16 casts do not
  round to nearest even (Triton 3.9), and this way the interpreter and the GPU run the same
  arithmetic;
- divisions whose rounding matters (amax / 448, x / e4m3 scale) use `div_rn` (IEEE), since `/`
  on fp32 is an approximate division on NVIDIA;
- RoPE angles are the reference's fp32 products pos * f_i; they are reduced mod 2*pi in fp64
  before the fp32 cos/sin, so positions up to 2^20 keep ~1e-6 absolute accuracy.
Quantised outputs are written as raw bytes: launchers hand `uint8` views of fp8 tensors.
"""
from __future__ import annotations

import triton
import triton.language as tl

# ---- exact rounding helpers ---------------------------------------------------------------------


@triton.jit
def _bf16_rne(v):
    """fp32 -> the fp32 value of its bf16 rounding (nearest, ties to even)."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _round_like(v, dtype: tl.constexpr):
    """fp32 value rounded to `dtype` and back to fp32 (the reference's `.to(x.dtype)`)."""
    if dtype == tl.bfloat16:
        v = _bf16_rne(v)
    elif dtype == tl.float16:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _store_as(ptr, v, mask):
    v = _round_like(v, ptr.dtype.element_ty)
    tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _e4m3_bits(x):
    """fp32 within +-448 -> e4m3fn byte (int32), round to nearest even, subnormals included."""
    b = x.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    af = a.to(tl.float32, bitcast=True)
    norm = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # drop 20 mantissa bits; rebias 127 -> 7
    sub = ((af * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # RNE of |x| / 2^-9, 0..8
    return tl.where(af < 0.015625, sub, norm) | sign


@triton.jit
def _e4m3_value(code):
    """e4m3fn byte (int32, no NaN) -> fp32."""
    e = (code >> 3) & 0xF
    m = (code & 7).to(tl.float32)
    p = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-10)
    v = tl.where(e == 0, m * 0.001953125, (m + 8.0) * p)
    return tl.where((code & 0x80) != 0, -v, v)


@triton.jit
def _pow2_ceil_scale(v):
    """For v > 0 normal: the ue8m0 byte of s = 2^ceil(log2(v)), and 1/s (both exact)."""
    b = v.to(tl.int32, bitcast=True)
    byte = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(tl.int32)
    byte = tl.minimum(byte, 254)
    inv = ((254 - byte) << 23).to(tl.float32, bitcast=True)
    return byte, inv


@triton.jit
def _fp8_block_quant(v):
    """v [NB, BLK] fp32 -> (e4m3 bytes [NB, BLK], ue8m0 bytes [NB]) per spec §3.3."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-4)
    byte, inv = _pow2_ceil_scale(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
    q = _e4m3_bits(tl.clamp(v * inv[:, None], -448.0, 448.0))
    return q, byte


@triton.jit
def _fp4_code(v):
    """Round to the e2m1 grid, ties to even, saturating at 6; returns codes 0..15 (int32)."""
    a = tl.abs(v)
    c = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return c | ((v < 0).to(tl.int32) << 3)


@triton.jit
def _cos_sin(ang):
    """cos and sin of fp32 angles: reduced mod 2*pi in fp64 first (angles reach ~1e6 rad)."""
    a = ang.to(tl.float64)
    k = tl.floor(a * 0.15915494309189535 + 0.5)
    r = ((a - k * 6.283185307179586) - k * 2.4492935982947064e-16).to(tl.float32)
    return tl.cos(r), tl.sin(r)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


# ---- RMSNorm (+ fp8 quant), fp8 quant -----------------------------------------------------------


@triton.jit
def _rstd(ss, H: tl.constexpr, eps):
    """1 / sqrt(mean(x^2) + eps) from fp64 sums of squares `ss`, as the reference computes it
    (numerics mean_sq32, rsqrt32): the mean in fp64 rounded to fp32, eps added in fp32, 1/sqrt in
    fp64 rounded to fp32. The squares of bf16 values are exact in fp64 and so, at a row's range of
    magnitudes, is their sum: every kernel that normalises a row (rms_norm_kernel, the fused key
    write) gets the same rstd whatever its tile order, so decode and prefill graphs agree."""
    ms = (tl.sum(tl.sum(ss, axis=1), axis=0) / H).to(tl.float32) + eps
    return (1.0 / tl.sqrt(ms.to(tl.float64))).to(tl.float32)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, eps, H: tl.constexpr, BLOCK_H: tl.constexpr,
                    QUANT: tl.constexpr):
    """One row per program; pass 1 sums squares, pass 2 writes w * (x * rstd) in x's dtype, or
    (QUANT) its per-32 fp8 quantisation. BLOCK_H is a multiple of 32."""
    row = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = BLOCK_H // 32
    cols = tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :]
    ss = tl.zeros([NB, 32], tl.float64)
    for c0 in range(0, H, BLOCK_H):
        m = (c0 + cols) < H
        x = tl.load(x_ptr + row * H + c0 + cols, mask=m, other=0.0).to(tl.float64)
        ss += x * x
    rstd = _rstd(ss, H, eps)
    for c0 in range(0, H, BLOCK_H):
        m = (c0 + cols) < H
        x = tl.load(x_ptr + row * H + c0 + cols, mask=m, other=0.0)
        w = tl.load(w_ptr + c0 + cols, mask=m, other=0.0).to(tl.float32)
        y = _round_like(w * (x.to(tl.float32) * rstd), x.dtype)
        if QUANT:
            q, sb = _fp8_block_quant(y)
            tl.store(q_ptr + row * H + c0 + cols, q.to(tl.uint8), mask=m)
            bm = (c0 // 32 + tl.arange(0, NB)) < H // 32
            tl.store(s_ptr + row * (H // 32) + c0 // 32 + tl.arange(0, NB), sb.to(tl.uint8), mask=bm)
        else:
            tl.store(y_ptr + row * H + c0 + cols, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def quant_fp8_kernel(x_ptr, q_ptr, s_ptr, N: tl.constexpr, BLOCK: tl.constexpr, BLK: tl.constexpr,
                     NR: tl.constexpr, ROWS: tl.constexpr):
    """Rows of N values, per-BLK fp8 with ue8m0 scales; program (ROWS rows of NR, chunk of BLOCK):
    one row's chunk is too little work to hide a program's latency at prefill's row counts."""
    NB: tl.constexpr = BLOCK // BLK
    i = tl.arange(0, ROWS * NB)
    row = tl.program_id(0).to(tl.int64) * ROWS + i // NB
    b = tl.program_id(1) * NB + i % NB
    cols = b[:, None] * BLK + tl.arange(0, BLK)[None, :]
    live = row < NR
    m = (cols < N) & live[:, None]
    x = tl.load(x_ptr + row[:, None] * N + cols, mask=m, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    byte, inv = _pow2_ceil_scale(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
    q = _e4m3_bits(tl.clamp(x * inv[:, None], -448.0, 448.0))
    tl.store(q_ptr + row[:, None] * N + cols, q.to(tl.uint8), mask=m)
    tl.store(s_ptr + row * (N // BLK) + b, byte.to(tl.uint8), mask=(b < N // BLK) & live)


# ---- RoPE (+ fp8 / fp4 quant) -------------------------------------------------------------------


@triton.jit
def _rope_pairs(xe, xo, pos_ptr, freq_ptr, tok, pos_offset, D: tl.constexpr, ROPE: tl.constexpr,
                INVERSE: tl.constexpr, BLK: tl.constexpr, NB: tl.constexpr):
    """A vector of D given as its even and odd elements in tiles [NB, BLK/2] (NB blocks of BLK
    elements), its last ROPE elements rotated at token tok's position, rounded to xe's dtype: a
    quantisation block is one tile row and an fp4 byte is one pair."""
    HP: tl.constexpr = BLK // 2
    pair = tl.arange(0, NB)[:, None] * HP + tl.arange(0, HP)[None, :]  # pair index i
    m = pair < D // 2
    j = pair - (D - ROPE) // 2  # rotated pair j uses f_j
    rot = (j >= 0) & m
    f = tl.load(freq_ptr + tl.where(rot, j, 0), mask=rot, other=0.0)
    pos = (tl.load(pos_ptr + tok).to(tl.int64) + pos_offset).to(tl.float32)
    ang = pos * f
    if INVERSE:
        ang = -ang
    c, s = _cos_sin(ang)
    re = xe.to(tl.float32)
    im = xo.to(tl.float32)
    ye = tl.where(rot, _round_like(re * c - im * s, xe.dtype), re)
    yo = tl.where(rot, _round_like(re * s + im * c, xe.dtype), im)
    return ye, yo


@triton.jit
def _rope_tile(x_ptr, pos_ptr, freq_ptr, r, pos_offset, HEADS: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
               INVERSE: tl.constexpr, BLK: tl.constexpr, NB: tl.constexpr):
    """Vector r (row r // HEADS) rotated by _rope_pairs."""
    HP: tl.constexpr = BLK // 2
    # the vector read whole and split into its even and odd elements in registers: two loads of
    # every other element touched each sector twice, at half the width a load can take
    cols = tl.arange(0, NB)[:, None] * BLK + tl.arange(0, BLK)[None, :]
    xe, xo = tl.split(tl.reshape(tl.load(x_ptr + r * D + cols, mask=cols < D, other=0.0), [NB, HP, 2]))
    return _rope_pairs(xe, xo, pos_ptr, freq_ptr, r // HEADS, pos_offset, D, ROPE, INVERSE, BLK, NB)


@triton.jit
def _fp8_tile(ye, yo, NB: tl.constexpr, BLK: tl.constexpr):
    """The pair tiles quantised to fp8 per BLK (ue8m0 scales): (bytes [NB, BLK], scale bytes [NB])."""
    amax = tl.maximum(tl.max(tl.abs(ye), axis=1), tl.max(tl.abs(yo), axis=1))
    byte, inv = _pow2_ceil_scale(tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32)))
    qe = _e4m3_bits(tl.clamp(ye * inv[:, None], -448.0, 448.0))
    qo = _e4m3_bits(tl.clamp(yo * inv[:, None], -448.0, 448.0))
    return tl.reshape(tl.join(qe.to(tl.uint8), qo.to(tl.uint8)), [NB, BLK]), byte


@triton.jit
def rope_kernel(x_ptr, pos_ptr, freq_ptr, y_ptr, q_ptr, s_ptr, pos_offset,
                HEADS: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr,
                MODE: tl.constexpr, BLK: tl.constexpr, NB: tl.constexpr):
    """One vector of D per program (row r = token * HEADS + head), rotated by _rope_tile. MODE 0:
    rotated vector in x's dtype; 1: fp8 per-32 ue8m0; 2: fp4 per-32 ue8m0; 3: fp4 per-16 e4m3 scale."""
    r = tl.program_id(0).to(tl.int64)
    ye, yo = _rope_tile(x_ptr, pos_ptr, freq_ptr, r, pos_offset, HEADS, D, ROPE, INVERSE, BLK, NB)
    HP: tl.constexpr = BLK // 2
    pair = tl.arange(0, NB)[:, None] * HP + tl.arange(0, HP)[None, :]
    m = pair < D // 2
    cols = tl.arange(0, NB)[:, None] * BLK + tl.arange(0, BLK)[None, :]
    if MODE == 0:
        y = tl.reshape(tl.join(ye.to(y_ptr.dtype.element_ty), yo.to(y_ptr.dtype.element_ty)), [NB, BLK])
        tl.store(y_ptr + r * D + cols, y, mask=cols < D)
    else:
        bidx = tl.arange(0, NB)
        bm = bidx < D // BLK
        if MODE == 1:
            q, byte = _fp8_tile(ye, yo, NB, BLK)
            tl.store(q_ptr + r * D + cols, q, mask=cols < D)
            tl.store(s_ptr + r * (D // BLK) + bidx, byte.to(tl.uint8), mask=bm)
        else:
            amax = tl.maximum(tl.max(tl.abs(ye), axis=1), tl.max(tl.abs(yo), axis=1))
            if MODE == 2:
                # floor 6 * 2^-126 (spec §3.4)
                byte, inv = _pow2_ceil_scale(tl.math.div_rn(tl.maximum(amax, 7.052966104933725e-38),
                                                            tl.full(amax.shape, 6.0, tl.float32)))
                ce = _fp4_code(ye * inv[:, None])
                co = _fp4_code(yo * inv[:, None])
            else:
                sb = _e4m3_bits(tl.minimum(tl.math.div_rn(tl.maximum(amax, 0.01171875),
                                                         tl.full(amax.shape, 6.0, tl.float32)), 448.0))
                sv = _e4m3_value(sb)[:, None]
                ce = _fp4_code(tl.math.div_rn(ye, tl.broadcast_to(sv, ye.shape)))
                co = _fp4_code(tl.math.div_rn(yo, tl.broadcast_to(sv, yo.shape)))
                byte = sb
            tl.store(q_ptr + r * (D // 2) + pair, (ce | (co << 4)).to(tl.uint8), mask=m)
            tl.store(s_ptr + r * (D // BLK) + bidx, byte.to(tl.uint8), mask=bm)


@triton.jit
def rope_fp8_ring_kernel(x_ptr, w_ptr, pos_ptr, freq_ptr, q_ptr, s_ptr, seq_ptr, slots_ptr, newest_ptr, ring_ptr,
                         rings_ptr, pos_offset, eps, D: tl.constexpr, ROPE: tl.constexpr, BLK: tl.constexpr,
                         NB: tl.constexpr, L: tl.constexpr, KEEP_ALL: tl.constexpr, NORM: tl.constexpr = 0):
    """rope_kernel's MODE 1 for a window key row, whose fp8 bytes and scales also go to its
    sequence's ring entry (slot, pos mod L) if the ring keeps the row (ring_write_kernel's rule and
    KEEP_ALL): the decode steps' RoPE + quantisation + ring write (rope_quant_fp8_cache_write).
    NORM: the row is first its RMSNorm w * (x * rstd) in x's dtype (the whole row is one tile:
    norm_rope_quant_fp8_cache_write)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, NB)[:, None] * BLK + tl.arange(0, BLK)[None, :]
    if NORM:
        HP: tl.constexpr = BLK // 2
        x = tl.load(x_ptr + r * D + cols, mask=cols < D, other=0.0)
        xf = x.to(tl.float32)
        x64 = xf.to(tl.float64)
        rstd = _rstd(x64 * x64, D, eps)  # rms_norm_kernel's, so the prefill graph's keys agree
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        xn = _round_like(w * (xf * rstd), x.dtype).to(x.dtype)  # exact: the rotation rounds to its dtype
        xe, xo = tl.split(tl.reshape(xn, [NB, HP, 2]))
        ye, yo = _rope_pairs(xe, xo, pos_ptr, freq_ptr, r, pos_offset, D, ROPE, 0, BLK, NB)
    else:
        ye, yo = _rope_tile(x_ptr, pos_ptr, freq_ptr, r, pos_offset, 1, D, ROPE, 0, BLK, NB)
    q, byte = _fp8_tile(ye, yo, NB, BLK)
    bidx = tl.arange(0, NB)
    bm = bidx < D // BLK
    tl.store(q_ptr + r * D + cols, q, mask=cols < D)
    tl.store(s_ptr + r * (D // BLK) + bidx, byte.to(tl.uint8), mask=bm)
    keep, entry = _ring_entry(pos_ptr, seq_ptr, slots_ptr, newest_ptr, r, L, KEEP_ALL)
    if keep:
        tl.store(ring_ptr + entry * D + cols, q, mask=cols < D)
        tl.store(rings_ptr + entry * (D // BLK) + bidx, byte.to(tl.uint8), mask=bm)


# ---- mHC ----------------------------------------------------------------------------------------


@triton.jit
def _hc_mix(r_ptr, fn_ptr, rows64, rmask, k_lo, k_hi, K: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
            BK: tl.constexpr):
    """Mix GEMM over K columns [k_lo, k_hi) of BM rows: the pre|post and the C*C mix columns
    (16 each) as two fp32 dots, and the rows' sum of squares. The dots run on tf32 MMAs in three
    passes (tf32x3: fn as a tf32 high part plus a tf32 low part; x, bf16, is exact in tf32): near
    fp32 accuracy, where ieee fp32 dots on the CUDA cores made a prefill's mixes take 44x their bytes."""
    jj = tl.arange(0, 16)
    acc_pp = tl.zeros([BM, 16], tl.float32)
    acc_m = tl.zeros([BM, 16], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < k_hi
        x = tl.load(r_ptr + rows64[:, None] * K + kk[None, :], mask=rmask[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
        fpp = tl.load(fn_ptr + jj[None, :] * K + kk[:, None], mask=km[:, None] & (jj[None, :] < 2 * C),
                      other=0.0)
        fm = tl.load(fn_ptr + (2 * C + jj[None, :]) * K + kk[:, None], mask=km[:, None], other=0.0)
        acc_pp += tl.dot(x, fpp, input_precision="tf32x3")
        acc_m += tl.dot(x, fm, input_precision="tf32x3")
    return acc_pp, acc_m, ss


@triton.jit
def _tf32_high(v):
    """v rounded to tf32's 10 mantissa bits (to nearest, ties away from zero): v minus it is exact
    in fp32 and at most 2^-11 of v, so the two as tf32 MMA operands carry v to about 2^-21."""
    return ((v.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


# hc_mix_split_kernel's partials: [SPLIT, n, HC_PART] fp32, per (split, row) the mix GEMM's 2C + C*C
# columns (pre|post, then the C*C mix), then the rows' sum of squares and the collapse's
HC_PART = tl.constexpr(32)


@triton.jit
def hc_mix_split_kernel(r_ptr, fn_ptr, part_ptr, prein_ptr, xc_ptr, n, C: tl.constexpr, H: tl.constexpr,
                        SPLIT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, COLLAPSE: tl.constexpr,
                        X2: tl.constexpr):
    """Program (row block, split s): for the s-th range of H and every copy c, the mix GEMM's K
    columns c*H + h into part[s, row] (HC_PART). With COLLAPSE (hc_pre), also the collapse
    sum_c pre_in[c] * R[c, h] of the same loaded copies, rounded to R's dtype, into xc, and that
    rounded value's sum of squares: the RMSNorm's statistic. Few rows (decode) leave most SMs idle
    with one program per row block; splitting H spreads the weight's 2*C + C*C rows and the rows'
    copies over the GPU. A step loads every copy's rows and weight columns as one tile each, so
    they are in flight together: a program is one round trip to memory, not one per copy. X2: the
    dots as two tf32 MMAs over fn's tf32 high and low parts (x, bf16, is exact in tf32), where
    tf32x3 takes three and splits x too: fewer registers a row block (a 128-row block on 8 warps
    holds two programs an SM)."""
    K: tl.constexpr = C * H
    NJ: tl.constexpr = 2 * C + C * C
    HS: tl.constexpr = (H + SPLIT * BK - 1) // (SPLIT * BK) * BK
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < n
    rows64 = rows.to(tl.int64)
    s = tl.program_id(1)
    h_lo = s * HS
    h_hi = tl.minimum(h_lo + HS, H)
    cc = tl.arange(0, C)
    jj = tl.arange(0, HC_PART)
    acc = tl.zeros([BM, HC_PART], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    ss2 = tl.zeros([BM], tl.float32)
    for h0 in range(h_lo, h_hi, BK):
        hh = h0 + tl.arange(0, BK)
        hm = hh < h_hi
        kk = cc[:, None] * H + hh[None, :]
        if BM < 16:
            # at most 4 rows (_hc_pre_by_rows): broadcast FMAs row by row, where a 16-row dot
            # would compute mostly padding; from 8 rows up the tf32x3 dots below are faster
            f = tl.load(fn_ptr + jj[None, None, :] * K + kk[:, :, None],
                        mask=hm[None, :, None] & (jj < NJ)[None, None, :], other=0.0)
            for r in tl.static_range(BM):
                row = tl.program_id(0) * BM + r
                xr = tl.load(r_ptr + row.to(tl.int64) * K + kk, mask=(kk * 0 + row < n) & hm[None, :],
                             other=0.0).to(tl.float32)
                sel = tl.arange(0, BM) == r
                acc += tl.where(sel[:, None], tl.sum(tl.sum(xr[:, :, None] * f, axis=1), axis=0)[None, :], 0.0)
                ss += tl.where(sel, tl.sum(tl.sum(xr * xr, axis=1), axis=0), 0.0)
                if COLLAPSE:
                    pr = tl.load(prein_ptr + row.to(tl.int64) * C + cc, mask=cc * 0 + row < n, other=0.0)
                    xc = _round_like(tl.sum(pr[:, None] * xr, axis=0), r_ptr.dtype.element_ty)
                    ss2 += tl.where(sel, tl.sum(xc * xc, axis=0), 0.0)
                    tl.store(xc_ptr + row.to(tl.int64) * H + hh, xc.to(xc_ptr.dtype.element_ty),
                             mask=(hh * 0 + row < n) & hm)
        else:
            # the block's rows from one 64-bit base and 32-bit offsets inside it: a 64-bit address
            # an element takes two registers each
            x = tl.load(r_ptr + (tl.program_id(0) * BM).to(tl.int64) * K + (tl.arange(0, BM) * K)[:, None, None]
                        + kk[None, :, :], mask=rmask[:, None, None] & hm[None, None, :], other=0.0).to(tl.float32)
            f = tl.load(fn_ptr + jj[None, None, :] * K + kk[:, :, None],
                        mask=hm[None, :, None] & (jj < NJ)[None, None, :], other=0.0)
            xr, fr = tl.reshape(x, [BM, C * BK]), tl.reshape(f, [C * BK, HC_PART])
            if X2:
                fh = _tf32_high(fr)
                acc += tl.dot(xr, fh, input_precision="tf32")
                acc += tl.dot(xr, fr - fh, input_precision="tf32")
            else:
                # tf32x3, as _hc_mix: x (bf16) is exact in tf32 and fn a tf32 high plus low part, so
                # near-fp32 products on the tensor cores, not ieee dots on the CUDA cores
                acc += tl.dot(xr, fr, input_precision="tf32x3")
            ss += tl.sum(tl.sum(x * x, axis=2), axis=1)
            if COLLAPSE:
                p = tl.load(prein_ptr + rows64[:, None] * C + cc[None, :], mask=rmask[:, None], other=0.0)
                xc = _round_like(tl.sum(p[:, :, None] * x, axis=1), r_ptr.dtype.element_ty)
                ss2 += tl.sum(xc * xc, axis=1)
                tl.store(xc_ptr + rows64[:, None] * H + hh[None, :], xc.to(xc_ptr.dtype.element_ty),
                         mask=rmask[:, None] & hm[None, :])
    base = part_ptr + (s * n + rows64) * HC_PART
    tl.store(base[:, None] + jj[None, :], acc, mask=rmask[:, None] & (jj < NJ)[None, :])
    tl.store(base + NJ, ss, mask=rmask)
    tl.store(base + NJ + 1, ss2, mask=rmask)


@triton.jit
def _hc_split_sum(part_ptr, n, rows64, rmask, col0, W: tl.constexpr, WM: tl.constexpr, SPLIT: tl.constexpr):
    """[R, W] sums over the splits of part[:, rows, col0 + j] (columns j >= WM read as 0): each
    lane adds its splits of every 32 in turn, then the 32 are summed, so the SPLIT loads have no
    reduction between them and are in flight together."""
    sp = tl.arange(0, 32)
    ww = tl.arange(0, W)
    m = rmask[:, None, None] & (ww < WM)[None, None, :]
    tot = tl.zeros([rows64.shape[0], 32, W], tl.float32)
    for s0 in tl.static_range(0, SPLIT, 32):
        sm = (s0 + sp) < SPLIT
        off = ((s0 + sp[None, :, None]) * n + rows64[:, None, None]) * HC_PART + col0 + ww[None, None, :]
        tot += tl.load(part_ptr + off, mask=m & sm[None, :, None], other=0.0)
    return tl.sum(tot, axis=1)


@triton.jit
def _hc_mix_out(acc_pp, acc_m, ss, scale_ptr, base_ptr, pre_ptr, post_ptr, m_ptr, eps, hc_eps, post_mult,
                rows64, rmask, C: tl.constexpr, H: tl.constexpr, ITERS: tl.constexpr):
    """From the mix GEMM's columns ([R, 16] pre|post and [R, 16] mix) and the rows' sum of squares
    over C*H: the RMS statistic, pre and post, and Sinkhorn on [R, C, C] in registers; stored to
    pre, post and m."""
    K: tl.constexpr = C * H
    R: tl.constexpr = rows64.shape[0]
    jj = tl.arange(0, 16)
    rms = tl.math.rsqrt(ss / K + eps)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    bpp = tl.load(base_ptr + jj, mask=jj < 2 * C, other=0.0)
    zpp = acc_pp * rms[:, None] * tl.where(jj < C, s0, s1)[None, :] + bpp[None, :]
    pre = _sigmoid(zpp) + hc_eps
    post = post_mult * _sigmoid(zpp)
    tl.store(pre_ptr + rows64[:, None] * C + jj[None, :], pre, mask=rmask[:, None] & (jj[None, :] < C))
    tl.store(post_ptr + rows64[:, None] * C + (jj[None, :] - C), post,
             mask=rmask[:, None] & (jj[None, :] >= C) & (jj[None, :] < 2 * C))
    bm_ = tl.load(base_ptr + 2 * C + jj)
    z = acc_m * rms[:, None] * s2 + bm_[None, :]
    m3 = tl.reshape(z, [R, C, C])
    e = tl.exp(m3 - tl.max(m3, axis=2)[:, :, None])
    m3 = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    m3 = m3 / (tl.sum(m3, axis=1)[:, None, :] + hc_eps)
    for _ in range(ITERS - 1):
        m3 = m3 / (tl.sum(m3, axis=2)[:, :, None] + hc_eps)
        m3 = m3 / (tl.sum(m3, axis=1)[:, None, :] + hc_eps)
    tl.store(m_ptr + rows64[:, None] * (C * C) + jj[None, :], tl.reshape(m3, [R, 16]), mask=rmask[:, None])


@triton.jit
def _hc_mixes(r_ptr, fn_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, m_ptr, part_ptr, n, eps, hc_eps, post_mult,
              row0, C: tl.constexpr, H: tl.constexpr, ITERS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
              SPLIT: tl.constexpr):
    """An mHC entry's mixes. SPLIT == 1: rows row0 .. row0 + BM, the mix GEMM [BM, C*H] x fn^T
    here. SPLIT > 1: row row0 alone, its columns summed over hc_mix_split_kernel's partials (a
    program per row: the sums are where the time goes, and rows are independent)."""
    K: tl.constexpr = C * H
    if SPLIT == 1:
        rows = row0 + tl.arange(0, BM)
        acc_pp, acc_m, ss = _hc_mix(r_ptr, fn_ptr, rows.to(tl.int64), rows < n, 0, K, K, C, BM, BK)
        _hc_mix_out(acc_pp, acc_m, ss, scale_ptr, base_ptr, pre_ptr, post_ptr, m_ptr, eps, hc_eps, post_mult,
                    rows.to(tl.int64), rows < n, C, H, ITERS)
    else:
        rows64 = row0.to(tl.int64) + tl.zeros([1], tl.int64)
        rmask = rows64 < n
        acc_pp = _hc_split_sum(part_ptr, n, rows64, rmask, 0, 16, 2 * C, SPLIT)
        acc_m = _hc_split_sum(part_ptr, n, rows64, rmask, 2 * C, 16, 16, SPLIT)
        ss = tl.sum(_hc_split_sum(part_ptr, n, rows64, rmask, 2 * C + C * C, 2, 1, SPLIT), axis=1)
        _hc_mix_out(acc_pp, acc_m, ss, scale_ptr, base_ptr, pre_ptr, post_ptr, m_ptr, eps, hc_eps, post_mult,
                    rows64, rmask, C, H, ITERS)


@triton.jit
def hc_pre_kernel(r_ptr, fn_ptr, scale_ptr, base_ptr, prein_ptr, nw_ptr,
                  x_ptr, pre_ptr, post_ptr, m_ptr, part_ptr, n, eps, hc_eps, post_mult,
                  C: tl.constexpr, H: tl.constexpr, ITERS: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, SPLIT: tl.constexpr):
    """SPLIT == 1: BM rows per program, the mixes (_hc_mixes), then collapse(R, pre_in) -> bf16 ->
    RMSNorm (two passes over H). SPLIT > 1: program (row block, p) after hc_mix_split_kernel,
    which left the rounded collapse in x and the partials in part: program p < BM finishes the
    mixes of the block's row p, and program p normalises the p-th BH chunk of x in place (the
    launch has max(BM, H / BH) programs on that axis)."""
    K: tl.constexpr = C * H
    NJ: tl.constexpr = 2 * C + C * C
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < n
    rows64 = rows.to(tl.int64)
    hh = tl.arange(0, BH)
    if SPLIT > 1:
        p = tl.program_id(1)
        if p < BM:
            _hc_mixes(r_ptr, fn_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, m_ptr, part_ptr, n, eps, hc_eps,
                      post_mult, tl.program_id(0) * BM + p, C, H, ITERS, BM, BK, SPLIT)
        h0 = p * BH
        if h0 < H:
            ss2 = tl.sum(_hc_split_sum(part_ptr, n, rows64, rmask, NJ + 1, 2, 1, SPLIT), axis=1)
            rstd = tl.math.rsqrt(ss2 / H + eps)
            hm = rmask[:, None] & ((h0 + hh) < H)[None, :]
            xc = tl.load(x_ptr + rows64[:, None] * H + h0 + hh[None, :], mask=hm, other=0.0).to(tl.float32)
            w = tl.load(nw_ptr + h0 + hh, mask=(h0 + hh) < H, other=0.0).to(tl.float32)
            _store_as(x_ptr + rows64[:, None] * H + h0 + hh[None, :], w[None, :] * (xc * rstd[:, None]), hm)
    else:
        _hc_mixes(r_ptr, fn_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, m_ptr, part_ptr, n, eps, hc_eps, post_mult,
                  tl.program_id(0) * BM, C, H, ITERS, BM, BK, SPLIT)
        # collapse with the previous sub-layer's pre, then RMSNorm of the bf16 result
        ss2 = tl.zeros([BM], tl.float32)
        for h0 in range(0, H, BH):
            hm = rmask[:, None] & ((h0 + hh) < H)[None, :]
            acc = tl.zeros([BM, BH], tl.float32)
            for c in tl.static_range(C):
                p = tl.load(prein_ptr + rows64 * C + c, mask=rmask, other=0.0)
                rc = tl.load(r_ptr + rows64[:, None] * K + c * H + h0 + hh[None, :], mask=hm, other=0.0)
                acc += p[:, None] * rc.to(tl.float32)
            xc = _round_like(acc, r_ptr.dtype.element_ty)
            ss2 += tl.sum(xc * xc, axis=1)
        rstd = tl.math.rsqrt(ss2 / H + eps)
        for h0 in range(0, H, BH):
            hm = rmask[:, None] & ((h0 + hh) < H)[None, :]
            acc = tl.zeros([BM, BH], tl.float32)
            for c in tl.static_range(C):
                p = tl.load(prein_ptr + rows64 * C + c, mask=rmask, other=0.0)
                rc = tl.load(r_ptr + rows64[:, None] * K + c * H + h0 + hh[None, :], mask=hm, other=0.0)
                acc += p[:, None] * rc.to(tl.float32)
            xc = _round_like(acc, r_ptr.dtype.element_ty)
            w = tl.load(nw_ptr + h0 + hh, mask=(h0 + hh) < H, other=0.0).to(tl.float32)
            _store_as(x_ptr + rows64[:, None] * H + h0 + hh[None, :], w[None, :] * (xc * rstd[:, None]), hm)


@triton.jit
def _expand_rows(y, r_ptr, post_ptr, m_ptr, out_ptr, row, hh, hm, C: tl.constexpr, H: tl.constexpr, BH: tl.constexpr):
    """Row `row`'s streams out[j] = post[j] * y + sum_i M[i, j] * R[i] over the chunk hh (y fp32)."""
    for j in tl.static_range(C):
        mixed = tl.zeros([BH], tl.float32)
        for i in tl.static_range(C):
            mij = tl.load(m_ptr + row * C * C + i * C + j)
            ri = tl.load(r_ptr + row * C * H + i * H + hh, mask=hm, other=0.0).to(tl.float32)
            mixed += mij * ri
        pj = tl.load(post_ptr + row * C + j)
        _store_as(out_ptr + row * C * H + j * H + hh, pj * y + mixed, hm)


@triton.jit
def hc_expand_kernel(y_ptr, r_ptr, post_ptr, m_ptr, out_ptr, C: tl.constexpr, H: tl.constexpr,
                     BH: tl.constexpr):
    """out[j] = post[j] * y + sum_i M[i, j] * R[i]; program (row, chunk of H)."""
    row = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = hh < H
    y = tl.load(y_ptr + row * H + hh, mask=hm, other=0.0).to(tl.float32)
    _expand_rows(y, r_ptr, post_ptr, m_ptr, out_ptr, row, hh, hm, C, H, BH)


# ---- MoE ----------------------------------------------------------------------------------------


@triton.jit
def moe_router_kernel(logit_ptr, bias_ptr, sel_ptr, w_ptr, scale, vl_ptr, ids_ptr, image_id, E: tl.constexpr,
                      K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr,
                      BIAS_ROWS: tl.constexpr, IDS: tl.constexpr, PARTS: tl.constexpr = 1):
    """s = sqrt(softplus(l)); k rounds of argmax of s + bias (lowest id on ties); weights from s.
    The bias is one row for all tokens, or one row per token (BIAS_ROWS), or (IDS) the row of
    bias_vl for an image token and of bias for any other (route_bias, read here rather than
    written out as [n, E]). PARTS > 1: logit_ptr holds the logits GEMM's K-split partials
    [PARTS, rows, E], summed here in split order as split_sum_kernel sums them
    (linear_moe_router)."""
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    if PARTS > 1:
        total = tl.num_programs(0).to(tl.int64) * E
        x = tl.zeros([BLOCK_E], tl.float32)
        for p in tl.static_range(PARTS):
            x += tl.load(logit_ptr + p * total + row * E + e, mask=em, other=0.0)
    else:
        x = tl.load(logit_ptr + row * E + e, mask=em, other=0.0)
    # softplus = max(x, 0) + log1p(exp(-|x|)), log1p by Kahan's (1+z) trick (no libdevice in the
    # interpreter); torch's threshold (x > 20 -> x) agrees in fp32
    z = tl.exp(-tl.abs(x))
    u = 1.0 + z
    l1p = tl.where(u == 1.0, z, tl.log(u) * z / (u - 1.0))
    sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)
    s = tl.sqrt_rn(sp)
    if IDS:
        image = tl.load(ids_ptr + row) == image_id
        b = tl.where(image, tl.load(vl_ptr + e, mask=em, other=0.0), tl.load(bias_ptr + e, mask=em, other=0.0))
    else:
        b = tl.load(bias_ptr + (row * E if BIAS_ROWS else 0) + e, mask=em, other=0.0)
    score = tl.where(em, s + b, float("-inf"))
    kk = tl.arange(0, KP)
    sel = tl.zeros([KP], tl.int32)
    wv = tl.zeros([KP], tl.float32)
    for i in tl.static_range(K):
        best = tl.max(score, axis=0)
        idx = tl.min(tl.where(score == best, e, BLOCK_E), axis=0)
        sel = tl.where(kk == i, idx, sel)
        wv = tl.where(kk == i, tl.sum(tl.where(e == idx, s, 0.0), axis=0), wv)
        score = tl.where(e == idx, float("-inf"), score)
    if RENORM:
        wv = wv / (tl.sum(wv, axis=0) + 1e-20)
    tl.store(sel_ptr + row * K + kk, sel, mask=kk < K)
    tl.store(w_ptr + row * K + kk, wv * scale, mask=kk < K)


@triton.jit
def swiglu_quant_kernel(g_ptr, u_ptr, wt_ptr, pair_ptr, q_ptr, s_ptr, limit,
                        F: tl.constexpr, G_STRIDE: tl.constexpr, U_OFF: tl.constexpr,
                        WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, NR: tl.constexpr, ROWS: tl.constexpr):
    """(w * silu(min(g, limit))) * clamp(u, +-limit) -> bf16 -> fp8 per 32; program (ROWS rows of
    NR, chunk). g and u are rows of stride G_STRIDE (u at column offset U_OFF: the fused [gate | up])."""
    NB: tl.constexpr = BLOCK // 32
    i = tl.arange(0, ROWS * NB)
    row = tl.program_id(0).to(tl.int64) * ROWS + i // NB
    b = tl.program_id(1) * NB + i % NB
    cols = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    live = row < NR
    m = (cols < F) & live[:, None]
    g = tl.minimum(tl.load(g_ptr + row[:, None] * G_STRIDE + cols, mask=m, other=0.0).to(tl.float32), limit)
    u = tl.load(u_ptr + row[:, None] * G_STRIDE + U_OFF + cols, mask=m, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    if WEIGHTED:
        p = tl.load(pair_ptr + row, mask=live, other=0).to(tl.int64)
        s = tl.load(wt_ptr + p, mask=live, other=0.0)[:, None] * s
    a = _bf16_rne(s * tl.clamp(u, -limit, limit))
    q, sb = _fp8_block_quant(a)
    tl.store(q_ptr + row[:, None] * F + cols, q.to(tl.uint8), mask=m)
    tl.store(s_ptr + row * (F // 32) + b, sb.to(tl.uint8), mask=(b < F // 32) & live)


@triton.jit
def inverse_perm_kernel(order_ptr, inv_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    p = tl.load(order_ptr + i, mask=m, other=0)
    tl.store(inv_ptr + p, i, mask=m)


@triton.jit
def _combine_acc(y_ptr, inv_ptr, t, hh, hm, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BH: tl.constexpr,
                 M: tl.constexpr, SCAN: tl.constexpr):
    """The fp32 sum over chunk hh of token t's K pair rows of y, in ascending expert-order
    position from 0 (the reference's order exactly: its segments run in ascending expert order).
    inv_ptr: each pair's position (inverse_perm_kernel's), or with SCAN (a power of two >= the M
    pairs) the pairs in position order themselves, searched for t's."""
    lane = tl.arange(0, KP)
    if SCAN:
        i = tl.arange(0, SCAN)
        pv = tl.load(inv_ptr + i, mask=i < M, other=-1)
        hit = pv[None, :] == (t * K + lane).to(tl.int32)[:, None]
        ids = tl.min(tl.where(hit & (lane < K)[:, None], i[None, :], 2147483647), axis=1)
    else:
        ids = tl.load(inv_ptr + t * K + lane, mask=lane < K, other=2147483647)
    acc = tl.zeros([BH], tl.float32)
    prev = -1
    for _ in tl.static_range(K):
        cur = tl.min(tl.where(ids > prev, ids, 2147483647), axis=0)
        acc += tl.load(y_ptr + cur.to(tl.int64) * H + hh, mask=hm, other=0.0).to(tl.float32)
        prev = cur
    return acc


@triton.jit
def moe_combine_kernel(y_ptr, inv_ptr, sh_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                       BH: tl.constexpr, SHARED: tl.constexpr, M: tl.constexpr = 0, SCAN: tl.constexpr = 0):
    """out[t] = _combine_acc's sum of t's pair rows; with SHARED, plus the shared expert's bf16 row
    in fp32, stored as bf16 (moe_combine_shared). Decode calls SCAN: no inverse launch first."""
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = hh < H
    acc = _combine_acc(y_ptr, inv_ptr, t, hh, hm, H, K, KP, BH, M, SCAN)
    if SHARED:
        acc += tl.load(sh_ptr + t * H + hh, mask=hm, other=0.0).to(tl.float32)
        _store_as(out_ptr + t * H + hh, acc, hm)
    else:
        tl.store(out_ptr + t * H + hh, acc, mask=hm)


@triton.jit
def moe_combine_expand_kernel(y_ptr, inv_ptr, sh_ptr, r_ptr, post_ptr, m_ptr, out_ptr, H: tl.constexpr,
                              K: tl.constexpr, KP: tl.constexpr, BH: tl.constexpr, C: tl.constexpr,
                              M: tl.constexpr = 0, SCAN: tl.constexpr = 0):
    """moe_combine_kernel's SHARED row, rounded to bf16 as it would be stored, expanded into the
    residual streams by hc_expand_kernel's rule in the same program (moe_combine_hc_expand)."""
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = hh < H
    acc = _combine_acc(y_ptr, inv_ptr, t, hh, hm, H, K, KP, BH, M, SCAN)
    acc += tl.load(sh_ptr + t * H + hh, mask=hm, other=0.0).to(tl.float32)
    _expand_rows(_bf16_rne(acc), r_ptr, post_ptr, m_ptr, out_ptr, t, hh, hm, C, H, BH)


# ---- gathers and cache writes -------------------------------------------------------------------


@triton.jit
def gather_rows_kernel(src_ptr, idx_ptr, dst_ptr, W: tl.constexpr, DIV: tl.constexpr, BLOCK: tl.constexpr):
    """dst[t] = src[idx[t] // DIV] for rows of W elements; program (t, chunk)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < W
    src = tl.load(idx_ptr + t).to(tl.int64) // DIV
    tl.store(dst_ptr + t * W + cols, tl.load(src_ptr + src * W + cols, mask=m), mask=m)


@triton.jit
def gather_row_pairs_kernel(a_ptr, b_ptr, idx_ptr, da_ptr, db_ptr, WA: tl.constexpr, WB: tl.constexpr,
                            DIV: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
                            NR: tl.constexpr, ROWS: tl.constexpr):
    """gather_rows_kernel over two tables of the same rows (a quantised tensor's data and scales):
    da[t] = a[idx[t] // DIV] by chunks, and the chunk-0 programs also db[t] = b[idx[t] // DIV]
    (WB <= BLOCK_B); program (ROWS rows t of NR, chunk of a's row). One launch where two would be."""
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = t < NR
    src = tl.load(idx_ptr + t, mask=live, other=0).to(tl.int64) // DIV
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (cols < WA)[None, :] & live[:, None]
    tl.store(da_ptr + t[:, None] * WA + cols[None, :], tl.load(a_ptr + src[:, None] * WA + cols[None, :], mask=m),
             mask=m)
    if tl.program_id(1) == 0:
        cb = tl.arange(0, BLOCK_B)
        mb = (cb < WB)[None, :] & live[:, None]
        tl.store(db_ptr + t[:, None] * WB + cb[None, :], tl.load(b_ptr + src[:, None] * WB + cb[None, :], mask=mb),
                 mask=mb)


@triton.jit
def seq_newest_kernel(pos_ptr, seq_ptr, newest_ptr, n, BLOCK: tl.constexpr):
    """newest[s] = the largest position of sequence s in the step (scratch starts at -1)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(seq_ptr + i, mask=m, other=0)
    p = tl.load(pos_ptr + i, mask=m, other=0).to(tl.int32)
    tl.atomic_max(newest_ptr + s, p, mask=m)


@triton.jit
def _ring_entry(pos_ptr, seq_ptr, slots_ptr, newest_ptr, t, L: tl.constexpr, KEEP_ALL: tl.constexpr):
    """(keep, entry) of row t in its sequence's ring of L: entry slot * L + pos mod L, kept when the
    position is among the sequence's newest L (ring_keep), or always with KEEP_ALL (newest_ptr unread)."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    if KEEP_ALL:
        keep = True
    else:
        keep = pos > tl.load(newest_ptr + seq).to(tl.int64) - L
    return keep, tl.load(slots_ptr + seq).to(tl.int64) * L + pos % L


@triton.jit
def ring_write_kernel(a_ptr, b_ptr, pos_ptr, seq_ptr, slots_ptr, newest_ptr, da_ptr, db_ptr,
                      L: tl.constexpr, WA: tl.constexpr, WB: tl.constexpr,
                      A_STRIDE: tl.constexpr, A_OFF: tl.constexpr, B_STRIDE: tl.constexpr, B_OFF: tl.constexpr,
                      BLOCK: tl.constexpr, KEEP_ALL: tl.constexpr = 0):
    """Row t of A (WA elements) and of B (WB) into ring entry (slot, pos mod L) of its sequence,
    at element offset (slot * L + idx) * STRIDE + OFF, only for the newest L positions of the
    sequence (a chunk longer than the ring keeps its last rows, as ring_keep does). KEEP_ALL: the
    step has at most L rows, so no sequence has more and every row is kept; newest_ptr is unread."""
    t = tl.program_id(0).to(tl.int64)
    keep, entry = _ring_entry(pos_ptr, seq_ptr, slots_ptr, newest_ptr, t, L, KEEP_ALL)
    if keep:
        for c0 in tl.static_range(0, WA, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < WA
            tl.store(da_ptr + entry * A_STRIDE + A_OFF + cols, tl.load(a_ptr + t * WA + cols, mask=m), mask=m)
        for c0 in tl.static_range(0, WB, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < WB
            tl.store(db_ptr + entry * B_STRIDE + B_OFF + cols, tl.load(b_ptr + t * WB + cols, mask=m), mask=m)


@triton.jit
def compressed_write_kernel(a_ptr, b_ptr, pos_ptr, seq_ptr, bt_ptr, da_ptr, db_ptr,
                            RATIO: tl.constexpr, ENTRIES: tl.constexpr, BT_W: tl.constexpr,
                            WA: tl.constexpr, WB: tl.constexpr, BLOCK: tl.constexpr):
    """A row completing compressed entry c = (pos+1)/r - 1 goes to page block_table[s][c // E],
    row c % E."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if (pos + 1) % RATIO == 0:
        seq = tl.load(seq_ptr + t).to(tl.int64)
        c = (pos + 1) // RATIO - 1
        page = tl.load(bt_ptr + seq * BT_W + c // ENTRIES).to(tl.int64)
        entry = page * ENTRIES + c % ENTRIES
        for c0 in tl.static_range(0, WA, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < WA
            tl.store(da_ptr + entry * WA + cols, tl.load(a_ptr + t * WA + cols, mask=m), mask=m)
        for c0 in tl.static_range(0, WB, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < WB
            tl.store(db_ptr + entry * WB + cols, tl.load(b_ptr + t * WB + cols, mask=m), mask=m)


# ---- Engram -------------------------------------------------------------------------------------


@triton.jit
def engram_hash_kernel(g_ptr, mult_ptr, prime_ptr, off_ptr, out_ptr, G: tl.constexpr, HEADS: tl.constexpr,
                       HP: tl.constexpr):
    """acc = g0*m0 ^ g1*m1 ^ ...; column (o, h) = acc_o mod prime + offset, int64 throughout."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)
    hm = h < HEADS
    acc = tl.load(g_ptr + row * G).to(tl.int64) * tl.load(mult_ptr)
    for o in tl.static_range(1, G):
        acc = acc ^ (tl.load(g_ptr + row * G + o).to(tl.int64) * tl.load(mult_ptr + o))
        pr = tl.load(prime_ptr + (o - 1) * HEADS + h, mask=hm, other=1)
        of = tl.load(off_ptr + (o - 1) * HEADS + h, mask=hm, other=0)
        tl.store(out_ptr + row * ((G - 1) * HEADS) + (o - 1) * HEADS + h, acc % pr + of, mask=hm)


@triton.jit
def engram_gate_kernel(r_ptr, kv_ptr, qw_ptr, kw_ptr, ids_ptr, out_ptr, eps, image_id, C: tl.constexpr,
                       H: tl.constexpr, BH: tl.constexpr, KW_ROWS: tl.constexpr, IDS: tl.constexpr):
    """Program (row, copy c): dot of R[c] and key[c] weighted by q_w[c] * k_w[c] (k_w has one row
    per copy, or one row for all), normalised per copy over H, signed sqrt, sigmoid gate;
    R[c] + gate * value. With token ids (IDS), an image token's gate is 0."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    hh = tl.arange(0, BH)
    dot = tl.zeros([BH], tl.float32)
    rr = tl.zeros([BH], tl.float32)
    kk2 = tl.zeros([BH], tl.float32)
    for h0 in range(0, H, BH):
        m = (h0 + hh) < H
        r = tl.load(r_ptr + row * C * H + c * H + h0 + hh, mask=m, other=0.0).to(tl.float32)
        k = tl.load(kv_ptr + row * (C + 1) * H + c * H + h0 + hh, mask=m, other=0.0).to(tl.float32)
        w = tl.load(qw_ptr + c * H + h0 + hh, mask=m, other=0.0).to(tl.float32) \
            * tl.load(kw_ptr + (c if KW_ROWS > 1 else 0) * H + h0 + hh, mask=m, other=0.0).to(tl.float32)
        dot += r * w * k
        rr += r * r
        kk2 += k * k
    d = tl.sum(dot, axis=0) * tl.math.rsqrt(tl.sum(rr, axis=0) / H + eps) \
        * tl.math.rsqrt(tl.sum(kk2, axis=0) / H + eps) * (1.0 / tl.sqrt_rn(H * 1.0))
    sq = tl.sqrt_rn(tl.maximum(tl.abs(d), 1e-6))
    gate = _sigmoid(tl.where(d < 0, -sq, sq))
    if IDS:
        gate = tl.where(tl.load(ids_ptr + row) == image_id, 0.0, gate)
    for h0 in range(0, H, BH):
        m = (h0 + hh) < H
        r = tl.load(r_ptr + row * C * H + c * H + h0 + hh, mask=m, other=0.0).to(tl.float32)
        v = tl.load(kv_ptr + row * (C + 1) * H + C * H + h0 + hh, mask=m, other=0.0).to(tl.float32)
        _store_as(out_ptr + row * C * H + c * H + h0 + hh, r + gate * v, m)


@triton.jit
def grouped_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, n, G: tl.constexpr, KG: tl.constexpr,
                          NG: tl.constexpr, SK: tl.constexpr, QUANT: tl.constexpr, BM: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    """Block-diagonal projection: y[:, g*NG + j] = x[:, g*KG:(g+1)*KG] . W[g*NG + j] for group g.
    W is fp8 e4m3 with one ue8m0 scale per 32x32 block (QUANT), widened in registers (exact: 4
    significant bits times a power of two, a bf16 value as the spec's load-time dequantisation
    gives), or bf16. The MMAs take the bf16 values as fp32 at tf32 precision, which holds them
    exactly (10 mantissa bits >= 7), so the products are exact as in a bf16 MMA; the CPU
    interpreter has no bf16 dot. fp32 accumulation, output rounded to y's dtype. `linear` at fp32
    compute on bf16 operands is the one-group case.
    Program (row tile, (group, column tile), K split s). With SPLIT > 1 each program covers one
    K range and writes its fp32 partial to part[s] (split_sum_kernel adds them in split order):
    a decode call has one row tile, and one program per column tile walking all of K leaves most
    of the GPU's memory pipes idle."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    ps = tl.program_id(2)
    TILES: tl.constexpr = (NG + BN - 1) // BN
    KS: tl.constexpr = (KG + SPLIT * BK - 1) // (SPLIT * BK) * BK
    NB: tl.constexpr = BK // 32
    g = pn // TILES
    rows = pm * BM + tl.arange(0, BM)
    cols = (pn % TILES) * BN + tl.arange(0, BN)
    rm = rows < n
    cm = cols < NG
    wrow = (g * NG + cols).to(tl.int64)
    xrow = rows.to(tl.int64) * (G * KG) + g * KG
    acc = tl.zeros([BM, BN], tl.float32)
    k_lo = ps * KS
    k_hi = tl.minimum(k_lo + KS, KG)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + tl.arange(0, BK)
        km = ks < k_hi
        xt = tl.load(x_ptr + xrow[:, None] + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        wm = cm[:, None] & km[None, :]
        if QUANT:
            code = tl.load(w_ptr + wrow[:, None] * KG + ks[None, :], mask=wm, other=0).to(tl.int32)
            # one scale per 32 K of a row: loaded per block and broadcast, not gathered per element
            kb = k0 // 32 + tl.arange(0, NB)
            sb = tl.load(s_ptr + (wrow // 32)[:, None] * SK + kb[None, :], mask=cm[:, None] & (kb < SK)[None, :],
                         other=127).to(tl.int32)
            scale = (sb << 23).to(tl.float32, bitcast=True)  # 2^(sb-127)
            wt = tl.reshape(tl.reshape(_e4m3_value(code), [BN, NB, 32]) * scale[:, :, None], [BN, BK])
        else:
            wt = tl.load(w_ptr + wrow[:, None] * KG + ks[None, :], mask=wm, other=0.0).to(tl.float32)
        acc += tl.dot(xt.to(tl.float32), tl.trans(wt), input_precision="tf32")
    out = rows.to(tl.int64)[:, None] * (G * NG) + g * NG + cols[None, :]
    if SPLIT == 1:
        _store_as(y_ptr + out, acc, rm[:, None] & cm[None, :])
    else:
        tl.store(part_ptr + ps * n * (G * NG) + out, acc, mask=rm[:, None] & cm[None, :])


@triton.jit
def block_linear_mx_kernel(x_ptr, sx_ptr, w_ptr, s_ptr, y_ptr, part_ptr, n, G: tl.constexpr, KG: tl.constexpr,
                           NG: tl.constexpr, SK: tl.constexpr, XQ: tl.constexpr, WQ: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                           F8: tl.constexpr = 0):
    """grouped_linear_kernel's product with each BK chunk through tl.dot_scaled. The weight is fp8
    e4m3 with one ue8m0 per 32x32 block (WQ: its block's scale repeated to its 32 rows, the MX
    layout, gathered from the block scales as loaded, no extra bytes read) or bf16; x is bf16
    rows (grouped_linear's wo_a, the fp32-compute linear) or, with XQ, fp8 e4m3 rows with one
    ue8m0 per 32 K (gemm_fp8, the spec's lin8). On sm90 Triton widens the codes to bf16 with the
    scale applied (exact: 4 significant bits times a power of two) and runs bf16 MMAs, so the
    products are exact and the sums fp32 as in the tf32 path, without the fp32 operands'
    registers and half-rate MMAs; on sm100 it takes the block-scaled MMA. (dot_scaled on bf16 with
    no scales is also the bf16 dot the CPU interpreter runs.) Programs and the K split as
    grouped_linear_kernel. F8 (with XQ and WQ, lin8) runs one fp8 MMA per 32-deep block on the
    codes as they are and applies the two scales to its fp32 partial (`_f8_block`): nothing is
    widened, where dot_scaled on sm90 widens both operands to bf16 first."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    ps = tl.program_id(2)
    TILES: tl.constexpr = (NG + BN - 1) // BN
    KS: tl.constexpr = (KG + SPLIT * BK - 1) // (SPLIT * BK) * BK
    g = pn // TILES
    rows = pm * BM + tl.arange(0, BM)
    cols = (pn % TILES) * BN + tl.arange(0, BN)
    rm = rows < n
    cm = cols < NG
    wrow = (g * NG + cols).to(tl.int64)
    rows64 = rows.to(tl.int64)
    xrow = rows64 * (G * KG) + g * KG
    acc = tl.zeros([BM, BN], tl.float32)
    k_lo = ps * KS
    k_hi = tl.minimum(k_lo + KS, KG)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + tl.arange(0, BK)
        km = ks < k_hi
        kb = k0 // 32 + tl.arange(0, BK // 32)
        kbm = kb < (k_hi + 31) // 32
        if F8:
            for kk in tl.static_range(BK // 32):
                kc = k0 + kk * 32 + tl.arange(0, 32)
                kcm = kc < k_hi
                xq = tl.load(x_ptr.to(tl.pointer_type(tl.uint8)) + xrow[:, None] + kc[None, :],
                             mask=rm[:, None] & kcm[None, :], other=0)
                wq = tl.load(w_ptr + wrow[:, None] * KG + kc[None, :], mask=cm[:, None] & kcm[None, :], other=0)
                kb1 = k0 // 32 + kk  # (as a vector in the masks: the interpreter takes no scalar there)
                sx = tl.load(sx_ptr + rows64 * (G * SK) + g * SK + kb1, mask=rm & ((rows * 0 + kb1) < SK),
                             other=127).to(tl.int32)
                sw = tl.load(s_ptr + (wrow // 32) * SK + kb1, mask=cm & ((cols * 0 + kb1) < SK), other=127).to(tl.int32)
                acc = _f8_block(xq, wq, sx, sw, acc, 0)
        else:
            w = tl.load(w_ptr + wrow[None, :] * KG + ks[:, None], mask=cm[None, :] & km[:, None], other=0)
            if XQ:
                xt = tl.load(x_ptr.to(tl.pointer_type(tl.uint8)) + xrow[:, None] + ks[None, :],
                             mask=rm[:, None] & km[None, :], other=0)
                sx = tl.load(sx_ptr + rows64[:, None] * (G * SK) + g * SK + kb[None, :], mask=rm[:, None] & kbm[None, :],
                             other=127)
            else:
                xt = tl.load(x_ptr + xrow[:, None] + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
                sx = None
            if WQ:
                sw = tl.load(s_ptr + (wrow // 32)[:, None] * SK + kb[None, :], mask=cm[:, None] & kbm[None, :], other=127)
                acc = tl.dot_scaled(xt, sx, "e4m3" if XQ else "bf16", w, sw, "e4m3", acc, fast_math=True)
            else:
                acc = tl.dot_scaled(xt, sx, "bf16", w, None, "bf16", acc, fast_math=True)
    out = rows64[:, None] * (G * NG) + g * NG + cols[None, :]
    if SPLIT == 1:
        _store_as(y_ptr + out, acc, rm[:, None] & cm[None, :])
    else:
        tl.store(part_ptr + ps * n * (G * NG) + out, acc, mask=rm[:, None] & cm[None, :])


@triton.jit
def _widen_blocks(q, sbytes, R: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """e4m3 bytes [R, BK] times 2^(s - 127) per 32 of K (ue8m0 bytes [R, BK / 32]) -> DT, exact in
    bf16: 4 significant bits times a power of two."""
    s = tl.reshape(tl.broadcast_to(_pow2(sbytes.to(tl.int32), 0)[:, :, None], (R, BK // 32, 32)), (R, BK))
    return (q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s).to(DT)


@triton.jit
def block_linear_rows_kernel(x_ptr, sx_ptr, w_ptr, s_ptr, y_ptr, part_ptr, n, G: tl.constexpr, KG: tl.constexpr,
                             NG: tl.constexpr, SK: tl.constexpr, XQ: tl.constexpr, WQ: tl.constexpr,
                             BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                             F32: tl.constexpr = 0):
    """block_linear_mx_kernel's product for n <= BR rows, all in one tile, with the weight as the
    MMA's left operand: acc[BN, BR] = W_tile . x^T. Each weight tile is read once (row tiles of
    16 read it once per tile), and its codes are widened to bf16 with their 32x32 block's scale
    in the registers the MMA takes them from (exact, as in dot_scaled's widening; sm90's wgmma
    takes its left operand from registers), so one fp32 accumulator runs over the whole K. x is
    bf16 rows or (XQ) fp8 rows per 32 K, widened the same way. Program (N tile, K split); NG is a
    multiple of BN and every split a whole number of BK steps (`block_linear_rows_fits`). F32:
    fp32 operands, for the CPU interpreter, whose bf16 dot is not exact (the same products)."""
    DT: tl.constexpr = tl.float32 if F32 else tl.bfloat16
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    TILES: tl.constexpr = NG // BN
    KS: tl.constexpr = KG // SPLIT
    g = pn // TILES
    cols = (pn % TILES) * BN + tl.arange(0, BN)
    wrow = (g * NG + cols).to(tl.int64)
    rows = tl.arange(0, BR)
    rm = rows < n
    rows64 = rows.to(tl.int64)
    xrow = rows64 * (G * KG) + g * KG
    acc = tl.zeros([BN, BR], tl.float32)
    for k0 in range(ps * KS, ps * KS + KS, BK):
        ks = k0 + tl.arange(0, BK)
        kb = k0 // 32 + tl.arange(0, BK // 32)
        wq = tl.load(w_ptr + wrow[:, None] * KG + ks[None, :])
        if WQ:
            w = _widen_blocks(wq, tl.load(s_ptr + (wrow // 32)[:, None] * SK + kb[None, :]), BN, BK, DT)
        else:
            w = wq.to(DT)
        if XQ:
            xq = tl.load(x_ptr.to(tl.pointer_type(tl.uint8)) + xrow[:, None] + ks[None, :], mask=rm[:, None], other=0)
            sx = tl.load(sx_ptr + rows64[:, None] * (G * SK) + g * SK + kb[None, :], mask=rm[:, None], other=127)
            x = _widen_blocks(xq, sx, BR, BK, DT)
        else:
            x = tl.load(x_ptr + xrow[:, None] + ks[None, :], mask=rm[:, None], other=0.0).to(DT)
        acc = tl.dot(w, tl.trans(x), acc)
    out = rows64[None, :] * (G * NG) + g * NG + cols[:, None]
    if SPLIT == 1:
        _store_as(y_ptr + out, acc, rm[None, :])
    else:
        tl.store(part_ptr + ps * n * (G * NG) + out, acc, mask=rm[None, :])


@triton.jit
def split_sum_kernel(part_ptr, y_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y = part[0] + part[1] + ... in split order (fp32), rounded to y's dtype: a split-K GEMM's
    sum, the same order whatever the launch."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < total
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * total + i, mask=m, other=0.0)
    _store_as(y_ptr + i, acc, m)


@triton.jit
def split_sum_quant_kernel(part_ptr, q_ptr, s_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """split_sum_kernel's bf16 sums quantised to fp8 per 32 as quant_fp8_kernel does (rows a
    multiple of 32 wide): the bytes to q, the ue8m0 scales to s."""
    NB: tl.constexpr = BLOCK // 32
    b = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)
    i = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    m = i < total
    acc = tl.zeros([NB, 32], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * total + i, mask=m, other=0.0)
    q, sb = _fp8_block_quant(_bf16_rne(acc))
    tl.store(q_ptr + i, q.to(tl.uint8), mask=m)
    tl.store(s_ptr + b, sb.to(tl.uint8), mask=b < total // 32)


# ---- grouped fp4 GEMM (MoE experts, decode) ----------------------------------------------------


@triton.jit
def _fp4_f16(code):
    """e2m1 codes (int32 0..15, bit 3 the sign) -> fp16 value * 2^-14, exact: the code's three
    magnitude bits placed at fp16 bits 9..11 are the fp16 exponent and top mantissa bit of
    value * 2^-14 (code 1, 0.5, lands on the subnormal 2^-15)."""
    h = ((code & 7) << 9) | ((code & 8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e4m3_f16(code):
    """e4m3fn bytes (int32, no NaN) -> their fp16 values, exact (4 significant bits, 2^-9..448)."""
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _fp4_pair_f16(w, C: tl.constexpr):
    """Nibbles C and C + 4 of each 32-bit word of e2m1 codes, two at a time: the fp16x2 bits
    (int32) of value * 2^-14 as `_fp4_f16` gives it, nibble C in the low half. One shift and mask
    per two codes where the byte-wise widening takes one per code: the MoE GEMM at decode is bound
    by these integer ops, not by memory."""
    if C == 3:
        h = ((w >> 3) & 0x0E000E00) | (w & -0x7FFF8000)
    else:
        h = ((w << (9 - 4 * C)) & 0x0E000E00) | ((w << (12 - 4 * C)) & -0x7FFF8000)
    return h


@triton.jit
def _f16_lo(h):
    return h.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _f16_hi(h):
    return (h >> 16).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _fp4_block_bytes(x_ptr, w_ptr, xrow, wrow, xn, wn, kbi, K: tl.constexpr):
    """One 32-deep scale block's x . W^T (fp32 [BM, BN], unscaled): x as int16 pairs and W as
    bytes, split into even and odd K, one fp16 MMA each."""
    jj = tl.arange(0, 16)
    wb = tl.load(w_ptr + wrow[:, None] * (K // 2) + kbi * 16 + jj[None, :], mask=wn[:, None], other=0).to(tl.int32)
    xp = tl.load(x_ptr + xrow[:, None] * (K // 2) + kbi * 16 + jj[None, :], mask=xn[:, None], other=0).to(tl.int32)
    part = tl.dot(_e4m3_f16(xp & 0xFF), tl.trans(_fp4_f16(wb & 15)))
    return tl.dot(_e4m3_f16((xp >> 8) & 0xFF), tl.trans(_fp4_f16(wb >> 4)), part)


@triton.jit
def _fp4_block_words(x_ptr, w_ptr, xrow, wrow, xn, wn, kbi, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The same block from W's 4 words of 8 codes per row (`_fp4_pair_f16`): tile A holds the
    nibbles 0..3 of each word (K = 8j + 0..3), tile B the nibbles 4..7; x is read in that K order
    (the first and second 4 bytes of each 8). tl.join puts its new axis last, so joining (0, 2)
    with (1, 3) lays nibble c of word j at 4j + c."""
    wp = w_ptr.to(tl.pointer_type(tl.int32))
    xb_ptr = x_ptr.to(tl.pointer_type(tl.uint8))
    jw = tl.arange(0, 4)
    w = tl.load(wp + wrow[:, None] * (K // 8) + kbi * 4 + jw[None, :], mask=wn[:, None], other=0)
    xq = xb_ptr + xrow[:, None, None] * K + kbi * 32 + 8 * jw[None, :, None] + jw[None, None, :]
    xa = tl.reshape(tl.load(xq, mask=xn[:, None, None], other=0), [BM, 16]).to(tl.int32)
    xb = tl.reshape(tl.load(xq + 4, mask=xn[:, None, None], other=0), [BM, 16]).to(tl.int32)
    h0 = _fp4_pair_f16(w, 0)
    h1 = _fp4_pair_f16(w, 1)
    h2 = _fp4_pair_f16(w, 2)
    h3 = _fp4_pair_f16(w, 3)
    wa = tl.reshape(tl.join(tl.join(_f16_lo(h0), _f16_lo(h2)), tl.join(_f16_lo(h1), _f16_lo(h3))), [BN, 16])
    wb = tl.reshape(tl.join(tl.join(_f16_hi(h0), _f16_hi(h2)), tl.join(_f16_hi(h1), _f16_hi(h3))), [BN, 16])
    part = tl.dot(_e4m3_f16(xa), tl.trans(wa))
    return tl.dot(_e4m3_f16(xb), tl.trans(wb), part)


@triton.jit
def _fp4_chunk_mx(x_ptr, sx_ptr, w_ptr, sw_ptr, xrow, wrow, rm, cm, k0, kend, acc, K: tl.constexpr, BK: tl.constexpr):
    """acc + BK of K (from k0, nothing at or past kend) through tl.dot_scaled: e4m3 rows and e2m1
    weights with their ue8m0 per 32, the OCP MX formats of the checkpoint as they are (e2m1 packed
    two per byte along K, the even K in the low nibble). Triton widens both to bf16 with the scale
    applied, exact for these formats, so the products are exact and the sums fp32 as in the
    widening paths; where the widening and the MMA overlap is Triton's to schedule."""
    xb = x_ptr.to(tl.pointer_type(tl.uint8))
    kx = k0 + tl.arange(0, BK)
    kw = k0 // 2 + tl.arange(0, BK // 2)
    ks = k0 // 32 + tl.arange(0, BK // 32)
    x = tl.load(xb + xrow[:, None] * K + kx[None, :], mask=rm[:, None] & (kx < kend)[None, :], other=0)
    w = tl.load(w_ptr + wrow[None, :] * (K // 2) + kw[:, None], mask=cm[None, :] & (kw < kend // 2)[:, None],
                other=0)
    sx = tl.load(sx_ptr + xrow[:, None] * (K // 32) + ks[None, :], mask=rm[:, None] & (ks < kend // 32)[None, :],
                 other=0)
    sw = tl.load(sw_ptr + wrow[:, None] * (K // 32) + ks[None, :], mask=cm[:, None] & (ks < kend // 32)[None, :],
                 other=0)
    return tl.dot_scaled(x, sx, "e4m3", w, sw, "e2m1", acc, fast_math=True)


@triton.jit
def _pow2(sbyte, bias: tl.constexpr):
    """2^(sbyte - 127 + bias) in fp32 for ue8m0 bytes (int32), exact while it stays normal."""
    return ((sbyte + bias) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_e4m3_pair(b, ASM: tl.constexpr):
    """Bytes of two e2m1 codes (uint8, the even K in the low nibble) -> (even, odd) e4m3 bytes of
    value * 2^-6, exact: a code's three magnitude bits at e4m3 bits 2..4 are the e4m3 exponent and
    top mantissa bit of value * 2^-6 (code 1, 0.5, lands on the subnormal 2^-7), its sign at bit 7.
    With ASM four bytes at a time in one 32-bit register (shift and mask, two outputs), the MoE
    GEMM's widening at about one integer op per code; the CPU interpreter runs no PTX, so there
    the same bits come from byte-wise integer ops."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t0, t1;\n"
            "shl.b32 t0, $2, 2; and.b32 t0, t0, 0x1C1C1C1C;\n"
            "shl.b32 t1, $2, 4; and.b32 t1, t1, 0x80808080; or.b32 $0, t0, t1;\n"
            "shr.b32 t0, $2, 2; and.b32 t0, t0, 0x1C1C1C1C;\n"
            "and.b32 t1, $2, 0x80808080; or.b32 $1, t0, t1; }",
            "=r,=r,r", [b], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        bi = b.to(tl.int32)
        lo = (((bi & 7) << 2) | ((bi & 8) << 4)).to(tl.uint8)
        hi = (((bi >> 2) & 0x1C) | (bi & 0x80)).to(tl.uint8)
    return lo, hi


@triton.jit
def _fp4_word_f32(w, ASM: tl.constexpr):
    """32-bit words of 8 e2m1 codes -> 8 fp32 tensors, code k of each word (K = 8j + k) as value *
    2^-14, exact: the pairs of `_fp4_pair_f16` (codes k and k + 4 as fp16x2) widened half by half.
    With ASM one shift-and-mask pair and two conversions per two codes, and no byte moves; the CPU
    interpreter runs no PTX and takes the same bits from Triton's integer ops."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, u; .reg .b16 l, h;\n"
            "shl.b32 t, $8, 9; and.b32 t, t, 0x0E000E00; shl.b32 u, $8, 12; and.b32 u, u, 0x80008000;\n"
            "or.b32 t, t, u; mov.b32 {l, h}, t; cvt.f32.f16 $0, l; cvt.f32.f16 $4, h;\n"
            "shl.b32 t, $8, 5; and.b32 t, t, 0x0E000E00; shl.b32 u, $8, 8; and.b32 u, u, 0x80008000;\n"
            "or.b32 t, t, u; mov.b32 {l, h}, t; cvt.f32.f16 $1, l; cvt.f32.f16 $5, h;\n"
            "shl.b32 t, $8, 1; and.b32 t, t, 0x0E000E00; shl.b32 u, $8, 4; and.b32 u, u, 0x80008000;\n"
            "or.b32 t, t, u; mov.b32 {l, h}, t; cvt.f32.f16 $2, l; cvt.f32.f16 $6, h;\n"
            "shr.b32 t, $8, 3; and.b32 t, t, 0x0E000E00; and.b32 u, $8, 0x80008000;\n"
            "or.b32 t, t, u; mov.b32 {l, h}, t; cvt.f32.f16 $3, l; cvt.f32.f16 $7, h; }",
            "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        h0 = _fp4_pair_f16(w, 0)
        h1 = _fp4_pair_f16(w, 1)
        h2 = _fp4_pair_f16(w, 2)
        h3 = _fp4_pair_f16(w, 3)
        return (_f16_lo(h0).to(tl.float32), _f16_lo(h1).to(tl.float32), _f16_lo(h2).to(tl.float32),
                _f16_lo(h3).to(tl.float32), _f16_hi(h0).to(tl.float32), _f16_hi(h1).to(tl.float32),
                _f16_hi(h2).to(tl.float32), _f16_hi(h3).to(tl.float32))


@triton.jit
def _e4m3_byte_f32(word, b: tl.constexpr):
    """Byte b of 32-bit words of e4m3 codes as fp32 (exact)."""
    return ((word >> (8 * b)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _fp4_gemv_row(x_ptr, sx_ptr, row, live, kw, km, sw, ws, acc, K: tl.constexpr):
    """One row's acc [BN] + a scale block: the row's 32 e4m3 values (x's words 2j and 2j + 1 hold
    K = 8j + 0..3 and 8j + 4..7) against the 8 widened codes per W word `ws`, one fp32 FMA per
    code (the products are exact), the block's 32 summed in fp32 in each thread, then its scales."""
    rv = kw * 0 + row  # the row as a vector (the interpreter takes no scalar in a mask)
    xw = x_ptr.to(tl.pointer_type(tl.int32)) + rv.to(tl.int64) * (K // 4) + 2 * kw
    lm = km & (rv < live)
    x_lo = tl.load(xw, mask=lm, other=0)
    x_hi = tl.load(xw + 1, mask=lm, other=0)
    w0, w1, w2, w3, w4, w5, w6, w7 = ws
    p = _e4m3_byte_f32(x_lo, 0)[None, :] * w0
    p += _e4m3_byte_f32(x_lo, 1)[None, :] * w1
    p += _e4m3_byte_f32(x_lo, 2)[None, :] * w2
    p += _e4m3_byte_f32(x_lo, 3)[None, :] * w3
    p += _e4m3_byte_f32(x_hi, 0)[None, :] * w4
    p += _e4m3_byte_f32(x_hi, 1)[None, :] * w5
    p += _e4m3_byte_f32(x_hi, 2)[None, :] * w6
    p += _e4m3_byte_f32(x_hi, 3)[None, :] * w7
    kbi = kw // 4  # the block, once per lane of the 4
    sx = tl.load(sx_ptr + rv.to(tl.int64) * (K // 32) + kbi, mask=lm, other=0).to(tl.int32)
    # the 4 lanes hold the same scale: max is one of them, and keeps sx a [1] of the row
    return acc + tl.sum(p, axis=1) * (_pow2(tl.max(sx, axis=0), 0) * _pow2(sw, 14))


@triton.jit
def _fp4_gemv_block(x_ptr, sx_ptr, w_ptr, sw_ptr, r0, end, wrow, cm, kbi, acc0, acc1, K: tl.constexpr,
                    TWO: tl.constexpr, ASM: tl.constexpr):
    """Scale block kbi (32 of K) for rows r0 (acc0) and, with TWO, r0 + 1 (acc1) on the CUDA cores,
    for the one or two rows an expert has at decode: each column's 4 words of W widened once
    (`_fp4_word_f32`) for both rows. No MMA: a 16-row tile for one or two rows pays for operand
    shuffles that bound the MMA variants at decode. Each thread holds whole words of its columns,
    so a block's sum stays in the thread."""
    jw = tl.arange(0, 4)
    kw = kbi * 4 + jw
    km = kw < K // 8
    w = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + wrow[:, None] * (K // 8) + kw[None, :],
                mask=cm[:, None] & km[None, :], other=0)
    sw = tl.load(sw_ptr + wrow * (K // 32) + kbi, mask=cm & ((wrow * 0 + kbi) < K // 32), other=0).to(tl.int32)
    ws = _fp4_word_f32(w, ASM)
    acc0 = _fp4_gemv_row(x_ptr, sx_ptr, r0, end, kw, km, sw, ws, acc0, K)
    if TWO:
        acc1 = _fp4_gemv_row(x_ptr, sx_ptr, r0 + 1, end, kw, km, sw, ws, acc1, K)
    return acc0, acc1


@triton.jit
def _f8_block(xq, wq, sx, sw, acc, W_BIAS: tl.constexpr):
    """acc + one 32-deep scale block on fp8 MMAs: e4m3 bytes x [BM, 32] . w [BN, 32]^T in fp32
    (the products of e4m3 values are exact; the MMA sums 32 of them), times 2^(sx-127) per row and
    2^(sw-127+W_BIAS) per column (ue8m0 bytes as int32) into the fp32 accumulator: the promotion
    per scale block that the block-scaled formats need on an MMA with no scale operand (sm90)."""
    part = tl.dot(xq.to(tl.float8e4nv, bitcast=True), tl.trans(wq.to(tl.float8e4nv, bitcast=True)))
    return acc + part * (_pow2(sx, 0)[:, None] * _pow2(sw, W_BIAS)[None, :])


@triton.jit
def _moe_out(y_ptr, part_ptr, s, rows, cols, v, mask, MTOT: tl.constexpr, N: tl.constexpr, SPLIT: tl.constexpr):
    """A [BM, BN] tile of the grouped GEMM's output: y in bf16, or split s's fp32 partial."""
    off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if SPLIT == 1:
        _store_as(y_ptr + off, v, mask)
    else:
        tl.store(part_ptr + s * (MTOT * N) + off, v, mask=mask)


@triton.jit
def grouped_gemm_fp4_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, off_ptr, y_ptr, part_ptr, MTOT: tl.constexpr,
                            N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, A: tl.constexpr, EP: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                            WORDS: tl.constexpr, MX: tl.constexpr, F8: tl.constexpr = 0, ASM: tl.constexpr = 1,
                            GEMV: tl.constexpr = 0):
    """y[r] = x[r] . W[e]^T for the rows r in [off[e], off[e+1]) of each expert e, for few rows per
    expert (decode). x: fp8 e4m3 rows read as int16 pairs (even K in the low byte), one ue8m0 per
    32 K; W: [E, N, K/2] packed e2m1 (low nibble = even K), one ue8m0 per output row and 32 K.
    The codes are widened in registers to fp16 (exact: e4m3 values, and e2m1 values * 2^-14), one
    fp16 MMA pair (even K, odd K) per 32-deep scale block with fp32 accumulation (products of 4 x 2
    significant bits are exact), and the block's partial sum scaled by its two power-of-two scales
    into the fp32 accumulator; bf16 out. The fp16 operands take half the registers of fp32 ones
    and run at twice the tf32 rate. WORDS widens W's codes two at a time from 32-bit words
    (`_fp4_block_words`, the same values and sums); bytes one at a time otherwise. MX hands each
    BK chunk to tl.dot_scaled instead (`_fp4_chunk_mx`). F8 (over WORDS and MX) widens the codes
    to e4m3 bytes of value * 2^-6 (`_fp4_e4m3_pair`, ASM: in 32-bit words) and runs one fp8 MMA per
    scale block with the x rows as they are (`_f8_block`): no widening of x, and about one integer
    op per weight code where fp16 widening takes several. GEMV (over all of them) takes the
    CUDA cores instead of MMAs (`_fp4_gemv_block`): BM is then the rows per pass, 1 or 2.

    Program (N tile, i): i < A works for the i-th expert whose row range is non-empty (found
    from `off` here: no host work, and no program for an idle expert; A = min(E, MTOT) bounds
    how many can be busy), walking its rows in tiles of BM; program (N tile, A) zeroes the rows
    outside [off[0], off[E]), which no expert covers (the offsets are non-decreasing). With
    SPLIT > 1 a third grid axis splits K: each program writes its fp32 partial (or zeroes) to
    part[s], and split_sum_kernel adds them in split order: at a few rows per expert, the K split
    is what gives a decode call enough programs."""
    pn = tl.program_id(0)
    i = tl.program_id(1)
    ps = tl.program_id(2)
    NB: tl.constexpr = BK // 32
    KS: tl.constexpr = (K + SPLIT * BK - 1) // (SPLIT * BK) * BK
    KB = tl.minimum(ps * KS + KS, K) // 32  # the split's end, in scale blocks
    cols = pn * BN + tl.arange(0, BN)
    cm = cols < N
    if i < A:
        ee = tl.arange(0, EP)
        lo = tl.load(off_ptr + ee, mask=ee < E, other=0)
        hi = tl.load(off_ptr + ee + 1, mask=ee < E, other=0)
        busy = hi > lo
        pick = busy & (tl.cumsum(busy.to(tl.int32), axis=0) == i + 1)
        e = tl.sum(tl.where(pick, ee, 0), axis=0).to(tl.int64)
        start = tl.sum(tl.where(pick, lo, 0), axis=0)
        end = tl.sum(tl.where(pick, hi, 0), axis=0)  # start == end == 0: fewer than i + 1 busy
        wrow = (e * N + cols).to(tl.int64)
        for r0 in range(start, end, BM):
            rows = r0 + tl.arange(0, BM)
            rm = rows < end
            xrow = rows.to(tl.int64)
            acc = tl.zeros([BM, BN], tl.float32)
            acc0 = tl.zeros([BN], tl.float32)  # GEMV: rows r0 and r0 + 1
            acc1 = tl.zeros([BN], tl.float32)
            for k0 in range(ps * KS, tl.minimum(ps * KS + KS, K), BK):
                for kk in tl.static_range(NB * GEMV):
                    acc0, acc1 = _fp4_gemv_block(x_ptr, sx_ptr, w_ptr, sw_ptr, r0, end, wrow, cm, k0 // 32 + kk,
                                                 acc0, acc1, K, BM == 2, ASM)
                if MX and not F8 and not GEMV:
                    acc = _fp4_chunk_mx(x_ptr, sx_ptr, w_ptr, sw_ptr, xrow, wrow, rm, cm, k0, KB * 32, acc, K, BK)
                for kk in tl.static_range(NB * F8 * (1 - GEMV)):
                    kbi = k0 // 32 + kk
                    wn = cm & ((cols * 0 + kbi) < KB)
                    xn = rm & ((rows * 0 + kbi) < KB)
                    sw = tl.load(sw_ptr + wrow * (K // 32) + kbi, mask=wn, other=0).to(tl.int32)
                    sx = tl.load(sx_ptr + xrow * (K // 32) + kbi, mask=xn, other=0).to(tl.int32)
                    jb = tl.arange(0, 16)
                    wb = tl.load(w_ptr + wrow[:, None] * (K // 2) + kbi * 16 + jb[None, :], mask=wn[:, None], other=0)
                    w_even, w_odd = _fp4_e4m3_pair(wb, ASM)
                    jx = tl.arange(0, 32)
                    xq = tl.load(x_ptr.to(tl.pointer_type(tl.uint8)) + xrow[:, None] * K + kbi * 32 + jx[None, :],
                                 mask=xn[:, None], other=0)
                    acc = _f8_block(xq, tl.reshape(tl.join(w_even, w_odd), [BN, 32]), sx, sw, acc, 6)
                for kk in tl.static_range(NB * (1 - MX) * (1 - F8) * (1 - GEMV)):
                    kbi = k0 // 32 + kk  # one 32-deep scale block: 16 bytes / int16 pairs per row
                    # (the block's bound joins the row masks as a vector: the interpreter takes no
                    # scalar in a mask)
                    wn = cm & ((cols * 0 + kbi) < KB)
                    xn = rm & ((rows * 0 + kbi) < KB)
                    sw = tl.load(sw_ptr + wrow * (K // 32) + kbi, mask=wn, other=0).to(tl.int32)
                    sx = tl.load(sx_ptr + xrow * (K // 32) + kbi, mask=xn, other=0).to(tl.int32)
                    if WORDS:
                        part = _fp4_block_words(x_ptr, w_ptr, xrow, wrow, xn, wn, kbi, K, BM, BN)
                    else:
                        part = _fp4_block_bytes(x_ptr, w_ptr, xrow, wrow, xn, wn, kbi, K)
                    acc += part * (_pow2(sx, 0)[:, None] * _pow2(sw, 14)[None, :])
            if GEMV:
                if BM == 2:
                    acc = tl.trans(tl.join(acc0, acc1))
                else:
                    acc = acc0[None, :]
            _moe_out(y_ptr, part_ptr, ps, rows, cols, acc, rm[:, None] & cm[None, :], MTOT, N, SPLIT)
    else:
        zero = tl.zeros([BM, BN], tl.float32)
        first = tl.load(off_ptr)
        last = tl.load(off_ptr + E)
        for r0 in range(0, first, BM):
            rows = r0 + tl.arange(0, BM)
            _moe_out(y_ptr, part_ptr, ps, rows, cols, zero, (rows < first)[:, None] & cm[None, :], MTOT, N, SPLIT)
        for r0 in range(last, MTOT, BM):
            rows = r0 + tl.arange(0, BM)
            _moe_out(y_ptr, part_ptr, ps, rows, cols, zero, (rows < MTOT)[:, None] & cm[None, :], MTOT, N, SPLIT)


# ---- DSpark heads (the draft block's tokens) ----------------------------------------------------


@triton.jit
def dspark_step_kernel(a_ptr, first_ptr, drafts_ptr, memb_ptr, mhead_ptr, pv_ptr, pi_ptr, s, V: tl.constexpr,
                       R: tl.constexpr, S: tl.constexpr, NT: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    """Draft step s of sequence `row`, over one tile of the vocabulary: logits = A[row * S + s] (the
    head's fp32 logits of block row s, one GEMM for all rows beforehand) + markov_embed[prev] .
    markov_head^T in fp32, where prev is t* at s = 0 and the draft of step s - 1 after; the tile's
    maximum and its lowest id go to pv / pi[row, tile]."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    if s == 0:
        prev = tl.load(first_ptr + row).to(tl.int64)
    else:
        prev = tl.load(drafts_ptr + row * S + s - 1).to(tl.int64)
    v = t * BV + tl.arange(0, BV)
    vm = v < V
    v64 = v.to(tl.int64)
    acc = tl.zeros([BV], tl.float32)
    for r0 in tl.static_range(0, R, BR):
        rr = r0 + tl.arange(0, BR)
        rm = rr < R
        m = tl.load(memb_ptr + prev * R + rr, mask=rm, other=0.0).to(tl.float32)
        w = tl.load(mhead_ptr + v64[:, None] * R + rr[None, :], mask=vm[:, None] & rm[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * m[None, :], axis=1)
    logit = tl.load(a_ptr + (row * S + s) * V + v64, mask=vm, other=0.0) + acc
    logit = tl.where(vm, logit, float("-inf"))
    best = tl.max(logit, axis=0)
    tl.store(pv_ptr + row * NT + t, best)
    tl.store(pi_ptr + row * NT + t, tl.min(tl.where(logit == best, v, 2147483647), axis=0))


@triton.jit
def dspark_pick_kernel(pv_ptr, pi_ptr, hb_ptr, first_ptr, drafts_ptr, memb_ptr, proj_ptr, conf_ptr, s,
                       H: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, S: tl.constexpr, NT: tl.constexpr,
                       BT: tl.constexpr, BH: tl.constexpr):
    """Step s of sequence `row`: the draft is the tiles' maximum with the lowest id among equal
    maxima (argmax's first index); its confidence logit is [hb_s ; markov_embed[prev]] . proj on
    the pre-norm hidden, in fp32."""
    row = tl.program_id(0).to(tl.int64)
    if s == 0:
        prev = tl.load(first_ptr + row).to(tl.int64)
    else:
        prev = tl.load(drafts_ptr + row * S + s - 1).to(tl.int64)
    tt = tl.arange(0, BT)
    best = tl.max(tl.full([BT], float("-inf"), tl.float32), axis=0)
    idx = tl.min(tl.full([BT], 2147483647, tl.int32), axis=0)
    for t0 in range(0, NT, BT):
        tm = (t0 + tt) < NT
        pv = tl.load(pv_ptr + row * NT + t0 + tt, mask=tm, other=float("-inf"))
        pi = tl.load(pi_ptr + row * NT + t0 + tt, mask=tm, other=2147483647)
        b = tl.max(pv, axis=0)
        i = tl.min(tl.where(pv == b, pi, 2147483647), axis=0)
        idx = tl.where(b > best, i, tl.where(b == best, tl.minimum(i, idx), idx))
        best = tl.maximum(best, b)
    tl.store(drafts_ptr + row * S + s, idx.to(tl.int64))
    hh = tl.arange(0, BH)
    acc = tl.zeros([BH], tl.float32)
    for h0 in range(0, H, BH):
        hm = (h0 + hh) < H
        x = tl.load(hb_ptr + (row * S + s) * H + h0 + hh, mask=hm, other=0.0).to(tl.float32)
        acc += x * tl.load(proj_ptr + h0 + hh, mask=hm, other=0.0).to(tl.float32)
    rr = tl.arange(0, RP)
    rm = rr < R
    m = tl.load(memb_ptr + prev * R + rr, mask=rm, other=0.0).to(tl.float32)
    mp = tl.load(proj_ptr + H + rr, mask=rm, other=0.0).to(tl.float32)
    tl.store(conf_ptr + row * S + s, tl.sum(acc, axis=0) + tl.sum(m * mp, axis=0))


# ---- per-sequence spans, compressor pooling + norm, the mHC pieces outside hc_pre ---------------


@triton.jit
def seq_first_kernel(pos_ptr, seq_ptr, first_ptr, n, BLOCK: tl.constexpr):
    """first[s] = the smallest position of sequence s in the step (scratch starts at INT32_MAX):
    the references' seq_span, which tells a group or n-gram source in the step from one in a ring."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(seq_ptr + i, mask=m, other=0)
    p = tl.load(pos_ptr + i, mask=m, other=0).to(tl.int32)
    tl.atomic_min(first_ptr + s, p, mask=m)


@triton.jit
def compress_pool_norm_kernel(l_ptr, s_ptr, st_ptr, pos_ptr, seq_ptr, slots_ptr, first_ptr, nw_ptr, y_ptr, n, eps,
                              RATIO: tl.constexpr, RP: tl.constexpr, RING: tl.constexpr, D: tl.constexpr,
                              BD: tl.constexpr):
    """One row per program: the RATIO rows of its group (from this step's rows where the group's
    position is in the step, else from the fp32 state ring, slot pos mod RING), softmax of the
    scores over the group per column, the weighted latent sum on rows that complete an entry
    (zeros elsewhere), rounded to bf16, then the RMSNorm of that row."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    first = tl.load(first_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    i = tl.arange(0, RP)
    d = tl.arange(0, BD)
    gpos = pos - RATIO + 1 + i
    row = tl.minimum(tl.maximum(t - RATIO + 1 + i, 0), tl.maximum(n - 1, 0))
    in_step = (gpos >= first) & (i < RATIO)
    in_ring = (gpos < first) & (i < RATIO)
    entry = (slot * RING + tl.maximum(gpos, 0) % RING) * 2
    dm = (d < D)[None, :]
    step_m = in_step[:, None] & dm
    ring_m = in_ring[:, None] & dm
    lv = tl.where(step_m, tl.load(l_ptr + row[:, None] * D + d[None, :], mask=step_m, other=0.0),
                  tl.load(st_ptr + entry[:, None] * D + d[None, :], mask=ring_m, other=0.0))
    sv = tl.where(step_m, tl.load(s_ptr + row[:, None] * D + d[None, :], mask=step_m, other=0.0),
                  tl.load(st_ptr + (entry + 1)[:, None] * D + d[None, :], mask=ring_m, other=0.0))
    sv = tl.where((i < RATIO)[:, None], sv, float("-inf"))
    e = tl.exp(sv - tl.max(sv, axis=0)[None, :])
    p = e / tl.sum(e, axis=0)[None, :]
    z = tl.sum(p * lv, axis=0)
    z = tl.where((pos + 1) % RATIO == 0, z, 0.0)
    zb = tl.where(d < D, _bf16_rne(z), 0.0)
    rstd = tl.math.rsqrt(tl.sum(zb * zb, axis=0) / D + eps)
    w = tl.load(nw_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    _store_as(y_ptr + t * D + d, w * (zb * rstd), d < D)


@triton.jit
def hc_mix_kernel(r_ptr, fn_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, m_ptr, part_ptr, n, eps, hc_eps, post_mult,
                  C: tl.constexpr, H: tl.constexpr, ITERS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                  SPLIT: tl.constexpr):
    """hc_pre_kernel's mixes alone (the mix GEMM, here or summed from hc_mix_split_kernel's
    partials, the RMS statistic, Sinkhorn), for an entry with no collapse. SPLIT > 1: program
    (row block, p) takes the block's row p."""
    row0 = tl.program_id(0) * BM + (tl.program_id(1) if SPLIT > 1 else 0)
    _hc_mixes(r_ptr, fn_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, m_ptr, part_ptr, n, eps, hc_eps, post_mult,
              row0, C, H, ITERS, BM, BK, SPLIT)


@triton.jit
def hc_reduce_kernel(r_ptr, mix_ptr, out_ptr, C: tl.constexpr, H: tl.constexpr, BH: tl.constexpr,
                     MEAN: tl.constexpr):
    """out = sum_c mix[c] * R[c] (hc_collapse), or the mean of the copies (MEAN: hc_mean), in fp32
    in copy order, rounded to the stream's dtype; program (row, chunk of H)."""
    row = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = hh < H
    acc = tl.zeros([BH], tl.float32)
    for c in tl.static_range(C):
        rc = tl.load(r_ptr + row * C * H + c * H + hh, mask=hm, other=0.0).to(tl.float32)
        if MEAN:
            acc += rc
        else:
            acc += tl.load(mix_ptr + row * C + c) * rc
    if MEAN:
        acc = tl.math.div_rn(acc, tl.full(acc.shape, C, tl.float32))
    _store_as(out_ptr + row * H + hh, acc, hm)


@triton.jit
def hc_collapse_norm_kernel(r_ptr, prein_ptr, nw_ptr, x_ptr, q_ptr, s_ptr, eps, C: tl.constexpr, H: tl.constexpr,
                            BH: tl.constexpr, QUANT: tl.constexpr = 0):
    """x = w * RMSNorm(sum_c pre_in[c] * R[c]), the collapse in fp32 in copy order rounded to the
    stream's dtype first (hc_pre's input, as its finishing kernel computes it); a program per
    row, the whole row in one block (one trip to memory). QUANT: also x (as stored) quantised
    per 32 to fp8 with ue8m0 scales into q / s."""
    row = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BH)
    hm = hh < H
    acc = tl.zeros([BH], tl.float32)
    for c in tl.static_range(C):
        rc = tl.load(r_ptr + row * C * H + c * H + hh, mask=hm, other=0.0).to(tl.float32)
        acc += tl.load(prein_ptr + row * C + c) * rc
    xc = _round_like(acc, r_ptr.dtype.element_ty)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=0) / H + eps)
    w = tl.load(nw_ptr + hh, mask=hm, other=0.0).to(tl.float32)
    x = _round_like(w * (xc * rstd), x_ptr.dtype.element_ty)  # as stored: the quantisation reads it
    tl.store(x_ptr + row * H + hh, x.to(x_ptr.dtype.element_ty), mask=hm)
    if QUANT:
        NB: tl.constexpr = BH // 32
        y = tl.reshape(x, [NB, 32])
        qb, sb = _fp8_block_quant(y)
        cols = tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :]
        tl.store(q_ptr + row * H + cols, qb.to(tl.uint8), mask=cols < H)
        tl.store(s_ptr + row * (H // 32) + tl.arange(0, NB), sb.to(tl.uint8), mask=tl.arange(0, NB) < H // 32)


@triton.jit
def repeat_rows_kernel(x_ptr, out_ptr, W: tl.constexpr, COPIES: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, c] = x[t] for c < COPIES (the repeated mHC stream); program (row, chunk)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < W
    v = tl.load(x_ptr + t * W + cols, mask=m)
    for c in tl.static_range(COPIES):
        tl.store(out_ptr + (t * COPIES + c) * W + cols, v, mask=m)


@triton.jit
def copy_cols_kernel(src_ptr, dst_ptr, W_IN: tl.constexpr, W_OUT: tl.constexpr, OFF: tl.constexpr,
                     BLOCK: tl.constexpr):
    """dst[o, OFF:OFF+W_IN] = src[o] (one operand of a concat, o the outer index); program (o, chunk)."""
    o = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < W_IN
    tl.store(dst_ptr + o * W_OUT + OFF + cols, tl.load(src_ptr + o * W_IN + cols, mask=m), mask=m)


# ---- Engram ids ---------------------------------------------------------------------------------


@triton.jit
def lookup_kernel(table_ptr, ids_ptr, dead_ptr, out_ptr, n, V: tl.constexpr, ND: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = table[ids[t]], or DEAD (-1) for ids outside the table or among the ND dead ids."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    ids = tl.load(ids_ptr + i, mask=m, other=0).to(tl.int64)
    inside = (ids >= 0) & (ids < V)
    for j in tl.static_range(ND):
        inside = inside & (ids != tl.load(dead_ptr + j))
    v = tl.load(table_ptr + tl.minimum(tl.maximum(ids, 0), V - 1), mask=m & inside, other=0).to(tl.int64)
    tl.store(out_ptr + i, tl.where(inside, v, -1), mask=m)


@triton.jit
def engram_ngram_ids_kernel(cids_ptr, hist_ptr, pos_ptr, seq_ptr, slots_ptr, first_ptr, out_ptr, n, pad,
                            R: tl.constexpr, RP: tl.constexpr, RING: tl.constexpr):
    """Row t: the compressed ids at positions pos - r (r < R), from this step's rows where the
    position is in the step, else from the history ring (slot pos mod RING); a look-back before
    the sequence start or through a DEAD id blocks it and every longer one (pad id)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    first = tl.load(first_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    r = tl.arange(0, RP)
    rm = r < R
    src_pos = pos - r
    in_step = src_pos >= first
    row = tl.minimum(tl.maximum(t - r, 0), tl.maximum(n - 1, 0))
    from_step = tl.load(cids_ptr + row, mask=rm & in_step, other=0).to(tl.int64)
    from_ring = tl.load(hist_ptr + slot * RING + tl.maximum(src_pos, 0) % RING, mask=rm & ~in_step, other=0)
    src = tl.where(in_step, from_step, from_ring.to(tl.int64))
    unusable = ((src_pos < 0) | (src == -1)) & rm
    blocked = tl.cumsum(unusable.to(tl.int32), axis=0) > 0
    tl.store(out_ptr + t * R + r, tl.where(blocked, pad.to(tl.int64), src), mask=rm)
# ---- MoE permutation (moe_permute) ----------------------------------------------------------------
# A counting sort by expert, all integer arithmetic and no atomics, so the order is the stable
# sort's exactly and every run writes the same bytes. A block of pairs is ranked in registers by a
# bitonic sort of (expert, position in the block) keys; across blocks each expert's pairs go after
# those of the earlier blocks: per-block histograms, then an exclusive scan over blocks and
# experts. Work is linear in the pairs (plus blocks x experts for the scan), where ranking every
# pair against every other would be quadratic: 24576 prefill pairs would cost 600M comparisons.
# Decode steps (every pair in one block) take the sort alone, in one program and one launch.


@triton.jit
def moe_permute_count_kernel(sel_ptr, cnt_ptr, adj_ptr, N: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                             BLOCK: tl.constexpr):
    """Block b's pairs per expert (cnt[b]), and where each expert's run starts in the block's
    sorted order (adj[b], which the scan turns into the shift to its global place)."""
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    e = tl.load(sel_ptr + i, mask=m, other=0).to(tl.int32)
    h = tl.histogram(e, EP, mask=m)
    ee = tl.arange(0, EP)
    tl.store(cnt_ptr + b * E + ee, h, mask=ee < E)
    tl.store(adj_ptr + b * E + ee, tl.cumsum(h, 0) - h, mask=ee < E)


@triton.jit
def moe_permute_scan_kernel(cnt_ptr, adj_ptr, off_ptr, E: tl.constexpr, NB: tl.constexpr, EP: tl.constexpr,
                            EC: tl.constexpr, NBT: tl.constexpr):
    """Experts [c0, c0 + EC) of program c: offsets[e] = pairs of the experts before e, and
    adj[b, e] = offsets[e] + e's pairs in the blocks before b - e's start in block b. A program
    reads the counts of every earlier expert, so the grid needs no second pass."""
    c0 = tl.program_id(0) * EC
    cc = c0 + tl.arange(0, EC)
    cm = cc < E
    ee = tl.arange(0, EP)
    bb = tl.arange(0, NBT)
    below = tl.zeros([NBT], tl.int32)
    tot = tl.zeros([EC], tl.int32)
    for b0 in range(0, NB, NBT):
        rm = (b0 + bb) < NB
        row = (b0 + bb)[:, None] * E
        below += tl.sum(tl.load(cnt_ptr + row + ee[None, :], mask=rm[:, None] & (ee < c0)[None, :], other=0), axis=1)
        tot += tl.sum(tl.load(cnt_ptr + row + cc[None, :], mask=rm[:, None] & cm[None, :], other=0), axis=0)
    start = tl.sum(below, axis=0) + tl.cumsum(tot, 0) - tot
    tl.store(off_ptr + cc, start, mask=cc <= E)  # offsets[E] (= N): the program holding E
    run = start
    for b0 in range(0, NB, NBT):
        m = ((b0 + bb) < NB)[:, None] & cm[None, :]
        at = (b0 + bb)[:, None] * E + cc[None, :]
        t = tl.load(cnt_ptr + at, mask=m, other=0)
        own = tl.load(adj_ptr + at, mask=m, other=0)
        tl.store(adj_ptr + at, run[None, :] + tl.cumsum(t, 0) - t - own, mask=m)
        run += tl.sum(t, axis=0)


@triton.jit
def moe_permute_kernel(sel_ptr, adj_ptr, order_ptr, off_ptr, N: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                       BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    """Block b's pairs sorted by (expert, position): the p-th of them goes to p + adj[b, its
    expert]. SINGLE: the block holds every pair, p is the place, and the offsets come from the
    block's histogram."""
    b = tl.program_id(0)
    p = tl.arange(0, BLOCK)
    m = b * BLOCK + p < N
    e = tl.load(sel_ptr + b * BLOCK + p, mask=m, other=0).to(tl.int32)
    key = tl.sort(tl.where(m, e * BLOCK + p, E * BLOCK + p))  # padding sorts last
    se = key // BLOCK
    ok = se < E
    if SINGLE:
        h = tl.histogram(e, EP, mask=m)
        ee = tl.arange(0, EP)
        tl.store(off_ptr + ee, tl.cumsum(h, 0) - h, mask=ee <= E)
        pos = p
    else:
        pos = p + tl.load(adj_ptr + b * E + se, mask=ok, other=0)
    tl.store(order_ptr + pos, b * BLOCK + key % BLOCK, mask=ok)


# ---- indexer: scores, candidate pool, top-k (the fused indexer_topk) ----------------------------
#
# Scores are kept as int32 keys whose signed order is the float order (-0.0 and +0.0 one key, as
# the reference's sort compares them equal): -inf is -2139095041, +inf 2139095040. Both
# selections rank by (key desc, index asc), the reference's stable top-k, and emit the picks in
# ascending index order, which is the order the op returns them in.


@triton.jit
def _fp4_f16(code):
    """e2m1 codes (int32 0..15) -> their value x 2^-14 in fp16, by placing the code's bits: the
    magnitude (e1 e0 m) where fp16 reads the exponent's low bits over the top mantissa bit (the
    0.5 code lands on fp16's subnormal 2^-15, exactly), the sign on fp16's. Four integer
    operations a code; products of two are multiples of 2^-30 below 2^-22, so an fp16 MMA of a
    32-deep block accumulates them exactly in fp32."""
    return (((code & 7) << 9) | ((code & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _score_key(s):
    b = s.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def indexer_block_map_kernel(cand_ptr, map_ptr, NC: tl.constexpr, NBLK: tl.constexpr, BLOCK: tl.constexpr):
    """map[t, b] = 1 for each block b of row t's candidate list (-1 entries are padding): the
    pool as a per-block table, whatever the list's order."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    b = tl.load(cand_ptr + t * NC + i, mask=i < NC, other=-1)
    tl.store(map_ptr + t * NBLK + b, tl.full([BLOCK], 1, tl.uint8), mask=(i < NC) & (b >= 0) & (b < NBLK))


@triton.jit
def indexer_score_kernel(qd_ptr, qs_ptr, w_ptr, kd_ptr, ks_ptr, pos_ptr, seq_ptr, bt_ptr, map_ptr, key_ptr, bkey_ptr,
                         w_scale, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, PE: tl.constexpr,
                         MAXP: tl.constexpr, RATIO: tl.constexpr, CAP: tl.constexpr, BS: tl.constexpr,
                         NBLK: tl.constexpr, SCALE: tl.constexpr, CAND: tl.constexpr, EMIT: tl.constexpr,
                         BC: tl.constexpr):
    """Keys of score[t, c] = sum_h w[t, h] * relu(qI[t, h] . kI[c]) for the BC entries of tile
    program_id(1) of row t, -inf past vis = (pos + 1) // RATIO (and outside the pool, CAND);
    with EMIT also each BS-entry block's max. Tiles wholly past vis are not written (the select
    kernel reads nothing there).

    Scores are bf16 arithmetic as the reference's (ir/numerics.py). Its dot is exact (fp64)
    rounded to fp32, then to bf16: here each 32-wide scale block is a dot of the e2m1 values x
    2^-14 (_fp4_f16; fp16 MMAs, exact in fp32; not bf16, whose dot the interpreter gets wrong), the
    blocks scaled by their 2^(sq + sk) and summed in fp64, which holds them exactly, then rounded
    the same way. Each head term w * relu(dot) is exact in fp32 and rounded to bf16; the terms are
    summed in fp64 like the reference's sum32 (in another order: the same sum unless the 32 terms
    span more than 2^29, and then only where the fp64 rounding reaches the fp32 one), and the sum
    rounded to fp32, then bf16."""
    t = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BC
    vis = tl.minimum((tl.load(pos_ptr + t).to(tl.int64) + 1) // RATIO, CAP)
    if c0 < vis:
        NB: tl.constexpr = D // 32
        c = c0 + tl.arange(0, BC)
        cm = c < vis
        live = cm
        if CAND:
            live = cm & (tl.load(map_ptr + t * NBLK + c // BS, mask=cm, other=0) != 0)
        key = tl.full([BC], -2139095041, tl.int32)
        if tl.max(live.to(tl.int32), axis=0) > 0:
            seq = tl.load(seq_ptr + t).to(tl.int64)
            page = tl.load(bt_ptr + seq * MAXP + c // PE, mask=live, other=0).to(tl.int64)
            krow = page * PE + c % PE
            h = tl.arange(0, HP)
            hm = h < H
            qrow = t * H + h
            w = tl.load(w_ptr + qrow, mask=hm, other=0.0).to(tl.float32)
            if SCALE:
                w = _round_like(w * w_scale, w_ptr.dtype.element_ty)
            j = tl.arange(0, 16)
            dot = tl.zeros([BC, HP], tl.float64)
            for b in tl.static_range(NB):
                qb = tl.load(qd_ptr + qrow[:, None] * (D // 2) + b * 16 + j[None, :], mask=hm[:, None],
                             other=0).to(tl.int32)
                kb = tl.load(kd_ptr + krow[:, None] * (D // 2) + b * 16 + j[None, :], mask=live[:, None],
                             other=0).to(tl.int32)
                # low nibbles are the even elements, high the odd: two 16-deep MMAs make the block
                s = tl.dot(_fp4_f16(kb & 15), tl.trans(_fp4_f16(qb & 15)))
                s = tl.dot(_fp4_f16(kb >> 4), tl.trans(_fp4_f16(qb >> 4)), s)
                sq = tl.load(qs_ptr + qrow * NB + b, mask=hm, other=0).to(tl.int64)
                sk = tl.load(ks_ptr + krow * NB + b, mask=live, other=0).to(tl.int64)
                # 2^(sq - 127 + 14) and 2^(sk - 127 + 14) as fp64 bits, per head and per entry (the
                # codes' 2^-14 each): their product per element is exact
                fq = ((sq + (1023 - 127 + 14)) << 52).to(tl.float64, bitcast=True)
                fk = ((sk + (1023 - 127 + 14)) << 52).to(tl.float64, bitcast=True)
                dot += s.to(tl.float64) * (fk[:, None] * fq[None, :])
            p = _round_like(w[None, :] * tl.maximum(_round_like(dot.to(tl.float32), tl.bfloat16), 0.0), tl.bfloat16)
            score = _round_like(tl.sum(p.to(tl.float64), axis=1).to(tl.float32), tl.bfloat16)
            key = tl.where(live, _score_key(score), -2139095041)
        tl.store(key_ptr + t * CAP + c, key, mask=c < CAP)
        if EMIT:
            bb = c0 // BS + tl.arange(0, BC // BS)
            tl.store(bkey_ptr + t * NBLK + bb, tl.max(tl.reshape(key, [BC // BS, BS]), axis=1), mask=bb < NBLK)


@triton.jit
def _load_keys(ptr, idx, m, pin):
    key = tl.load(ptr + idx, mask=m, other=-2139095041)
    return tl.where(idx == pin, 2139095040, key)


@triton.jit
def _radix_threshold(ptr, nv, ntot, kk, pin, BLOCK: tl.constexpr):
    """(T, r): the kk first of ntot keys by (key desc, index asc) are those above T and the r
    lowest-index ones equal to T. Keys 0..nv-1 are read at ptr (key `pin` as +inf), the rest are
    -inf. Four 8-bit radix passes over the keys' unsigned images (key ^ sign bit)."""
    bins = tl.arange(0, 256)
    u_inf = -2139095041 ^ -2147483648
    prefix = nv * 0
    pmask = nv * 0
    need = kk + nv * 0
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for c0 in range(0, nv, BLOCK):
            idx = c0 + tl.arange(0, BLOCK)
            m = idx < nv
            u = _load_keys(ptr, idx, m, pin) ^ -2147483648
            match = m & ((u & pmask) == prefix)
            # keys outside the prefix land in bin 0 and are taken out of it again
            hist += tl.histogram(tl.where(match, (u >> shift) & 255, 0), 256)
            hist -= tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32), axis=0), 0)
        hist += tl.where((bins == ((u_inf >> shift) & 255)) & ((u_inf & pmask) == prefix), ntot - nv, 0)
        ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys in bins >= b
        dstar = tl.max(tl.where(ge >= need, bins, 0), axis=0)
        need -= tl.sum(tl.where(bins > dstar, hist, 0), axis=0)
        prefix = prefix | (dstar << shift)
        pmask = pmask | (tl.full([], 255, tl.int32) << shift)
    return prefix ^ -2147483648, need


@triton.jit
def _emit_ascending(ptr, nv, thr, need, pin, out_ptr, KOUT: tl.constexpr, DROP_INF: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Write the indices < nv of keys above thr and of the first `need` equal to it (and not -inf,
    DROP_INF) in ascending order to out[0..KOUT), -1 after them."""
    base = nv * 0
    eq_seen = nv * 0
    for c0 in range(0, nv, BLOCK):
        idx = c0 + tl.arange(0, BLOCK)
        m = idx < nv
        key = _load_keys(ptr, idx, m, pin)
        eq = (m & (key == thr)).to(tl.int32)
        rank = eq_seen + tl.cumsum(eq, axis=0) - eq
        sel = m & ((key > thr) | ((eq != 0) & (rank < need)))
        if DROP_INF:
            sel = sel & (key > -2139095041)
        s = sel.to(tl.int32)
        at = base + tl.cumsum(s, axis=0) - s
        tl.store(out_ptr + at, idx, mask=sel & (at < KOUT))
        base += tl.sum(s, axis=0)
        eq_seen += tl.sum(eq, axis=0)
    for p0 in range(0, KOUT, BLOCK):
        o = p0 + tl.arange(0, BLOCK)
        tl.store(out_ptr + o, tl.full([BLOCK], -1, tl.int32), mask=(o >= base) & (o < KOUT))


@triton.jit
def indexer_select_kernel(key_ptr, bkey_ptr, pos_ptr, top_ptr, pool_ptr, RATIO: tl.constexpr, CAP: tl.constexpr,
                          K: tl.constexpr, KK: tl.constexpr, BS: tl.constexpr, NBLK: tl.constexpr, TB: tl.constexpr,
                          KB: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0); program_id(1) 0: the top KK = min(K, CAP) entries (topk_select: picks at
    or past vis become -1, which is every pick after the visible ones); 1 (the candidate source):
    the pool of candidate_blocks, the top KB = min(TB, NBLK) blocks by their max key, the block of
    the newest visible entry pinned to +inf, -inf picks dropped. A row with at most KK visible
    entries (KB blocks) keeps all of them without a radix pass."""
    t = tl.program_id(0).to(tl.int64)
    vis = tl.minimum(tl.maximum((tl.load(pos_ptr + t).to(tl.int64) + 1) // RATIO, 0), CAP).to(tl.int32)
    thr = tl.full([], -2147483648, tl.int32)
    need = vis * 0
    if tl.program_id(1) == 0:
        if vis > KK:
            thr, need = _radix_threshold(key_ptr + t * CAP, vis, CAP, KK, -1, BLOCK)
        _emit_ascending(key_ptr + t * CAP, vis, thr, need, -1, top_ptr + t * K, K, False, BLOCK)
    else:
        nvb = (vis + BS - 1) // BS
        if nvb > KB:
            thr, need = _radix_threshold(bkey_ptr + t * NBLK, nvb, NBLK, KB, nvb - 1, BLOCK)
        _emit_ascending(bkey_ptr + t * NBLK, nvb, thr, need, nvb - 1, pool_ptr + t * TB, TB, True, BLOCK)
