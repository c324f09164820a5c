"""The driver structures the runtime hands cuLaunchKernelEx, laid out as cuda.h has them (CUDA 12
and 13), and the switch that launches every kernel plainly."""
import ctypes

from deepinfer.runtime import cuda_driver as D


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
