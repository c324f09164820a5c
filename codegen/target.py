"""Targets are values, not probes: each is an explicit frozen description that enters every cache
and tuning key. Nothing here looks at the machine; `--target` names one.

Numbers marked `modelled` are datasheet values used by the cost model until a measurement on the
hardware replaces them (autotune records measured ceilings separately)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


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

    def key(self) -> dict:
        return asdict(self)


TARGETS = {
    "sm90": Target("sm90", "cuda", "sm_90a", cores=132, smem_bytes=227 * 1024, hbm_bytes_per_s=4.8e12,
                   peak_flops={"bf16": 989e12, "fp8": 1979e12, "f32": 67e12}),
    "sm100": Target("sm100", "cuda", "sm_100a", cores=148, smem_bytes=227 * 1024, hbm_bytes_per_s=8.0e12,
                    peak_flops={"bf16": 2250e12, "fp8": 4500e12, "fp4": 9000e12, "f32": 80e12}),
    "ascend950": Target("ascend950", "ascend", "dav-3510", cores=64, ub_bytes=248 * 1024, l1_bytes=1024 * 1024,
                        l0a_bytes=64 * 1024, l0b_bytes=64 * 1024, l0c_bytes=256 * 1024, hbm_bytes_per_s=1.6e12,
                        peak_flops={"bf16": 500e12, "fp8": 1000e12}),
    "cpu": Target("cpu", "cpu", "x86_64", cores=2),
}


class UnknownTargetError(ValueError):
    pass


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise UnknownTargetError(f"unknown target {name!r} (known: {', '.join(TARGETS)})") from None
