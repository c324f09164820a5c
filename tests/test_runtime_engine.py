"""The engine end to end on the tiny model (random checkpoint) with the graph interpreter: greedy
tokens equal the independent reference's argmax under continuous batching, chunked prefill and
preemption; speculative decoding gives the same greedy tokens and leaves the caches as a plain run
does; seeded sampling is reproducible; bad input ends in one line."""
import json
import random
from types import SimpleNamespace

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main as cli_main
from deepinfer.models.checkpoint import CheckpointError, make_checkpoint
from deepinfer.ir.quant import QTensor
from deepinfer.models.config import ConfigError
from deepinfer.models.deepseek_v41 import PAGE_TOKENS, max_backtrack
from deepinfer.runtime.batch import DraftSeq, SeqChunk
from deepinfer.runtime.engine import EngineConfigError, RequestError
from deepinfer.runtime.sampling_params import SamplingParamsError

from reference import ReferenceModel

MODEL = "v4.1-flash-tiny"
# mixed lengths: one token, shorter than the 16-token window, several pages (> 128), odd lengths
PROMPT_LENS = [5, 150, 33, 1, 200, 17, 129, 64]
ARRIVAL_STEP = [0, 0, 1, 2, 4, 7, 11, 16]  # engine step before which each prompt is added
GEN_TOKENS = 64
# the tests of the plain and speculative module fixtures (about 75 and 70 s of engine steps) on one
# test worker (scripts/test.sh distributes by --dist loadgroup): on two, each computed them
ONE_WORKER = pytest.mark.xdist_group("engine_greedy_fixtures")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(MODEL, tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def ref(ckpt):
    return ReferenceModel.from_checkpoint(ckpt)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 129280, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def reference_greedy(ref, prompt, n):
    """The reference's own greedy loop: prefill, then argmax and decode one token at a time."""
    seq = ref.new_sequence()
    logits = ref.prefill(seq, prompt)
    out = []
    for _ in range(n):
        out.append(int(torch.argmax(logits)))  # first maximum = lowest id, as the engine's greedy path
        if len(out) < n:
            logits = ref.decode(seq, out[-1])
    return out


def reference_accepts(ref, prompt, tokens) -> int:
    """How many of `tokens` are the reference's greedy choice given the prompt and the tokens before.

    One reference prefill over prompt + tokens gives every row's logits at once (the reference's
    chunked prefill equals its token-by-token decode), so this checks greedy equality token for
    token at the cost of a prefill instead of len(tokens) decodes: if each token is the argmax
    after the ones before it, the whole list is exactly the reference's greedy continuation."""
    logits = ref.prefill(ref.new_sequence(), prompt + tokens[:-1], all_logits=True)[len(prompt) - 1:]
    argmax = torch.argmax(logits, dim=-1).tolist()
    return next((i for i, (a, t) in enumerate(zip(argmax, tokens)) if a != t), len(tokens))


GREEDY = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True)


