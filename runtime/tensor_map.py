"""The type of a TMA tensor-map kernel parameter, shared by the compiler (which writes it) and the
runtime (which encodes it, runtime/cuda_driver.py); a module of its own, so that neither the driver
code nor the compiler's enter the other's code fingerprints.
"""
from __future__ import annotations

import functools
import json


class TensorMapError(ValueError):
    pass


# A kernel lowered with TMA copies takes, for each buffer it copies that way, a CUtensorMap by value
# (`__grid_constant__ const CUtensorMap X_desc`): the buffer's address, extents and strides, and the
# box one copy moves. Its parameter type is "CUtensorMap " + the JSON of how the compiler's lowering
# encodes it (everything cuTensorMapEncodeTiled takes but the address; codegen's tilelang lower):
# buffer (the host's buffer name), dtype (a CUtensorMapDataType), dims (innermost first), strides
# (bytes, of dims 1..), elem_size, box, elem_strides, interleave, swizzle, l2, oob. The runtime
# encodes the map for the bound buffer's address at launch (a host-side call; a captured graph
# keeps the bytes it was captured with, as it keeps every argument).
TENSOR_MAP = "CUtensorMap"


def tensor_map_spec(ctype: str) -> dict | None:
    """The encoding a "CUtensorMap {...}" parameter type carries; None for any other type."""
    if not ctype.startswith(TENSOR_MAP):
        return None
    return _tensor_map_spec(ctype)


@functools.lru_cache(maxsize=256)
def _tensor_map_spec(ctype: str) -> dict:
    try:
        spec = json.loads(ctype[len(TENSOR_MAP):])
        r = len(spec["dims"])
        if not (1 <= r <= 5 and len(spec["strides"]) == r - 1 and len(spec["box"]) == r
                and len(spec["elem_strides"]) == r):
            raise ValueError(f"rank {r} with {len(spec['strides'])} strides, {len(spec['box'])} box extents")
        return spec
    except (ValueError, KeyError, TypeError) as e:
        raise TensorMapError(f"malformed tensor map parameter {ctype[:80]!r}: {e}") from None


def tensor_map_mismatch(spec: dict, shape, strides, element_size: int) -> str | None:
    """Why a buffer of this shape, element strides and element size is not the one the map was
    lowered for (bytes compared, so a packed buffer may be typed differently), or None."""
    inner = spec["dims"][0] * spec["elem_size"]
    want = [inner] + [spec["dims"][i] for i in range(1, len(spec["dims"]))]
    got_bytes = [shape[-1] * element_size] + list(reversed(shape[:-1]))
    if len(shape) != len(spec["dims"]) or got_bytes != want:
        return f"shape {list(shape)} ({element_size}-byte elements), the map was lowered for {spec['dims']} " \
               f"({spec['elem_size']}-byte elements, innermost first)"
    got_strides = [s * element_size for s in reversed(strides[:-1])]
    if strides[-1] != 1 or got_strides != spec["strides"]:
        return f"strides {list(strides)}, the map was lowered for {spec['strides']} bytes"
    return None
