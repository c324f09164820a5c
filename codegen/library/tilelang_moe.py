"""TileLang grouped MoE GEMM: `grouped_gemm_fp4` (ir/ops/fused.py).

Rows [offsets[e], offsets[e+1]) of the fp8 activation (ue8m0 per row per 32) meet expert e's fp4
e2m1 weight [N, K/2] packed (low nibble = even element) with one ue8m0 byte per output row per 32
inputs; fp32 accumulation, bf16 out.

sm90 has no fp4 tensor-core operand, so each K tile of the weight is widened in shared memory:
every e2m1 code is exactly an e4m3 value (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6), so the widening
is a byte map and the scales stay outside the MMA, applied per 32-deep slice like gemm_fp8
(acc += slice * sx[m, kb] * sw[n, kb]). One CTA owns (an N tile, an expert) and walks that
expert's row tiles; CTAs of empty experts exit at once. Decode (a few rows per expert) and
prefill (tens to hundreds) differ only by their knobs.

sm100 has the operands natively: `tcgen05.mma ... kind::mxf8f6f4.block_scale` multiplies e4m3 rows
by e2m1 weights with a ue8m0 scale per row and 32 K on each side (`T.tcgen05_gemm_blockscaled`),
accumulating in tensor memory. Its shared-memory fp4 layout holds 16 codes in the first 8 of every
16 bytes (one byte slot per element), which the CTA fills from the packed weight; the scales go
through the warp transpose into tensor memory each 128-deep K step (4 ue8m0 bytes per row are one
32-bit word, so the [rows, K/32] byte tensors are read as [rows, K/128] words). 128-row tiles (the
instruction's M); single-buffered. Built with nvcc for sm_100a here, never run.
"""
from typing import Any, Mapping

from ..targets import Target, building
from .tilelang_host import host_grouped_gemm_fp4
from ..template import KernelSource, KernelSpec, Template, register
from .tilelang_gemm import _tl, e8m0_f32, source


def fp4_to_e4m3_byte(T, nib):
    """e2m1 code (0..15) -> the e4m3 byte of the same value: codes 2..7 are normal in both formats
    (e4m3 byte = code*4 + 0x30), code 1 (0.5) is e4m3 0x30, bit 3 is the sign."""
    mag = T.bitwise_and(nib, 7)
    b = T.if_then_else(mag == 0, 0, T.if_then_else(mag == 1, 0x30, mag * 4 + 0x30))
    return T.bitwise_or(b, T.shift_left(T.bitwise_and(nib, 8), 4))


