"""TileLang prefill linears on bf16 tensor cores, where a target's defaults carry their tiles:
`gemm_fp8` (the fp8 linears; `tilelang_gemm_fp8_bf16`, an op of ir/ops/fused.py) and
`grouped_linear` (wo_a, bf16 rows against an fp8 weight; `tilelang_grouped_linear_bf16`). The MoE
experts' program on the same idea is tilelang_moe_prefill.

Both operands carry a ue8m0 scale per 32 K, so an fp8 MMA must promote its fp32 partial into the
accumulator after every 32-deep slice (tilelang_gemm). Here each K tile of the weight is
dequantised into bf16 in shared memory instead, the scale folded in: an e4m3 value times a power
of two is exact in bf16 (8 significant bits, fp32's exponent range), so the products are the same,
and the wgmma accumulates over the whole K in fp32 with no promotion. The sums run in the tensor
core's order rather than slice by slice: the output is rounded as any fp32-accumulated GEMM's.
The raw tiles and their scales stream through a `stages`-deep pipeline; the bf16 tiles are one
buffer each.

One program of bf16 rows against the fp8 weight (one CTA an output tile, the tiles rasterised in
panels, as tilelang_gemm's): wo_a's rows are bf16 already, and gemm_fp8's are dequantised by a
kernel of their own first, once, rather than by each of the GEMM's N tiles.
"""
from typing import Any, Mapping

from ..targets import Target
from .tilelang_host import host_gemm_fp8_rows_bf16, host_grouped_linear
from ..template import KernelSource, KernelSpec, Template, batch_invariant, register

# tilelang_gemm and tilelang_attention are imported where used: importing them here would
# register their templates ahead of the Triton ones (this module is imported before triton_ops,
# so that prefill calls reach these templates first where a target enables them)


KNOBS = {"block_M": (64, 128), "block_N": (64, 128, 256), "block_K": (64, 128), "stages": (2, 3, 4),
         "threads": (128, 256), "scales_once": (0, 1)}
# the programs may also be lowered with TMA copies from a producer warpgroup (tilelang_gemm's tma
# knob)
ROWS_KNOBS = dict(KNOBS, tma=(0, 1))
# also the register-operand program with its MMAs in flight (rows_inflight_program)
GEMM_KNOBS = dict(ROWS_KNOBS, inflight=(0, 1))


