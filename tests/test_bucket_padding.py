"""Device plans run every step at a bucket's static shape: padded rows and sequences in a scratch
slot and page. Here the cpu plan runs the same padding through the same call-list runner as the
GPU executor (runtime/plan_runner.py: values freed after their last reader, state kept in fixed
buffers), with references for kernels, and must give the interpreter's logits of the unpadded
step: padding never leaks into a real row, nor a real row into the scratch."""
import pytest
import torch

from deepinfer.models.checkpoint import make_checkpoint
from deepinfer.passes.driver import CompileOptions, compile_model
from deepinfer.runtime.batch import SeqChunk, bucket_inputs
from deepinfer.runtime.plan_executor import PlanExecutor, choose_bucket


@pytest.fixture(scope="module")
def plan_and_weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("pad")
    ckpt = make_checkpoint("v4.1-flash-tiny", root / "ckpt", seed=3)
    opts = CompileOptions("cpu", max_model_len=512, max_num_seqs=4, decode_batches=(1, 2, 4), prefill_tokens=(64,),
                          verify_batches=(1, 2, (2, 4)))
    return compile_model("v4.1-flash-tiny", opts, root / "plan").plan_dir, ckpt


def test_padded_steps_equal_unpadded(plan_and_weights):
    plan, ckpt = plan_and_weights
    plain = PlanExecutor(plan, ckpt, num_slots=4, num_pages=8)
    padded = PlanExecutor(plan, ckpt, num_slots=4, num_pages=8, pad_to_buckets=True)
    assert (padded.num_slots, padded.num_pages) == (4, 8)
    a, b = list(range(100, 120)), list(range(500, 540))
    steps = [
        [SeqChunk(0, 0, a, [0, 1]), SeqChunk(2, 0, b[:30], [4, 5], sample=False)],  # prefill, one chunk unsampled
        [SeqChunk(0, 20, [7], [0, 1]), SeqChunk(2, 30, b[30:], [4, 5])],  # mixed: prefill bucket
        [SeqChunk(0, 21, [8], [0, 1]), SeqChunk(2, 40, [9], [4, 5])],  # decode b2
        [SeqChunk(2, 41, [10], [4, 5])],  # decode b1
        [SeqChunk(0, 22, [11], [0, 1]), SeqChunk(2, 42, [12], [4, 5]), SeqChunk(1, 0, [3], [2])],  # b4, padded to 4
    ]
    used = set()
    for chunks in steps:
        used.add(choose_bucket(padded.plan, chunks))
        want, got = plain.step(chunks), padded.step(chunks)
        assert got.shape == want.shape
        assert torch.equal(got, want)
    assert used == {("step", "prefill_t64"), ("step_decode", "decode_b2"), ("step_decode", "decode_b1"),
                    ("step_decode", "decode_b4")}


