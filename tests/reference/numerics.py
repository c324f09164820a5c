"""Numeric building blocks of the reference (spec §3), written from the spec only.

Conventions
- Activations are bf16 tensors; everything the spec marks fp32 is computed in fp32.
- Fake quantisation ("fq") returns the dequantised values.  Every fq result (fp8 e4m3 or fp4 e2m1
  times a power-of-two / e4m3 scale) is exactly representable in bf16, so caches hold them as bf16.
- GEMMs that the spec specifies as "fp32 accumulation" are computed in fp64 and rounded once to
  fp32 (`mm32`).  The spec does not pin an accumulation order; a more precise accumulation is within
  its semantics, and it makes each output row independent of how many rows are in the batch (torch's
  fp32 CPU GEMM is not), so chunked prefill, whole prefill and decode agree bit for bit except for
  fp64->fp32 double-rounding cases (probability ~1e-8 per element).
- Likewise every fp32 transcendental (exp, sigmoid, softmax, silu, softplus, rsqrt, cos/sin) is
  evaluated in fp64 and rounded once to fp32: torch's fp32 CPU kernels give last-ulp differences
  between their vectorised and scalar paths, i.e. depending on the tensor size.
- TIE RULE (spec §4.4(d) "Ties", §16.4; no official rule exists): every top-k in the reference --
  indexer top-k, candidate blocks, router -- is `stable_topk`: the highest score wins, and among
  equal scores the LOWEST index (position / block / expert id) wins.  torch.topk does not guarantee
  any tie order, so it is never used.
- Rounding points inside two ops follow the official model (spec §3.6): sparse attention rounds its
  probabilities to bf16 before P.V (max and denominator fp32), and index scores are bf16
  arithmetic (the q.k dot, each weighted head term and the head sum each rounded to bf16).
"""
from __future__ import annotations

import torch

EPS = 1e-20  # rms_norm_eps of V4.1 (§3.1); the config value is used where the config is at hand

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4  # §3.3
FP4_MAX = 6.0
FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126  # §3.4
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9  # §3.4
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # e2m1 magnitudes by code 0..7


# ---- GEMM and reductions ------------------------------------------------------------------------

def mm32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T with fp32 inputs/outputs (accumulated in fp64, see module docstring)."""
    return (x.double() @ w.double().T).float()


def bf16_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A "bf16 GEMM" of the spec: bf16 operands, fp32 accumulation, bf16 output."""
    return mm32(x.float(), w.float()).bfloat16()


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """An fp32 result rounded to bf16, kept in fp32 for the arithmetic that follows."""
    return x.float().bfloat16().float()


def rsqrt32(x: torch.Tensor) -> torch.Tensor:
    return (1.0 / torch.sqrt(x.double())).float()


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


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """§3.1: (w * (x_f32 * rsqrt(mean(x_f32^2) + eps))).to(x.dtype)."""
    xf = x.float()
    ms = (xf.double() ** 2).mean(-1, keepdim=True).float()
    return (w.float() * (xf * rsqrt32(ms + eps))).to(x.dtype)


# ---- element codecs -------------------------------------------------------------------------------

def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 v) for v > 0 (the mantissa rounded up to a power of two), exactly."""
    m, e = torch.frexp(v)  # v = m * 2^e with 0.5 <= m < 1
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(v), e)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest e4m3 value (ties to even), saturating at +-448."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code, saturating at 6."""
    a = x.float().abs().clamp(max=FP4_MAX)
    grid = FP4_GRID.to(a.device)
    dist = (a.unsqueeze(-1) - grid).abs()
    code = dist.argmin(-1)  # first minimum = the lower code of a tie
    upper = (code + 1).clamp(max=7)
    tie = (dist.gather(-1, upper.unsqueeze(-1)).squeeze(-1) == dist.gather(-1, code.unsqueeze(-1)).squeeze(-1))
    code = torch.where(tie & (code % 2 == 1) & (upper != code), upper, code)
    return torch.copysign(grid[code], x.float())


