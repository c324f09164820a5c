"""Pieces shared by the decode GEMMs on warp MMAs (tilelang_moe_decode, tilelang_gemm_decode): the
weight is the 16-row A operand of `mma.sync m16n8k32` e4m3 and 8 rows of x the B operand, so lane
(g, q) holds C for weight rows g and g + 8 and x rows 2q and 2q + 1 (c0..c3 in PTX's order).

Each is a TileLang macro made for a program's constants; `T` is tilelang.language."""


def scaled_mma(T, NT: int, guarded: bool = False):
    """acc[o + 4 nt + i] += C_i of A x B_nt, scaled by the weight row's scale (s0: row g, s1: row
    g + 8) and x's (sx[2 nt + j]: row 2q + j of tile nt), for NT tiles of 8 x rows: one MMA per
    32-deep scale block, its fp32 sum scaled into the accumulator. `guarded`: the macro takes the
    rows left from the pass's first (`left`) and skips tiles 1.. that hold none (a uniform branch:
    a wide pass costs a call of few rows no MMAs)."""

    @T.macro
    def one(a, b, c, acc, o, s0, s1, sx, nt):
        for i in T.unroll(4):
            c[i] = T.float32(0)
        T.ptx_mma("float32", "m16n8k32", "row", "col", "e4m3", "e4m3", "fp32",
                  a.data, 0, b.data, 2 * nt, c.data, 0, T.bool(False))
        acc[o + nt * 4] += c[0] * (s0 * sx[2 * nt])
        acc[o + nt * 4 + 1] += c[1] * (s0 * sx[2 * nt + 1])
        acc[o + nt * 4 + 2] += c[2] * (s1 * sx[2 * nt])
        acc[o + nt * 4 + 3] += c[3] * (s1 * sx[2 * nt + 1])

    if not guarded:
        @T.macro
        def mma(a, b, c, acc, o, s0, s1, sx):
            for nt in T.unroll(NT):
                one(a, b, c, acc, o, s0, s1, sx, nt)

        return mma

    @T.macro
    def mma_rows(a, b, c, acc, o, s0, s1, sx, left):
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