def test_bucket_inputs_layout():
    env = {"num_tokens": 8, "num_seqs": 3, "num_samples": 3, "max_pages": 2}
    x, n = bucket_inputs([SeqChunk(0, 5, [1, 2, 3], [0])], env, scratch_slot=9, scratch_page=7, pad_token=2)
    assert n == 1
    assert x["token_ids"].tolist() == [1, 2, 3, 2, 2, 2, 2, 2]
    assert x["positions"].tolist() == [5, 6, 7, 0, 1, 2, 0, 1]
    assert x["token_seq"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert x["seq_slots"].tolist() == [0, 9, 9]
    assert x["block_table"].tolist() == [[0, -1], [7, 7], [7, 7]]
    assert x["sample_rows"].tolist() == [2, 5, 7]


def test_a_step_that_fits_no_bucket_is_refused(plan_and_weights):
    from deepinfer.codegen.plan import load_plan

    plan = load_plan(plan_and_weights[0])
    with pytest.raises(ValueError, match="fits no bucket"):
        choose_bucket(plan, [SeqChunk(0, 0, list(range(70)), [0])])


def test_verify_steps_padded_equal_unpadded(plan_and_weights):
    """Speculative verify chunks ([t*, d_0 ..], logits for every row) run in the verify buckets:
    up to 1 + the draft block's rows per sequence, one spare sequence for the padding rows; a
    ragged bucket (2 sequences sharing 4 rows) takes the steps its rows hold, however they are
    spread over its sequences."""
    plan, ckpt = plan_and_weights
    plain = PlanExecutor(plan, ckpt, num_slots=4, num_pages=8)
    padded = PlanExecutor(plan, ckpt, num_slots=4, num_pages=8, pad_to_buckets=True)
    assert padded.max_draft_len == 5 and plain.max_draft_len == 5
    kinds, envs = padded.plan["bucket_kinds"], padded.plan["buckets"]["step_decode"]
    assert kinds["verify_b2"] == kinds["verify_b2r4"] == "verify" and envs["verify_b2"]["num_tokens"] == 12
    assert (envs["verify_b2r4"]["num_tokens"], envs["verify_b2r4"]["num_seqs"]) == (4, 3)
    assert padded.verify_shapes == [(1, 6), (2, 4), (2, 12)]
    a, b = list(range(100, 120)), list(range(500, 530))
    prefill = [SeqChunk(0, 0, a, [0, 1]), SeqChunk(2, 0, b, [4, 5])]
    steps = [
        [SeqChunk(0, 20, [7, 8, 9, 10], [0, 1], logit_rows=4), SeqChunk(2, 30, [1, 2, 3, 4, 5, 6], [4, 5], logit_rows=6)],
        [SeqChunk(0, 24, [11, 12, 13, 14], [0, 1], logit_rows=4)],  # one sequence of 4 rows: the ragged bucket
        [SeqChunk(0, 28, [13], [0, 1]), SeqChunk(2, 36, [14, 15, 16], [4, 5], logit_rows=3)],
        [SeqChunk(0, 29, [17, 18, 19, 20, 21], [0, 1], logit_rows=5)],  # 5 rows: more than it holds
    ]
    assert torch.equal(plain.step(prefill), padded.step(prefill))
    used = []
    for chunks in steps:
        used.append(choose_bucket(padded.plan, chunks))
        want, got = plain.step(chunks), padded.step(chunks)
        assert got.shape == want.shape == (sum(c.logit_rows for c in chunks), want.shape[1])
        assert torch.equal(got, want)
    assert used == [("step_decode", "verify_b2"), ("step_decode", "verify_b2r4"), ("step_decode", "verify_b2r4"),
                    ("step_decode", "verify_b1")]
    # more drafts than the verify buckets' rows per sequence: a prefill bucket, sampled rows permitting
    with pytest.raises(ValueError, match="fits no bucket"):
        choose_bucket(padded.plan, [SeqChunk(0, 30, list(range(7)), [0, 1], logit_rows=7)])


def test_speculation_through_the_padded_plan_gives_plain_tokens(plan_and_weights):
    """The engine speculates on a padded plan (verify buckets, draft buckets padded with dummy
    sequences) and its greedy tokens equal a run without speculation. Two sequences run at a time
    (the largest verify bucket); the third waits, and is admitted in a step without drafts."""
    from deepinfer.runtime.engine import LLMEngine
    from deepinfer.runtime.sampling_params import SamplingParams

    from test_runtime_scheduler import FakeTokenizer

    plan, ckpt = plan_and_weights
    prompts = [list(range(100, 120)), list(range(300, 307)), [5, 6, 7]]
    outs = {}
    for spec in (0, None):
        ex = PlanExecutor(plan, ckpt, num_slots=4, num_pages=8, pad_to_buckets=True)
        engine = LLMEngine(ex, FakeTokenizer(), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256,
                           speculative=spec)
        ids = [engine.add_request(params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                  prompt_token_ids=p) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                done[o.request_id] = o.token_ids
        outs[spec] = [done[i] for i in ids]
        if spec is None:
            assert engine.num_speculative == 5 and engine.spec_stats.verifies > 0
    assert outs[None] == outs[0]


def test_the_step_time_curve_times_each_bucket_in_the_scratch_slot(plan_and_weights):
    """time_step_buckets (the CUDA executor's warm_up): one entry per decode and verify bucket a
    step of at most max_seqs sequences runs in, each a positive time; the timed steps write only
    the scratch slot and page, never a real sequence's state."""
    from deepinfer.ir.quant import QTensor
    from deepinfer.runtime.plan_executor import time_step_buckets

    plan, ckpt = plan_and_weights
    padded = PlanExecutor(plan, ckpt, num_slots=4, num_pages=8, pad_to_buckets=True)
    padded.step([SeqChunk(1, 0, list(range(100, 140)), [2])])  # a real sequence in slot 1, page 2

    def real_state():
        parts = [(k, x) for k, v in padded.state.items() for x in ((v.data, v.scale) if isinstance(v, QTensor) else (v,))]
        return {(k, i): x[:-1].clone() for i, (k, x) in enumerate(parts)}  # all but the scratch slot / page

    before = real_state()
    curve = time_step_buckets(padded, max_seqs=1, reps=1)
    assert [(b, s, r) for b, s, r, _ in curve] == [("decode_b1", 1, 1), ("verify_b1", 1, 6)]
    assert all(t > 0 for *_, t in curve)
    curve = time_step_buckets(padded, max_seqs=2, reps=1, skip={"decode_b1", "verify_b1"})
    assert sorted((b, s, r) for b, s, r, _ in curve) == [("decode_b2", 2, 2), ("verify_b2", 2, 12),
                                                         ("verify_b2r4", 2, 4)]
    after = real_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