def grouped_gemm_fp4_program(Mtot: int, N: int, K: int, E: int, *, block_M=64, block_N=128, block_K=128,
                             stages=3, threads=128):
    _, T = _tl()
    assert K % block_K == 0 and block_K % 32 == 0 and N % block_N == 0
    kb = block_K // 32
    k_iters = K // block_K

    @T.prim_func
    def grouped_gemm_fp4(X: T.Tensor((Mtot, K), "float8_e4m3"), SX: T.Tensor((Mtot, K // 32), "uint8"),
                         W: T.Tensor((E, N, K // 2), "uint8"), SW: T.Tensor((E, N, K // 32), "uint8"),
                         offsets: T.Tensor((E + 1,), "int32"), C: T.Tensor((Mtot, N), "bfloat16")):
        with T.Kernel(N // block_N, E, threads=threads) as (bx, e):
            X_s = T.alloc_shared((block_M, block_K), "float8_e4m3")
            Wp_s = T.alloc_shared((block_N, block_K // 2), "uint8")
            W_s = T.alloc_shared((block_N, block_K), "float8_e4m3")
            SX_s = T.alloc_shared((block_M, kb), "uint8")
            SW_s = T.alloc_shared((block_N, kb), "uint8")
            tmp = T.alloc_fragment((block_M, block_N), "float32")
            acc = T.alloc_fragment((block_M, block_N), "float32")
            start = offsets[e]
            rows = offsets[e + 1] - start
            for mt in T.serial(T.ceildiv(rows, block_M)):
                r0 = start + mt * block_M
                T.clear(acc)
                for k in T.Pipelined(k_iters, num_stages=stages):
                    # rows past the expert's end are read (they are other experts' rows or guarded
                    # at Mtot) and never stored
                    T.copy(X[r0, k * block_K], X_s)
                    T.copy(SX[r0, k * kb], SX_s)
                    T.copy(W[e, bx * block_N, k * (block_K // 2)], Wp_s)
                    T.copy(SW[e, bx * block_N, k * kb], SW_s)
                    for j, kk in T.Parallel(block_N, block_K):
                        W_s[j, kk] = T.reinterpret(
                            T.Cast("uint8", fp4_to_e4m3_byte(
                                T, T.bitwise_and(T.shift_right(T.Cast("int32", Wp_s[j, kk // 2]), (kk % 2) * 4), 15))),
                            "float8_e4m3")
                    # generic-proxy stores read next by wgmma (async proxy) need this fence
                    T.fence_proxy_async()
                    for s in T.unroll(kb):
                        T.gemm(X_s[:, s * 32:(s + 1) * 32], W_s[:, s * 32:(s + 1) * 32], tmp, transpose_B=True,
                               clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        for i, j in T.Parallel(block_M, block_N):
                            acc[i, j] += tmp[i, j] * (e8m0_f32(T, SX_s[i, s]) * e8m0_f32(T, SW_s[j, s]))
                for i, j in T.Parallel(block_M, block_N):
                    if mt * block_M + i < rows:
                        C[r0 + i, bx * block_N + j] = acc[i, j]

    return grouped_gemm_fp4


def grouped_gemm_fp4_sm100_program(Mtot: int, N: int, K: int, E: int, *, block_N=128, **_):
    """The grouped GEMM on sm100's block-scaled tensor-core MMA (module docstring)."""
    _, T = _tl()
    from tilelang.layout import make_full_bank_swizzled_layout

    block_M, block_K = 128, 128
    assert K % block_K == 0 and N % block_N == 0
    k_iters = K // block_K
    fp4_s = T.float4_e2m1_unpacked

    @T.prim_func
    def grouped_gemm_fp4(X: T.Tensor((Mtot, K), "float8_e4m3fn"), SX: T.Tensor((Mtot, K // 128), "uint32"),
                         W: T.Tensor((E, N, K // 2), "uint8"), SW: T.Tensor((E, N, K // 128), "uint32"),
                         offsets: T.Tensor((E + 1,), "int32"), C: T.Tensor((Mtot, N), "bfloat16")):
        with T.Kernel(N // block_N, E, threads=128) as (bx, e):
            X_s = T.alloc_shared((block_M, block_K), "float8_e4m3fn")
            W_s = T.alloc_shared((block_N, block_K), fp4_s)
            SX_s = T.alloc_shared((block_M,), "uint32")
            SW_s = T.alloc_shared((block_N,), "uint32")
            acc_t = T.alloc_tmem([block_M, block_N], "float32")
            sx_t = T.alloc_tmem([block_M, 4], "uint32")
            sw_t = T.alloc_tmem([block_M, block_N // 128 * 4], "uint32")
            acc = T.alloc_fragment((block_M, block_N), "float32")
            mbar = T.alloc_barrier(1)
            W_b = T.view(W_s, dtype="uint8")
            T.annotate_layout({W_s: make_full_bank_swizzled_layout(W_s), W_b: make_full_bank_swizzled_layout(W_b)})
            tx = T.get_thread_binding()
            start = offsets[e]
            rows = offsets[e + 1] - start
            for mt in T.serial(T.ceildiv(rows, block_M)):
                r0 = start + mt * block_M
                for k in T.serial(k_iters):
                    # rows past the expert's end are read (other experts' rows, or guarded at Mtot)
                    # and never stored
                    T.copy(X[r0, k * block_K], X_s)
                    for r, c in T.Parallel(block_N, block_K):
                        W_b[r, c] = T.if_then_else(
                            c % 16 < 8, W[e, bx * block_N + r, k * (block_K // 2) + (c // 16) * 8 + c % 16], T.uint8(0))
                    T.copy(SX[r0:r0 + block_M, k], SX_s)
                    T.copy(SW[e, bx * block_N:(bx + 1) * block_N, k], SW_s)
                    T.fence_proxy_async()
                    T.sync_threads()
                    if tx < 32:
                        T.tcgen05_sf_warp_transpose(SX_s)
                        T.tcgen05_sf_warp_transpose(SW_s)
                        T.fence_proxy_async()
                        T.sync_warp()
                        T.tcgen05_cp_warpx4(SX_s, sx_t)
                        T.tcgen05_cp_warpx4(SW_s, sw_t)
                        T.tcgen05_gemm_blockscaled(X_s, W_s, acc_t, sx_t, sw_t, transpose_B=True, mbar=mbar,
                                                   clear_accum=k == 0, k_start=k * block_K,
                                                   sf_a_granularity_k=32, sf_b_granularity_k=32)
                    T.mbarrier_wait_parity(mbar, (mt * k_iters + k) % 2)
                T.copy(acc_t, acc)
                for i, j in T.Parallel(block_M, block_N):
                    if mt * block_M + i < rows:
                        C[r0 + i, bx * block_N + j] = acc[i, j]

    return grouped_gemm_fp4


def _dims(spec: KernelSpec):
    x, w = spec.in_types[0], spec.in_types[1]
    return int(x.shape[0]), int(w.shape[1]), int(w.shape[2]), int(w.shape[0])


MOE_KNOBS = {"block_M": (64, 128), "block_N": (64, 128, 256), "block_K": (64, 128), "stages": (2, 3, 4),
             "threads": (128, 256)}


def moe_default_config(target: Target, mtot: int, n: int, k: int, e: int) -> dict:
    """Decode (under ~2 rows per expert on average): 64-row tiles and narrow N tiles, so the few
    active experts still spread their weight stream over many CTAs. Prefill: 128-row tiles over
    two warpgroups. The widening program's tiles are the target's
    (`target.defaults["tilelang_grouped_gemm_fp4"]`: register budgets)."""
    if block_scaled(target, n):
        return {"block_N": 128}  # the block-scaled program: 128-row tiles by the instruction
    tiles = target.defaults["tilelang_grouped_gemm_fp4"]
    return dict(tiles["decode"] if mtot <= 2 * e else tiles["prefill"])


def block_scaled(target: Target, n: int) -> bool:
    """The native block-scaled MMA (e4m3 x e2m1, ue8m0 per 32 K) takes N in 128-row tiles; other
    targets and widths widen the fp4 weights to fp8 in the prologue."""
    return "tcgen05_mxf8f6f4" in target.features and n % 128 == 0


def _render(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    mtot, n, k, e = _dims(spec)
    c = dict(moe_default_config(target, mtot, n, k, e), **config)
    if block_scaled(target, n):
        func = grouped_gemm_fp4_sm100_program(mtot, n, k, e, block_N=c["block_N"])
    else:
        func = grouped_gemm_fp4_program(mtot, n, k, e, **c)
    return source(func, target.arch, {"template": "tilelang_grouped_gemm_fp4", "config": c,
                                      "dims": {"rows": mtot, "n": n, "k": k, "experts": e}})


def canonical_rows(target: Target, spec: KernelSpec) -> KernelSpec:
    """Calls under 2 rows per expert share the 2E-row instance; the host pads the rows, which the
    expert offsets never reach. Kernel selection hands those calls to the Triton decode template
    first (triton_grouped_gemm_fp4, registered before this one), each row count with its own
    instance, so this only pads decode calls that template does not take."""
    from .tilelang_gemm import rows_type

    mtot, n, _, e = _dims(spec)
    if mtot >= 2 * e:
        return spec
    return KernelSpec(spec.op, spec.attrs, (rows_type(spec.in_types[0], 2 * e),) + tuple(spec.in_types[1:]),
                      (spec.out_types[0].with_shape((2 * e, n)),))


register(Template(
    name="tilelang_grouped_gemm_fp4",
    ops=("grouped_gemm_fp4",),
    targets=building("cuda", defaults="tilelang_grouped_gemm_fp4"),
    knobs=MOE_KNOBS,
    render=_render,
    default_config=lambda target, spec: moe_default_config(target, *_dims(spec)),
    supports=lambda target, spec: _dims(spec)[2] % 128 == 0 and _dims(spec)[1] % 64 == 0,
    host=host_grouped_gemm_fp4,
    canonical=canonical_rows,
))
