"""The precision conventions of every op's reference semantics.

The spec pins where fp32 is used but not accumulation orders or transcendental implementations.
The reference semantics pin them so that a row's result does not depend on how many rows share the
step (torch's fp32 CPU kernels take different vectorised paths by size, so chunked prefill,
whole prefill and decode would differ in the last bits and ties in top-k would break differently):
- an "fp32 accumulation" GEMM or reduction accumulates in fp64 and rounds once to fp32;
- fp32 transcendentals (exp, sigmoid, softmax, silu, softplus, rsqrt, cos/sin) are evaluated in
  fp64 and rounded once.
Kernels are compared to these semantics within their dtype's tolerance, not bit for bit.

Two ops round to bf16 inside, where the official model (`inference/model.py` and its TileLang
sparse-attention kernel) rounds, so that the reference agrees with it (spec §3.6):
- sparse attention (and the window and DSpark block attentions, which share `attend_with_sink`):
  the probabilities exp(s - m) are rounded to bf16 before the P.V product, while the max and the
  denominator stay fp32 (the denominator sums the unrounded probabilities). m is the row's max over
  all its keys; a kernel with an online softmax rounds each key block against its running max
  instead, which differs by at most one bf16 rounding of each term;
- index scores: the q.k dot of each head is rounded to bf16 (a bf16 einsum's output), ReLU,
  times the bf16 head weight rounded to bf16 (a bf16 product), and the head sum rounded to bf16
  (a bf16 sum; fp32 accumulation as torch's, here fp64 rounded once to fp32, then to bf16).
  Scores are bf16 values held in fp32; ties are frequent and break by lowest position.
"""
from __future__ import annotations

import weakref

import torch


# fp64 copies of constant tensors (weights), made once where a plan executor asks for them: the
# conversion of a large weight every step would cost more than the product itself on the CPU.
# Entries hold their tensor weakly and vanish with it, so executors that go away leave nothing.
_F64: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def keep_f64(t: torch.Tensor) -> None:
    if id(t) not in _F64:
        _F64[id(t)] = (weakref.ref(t), t.double())
        weakref.finalize(t, _F64.pop, id(t), None)


def as64(t: torch.Tensor) -> torch.Tensor:
    hit = _F64.get(id(t))
    return hit[1] if hit is not None and hit[0]() is t else t.double()


def mm32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T, fp32 result accumulated in fp64."""
    return (as64(x) @ as64(w).t()).float()


def sum32(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    return x.double().sum(dim, keepdim=keepdim).float()


def mean_sq32(x: torch.Tensor, dim: int = -1, keepdim: bool = True) -> torch.Tensor:
    """mean(x^2) of fp32 values, accumulated in fp64."""
    return (x.double() ** 2).mean(dim, keepdim=keepdim).float()


def rsqrt32(x: torch.Tensor) -> torch.Tensor:
    return (1.0 / torch.sqrt(x.double())).float()


def bf16r(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to bf16 (to nearest, ties to even) and held in fp32."""
    return x.float().bfloat16().float()


def exp32(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).float()


def sigmoid32(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.double()).float()


def silu32(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x.double()).float()


def softplus32(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.softplus(x.double()).float()


def softmax32(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(x.double(), dim).float()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """(w * (x_f32 * rsqrt(mean(x_f32^2) + eps))) in x's dtype (spec §3.1)."""
    xf = x.float()
    return (w.float() * (xf * rsqrt32(mean_sq32(xf) + eps))).to(x.dtype)
