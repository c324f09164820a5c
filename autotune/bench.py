"""Timing one instance's candidates on the GPU machine, with no compiler: each candidate runs
through the runtime's own launch path (its cubins loaded through the driver,
runtime/cuda_executor.load_instance, and its host recipe replayed, runtime/host_recipe.py), the
way a plan runs the instance.

Per instance (once per worker process, autotune/measure.py): the check inputs and the op's
reference on them (run on the device, fp64 as the op pins), and one input set per repeat set,
each made fresh from the instance's spec by the check's input makers
(codegen/library/triton_check.spec_case). Per candidate: its outputs on the check inputs against
the reference by the per-output rules (triton_check.judge); only a candidate that passes is
timed: per repeat set a warm-up, then per repeat an L2 flush and a head start for the host
(a device sleep while the host queues the call), CUDA events around the call. The timings are
the repeats of all sets together: p20, p50, p80 in microseconds.
"""
from __future__ import annotations

import time
from pathlib import Path

from .tuner import parse_spec


def summarize(us: list[float]) -> dict:
    """p20 / p50 / p80 (nearest rank) of per-call microseconds, and how many there were."""
    s = sorted(us)
    if not s:
        raise ValueError("no timings")

    def q(f):
        return s[min(len(s) - 1, round(f * (len(s) - 1)))]
    return {"p20": q(0.2), "p50": q(0.5), "p80": q(0.8), "repeats": len(s)}


DEFAULTS = {"sets": 5, "repeats": 20, "warmup": 3}


class Bench:
    """One instance's candidates on one device (see the module docstring). A subclass stands in
    for the GPU in tests by overriding `device_type`, `device_info`, `load` and `time`."""

    device_type = "cuda"

    def __init__(self, root, inst: str, entry: dict, settings: dict):
        import torch

        from ..codegen.library.triton_check import spec_case
        from ..ir.registry import get_op

        self.root, self.inst, self.entry = Path(root), inst, entry
        self.s = dict(DEFAULTS, **settings)
        spec = parse_spec(entry["spec"])
        self.op, self.template = spec.op, entry["template"]
        self.device = torch.device(self.device_type, 0) if self.device_type == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.check_inputs, self.attrs = spec_case(spec.op, spec.in_types, spec.attr, self.device, seed=0)
        with torch.device(self.device):
            ref = get_op(spec.op).ref(*[_clone(v) for v in self.check_inputs], **self.attrs)
        self.ref = _cpu(ref)
        self.ref_inputs = [_cpu(v) for v in self.check_inputs[:3]]
        # fresh inputs per repeat set: no timing leans on one draw of data-dependent work (routing,
        # top-k lists, positions) or on values left in a cache
        self.sets = [spec_case(spec.op, spec.in_types, spec.attr, self.device, seed=1 + i)[0]
                     for i in range(self.s["sets"])]
        if self.device.type == "cuda":
            l2 = torch.cuda.get_device_properties(self.device).L2_cache_size
            self.flush = torch.empty(max(2 * l2, 64 << 20), dtype=torch.uint8, device=self.device)

    @staticmethod
    def device_info() -> dict:
        """What a measurement on this machine's GPU 0 is recorded with (autotune/tuner.on_device)."""
        import torch

        from ..runtime.cuda_driver import driver_version

        props = torch.cuda.get_device_properties(0)
        return {"name": props.name, "cores": props.multi_processor_count, "driver": driver_version(),
                "runtime": torch.version.cuda, "capability": f"{props.major}.{props.minor}"}

    def load(self, cand: dict):
        """The candidate as a function of the op's inputs: its host recipe over its cubins (whose
        hashes the parent checked before it handed the candidate over)."""
        from ..runtime.cuda_driver import c_arg
        from ..runtime.cuda_executor import load_instance
        from ..runtime.host_recipe import HostRecipe

        kernels = load_instance(self.root, f"{self.inst}/{cand['id']}", cand["kernel"], self.device.index)
        return HostRecipe(cand["recipe"], kernels.launch, self.device, f"{self.template} {self.inst}/{cand['id']}",
                          c_arg)

    def run(self, cand: dict) -> dict:
        """{"status": "ok", "timings", "check"} or {"status": "wrong", "why"}; raises for a
        candidate that fails to load or run."""
        from ..codegen.library.triton_check import judge

        fn = self.load(cand)
        recipe = cand.get("recipe")
        got = fn(*as_recorded([_clone(v) for v in self.check_inputs], recipe))
        self._sync()
        ok, why = judge(self.op, self.template, _cpu(got), self.ref, self.ref_inputs, self.attrs)
        if not ok:
            return {"status": "wrong", "why": why}
        us = []
        for xs in self.sets:
            us += self.time(fn, as_recorded(xs, recipe), cand)
        return {"status": "ok", "timings": summarize(us), "check": why}

    def time(self, fn, xs: list, cand: dict) -> list[float]:
        """Microseconds of each repeat of `fn(*xs)` by the device's clock."""
        import torch

        for _ in range(self.s["warmup"]):
            fn(*xs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*xs)
        host_s = time.perf_counter() - t  # the host's time to queue one call (recipe steps, launches)
        torch.cuda.synchronize()
        # the device sleeps while the host queues the call, so the events time the call's kernels
        # back to back, as in a CUDA graph; ~2 GHz cycles, twice the host's time, 100 us at least
        cycles = int(max(2 * host_s, 100e-6) * 2e9)
        events = []
        for _ in range(self.s["repeats"]):
            self.flush.zero_()  # the L2 cache holds no input of the previous repeat
            torch.cuda._sleep(cycles)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(*xs)
            b.record()
            events.append((a, b))
        torch.cuda.synchronize()
        return [a.elapsed_time(b) * 1e3 for a, b in events]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize()


def as_recorded(values: list, recipe: dict | None) -> list:
    """The inputs with the strides their recipe was recorded with (a recipe checks them): a copy
    into a tensor of those strides where they differ."""
    if not recipe:
        return values
    from ..ir.quant import QTensor

    strides = iter(recipe["strides"])
    out = []
    for v, part in zip(values, recipe["inputs"]):
        if part is None:
            out.append(v)
        elif isinstance(v, QTensor):
            out.append(QTensor(_restride(v.data, next(strides)), _restride(v.scale, next(strides))))
        else:
            out.append(_restride(v, next(strides)))
    return out


def _restride(t, stride):
    import torch

    if tuple(t.stride()) == tuple(stride):
        return t
    x = torch.empty_strided(t.shape, tuple(stride), dtype=t.dtype, device=t.device)
    x.copy_(t)
    return x


def _clone(v):
    from ..codegen.library.triton_check import clone_value

    return clone_value(v)


def _cpu(v):
    import torch

    from ..ir.quant import QTensor

    if isinstance(v, QTensor):
        return QTensor(v.data.cpu(), v.scale.cpu())
    if isinstance(v, tuple):
        return tuple(_cpu(x) for x in v)
    return v.cpu() if isinstance(v, torch.Tensor) else v
