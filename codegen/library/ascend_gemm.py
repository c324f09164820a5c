"""TileLang-Ascend cube-core GEMMs for ascend950, C = A @ B^T with fp32 accumulation in L0C, written
as bf16 or fp32 through the fixpipe: `linear` on bf16 operands, and `gemm_fp8` as an MX block-scaled
GEMM (fp8 e4m3 operands, one ue8m0 scale per row and 32 K elements; the weights' 32x32 block
scales are repeated per row at load by the pipeline's `row_weight_scales`).

Data path (the buffer scopes choose the engines): GM -> L1 by DMA, double-buffered over K by
`T.Pipelined`; L1 -> L0A / L0B inside `T.gemm` (TileLang's template splits each K tile into the
chunks that fit two 32 KiB stages); mmad into the L0C accumulator; L0C -> GM with the cast. A
1-D grid of AI cores walks the output tiles (`T.Persistent`). A partial last M tile (decode rows)
is clipped on load and store by the compiler. Bf16 products are exact in fp32, so the same
kernel serves `compute="f32"` on bf16 operands.

Rendered and capacity-checked here; built only where CANN's `bisheng` exists; never run on an
Ascend 950, so nothing about it is verified.
"""
# no `from __future__ import annotations`: TileLang evaluates the prim_func's T.Tensor((M, K), ...)
# hints, and string annotations would look up M, K at the wrong time

import functools

from ..targets import building
from ..template import KernelSource, KernelSpec, Template, register
from .ascend_common import SIMT_CONTEXT_BYTES
from .ascend_common import align32 as _align32
from .ascend_common import lower_ascend

_BYTES = {"bf16": 2, "f32": 4}
_L0_STAGE = 32 * 1024  # TileLang's L1-input gemm double-buffers 64 KiB L0A / L0B


def _pick(n: int, options) -> int | None:
    return next((b for b in options if n % b == 0), None)