def valid_state(state: dict, slot_names: list[str], slot: int, pages: list[int], n: int, backtrack: int) -> dict:
    """What a sequence with n cached tokens holds in every state buffer, by position: of each slot
    ring (window keys, compressor state, Engram history; slot = pos mod length) the newest
    length - backtrack + 1 positions, the ones a verify step's rejected rows (<= backtrack - 1 of
    them, at positions >= n) cannot have overwritten and that every later read falls in; of each
    paged cache the entries completed by positions < n."""
    out = {}
    for name, buf in state.items():
        parts = (buf.data, buf.scale) if isinstance(buf, QTensor) else (buf,)
        if name in slot_names:
            ring = parts[0].shape[1]
            pos = torch.arange(max(0, n - (ring - backtrack + 1)), n)
            out[name] = [x[slot, pos % ring].clone() for x in parts]
        else:
            per_page = parts[0].shape[1]
            entries = torch.arange(n // (PAGE_TOKENS // per_page))
            page = torch.tensor(pages, dtype=torch.long)[entries // per_page]
            out[name] = [x[page, entries % per_page].clone() for x in parts]
    return out


def record_states(engine) -> dict:
    """request id -> valid_state of its sequence when it last gave its slot back (at its finish;
    an earlier preemption's record is replaced)."""
    ex, cache, free = engine.executor, engine.cache, engine.cache.free
    slots = [k for k in ex.state if k in set(ex.slot_names)]
    backtrack = max_backtrack(ex.program.cfg)
    states = {}

    def record_then_free(owner):
        seq = engine._sequences.get(owner)
        if cache.holds(owner) and seq is not None:
            states[owner] = valid_state(ex.state, slots, cache.slot(owner), cache.pages(owner),
                                        len(seq.token_ids) - 1, backtrack)
        free(owner)

    cache.free = record_then_free
    return states


def run_staggered(engine, prompts, aborts=None):
    """The prompts arriving before the engine steps ARRIVAL_STEP, 64 greedy tokens each; `aborts`:
    engine step -> index of a prompt aborted before that step."""
    ids, outs, step = {}, {}, 0
    while len(outs) < len(prompts):
        for i, at in enumerate(ARRIVAL_STEP):
            if at == step:
                ids[engine.add_request(params=GREEDY, prompt_token_ids=prompts[i])] = i
        if aborts and step in aborts:
            assert engine.abort_request(next(r for r, i in ids.items() if i == aborts[step]))
        for o in engine.step():
            outs[ids[o.request_id]] = o
        step += 1
    return [outs[i] for i in range(len(prompts))], {i: r for r, i in ids.items()}


@pytest.fixture(scope="module")
def plain_greedy(ckpt, prompts):
    """The 8 prompts through one engine without speculation, arriving at different steps, 64
    greedy tokens each, with the caches of each sequence as it finished."""
    llm = LLM(MODEL, ckpt, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=320, speculative=0)
    states = record_states(llm.engine)
    outs, ids = run_staggered(llm.engine, prompts)
    return SimpleNamespace(outs=outs, engine=llm.engine, states={i: states[r] for i, r in ids.items()})


@pytest.fixture(scope="module")
def greedy_outputs(plain_greedy):
    return plain_greedy.outs, plain_greedy.engine


class OracleDrafts:
    """The tiny model's executor with drafts that are mostly right: the known greedy continuation
    (a plain run's), each token replaced by another with probability `wrong` from a seeded stream.
    With random weights the model's own draft head is almost never right, which would leave
    acceptance, multi-row advances and rollback at every offset untested."""

    def __init__(self, engine, truth: dict, wrong: float, seed: int = 0):
        self.inner, self.engine, self.truth, self.wrong = engine.executor, engine, truth, wrong
        self.rng = random.Random(seed)
        for k in ("num_slots", "num_pages", "page_tokens", "vocab_size", "max_draft_len"):
            setattr(self, k, getattr(self.inner, k))
        self.block = self.inner.program.cfg.dspark_block_size

    def step(self, chunks):
        return self.inner.step(chunks)

    def reset_slot(self, slot):
        self.inner.reset_slot(slot)

    def draft(self, seqs):
        owner = {self.engine.cache.slot(s.request_id): s for s in self.engine.scheduler.running}
        drafts = []
        for d in seqs:
            full = self.truth[tuple(owner[d.slot].prompt_token_ids)]
            assert full[d.start] == d.first, "t* is off the greedy path: speculation changed a token"
            nxt = (full[d.start + 1:d.start + 1 + self.block] + [3] * self.block)[:self.block]
            drafts.append([t if self.rng.random() >= self.wrong else (t + 1) % self.vocab_size for t in nxt])
        return torch.tensor(drafts), torch.zeros(len(seqs), self.block)


ABORTS = {12: 2, 20: 6}  # engine step -> the prompt aborted before it
SPEC_PAGES = 3  # prompt 4 needs all 3 at its end: it or a newer sequence is preempted


@pytest.fixture(scope="module")
def spec_greedy(ckpt, prompts, plain_greedy):
    """The plain run's load with speculation (5 drafts, 30% of them wrong), on a pool small enough
    to preempt, with two requests aborted midway."""
    llm = LLM(MODEL, ckpt, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=320, num_pages=SPEC_PAGES,
              speculative=5)
    engine = llm.engine
    states = record_states(engine)
    truth = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain_greedy.outs)}
    engine.executor = OracleDrafts(engine, truth, wrong=0.3)
    outs, ids = run_staggered(engine, prompts, ABORTS)
    return SimpleNamespace(outs=outs, engine=engine, states={i: states[r] for i, r in ids.items() if r in states})


