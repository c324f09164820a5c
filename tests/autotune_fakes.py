"""A stand-in for the GPU in the measured autotuner's tests (tests/test_autotune.py), imported by
the measuring worker process (autotune/measure.py) in place of autotune/bench.Bench.

It keeps everything of the real bench but the device: the instance's inputs come from the check's
input makers, each candidate runs its own host recipe from the manifest (runtime/host_recipe.py),
and its outputs are judged against the op's reference by triton_check's rules. Its kernels are the
Triton JIT functions its launches name, under the interpreter (the worker runs with
TRITON_INTERPRET=1), instead of its cubins; its time is the settings' number for it (or one made
from its config) instead of CUDA events. The settings' "act" makes a candidate misbehave the ways
a GPU candidate can: raise, hang, crash the process, or compute a wrong result."""
import os
import signal
import time

import torch

from deepinfer.autotune.bench import Bench


class InterpretedBench(Bench):
    device_type = "cpu"

    @staticmethod
    def device_info() -> dict:
        return {"name": "FAKE H200", "cores": 132, "driver": "13.0", "runtime": "13.0"}

    def load(self, cand: dict):
        from deepinfer.codegen.library import triton_kernels
        from deepinfer.runtime.host_recipe import HostRecipe

        act = self.s.get("act", {}).get(cand["id"])
        if act == "raise":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if act == "hang":
            time.sleep(3600)
        if act == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        launches = cand["kernel"]["meta"]["kernels"]

        def launch(i, grid, args):
            ln = launches[i]
            fn = getattr(triton_kernels, ln["entry"])
            names = [a for a in fn.arg_names if ln["signature"][a] != "constexpr"]
            fn[tuple(grid)](**dict(zip(names, args)), **ln["constexprs"], num_warps=ln["num_warps"])

        recipe = HostRecipe(cand["recipe"], launch, torch.device("cpu"), f"{self.inst}/{cand['id']}")
        if act == "wrong":
            return lambda *xs: tuple(o * 1.5 for o in recipe(*xs))
        return recipe

    def time(self, fn, xs, cand: dict) -> list[float]:
        fn(*xs)
        cfg = cand["config"]
        us = self.s.get("us", {}).get(cand["id"], 3.0 + cfg.get("num_warps", 4) / 8 + cfg.get("num_stages", 1))
        return [us * f for f in (0.9, 1.0, 1.0, 1.1)][: self.s["repeats"]]
