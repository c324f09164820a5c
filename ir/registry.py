"""The op registry: each op's shape/dtype rule, reference semantics in torch, and cost.

An op is registered once with `@op(...)` on its reference function. The shape rule maps input
types and attributes to output types (raising `ShapeError` with the reason); the cost maps them to
sympy expressions of FLOPs and bytes, so a plan can report cost per bucket without running
anything. Ops that update a state buffer in place declare `inplace={output: input}`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import sympy

from .shapes import dim
from .types import Type


class ShapeError(ValueError):
    """An op's shape/dtype rule rejected its inputs or attributes."""


@dataclass(frozen=True)
class Cost:
    flops: Any = 0
    bytes_read: Any = 0
    bytes_written: Any = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(dim(self.flops + other.flops), dim(self.bytes_read + other.bytes_read),
                    dim(self.bytes_written + other.bytes_written))

    def subs(self, env: Mapping[str, int]) -> "Cost":
        from .shapes import sym

        t = {sym(k): v for k, v in env.items()}
        return Cost(*(sympy.sympify(v).xreplace(t) for v in (self.flops, self.bytes_read, self.bytes_written)))


InferFn = Callable[[Sequence[Type], Mapping[str, Any]], Sequence[Type]]
FlopsFn = Callable[[Sequence[Type], Sequence[Type], Mapping[str, Any]], Any]


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: InferFn
    ref: Callable[..., Any]
    flops: FlopsFn
    attrs: Mapping[str, Any] = field(default_factory=dict)  # name -> default (REQUIRED if none)
    inplace: Mapping[int, int] = field(default_factory=dict)  # output index -> aliased input index
    n_inputs: int | None = None  # None: variadic

    def check_attrs(self, attrs: Mapping[str, Any]) -> dict:
        """The op's attributes with defaults filled in. Keys starting with '@' are annotations that
        passes attach (kernel choice, operand formats); they do not change the semantics."""
        attrs = {k: v for k, v in attrs.items() if not k.startswith("@")}
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise ShapeError(f"unknown attribute(s) {', '.join(sorted(unknown))}")
        out = {}
        for k, default in self.attrs.items():
            if k in attrs:
                out[k] = attrs[k]
            elif default is REQUIRED:
                raise ShapeError(f"missing attribute {k!r}")
            else:
                out[k] = default
        return out

    def infer_types(self, in_types: Sequence[Type], attrs: Mapping[str, Any]) -> list[Type]:
        if self.n_inputs is not None and len(in_types) != self.n_inputs:
            raise ShapeError(f"takes {self.n_inputs} inputs, got {len(in_types)}")
        return list(self.infer(in_types, self.check_attrs(attrs)))

    def cost(self, in_types: Sequence[Type], out_types: Sequence[Type], attrs: Mapping[str, Any]) -> Cost:
        """The op's cost rule; a rule that gives only FLOPs gets every operand read and written once.

        Ops that touch part of an operand (gathers, cache writes) return a full `Cost` instead.
        """
        c = self.flops(in_types, out_types, self.check_attrs(attrs))
        if isinstance(c, Cost):
            return Cost(dim(c.flops), dim(c.bytes_read), dim(c.bytes_written))
        return Cost(
            flops=dim(sympy.sympify(c)),
            bytes_read=dim(sum((t.nbytes for t in in_types), sympy.Integer(0))),
            bytes_written=dim(sum((t.nbytes for t in out_types), sympy.Integer(0))),
        )


class _Required:
    def __repr__(self):
        return "REQUIRED"


REQUIRED = _Required()

_REGISTRY: dict[str, OpDef] = {}


def op(name: str, *, infer: InferFn, flops: FlopsFn | None = None, attrs: Mapping[str, Any] | None = None,
       inplace: Mapping[int, int] | None = None, n_inputs: int | None = None):
    """Register the decorated torch function as the reference semantics of op `name`."""

    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"op {name!r} registered twice")
        _REGISTRY[name] = OpDef(name, infer, fn, flops or (lambda i, o, a: 0), dict(attrs or {}),
                                dict(inplace or {}), n_inputs)
        return fn

    return deco


def get_op(name: str) -> OpDef:
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}") from None


def all_ops() -> dict[str, OpDef]:
    _ensure_loaded()
    return dict(_REGISTRY)


def _ensure_loaded():
    from . import ops  # noqa: F401  (importing the package registers every op)