@ONE_WORKER
def test_greedy_continuous_batching_equals_the_reference(greedy_outputs, prompts, ref):
    outs, engine = greedy_outputs
    for i, o in enumerate(outs):
        assert o.finish_reason == "length" and o.prompt_token_ids == prompts[i] and len(o.token_ids) == GEN_TOKENS
        agree = reference_accepts(ref, prompts[i], o.token_ids)
        assert agree == GEN_TOKENS, f"prompt {i} ({PROMPT_LENS[i]} tokens): token {agree} differs"
    # and literally: the reference's own greedy loop for the one-token prompt
    assert outs[3].token_ids == reference_greedy(ref, prompts[3], GEN_TOKENS)
    assert engine.scheduler.num_preemptions == 0
    engine.cache.check_no_leak()
    # the engine really batched: far fewer steps than one sequence at a time would need
    assert engine.num_steps < GEN_TOKENS + max(ARRIVAL_STEP) + 4


@ONE_WORKER
def test_chunked_prefill_gives_the_same_tokens(ckpt, prompts, greedy_outputs):
    # a 37-row budget splits the 150- and 200-token prompts into chunks that straddle ratio-2 groups,
    # window edges and the 128-token page boundary, interleaved with the other sequences' decodes
    llm = LLM(MODEL, ckpt, max_num_seqs=4, max_num_batched_tokens=37, max_model_len=320)
    picked = [1, 2, 4]
    outs = llm.generate(prompt_token_ids=[prompts[i] for i in picked],
                        sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for i, o in zip(picked, outs):
        assert o.token_ids == greedy_outputs[0][i].token_ids[:6], f"prompt {i} differs under chunked prefill"
    assert llm.engine.num_steps >= (150 + 33 + 200) // 37
    # speculation is on by default, with the model's own draft head: its drafts were verified too
    assert llm.engine.num_speculative == 5 and llm.engine.spec_stats.drafts_verified > 0
    assert llm.last_run_stats["speculative"] == 5 and llm.last_run_stats["verify_rows_per_step"] > 1


@ONE_WORKER
def test_speculative_greedy_equals_plain_with_preemption_and_aborts(spec_greedy, plain_greedy):
    engine, st = spec_greedy.engine, spec_greedy.engine.spec_stats
    for i, (o, want) in enumerate(zip(spec_greedy.outs, plain_greedy.outs)):
        if i in ABORTS.values():
            assert o.finish_reason == "abort" and o.token_ids == want.token_ids[:len(o.token_ids)], i
        else:
            assert o.finish_reason == "length" and o.token_ids == want.token_ids, f"prompt {i} differs"
    assert any(o.metrics.num_preemptions for i, o in enumerate(spec_greedy.outs) if i not in ABORTS.values())
    assert st.drafts_accepted > 50 and st.drafts_verified - st.drafts_accepted > 50
    assert engine.num_steps < plain_greedy.engine.num_steps
    engine.cache.check_no_leak()
    assert engine.cache.free_pages == SPEC_PAGES and engine.cache.free_slots == 8


@ONE_WORKER
def test_speculative_rollback_leaves_every_cache_as_a_plain_run(spec_greedy, plain_greedy):
    """Every state buffer of every finished sequence (window rings of all layers and DSpark stages,
    compressor state, Engram history, compressed KV and index K on its pages), at every position
    its later steps could read, equals the plain run's bit for bit."""
    done = [i for i in range(len(PROMPT_LENS)) if i not in ABORTS.values()]
    assert set(done) <= set(spec_greedy.states)
    for i in done:
        got, want = spec_greedy.states[i], plain_greedy.states[i]
        assert got.keys() == want.keys()
        for name in want:
            assert all(torch.equal(a, b) for a, b in zip(got[name], want[name])), f"prompt {i}: {name} differs"
        assert sum(w[0].numel() for w in want.values()) > 0


def test_random_load_with_aborts_and_preemption(ckpt, ref):
    """120 requests with 20 pages for up to 32 sequences: first a burst of 12 prompts just under the
    128-token page boundary that fill the pool and all need a second page a few tokens later (so
    the newest are preempted), then 108 short requests (1-20 tokens, 1-4 new tokens) arriving over
    time, some aborted. Everything ends finished or aborted, nothing leaks, and greedy requests
    (the preempted ones above all) still equal the reference."""
    rng = random.Random(11)
    llm = LLM(MODEL, ckpt, max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=160, num_pages=20)
    engine = llm.engine
    specs = []  # (prompt, params, long)
    for i in range(120):
        long = i < 12
        prompt = [rng.randrange(3, 129280) for _ in range(rng.randint(126, 127) if long else rng.randint(1, 20))]
        if long or i % 3 == 0:
            params = SamplingParams(temperature=0, max_tokens=4 if long else rng.randint(1, 4), ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=i, max_tokens=rng.randint(1, 4))
        specs.append((prompt, params, long))
    queued, by_id, outs = 0, {}, {}
    while queued < len(specs) or engine.has_unfinished_requests():
        for _ in range(min(len(specs) - queued, 20 if queued == 0 else rng.randint(0, 20))):
            prompt, params, _ = specs[queued]
            by_id[engine.add_request(params=params, prompt_token_ids=prompt)] = queued
            queued += 1
        if rng.random() < 0.5:
            live = [rid for rid in by_id if rid not in outs and not specs[by_id[rid]][2]]
            if live:
                engine.abort_request(rng.choice(live))  # False (and harmless) if it just finished
        for o in engine.step():
            outs[o.request_id] = o
    assert len(outs) == len(specs)
    aborted = {rid for rid, o in outs.items() if o.finish_reason == "abort"}
    assert 5 <= len(aborted) < 60
    for rid, o in outs.items():
        prompt, params, _ = specs[by_id[rid]]
        if rid in aborted:
            assert len(o.token_ids) < params.max_tokens
        else:
            assert o.finish_reason in ("length", "stop") and 1 <= len(o.token_ids) <= params.max_tokens
    engine.cache.check_no_leak()
    assert engine.cache.free_pages == 20 and engine.cache.free_slots == 32
    assert engine.num_speculative == 5 and engine.spec_stats.verifies > 0  # all of it speculative (the default)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    preempted = [rid for rid, o in outs.items() if o.metrics.num_preemptions]
    assert preempted and engine.scheduler.num_preemptions >= len(preempted)
    for rid in preempted:
        prompt, params, _ = specs[by_id[rid]]
        if params.greedy:
            assert reference_accepts(ref, prompt, outs[rid].token_ids) == len(outs[rid].token_ids), rid
    short_greedy = [rid for rid, i in by_id.items() if specs[i][1].greedy and not specs[i][2]
                    and rid not in aborted][:6]
    for rid in short_greedy:
        prompt, params, _ = specs[by_id[rid]]
        assert outs[rid].token_ids == reference_greedy(ref, prompt, params.max_tokens), rid


def test_seeded_sampling_is_reproducible(ckpt):
    llm = LLM(MODEL, ckpt, max_num_seqs=4, max_model_len=256)
    texts = ["The quick brown fox", "Once upon a time"]

    def run(seed, prompts=texts):
        params = SamplingParams(temperature=0.8, top_p=0.95, top_k=200, seed=seed, max_tokens=6)
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    first = run(7)
    assert llm.engine.num_speculative == 5 and llm.engine.spec_stats.verifies > 0  # sampled with speculation
    assert run(7) == first
    assert run(8) != first
    # the same request beside a different neighbour samples the same tokens
    assert run(7, [texts[0], "Something else entirely, and longer than the rest"])[0] == first[0]


def test_generate_text_chat_and_progress_bar(ckpt, capsys):
    llm = LLM(MODEL, ckpt, max_num_seqs=2, max_model_len=64)
    outs = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3))
    assert capsys.readouterr().err.count("requests") >= 1  # tqdm's bar over requests
    (o,) = outs
    assert o.prompt == "Hello" and o.prompt_token_ids[0] == llm.tokenizer.bos_id
    assert len(o.token_ids) == 3 and o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert chat[0].prompt_token_ids == llm.tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert chat[0].prompt.endswith("<｜Assistant｜></think>")
    with pytest.raises(RequestError, match="System") as e:
        llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], use_tqdm=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("call,error,needle", [
    (lambda llm: llm.generate("", use_tqdm=False), RequestError, "empty"),
    (lambda llm: llm.generate(prompt_token_ids=[[]], use_tqdm=False), RequestError, "empty"),
    (lambda llm: llm.generate(prompt_token_ids=[[5] * 33], use_tqdm=False), RequestError, "max_model_len 32"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=0.0)), SamplingParamsError, "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), SamplingParamsError, "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(temperature=-1)), SamplingParamsError, "temperature"),
    (lambda llm: llm.generate(["a", "b"], [SamplingParams()]), RequestError, "1 sampling params for 2"),
])
def test_bad_requests_fail_in_one_line_and_queue_nothing(small_llm, call, error, needle):
    with pytest.raises(error) as e:
        call(small_llm)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not small_llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def small_llm(ckpt):
    return LLM(MODEL, ckpt, max_num_seqs=2, max_model_len=32)


