"""TileLang GEMM templates: `gemm_fp8` (the spec's lin8) and `linear` (bf16 / fp32 inputs).

Also the helpers every TileLang template of this library shares: lowering a program for an
explicit CUDA arch (no GPU needed), the nvcc/ptxas report of a rendered source, and compiling a
program into a callable on a machine that has a GPU.

gemm_fp8 numerics (ops `gemm_fp8`, spec §3.6): A is fp8 e4m3 [M, K] with one ue8m0 byte per row
per 32 columns, B is the fp8 weight [N, K] with one ue8m0 byte per 32x32 tile. Both scales change
every 32 elements of K, so the tensor cores accumulate one 32-deep slice at a time into a scratch
fp32 tile and that tile is promoted into the fp32 accumulator with the product of the two scales
(powers of two, so the promotion is exact up to the fp32 add). On sm90 the slice is one wgmma
k32 instruction.

Decode calls (at most 64 rows, one canonical 64-row instance for every decode bucket) run
`gemm_fp8_rows_program`: the live row count is a kernel argument, the activation's copies are
predicated on it, and a split K writes per-split fp32 partials that a second kernel adds in split
order and casts. The host pads, zeroes and casts nothing: one or two kernels a call, and the same
sum for a row whatever else the batch holds.

sm100 multiplies with the scales inside the MMA: `tcgen05.mma ... kind::mxf8f6f4.block_scale` takes
e4m3 operands with one ue8m0 scale per row and 32 K on each side and accumulates in tensor memory,
so no promotion is needed. Four scale bytes of a row per 128-deep K step are one 32-bit word, so
the [rows, K/32] activation scales are read as [rows, K/128] words; the weight's 32x32 tile scales
are repeated to its 32 rows as the CTA stages them. The scales go through the warp transpose into
tensor memory each K step. 128-row tiles (the instruction's M), single-buffered, one warp issues.
K not a multiple of 128 keeps the promotion program. Built with nvcc for sm_100a here, never run.
"""
# no `from __future__ import annotations`: TileLang reads the kernels' annotations as live objects

import dataclasses
import json
import os
import re
import subprocess
import tempfile
from typing import Any, Mapping

from ..targets import Target, building
from .tilelang_host import host_gemm_fp8, host_linear
from ...runtime.tensor_map import TENSOR_MAP
from ..template import BATCH_INVARIANT, KernelSource, KernelSpec, Template, batch_invariant, register

# Pass configs every program of this library is lowered with: plain (non-TMA) copies keep the
# kernels launchable with raw pointers only, and our pipelines are written explicitly.
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
}
# A template's `tma` knob lowers its program with TMA copies and a producer warpgroup instead
# (TileLang's warp specialisation): each TMA-copied buffer becomes a CUtensorMap parameter, whose
# encoding lower() reads off the host module into the parameter's type (runtime/tensor_map.py).
TMA_PASS_CONFIGS = {
    "tl.disable_tma_lower": False,
    "tl.disable_warp_specialized": False,
}


def tma_pass_configs(config: Mapping[str, Any]) -> dict | None:
    return TMA_PASS_CONFIGS if config.get("tma") else None


def program_knobs(config: Mapping[str, Any]) -> dict:
    """A config without the knobs that choose how a program is lowered, not what it is."""
    return {k: v for k, v in config.items() if k != "tma"}


def _tl():
    import tilelang  # noqa: F401  (imported lazily: the CPU test suite must not need it)
    import tilelang.language as T

    return tilelang, T


def cuda_target(arch: str):
    import tvm

    return tvm.target.Target({"kind": "cuda", "arch": arch})


def lower(func, arch: str, pass_configs: Mapping[str, Any] | None = None) -> dict:
    """Render a TileLang program for `arch` (e.g. sm_90a) on any machine: the CUDA source, its
    entry symbol, launch grid/block and dynamic shared memory (read off the lowered device IR)."""
    from ..caches import lowered

    cfg = dict(PASS_CONFIGS, **(pass_configs or {}))
    out = lowered(func, ["cuda", arch, cfg], lambda: _lower(func, arch, cfg))
    return dict(out, grid=tuple(out["grid"]), block=tuple(out["block"]))


