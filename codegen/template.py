"""Kernel templates: one named, parameterised generator per kind of kernel call.

A template implements one or more IR ops (its reference semantics are those ops' `ref`), declares
its tuning knobs, and renders a source for a `KernelSpec` (the op, its attributes and the static
types of one call in one bucket) on a target. The registry is the one place kernel selection
looks templates up.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..ir.types import Type
from .targets import Target


@dataclass(frozen=True)
class KernelSpec:
    """One kernel call with every size known: what a template renders and a tuner keys on."""

    op: str
    attrs: tuple[tuple[str, Any], ...]  # the IR node's attrs, sorted
    in_types: tuple[Type, ...]  # static types (ints only)
    out_types: tuple[Type, ...]

    @property
    def attr(self) -> dict:
        return dict(self.attrs)

    def key(self) -> str:
        return f"{self.op}({', '.join(map(str, self.in_types))}){dict(self.attrs)}"


@dataclass(frozen=True)
class KernelSource:
    language: str  # "cuda" (TileLang-rendered), "triton", "ascendc", "torch"
    entry: str  # symbol / function name
    text: str  # the source
    grid: tuple[int, ...] = ()  # launch grid
    block: tuple[int, ...] = ()  # threads per block (CUDA) where the template fixes it
    smem_bytes: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Template:
    name: str
    ops: tuple[str, ...]  # IR ops this template implements
    targets: tuple[str, ...]  # targets it renders for: codegen.targets.building(its language) names them
    knobs: Mapping[str, tuple]  # tuning space: knob -> candidate values
    render: Callable[[Target, KernelSpec, Mapping[str, Any]], KernelSource]
    default_config: Callable[[Target, KernelSpec], dict]
    supports: Callable[[Target, KernelSpec], bool] = lambda target, spec: True
    # the host side of a generated kernel on its device: host(launch, inputs, attrs, config, meta) -> the
    # op's outputs, where launch(i, **buffers) runs the instance's i-th kernel with its buffers
    # bound by parameter name (TileLang templates; a Triton template's host is its launcher)
    host: Callable | None = None
    # the spec an instance is rendered for, when calls of several shapes can share one instance
    # (decode GEMMs: every row count up to 64 runs the 64-row kernel, its host pads the rows)
    canonical: Callable[[Target, KernelSpec], KernelSpec] | None = None

    def configs(self, target: Target, spec: KernelSpec):
        """Every point of the tuning space (the autotuner filters invalid ones by building)."""
        import itertools

        names = list(self.knobs)
        for values in itertools.product(*(self.knobs[n] for n in names)):
            yield dict(zip(names, values))


_TEMPLATES: dict[str, Template] = {}


def register(t: Template) -> Template:
    if t.name in _TEMPLATES:
        raise ValueError(f"template {t.name!r} registered twice")
    _TEMPLATES[t.name] = t
    return t


def templates() -> dict[str, Template]:
    _load()
    return dict(_TEMPLATES)


def select(target: Target, spec: KernelSpec) -> Template:
    """The template that implements `spec.op` on `target` (first registered that supports it)."""
    _load()
    for t in _TEMPLATES.values():
        if spec.op in t.ops and target.name in t.targets and t.supports(target, spec):
            return t
    raise LookupError(f"no {target.name} template implements {spec.op}")


def select_common(target: Target, specs: list[KernelSpec]) -> Template:
    """The first registered template that supports every spec of `specs` (one call's shapes in
    each bucket): a batch-invariant plan runs one template for a call whatever its row count."""
    _load()
    for t in _TEMPLATES.values():
        if all(s.op in t.ops and target.name in t.targets and t.supports(target, s) for s in specs):
            return t
    raise LookupError(f"no {target.name} template implements {specs[0].op} at every bucket's shapes")


BATCH_INVARIANT = "batch_invariant"  # a Target feature: kernel configs must not depend on the row count


def batch_invariant(target: Target) -> bool:
    return BATCH_INVARIANT in target.features


def _load():
    # importing the library registers every template. By name, not an import statement: a
    # template's render key hashes the import closure of its module (codegen/instances.py), and
    # registration does not make one template's code part of another's render
    importlib.import_module(f"{__package__}.library")
