"""Host recipes: the host work around a generated kernel, recorded as data for the plan.

A template's host side (a TileLang template's `host`, a Triton template's launcher) allocates the
op's outputs, pads, casts and views the operands, and launches the instance's kernels. That code
is the compiler's. At compile time it runs once per (call, bucket) on meta tensors with the call's
static shapes and strides, under a dispatch mode that records every aten op it makes and every
launch (kernel, grid, arguments in parameter order). The record is the call's host recipe in
plan.json; runtime/host_recipe.py replays it with the plan's cubins, so the serving side needs no
compiler code and does exactly what the host code did at that shape.

Meta tensors are the call's runtime values. A real tensor that flows into a recorded op is a
constant (RoPE frequencies, hash primes): its values go into the recipe. Ops on real tensors
alone (computing such a constant) are not recorded.

Recipe (JSON):
    inputs   per op input: [slot] or [data slot, scale slot] (quantised), or null (absent)
    strides  per input slot: the strides it was recorded with (the runtime checks them once)
    consts   slot -> {dtype, shape, values}
    steps    {"op": "aten.<name>.<overload>", "args", "kwargs", "out": [slots]}
             {"launch": kernel index, "grid": [..], "args": [{"t": slot} | scalar], "ctypes": [..],
              "aligned": [indices of pointer arguments the kernel was built to take 16-byte aligned]}
    outputs  per op output: [slot] or [data slot, scale slot]
Arguments: {"t": slot} a tensor; {"dtype"|"layout"|"memory_format": name}; {"device": 0} the
runtime's device; {"float": "inf"} a non-finite float; lists, numbers, strings and null as is.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..ir.quant import QTensor
from ..runtime.tensor_map import tensor_map_mismatch, tensor_map_spec

MAX_CONST_ELEMENTS = 1 << 16  # a constant is a handful of values; a larger one is a bug in a host


class RecipeError(ValueError):
    pass


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.slots: dict[int, int] = {}  # id(tensor) -> slot
        self.keep: list[torch.Tensor] = []  # the recorded tensors stay alive, so ids stay unique
        self.steps: list[dict] = []
        self.consts: dict[int, dict] = {}
        self.n = 0

    def new_slot(self, t: torch.Tensor) -> int:
        s = self.n
        self.n += 1
        self.slots[id(t)] = s
        self.keep.append(t)
        return s

    def slot_of(self, t: torch.Tensor) -> int:
        s = self.slots.get(id(t))
        if s is not None:
            return s
        if t.device.type == "meta":
            raise RecipeError(f"a host used a meta tensor {tuple(t.shape)} that no input or recorded op made")
        if t.numel() > MAX_CONST_ELEMENTS:
            raise RecipeError(f"a host made a constant of {t.numel()} elements")
        s = self.new_slot(t)
        c = t.detach().cpu().contiguous()
        values = c.reshape(-1).tolist()
        self.consts[s] = {"dtype": str(c.dtype).removeprefix("torch."), "shape": list(c.shape),
                          "values": [_num(v) for v in values]}
        return s

    def encode(self, x):
        if isinstance(x, torch.Tensor):
            return {"t": self.slot_of(x)}
        if isinstance(x, (list, tuple)):
            return [self.encode(v) for v in x]
        if isinstance(x, torch.dtype):
            return {"dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"device": 0}
        if isinstance(x, torch.layout):
            return {"layout": str(x).removeprefix("torch.")}
        if isinstance(x, torch.memory_format):
            return {"memory_format": str(x).removeprefix("torch.")}
        if isinstance(x, float):
            return _num(x)
        if x is None or isinstance(x, (bool, int, str)):
            return x
        raise RecipeError(f"a host passed {type(x).__name__} to an aten op; recipes hold tensors, numbers and names")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not any(t.device.type == "meta" for t in ins + outs):
            return out  # work on real tensors only: a constant being computed
        if func is torch.ops.aten.detach.default and id(args[0]) in self.slots:
            # factories under a device context detach their result: the same storage, no step
            self.slots[id(out)] = self.slots[id(args[0])]
            self.keep.append(out)
            return out
        if func is torch.ops.aten._to_copy.default and ins[0].device.type != "meta" and len(ins) == 1:
            # a constant copied to the device: the recipe holds it on the device already
            const = args[0].to(dtype=kwargs.get("dtype") or args[0].dtype)
            self.slots[id(out)] = self.slot_of(const)
            self.keep.append(out)
            return out
        step = {"op": f"aten.{func._schema.name.split('::')[1]}.{func._overloadname}",
                "args": self.encode(list(args)), "kwargs": {k: self.encode(v) for k, v in kwargs.items()}}
        # an op that returns an input (in-place ops) keeps that input's slot
        step["out"] = [self.slots[id(t)] if id(t) in self.slots else self.new_slot(t) for t in outs]
        self.steps.append(step)
        return out

    def launch(self, index: int, grid, args: list, ctypes: list[str], aligned: list[int] = ()) -> None:
        enc = []
        for a in args:
            if isinstance(a, torch.Tensor):
                enc.append({"t": self.slot_of(a)})
            elif isinstance(a, (bool, int, float)):
                enc.append(_num(a) if isinstance(a, float) else int(a))
            else:
                raise RecipeError(f"kernel argument of type {type(a).__name__}")
        step = {"launch": index, "grid": [int(g) for g in grid], "args": enc, "ctypes": list(ctypes)}
        if aligned:
            step["aligned"] = list(aligned)
        self.steps.append(step)


def _num(v):
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}
    return v


def _input_parts(v):
    if v is None:
        return []
    if isinstance(v, QTensor):
        return [v.data, v.scale]
    return [v]


def record(host: Callable[[_Recorder], Any], inputs: list, quantised: list[bool]) -> tuple[dict, tuple]:
    """Run `host(recorder)` (which calls the host code on `inputs` and returns the op's outputs,
    `quantised[i]` saying whether output i is a QTensor) under the recorder; returns (recipe, the
    outputs as meta values)."""
    rec = _Recorder()
    enc_inputs, strides = [], []
    for v in inputs:
        parts = _input_parts(v)
        if v is None:
            enc_inputs.append(None)
            continue
        enc_inputs.append([rec.new_slot(p) for p in parts])
        strides.extend([list(p.stride()) for p in parts])
    with rec:
        out = host(rec)
    # one value per op output: Triton launchers return a quantised output as its (data, scale)
    # pair, TileLang hosts as a QTensor
    flat = list(out) if isinstance(out, tuple) and not isinstance(out, QTensor) else [out]
    outputs, values = [], []
    for q in quantised:
        v = flat.pop(0) if flat else None
        if q and not isinstance(v, QTensor):
            v = QTensor(v, flat.pop(0) if flat else None)
        if v is None or (isinstance(v, QTensor) and v.scale is None):
            raise RecipeError(f"the host returned fewer values than the op's {len(quantised)} outputs")
        outputs.append([rec.slot_of(v.data), rec.slot_of(v.scale)] if q else [rec.slot_of(v)])
        values.append(v)
    if flat:
        raise RecipeError(f"the host returned {len(flat)} values more than the op's {len(quantised)} outputs")
    recipe = {"inputs": enc_inputs, "strides": strides, "consts": {str(k): v for k, v in rec.consts.items()},
              "steps": rec.steps, "outputs": outputs}
    return recipe, tuple(values)


# ---- the two kinds of host code -------------------------------------------------------------------

def record_tilelang(host: Callable, kernel: dict, inputs: list, attrs: dict, quantised: list[bool]) -> tuple[dict, tuple]:
    """A TileLang template's host(launch, inputs, attrs, config, meta): its `launch(i, **buffers)`
    binds buffers by the i-th kernel's parameter names, recorded in parameter order."""
    params = [kernel["meta"]["params"]]
    if "combine" in kernel["meta"]:
        params.append(kernel["meta"]["combine"]["params"])
    grids = [kernel["grid"]] + ([kernel["meta"]["combine"]["grid"]] if "combine" in kernel["meta"] else [])

    def run(rec: _Recorder):
        def launch(i: int, **buffers):
            args, aligned = [], []
            for j, (name, ct) in enumerate(params[i]):
                tmap = tensor_map_spec(ct)  # a TMA copy's map: bound to the buffer it maps
                key = tmap["buffer"] if tmap else name
                if key not in buffers:
                    raise RecipeError(f"kernel {i} of {kernel['template']} wants buffer {key}, the host gave "
                                      f"{', '.join(buffers)}")
                v = buffers[key]
                if isinstance(v, torch.Tensor) and not v.is_contiguous():
                    raise RecipeError(f"{kernel['template']}: buffer {key} is not contiguous")
                if tmap:
                    bad = tensor_map_mismatch(tmap, v.shape, v.stride(), v.element_size())
                    if bad:
                        raise RecipeError(f"{kernel['template']}: buffer {key} for {name}: {bad}")
                    aligned.append(j)
                args.append(v)
            rec.launch(i, grids[i], args, [ct for _, ct in params[i]], aligned)
        return host(launch, tuple(inputs), attrs, kernel["config"], kernel["meta"])
    return record(run, inputs, quantised)


