"""Prefix caching with the tiny sm90 plan on the GPU: the slot states a page keeps stay on the
device, an exact hit gives the tokens and logprobs of a miss (decode buckets as CUDA graphs, whose
state buffers the restore writes in place), and bounded replay leaves the shared pages unchanged.
The plan is compiled as tests/gpu/test_cuda_executor.py compiles it (or DEEPINFER_TINY_SM90_PLAN).
Run: python -m pytest -m gpu tests/gpu/test_prefix_cache_gpu.py
"""
import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):  # pragma: no cover
    pytest.skip("needs an sm90 GPU", allow_module_level=True)

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.ir.quant import QTensor  # noqa: E402
from deepinfer.models.checkpoint import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("sm90")
    ckpt = make_checkpoint("v4.1-flash-tiny", root / "ckpt", seed=11)
    if os.environ.get("DEEPINFER_TINY_SM90_PLAN"):
        return os.environ["DEEPINFER_TINY_SM90_PLAN"], ckpt
    pytest.importorskip("tilelang")
    from deepinfer.passes.driver import CompileOptions, compile_model

    opts = CompileOptions("sm90", max_model_len=2048, max_num_seqs=8, decode_batches=(1, 2, 4, 8),
                          prefill_tokens=(512,), jobs=os.cpu_count() or 1)
    return compile_model("v4.1-flash-tiny", opts, root / "plan").plan_dir, ckpt


def prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 129280, (n,), generator=g).tolist() for n in (140, 300)]


def page_bytes(ex, page):
    return [part[page].clone() for name in ex.page_names
            for part in ((ex.state[name].data, ex.state[name].scale) if isinstance(ex.state[name], QTensor)
                         else (ex.state[name],))]


def test_exact_hits_on_the_gpu_give_the_tokens_of_misses(plan):
    llm = LLM(plan=plan[0], weights=plan[1], max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=512,
              enable_prefix_caching=True)
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, logprobs=3, ignore_eos=True)]
    miss = llm.generate(prompt_token_ids=prompts(), sampling_params=params, use_tqdm=False)
    states = llm.engine.cache._state
    assert states and all(parts[0].device.type == "cuda" for s in states.values() for parts in s.values())
    hit = llm.generate(prompt_token_ids=prompts(), sampling_params=params, use_tqdm=False)
    st = llm.last_run_stats["prefix"]
    print("prefix", st, "graphs", llm.engine.executor.graph_status)
    assert st["hit_tokens"] == 128 + 256
    for m, h in zip(miss, hit):
        assert h.token_ids == m.token_ids
        worst = max(abs(a[t].logprob - b[t].logprob) for a, b in zip(m.outputs[0].logprobs, h.outputs[0].logprobs)
                    for t in a)
        print("logprob max |diff| hit vs miss", worst)
        assert worst == 0.0
    llm.engine.cache.check_no_leak()


def test_bounded_replay_on_the_gpu_leaves_the_shared_pages_unchanged(plan):
    llm = LLM(plan=plan[0], weights=plan[1], max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=512,
              enable_prefix_caching=True, swa_replay="bounded", swa_replay_keep=22)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    miss = llm.generate(prompt_token_ids=prompts(), sampling_params=greedy, use_tqdm=False)
    ex = llm.engine.executor
    pages = llm.engine.cache.lookup(prompts()[1]).pages
    before = [page_bytes(ex, p) for p in pages]
    hit = llm.generate(prompt_token_ids=prompts(), sampling_params=greedy, use_tqdm=False)
    assert all(torch.equal(a, b) for p, old in zip(pages, before) for a, b in zip(old, page_bytes(ex, p)))
    st = llm.last_run_stats["prefix"]
    assert st["prefill_tokens_saved"] == (128 - 22) + (256 - 22)
    agree = [next((i for i, (a, b) in enumerate(zip(m.token_ids, h.token_ids)) if a != b), 12)
             for m, h in zip(miss, hit)]
    print("bounded replay: greedy tokens agreeing of 12", agree)
    llm.engine.cache.check_no_leak()
