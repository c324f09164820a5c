"""The last resort on device targets: an op no generated template covers yet runs its torch
reference on the device's tensors. Kernel selection takes it only when nothing else supports the
call, and the compile summary and docs/kernels.md count these calls, so what is not a generated
kernel is visible."""
from __future__ import annotations

from ...ir.registry import all_ops
from ..template import KernelSource, Template, register


def _render(target, spec, config):
    return KernelSource(language="torch", entry=f"deepinfer.ir.ops:{spec.op}",
                        text=f"# torch reference of `{spec.op}` on {target.name}\n")


register(Template(
    name="torch_device",
    ops=tuple(all_ops()),
    targets=("sm90", "sm100", "ascend950"),
    knobs={},
    render=_render,
    default_config=lambda target, spec: {},
))