def rows_bf16_gemm_program(M: int, G: int, NG: int, KG: int, out_dtype: str = "bfloat16", *, block_M=128,
                           block_N=128, block_K=64, stages=4, threads=256, scales_once=0):
    """C[m, g*NG + n] = sum_k X[m, g*KG + k] * W[g*NG + n, k] sw[(g*NG + n)//32, k//32]: grouped_linear's
    block-diagonal product (group g of X's features meets rows g of W), and with G 1 gemm_fp8's on
    rows dequantised ahead (dequant_rows_program). X is bf16: its tiles go to the wgmma as loaded,
    only the weight's are dequantised. A CTA's N tile lies in one group (NG whole tiles).
    scales_once: the CTA's weight scales for the whole K (block_N/32 x KG/32 bytes) copied before
    the loop, rather than a step's few bytes with plain loads inside it, which every thread then
    waits on once a step (TileLang copies them with cp.async only from 4 bytes a row)."""
    from .tilelang_gemm import _tl, e8m0_f32

    _, T = _tl()
    assert KG % block_K == 0 and block_K % 32 == 0 and NG % block_N == 0 and block_N % 32 == 0
    kb = block_K // 32
    tiles = NG // block_N

    @T.prim_func
    def rows_bf16_gemm(X: T.Tensor((M, G * KG), "bfloat16"), W: T.Tensor((G * NG, KG), "float8_e4m3"),
                       SW: T.Tensor((G * NG // 32, KG // 32), "uint8"), C: T.Tensor((M, G * NG), out_dtype)):
        with T.Kernel(G * tiles, T.ceildiv(M, block_M), threads=threads) as (bx, by):
            X_s = T.alloc_shared((block_M, block_K), "bfloat16")
            W8_s = T.alloc_shared((block_N, block_K), "float8_e4m3")
            SW_s = T.alloc_shared((block_N // 32, KG // 32 if scales_once else kb), "uint8")
            B_s = T.alloc_shared((block_N, block_K), "bfloat16")
            acc = T.alloc_fragment((block_M, block_N), "float32")
            T.use_swizzle(panel_size=8)
            T.clear(acc)
            if scales_once:
                T.copy(SW[bx * (block_N // 32), 0], SW_s)
            for k in T.Pipelined(KG // block_K, num_stages=stages):
                # W's row bx * block_N is group bx // tiles's row (bx % tiles) * block_N
                T.copy(X[by * block_M, (bx // tiles) * KG + k * block_K], X_s)
                T.copy(W[bx * block_N, k * block_K], W8_s)
                if not scales_once:
                    T.copy(SW[bx * (block_N // 32), k * kb], SW_s)
                for j, kk in T.Parallel(block_N, block_K):
                    sb = SW_s[j // 32, k * kb + kk // 32] if scales_once else SW_s[j // 32, kk // 32]
                    B_s[j, kk] = T.Cast("bfloat16", T.Cast("float32", W8_s[j, kk]) * e8m0_f32(T, sb))
                T.fence_proxy_async()  # generic-proxy stores read next by wgmma (async proxy)
                T.gemm(X_s, B_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.copy(acc, C[by * block_M, bx * block_N])

    return rows_bf16_gemm


def inflight_fits(c: Mapping[str, Any], k: int) -> bool:
    """Whether config c's inflight loop (inflight_tiles) runs a K of k: its steps go in pairs (the
    two fragments alternate), at least stages - 2 of them with a copy issued one step or more
    ahead, and one m64 MMA of weight rows a warpgroup."""
    steps = k // c["block_K"]
    return (c["stages"] >= 3 and steps % 2 == 0 and steps >= c["stages"] - 2
            and c["block_N"] == 64 * (c["threads"] // 128))


def inflight_tiles(T, widths, *, block_N: int, block_K: int, stages: int, threads: int, K: int, copy_w, fill,
                   x_col=None):
    """[(n, tile)] for each width n: a macro tile(X, W, C, X_s, W_s, SW_s, Wf0, Wf1, e, bx, r0, used)
    that runs rows r0..r0 + n of X (bf16, in the weight fragment's K order) against the CTA's
    block_N weight rows with the weight as wgmma's register operand (the MMA's M, one m64 a
    warpgroup; the rows its N), and stores C[r0 + i, bx * block_N + j] for i < used. Each step's
    MMAs stay in flight while the next step's fragment is filled: two fragments alternate (K
    steps in pairs), a step waits only for the step before it (wait_wgmma(1)). The copies are
    issued by hand, stages - 2 steps ahead (x's rows and copy_w(W, W_s, step, buffer, e, bx), one
    commit group each; empty groups at the last steps keep the wait's count): a software
    pipeline's copy for step k + stages - 1 lands in step k - 1's buffer, which the MMA still in
    flight reads. fill(W_s, SW_s, Wf, buffer, step) writes the step's fragment. x_col(e, bx): the
    first column of X the CTA reads (a group's features; None: column 0)."""
    nk, ahead = K // block_K, stages - 2
    # one m64 MMA a warpgroup: 256 weight rows on two warpgroups (two a warpgroup) failed the
    # op's check on an H100 (docs/performance.md, thirty-sixth session)
    assert inflight_fits({"block_N": block_N, "block_K": block_K, "stages": stages, "threads": threads}, K)

    def x_tile(X, n, e, bx, r0, k):
        if x_col is None:
            return X[r0:r0 + n, k * block_K:(k + 1) * block_K]
        c0 = x_col(e, bx)
        return X[r0:r0 + n, c0 + k * block_K:c0 + (k + 1) * block_K]

    def tile_program(n: int):
        @T.macro
        def step(X, W, X_s, W_s, SW_s, Wf, acc, e, bx, r0, k, last):
            b = k % stages
            T.ptx_wait_group(2 * (ahead - 1))  # this step's two copy groups have landed
            T.fence_proxy_async()  # cp.async's writes, read next by wgmma (the async proxy)
            T.sync_threads()  # every warp's copies seen, and every warpgroup's step k - 2 finished
            kn = k + ahead
            if kn < nk:
                T.async_copy(x_tile(X, n, e, bx, r0, kn), X_s[kn % stages, 0:n, :])
                copy_w(W, W_s, kn, kn % stages, e, bx)
            else:  # empty groups keep the wait's count right at the last steps
                T.ptx_commit_group()
                T.ptx_commit_group()
            fill(W_s, SW_s, Wf, b, k)
            T.wgmma_gemm(Wf, X_s[b, 0:n, :], acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            # the K loop's last step waits for its own MMAs before the loop exits: left in flight
            # across the exit, ptxas converted accumulator registers for the stores ahead of the
            # epilogue's wait (the SASS's F2FPs before WARPGROUP.DEPBAR 0, wherever the stores
            # are unguarded; a fence on the accumulator after the wait did not stop it), and
            # gemm_fp8's 128-row tiles lost their last step (thirty-seventh session)
            if last:
                T.wait_wgmma(0)
            else:
                T.wait_wgmma(1)  # step k - 1's MMAs are done: its fragment and buffer are free

        @T.macro
        def tile(X, W, C, X_s, W_s, SW_s, Wf0, Wf1, e, bx, r0, used):
            acc = T.alloc_fragment((block_N, n), "float32")
            T.clear(acc)
            for s in T.unroll(ahead):
                # rows past the tile's used ones are read (other experts' rows, zeros past the
                # last row) and never stored
                T.async_copy(x_tile(X, n, e, bx, r0, s), X_s[s, 0:n, :])
                copy_w(W, W_s, s, s, e, bx)
            for kk in T.serial(nk // 2):
                step(X, W, X_s, W_s, SW_s, Wf0, acc, e, bx, r0, kk * 2, False)
                step(X, W, X_s, W_s, SW_s, Wf1, acc, e, bx, r0, kk * 2 + 1, kk == nk // 2 - 1)
            for j, i in T.Parallel(block_N, n):
                if i < used:
                    C[r0 + i, bx * block_N + j] = acc[j, i]
            T.sync_threads()  # every warp is done with the buffers before the next tile's copies

        return tile

    return [(n, tile_program(n)) for n in widths]


# a K order within each 16 that gives lane q of a quad its A-fragment slots (2q, 2q + 1, 2q + 8,
# 2q + 9) from bytes 4q..4q + 3 of a row's word: one 32-bit word a row a 16-deep MMA
def e4m3_rs_order(c):
    """The byte of the weight's row that slot c of the fragment's K order holds (on ints and on
    TileLang expressions alike)."""
    r = c % 16
    return c - r + 4 * ((r % 8) // 2) + r % 2 + 2 * (r // 8)


def e4m3_prelude() -> str:
    """deepinfer_e4m3_pair_bf16: bytes 2h and 2h + 1 of a word of e4m3 values, times 2^(s - 127),
    as a bf16 pair (low half the first). Each byte's magnitude bits shifted left by 4 are bf16's
    exponent's low bits over its top mantissa bits: the value x 2^-120, subnormals included; the
    factor 2^(s - 7) in two steps, as the fp4 widening does."""
    from .tilelang_moe_prefill import BF16X2_MUL

    return BF16X2_MUL + r"""
__device__ __forceinline__ unsigned deepinfer_e4m3_pair_bf16(unsigned w, unsigned h, unsigned s) {
  unsigned t = __byte_perm(w, 0u, h == 0u ? 0x4140u : 0x4342u);
  unsigned r = ((t & 0x007F007Fu) << 4) | ((t & 0x00800080u) << 8);
  unsigned e1 = min(s, 134u) + 120u, e2 = max(s, 134u) - 7u;
  r = deepinfer_bf16x2_mul(r, (e1 << 7) | (e1 << 23));
  return deepinfer_bf16x2_mul(r, (e2 << 7) | (e2 << 23));
}
"""


def e4m3_pair_values(words, h: int, scales):
    """What deepinfer_e4m3_pair_bf16 computes, on the host from the same shifts, masks and factors
    (int64 words and ue8m0 scales -> float64 [..., 2], bytes 2h and 2h + 1): the tests hold it to
    the op's dequantisation."""
    import torch

    from .tilelang_moe_prefill import bf16_bits_value

    w, s = words.to(torch.int64) & 0xFFFFFFFF, scales.to(torch.int64)
    out = []
    for byte in (2 * h, 2 * h + 1):
        b = (w >> (8 * byte)) & 0xFF
        bits = ((b & 0x7F) << 4) | ((b & 0x80) << 8)
        e1, e2 = torch.clamp(s, max=134) + 120, torch.clamp(s, min=134) - 7
        out.append(bf16_bits_value(bits) * 2.0 ** (e1 - 127).double() * 2.0 ** (e2 - 127).double())
    return torch.stack(out, -1)


def rows_inflight_program(M: int, G: int, NG: int, KG: int, out_dtype: str = "bfloat16", *, block_M=128,
                          block_N=128, block_K=64, stages=4, threads=256, rs_order=True):
    """rows_bf16_gemm_program's product (grouped_linear's with G groups, gemm_fp8's on rows
    dequantised ahead with G 1) with the e4m3 weight as wgmma's register operand, widened a byte
    pair at a time with its 32 x 32 block's scale folded in (exact), each step's MMAs in flight
    while the next step's fragment is filled (inflight_tiles, the prefill MoE GEMM's loop). C^T =
    W x^T: a CTA's block_N weight rows (in one group) are the MMA's M, block_M rows of x its N.
    The weight's scales for the CTA's whole K are read once, as 32-bit words (four 32-deep blocks
    a word, as tilelang_gemm.scale_operands' words: a byte copy took several guarded passes). W
    and SW: the e4m3 weight and its ue8m0 scales read as 32-bit words (the host passes the same
    bytes). rs_order: X's K order is e4m3_rs_order's (gemm_fp8's rows, dequantised ahead in it),
    so a lane's four fragment slots are one word of the weight's row; off (wo_a's X, as the
    attention writes it), slot c is byte c and the four slots lie in two words."""
    from .tilelang_gemm import _tl

    _, T = _tl()
    # KG % 128 (the scale words): inflight_fits' pairs of steps of at least 64
    assert KG % block_K == 0 and KG % 128 == 0 and block_K % 32 == 0 and NG % block_N == 0 and block_N % 32 == 0
    kb, kw, tiles = block_K // 32, block_K // 4, NG // block_N
    order = e4m3_rs_order if rs_order else (lambda c: c)

    @T.macro
    def copy_w(W, W_s, kn, s, e, bx):
        T.async_copy(W[bx * block_N:(bx + 1) * block_N, kn * kw:(kn + 1) * kw], W_s[s, :, :])

    @T.macro
    def fill(W_s, SW_s, Wf, b, k):
        for j, c in T.Parallel(block_N, block_K):
            src, blk = order(c), k * kb + c // 32
            scale = T.bitwise_and(T.shift_right(SW_s[j // 32, blk // 4], T.Cast("uint32", 8 * (blk % 4))), T.uint32(0xFF))
            pair = T.call_extern("uint32", "deepinfer_e4m3_pair_bf16", W_s[b, j, src // 4],
                                 T.Cast("uint32", (src % 4) // 2), scale)
            Wf[j, c] = T.reinterpret("bfloat16", T.Cast("uint16", T.shift_right(pair, T.Cast("uint32", 16 * (src % 2)))))

    # W's row bx * block_N is group bx // tiles's row (bx % tiles) * block_N; X's group columns
    x_col = None if G == 1 else (lambda e, bx: (bx // tiles) * KG)
    (_, tile), = inflight_tiles(T, [block_M], block_N=block_N, block_K=block_K, stages=stages, threads=threads, K=KG,
                                copy_w=copy_w, fill=fill, x_col=x_col)

    @T.prim_func
    def rows_bf16_gemm_rsi(X: T.Tensor((M, G * KG), "bfloat16"), W: T.Tensor((G * NG, KG // 4), "uint32"),
                           SW: T.Tensor((G * NG // 32, KG // 128), "uint32"), C: T.Tensor((M, G * NG), out_dtype)):
        with T.Kernel(G * tiles, T.ceildiv(M, block_M), threads=threads, prelude=e4m3_prelude()) as (bx, by):
            X_s = T.alloc_shared((stages, block_M, block_K), "bfloat16")
            W_s = T.alloc_shared((stages, block_N, kw), "uint32")
            SW_s = T.alloc_shared((block_N // 32, KG // 128), "uint32")
            Wf0 = T.alloc_fragment((block_N, block_K), "bfloat16")
            Wf1 = T.alloc_fragment((block_N, block_K), "bfloat16")
            T.copy(SW[bx * (block_N // 32), 0], SW_s)
            tile(X, W, C, X_s, W_s, SW_s, Wf0, Wf1, by, bx, by * block_M, T.min(M - by * block_M, block_M))

    return rows_bf16_gemm_rsi


def gemm_programs(M: int, N: int, K: int, out_dtype: str, config: Mapping[str, Any]) -> list:
    """gemm_fp8's two programs for a config (the GEMM, then the rows' dequantisation the host runs
    first): inflight's register-operand program, or rows_bf16_gemm_program on one group."""
    from .tilelang_gemm import program_knobs

    c = program_knobs(config)
    c.pop("min_rows", None)  # which calls take the template (_gemm_supports), not the program
    if c.pop("inflight", 0):
        return [rows_inflight_program(M, 1, N, K, out_dtype, **{k: v for k, v in c.items() if k != "scales_once"}),
                dequant_rows_program(M, K, order=e4m3_rs_order)]
    return [rows_bf16_gemm_program(M, 1, N, K, out_dtype, **c), dequant_rows_program(M, K)]


def dequant_rows_program(M: int, K: int, *, order=None, block_M=16, threads=256):
    """A[m, c] = A8[m, order(c)] * 2^(SA[m, c//32] - 127) in bf16 (exact): the rows dequantised once,
    ahead of a GEMM whose N tiles would each convert them again (gemm_fp8's here). `order`: the
    column of A8 that column c of A takes (a permutation within each 32, on TileLang expressions:
    tilelang_moe_prefill's widened K orders); the identity where None."""
    from .tilelang_gemm import _tl, e8m0_f32

    _, T = _tl()
    bk = next(b for b in (512, 256, 128, 64, 32) if K % b == 0)
    order = order or (lambda c: c)

    @T.prim_func
    def dequant_rows(A8: T.Tensor((M, K), "float8_e4m3"), SA: T.Tensor((M, K // 32), "uint8"),
                     A: T.Tensor((M, K), "bfloat16")):
        with T.Kernel(K // bk, T.ceildiv(M, block_M), threads=threads) as (bx, by):
            for i, kk in T.Parallel(block_M, bk):
                r, c = by * block_M + i, bx * bk + kk
                if r < M:
                    A[r, c] = T.Cast("bfloat16", T.Cast("float32", A8[r, order(c)]) * e8m0_f32(T, SA[r, c // 32]))

    return dequant_rows


# 64 deep on 4 stages: 112 KB of shared memory, two CTAs an SM (128 deep on 3 fits one)
ROWS_TILES = {"block_M": 128, "block_N": 128, "block_K": 64, "stages": 4, "threads": 256}


def _tiles(target: Target, key: str) -> dict:
    """The target's tiles for template `key`, or ROWS_TILES where it names none (a plan variant
    tuned by code whose target lacks them)."""
    return dict(target.defaults.get(key, ROWS_TILES))


def _whole_tiles(c: dict, m: int, n: int, k: int) -> bool:
    """A prefill-sized call (rows past the decode buckets' 64) of whole tiles of config c."""
    return m > 64 and m % c["block_M"] == 0 and n % c["block_N"] == 0 and k % c["block_K"] == 0


def gemm_default_config(target: Target, spec: KernelSpec) -> dict:
    return _tiles(target, "tilelang_gemm_fp8_bf16")


def linear_default_config(target: Target, spec: KernelSpec) -> dict:
    return _tiles(target, "tilelang_grouped_linear_bf16")


def _gemm_render(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    """The rows dequantised by the second kernel (the host launches it first), then
    rows_bf16_gemm_program on one group: the GEMM converts only the weight's tiles."""
    from .tilelang_gemm import _mnk, lower, out_dtype_name, source, tma_pass_configs

    m, n, k = _mnk(spec)
    c = dict(gemm_default_config(target, spec), **config)
    gemm, dequant = gemm_programs(m, n, k, out_dtype_name(spec), c)
    src = source(gemm, target.arch,
                 {"template": "tilelang_gemm_fp8_bf16", "config": c, "dims": {"rows": m, "n": n, "k": k}},
                 tma_pass_configs(c))
    dq = lower(dequant, target.arch)
    src.meta["combine"] = {"entry": dq["entry"], "text": dq["src"], "grid": dq["grid"], "block": dq["block"],
                           "smem_bytes": dq["smem"], "params": dq["params"]}
    return src


def _gemm_supports(target: Target, spec: KernelSpec) -> bool:
    """Prefill-sized calls (rows past the decode buckets' 64 and at least the target's min_rows,
    a whole number of the tiles) in the formats the decode lin8 programs read
    (tilelang_gemm_decode.fp8_operands)."""
    from .tilelang_gemm import _mnk
    from .tilelang_gemm_decode import fp8_operands

    if not fp8_operands(target, spec, "tilelang_gemm_fp8_bf16"):
        return False
    c, (m, n, k) = gemm_default_config(target, spec), _mnk(spec)
    return (_whole_tiles(c, m, n, k) and m >= c.get("min_rows", 0)
            and (not c.get("inflight") or inflight_fits(c, k)))


register(Template(
    name="tilelang_gemm_fp8_bf16",
    ops=("gemm_fp8",),
    targets=("sm90",),  # as tilelang_grouped_gemm_fp4_bf16's
    knobs=GEMM_KNOBS,
    render=_gemm_render,
    default_config=gemm_default_config,
    supports=_gemm_supports,
    host=host_gemm_fp8_rows_bf16,
))


def _linear_dims(spec: KernelSpec) -> tuple[int, int, int, int]:
    """(rows, groups, out features a group, in features a group)."""
    from .tilelang_gemm import _mnk

    m, n, kg = _mnk(spec)
    g = spec.attr["groups"]
    return m, g, n // g, kg


def _linear_render(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    from .tilelang_gemm import program_knobs, source, tma_pass_configs

    m, g, ng, kg = _linear_dims(spec)
    c = dict(linear_default_config(target, spec), **config)
    knobs = program_knobs(c)
    if knobs.pop("inflight", 0):  # the weight in registers, MMAs in flight; X in the features' order
        knobs.pop("scales_once", None)
        program = rows_inflight_program(m, g, ng, kg, rs_order=False, **knobs)
    else:
        program = rows_bf16_gemm_program(m, g, ng, kg, **knobs)
    return source(program, target.arch,
                  {"template": "tilelang_grouped_linear_bf16", "config": c,
                   "dims": {"rows": m, "groups": g, "ng": ng, "kg": kg}}, tma_pass_configs(c))


def _linear_supports(target: Target, spec: KernelSpec) -> bool:
    """Prefill-sized calls (rows past the decode buckets' 64, a whole number of the tiles) of bf16
    rows against an e4m3 weight with ue8m0 per 32 x 32 block (the checkpoint's wo_a), static
    shapes, a bf16 output; a target whose defaults carry the key, not a batch-invariant plan."""
    from ...ir.types import QuantType

    if "tilelang_grouped_linear_bf16" not in target.defaults or batch_invariant(target):
        return False
    x, w = spec.in_types[:2]
    if isinstance(x, QuantType) or not isinstance(w, QuantType) or w.rank != 2:
        return False
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape)):
        return False
    if not (x.dtype.name == "bf16" and spec.attr.get("weight_dtype") == "bf16" and w.data.dtype.name == "fp8e4m3"
            and w.scale.dtype.name == "e8m0" and tuple(w.block) == (32, 32) and spec.out_types[0].dtype.name == "bf16"):
        return False
    m, _, ng, kg = _linear_dims(spec)
    c = linear_default_config(target, spec)
    return _whole_tiles(c, m, ng, kg) and (not c.get("inflight") or inflight_fits(c, kg))


register(Template(
    name="tilelang_grouped_linear_bf16",
    ops=("grouped_linear",),
    targets=("sm90",),  # as tilelang_grouped_gemm_fp4_bf16's
    knobs=GEMM_KNOBS,
    render=_linear_render,
    default_config=linear_default_config,
    supports=_linear_supports,
    host=host_grouped_linear,
))
