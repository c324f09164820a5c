"""One backend per target, declared in one place: its name, the Target value, the pass pipeline
it compiles with, the template languages it renders, how it builds, and the capacity checks a
rendered or built kernel must pass before it is called valid.

| backend   | renders               | builds here (CPU machine)                               |
|-----------|-----------------------|---------------------------------------------------------|
| sm90      | cuda (TileLang), triton | nvcc -cubin sm_90a; Triton AOT GPUTarget("cuda", 90, 32) |
| sm100     | cuda (TileLang), triton | nvcc -cubin sm_100a; Triton AOT GPUTarget("cuda", 100, 32) |
| ascend950 | ascendc (TileLang Ascend) | bisheng when on PATH, else the checked source (`unbuilt`) |
| cpu       | torch                 | nothing                                                 |

"valid" means: fits the target's capacities as declared in its Target (and, after a build, as
ptxas reports). It never means verified (that needs a run on the hardware) or fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import build as _build
from .target import Target, get_target
from .template import KernelSource, KernelSpec, Template

REGS_PER_SM = 65536  # sm90 and sm100 register file per SM (32-bit registers)
MAX_THREADS = 1024
ASCEND_ALIGN = 32  # bytes: UB / L1 buffers and their GM transfers are 32-byte granular


@dataclass(frozen=True)
class Backend:
    name: str
    target: Target
    pipeline: str  # key of passes.pipelines.PIPELINES
    languages: tuple[str, ...]  # template languages it accepts, in preference order
    check: Callable[[KernelSource, dict | None], str | None]  # capacity check -> reason, or None

    def passes(self, **kw):
        """The target's pass list (imported lazily: passes import codegen)."""
        from ..passes.pipelines import PIPELINES

        return PIPELINES[self.pipeline](**kw)

    def accepts(self, template: Template) -> bool:
        return self.target.name in template.targets

    def render(self, template: Template, spec: KernelSpec, config: dict | None = None) -> KernelSource:
        if not self.accepts(template):
            raise ValueError(f"template {template.name} does not render for {self.name}")
        if not template.supports(self.target, spec):
            raise ValueError(f"template {template.name} does not support {spec.key()} on {self.name}")
        cfg = dict(template.default_config(self.target, spec))
        cfg.update(config or {})
        src = template.render(self.target, spec, cfg)
        if src.language not in self.languages:
            raise ValueError(f"{template.name} rendered {src.language!r}; {self.name} builds {self.languages}")
        return src

    def validate(self, src: KernelSource) -> str | None:
        """Capacity check of a rendered kernel (before any build): the reason it is invalid, or None."""
        return self.check(src, None)

    def build(self, sources: list[KernelSource], *, jobs: int = 1, cache: _build.CompileCache | None = None):
        """Build (or fetch from the compile cache) every source; see codegen.build."""
        return _build.build_many(list(sources), self.target, jobs=jobs, cache=cache, check=self.check,
                                 backend_name=self.name)

    def build_one(self, src: KernelSource, cache: _build.CompileCache | None = None) -> _build.BuildResult:
        return _build.build_one(src, self.target, cache, self.check)


# ---- capacity checks ----------------------------------------------------------------------------

def _cuda_check(target: Target):
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


def _ascend_check(target: Target):
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


def _cpu_check(src: KernelSource, resources: dict | None) -> str | None:
    return None


def _make() -> dict[str, Backend]:
    t = {n: get_target(n) for n in ("sm90", "sm100", "ascend950", "cpu")}
    return {
        "sm90": Backend("sm90", t["sm90"], "sm90", ("cuda", "triton"), _cuda_check(t["sm90"])),
        "sm100": Backend("sm100", t["sm100"], "sm100", ("cuda", "triton"), _cuda_check(t["sm100"])),
        "ascend950": Backend("ascend950", t["ascend950"], "ascend950", ("ascendc",), _ascend_check(t["ascend950"])),
        "cpu": Backend("cpu", t["cpu"], "cpu", ("torch",), _cpu_check),
    }


BACKENDS: dict[str, Backend] = _make()


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})") from None