def test_bad_engine_arguments_fail_in_one_line(ckpt, tmp_path):
    cases = [
        (dict(model=str(tmp_path / "no-such-model"), weights=ckpt), ConfigError, "unknown model"),
        (dict(model=MODEL, weights=tmp_path / "no-such-ckpt"), CheckpointError, "not a directory"),
        (dict(model=MODEL, weights=ckpt, target="sm90"), EngineConfigError, "compiled plan"),
        (dict(model=MODEL, weights=None), EngineConfigError, "weights"),
        (dict(model=MODEL, weights=ckpt, max_model_len=300, num_pages=2), EngineConfigError, "needs 3 pages"),
        (dict(model=MODEL, weights=ckpt, max_num_seqs=0), EngineConfigError, "max_num_seqs"),
        (dict(model=MODEL, weights=ckpt, speculative=-2), EngineConfigError, "speculative must be"),
        (dict(model=MODEL, weights=ckpt, speculative=6), EngineConfigError, "exceeds the draft block (5 drafts)"),
        (dict(model=MODEL, weights=ckpt, verify_budget=0), EngineConfigError, "verify_budget"),
        (dict(model=MODEL, weights=ckpt, fixed_acceptance=1.5), EngineConfigError, "fixed_acceptance must be"),
        (dict(model=MODEL, weights=ckpt, tensor_parallel_size=2), EngineConfigError, "tensor_parallel_size 2 is not"),
    ]
    for kwargs, error, needle in cases:
        with pytest.raises(error) as e:
            LLM(**kwargs)
        assert needle in str(e.value) and "\n" not in str(e.value), kwargs


