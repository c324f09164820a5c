"""Capacity checks a rendered or built kernel must pass before it is called valid, one per kind of
backend. "valid" means: fits the target's capacities as declared in its Target (and, after a
build, as ptxas reports). It never means verified (that needs a run on the hardware) or fast."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..template import KernelSource
    from .manifest import Target

REGS_PER_SM = 65536  # sm90 and sm100 register file per SM (32-bit registers)
MAX_THREADS = 1024
ASCEND_ALIGN = 32  # bytes: UB / L1 buffers and their GM transfers are 32-byte granular


def cuda_check(target: Target):
    def check(src: KernelSource, resources: dict | None) -> str | None:
        if src.language == "triton":
            warps = [k["num_warps"] for k in src.meta.get("kernels", [])] or [src.block[0] // 32 if src.block else 4]
            if max(warps) * 32 > MAX_THREADS:
                return f"{src.entry}: {max(warps)} warps exceed {MAX_THREADS} threads per block"
        threads = 1
        for b in src.block:
            threads *= b
        if threads > MAX_THREADS:
            return f"{src.entry}: {threads} threads per block exceed {MAX_THREADS}"
        if src.smem_bytes > target.smem_bytes:
            return f"{src.entry}: {src.smem_bytes} B dynamic shared memory exceed {target.smem_bytes} B"
        kernels = src.meta.get("kernels", [])
        for name, r in (resources or {}).items():
            if src.language == "triton" and ":" in name:  # "i:entry": that launch's own warps
                threads = 32 * kernels[int(name.split(":")[0])]["num_warps"]
            regs = r.get("registers") or 0
            smem = max(r.get("smem_bytes") or 0, r.get("shared_bytes") or 0) + (
                src.smem_bytes if src.language == "cuda" else 0)
            if regs > target.regs_per_thread:
                return f"{name}: {regs} registers per thread exceed {target.regs_per_thread}"
            if regs * max(threads, 1) > REGS_PER_SM:
                return f"{name}: {regs} registers x {threads} threads exceed the {REGS_PER_SM}-register file"
            if smem > target.smem_bytes:
                return f"{name}: {smem} B shared memory exceed {target.smem_bytes} B"
        return None
    return check


_ASCEND_SCOPES = {"ub": "ub_bytes", "l1": "l1_bytes", "l0a": "l0a_bytes", "l0b": "l0b_bytes", "l0c": "l0c_bytes"}


def ascend_check(target: Target):
    def check(src: KernelSource, resources: dict | None) -> str | None:
        """AscendC kernels carry their buffer plan in meta['buffers'] (scope -> list of byte sizes)."""
        bufs = src.meta.get("buffers")
        if bufs is None:
            return f"{src.entry}: no buffer plan to check against {target.name}'s capacities"
        for scope, sizes in bufs.items():
            if scope not in _ASCEND_SCOPES:
                return f"{src.entry}: unknown buffer scope {scope!r}"
            for s in sizes:
                if s % ASCEND_ALIGN:
                    return f"{src.entry}: a {scope} buffer of {s} B is not {ASCEND_ALIGN}-byte aligned"
            cap = getattr(target, _ASCEND_SCOPES[scope])
            if sum(sizes) > cap:
                return f"{src.entry}: {sum(sizes)} B of {scope} exceed {cap} B"
        for g in src.meta.get("gm_row_bytes", []):
            if g % ASCEND_ALIGN:
                return f"{src.entry}: a {g} B global-memory row is not {ASCEND_ALIGN}-byte aligned"
        grid = 1
        for g in src.grid:
            grid *= g
        if grid > target.cores:
            return f"{src.entry}: grid {grid} exceeds {target.cores} AI cores"
        return None
    return check


def no_check(src: KernelSource, resources: dict | None) -> str | None:
    """Torch references run the op's own semantics: nothing to fit."""
    return None
