"""One manifest per target (a module of this package each): its Target value, the operand formats
its kernels use, its pass pipeline, the template languages its backend builds and the capacity
check. The pipeline (passes/pipelines.py), the quant legaliser and the templates read these; none
of them compares a target's name."""
from __future__ import annotations

from . import ascend950, cpu, sm90, sm100
from .manifest import Manifest, Target

MANIFESTS: dict[str, Manifest] = {m.MANIFEST.name: m.MANIFEST for m in (sm90, sm100, ascend950, cpu)}
TARGETS: dict[str, Target] = {name: m.target for name, m in MANIFESTS.items()}


class UnknownTargetError(ValueError):
    pass


def get_manifest(name: str) -> Manifest:
    try:
        return MANIFESTS[name]
    except KeyError:
        raise UnknownTargetError(f"unknown target {name!r} (known: {', '.join(MANIFESTS)})") from None


def get_target(name: str) -> Target:
    return get_manifest(name).target


def building(language: str, defaults: str | None = None) -> tuple[str, ...]:
    """The targets whose backend builds `language` sources (and, where a template reads one of
    the per-target default tables, that carry `defaults`): what a template's `targets` is."""
    return tuple(n for n, m in MANIFESTS.items()
                 if language in m.languages and (defaults is None or defaults in m.target.defaults))


def device_targets() -> tuple[str, ...]:
    """The targets that build generated kernels (not torch references)."""
    return tuple(n for n, m in MANIFESTS.items() if "torch" not in m.languages)


__all__ = ["Manifest", "Target", "MANIFESTS", "TARGETS", "UnknownTargetError", "get_manifest", "get_target",
           "building", "device_targets"]
