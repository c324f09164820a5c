"""Replaying a call's host recipe (format: codegen/host_recipe.py, recorded at compile time): its
aten steps run as recorded with the runtime's device, and its launches go to the plan's kernels.

A recipe holds what the compiler's host code did at the call's static shapes, so this is all the
host work a generated call needs; the runtime imports no compiler code."""
from __future__ import annotations

import os

from typing import Callable

import torch

from ..ir.quant import QTensor
from .plan_file import PlanError

_NAMED = {
    "dtype": lambda v: getattr(torch, v),
    "layout": lambda v: getattr(torch, v),
    "memory_format": lambda v: getattr(torch, v),
    "float": float,
}


class _Slot:
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _decode(x, device):
    """JSON argument -> a Python value, tensors as _Slot placeholders."""
    if isinstance(x, list):
        return [_decode(v, device) for v in x]
    if isinstance(x, dict):
        if "t" in x:
            return _Slot(x["t"])
        if "device" in x:
            return device
        (k, v), = x.items()
        if k not in _NAMED:
            raise PlanError(f"host recipe argument {x!r} is not one this runtime knows")
        return _NAMED[k](v)
    return x


def _has_slot(x) -> bool:
    return isinstance(x, _Slot) or (isinstance(x, list) and any(_has_slot(v) for v in x))


def _bind(x, slots):
    if isinstance(x, _Slot):
        return slots[x.i]
    if isinstance(x, list):
        return [_bind(v, slots) for v in x]
    return x


def _aten(name: str):
    _, op, overload = name.split(".")
    try:
        return getattr(getattr(torch.ops.aten, op), overload)
    except AttributeError:
        raise PlanError(f"host recipe step {name} is not an aten op of this torch ({torch.__version__})") from None


def _poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point and t.element_size() > 1:
        t.fill_(float("nan"))
    elif t.element_size() == 1:
        t.view(torch.uint8).fill_(0xFF)


class HostRecipe:
    """One recipe bound to a device and its kernels: `launch(i, grid, args)` runs the instance's
    i-th kernel with `args` (ctypes values in parameter order)."""

    def __init__(self, recipe: dict, launch: Callable[[int, list, list], None], device: torch.device, what: str,
                 c_arg: Callable | None = None):
        self.what, self.launch = what, launch
        self.inputs = recipe["inputs"]
        self.strides = [tuple(s) for s in recipe["strides"]]
        self.outputs = recipe["outputs"]
        n = 1 + max([s for part in self.inputs if part for s in part]
                    + [s for st in recipe["steps"] for s in st.get("out", [])]
                    + [int(k) for k in recipe["consts"]], default=-1)
        self.consts = {}
        for k, c in recipe["consts"].items():
            t = torch.tensor(c["values"], dtype=getattr(torch, c["dtype"])).reshape(c["shape"])
            self.consts[int(k)] = t.to(device)
        self.n = n
        self.steps = []
        for st in recipe["steps"]:
            if "launch" in st:
                args = [_decode(a, device) for a in st["args"]]
                self.steps.append((None, st["launch"], st["grid"], (args, st["ctypes"], st.get("aligned", ())), None))
            else:
                args = _decode(st["args"], device)
                kwargs = {k: _decode(v, device) for k, v in st["kwargs"].items()}
                self.steps.append((_aten(st["op"]), None, None, (args, kwargs, _has_slot(kwargs)), st["out"]))
        self.c_arg = c_arg or (lambda ctype, v: v)
        self.checked = False
        # DEEPINFER_POISON=1 (debugging): every buffer a recipe allocates starts as NaN (floats;
        # 0xFF bytes for fp8 codes and scales), so a kernel that reads what no call wrote shows
        self.poison = {i for i, st in enumerate(recipe["steps"]) if "op" in st and st["op"].startswith(("aten.empty",
                       "aten.new_empty"))} if os.environ.get("DEEPINFER_POISON") == "1" else set()

    def _check_strides(self, slots) -> None:
        i = 0
        for part in self.inputs:
            for s in part or ():
                got = tuple(slots[s].stride())
                if got != self.strides[i]:
                    raise PlanError(f"{self.what}: input strides {got}, the plan recorded {self.strides[i]}")
                i += 1
        self.checked = True

    def __call__(self, *xs):
        slots = [None] * self.n
        for k, t in self.consts.items():
            slots[k] = t
        for part, x in zip(self.inputs, xs):
            if part is None:
                continue
            if len(part) == 2:
                slots[part[0]], slots[part[1]] = x.data, x.scale
            else:
                slots[part[0]] = x
        if not self.checked:
            self._check_strides(slots)
        for i, (fn, k, grid, args, outs) in enumerate(self.steps):
            if fn is None:
                vals, ctypes, aligned = args
                vals = _bind(vals, slots)
                for j in aligned:
                    if vals[j].data_ptr() % 16:
                        raise PlanError(f"{self.what}: kernel {k} was built for a 16-byte aligned argument {j}, "
                                        f"got address {vals[j].data_ptr():#x}")
                self.launch(k, grid, [self.c_arg(ct, v) for ct, v in zip(ctypes, vals)])
                continue
            a, kw, kw_slots = args
            res = fn(*_bind(a, slots), **({k2: _bind(v, slots) for k2, v in kw.items()} if kw_slots else kw))
            if i in self.poison and isinstance(res, torch.Tensor):
                _poison(res)
            if len(outs) == 1:
                slots[outs[0]] = res if isinstance(res, torch.Tensor) else res[0]
            elif outs:
                for s, t in zip(outs, [r for r in res if isinstance(r, torch.Tensor)]):
                    slots[s] = t
        return tuple(QTensor(slots[o[0]], slots[o[1]]) if len(o) == 2 else slots[o[0]] for o in self.outputs)
