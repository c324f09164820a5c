"""The cpu target: every op runs its torch reference semantics (the plan executor calls the op's
`ref` directly); the rendered source names the op so the plan is self-describing."""
from __future__ import annotations

from ...ir.registry import all_ops
from ..targets import building
from ..template import KernelSource, Template, register


def render_reference(target, spec, config):
    return KernelSource(language="torch", entry=f"deepinfer.ir.ops:{spec.op}",
                        text=f"# torch reference of `{spec.op}` on {target.name}\n")


def reference_template(name: str, targets: tuple[str, ...]) -> Template:
    return Template(name=name, ops=tuple(all_ops()), targets=targets, knobs={}, render=render_reference,
                    default_config=lambda target, spec: {})


register(reference_template("torch_ref", building("torch")))