class _TritonLaunches:
    """Stands for a plan's Triton cubins while a launcher runs: each `_k(kernel)[grid](...)` is
    matched to the instance's launches (kernel name and constexprs) and recorded."""

    def __init__(self, rec: _Recorder, kernel: dict):
        self.rec, self.kernel = rec, kernel

    def bind(self, fn):
        name = getattr(fn, "__name__", None) or fn.fn.__name__
        return _TritonKernel(self, fn, name)


class _TritonKernel:
    def __init__(self, owner: _TritonLaunches, fn, name: str):
        self.owner, self.fn, self.name = owner, fn, name

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launch(tuple(int(g) for g in grid), args, kw)

    def launch(self, grid, args, kw):
        launches = self.owner.kernel["meta"]["kernels"]
        for i, ln in enumerate(launches):
            if ln["entry"] == self.name and all(kw.get(k) == v for k, v in ln["constexprs"].items()):
                break
        else:
            raise RecipeError(f"{self.owner.kernel['template']}: the launcher ran {self.name} with "
                              f"{ {k: v for k, v in kw.items() if not k.startswith('num_')} }, which was not rendered")
        if list(grid) != list(ln["grid"]):
            raise RecipeError(f"{self.owner.kernel['template']}: {self.name} launched over grid {list(grid)}, "
                              f"rendered for {ln['grid']}")
        values = dict(zip(self.fn.arg_names, args))
        values.update(kw)
        names = [a for a in self.fn.arg_names if ln["signature"][a] != "constexpr"]
        # pointers the build took as 16-byte aligned (Launch.aligned): the runtime checks them
        self.owner.rec.launch(i, grid, [values[a] for a in names],
                              ["*" if ln["signature"][a].startswith("*") else ln["signature"][a] for a in names],
                              [j for j, a in enumerate(names) if a in ln.get("aligned", ())])


