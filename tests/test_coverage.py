"""The coverage record a compile writes into the plan and prints: instances per template, torch
instances per op, and the device kernels a step launches (views and allocations launch none)."""
import pytest

from deepinfer.cli import main
from deepinfer.codegen.plan import load_plan
from deepinfer.passes.coverage import coverage_lines, plan_coverage


def _plan(steps, template="triton_x"):
    return {"model": {"config": {"num_hidden_layers": 2}},
            "kernels": {"k0": {"template": template, "spec": "rope(bf16[1, 64])"},
                        "k1": {"template": "torch_device", "spec": "sparse_attn(bf16[1, 64])"}},
            "recipes": {"r0": {"steps": steps}},
            "buckets": {"step": {"decode_b1": {}}},
            "graphs": {"step": {"calls": [
                {"kernel": "view", "launch": {"decode_b1": {}}},
                {"kernel": template, "launch": {"decode_b1": {"template": template, "kernel": "k0", "recipe": "r0"}}},
                {"kernel": "torch_device", "launch": {"decode_b1": {"template": "torch_device", "kernel": "k1"}}}]}}}


def test_kernels_per_step_count_launches_and_copies_not_views():
    steps = [{"op": "aten.view.default"}, {"op": "aten.empty.memory_format"}, {"op": "aten.zeros.default"},
             {"op": "aten.copy_.default"}, {"launch": 0}, {"op": "aten._to_copy.default"}, {"op": "aten.slice.Tensor"}]
    cov = plan_coverage(_plan(steps))
    s = cov["steps"]["step/decode_b1"]
    # zeros + copy_ + the launch + the cast, and one for the torch call
    assert s == {"calls": 2, "torch_calls": 1, "kernels": 5, "kernels_per_layer": 2.5}
    assert cov["torch_instances"] == 1 and cov["torch_instances_per_op"] == {"sparse_attn": 1}
    assert cov["instances_per_template"] == {"torch_device": 1, "triton_x": 1}
    text = "\n".join(coverage_lines(cov))
    assert "generated instances: 1 on 1 templates; torch instances: 1 (sparse_attn 1)" in text
    assert "step/decode_b1 5 (2.5/layer)" in text
    nested = _plan(steps)  # a multimodal config.json (the presets') keeps the layer count in text_config
    nested["model"]["config"] = {"text_config": {"num_hidden_layers": 5}, "vision_config": {"num_hidden_layers": 32}}
    assert plan_coverage(nested)["steps"]["step/decode_b1"]["kernels_per_layer"] == 1.0


def test_compile_records_and_prints_coverage(tmp_path, capsys):
    assert main(["compile", "--model", "v4.1-flash-tiny", "--target", "cpu", "-o", str(tmp_path / "plan"),
                 "--max-model-len", "2048", "--decode-batches", "1", "--prefill-tokens", "512"]) == 0
    out = capsys.readouterr().out
    plan = load_plan(tmp_path / "plan")
    cov = plan["coverage"]
    # a cpu plan runs every call as its op's torch reference
    assert cov["torch_instances"] == len(plan["kernels"]) > 50
    assert set(cov["instances_per_template"]) == {"torch_ref"}
    assert cov["steps"]["step_decode/decode_b1"]["torch_calls"] == cov["steps"]["step_decode/decode_b1"]["calls"] > 100
    assert f"torch instances: {cov['torch_instances']}" in out and "kernels per step: " in out


def test_coverage_table_marks_fallbacks_per_target():
    from deepinfer.passes.coverage import coverage_table, templates_per_op
    from deepinfer.passes.driver import CompileOptions, select_instances

    opts = dict(max_model_len=2048, max_num_seqs=4, decode_batches=(1,), prefill_tokens=(512,), tuning_db="none")
    cols = {t: templates_per_op(select_instances("v4.1-flash-tiny", CompileOptions(t, **opts)))
            for t in ("cpu", "ascend950")}
    assert set(cols["cpu"]["rms_norm"]) == {"torch_ref"}
    assert "ascend_rms_norm" in cols["ascend950"]["rms_norm"]
    table = coverage_table(cols).splitlines()
    assert table[0] == "| op | cpu | ascend950 |" and len(table) == 2 + len(set(cols["cpu"]) | set(cols["ascend950"]))
    row = next(r for r in table if r.startswith("| rms_norm |"))
    assert "**torch fallback**" in row.split("|")[2] and "`ascend_rms_norm`" in row.split("|")[3]


@pytest.mark.parametrize("target", ["sm100", "ascend950"])
def test_real_model_selection_has_no_torch_instance(target):
    """Issue #18's done-when, on the selection (no render or build): every instance of the real
    model's single-process plan is a generated template on sm100 and ascend950."""
    from deepinfer.passes.coverage import TORCH_TEMPLATES, templates_per_op
    from deepinfer.passes.driver import CompileOptions, select_instances

    per_op = templates_per_op(select_instances("v4.1-flash", CompileOptions(target, tuning_db="none")))
    torch_ops = {op: t for op, t in per_op.items() if set(t) & set(TORCH_TEMPLATES)}
    assert not torch_ops
    if target == "ascend950":
        assert set(per_op["indexer_topk"]) == {"ascend_indexer_topk"}
        assert set(per_op["dspark_heads"]) == {"ascend_dspark_heads"}
