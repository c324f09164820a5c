"""Batch invariance (issue #13, item 2): with `--batch-invariant` every call of a plan runs one
template with one reduction structure (K splits, key-block splits) at every bucket, so a row's
sums run in one order whatever else is in its step; tuning rows are not read. Checked on the
selected kernels of the tiny sm90 plan (no build), and end to end on the CPU, where a request's
logprobs alone, inside a batch of four, and with its prompt in 16-token chunks are bit-identical."""
import pytest
import torch

from deepinfer.llm import LLM, SamplingParams
from deepinfer.passes.driver import CompileOptions, compile_model, select_calls
from deepinfer.runtime.engine import EngineConfigError

TINY = "v4.1-flash-tiny"
SPLITS = ("split_k", "SPLIT", "splits")  # the knobs that change the order of a row's sums


def _per_call(options):
    calls, instances = select_calls(TINY, options)
    by_id = {v[0]: v for v in instances.values()}
    out = []
    for g in calls.values():
        for c in g:
            seen = {b: (by_id[ln["kernel"]][1], by_id[ln["kernel"]][3]) for b, ln in c["launch"].items() if "kernel" in ln}
            if seen:
                out.append((c["op"], seen))
    return out


def test_a_batch_invariant_plan_runs_one_reduction_per_call_at_every_bucket():
    buckets = dict(max_model_len=2048, max_num_seqs=64, decode_batches=(1, 8, 64), prefill_tokens=(512, 2048),
                   tuning_db="none")
    varying = []
    for invariant in (False, True):
        varying = []
        for op, seen in _per_call(CompileOptions("sm90", batch_invariant=invariant, **buckets)):
            templates = {t for t, _ in seen.values()}
            splits = {tuple(cfg.get(k, 1) for k in SPLITS) for _, cfg in seen.values()}
            triton_cfgs = {tuple(sorted(cfg.items())) for t, cfg in seen.values() if t.startswith("triton_")}
            if len(templates) > 1 or len(splits) > 1 or len(triton_cfgs) > 1:
                varying.append((op, seen))
        if not invariant:  # the default plan does split by the batch: the check below can fail
            assert {op for op, _ in varying} >= {"gemm_fp8"}, varying
    assert varying == []
    # the MoE GEMM keeps its decode template at prefill too (the prefill one at decode rows
    # launches every expert's tiles)
    moe = [seen for op, seen in _per_call(CompileOptions("sm90", batch_invariant=True, **buckets))
           if op == "grouped_gemm_fp4"]
    assert moe and all(t == "triton_grouped_gemm_fp4" for seen in moe for t, _ in seen.values()), moe


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from deepinfer.models.checkpoint import make_checkpoint

    return make_checkpoint(TINY, tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


def _logprobs(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [[sorted(d.items()) for d in o.outputs[0].logprobs] for o in outs]


def test_a_request_alone_in_a_batch_and_chunked_gives_identical_logprobs(ckpt, tmp_path, one_torch_thread):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 129280, (n,), generator=g).tolist() for n in (70, 40, 100, 20)]
    plan = compile_model(TINY, CompileOptions("cpu", max_model_len=320, max_num_seqs=8, batch_invariant=True),
                         tmp_path / "plan").plan_dir
    from deepinfer.autotune.tuner import TuneError
    from deepinfer.autotune.candidates import build_candidates

    with pytest.raises(TuneError, match="takes no tuning"):  # tuned configs would be per bucket again
        build_candidates(plan, tmp_path / "cands")
    for kw in (dict(model=TINY), dict(plan=plan)):
        llm = LLM(weights=ckpt, max_num_seqs=8, max_model_len=320, batch_invariant=True, **kw)
        alone, batch = _logprobs(llm, prompts[:1]), _logprobs(llm, prompts)
        chunked = _logprobs(LLM(weights=ckpt, max_num_seqs=8, max_model_len=320, max_num_batched_tokens=16,
                                batch_invariant=True, **kw), prompts[:1])
        assert alone[0] == batch[0] == chunked[0], kw


def test_a_plan_compiled_without_it_is_refused_in_one_line(tiny_plan_and_weights, capsys):
    from deepinfer.cli import main

    plan, weights = tiny_plan_and_weights
    with pytest.raises(EngineConfigError, match="compiled without --batch-invariant"):
        LLM(plan=plan, weights=weights, batch_invariant=True)
    assert main(["generate", str(plan), "--weights", str(weights), "--prompt", "Hi", "--batch-invariant"]) == 2
    err = capsys.readouterr().err
    assert "compiled without --batch-invariant" in err and err.count("\n") == 1
    with pytest.raises(EngineConfigError, match="batch_invariant"):
        LLM(plan=plan, weights=weights, batch_invariant="yes")
