"""TileLang-Ascend templates for ascend950 (AscendC source through TileLang's Ascend backend,
`target="ascend"`). Here: RMSNorm, a vector-core kernel (SIMT regions on the Unified Buffer).

These render and pass the backend's capacity checks on this machine; they are built only where
CANN's `bisheng` exists and have never run on an Ascend 950, so nothing about them is verified.
The buffer plan the capacity check reads (meta['buffers']) is computed from the same sizes the
kernel allocates, rounded up to the 32-byte UB granule as the Ascend pipeline merges them.
"""
from __future__ import annotations

import functools

from ..targets import building
from ..template import KernelSource, KernelSpec, Template, register
from .ascend_common import align32 as _align32
from .ascend_common import lower_ascend

_BYTES = {"bf16": 2, "f16": 2, "f32": 4}


def _rms_norm_plan(h: int, dtype: str, threads: int) -> dict:
    """UB buffers of the kernel below: fp32 row, fp32 weight, the row in its storage dtype,
    per-thread partial sums, and the statistic."""
    return {"ub": [_align32(h * 4), _align32(h * 4), _align32(h * _BYTES[dtype]), _align32(threads * 4), 32]}


@functools.lru_cache(maxsize=64)
def _rms_norm_source(n: int, h: int, dtype: str, eps: float, cores: int, threads: int) -> str:
    import tilelang.ascend.language as T

    tdt = {"bf16": T.bfloat16, "f16": T.float16, "f32": T.float32}[dtype]
    grid = min(n, cores)
    per_core = -(-n // grid)
    per_thread = -(-h // threads)

    @T.prim_func
    def rms_norm(X: T.Tensor((n, h), tdt), W: T.Tensor((h,), tdt), Y: T.Tensor((n, h), tdt)):
        with T.Kernel(grid) as core:
            xs = T.alloc_shared((h,), T.float32)
            ws = T.alloc_shared((h,), T.float32)
            xb = T.alloc_shared((h,), tdt)
            part = T.alloc_shared((threads,), T.float32)
            stat = T.alloc_shared((8,), T.float32)
            T.copy(W[0], xb)
            with T.SimtVF(threads=threads):
                for i in T.Parallel(h):
                    ws[i] = T.cast(xb[i], T.float32)
            # persistent loop: core c takes rows c, c + grid, ... (the grid never exceeds the cores)
            for it in T.serial(per_core):
                row = it * grid + core
                if row < n:
                    T.copy(X[row, 0], xb)
                    with T.SimtVF(threads=threads):
                        for i in T.Parallel(h):
                            xs[i] = T.cast(xb[i], T.float32)
                    # sum of squares: each thread a strided slice, then one thread adds the partials
                    with T.SimtVF(threads=threads):
                        tid = T.get_thread_binding()
                        part[tid] = 0.0
                        for j in T.serial(per_thread):
                            if j * threads + tid < h:
                                part[tid] = part[tid] + xs[j * threads + tid] * xs[j * threads + tid]
                    with T.SimtVF(threads=1):
                        stat[0] = 0.0
                        for t in T.serial(threads):
                            stat[0] = stat[0] + part[t]
                        stat[1] = T.rsqrt(stat[0] / h + eps)
                    with T.SimtVF(threads=threads):
                        for i in T.Parallel(h):
                            xb[i] = T.cast(ws[i] * (xs[i] * stat[1]), tdt)
                    T.copy(xb, Y[row, 0])

    return lower_ascend(rms_norm)


def _ascend_rms_supports(target, spec: KernelSpec) -> bool:
    x = spec.in_types[0]
    return (len(x.shape) == 2 and all(isinstance(d, int) for d in x.shape) and x.dtype.name in _BYTES
            and spec.in_types[1].dtype == x.dtype and (x.shape[1] * _BYTES[x.dtype.name]) % 32 == 0)


def _ascend_rms_render(target, spec: KernelSpec, config) -> KernelSource:
    x = spec.in_types[0]
    n, h = x.shape
    threads = int(config["threads"])
    grid = min(n, target.cores)
    text = _rms_norm_source(n, h, x.dtype.name, float(spec.attr["eps"]), target.cores, threads)
    return KernelSource(language="ascendc", entry="rms_norm_kernel", text=text, grid=(grid,), block=(threads,),
                        meta={"buffers": _rms_norm_plan(h, x.dtype.name, threads),
                              "gm_row_bytes": [h * _BYTES[x.dtype.name]], "config": dict(config)})


register(Template(
    name="ascend_rms_norm", ops=("rms_norm",), targets=building("ascendc"), knobs={"threads": (64, 128, 256)},
    render=_ascend_rms_render, default_config=lambda target, spec: {"threads": 128},
    supports=_ascend_rms_supports))