def _lower(func, arch: str, cfg: dict) -> dict:
    tilelang, _ = _tl()
    import tvm

    with tvm.transform.PassContext(opt_level=3, config=cfg), cuda_target(arch) as tgt:
        art = tilelang.lower(func, target=tgt)
    out = {"src": art.kernel_source, "entry": "", "grid": (), "block": (), "smem": 0, "params": []}
    for gv, f in art.device_mod.functions.items():
        attrs = f.attrs
        if attrs is None or "thread_extent" not in attrs:
            continue
        ext = {str(k): int(v) for k, v in attrs["thread_extent"].items()}
        out["entry"] = gv.name_hint
        # the kernel's parameters as the lowering left them (it orders them by name and drops
        # buffers the kernel never touches): hosts bind buffers by these names
        out["params"] = [[p.name, _param_ctype(p)] for p in f.params]
        out["grid"] = tuple(ext.get(f"blockIdx.{a}", 1) for a in "xyz")
        out["block"] = tuple(ext.get(f"threadIdx.{a}", 1) for a in "xyz")
        out["smem"] = int(attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in attrs else 0
    maps = _tensor_maps(art.host_mod)
    out["params"] = [[name, TENSOR_MAP + " " + json.dumps(maps[name], separators=(",", ":"), sort_keys=True)
                      if name in maps else ct] for name, ct in out["params"]]
    return out


def _tensor_maps(host_mod) -> dict:
    """Per CUtensorMap parameter, how the host module encodes it (its tensormap_create_tiled
    arguments: map, dtype, rank, buffer, then rank-long lists of extents, byte strides (the first
    is the element size), box and element strides, then interleave, swizzle, L2 promotion and
    out-of-bounds fill). The extents must be static: the runtime encodes from these numbers."""
    maps = {}
    for _, f in host_mod.functions.items():
        if f.attrs is None or "tma_descriptor_args" not in f.attrs:
            continue
        for desc, args in f.attrs["tma_descriptor_args"].items():
            args = list(args)
            if str(args[0]).strip('"') != "__tvm_tensormap_create_tiled":
                raise ValueError(f"{desc}: {args[0]} tensor maps are not supported (tiled ones only)")
            if not all(hasattr(a, "value") for a in args[5:]):
                raise ValueError(f"{desc}: a TMA copy of a buffer with dynamic extents ({args[4]})")
            r, v = int(args[3].value), [int(a.value) for a in args[5:]]
            maps[str(desc)] = {"buffer": str(args[4]), "dtype": int(args[2].value), "dims": v[:r],
                               "elem_size": v[r], "strides": v[r + 1:2 * r], "box": v[2 * r:3 * r],
                               "elem_strides": v[3 * r:4 * r], "interleave": v[4 * r], "swizzle": v[4 * r + 1],
                               "l2": v[4 * r + 2], "oob": v[4 * r + 3]}
    return maps


def _param_ctype(p) -> str:
    """A device-function parameter as the launch ABI sees it: a pointer, or a scalar type."""
    if str(p.dtype) == "handle":
        return "void*"
    return {"int32": "int32_t", "int64": "int64_t", "float32": "float"}[str(p.dtype)]


def source(func, arch: str, meta: Mapping[str, Any], pass_configs: Mapping[str, Any] | None = None) -> KernelSource:
    r = lower(func, arch, pass_configs)
    return KernelSource("cuda", r["entry"], r["src"], grid=r["grid"], block=r["block"], smem_bytes=r["smem"],
                        meta=dict(meta, params=r["params"]))


def nvcc_report(src: str, arch: str, timeout: int = 600) -> dict:
    """Build `src` into a cubin with nvcc -Xptxas -v; returns registers, spills, smem and the log.
    `arch` is sm_90a / sm_100a (the -gencode form, which assembles the `a` features)."""
    import tilelang.env as tenv

    num = arch.removeprefix("sm_")
    with tempfile.TemporaryDirectory() as d:
        cu = os.path.join(d, "k.cu")
        with open(cu, "w") as f:
            f.write(src)
        cmd = ["nvcc", "-cubin", "-std=c++20", "-O3", f"-gencode=arch=compute_{num},code=sm_{num}", "-Xptxas", "-v",
               "-w", "-I" + tenv.TILELANG_TEMPLATE_PATH, "-I" + tenv.CUTLASS_INCLUDE_DIR, "-DENABLE_BF16",
               "-o", os.path.join(d, "k.cubin"), cu]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    log = p.stdout + p.stderr
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
    return {"ok": p.returncode == 0, "registers": max(regs, default=0), "spill_bytes": sum(spills),
            "stack_bytes": max(stack, default=0), "log": log[-4000:]}


def compile_kernel(func, out_idx=None, pass_configs: Mapping[str, Any] | None = None):
    """A callable kernel on the local GPU (the device machine); the arch comes from the device.
    `pass_configs` add to PASS_CONFIGS as they do in `lower` (a template's own)."""
    tilelang, _ = _tl()
    return tilelang.compile(func, out_idx=out_idx, target="cuda", pass_configs=dict(PASS_CONFIGS, **(pass_configs or {})))


def e8m0_f32(T, b):
    """2^(b-127) of a ue8m0 byte as fp32, by placing the byte in the exponent field (exact for
    b in 1..254; the scale rules of ir.quant never produce 0 or 255)."""
    return T.reinterpret(T.shift_left(T.Cast("int32", b), 23), "float32")


def e8m0_word_f32(T, w, i: int):
    """e8m0_f32 of byte i of a 32-bit word holding four consecutive ue8m0 scales (little-endian:
    byte i is the scale of the word's i-th 32-deep block)."""
    return T.reinterpret(T.bitwise_and(T.shift_left(T.shift_right(w, T.uint32(8 * i)), T.uint32(23)),
                                       T.uint32(0x7F800000)), "float32")


def scale_operands(T, words: int, rows_a, rows_b: int, K: int, block_K: int):
    """The two scale tensors' parameter types, their per-step shared tiles' shapes, and the fp32
    scale of (tile row, 32-deep block kk of the step) read from such a tile.

    words = 0: one ue8m0 byte per 32 K (uint8 [rows, K/32]); TileLang copies a step's few bytes a
    row with plain loads, which the threads wait on inside the pipelined loop (a load's full
    latency every K step, the loop's async copies notwithstanding). words = 1: the same bytes read
    as uint32 [rows, K/128] (four 32-deep blocks a word; block_K a multiple of 128), so a step's
    scales are 4-byte cp.async copies in the pipeline like the operands'. The host passes the same
    uint8 tensors (the launch passes pointers; K/32 is a multiple of 4)."""
    if words:
        assert block_K % 128 == 0 and K % 128 == 0, "word scales take 128-deep K steps"
        n = block_K // 128
        return ((rows_a, K // 128), "uint32"), ((rows_b, K // 128), "uint32"), n, "uint32", \
            lambda S_s, r, kk: e8m0_word_f32(T, S_s[r, kk // 4], kk % 4)
    n = block_K // 32
    return ((rows_a, K // 32), "uint8"), ((rows_b, K // 32), "uint8"), n, "uint8", \
        lambda S_s, r, kk: e8m0_f32(T, S_s[r, kk])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def out_dtype_name(spec: KernelSpec) -> str:
    return {"bf16": "bfloat16", "f32": "float32"}[spec.attr.get("out_dtype", "bf16")]


# ---- gemm_fp8 ---------------------------------------------------------------------------------

def gemm_fp8_program(M: int, N: int, K: int, out_dtype: str = "bfloat16", *, block_M=128, block_N=128,
                     block_K=128, stages=3, threads=256, split_k=1, overlap=0, words=0):
    """C[M, N] = sum_k A[m, k] sa[m, k//32] * B[n, k] sb[n//32, k//32], fp32 accumulation.

    split_k > 1 gives each CTA a contiguous range of K and makes C an fp32 buffer that the CTAs
    add into atomically (the caller zeroes it); decode shapes have too few output tiles to fill
    the GPU otherwise. overlap: each 32-deep block's wgmma is issued before the block before it
    is scaled into the accumulator (two product tiles; wait for all but the newest), so at
    prefill sizes the tensor cores work while the scaling runs, not after it; the same products
    and sums in the same order. words: the scales as 32-bit words (scale_operands)."""
    tilelang, T = _tl()
    assert K % 32 == 0 and block_K % 32 == 0 and block_N % 32 == 0
    kb = block_K // 32
    (sa_shape, sa_t), (sb_shape, sb_t), sw, s_t, scale = scale_operands(T, words, M, ceil_div(N, 32), K, block_K)
    assert not overlap or kb % 2 == 0, "overlap takes the scale blocks in pairs"
    k_iters = ceil_div(K, block_K)
    assert k_iters % split_k == 0, "split_k must divide the number of K tiles"
    per_split = k_iters // split_k
    c_dtype = "float32" if split_k > 1 else out_dtype

    @T.macro
    def scale_into(acc, prod, SA_s, SB_s, kk):
        """acc += block kk's product times its row and weight scales."""
        for i, j in T.Parallel(block_M, block_N):
            acc[i, j] += prod[i, j] * (scale(SA_s, i, kk) * scale(SB_s, j // 32, kk))

    @T.prim_func
    def gemm_fp8(A: T.Tensor((M, K), "float8_e4m3"), SA: T.Tensor(sa_shape, sa_t),
                 B: T.Tensor((N, K), "float8_e4m3"), SB: T.Tensor(sb_shape, sb_t),
                 C: T.Tensor((M, N), c_dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), split_k, threads=threads) as (bx, by, bz):
            A_s = T.alloc_shared((block_M, block_K), "float8_e4m3")
            B_s = T.alloc_shared((block_N, block_K), "float8_e4m3")
            SA_s = T.alloc_shared((block_M, sw), s_t)
            SB_s = T.alloc_shared((block_N // 32, sw), s_t)
            tmp = T.alloc_fragment((block_M, block_N), "float32")
            if overlap:
                tmp2 = T.alloc_fragment((block_M, block_N), "float32")
            acc = T.alloc_fragment((block_M, block_N), "float32")
            T.use_swizzle(panel_size=8)
            T.clear(acc)
            for ko in T.Pipelined(per_split, num_stages=stages):
                k = bz * per_split + ko
                T.copy(A[by * block_M, k * block_K], A_s)
                T.copy(B[bx * block_N, k * block_K], B_s)
                T.copy(SA[by * block_M, k * sw], SA_s)
                T.copy(SB[bx * (block_N // 32), k * sw], SB_s)
                if overlap:  # blocks in pairs, tmp / tmp2 alternating: each scaled after the next is issued
                    for kp in T.unroll(kb // 2):
                        T.wgmma_gemm(A_s[:, 64 * kp:64 * kp + 32], B_s[:, 64 * kp:64 * kp + 32], tmp, transpose_B=True,
                                     clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        if kp > 0:
                            T.wait_wgmma(1)
                            scale_into(acc, tmp2, SA_s, SB_s, 2 * kp - 1)
                        T.wgmma_gemm(A_s[:, 64 * kp + 32:64 * kp + 64], B_s[:, 64 * kp + 32:64 * kp + 64], tmp2,
                                     transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(1)
                        scale_into(acc, tmp, SA_s, SB_s, 2 * kp)
                        if kp == kb // 2 - 1:  # the step's last block, before its stage is refilled
                            T.wait_wgmma(0)
                            scale_into(acc, tmp2, SA_s, SB_s, kb - 1)
                else:
                    for kk in T.unroll(kb):
                        # one 32-deep slice per scale block: wgmma k32 on sm90
                        T.gemm(A_s[:, kk * 32:(kk + 1) * 32], B_s[:, kk * 32:(kk + 1) * 32], tmp, transpose_B=True,
                               clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        scale_into(acc, tmp, SA_s, SB_s, kk)
            if split_k > 1:
                T.atomic_add(C[by * block_M, bx * block_N], acc)
            else:
                T.copy(acc, C[by * block_M, bx * block_N])

    return gemm_fp8


def gemm_fp8_rows_program(N: int, K: int, out_dtype: str = "bfloat16", *, block_M=64, block_N=64, block_K=128,
                          stages=4, threads=128, split_k=1, words=0):
    """gemm_fp8_program's product for at most `block_M` rows, their count `m` a kernel argument:
    the activation and its scales are read as [m, K] (rows past m load as zeros, the copies are
    predicated) and C is written for its m rows, so the host pads nothing. split_k > 1 writes one
    fp32 partial tile per split into P [split_k, block_M, N] (every element once: nothing to zero)
    and `gemm_split_sum_program` adds them in split order, a fixed order (no atomics). words: the
    scales as 32-bit words (scale_operands)."""
    _, T = _tl()
    assert K % 32 == 0 and block_K % 32 == 0 and block_N % 32 == 0
    kb = block_K // 32
    k_iters = ceil_div(K, block_K)
    assert k_iters % split_k == 0, "split_k must divide the number of K tiles"
    per_split = k_iters // split_k
    m = T.dynamic("m")
    out_shape, c_dtype = ((split_k, block_M, N), "float32") if split_k > 1 else ((m, N), out_dtype)
    (sa_shape, sa_t), (sb_shape, sb_t), sw, s_t, scale = scale_operands(T, words, m, ceil_div(N, 32), K, block_K)

    @T.prim_func
    def gemm_fp8(A: T.Tensor((m, K), "float8_e4m3"), SA: T.Tensor(sa_shape, sa_t),
                 B: T.Tensor((N, K), "float8_e4m3"), SB: T.Tensor(sb_shape, sb_t),
                 C: T.Tensor(out_shape, c_dtype)):
        with T.Kernel(T.ceildiv(N, block_N), split_k, threads=threads) as (bx, bz):
            A_s = T.alloc_shared((block_M, block_K), "float8_e4m3")
            B_s = T.alloc_shared((block_N, block_K), "float8_e4m3")
            SA_s = T.alloc_shared((block_M, sw), s_t)
            SB_s = T.alloc_shared((block_N // 32, sw), s_t)
            tmp = T.alloc_fragment((block_M, block_N), "float32")
            acc = T.alloc_fragment((block_M, block_N), "float32")
            T.clear(acc)
            for ko in T.Pipelined(per_split, num_stages=stages):
                k = bz * per_split + ko
                T.copy(A[0, k * block_K], A_s)
                T.copy(B[bx * block_N, k * block_K], B_s)
                T.copy(SA[0, k * sw], SA_s)
                T.copy(SB[bx * (block_N // 32), k * sw], SB_s)
                for kk in T.unroll(kb):
                    T.gemm(A_s[:, kk * 32:(kk + 1) * 32], B_s[:, kk * 32:(kk + 1) * 32], tmp, transpose_B=True,
                           clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    for i, j in T.Parallel(block_M, block_N):
                        acc[i, j] += tmp[i, j] * (scale(SA_s, i, kk) * scale(SB_s, j // 32, kk))
            if split_k > 1:
                T.copy(acc, C[bz, 0, bx * block_N])
            else:
                T.copy(acc, C[0, bx * block_N])

    return gemm_fp8


SPLIT_SUM_COLS, SPLIT_SUM_ROWS = 256, 8  # one CTA: 8 rows x 256 columns, 2 columns a thread


def gemm_split_sum_program(N: int, split_k: int, rows: int, out_dtype: str = "bfloat16"):
    """C[i, n] = sum over s in order of P[s, i, n] for the m live rows (m a kernel argument)."""
    _, T = _tl()
    m = T.dynamic("m")
    cb, rb = SPLIT_SUM_COLS, SPLIT_SUM_ROWS

    @T.prim_func
    def split_sum(P: T.Tensor((split_k, rows, N), "float32"), C: T.Tensor((m, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, cb), rows // rb, threads=cb // 2) as (bx, by):
            acc = T.alloc_fragment((rb, cb), "float32")
            T.clear(acc)
            for s in T.serial(split_k):
                for i, j in T.Parallel(rb, cb):
                    acc[i, j] += P[s, by * rb + i, bx * cb + j]
            for i, j in T.Parallel(rb, cb):
                if by * rb + i < m:
                    C[by * rb + i, bx * cb + j] = acc[i, j]

    return split_sum


def gemm_fp8_sm100_program(M: int, N: int, K: int, out_dtype: str = "bfloat16", *, block_N=128, split_k=1):
    """gemm_fp8_program's product on the block-scaled tcgen05 MMA (module docstring)."""
    _, T = _tl()
    block_M, block_K = 128, 128
    assert K % block_K == 0 and block_N % 128 == 0
    k_iters = K // block_K
    assert k_iters % split_k == 0, "split_k must divide the number of K tiles"
    per_split = k_iters // split_k
    c_dtype = "float32" if split_k > 1 else out_dtype

    @T.prim_func
    def gemm_fp8(A: T.Tensor((M, K), "float8_e4m3"), SA: T.Tensor((M, K // 128), "uint32"),
                 B: T.Tensor((N, K), "float8_e4m3"), SB: T.Tensor((ceil_div(N, 32), K // 128), "uint32"),
                 C: T.Tensor((M, N), c_dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), split_k, threads=128) as (bx, by, bz):
            A_s = T.alloc_shared((block_M, block_K), "float8_e4m3")
            B_s = T.alloc_shared((block_N, block_K), "float8_e4m3")
            SA_s = T.alloc_shared((block_M,), "uint32")
            SB_s = T.alloc_shared((block_N,), "uint32")
            acc_t = T.alloc_tmem([block_M, block_N], "float32")
            sa_t = T.alloc_tmem([block_M, 4], "uint32")
            sb_t = T.alloc_tmem([block_M, block_N // 128 * 4], "uint32")
            acc = T.alloc_fragment((block_M, block_N), "float32")
            c_s = T.alloc_shared((block_M, block_N), c_dtype)
            mbar = T.alloc_barrier(1)
            tx = T.get_thread_binding()
            T.use_swizzle(panel_size=8)
            for ko in T.serial(per_split):
                k = bz * per_split + ko
                T.copy(A[by * block_M, k * block_K], A_s)
                T.copy(B[bx * block_N, k * block_K], B_s)
                for i in T.Parallel(block_M):  # rows past M (decode tiles) scale zeros
                    SA_s[i] = T.if_then_else(by * block_M + i < M, SA[T.min(by * block_M + i, M - 1), k], T.uint32(0))
                for i in T.Parallel(block_N):
                    SB_s[i] = SB[(bx * block_N + i) // 32, k]
                # the MMA reads shared memory through the async proxy: order the stores before it
                T.fence_proxy_async()
                T.sync_threads()
                if tx < 32:
                    T.tcgen05_sf_warp_transpose(SA_s)
                    T.tcgen05_sf_warp_transpose(SB_s)
                    T.fence_proxy_async()
                    T.sync_warp()
                    T.tcgen05_cp_warpx4(SA_s, sa_t)
                    T.tcgen05_cp_warpx4(SB_s, sb_t)
                    T.tcgen05_gemm_blockscaled(A_s, B_s, acc_t, sa_t, sb_t, transpose_B=True, mbar=mbar,
                                               clear_accum=ko == 0, k_start=k * block_K,
                                               sf_a_granularity_k=32, sf_b_granularity_k=32)
                T.mbarrier_wait_parity(mbar, ko % 2)
                T.sync_threads()  # the next step's stores reuse the tiles this MMA read
            T.copy(acc_t, acc)
            if split_k > 1:
                T.atomic_add(C[by * block_M, bx * block_N], acc)
            else:
                T.copy(acc, c_s)
                T.copy(c_s, C[by * block_M, bx * block_N])

    return gemm_fp8


def block_scaled_gemm(target: Target, n: int, k: int) -> bool:
    """The tcgen05 block-scaled program serves this product (sm100, 128-deep K steps)."""
    return "tcgen05_mxf8f6f4" in target.features and k % 128 == 0 and n % 32 == 0


DECODE_ROWS = 64  # one 64-row tile: every GEMM with at most this many rows runs the same kernel


def rows_type(t, rows: int):
    """`t` ([.., in], plain or quantised) as [rows, in]."""
    from ...ir.types import QuantType

    if isinstance(t, QuantType):
        return QuantType(rows_type(t.data, rows), rows_type(t.scale, rows), (1,) + tuple(t.block[-1:]))
    return t.with_shape((rows, t.shape[-1]))


def canonical_rows(target: Target, spec: KernelSpec) -> KernelSpec:
    """Decode GEMMs (at most 64 rows: one row tile, and a config that does not depend on the row
    count) share the 64-row instance across buckets; the host pads the rows. Fewer instances to
    render and build, the same work on the GPU."""
    m, n, _ = _mnk(spec)
    if m >= DECODE_ROWS:
        return spec
    return KernelSpec(spec.op, spec.attrs, (rows_type(spec.in_types[0], DECODE_ROWS),) + tuple(spec.in_types[1:]),
                      (spec.out_types[0].with_shape((DECODE_ROWS, n)),) + tuple(spec.out_types[1:]))


def _mnk(spec: KernelSpec):
    """(rows, out features, in features) of a [.., in] x [out, in]^T product."""
    x, w = spec.in_types[0], spec.in_types[1]
    m = 1
    for d in x.shape[:-1]:
        m *= int(d)
    return m, int(w.shape[0]), int(w.shape[1])


GEMM_KNOBS = {"block_M": (64, 128), "block_N": (64, 128, 256), "block_K": (64, 128), "stages": (2, 3, 4),
              "threads": (128, 256), "split_k": (1, 2, 4, 8), "words": (0, 1)}


def _decode_split(target: Target, tiles: int, k_steps: int) -> int:
    """Split K (a divisor of the K steps) while the output tiles leave most SMs idle."""
    return next((s for s in (8, 4, 2) if k_steps % s == 0 and tiles * s <= 2 * target.cores
                 and tiles < target.cores), 1)


def gemm_default_config(target: Target, m: int, n: int, k: int) -> dict:
    """Prefill: 128-row tiles, 2 warpgroups. Decode (m <= 64): one 64-row tile, narrow N tiles and
    split K so that the weight stream is spread over most SMs. The K step of decode tiles and the
    N width of prefill tiles are the target's (`target.defaults["tilelang_gemm"]`: register budgets)."""
    own = target.defaults["tilelang_gemm"]
    if batch_invariant(target):  # a row's sum runs over K in one order whatever the row count: no split
        plain = dataclasses.replace(target, features=tuple(f for f in target.features if f != BATCH_INVARIANT))
        return dict(gemm_default_config(plain, m, n, k), split_k=1)
    if block_scaled_gemm(target, n, k):
        split = _decode_split(target, ceil_div(n, 128), k // 128) if m <= 64 else 1
        return {"block_M": 128, "block_N": 128, "block_K": 128, "stages": 1, "threads": 128, "split_k": split}
    if m <= 64:
        bn, bk = 64, 128
        split = _decode_split(target, ceil_div(n, bn), ceil_div(k, bk))
        if k % own["decode_block_K"] == 0:
            # a shallower K step where 128-deep ones spill; the split stays a divisor of the K steps
            bk = own["decode_block_K"]
        return {"block_M": 64, "block_N": bn, "block_K": bk, "stages": 4, "threads": 128, "split_k": split}
    return {"block_M": 128, "block_N": own["prefill_block_N"], "block_K": 128, "stages": 3, "threads": 256,
            "split_k": 1}


def gemm_fp8_default_config(target: Target, m: int, n: int, k: int) -> dict:
    """lin8's default: gemm_default_config's, with decode rows on the wgmma program tuned by the
    H200's sweep at 64 rows (bench/gemm_fp8_decode.py LIN8_WGMMA, docs/performance.md's fourteenth
    session; the step's lin8 6.23 -> 4.88 ms taking each shape's best): a split shape takes twice
    the split (cut to whole K tiles) on 2 stages, more CTAs in flight and a shorter wave tail
    (5120 x 8192 42.1 -> 33.1 us); an unsplit one (many N tiles already) 128-wide N tiles on 3
    stages (32768 x 1280 39.8 -> 26.8 us). Prefill rows keep gemm_default_config's, with the
    overlapped scaling where the target's tilelang_gemm defaults set `prefill_overlap`;
    block-scaled targets and batch-invariant plans keep it as it is."""
    c = gemm_default_config(target, m, n, k)
    if batch_invariant(target) or block_scaled_gemm(target, n, k):
        return c
    own = target.defaults.get("tilelang_gemm", {})
    if own.get("words") and c["block_K"] % 128 == 0 and k % 128 == 0:
        c = dict(c, words=1)  # the scales as words by cp.async where the target says so (scale_operands)
    if m > DECODE_ROWS:
        # prefill tiles with the scaling overlapped where the target turns it on (gemm_fp8_program)
        on = own.get("prefill_overlap", 0)
        return dict(c, overlap=1) if on and (c["block_K"] // 32) % 2 == 0 else c
    if c["split_k"] > 1:
        steps = ceil_div(k, c["block_K"])
        return dict(c, stages=2, split_k=max(d for d in range(1, 2 * c["split_k"] + 1) if steps % d == 0))
    return dict(c, block_N=128, stages=3) if n % 128 == 0 else c


def rows_argument(target: Target, m: int, n: int, k: int, config: Mapping[str, Any]) -> bool:
    """The decode program (rows a kernel argument, no padding, split-K without atomics) serves
    this instance: one row tile holding every row of the canonical decode instance."""
    return (not block_scaled_gemm(target, n, k) and m == DECODE_ROWS == config["block_M"]
            and n % SPLIT_SUM_COLS == 0)


def _render_gemm_fp8(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    m, n, k = _mnk(spec)
    c = dict(gemm_fp8_default_config(target, m, n, k), **config)
    meta = {"template": "tilelang_gemm_fp8", "config": c, "mnk": (m, n, k)}
    if rows_argument(target, m, n, k, c):
        func = gemm_fp8_rows_program(n, k, out_dtype_name(spec), **c)
        src = source(func, target.arch, dict(meta, rows_argument=True))
        if c["split_k"] > 1:
            comb = lower(gemm_split_sum_program(n, c["split_k"], m, out_dtype_name(spec)), target.arch)
            src.meta["combine"] = {"entry": comb["entry"], "text": comb["src"], "grid": comb["grid"],
                                   "block": comb["block"], "smem_bytes": comb["smem"], "params": comb["params"]}
        return src
    if block_scaled_gemm(target, n, k):
        func = gemm_fp8_sm100_program(m, n, k, out_dtype_name(spec), block_N=c["block_N"], split_k=c["split_k"])
    else:
        func = gemm_fp8_program(m, n, k, out_dtype_name(spec), **c)
    return source(func, target.arch, dict(meta, atomic_f32_out=c["split_k"] > 1))


register(Template(
    name="tilelang_gemm_fp8",
    ops=("gemm_fp8",),
    targets=building("cuda", defaults="tilelang_gemm"),
    knobs=GEMM_KNOBS,
    render=_render_gemm_fp8,
    default_config=lambda target, spec: gemm_fp8_default_config(target, *_mnk(spec)),
    supports=lambda target, spec: _mnk(spec)[2] % 32 == 0,
    host=host_gemm_fp8,
    canonical=canonical_rows,
))


# ---- linear (bf16 x bf16 or fp32 x fp32, fp32 accumulation) -----------------------------------

def linear_program(M: int, N: int, K: int, in_dtype: str = "bfloat16", out_dtype: str = "bfloat16", *,
                   block_M=128, block_N=128, block_K=64, stages=3, threads=256, split_k=1):
    """C = A @ B^T on the bf16 tensor cores, fp32 accumulation."""
    tilelang, T = _tl()
    k_iters = ceil_div(K, block_K)
    assert k_iters % split_k == 0
    per_split = k_iters // split_k
    c_dtype = "float32" if split_k > 1 else out_dtype

    @T.prim_func
    def linear(A: T.Tensor((M, K), in_dtype), B: T.Tensor((N, K), in_dtype), C: T.Tensor((M, N), c_dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), split_k, threads=threads) as (bx, by, bz):
            A_s = T.alloc_shared((block_M, block_K), in_dtype)
            B_s = T.alloc_shared((block_N, block_K), in_dtype)
            acc = T.alloc_fragment((block_M, block_N), "float32")
            T.use_swizzle(panel_size=8)
            T.clear(acc)
            for ko in T.Pipelined(per_split, num_stages=stages):
                k = bz * per_split + ko
                T.copy(A[by * block_M, k * block_K], A_s)
                T.copy(B[bx * block_N, k * block_K], B_s)
                T.gemm(A_s, B_s, acc, transpose_B=True)
            if split_k > 1:
                T.atomic_add(C[by * block_M, bx * block_N], acc)
            else:
                T.copy(acc, C[by * block_M, bx * block_N])

    return linear



def _linear_supports(target: Target, spec: KernelSpec) -> bool:
    from ...ir.types import QuantType

    x, w = spec.in_types[0], spec.in_types[1]
    if isinstance(x, QuantType) or isinstance(w, QuantType):
        return False
    # compute=f32 is an fp32 GEMM in the reference; the tensor cores would make it tf32, a visible
    # deviation (the router's top-k is sensitive to it), so only bf16 GEMMs are taken here
    return (spec.attr.get("compute") == "bf16" and x.dtype.name == "bf16" and w.dtype.name == "bf16"
            and _mnk(spec)[2] % 8 == 0)


def _linear_default_config(target: Target, spec: KernelSpec) -> dict:
    """The fp8 GEMM's tiles with 64-deep K steps (a bf16 tile of 64 is as wide in bytes as fp8's 128)."""
    return {**gemm_default_config(target, *_mnk(spec)), "block_K": 64}


def _render_linear(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    m, n, k = _mnk(spec)
    c = {**_linear_default_config(target, spec), **config}
    in_dt = "bfloat16"
    out = spec.out_types[0].dtype.name
    func = linear_program(m, n, k, in_dt, {"bf16": "bfloat16", "f32": "float32"}[out], **c)
    return source(func, target.arch, {"template": "tilelang_linear", "config": c, "mnk": (m, n, k),
                                      "atomic_f32_out": c["split_k"] > 1})


register(Template(
    name="tilelang_linear",
    ops=("linear",),
    targets=building("cuda", defaults="tilelang_gemm"),
    knobs={**{k: v for k, v in GEMM_KNOBS.items() if k != "words"}, "block_K": (32, 64)},
    render=_render_linear,
    default_config=_linear_default_config,
    supports=_linear_supports,
    host=host_linear,
    canonical=canonical_rows,
))
