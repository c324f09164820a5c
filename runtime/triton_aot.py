"""Launching a plan's ahead-of-time Triton cubins through the templates' own host launchers.

A Triton template's host side is its launcher in `codegen/library/triton_launchers.py` (it allocates
the outputs and launches one or more kernels). Inside `aot_kernels(provider)` a launcher's
`_k(kernel)[grid](...)` comes here instead of Triton's JIT: the launch is matched to the plan's
record of it (kernel name and specialisation), its grid checked against the one the plan was
built for, and the cubin launched through the CUDA driver. So the serving machine runs the
binaries the compile machine built, whatever Triton it has.

The parameter list is the one Triton's ahead-of-time compiler gives a kernel (checked against its
PTX, Triton 3.9): the non-constexpr arguments in declaration order, then the global-scratch and
profile-scratch pointers.
"""
from __future__ import annotations

import torch

from .cuda_driver import CubinFunction, CudaError, c_arg


class TritonAotCall:
    """The launches of one kernel instance of a plan, each with its cubin."""

    def __init__(self, inst: str, launches: list[dict], cubins: list[bytes], device: int = 0):
        self.inst, self.launches = inst, launches
        self.functions = [CubinFunction(cb, ln["metadata"]["name"], ln["grid"], (32 * ln["num_warps"],),
                                        ln["metadata"]["shared"], device) for ln, cb in zip(launches, cubins)]

    def bind(self, fn):
        return _Bound(self, fn)

    def find(self, name: str, kw: dict) -> int:
        for i, ln in enumerate(self.launches):
            if ln["entry"] == name and all(kw.get(k) == v for k, v in ln["constexprs"].items()):
                return i
        raise CudaError(f"instance {self.inst}: the launcher ran {name} with "
                        f"{ {k: v for k, v in kw.items() if not k.startswith('num_')} }, which the plan did not build")


class _Bound:
    def __init__(self, call: TritonAotCall, fn):
        self.call, self.fn = call, fn

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launch(tuple(int(g) for g in grid), args, kw)

    def launch(self, grid, args, kw):
        fn = self.fn
        name = getattr(fn, "__name__", None) or fn.fn.__name__
        i = self.call.find(name, kw)
        ln = self.call.launches[i]
        if list(grid) != list(ln["grid"]):
            raise CudaError(f"instance {self.call.inst}: {name} launched over grid {list(grid)}, built for {ln['grid']}")
        values = dict(zip(fn.arg_names, args))
        values.update(kw)
        for a in ln.get("aligned", ()):
            if values[a].data_ptr() % 16:
                raise CudaError(f"instance {self.call.inst}: {name} was built for a 16-byte aligned {a}, got "
                                f"address {values[a].data_ptr():#x}")
        params = []
        for a in fn.arg_names:
            ty = ln["signature"][a]
            if ty == "constexpr":
                continue
            params.append(c_arg("*" if ty.startswith("*") else ty, values[a]))
        md = ln["metadata"]
        keep = []
        for size_key in ("global_scratch_size", "profile_scratch_size"):
            size = int(md.get(size_key) or 0)
            if size:
                programs = grid[0] * (grid[1] if len(grid) > 1 else 1) * (grid[2] if len(grid) > 2 else 1)
                buf = torch.empty(size * programs, dtype=torch.uint8, device="cuda")
                keep.append(buf)
                params.append(c_arg("*", buf))
            else:
                params.append(c_arg("*", 0))
        self.call.functions[i].launch(params)
