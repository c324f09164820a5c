"""Launching a plan's ahead-of-time Triton cubins.

A Triton instance of a plan holds one cubin per kernel launch its launcher makes, with the
launch record of the build (kernel name, metadata). A host recipe names the launch by index, with
its grid and its arguments (the kernel's non-constexpr parameters in declaration order, with
their C types); the parameter list the ahead-of-time compiler gives a kernel is those arguments, then the
global-scratch and profile-scratch pointers (checked against its PTX, Triton 3.9). So the serving
machine runs the binaries the compile machine built, whatever Triton it has, or none.
"""
from __future__ import annotations

import torch

from .cuda_driver import CubinFunction, c_arg


class TritonKernels:
    """The launches of one kernel instance of a plan, each with its cubin."""

    def __init__(self, inst: str, launches: list[dict], cubins: list[bytes], device: int = 0, pdl: bool = False):
        self.inst, self.device = inst, device
        self.functions = [CubinFunction(cb, ln["metadata"]["name"], ln["grid"], (32 * ln["num_warps"],),
                                        ln["metadata"]["shared"], device, pdl) for ln, cb in zip(launches, cubins)]
        # scratch bytes per program, passed after the kernel's own arguments
        self.scratch = [[int(ln["metadata"].get(k) or 0) for k in ("global_scratch_size", "profile_scratch_size")]
                        for ln in launches]

    def launch(self, i: int, grid, args: list) -> None:
        """`args`: the kernel's own arguments as ctypes values, in declaration order."""
        params = list(args)
        keep = []
        programs = 1
        for g in grid:
            programs *= int(g)
        for size in self.scratch[i]:
            if size:
                buf = torch.empty(size * programs, dtype=torch.uint8, device=torch.device("cuda", self.device))
                keep.append(buf)
                params.append(c_arg("*", buf))
            else:
                params.append(c_arg("*", 0))
        self.functions[i].launch(params, grid=grid)
