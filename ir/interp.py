"""The graph interpreter: evaluates a graph on torch tensors with each op's reference semantics.

It is the semantic ground truth below the plan: every pass must keep its output, and every
kernel template is checked against the same reference functions. Size symbols are bound from the
shapes of the inputs and state; every produced value is checked against its declared type.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from . import shapes as sh
from .graph import Graph
from .quant import QTensor
from .registry import get_op
from .types import QuantType, TensorType


class InterpretError(RuntimeError):
    pass


def _check(name: str, t, value, env: dict, bind: bool) -> None:
    if isinstance(t, QuantType):
        if not isinstance(value, QTensor):
            raise InterpretError(f"%{name}: expected a quantised tensor (data, scale), got {type(value).__name__}")
        _check(name + ".data", t.data, value.data, env, bind)
        _check(name + ".scale", t.scale, value.scale, env, bind)
        return
    assert isinstance(t, TensorType)
    if not isinstance(value, torch.Tensor):
        raise InterpretError(f"%{name}: expected a tensor, got {type(value).__name__}")
    storage = t.dtype.storage
    ok_dtypes = {storage, torch.int8} if t.dtype.name == "fp4e2m1" else {storage}
    if value.dtype not in ok_dtypes:
        raise InterpretError(f"%{name}: expected {t.dtype} (torch {storage}), got {value.dtype}")
    want = t.storage_shape()
    try:
        if bind:
            sh.bind(want, tuple(value.shape), env, f"%{name}")
        else:
            got = sh.evaluate(want, env)
            if tuple(value.shape) != got:
                raise InterpretError(f"%{name}: expected shape {list(got)}, got {list(value.shape)}")
    except ValueError as e:
        raise InterpretError(str(e)) from None


def interpret(g: Graph, inputs: Mapping[str, Any], params: Mapping[str, Any],
              state: Mapping[str, Any] | None = None, *, check: bool = True, trace: dict | None = None):
    """Run one step. Returns (outputs by name, new state by name, bound size symbols).

    `trace`, when given, receives every value by name (for locating where two runs diverge)."""
    state = state or {}
    env: dict[str, int] = {}
    vals: dict[str, Any] = {}
    for kind, names, given in (("input", g.inputs, inputs), ("param", g.params, params),
                               ("state", g.state, state)):
        missing = [n for n in names if n not in given]
        if missing:
            raise InterpretError(f"missing {kind}(s): {', '.join('%' + m for m in missing[:5])}"
                                 + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        for n in names:
            if check:
                _check(n, g.types[n], given[n], env, bind=True)
            vals[n] = given[n]
    for node in g.nodes:
        opdef = get_op(node.op)
        try:
            out = opdef.ref(*(vals[i] for i in node.inputs), **opdef.check_attrs(node.attr))
        except InterpretError:
            raise
        except Exception as e:
            raise InterpretError(f"node {node.name}: {type(e).__name__}: {e}") from e
        outs = out if isinstance(out, tuple) and not isinstance(out, QTensor) else (out,)
        if len(outs) != len(node.outputs):
            raise InterpretError(f"node {node.name}: reference returned {len(outs)} values, "
                                 f"expected {len(node.outputs)}")
        for name, v in zip(node.outputs, outs):
            if check:
                _check(name, g.types[name], v, env, bind=False)
            vals[name] = v
    new_state = dict(state)
    for root, v in g.state_updates().items():
        new_state[root] = vals[v]
    if trace is not None:
        trace.update(vals)
    return {o: vals[o] for o in g.outputs}, new_state, env
