"""The few CUDA driver calls a compiled plan needs to run its cubins: load a module from bytes,
find a function, raise its dynamic shared-memory limit, launch it on torch's current stream.

A cubin built to wait on the grid before it (codegen/build.py, "programmatic dependent launch")
is launched with programmatic stream serialization, so that its launch overlaps the tail of the
kernel before it; DEEPINFER_PDL=0 launches every kernel plainly (the wait then returns at once),
and so does a step run under `pdl_launches(False)` (the executor's prefill steps).

ctypes over libcuda, so the runtime needs neither TileLang nor a CUDA toolkit on the serving
machine: the plan's cubins were built on the compile machine. Launches go onto torch's current
stream, so they order with torch work and are recorded by CUDA graph capture like any kernel.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os

from .tensor_map import TENSOR_MAP, tensor_map_spec

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuLaunchKernelEx)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def pdl_enabled() -> bool:
    return os.environ.get("DEEPINFER_PDL", "1") != "0"


_PDL_HERE = contextvars.ContextVar("deepinfer_pdl_launches", default=True)


@contextlib.contextmanager
def pdl_launches(on: bool):
    """Launches made inside use PDL (where their kernel was built for it) only if `on`."""
    token = _PDL_HERE.set(on)
    try:
        yield
    finally:
        _PDL_HERE.reset(token)


class CudaError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _lib():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaError(f"the CUDA driver (libcuda.so.1) is not loadable: {e}") from None
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(rc, ctypes.byref(name))
        raise CudaError(f"{what} failed: {name.value.decode() if name.value else rc}")


@functools.lru_cache(maxsize=None)
def _context(device: int) -> int:
    """Make the device's primary context (the one torch uses) current on this thread."""
    lib = _lib()
    _check(lib.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx.value


def driver_version() -> str:
    """The CUDA version the installed driver supports, as "13.0" (what a measurement of its
    kernels is recorded with)."""
    v = ctypes.c_int()
    _check(_lib().cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
    return f"{v.value // 1000}.{v.value % 1000 // 10}"


class CubinFunction:
    """One kernel of a cubin, launched with a fixed grid, block and dynamic shared memory."""

    def __init__(self, cubin: bytes, name: str, grid, block, smem: int, device: int = 0, pdl: bool = False):
        _context(device)
        lib = _lib()
        self.name, self.smem = name, int(smem)
        self.pdl = bool(pdl) and pdl_enabled()
        if self.pdl:
            self._attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        self._image = ctypes.create_string_buffer(cubin, len(cubin))  # the driver reads it during load only
        self.module = ctypes.c_void_p()
        _check(lib.cuModuleLoadData(ctypes.byref(self.module), self._image), f"loading the cubin of {name}")
        self.fn = ctypes.c_void_p()
        _check(lib.cuModuleGetFunction(ctypes.byref(self.fn), self.module, name.encode()), f"finding {name}")
        if self.smem > 48 * 1024:  # above the default 48 KB a kernel must opt in
            _check(lib.cuFuncSetAttribute(self.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem),
                   f"setting {self.smem} B of shared memory on {name}")

    def launch(self, args: list, stream: int | None = None, grid=None) -> None:
        """args: ctypes values in the kernel's parameter order; on torch's current stream by default."""
        if stream is None:
            import torch

            stream = torch.cuda.current_stream().cuda_stream
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        g = self.grid if grid is None else tuple(grid) + (1,) * (3 - len(grid))
        if self.pdl and _PDL_HERE.get():
            cfg = LaunchConfig(*g, *self.block, self.smem, ctypes.c_void_p(stream), ctypes.pointer(self._attr), 1)
            _check(_lib().cuLaunchKernelEx(ctypes.byref(cfg), self.fn, ptrs, None), f"launching {self.name}")
            return
        _check(_lib().cuLaunchKernel(self.fn, *[ctypes.c_uint(x) for x in g], *[ctypes.c_uint(x) for x in self.block],
                                     ctypes.c_uint(self.smem), ctypes.c_void_p(stream), ptrs, None),
               f"launching {self.name}")


# ---- TMA tensor maps (their parameter type: runtime/tensor_map.py) -------------------------------
TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN = 128, 64


@functools.lru_cache(maxsize=4096)
def tensor_map(ctype: str, address: int):
    """The CUtensorMap of a "CUtensorMap {...}" parameter for a buffer at `address`, as a ctypes
    array at a 64-byte boundary (what the driver wants); launches copy its bytes."""
    spec = tensor_map_spec(ctype)
    if address % 16:
        raise CudaError(f"a TMA copy's buffer must be 16-byte aligned, got address {address:#x}")
    buf = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
    tm = (ctypes.c_uint8 * TENSOR_MAP_BYTES).from_buffer(buf, -ctypes.addressof(buf) % TENSOR_MAP_ALIGN)
    r = len(spec["dims"])
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    _check(_lib().cuTensorMapEncodeTiled(
        ctypes.byref(tm), ctypes.c_int(spec["dtype"]), u32(r), ctypes.c_void_p(address),
        (u64 * r)(*spec["dims"]), (u64 * max(r - 1, 1))(*spec["strides"]), (u32 * r)(*spec["box"]),
        (u32 * r)(*spec["elem_strides"]), ctypes.c_int(spec["interleave"]), ctypes.c_int(spec["swizzle"]),
        ctypes.c_int(spec["l2"]), ctypes.c_int(spec["oob"])), f"encoding the tensor map of {spec['buffer']}")
    return tm


def c_arg(ctype: str, value):
    """A kernel argument as the ctypes value its parameter type wants."""
    if ctype.startswith(TENSOR_MAP):
        return tensor_map(ctype, value.data_ptr())
    if ctype.endswith("*"):
        return ctypes.c_uint64(value.data_ptr() if hasattr(value, "data_ptr") else int(value))
    if ctype in ("int", "int32_t", "i32"):
        return ctypes.c_int32(int(value))
    if ctype in ("int64_t", "long", "i64"):
        return ctypes.c_int64(int(value))
    if ctype in ("float", "fp32"):
        return ctypes.c_float(float(value))
    raise CudaError(f"kernel parameter type {ctype!r} is not supported")