def test_vllm_outputs_logprobs_and_the_tokenizer(small_llm, ref, prompts):
    """RequestOutput.outputs of CompletionOutputs (the flat fields are sample 0's); logprobs of the
    sampled tokens, speculated (the default), equal the reference model's log_softmax at each row."""
    llm = small_llm
    assert llm.get_tokenizer() is llm.tokenizer
    prompt = prompts[2][:12]
    spec_before = llm.engine.spec_stats.drafts_verified
    (out,) = llm.generate(prompt_token_ids=prompt, use_tqdm=False,
                          sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    assert llm.engine.spec_stats.drafts_verified > spec_before  # the logprobs came through verify rows
    (c,) = out.outputs
    assert out.finished and c.index == 0 and c.finish_reason == "length" and c.stop_reason is None
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (c.text, c.token_ids, "length", None)
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True) and len(c.token_ids) == 6
    want = torch.log_softmax(ref.prefill(ref.new_sequence(), prompt + c.token_ids[:-1], all_logits=True)[
        len(prompt) - 1:].float(), -1)
    for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        top = torch.sort(want[j], descending=True, stable=True).indices[:3].tolist()
        assert list(entry) == top and entry[token].rank == 1  # greedy: the sampled token is the top one
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(want[j, t]), abs=2e-3)
            assert lp.decoded_token == llm.tokenizer.decode([t])
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_n_samples_on_the_model(small_llm):
    llm = small_llm
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate("The sky is", params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert llm.generate("The sky is", params, use_tqdm=False)[0].outputs == out.outputs
    one = SamplingParams(temperature=1.0, seed=11, max_tokens=4, ignore_eos=True)
    assert llm.generate("The sky is", one, use_tqdm=False)[0].token_ids == out.outputs[0].token_ids


def test_prompt_dicts(small_llm):
    llm = small_llm
    ids = llm.tokenizer.encode("Hello there", add_bos=True)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt": "Hello there"}, "Hello there", {"prompt_token_ids": ids},
                         {"prompt": "shown", "prompt_token_ids": ids}], params, use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outs}) == 1 and all(o.prompt_token_ids == ids for o in outs)
    assert [o.prompt for o in outs] == ["Hello there", "Hello there", None, "shown"]
    (alone,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert alone.token_ids == outs[0].token_ids


def test_executor_draft_matches_the_reference(small_llm, ref, prompts):
    ex = small_llm.engine.executor
    prompt = prompts[2]
    ex.reset_slot(1)
    logits = ex.step([SeqChunk(1, 0, prompt, [0], sample=True)])
    first = int(torch.argmax(logits[0]))
    drafts, conf = ex.draft([DraftSeq(1, first, len(prompt))])
    seq = ref.new_sequence()
    ref.prefill(seq, prompt)
    want_drafts, want_conf = ref.draft(seq, first)
    assert drafts[0].tolist() == want_drafts
    assert torch.allclose(conf[0], want_conf, rtol=1e-3, atol=1e-4)


def test_cli_generate(ckpt, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n\n" + json.dumps("Second prompt") + "\n")
    rc = cli_main(["generate", "--model", MODEL, "--weights", str(ckpt), "--prompts", str(prompts),
                   "--max-tokens", "2", "--temperature", "0", "--max-model-len", "64"])
    out = capsys.readouterr().out
    assert rc == 0
    assert '[0] prompt: "Hello"' in out and '[1] prompt: "Second prompt"' in out
    assert "2 requests, " in out and "4 generated tokens" in out and "tokens/s" in out
    assert "speculative (5 drafts): mean accepted length " in out and "verify rows/step" in out
    assert "draft time" in out
    rc = cli_main(["generate", "--model", MODEL, "--weights", str(ckpt), "--prompt", "Hello", "--max-tokens", "2",
                   "--temperature", "0", "--max-model-len", "64", "--speculative", "off"])
    out = capsys.readouterr().out
    assert rc == 0 and "speculative" not in out and "2 generated tokens" in out
    bad = [(["--prompt", "x", "--top-p", "0"], "--top-p"), (["--prompt", "x", "--temperature", "-1"], "--temperature"),
           (["--prompt", ""], "empty"), (["--prompts", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
           (["--prompt", "x", "--speculative", "some"], "--speculative takes off or a number"),
           (["--prompt", "x", "--speculative", "9"], "exceeds the draft block")]
    for extra, needle in bad:
        rc = cli_main(["generate", "--model", MODEL, "--weights", str(ckpt), "--max-model-len", "64"] + extra)
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.startswith("deepinfer: error:") and needle in err and "\n" not in err, err
    rc = cli_main(["generate", "--model", "no-such-model", "--weights", str(ckpt), "--prompt", "x"])
    assert rc == 2 and "unknown model" in capsys.readouterr().err


def test_cli_version(capsys):
    from deepinfer.version import VERSION

    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"deepinfer {VERSION}\n"