def e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte b -> 2^(b-127) as fp32 (accepts uint8 or float8_e8m0fnu tensors)."""
    if b.dtype == torch.float8_e8m0fnu:
        b = b.view(torch.uint8)
    return torch.ldexp(torch.ones(b.shape), b.to(torch.int32) - 127)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (bit 3 = sign) -> fp32 values."""
    c = codes.to(torch.int64)
    mag = FP4_GRID[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[.., k/2] bytes -> [.., k] codes; the low nibble is the even element (§3.4)."""
    b = packed.view(torch.uint8).to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], -1).flatten(-2)


# ---- fake quantisation of activations (§3.3, §3.4) -------------------------------------------------

def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    assert x.shape[-1] % block == 0, (x.shape, block)
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


def fq8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 per-`block` with a UE8M0 scale; returns fp32 dequantised values."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    s = pow2_ceil(amax / FP8_MAX)
    return (e4m3_round(xb / s) * s).flatten(-2)


def fq4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 per-`block` with a UE8M0 (power-of-two) scale; fp32 dequantised values."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_UE8M0_AMAX_FLOOR)
    s = pow2_ceil(amax / FP4_MAX)
    return (e2m1_round(xb / s) * s).flatten(-2)


def fq4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 e2m1 per-`block` with an e4m3 scale rounded to nearest (compressed KV); fp32 values."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_E4M3_AMAX_FLOOR)
    s = e4m3_round(amax / FP4_MAX)
    return (e2m1_round(xb / s) * s).flatten(-2)


def lin8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """lin8 / lin4 (§3.6): per-32 fp8 fake-quantised activation x dequantised fp32 weight,
    fp32 accumulation, bf16 output.  `w` is the dequantised weight (fp8 or fp4 source)."""
    return mm32(fq8(x), w).bfloat16()


# ---- weight dequantisation (§3.5) ------------------------------------------------------------------

def dequant_fp8_weight(w: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """W[i,j] = e4m3[i,j] * 2^(S[i//32, j//32] - 127), fp32."""
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
    return w.float() * s


def dequant_fp4_weight(w: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """W[i,j] = e2m1[i,j] * 2^(S[i, j//32] - 127); w holds [out, in/2] packed bytes; fp32."""
    v = e2m1_decode(unpack_fp4(w))
    return v * e8m0_to_float(scale).repeat_interleave(block, -1)[:, : v.shape[1]]


def dequant_rows(rows: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Engram table rows: T[r,j] = e4m3[r,j] * 2^(S[r, j//32] - 127), fp32."""
    return rows.float() * e8m0_to_float(scale).repeat_interleave(block, -1)


# ---- RoPE / YaRN (§3.2) ------------------------------------------------------------------------------

def rope_freqs(dim: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """Per-pair frequencies f_i (i < dim/2), fp32; `yarn` = {factor, beta_fast, beta_slow, original}."""
    f = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn:
        import math

        def corr(rot):
            return dim * math.log(yarn["original"] / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corr(yarn["beta_fast"])), 0)
        high = min(math.ceil(corr(yarn["beta_slow"])), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        f = (f / yarn["factor"]) * ramp + f * (1 - ramp)
    return f


def rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the whole last dim of x by angle pos*f (fp32 cos/sin).

    x: [n, ..., d]; pos: [n] absolute positions.  inverse=True rotates by -pos*f.  Returns x.dtype."""
    ang = pos.to(torch.float32)[:, None] * freqs[None, :]  # [n, d/2]
    if inverse:
        ang = -ang
    cos, sin = torch.cos(ang.double()).float(), torch.sin(ang.double()).float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[0],)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float().unflatten(-1, (-1, 2))
    re, im = xf[..., 0], xf[..., 1]
    out = torch.stack([re * cos - im * sin, re * sin + im * cos], -1).flatten(-2)
    return out.to(x.dtype)


def rope_tail(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE applied to the LAST 2*len(freqs) dims of x only (§3.2)."""
    d = 2 * freqs.shape[0]
    return torch.cat([x[..., :-d], rope(x[..., -d:], pos, freqs, inverse)], -1)


# ---- selection -----------------------------------------------------------------------------------------

def stable_topk(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; ties go to the LOWEST index (the reference's one tie rule).

    Returns (values, indices), ordered by descending score then ascending index."""
    vals, idx = torch.sort(score, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]
