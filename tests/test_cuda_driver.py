"""The driver structures the runtime hands cuLaunchKernelEx, laid out as cuda.h has them (CUDA 12
and 13), and the switch that launches every kernel plainly."""
import ctypes
import json

import pytest

from deepinfer.runtime import cuda_driver as D
from deepinfer.runtime import tensor_map as TM


def test_launch_structures_match_cuda_h():
    # CUlaunchAttribute: id (4) + pad to 8 + a 64-byte value union
    assert ctypes.sizeof(D.LaunchAttribute) == 72 and D.LaunchAttribute.value.offset == 8
    # CUlaunchConfig: 7 unsigned ints, then the stream and attribute pointers, then numAttrs
    assert D.LaunchConfig.hStream.offset == 32 and D.LaunchConfig.attrs.offset == 40
    assert D.LaunchConfig.numAttrs.offset == 48 and ctypes.sizeof(D.LaunchConfig) == 56
    a = D.LaunchAttribute(id=D.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    assert bytes(a)[:4] == (6).to_bytes(4, "little") and bytes(a)[8:12] == (1).to_bytes(4, "little")


def test_pdl_switch(monkeypatch):
    monkeypatch.delenv("DEEPINFER_PDL", raising=False)
    assert D.pdl_enabled()
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    assert not D.pdl_enabled()


def test_pdl_launches_scope():
    assert D._PDL_HERE.get()
    with D.pdl_launches(False):
        assert not D._PDL_HERE.get()
        with D.pdl_launches(True):
            assert D._PDL_HERE.get()
        assert not D._PDL_HERE.get()
    assert D._PDL_HERE.get()


def _map_type(**over):
    spec = {"buffer": "W", "dtype": 0, "dims": [1024, 512], "elem_size": 1, "strides": [1024], "box": [64, 128],
            "elem_strides": [1, 1], "interleave": 0, "swizzle": 3, "l2": 2, "oob": 0}
    spec.update(over)
    return TM.TENSOR_MAP + " " + json.dumps(spec)


def test_a_tensor_map_is_encoded_for_the_bound_buffer(monkeypatch):
    """A "CUtensorMap {...}" argument becomes the driver's encoding of that layout at the bound
    buffer's address, in 128 bytes at a 64-byte boundary; the same buffer reuses it."""
    seen = []

    class FakeLib:
        def cuTensorMapEncodeTiled(self, tm, dtype, rank, addr, dims, strides, box, es, il, sw, l2, oob):
            r = rank.value
            seen.append((dtype.value, r, addr.value, list(dims)[:r], list(strides)[:r - 1], list(box)[:r],
                         list(es)[:r], il.value, sw.value, l2.value, oob.value))
            ctypes.memset(ctypes.addressof(tm._obj), 0xAB, 128)
            return 0

    monkeypatch.setattr(D, "_lib", lambda: FakeLib())
    D.tensor_map.cache_clear()

    class Buf:
        def data_ptr(self):
            return 0x7F0000001000

    ct = _map_type()
    tm = D.c_arg(ct, Buf())
    assert seen == [(0, 2, 0x7F0000001000, [1024, 512], [1024], [64, 128], [1, 1], 0, 3, 2, 0)]
    assert ctypes.sizeof(tm) == 128 and ctypes.addressof(tm) % 64 == 0 and bytes(tm) == b"\xab" * 128
    assert D.c_arg(ct, Buf()) is tm and len(seen) == 1
    with pytest.raises(D.CudaError, match="16-byte aligned"):
        D.tensor_map(ct, 0x7F0000001008)
    with pytest.raises(TM.TensorMapError, match="malformed tensor map"):
        TM.tensor_map_spec(_map_type(strides=[1024, 4]))
    assert TM.tensor_map_spec("void*") is None


def test_a_tensor_map_names_the_layout_a_buffer_misses():
    spec = TM.tensor_map_spec(_map_type())
    assert TM.tensor_map_mismatch(spec, (512, 1024), (1024, 1), 1) is None
    assert TM.tensor_map_mismatch(spec, (512, 256), (256, 1), 4) is None  # the same bytes, 4-byte words
    assert "shape" in TM.tensor_map_mismatch(spec, (256, 1024), (1024, 1), 1)
    assert "strides" in TM.tensor_map_mismatch(spec, (512, 1024), (2048, 1), 1)