def _k_chunk(block_m: int, block_n: int, block_k: int, elem: int = 2) -> int:
    """The K chunk TileLang's gemm moves into L0A / L0B per stage (its own sizing rule)."""
    c0 = 32 // elem
    t = min(_L0_STAGE // (block_m * elem), _L0_STAGE // (block_n * elem), block_k) // c0 * c0
    while block_k % t and t > c0:
        t -= c0
    return t


def gemm_plan(m: int, n: int, k: int, config: dict, cores: int, elem: int = 2, mx: bool = False) -> dict:
    """Tiles, grid and on-chip bytes per scope for a config (what the capacity check reads); `mx`
    adds the scale tiles (one byte per row and 32 K) to L1."""
    bm = min(config["block_M"], -(-m // 16) * 16)  # decode rows: the M tile shrinks to the rows
    bn, bk, stages = config["block_N"], config["block_K"], config["stages"]
    tiles = -(-m // bm) * (n // bn)
    kc = _k_chunk(bm, bn, bk, elem)
    l1 = [_align32(bm * bk * elem)] * stages + [_align32(bn * bk * elem)] * stages
    if mx:
        l1 += [_align32(bm * bk // 32)] * stages + [_align32(bn * bk // 32)] * stages
    return {"block_M": bm, "tiles": tiles, "grid": min(cores, tiles), "k_chunk": kc,
            "buffers": {"l1": l1, "l0a": [2 * bm * kc * elem], "l0b": [2 * bn * kc * elem], "l0c": [bm * bn * 4]}}


@functools.lru_cache(maxsize=64)
def _gemm_source(m: int, n: int, k: int, out: str, bm: int, bn: int, bk: int, stages: int, grid: int) -> str:
    import tilelang.ascend.language as T

    odt = {"bf16": T.bfloat16, "f32": T.float32}[out]
    m_tiles, n_tiles = -(-m // bm), n // bn

    @T.prim_func
    def linear(A: T.Tensor((m, k), T.bfloat16), B: T.Tensor((n, k), T.bfloat16), C: T.Tensor((m, n), odt)):
        with T.Kernel(grid) as core:
            a_l1 = T.alloc_l1((bm, bk), T.bfloat16)
            b_l1 = T.alloc_l1((bn, bk), T.bfloat16)
            acc = T.alloc_l0c((bm, bn), T.float32)
            for tile in T.Persistent([m_tiles * n_tiles], grid, core):
                m0 = tile // n_tiles * bm
                n0 = tile % n_tiles * bn
                for kt in T.Pipelined(k // bk, num_stages=stages):
                    T.copy(A[m0, kt * bk], a_l1)
                    T.copy(B[n0, kt * bk], b_l1)
                    T.gemm(a_l1, b_l1, acc, transpose_B=True, clear_accum=(kt == 0))
                T.copy(acc, C[m0, n0])

    return lower_ascend(linear)


def _dims(spec: KernelSpec):
    """(rows, N, K, output dtype) of a call; quantised operands by their data."""
    x, w = (getattr(t, "data", t) for t in spec.in_types[:2])
    m = 1
    for d in x.shape[:-1]:
        m *= d
    return m, w.shape[0], w.shape[1], spec.out_types[0].dtype.name


def _tile_config(target, spec: KernelSpec, block_k: int) -> dict:
    m, n, _, _ = _dims(spec)
    widths = [b for b in (256, 128, 64, 32, 16) if n % b == 0]
    # decode: the widest N tile that still gives every AI core a tile, else the narrowest
    bn = next((b for b in widths if n // b >= target.cores), widths[-1]) if m <= 64 else widths[0]
    return {"block_M": 128, "block_N": bn, "block_K": block_k, "stages": 2}


def _supports(target, spec: KernelSpec) -> bool:
    x, w = spec.in_types
    if not all(isinstance(d, int) for t in (x, w) for d in t.shape) or getattr(w, "data", None) is not None:
        return False
    if x.dtype.name != "bf16" or w.dtype.name != "bf16" or spec.out_types[0].dtype.name not in _BYTES:
        return False
    m, n, k, _ = _dims(spec)
    return _pick(n, (256, 128, 64, 32, 16)) is not None and _pick(k, (128, 64, 32, 16)) is not None


def _default_config(target, spec: KernelSpec) -> dict:
    return _tile_config(target, spec, _pick(_dims(spec)[2], (64, 128, 32, 16)))


def _render(target, spec: KernelSpec, config) -> KernelSource:
    m, n, k, out = _dims(spec)
    c = {**_default_config(target, spec), **(config or {})}
    p = gemm_plan(m, n, k, c, target.cores)
    text = _gemm_source(m, n, k, out, p["block_M"], c["block_N"], c["block_K"], c["stages"], p["grid"])
    return KernelSource(language="ascendc", entry="linear_kernel", text=text, grid=(p["grid"],), block=(),
                        meta={"buffers": p["buffers"], "gm_row_bytes": [k * 2, n * _BYTES[out]], "config": c})


register(Template(
    name="ascend_linear", ops=("linear",), targets=building("ascendc"),
    knobs={"block_M": (64, 128, 256), "block_N": (64, 128, 256), "block_K": (64, 128), "stages": (1, 2)},
    render=_render, default_config=_default_config, supports=_supports))


# ---- gemm_fp8: MX block-scaled ------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _mx_source(m: int, n: int, k: int, out: str, bm: int, bn: int, bk: int, stages: int, grid: int) -> str:
    import tilelang.ascend.language as T

    fp8, odt = "float8_e4m3fn", {"bf16": T.bfloat16, "f32": T.float32}[out]
    m_tiles, n_tiles, sk, tsf = -(-m // bm), n // bn, k // 32, bk // 32

    @T.prim_func
    def gemm_fp8(A: T.Tensor((m, k), fp8), B: T.Tensor((n, k), fp8), SA: T.Tensor((m, sk), T.uint8),
                 SB: T.Tensor((n, sk), T.uint8), C: T.Tensor((m, n), odt)):
        with T.Kernel(grid) as core:
            a_l1 = T.alloc_l1((bm, bk), fp8)
            b_l1 = T.alloc_l1((bn, bk), fp8)
            sa_l1 = T.alloc_l1((bm, tsf), T.uint8)
            sb_l1 = T.alloc_l1((bn, tsf), T.uint8)
            acc = T.alloc_l0c((bm, bn), T.float32)
            for tile in T.Persistent([m_tiles * n_tiles], grid, core):
                m0 = tile // n_tiles * bm
                n0 = tile % n_tiles * bn
                for kt in T.Pipelined(k // bk, num_stages=stages):
                    T.copy(A[m0, kt * bk], a_l1)
                    T.copy(B[n0, kt * bk], b_l1)
                    T.copy(SA[m0, kt * tsf], sa_l1)
                    T.copy(SB[n0, kt * tsf], sb_l1)
                    T.gemm_blockscaled(a_l1, b_l1, acc, sa_l1, sb_l1, transpose_B=True, clear_accum=(kt == 0))
                T.copy(acc, C[m0, n0])

    return lower_ascend(gemm_fp8)


def _mx_supports(target, spec: KernelSpec) -> bool:
    x, w = spec.in_types
    if getattr(x, "block", None) is None or getattr(w, "block", None) != (1, 32) or x.block[-1] != 32:
        return False
    if not all(isinstance(d, int) for t in (x.data, w.data) for d in t.shape):
        return False
    m, n, k, out = _dims(spec)
    # K tiles of 128 (the MX MMA steps 64 K per scale pair); a scale row of K/32 bytes must be a
    # whole number of 32-byte granules for its DMA
    return out in _BYTES and n % 16 == 0 and k % 128 == 0 and (k // 32) % 32 == 0


def _mx_default_config(target, spec: KernelSpec) -> dict:
    return _tile_config(target, spec, 128)


def _mx_render(target, spec: KernelSpec, config) -> KernelSource:
    m, n, k, out = _dims(spec)
    c = {**_mx_default_config(target, spec), **(config or {})}
    p = gemm_plan(m, n, k, c, target.cores, elem=1, mx=True)
    if p["k_chunk"] % 64:
        raise ValueError(f"gemm_fp8 on ascend950: a {p['block_M']}x{c['block_N']} tile leaves L0 chunks of "
                         f"{p['k_chunk']} K, the MX MMA needs multiples of 64")
    text = _mx_source(m, n, k, out, p["block_M"], c["block_N"], c["block_K"], c["stages"], p["grid"])
    return KernelSource(language="ascendc", entry="gemm_fp8_kernel", text=text, grid=(p["grid"],), block=(),
                        meta={"buffers": p["buffers"], "gm_row_bytes": [k, k // 32, n * _BYTES[out]], "config": c})


register(Template(
    name="ascend_gemm_mxfp8", ops=("gemm_fp8",), targets=building("ascendc"),
    knobs={"block_M": (64, 128, 256), "block_N": (64, 128, 256), "block_K": (128, 256), "stages": (1, 2)},
    render=_mx_render, default_config=_mx_default_config, supports=_mx_supports))


# ---- gemm_fp8 whose scale rows the MX GEMM cannot load ------------------------------------------

@functools.lru_cache(maxsize=32)
def _dequant_source(m: int, n: int, k: int, out: str, bm: int, bn: int, bk: int, grid: int) -> str:
    """C = (A x 2^SA) (B x 2^SB)^T with both fp8 operands widened to bf16 on the vector core (exact:
    an e4m3 value times a power of two is a bf16 value) and moved UB -> L1 for the cube's bf16 MMA;
    the ue8m0 scale rows go GM -> UB by the padding DMA, which takes any byte length."""
    import tilelang.ascend.language as T

    from .tilelang_gemm import e8m0_f32

    fp8, odt = "float8_e4m3fn", {"bf16": T.bfloat16, "f32": T.float32}[out]
    m_tiles, n_tiles, kb, threads = -(-m // bm), n // bn, bk // 32, 128

    @T.prim_func
    def gemm_fp8(A: T.Tensor((m, k), fp8), B: T.Tensor((n, k), fp8), SA: T.Tensor((m, k // 32), T.uint8),
                 SB: T.Tensor((n, k // 32), T.uint8), C: T.Tensor((m, n), odt)):
        with T.Kernel(grid) as core:
            a8 = T.alloc_shared((bm, bk), fp8)
            b8 = T.alloc_shared((bn, bk), fp8)
            sa = T.alloc_shared((bm, kb), T.uint8)
            sb = T.alloc_shared((bn, kb), T.uint8)
            ab = T.alloc_shared((bm, bk), T.bfloat16)
            bb = T.alloc_shared((bn, bk), T.bfloat16)
            a_l1 = T.alloc_l1((bm, bk), T.bfloat16)
            b_l1 = T.alloc_l1((bn, bk), T.bfloat16)
            acc = T.alloc_l0c((bm, bn), T.float32)
            for tile in T.Persistent([m_tiles * n_tiles], grid, core):
                m0 = tile // n_tiles * bm
                n0 = tile % n_tiles * bn
                for kt in T.serial(k // bk):
                    T.copy(A[m0, kt * bk], a8)
                    T.copy(SA[m0, kt * kb], sa)
                    T.copy(B[n0, kt * bk], b8)
                    T.copy(SB[n0, kt * kb], sb)
                    # one element per thread and step: the SIMT vectoriser has no uint8 vector type
                    with T.SimtVF(threads=threads):
                        tid = T.get_thread_binding()
                        for s in T.serial(bm * bk // threads):
                            i = (s * threads + tid) // bk
                            j = (s * threads + tid) % bk
                            ab[i, j] = T.cast(T.cast(a8[i, j], T.float32) * e8m0_f32(T, sa[i, j // 32]), T.bfloat16)
                    with T.SimtVF(threads=threads):
                        tid = T.get_thread_binding()
                        for s in T.serial(bn * bk // threads):
                            i = (s * threads + tid) // bk
                            j = (s * threads + tid) % bk
                            bb[i, j] = T.cast(T.cast(b8[i, j], T.float32) * e8m0_f32(T, sb[i, j // 32]), T.bfloat16)
                    T.copy(ab, a_l1)
                    T.copy(bb, b_l1)
                    T.gemm(a_l1, b_l1, acc, transpose_B=True, clear_accum=(kt == 0))
                T.copy(acc, C[m0, n0])

    return lower_ascend(gemm_fp8)


def dequant_plan(m: int, n: int, k: int, config: dict, cores: int) -> dict:
    """`gemm_plan` of the bf16 MMA plus the vector prologue's UB: fp8 tiles, scale tiles, and each
    bf16 tile with the nd2nz copy (one row longer) its UB -> L1 scatter writes."""
    p = gemm_plan(m, n, k, {**config, "stages": 1}, cores)
    bm, bn, bk = p["block_M"], config["block_N"], config["block_K"]
    ub = [_align32(bm * bk), _align32(bn * bk), _align32(bm * bk // 32), _align32(bn * bk // 32)]
    ub += [_align32(r * bk * 2) for r in (bm, bm + 1, bn, bn + 1)] + [SIMT_CONTEXT_BYTES]
    return {**p, "buffers": {**p["buffers"], "ub": ub}}


def _dequant_supports(target, spec: KernelSpec) -> bool:
    x, w = spec.in_types
    if getattr(x, "block", None) != (1, 32) or getattr(w, "block", None) != (1, 32):
        return False
    if not all(isinstance(d, int) for t in (x.data, w.data) for d in t.shape):
        return False
    m, n, k, out = _dims(spec)
    return out in _BYTES and n % 16 == 0 and k % 128 == 0


def _dequant_default_config(target, spec: KernelSpec) -> dict:
    # N tiles of at most 128: two bf16 copies of a 256 x 128 weight tile leave too little UB
    c = _tile_config(target, spec, 128)
    return {**c, "block_N": min(c["block_N"], 128)}


def _dequant_render(target, spec: KernelSpec, config) -> KernelSource:
    m, n, k, out = _dims(spec)
    c = {**_dequant_default_config(target, spec), **(config or {})}
    p = dequant_plan(m, n, k, c, target.cores)
    text = _dequant_source(m, n, k, out, p["block_M"], c["block_N"], c["block_K"], p["grid"])
    return KernelSource(language="ascendc", entry="gemm_fp8_kernel", text=text, grid=(p["grid"],), block=(128,),
                        meta={"buffers": p["buffers"], "gm_row_bytes": [k, n * _BYTES[out]], "config": c})


# after the MX template: only the calls it declines (scale rows of K/32 bytes that are not whole
# 32-byte granules, which its GM -> L1 scale load needs) come here
register(Template(
    name="ascend_gemm_fp8_dequant", ops=("gemm_fp8",), targets=building("ascendc"),
    knobs={"block_M": (16, 64, 128), "block_N": (64, 128, 256), "block_K": (128, 256)},
    render=_dequant_render, default_config=_dequant_default_config, supports=_dequant_supports))
