"""What every TileLang-Ascend template shares: the UB / L1 granule, element sizes, TileLang's names
of the IR dtypes, and lowering a prim_func to AscendC source (TileLang's Ascend target must be
entered around `tilelang.lower`)."""
from __future__ import annotations

BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8, "u8": 1, "i8": 1, "f8e4m3": 1, "fp8e4m3": 1, "e8m0": 1}
# TileLang dtype of each IR storage dtype (ue8m0 scales are raw exponent bytes)
TL_DTYPE = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "i32": "int32", "i64": "int64", "u8": "uint8",
            "i8": "int8", "e8m0": "uint8", "fp8e4m3": "float8_e4m3fn"}
GRANULE = 32  # bytes: UB / L1 buffers and their GM transfers are 32-byte granular (capacity.ASCEND_ALIGN)
# TileLang-Ascend keeps 32 KiB of the UB for SIMT thread contexts in any kernel with a SIMT region
# (its auto scheduler's GetSharedMemoryLimit: 248 KiB physical - 32 KiB); a buffer plan of such a
# kernel lists it, so the check against the 248 KiB UB sees what the scheduler will refuse
SIMT_CONTEXT_UB = 32 * 1024


def align32(n: int) -> int:
    return -(-n // GRANULE) * GRANULE


def lower_ascend(prim_func) -> str:
    """AscendC source of a TileLang-Ascend prim_func."""
    import tilelang
    from tilelang.ascend.target import _make_ascend_target

    with _make_ascend_target():
        return tilelang.lower(prim_func, target="ascend").kernel_source


def e2m1_f32(T, nib):
    """The fp32 value of an e2m1 code (0..15, bit 3 the sign): magnitudes 0, .5 (codes 0, 1), else
    2^(e-1) * (1 + m/2) for exponent bits e and mantissa bit m; computed, since a SIMT region has no
    constant table."""
    mag = T.bitwise_and(nib, 7)
    v = T.if_then_else(mag < 2, T.Cast("float32", mag) * 0.5,
                       T.reinterpret(T.shift_left(T.shift_right(mag, 1) + 126, 23), "float32")
                       * (1.0 + T.Cast("float32", T.bitwise_and(mag, 1)) * 0.5))
    return T.if_then_else(nib >= 8, -v, v)
