"""The compiled tiny sm90 plan on the GPU: every call against its op's reference on the GPU's own
inputs (bench/runtime_sm90.local_check), and offline generation through LLM(plan=...) with the
decode buckets captured as CUDA graphs. Needs an sm90 GPU, and TileLang when the plan is compiled
here into a temporary directory; DEEPINFER_TINY_SM90_PLAN names one compiled beforehand with the same
options: `deepinfer compile --model v4.1-flash-tiny --target sm90 --max-model-len 2048
--max-num-seqs 8 --decode-batches 1,2,4,8 --prefill-tokens 512`.
Run: python -m pytest -m gpu tests/gpu/test_cuda_executor.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):  # pragma: no cover
    pytest.skip("needs an sm90 GPU", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import runtime_sm90 as rt  # noqa: E402
from serving_machine import generate_script, parse_output  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.checkpoint import make_checkpoint  # noqa: E402
from deepinfer.passes.driver import CompileOptions, compile_model  # noqa: E402


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("sm90")
    ckpt = make_checkpoint("v4.1-flash-tiny", root / "ckpt", seed=11)
    if os.environ.get("DEEPINFER_TINY_SM90_PLAN"):  # compiled beforehand with the options below
        return os.environ["DEEPINFER_TINY_SM90_PLAN"], ckpt
    pytest.importorskip("tilelang")
    opts = CompileOptions("sm90", max_model_len=2048, max_num_seqs=8, decode_batches=(1, 2, 4, 8),
                          prefill_tokens=(512,), jobs=os.cpu_count() or 1)
    return compile_model("v4.1-flash-tiny", opts, root / "plan").plan_dir, ckpt


def test_every_call_matches_its_reference(plan):
    res = rt.local_check(str(plan[0]))
    assert not res["failures"], res["failures"][:5]
    # one prefill and one decode step: every call of both graphs was checked
    graphs = json.loads((Path(plan[0]) / "plan.json").read_text())["graphs"]
    decode = "step_decode" if "step_decode" in graphs else "step"  # a plan whose decode graph is its step graph
    assert sum(r["calls"] for r in res["per_template"].values()) == sum(
        len(graphs[g]["calls"]) for g in ("step", decode))


def test_generate_through_the_engine(plan):
    llm = LLM(plan=plan[0], weights=plan[1], max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=512)
    outs = llm.generate(prompt_token_ids=[[5, 6, 7, 8], list(range(100, 160))],
                        sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    ex = llm.engine.executor
    assert ex.graph_status and all(v == "captured" for v in ex.graph_status.values()), ex.graph_status


def test_the_plan_generates_where_the_compiler_is_absent(plan):
    """A serving machine has the plan, torch and the CUDA driver: the sm90 plan generates in a
    process where the compiler and the kernel languages cannot be imported, with the tokens of
    this process's run."""
    prompts = [[5, 6, 7, 8], list(range(100, 160))]
    kw = dict(max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=512)
    r = subprocess.run([sys.executable, "-c", generate_script(plan[0], plan[1], prompts, 8, **kw)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = parse_output(r.stdout)
    assert lines["MODULES"] == "[]"
    want = LLM(plan=plan[0], weights=plan[1], **kw).generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False)
    assert lines["TOKENS"] == str([o.token_ids for o in want])


def test_pdl_launches_give_the_tokens_of_plain_launches(plan, monkeypatch):
    """Every kernel of an sm90 plan waits on the grid before it, and is launched with programmatic
    stream serialization (its launch overlaps the previous kernel's tail): CUDA-graph decode gives
    the tokens of plain launches (DEEPINFER_PDL=0)."""
    prompts = [[5, 6, 7, 8], list(range(100, 160))]
    kw = dict(max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=512)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_PDL", pdl)
        llm = LLM(plan=plan[0], weights=plan[1], **kw)
        runs[pdl] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
        fns = [f for k in llm.engine.executor._kernels.values()
               for f in getattr(k, "kernels", None) or getattr(k, "functions", [])]
        assert fns and all(f.pdl == (pdl == "1") for f in fns)
    assert runs["0"] == runs["1"]


def test_calls_on_two_streams_give_the_logits_of_one(plan, monkeypatch):
    """DEEPINFER_LANES=2 spreads a decode step's calls over two streams (plan_runner.schedule_lanes:
    branches such as the shared expert beside the routed experts, joined by events; in-place
    writes after their readers by the plan's `after` edges): a prefill and six decode steps,
    captured as CUDA graphs, give the logits of one stream bit for bit."""
    from deepinfer.runtime.batch import SeqChunk
    from deepinfer.runtime.cuda_executor import CudaPlanExecutor

    runs = {}
    for lanes in ("1", "2"):
        monkeypatch.setenv("DEEPINFER_LANES", lanes)
        ex = CudaPlanExecutor(plan[0], plan[1])
        chunks = [SeqChunk(0, 0, list(range(5, 45)), [0]), SeqChunk(1, 0, list(range(100, 130)), [1])]
        out = [ex.step(chunks)]
        for _ in range(6):
            chunks = [SeqChunk(c.slot, c.start + len(c.tokens), [int(r.argmax())], c.pages)
                      for c, r in zip(chunks, out[-1])]
            out.append(ex.step(chunks))
        runs[lanes] = out
        assert all(v == "captured" for v in ex.graph_status.values()), ex.graph_status
        if lanes == "2":
            used = [s for s in ex.runner._lanes.values()]
            assert used and all(max(s[0]) == 1 and sum(map(len, s[1])) > 0 for s in used)
    assert all(torch.equal(a, b) for a, b in zip(runs["1"], runs["2"]))



@pytest.mark.parametrize("device_rows", [1, 8])
def test_argmax_steps_return_the_logits_argmax(plan, monkeypatch, device_rows):
    """submit(argmax=True) (the engine's all-greedy steps) returns each sampled row's argmax id,
    the first maximum as on the host, in place of its logits: two executors run the same prefill
    and captured decode steps, one returning logits, one ids (reduced on the device from
    `device_rows` rows: both ways here, two rows a step)."""
    from deepinfer.runtime import cuda_executor
    from deepinfer.runtime.batch import SeqChunk
    from deepinfer.runtime.cuda_executor import CudaPlanExecutor

    monkeypatch.setattr(cuda_executor, "ARGMAX_DEVICE_ROWS", device_rows)

    by_logits, by_ids = CudaPlanExecutor(plan[0], plan[1]), CudaPlanExecutor(plan[0], plan[1])
    chunks = [SeqChunk(0, 0, list(range(5, 45)), [0]), SeqChunk(1, 0, list(range(100, 130)), [1])]
    for _ in range(5):
        want = by_logits.step(chunks).argmax(-1)
        ids = by_ids.step(chunks, argmax=True)
        assert ids.dtype == torch.int64 and ids.tolist() == want.tolist()
        chunks = [SeqChunk(c.slot, c.start + len(c.tokens), [int(t)], c.pages) for c, t in zip(chunks, ids)]
    assert all(v == "captured" for v in by_ids.graph_status.values()), by_ids.graph_status


def test_early_submitted_steps_give_the_tokens_of_plain_ones(plan, monkeypatch):
    """By default (DEEPINFER_EARLY_SUBMIT unset or 1) a step after an all-greedy one is submitted
    before that step's ids reach the host, its tokens fed from them on the device
    (LLMEngine._submit_early); greedy generation of three lengths gives the tokens it gives
    with DEEPINFER_EARLY_SUBMIT=0."""
    prompts = [[5, 6, 7, 8], list(range(100, 160)), [9] * 20]
    kw = dict(max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=512)
    runs = {}
    for early in ("0", None):
        if early is None:
            monkeypatch.delenv("DEEPINFER_EARLY_SUBMIT", raising=False)
        else:
            monkeypatch.setenv("DEEPINFER_EARLY_SUBMIT", early)
        llm = LLM(plan=plan[0], weights=plan[1], **kw)
        assert llm.engine.executor.feed_steps == (early is None)
        sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 7, 16)]
        runs[early] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sps,
                                                         use_tqdm=False)]
    assert runs["0"] == runs[None] and [len(t) for t in runs[None]] == [12, 7, 16]
