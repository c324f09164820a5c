"""TileLang-Ascend cube-core GEMM for ascend950: `linear` on bf16 operands, C = A @ B^T with fp32
accumulation in L0C, written as bf16 or fp32 through the fixpipe.

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

from ..template import KernelSource, KernelSpec, Template, register

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


def gemm_plan(m: int, n: int, k: int, config: dict, cores: int) -> dict:
    """Tiles, grid and on-chip bytes per scope for a config (what the capacity check reads)."""
    bm = min(config["block_M"], -(-m // 16) * 16)  # decode rows: the M tile shrinks to the rows
    bn, bk, stages = config["block_N"], config["block_K"], config["stages"]
    tiles = -(-m // bm) * (n // bn)
    kc = _k_chunk(bm, bn, bk)
    return {"block_M": bm, "tiles": tiles, "grid": min(cores, tiles),
            "buffers": {"l1": [bm * bk * 2] * stages + [bn * bk * 2] * stages, "l0a": [2 * bm * kc * 2],
                        "l0b": [2 * bn * kc * 2], "l0c": [bm * bn * 4]}}


@functools.lru_cache(maxsize=64)
def _gemm_source(m: int, n: int, k: int, out: str, bm: int, bn: int, bk: int, stages: int, grid: int) -> str:
    import tilelang
    import tilelang.ascend.language as T
    from tilelang.ascend.target import _make_ascend_target

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

    with _make_ascend_target():
        return tilelang.lower(linear, target="ascend").kernel_source


def _dims(spec: KernelSpec):
    x, w = spec.in_types
    m = 1
    for d in x.shape[:-1]:
        m *= d
    return m, w.shape[0], w.shape[1], spec.out_types[0].dtype.name


def _supports(target, spec: KernelSpec) -> bool:
    x, w = spec.in_types
    if not all(isinstance(d, int) for t in (x, w) for d in t.shape) or getattr(w, "data", None) is not None:
        return False
    if x.dtype.name != "bf16" or w.dtype.name != "bf16" or spec.out_types[0].dtype.name not in _BYTES:
        return False
    m, n, k, _ = _dims(spec)
    return _pick(n, (256, 128, 64, 32, 16)) is not None and _pick(k, (128, 64, 32, 16)) is not None


def _default_config(target, spec: KernelSpec) -> dict:
    m, n, k, _ = _dims(spec)
    widths = [b for b in (256, 128, 64, 32, 16) if n % b == 0]
    if m <= 64:  # decode: the widest N tile that still gives every AI core a tile, else the narrowest
        bn = next((b for b in widths if n // b >= target.cores), widths[-1])
    else:
        bn = widths[0]
    return {"block_M": 128, "block_N": bn, "block_K": _pick(k, (64, 128, 32, 16)), "stages": 2}


def _render(target, spec: KernelSpec, config) -> KernelSource:
    m, n, k, out = _dims(spec)
    c = {**_default_config(target, spec), **(config or {})}
    p = gemm_plan(m, n, k, c, target.cores)
    text = _gemm_source(m, n, k, out, p["block_M"], c["block_N"], c["block_K"], c["stages"], p["grid"])
    return KernelSource(language="ascendc", entry="linear_kernel", text=text, grid=(p["grid"],), block=(),
                        meta={"buffers": p["buffers"], "gm_row_bytes": [k * 2, n * _BYTES[out]], "config": c})


register(Template(
    name="ascend_linear", ops=("linear",), targets=("ascend950",),
    knobs={"block_M": (64, 128, 256), "block_N": (64, 128, 256), "block_K": (64, 128), "stages": (1, 2)},
    render=_render, default_config=_default_config, supports=_supports))
