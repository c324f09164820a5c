"""What every TileLang-Ascend template shares: the UB / L1 granule, element sizes, TileLang's names
of the IR dtypes, and lowering a prim_func to AscendC source (TileLang's Ascend target must be
entered around `tilelang.lower`)."""
from __future__ import annotations

BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8, "u8": 1, "i8": 1, "f8e4m3": 1, "fp8e4m3": 1, "e8m0": 1}
# TileLang dtype of each IR storage dtype (ue8m0 scales are raw exponent bytes)
TL_DTYPE = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "i32": "int32", "i64": "int64", "u8": "uint8",
            "i8": "int8", "e8m0": "uint8", "fp8e4m3": "float8_e4m3fn"}
GRANULE = 32  # bytes: UB / L1 buffers and their GM transfers are 32-byte granular (capacity.ASCEND_ALIGN)


def align32(n: int) -> int:
    return -(-n // GRANULE) * GRANULE


def lower_ascend(prim_func) -> str:
    """AscendC source of a TileLang-Ascend prim_func."""
    import tilelang
    from tilelang.ascend.target import _make_ascend_target

    with _make_ascend_target():
        return tilelang.lower(prim_func, target="ascend").kernel_source
