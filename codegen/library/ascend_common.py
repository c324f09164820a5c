"""What every TileLang-Ascend template shares: the UB / L1 granule, element sizes, TileLang's names
of the IR dtypes, and lowering a prim_func to AscendC source (TileLang's Ascend target must be
entered around `tilelang.lower`)."""
from __future__ import annotations

import math

BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8, "u8": 1, "i8": 1, "f8e4m3": 1, "fp8e4m3": 1, "e8m0": 1}
GRANULE = 32  # bytes: UB / L1 buffers and their GM transfers are 32-byte granular (capacity.ASCEND_ALIGN)
# UB a kernel with SIMT regions cannot use: the SIMT threads' context (TileLang-Ascend's
# auto-schedule takes it off the 248 KiB before placing buffers, GetSharedMemoryLimit in
# src/ascend/transform/auto_schedule.cc); such a kernel's buffer plan lists it
SIMT_CONTEXT_BYTES = 32 * 1024

# IR dtype -> the TileLang dtype of its storage: e8m0 scales are raw exponent bytes, fp4 packs two
# codes a byte (its storage shape halves the last dim)
TL_DTYPE = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "i32": "int32", "i64": "int64",
            "u8": "uint8", "i8": "int8", "fp8e4m3": "float8_e4m3fn", "e8m0": "uint8", "fp4e2m1": "uint8"}


def align32(n: int) -> int:
    return -(-n // GRANULE) * GRANULE


def ub_bytes(shape, dtype: str) -> int:
    """Bytes of an on-chip buffer of `shape` in an IR dtype's storage, rounded up to the granule."""
    return align32(math.prod(shape) * (1 if dtype == "fp4e2m1" else BYTES[dtype]))


def const_at(values, j, dtype: str):
    """values[j] for a loop variable j over Python constants, as a select chain: an explicitly
    unrolled loop makes j a literal and the chain folds to the one constant."""
    from tvm import tirx

    e = tirx.const(values[-1], dtype)
    for k in range(len(values) - 2, -1, -1):
        e = tirx.Select(j == k, tirx.const(values[k], dtype), e)
    return e


def lower_ascend(prim_func) -> str:
    """AscendC source of a TileLang-Ascend prim_func."""
    from ..caches import lowered

    def lower() -> dict:
        import tilelang
        from tilelang.ascend.target import _make_ascend_target

        with _make_ascend_target():
            return {"src": tilelang.lower(prim_func, target="ascend").kernel_source}

    return lowered(prim_func, ["ascend"], lower)["src"]


def e2m1_f32(T, nib):
    """The fp32 value of an e2m1 code (0..15, bit 3 the sign): magnitudes 0, .5 (codes 0, 1), else
    2^(e-1) * (1 + m/2) for exponent bits e and mantissa bit m; computed, since a SIMT region has no
    constant table."""
    mag = T.bitwise_and(nib, 7)
    v = T.if_then_else(mag < 2, T.Cast("float32", mag) * 0.5,
                       T.reinterpret(T.shift_left(T.shift_right(mag, 1) + 126, 23), "float32")
                       * (1.0 + T.Cast("float32", T.bitwise_and(mag, 1)) * 0.5))
    return T.if_then_else(nib >= 8, -v, v)
