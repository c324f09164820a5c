"""Tensor types: a plain tensor (dtype + shape) and a quantised tensor (data + block scales)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import sympy

from . import dtypes as dt
from . import shapes as sh
from .shapes import Dim


@dataclass(frozen=True)
class TensorType:
    dtype: dt.DType
    shape: tuple[Dim, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", sh.shape(self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> Dim:
        return sh.numel(self.shape)

    @property
    def nbytes(self) -> Dim:
        return sh.dim(self.dtype.nbytes(self.numel))

    def storage_shape(self) -> tuple[Dim, ...]:
        """Shape of the torch tensor holding it: fp4 packs the last dim two per byte."""
        if self.dtype.packed == 1 or not self.shape:
            return self.shape
        return self.shape[:-1] + (sh.dim(sympy.sympify(self.shape[-1]) / self.dtype.packed),)

    def with_shape(self, shape) -> "TensorType":
        return TensorType(self.dtype, tuple(shape))

    def subs(self, env) -> "TensorType":
        return TensorType(self.dtype, sh.subs(self.shape, env))

    def free_symbols(self) -> set:
        return sh.free_symbols(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype.name}{sh.shape_str(self.shape)}"


@dataclass(frozen=True)
class QuantType:
    """Block-quantised tensor: `data` holds the codes, `scale` one value per `block` of data.

    `block` has one entry per data dim; the scale shape is ceil(data / block) per dim.
    """

    data: TensorType
    scale: TensorType
    block: tuple[int, ...]

    def __post_init__(self):
        if len(self.block) != self.data.rank or self.scale.rank != self.data.rank:
            raise ValueError(f"quantised type {self}: block and scale need the data's rank")
        for d, s, b in zip(self.data.shape, self.scale.shape, self.block):
            if not sh.equal(sympy.ceiling(sympy.sympify(d) / b), s):
                raise ValueError(f"quantised type {self}: scale dim {s} != ceil({d}/{b})")

    @property
    def dtype(self) -> dt.DType:
        return self.data.dtype

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.data.shape

    @property
    def rank(self) -> int:
        return self.data.rank

    @property
    def numel(self) -> Dim:
        return self.data.numel

    @property
    def nbytes(self) -> Dim:
        return sh.dim(self.data.nbytes + self.scale.nbytes)

    def subs(self, env) -> "QuantType":
        return QuantType(self.data.subs(env), self.scale.subs(env), self.block)

    def free_symbols(self) -> set:
        return self.data.free_symbols() | self.scale.free_symbols()

    def __str__(self) -> str:
        return f"{self.data}{{{self.scale},{'x'.join(map(str, self.block))}}}"


Type = Union[TensorType, QuantType]


def tensor(dtype, *shape) -> TensorType:
    return TensorType(dt.dtype(dtype) if isinstance(dtype, str) else dtype, tuple(shape))


def quantized(data_dtype, shape, scale_dtype, block) -> QuantType:
    """A block-quantised type; the scale shape follows from the data shape and the block."""
    data = tensor(data_dtype, *shape)
    scale_shape = tuple(sh.dim(sympy.ceiling(sympy.sympify(d) / b)) for d, b in zip(data.shape, block))
    return QuantType(data, tensor(scale_dtype, *scale_shape), tuple(block))
