"""Element types of the IR and the bit-level codecs of the narrow ones.

Every dtype knows how it is held in a torch tensor (`storage`): fp4 e2m1 is packed two codes per
byte (low nibble = even element, spec §3.4), ue8m0 scales are raw exponent bytes (spec §3.3).
The block-quantisation rules that use these codecs live in `ir.quant`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    name: str
    bits: int  # bits per logical element (fp4: 4, although storage packs two per uint8)
    storage: torch.dtype  # torch dtype of the tensor that holds the data
    is_float: bool

    def __str__(self) -> str:
        return self.name

    @property
    def packed(self) -> int:
        """Logical elements per storage element (2 for fp4, else 1)."""
        return 8 // self.bits if self.bits < 8 else 1

    def nbytes(self, numel):
        """Bytes taken by `numel` logical elements (works on ints and sympy expressions)."""
        import sympy

        b = sympy.sympify(numel) * sympy.Rational(self.bits, 8)
        return int(b) if b.is_Integer else b


bf16 = DType("bf16", 16, torch.bfloat16, True)
f16 = DType("f16", 16, torch.float16, True)
f32 = DType("f32", 32, torch.float32, True)
i8 = DType("i8", 8, torch.int8, False)
u8 = DType("u8", 8, torch.uint8, False)
i32 = DType("i32", 32, torch.int32, False)
i64 = DType("i64", 64, torch.int64, False)
bool_ = DType("bool", 8, torch.bool, False)
fp8e4m3 = DType("fp8e4m3", 8, torch.float8_e4m3fn, True)
e8m0 = DType("e8m0", 8, torch.uint8, True)  # raw biased exponent byte: value 2^(b-127)
fp4e2m1 = DType("fp4e2m1", 4, torch.uint8, True)  # packed: byte = code[2i] | code[2i+1] << 4

ALL = {d.name: d for d in (bf16, f16, f32, i8, u8, i32, i64, bool_, fp8e4m3, e8m0, fp4e2m1)}


def dtype(name: str) -> DType:
    try:
        return ALL[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(ALL)})") from None


# ---- e8m0 (ue8m0): an unsigned biased exponent, value 2^(b-127); 255 is NaN ------------------

def e8m0_decode(b: torch.Tensor) -> torch.Tensor:
    e = b.to(torch.uint8).to(torch.int32)
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def e8m0_encode_pow2(s: torch.Tensor) -> torch.Tensor:
    """Exponent byte of an exact power of two `s` (what the scale rules produce)."""
    _, exp = torch.frexp(s.float())  # s = 0.5 * 2^exp for a power of two
    return (exp - 1 + 127).clamp(0, 254).to(torch.uint8)


# ---- fp4 e2m1: codes 0..7 are {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 is the sign --------------------

FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Midpoints between neighbouring magnitudes, and whether a value exactly on one rounds up: ties go
# to the even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4).
_FP4_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_TIE_UP = (False, True, False, True, False, True, False)


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to the e2m1 grid (nearest, ties to even, saturating at 6); returns codes 0..15."""
    a = x.float().abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for mid, up in zip(_FP4_MIDS, _FP4_TIE_UP):
        code += (a >= mid if up else a > mid).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


_FP4_VALUES = torch.cat([FP4_GRID, -FP4_GRID])  # value of each 4-bit code 0..15


@functools.lru_cache(maxsize=None)
def _fp4_values(device: torch.device) -> torch.Tensor:
    # one copy per device, made once: a host-to-device copy per call breaks CUDA graph capture
    return _FP4_VALUES.to(device)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    return _fp4_values(codes.device)[codes.to(torch.int64) & 15]


def fp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, the even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even last dim, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes (uint8 or int8 as in the checkpoint) -> [..., 2n] codes."""
    b = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed.to(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


# ---- fp8 e4m3 (the fn variant: no infinities, max 448) ----------------------------------------

FP8_MAX = 448.0


def fp8_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 (nearest even), saturating at +-448 rather than producing NaN."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
