"""Offline generation from a compiled cpu plan: the same greedy tokens as the graph interpreter,
through LLM(plan=...) and `deepinfer generate PLAN_DIR`."""
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main


@pytest.fixture(scope="module")
def plan_and_weights(tiny_plan_and_weights):
    return tiny_plan_and_weights


def test_plan_generation_equals_interpreter(plan_and_weights):
    plan, ckpt = plan_and_weights
    prompts = [[5, 17, 300, 9000, 12], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(plan=plan, weights=ckpt, max_num_seqs=2, max_model_len=256)
    a = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    b = LLM("v4.1-flash-tiny", ckpt, max_num_seqs=2, max_model_len=256, speculative=0).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 6 for o in a)
    # the plan speculated (the default; its step_decode graph runs the verify chunks) and still agrees
    assert llm.engine.num_speculative == 5 and llm.engine.spec_stats.drafts_verified > 0


def test_generate_cli_runs_a_plan(plan_and_weights, capsys):
    plan, ckpt = plan_and_weights
    assert main(["generate", str(plan), "--weights", str(ckpt), "--prompt", "hello", "--max-tokens", "3",
                 "--temperature", "0", "--max-num-seqs", "2", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "[0] output:" in out and "generated tokens/s" in out and "mean accepted length" in out
    assert "verify rows/step" in out


def test_fixed_acceptance_through_llm(plan_and_weights):
    """The benchmark mode through LLM(plan=...): at p = 1 every draft is accepted, so a verify
    yields 1 + its drafts and the run takes fewer steps than it has tokens."""
    plan, ckpt = plan_and_weights
    llm = LLM(plan=plan, weights=ckpt, max_num_seqs=1, max_model_len=256, fixed_acceptance=1.0, seed=3)
    (out,) = llm.generate(prompt_token_ids=[[5, 17, 300]], use_tqdm=False,
                          sampling_params=SamplingParams(temperature=0, max_tokens=13, ignore_eos=True))
    st = llm.last_run_stats
    assert len(out.token_ids) == 13 and st["acceptance_rate"] == 1.0 and st["mean_accepted_length"] == 6.0
    assert st["steps"] == 3  # the prefill's token, then two verifies of 5 drafts + 1


def test_plan_limits_are_enforced(plan_and_weights, capsys):
    plan, ckpt = plan_and_weights
    assert main(["generate", str(plan), "--weights", str(ckpt), "--prompt", "x", "--max-model-len", "9999"]) == 2
    assert "exceeds the plan's 512" in capsys.readouterr().err


def test_a_gpu_plan_without_a_gpu_is_one_line(tmp_path, capsys):
    """An sm90 plan on a machine with no GPU: refused with one line, no traceback."""
    import json

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from deepinfer.codegen.plan import versions, write_plan

    plan = {"model": {"id": "x", "config_hash": "0", "config": {}}, "target": {"name": "sm90"}, "versions": versions(),
            "options": {"max_model_len": 256, "max_num_seqs": 2, "num_pages": 9, "num_slots": 3, "page_tokens": 128},
            "buckets": {"step": {"decode_b1": {"num_tokens": 1}}}, "graphs": {"step": {"calls": []}}, "kernels": {},
            "params": {},
            "load_program": [], "state": {}, "memory": {}}
    out = write_plan(json.loads(json.dumps(plan)), {}, tmp_path / "plan")
    assert main(["generate", str(out), "--weights", str(tmp_path), "--prompt", "x", "--max-model-len", "128",
                 "--max-num-seqs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs an NVIDIA GPU" in err[0], err
