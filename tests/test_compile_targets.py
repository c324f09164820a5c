"""Compiles for the device targets on the CPU machine: every call gets a template, generated
kernels are built (nvcc / Triton AOT) or kept as checked sources (AscendC without bisheng), and
ptxas reports land in the plan. The tiny model with two buckets runs by default for sm90; the tiny
sm100 and ascend950 compiles (two minutes each on two cores) and the real model for each device
target are `slow` (`bash scripts/test.sh -m slow`)."""
import pytest

from deepinfer.codegen.plan import load_plan
from deepinfer.passes.driver import CompileOptions, compile_model

SMALL = dict(max_model_len=2048, max_num_seqs=4, decode_batches=(1,), prefill_tokens=(512,), jobs=2)


def _check_plan(report, target):
    plan = load_plan(report.plan_dir, target=target)
    kernels = plan["kernels"]
    statuses = {k.get("build", {}).get("status", "torch") for k in kernels.values()}
    assert not statuses & {"failed", "invalid"}, statuses
    for call in plan["graphs"]["step"]["calls"]:
        for entry in call["launch"].values():
            assert call["kernel"] == "view" or entry["kernel"] in kernels
    return plan


@pytest.mark.parametrize("target", ["sm90", pytest.param("sm100", marks=pytest.mark.slow)])
def test_tiny_cuda_targets_build_every_generated_kernel(target, tmp_path):
    plan = _check_plan(compile_model("v4.1-flash-tiny", CompileOptions(target, **SMALL), tmp_path / "p"), target)
    built = [k for k in plan["kernels"].values() if k.get("build", {}).get("status") == "built"]
    assert len(built) > 50
    langs = {k["language"] for k in built}
    assert langs == {"cuda", "triton"}
    # ptxas reports of the GEMM kernels: registers known and no spills
    gemms = [k for k in built if k["template"] == "tilelang_gemm_fp8"]
    assert gemms
    for k in gemms:
        for res in k["build"]["resources"].values():
            assert res.get("registers", 0) > 0 and res.get("spill_stores", 0) == 0 and res.get("spill_loads", 0) == 0


@pytest.mark.slow
def test_tiny_ascend_keeps_checked_sources(tmp_path):
    plan = _check_plan(compile_model("v4.1-flash-tiny", CompileOptions("ascend950", **SMALL), tmp_path / "p"),
                       "ascend950")
    ascend = [k for k in plan["kernels"].values() if k["language"] == "ascendc"]
    assert ascend and all(k["build"]["status"] in ("unbuilt", "built") for k in ascend)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm90", "sm100", "ascend950"])
def test_real_model_compiles_for_device_targets(target, tmp_path):
    _check_plan(compile_model("v4.1-flash", CompileOptions(target, jobs=2), tmp_path / "p"), target)
