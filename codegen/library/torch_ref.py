"""The cpu target: every op runs its torch reference semantics (the plan executor calls the op's
`ref` directly); the rendered source names the op so the plan is self-describing."""
from __future__ import annotations

from ...ir.registry import all_ops
from ..template import KernelSource, Template, register


def _render(target, spec, config):
    return KernelSource(language="torch", entry=f"deepinfer.ir.ops:{spec.op}",
                        text=f"# torch reference of `{spec.op}`\n")


register(Template(
    name="torch_ref",
    ops=tuple(all_ops()),
    targets=("cpu",),
    knobs={},
    render=_render,
    default_config=lambda target, spec: {},
))