def record_triton(launcher: Callable, kernel: dict, inputs: list, quantised: list[bool]) -> tuple[dict, tuple]:
    from .library.triton_launchers import aot_kernels

    meta = kernel["meta"]

    def run(rec: _Recorder):
        with aot_kernels(_TritonLaunches(rec, kernel)):
            return launcher(*inputs, **meta["launch_attrs"], cfg=meta["config"])
    return record(run, inputs, quantised)


# ---- every call of a compiled graph -------------------------------------------------------------

def meta_value(t):
    """An empty meta tensor (a QTensor for a quantised type) of a static IR type."""
    from ..ir import shapes as sh

    def one(tt):
        return torch.empty(sh.evaluate(tt.storage_shape(), {}), dtype=tt.dtype.storage, device="meta")
    return QTensor(one(t.data), one(t.scale)) if hasattr(t, "scale") else one(t)


def _layout(v):
    """What a host's behaviour can depend on in an input: shapes, strides and dtypes (meta tensors
    have no values), or the value itself for a non-tensor."""
    if isinstance(v, QTensor):
        return (_layout(v.data), _layout(v.scale))
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), str(v.dtype))
    return repr(v)


def _like(v):
    if isinstance(v, QTensor):
        return QTensor(_like(v.data), _like(v.scale))
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


