"""Pieces shared by the decode GEMMs on warp MMAs (tilelang_moe_decode, tilelang_gemm_decode): the
weight is the 16-row A operand of `mma.sync m16n8k32` e4m3 and 8 rows of x the B operand, so lane
(g, q) holds C for weight rows g and g + 8 and x rows 2q and 2q + 1 (c0..c3 in PTX's order).

Each is a TileLang macro made for a program's constants; `T` is tilelang.language.

sm_90 has no e4m3 `mma.sync`: ptxas runs one as two f16 MMAs (m16n8k16) after converting each
operand pair (cvt.rn.f16x2.e4m3x2, one F2FP per f16 pair), then adds the C operand in an FADD per
element, a zero here since every block's product is scaled on its own. With `f16` the programs
convert and issue the two f16 MMAs themselves (F16_PRELUDE, given to T.Kernel as its prelude):
the same conversions and products without the add, and x's pairs converted once per block for
all of the CTA's weight rows."""

# the conversions as device functions: TileLang has no cvt from e4m3 pairs
F16_PRELUDE = r"""
__device__ __forceinline__ unsigned deepinfer_e4m3_lo_f16x2(unsigned v) {
  unsigned r;
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\t}" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ unsigned deepinfer_e4m3_hi_f16x2(unsigned v) {
  unsigned r;
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, h;\n\t}" : "=r"(r) : "r"(v));
  return r;
}
"""


# The f16 fragments from the e4m3 ones, as (word, half) per f16 register. mma.m16n8k32's lane (g, q)
# holds A words a0 (row g, K slots 4q..4q+3), a1 (row g + 8), a2, a3 (the same at 16 + 4q) and B
# words b0 (x row g, slots 4q..), b1 (16 + 4q..); m16n8k16's holds A pairs a0 (row g, slots 2q,
# 2q + 1), a1 (row g + 8), a2, a3 (the same at 8 + 2q) and B pairs b0 (2q..), b1 (8 + 2q..). So
# the k16 MMA for K slots 0..15 takes a0's and a1's lower pairs then their upper pairs, with b0's
# lower and upper pair (its slot 2q is slot 4q of the k32 block, its 8 + 2q slot 4q + 2), and the
# one for slots 16..31 the same of a2, a3 and b1.
A_PAIRS = ((0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1))
X_PAIRS = ((0, 0), (0, 1), (1, 0), (1, 1))


def f16_pairs(T, v, half: int):
    """The f16 pair of e4m3 bytes 2*half and 2*half + 1 of word v (the lower byte in the lower
    half, as the MMAs read a pair: the lower column first)."""
    return T.call_extern("uint32", ("deepinfer_e4m3_lo_f16x2", "deepinfer_e4m3_hi_f16x2")[half], v)


def f16_x(T, NT: int):
    """x's B fragments as f16 pairs, for `scaled_mma(f16=True)`: b[2NT + 4nt ..] = the pairs of
    b[2nt] (K slots 4q..4q+3 of the k32 MMA: the first k16 MMA's b0, b1) and of b[2nt + 1] (slots
    16+4q..: the second's)."""

    @T.macro
    def widen(b):
        for nt in T.unroll(NT):
            for i, (j, h) in enumerate(X_PAIRS):
                b[2 * NT + 4 * nt + i] = f16_pairs(T, b[2 * nt + j], h)

    return widen


def scaled_mma(T, NT: int, guarded: bool = False, f16: bool = False):
    """acc[o + 4 nt + i] += C_i of A x B_nt, scaled by the weight row's scale (s0: row g, s1: row
    g + 8) and x's (sx[2 nt + j]: row 2q + j of tile nt), for NT tiles of 8 x rows: one MMA per
    32-deep scale block, its fp32 sum scaled into the accumulator. `guarded`: the macro takes the
    rows left from the pass's first (`left`) and skips tiles 1.. that hold none (a uniform branch:
    a wide pass costs a call of few rows no MMAs). `f16`: two f16 MMAs per block, `a` of 12 words
    (a[4..11] take the pairs of a[0..3]) and `b` of 6 NT (its pairs from f16_x)."""

    @T.macro
    def one(a, b, c, acc, o, s0, s1, sx, nt):
        for i in T.unroll(4):
            c[i] = T.float32(0)
        if f16:  # K slots 0..15 of the block, then 16..31 (A_PAIRS, X_PAIRS)
            T.ptx_mma("float32", "m16n8k16", "row", "col", "fp16", "fp16", "fp32",
                      a.data, 4, b.data, 2 * NT + 4 * nt, c.data, 0, T.bool(False))
            T.ptx_mma("float32", "m16n8k16", "row", "col", "fp16", "fp16", "fp32",
                      a.data, 8, b.data, 2 * NT + 4 * nt + 2, c.data, 0, T.bool(False))
        else:
            T.ptx_mma("float32", "m16n8k32", "row", "col", "e4m3", "e4m3", "fp32",
                      a.data, 0, b.data, 2 * nt, c.data, 0, T.bool(False))
        acc[o + nt * 4] += c[0] * (s0 * sx[2 * nt])
        acc[o + nt * 4 + 1] += c[1] * (s0 * sx[2 * nt + 1])
        acc[o + nt * 4 + 2] += c[2] * (s1 * sx[2 * nt])
        acc[o + nt * 4 + 3] += c[3] * (s1 * sx[2 * nt + 1])

    @T.macro
    def widen_a(a):
        for i, (w, h) in enumerate(A_PAIRS):
            a[4 + i] = f16_pairs(T, a[w], h)

    if not guarded:
        @T.macro
        def mma(a, b, c, acc, o, s0, s1, sx):
            if f16:
                widen_a(a)
            for nt in T.unroll(NT):
                one(a, b, c, acc, o, s0, s1, sx, nt)

        return mma

    @T.macro
    def mma_rows(a, b, c, acc, o, s0, s1, sx, left):
        if f16:
            widen_a(a)
        one(a, b, c, acc, o, s0, s1, sx, 0)
        if NT > 1:
            for nt in T.unroll(1, NT):
                if nt * 8 < left:
                    one(a, b, c, acc, o, s0, s1, sx, nt)

    return mma_rows


def warp_order_sum(T, WK: int, nacc: int):
    """Warp 0's accumulators += those of warps 1..WK-1, in warp order (a fixed order: the result
    does not depend on timing), through `red` [WK, nacc, 32] in shared memory."""

    @T.macro
    def total(red, acc, wp, lane):
        if WK > 1:
            for i in T.unroll(nacc):
                red[wp, i, lane] = acc[i]
            T.sync_threads()
            if wp == 0:
                for i in T.unroll(nacc):
                    for w in T.unroll(1, WK):
                        acc[i] += red[w, i, lane]

    return total


def out_position(T, i, NT: int):
    """(x row within the pass, weight row within the CTA) of accumulator i of lane (g, q), as
    offsets from 2q and g: the tile nt = (i // 4) % NT, the row tile rt = i // (4 NT)."""
    return ((i // 4) % NT) * 8 + i % 2, (i // (NT * 4)) * 16 + 8 * ((i % 4) // 2)
