"""What a target is: its value (`Target`, capacities and peaks, entering every cache and tuning
key) and its manifest (`Manifest`: the Target plus the operand formats, the pass list, the
template languages its backend builds and the capacity check). Targets are values, not probes:
nothing here looks at the machine; `--target` names one.

Numbers marked `modelled` are datasheet values used by the cost model until a measurement on the
hardware replaces them (autotune records measured ceilings separately)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    from ..template import KernelSource


@dataclass(frozen=True)
class Target:
    name: str  # "sm90" | "sm100" | "ascend950" | "cpu"
    kind: str  # "cuda" | "ascend" | "cpu"
    arch: str  # "sm_90a", "sm_100a", "dav-3510", "x86_64"
    cores: int  # SMs / AI cores / CPU cores the plan may use
    smem_bytes: int = 0  # CUDA: shared memory per block (opt-in maximum)
    regs_per_thread: int = 255
    ub_bytes: int = 0  # Ascend: unified buffer per core
    l1_bytes: int = 0  # Ascend: L1 buffer per core
    l0a_bytes: int = 0
    l0b_bytes: int = 0
    l0c_bytes: int = 0
    hbm_bytes_per_s: float = 0.0  # modelled
    peak_flops: dict = field(default_factory=dict)  # dtype -> FLOP/s, modelled
    toolchain: dict = field(default_factory=dict)  # versions that enter cache keys
    # what templates read instead of the target's name (both enter the key, so a changed choice
    # never reuses a stale render): named instructions the target has, and per template family
    # the default-config choices that differ between targets
    features: tuple[str, ...] = ()
    defaults: dict = field(default_factory=dict)

    def key(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Manifest:
    """Everything the compiler knows about one target, declared in its module of this package."""

    target: Target
    languages: tuple[str, ...]  # template languages its backend builds, in preference order
    operand_formats: Mapping[str, str]  # op -> how the target's kernels consume its quantised operands
    passes: tuple[str, ...]  # the flat pass pipeline, by name (passes/pipelines.py binds them)
    check: Callable[[KernelSource, dict | None], str | None]  # capacity check -> reason, or None

    @property
    def name(self) -> str:
        return self.target.name