def _as_outputs(out, n: int) -> tuple:
    outs = out if isinstance(out, tuple) and not isinstance(out, QTensor) else (out,)
    if len(outs) != n:
        raise RecipeError(f"returned {len(outs)} values for {n} outputs")
    return tuple(outs)


def host_recipes(g, calls: list[dict], envs: dict[str, dict], kernels: dict, recipes: dict) -> None:
    """Record the host recipe of every generated call of `calls` (the plan's call list of graph
    `g`) in every bucket of `envs`, into `call["launch"][bucket]["recipe"]`; identical recipes are
    stored once in `recipes`. Each bucket is run abstractly on meta tensors in call order, the
    references and views included, so every call is recorded with the strides its inputs will
    have at run time."""
    import json

    from ..ir.registry import get_op
    from .library import triton_launchers
    from .template import templates

    recorded = {i for i, k in kernels.items() if k.get("language") in ("cuda", "triton")}
    if not any(ln.get("kernel") in recorded for c in calls for ln in c["launch"].values()):
        return  # no call replays a recipe (cpu plans, ascend950 sources): nothing to run abstractly
    index = {json.dumps(r, sort_keys=True): rid for rid, r in recipes.items()}
    # the layers repeat one another: a call with the op, attributes, instance and input layouts of
    # one already run has the same recipe and outputs, so each is recorded once
    memo: dict = {}
    for bucket, env in envs.items():
        vals: dict = {}

        def value(v):
            if v not in vals:
                vals[v] = meta_value(g.types[v].subs(env))
            return vals[v]
        with torch.device("meta"):
            for call in calls:
                launch = call["launch"].get(bucket, {})
                inst = launch.get("kernel")
                k = kernels.get(inst) if inst else None
                xs = [value(v) for v in call["inputs"]]
                op = get_op(call["op"])
                attrs = op.check_attrs(call["attrs"])
                where = f"{call['op']} ({call['outputs'][0]}) in {bucket}"
                quantised = [hasattr(g.types[o], "scale") for o in call["outputs"]]
                key = (call["op"], json.dumps(call["attrs"], sort_keys=True, default=str), inst if k else None,
                       tuple(_layout(x) for x in xs))
                if key in memo:
                    rid, outs = memo[key]
                    if rid is not None:
                        launch["recipe"] = rid
                    # fresh tensors of the same layouts: a recording keys its slots by tensor
                    # identity, and two calls' outputs are never one tensor
                    vals.update(zip(call["outputs"], (_like(o) for o in outs)))
                    continue
                try:
                    if k is not None and k["language"] == "cuda":
                        rec, outs = record_tilelang(templates()[k["template"]].host, k, xs, attrs, quantised)
                    elif k is not None and k["language"] == "triton":
                        launcher = getattr(triton_launchers, k["meta"]["launcher"])
                        rec, outs = record_triton(launcher, k, xs, quantised)
                    else:
                        rec = None
                        try:
                            outs = _as_outputs(op.ref(*xs, **attrs), len(call["outputs"]))
                        except Exception:  # noqa: BLE001  (a reference that cannot run on meta: its declared types)
                            outs = tuple(meta_value(g.types[o].subs(env)) for o in call["outputs"])
                except RecipeError as e:
                    raise RecipeError(f"{where}: {e}") from None
                rid = None
                if rec is not None:
                    text = json.dumps(rec, sort_keys=True)
                    if text not in index:
                        index[text] = f"r{len(recipes):05d}"
                        recipes[index[text]] = rec
                    rid = launch["recipe"] = index[text]
                memo[key] = (rid, outs)
                vals.update(zip(call["outputs"], outs))
