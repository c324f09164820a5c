"""Block quantisation rules of the spec (§3.3-§3.5), on torch tensors.

A quantised tensor is data plus a block-scale tensor (`QTensor`); its IR type is `QuantType`
(ir.types). "fake" variants return the dequantised values, which is how the reference semantics
of the model are defined (fp32 simulation of the quantisation).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import dtypes as dt


class QTensor(NamedTuple):
    """A quantised tensor at run time: storage data plus its scale tensor."""

    data: torch.Tensor
    scale: torch.Tensor


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block {block}")
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)), i.e. v with its mantissa rounded up to a power of two (v > 0)."""
    m, e = torch.frexp(v)  # v = m * 2^e, 0.5 <= m < 1
    return torch.ldexp(torch.ones_like(v), torch.where(m == 0.5, e - 1, e))


# ---- fp8 e4m3 per 32 elements with a ue8m0 scale (activations, window KV; §3.3) ---------------

FP8_AMAX_FLOOR = 1e-4


def quant_fp8_32(x: torch.Tensor, block: int = 32) -> QTensor:
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    s = _pow2_ceil(amax / dt.FP8_MAX)
    q = dt.fp8_encode(xb / s)
    return QTensor(q.flatten(-2), dt.e8m0_encode_pow2(s.squeeze(-1)))


def dequant_fp8_32(q: QTensor, block: int = 32) -> torch.Tensor:
    s = dt.e8m0_decode(q.scale).unsqueeze(-1)
    return (q.data.float().unflatten(-1, (-1, block)) * s).flatten(-2)


def fake_quant_fp8_32(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fq8: the fp32 value of the per-32 fp8 round trip, in x's dtype."""
    return dequant_fp8_32(quant_fp8_32(x, block), block).to(x.dtype)


# ---- fp4 e2m1 per 32 with ue8m0 scale (index q/k, expert weights; §3.4) -----------------------

FP4_MAX = 6.0
FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9


def quant_fp4_ue8m0(x: torch.Tensor, block: int = 32) -> QTensor:
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_UE8M0_AMAX_FLOOR)
    s = _pow2_ceil(amax / FP4_MAX)
    codes = dt.fp4_encode(xb / s).flatten(-2)
    return QTensor(dt.fp4_pack(codes), dt.e8m0_encode_pow2(s.squeeze(-1)))


def dequant_fp4_ue8m0(q: QTensor, block: int = 32) -> torch.Tensor:
    v = dt.fp4_decode(dt.fp4_unpack(q.data)).unflatten(-1, (-1, block))
    return (v * dt.e8m0_decode(q.scale).unsqueeze(-1)).flatten(-2)


# ---- fp4 e2m1 per 16 with an e4m3 scale (compressed main KV; §3.4) -----------------------------

def quant_fp4_e4m3(x: torch.Tensor, block: int = 16) -> QTensor:
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_E4M3_AMAX_FLOOR)
    s = dt.fp8_encode(amax / FP4_MAX)  # round to nearest e4m3, not a power of two
    codes = dt.fp4_encode(xb / s.float()).flatten(-2)
    return QTensor(dt.fp4_pack(codes), s.squeeze(-1))


def dequant_fp4_e4m3(q: QTensor, block: int = 16) -> torch.Tensor:
    v = dt.fp4_decode(dt.fp4_unpack(q.data)).unflatten(-1, (-1, block))
    return (v * q.scale.float().unsqueeze(-1)).flatten(-2)


# ---- weights (§3.5) ---------------------------------------------------------------------------

def dequant_fp8_weight(w: torch.Tensor, scale: torch.Tensor, block=(32, 32)) -> torch.Tensor:
    """W[i,j] = e4m3[i,j] * 2^(S[i//32, j//32] - 127), as fp32."""
    s = dt.e8m0_decode(scale)
    s = s.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
    return w.float() * s


def quant_fp8_weight(w: torch.Tensor, block=(32, 32)) -> QTensor:
    """The inverse of dequant_fp8_weight with power-of-two block scales (for making checkpoints)."""
    o, i = w.shape
    bo, bi = block
    po, pi = -o % bo, -i % bi
    wp = torch.nn.functional.pad(w.float(), (0, pi, 0, po))
    tiles = wp.view((o + po) // bo, bo, (i + pi) // bi, bi)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(FP8_AMAX_FLOOR)
    s = _pow2_ceil(amax / dt.FP8_MAX)
    q = dt.fp8_encode(tiles / s[:, None, :, None]).view(o + po, i + pi)[:o, :i]
    return QTensor(q.contiguous(), dt.e8m0_encode_pow2(s))


def dequant_fp4_weight(w: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """W[i,j] = e2m1[i,j] * 2^(S[i, j//32] - 127); w is [out, in/2] packed bytes."""
    return dequant_fp4_ue8m0(QTensor(w, scale), block)
