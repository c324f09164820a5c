"""A device plan launches its Triton cubins through the templates' own host launchers: every
launch a launcher makes must be one the plan recorded and built (kernel, specialisation, grid).
Checked here without a GPU: the tiny model through the sm90 pipeline, every Triton call rendered
at a decode and a prefill bucket, its launcher run on zero tensors of the call's types with the
cubin launch itself stubbed out."""
import pytest
import torch

pytest.importorskip("triton")

from deepinfer.codegen.library import triton_launchers as tk  # noqa: E402
from deepinfer.codegen.targets import get_target  # noqa: E402
from deepinfer.codegen.template import select  # noqa: E402
from deepinfer.ir import shapes as sh  # noqa: E402
from deepinfer.ir.quant import QTensor  # noqa: E402
from deepinfer.ir.types import QuantType  # noqa: E402
from deepinfer.models.config import load_config  # noqa: E402
from deepinfer.models.deepseek_v41 import build_model  # noqa: E402
from deepinfer.passes.driver import run_pipeline  # noqa: E402
from deepinfer.passes.kernels import kernel_spec  # noqa: E402
from deepinfer.runtime import triton_aot  # noqa: E402
from deepinfer.runtime.plan_runner import as_outputs  # noqa: E402


class _NoLaunch:
    def __init__(self, *a, **k):
        pass

    def launch(self, *a, **k):
        pass


def _zeros(t, env):
    if isinstance(t, QuantType):
        return QTensor(_zeros(t.data, env), _zeros(t.scale, env))
    return torch.zeros(sh.evaluate(t.storage_shape(), env), dtype=t.dtype.storage)


def test_every_triton_launch_is_one_the_plan_built(monkeypatch):
    monkeypatch.setattr(triton_aot, "CubinFunction", _NoLaunch)
    target = get_target("sm90")
    g = run_pipeline(build_model(load_config("v4.1-flash-tiny")).step, "sm90")
    envs = [{"num_tokens": 4, "num_seqs": 4, "num_samples": 4, "max_pages": 4, "num_slots": 6, "num_pages": 9},
            {"num_tokens": 64, "num_seqs": 5, "num_samples": 5, "max_pages": 4, "num_slots": 6, "num_pages": 9}]
    checked, templates_seen = 0, set()
    for env in envs:
        for n in g.nodes:
            if n.attr.get("@kernel") in (None, "view"):
                continue
            types = {v: g.types[v].subs(env) for v in (*n.inputs, *n.outputs)}
            spec = kernel_spec(g, n, types)
            t = select(target, spec)
            if not t.name.startswith("triton_"):
                continue
            configs = [t.default_config(target, spec)]
            if t.name == "triton_hc_pre":  # its split-K variant launches two kernels
                configs.append(dict(configs[0], SPLIT=8))
            for cfg in configs:
                src = t.render(target, spec, cfg)
                launches = [dict(k, metadata={"name": k["entry"], "shared": 0}) for k in src.meta["kernels"]]
                call = triton_aot.TritonAotCall(n.name, launches, [b""] * len(launches))
                xs = [_zeros(types[v], env) for v in n.inputs]
                with tk.aot_kernels(call):
                    out = getattr(tk, src.meta["launcher"])(*xs, **src.meta["launch_attrs"], cfg=src.meta["config"])
                for v, name in zip(as_outputs(out, [types[o] for o in n.outputs]), n.outputs):  # as the node declares
                    want = _zeros(types[name], env)
                    for a, b in ((v.data, want.data), (v.scale, want.scale)) if isinstance(want, QTensor) else ((v, want),):
                        assert a.shape == b.shape and a.dtype == b.dtype, (n.name, name, a.shape, b.shape)
                checked += 1
            templates_seen.add(t.name)
    assert checked > 100 and len(templates_seen) >= 15, (checked, sorted(templates_seen))


def test_an_unrecorded_launch_is_refused(monkeypatch):
    monkeypatch.setattr(triton_aot, "CubinFunction", _NoLaunch)
    rec = {"entry": "quant_fp8_kernel", "constexprs": {"N": 64, "BLOCK": 1024, "BLK": 32}, "grid": [3, 1],
           "num_warps": 4, "num_stages": 1, "signature": {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8",
                                                          "N": "constexpr", "BLOCK": "constexpr", "BLK": "constexpr"},
           "metadata": {"name": "quant_fp8_kernel", "shared": 0}}
    call = triton_aot.TritonAotCall("k0", [rec], [b""])
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with tk.aot_kernels(call):
        tk.launch_quant_fp8(x, block=32, cfg={"BLOCK": 1024, "num_warps": 4, "num_stages": 1})  # as recorded
        with pytest.raises(RuntimeError, match="did not build"):
            tk.launch_quant_fp8(x, block=32, cfg={"BLOCK": 512, "num_warps": 4, "num_stages": 1})
        with pytest.raises(RuntimeError, match="grid"):
            tk.launch_quant_fp8(torch.zeros(5, 64, dtype=torch.bfloat16), block=32,
                                cfg={"BLOCK": 1024, "num_warps": 4, "num_stages": 1})


def test_decode_torch_references_need_no_host_sync():
    """A decode bucket is captured as a CUDA graph, which fails at any host synchronisation. The
    calls left to torch references must therefore do no data-dependent host work: each runs here
    on meta tensors (which have no data), at a decode bucket of the tiny sm90 pipeline (where the
    attention ops, too, are references: the TileLang templates take 64 heads only)."""
    from deepinfer.ir.registry import get_op

    target = get_target("sm90")
    g = run_pipeline(build_model(load_config("v4.1-flash-tiny")).step, "sm90")
    env = {"num_tokens": 4, "num_seqs": 4, "num_samples": 4, "max_pages": 4, "num_slots": 6, "num_pages": 9}
    failing, ran = set(), 0
    for n in g.nodes:
        if n.attr.get("@kernel") in (None, "view"):
            continue
        types = {v: g.types[v].subs(env) for v in (*n.inputs, *n.outputs)}
        if select(target, kernel_spec(g, n, types)).name != "torch_device":
            continue
        xs = [_zeros(types[v], env) for v in n.inputs]
        xs = [QTensor(x.data.to("meta"), x.scale.to("meta")) if isinstance(x, QTensor) else x.to("meta") for x in xs]
        op = get_op(n.op)
        try:
            with torch.device("meta"):
                op.ref(*xs, **op.check_attrs(n.attr))
            ran += 1
        except (NotImplementedError, RuntimeError):
            failing.add(n.op)
    assert ran > 50
    assert not failing, failing
