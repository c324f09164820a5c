"""Cache manager and scheduler, driven through the engine with a fake executor that behaves like a
real cache: it remembers, per slot and per page, exactly what it was fed, refuses a chunk that does
not continue its slot's history or whose pages do not hold that history, and derives each logits
row from the sequence's whole history. So any scheduling bug (wrong start, a page shared by two
live sequences, a lost token at preemption) changes tokens or raises, and the expected output of
every request is known without running a model."""
import dataclasses
import random

import pytest
import torch
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.runtime.cache import CacheFull, CacheManager
from deepinfer.runtime.engine import EngineConfigError, LLMEngine, RequestError
from deepinfer.runtime.executor import Executor
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.runtime.speculative import budget_from_curve, split_by_confidence

VOCAB = 50
EOS = 1


class FakeTokenizer:
    eos_id = EOS

    def encode(self, text, add_bos=False):
        return ([0] if add_bos else []) + [3 + (ord(c) % (VOCAB - 3)) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)

    def text_stream(self, skip_special_tokens=True):
        return FakeTextStream(self)


class FakeTextStream:
    """One character per token: each token's text is its own decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def push(self, token):
        return self.tokenizer.decode([token])

    def finish(self):
        return ""


def next_token(history: list[int]) -> int:
    """The fake model's greedy choice after `history`; never EOS, so lengths are decided by max_tokens."""
    return 2 + (sum((i + 1) * t for i, t in enumerate(history)) * 2654435761) % (VOCAB - 2)


class FakeExecutor:
    rollback = False  # SpecFakeExecutor: caches keyed by position, so a chunk may restart before the end

    def __init__(self, num_slots, num_pages, page_tokens=4):
        self.num_slots, self.num_pages, self.page_tokens, self.vocab_size = num_slots, num_pages, page_tokens, VOCAB
        self.history = {s: [] for s in range(num_slots)}
        self.page_data = {p: [None] * page_tokens for p in range(num_pages)}
        self.steps = self.rows = 0

    def reset_slot(self, slot):
        self.history[slot] = []

    def step(self, chunks):
        slots = [c.slot for c in chunks]
        assert len(set(slots)) == len(slots), "a slot twice in one step"
        pages = [p for c in chunks for p in c.pages]
        assert len(set(pages)) == len(pages), "a page shared by two sequences"
        rows = []
        for c in chunks:
            hist = self.history[c.slot]
            if self.rollback:  # rejected draft rows: positions from `start` on are rewritten
                assert c.start <= len(hist), f"slot {c.slot}: chunk starts at {c.start}, cache holds {len(hist)}"
                del hist[c.start:]
            assert c.start == len(hist), f"slot {c.slot}: chunk starts at {c.start}, cache holds {len(hist)}"
            end = c.start + len(c.tokens)
            assert len(c.pages) == -(-end // self.page_tokens), "pages do not cover the chunk exactly"
            for pos in range(c.start):  # the pages still hold this sequence's earlier tokens
                assert self.page_data[c.pages[pos // self.page_tokens]][pos % self.page_tokens] == hist[pos], \
                    f"slot {c.slot}: page content of position {pos} was overwritten"
            for pos, t in zip(range(c.start, end), c.tokens):
                self.page_data[c.pages[pos // self.page_tokens]][pos % self.page_tokens] = t
            hist.extend(c.tokens)
            if c.sample:
                for end in range(len(hist) - c.logit_rows + 1, len(hist) + 1):  # every verify row
                    row = torch.linspace(0, 1, VOCAB)  # a spread-out distribution for sampled requests
                    row[next_token(hist[:end])] = 5.0
                    rows.append(row)
        self.steps += 1
        self.rows += sum(len(c.tokens) for c in chunks)
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)

    def draft(self, seqs, block=3):
        """The fake model's own greedy continuation after t*, with zero confidence logits."""
        drafts = []
        for d in seqs:
            assert len(self.history[d.slot]) >= d.start, f"slot {d.slot}: drafting at {d.start} before it is cached"
            hist = self.history[d.slot][:d.start] + [d.first]  # (rows past `start` were rejected drafts)
            drafts.append(expected(hist, block))
        return torch.tensor(drafts), torch.zeros(len(seqs), block)


def expected(prompt, n):
    hist = list(prompt)
    for _ in range(n):
        hist.append(next_token(hist))
    return hist[len(prompt):]


def make_engine(num_slots=4, num_pages=8, page_tokens=4, **kw):
    ex = FakeExecutor(num_slots, num_pages, page_tokens)
    kw.setdefault("max_num_seqs", num_slots)
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_model_len", 32)
    return LLMEngine(ex, FakeTokenizer(), **kw), ex


def run_all(engine, limit=10_000):
    outs = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outs
        for o in engine.step():
            outs[o.request_id] = o
    raise AssertionError("engine did not finish")


# ---- cache manager ------------------------------------------------------------------------------

def test_cache_manager_allocates_grows_and_frees_without_leaks():
    cm = CacheManager(num_slots=2, num_pages=5, page_tokens=128)
    assert cm.pages_for(0) == 0 and cm.pages_for(1) == 1 and cm.pages_for(128) == 1 and cm.pages_for(129) == 2
    assert cm.allocate("a", 200) == 0 and cm.pages("a") == [0, 1]
    assert cm.free_tokens == 3 * 128
    assert cm.grow("a", 256) == [0, 1] and cm.grow("a", 257) == [0, 1, 2]
    # a verify step's rejected rows: back to the pages of the accepted tokens, and the page reused next
    assert cm.shrink("a", 256) == [0, 1] and cm.free_pages == 3 and cm.shrink("a", 200) == [0, 1]
    assert cm.grow("a", 257) == [0, 1, 2]
    assert cm.allocate("b", 1) == 1
    with pytest.raises(CacheFull):
        cm.allocate("c", 1)  # no slot left
    with pytest.raises(CacheFull):
        cm.grow("b", 129 + 128)  # needs 2 more pages, 1 free
    assert cm.pages("b") == [3]  # all or nothing
    assert not cm.can_cover("a", 5 * 128) and cm.can_cover("a", 4 * 128)
    cm.free("a")
    cm.free("a")  # freeing twice is harmless
    assert cm.free_pages == 4 and cm.free_slots == 1
    cm.check_no_leak()
    cm.free("b")
    assert cm.free_pages == 5 and cm.free_slots == 2
    cm.check_no_leak()
    assert cm.allocate("d", 1) == 0 and cm.pages("d") == [0]  # lowest ids first again


# ---- scheduler through the engine ---------------------------------------------------------------

def test_preemption_by_recompute_gives_the_same_tokens():
    # 5 pages of 4 tokens; two sequences growing to 12 tokens (3 pages) each cannot both fit: the newer is
    # preempted, restarts with its generated tokens as prompt, and still produces the same tokens
    engine, ex = make_engine(num_slots=2, num_pages=5, page_tokens=4, max_num_batched_tokens=64, max_model_len=20)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    a = engine.add_request(prompt_token_ids=[5, 6, 7, 8], params=greedy)
    b = engine.add_request(prompt_token_ids=[9, 10, 11, 12], params=greedy)
    outs = run_all(engine)
    assert engine.scheduler.num_preemptions >= 1
    assert outs[a].token_ids == expected([5, 6, 7, 8], 8)
    assert outs[b].token_ids == expected([9, 10, 11, 12], 8)
    engine.cache.check_no_leak()
    assert engine.cache.free_pages == 5 and engine.cache.free_slots == 2


def test_chunked_prefill_respects_the_token_budget():
    engine, ex = make_engine(num_slots=3, num_pages=30, page_tokens=4, max_num_batched_tokens=5, max_model_len=40)
    prompts = [list(range(3, 3 + n)) for n in (17, 3, 11)]
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=4))
           for p in prompts]
    rows_before = 0
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        assert ex.rows - rows_before <= 5
        rows_before = ex.rows
    for rid, p in zip(ids, prompts):
        assert outs[rid].token_ids == expected(p, 4)
    # 31 prompt rows + 3 * 3 decode rows, no recompute
    assert ex.rows == 31 + 9


def test_random_load_with_aborts_and_preemption_leaks_nothing():
    rng = random.Random(7)
    engine, ex = make_engine(num_slots=6, num_pages=10, page_tokens=4, max_num_batched_tokens=20, max_model_len=24)
    want, aborted, outs = {}, set(), {}
    pending = 300
    while pending or engine.has_unfinished_requests():
        for _ in range(min(rng.randint(0, 4), pending)):
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 16))]
            n = rng.randint(1, 8)
            rid = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=n))
            want[rid] = expected(prompt, n)
            pending -= 1
        if rng.random() < 0.15 and want:
            victim = rng.choice(sorted(want))
            if engine.abort_request(victim):
                aborted.add(victim)
        for o in engine.step():
            outs[o.request_id] = o
    assert engine.scheduler.num_preemptions > 0
    assert set(outs) == set(want)
    for rid, o in outs.items():
        if rid in aborted:
            assert o.finish_reason == "abort"
            assert o.token_ids == want[rid][:len(o.token_ids)]
        else:
            assert o.finish_reason == "length" and o.token_ids == want[rid], rid
    engine.cache.check_no_leak()
    assert engine.cache.free_pages == 10 and engine.cache.free_slots == 6
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_finish_reasons_and_stop_strings():
    engine, _ = make_engine(num_slots=4, num_pages=40, max_model_len=12)
    prompt = [4, 5, 6]
    gen = expected(prompt, 9)
    text = FakeTokenizer().decode(gen)
    stop_id = engine.add_request(prompt_token_ids=prompt,
                                 params=SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[gen[2]]))
    stop_str = engine.add_request(prompt_token_ids=prompt,
                                  params=SamplingParams(temperature=0, max_tokens=9, stop=[text[3:5]]))
    length = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=9))
    outs = run_all(engine)
    first = min(i for i in range(len(gen)) if gen[i] == gen[2])
    assert outs[stop_id].finish_reason == "stop" and outs[stop_id].token_ids == gen[:first + 1]
    assert outs[stop_id].stop_reason == gen[2]
    assert outs[stop_id].text == text[:first]  # the stop token's text is left out
    at = text.find(text[3:5])
    assert outs[stop_str].finish_reason == "stop" and outs[stop_str].text == text[:at]
    assert outs[stop_str].stop_reason == text[3:5]
    # max_model_len 12 ends it before max_tokens: 3 prompt + 9 generated = 12
    assert outs[length].finish_reason == "length" and outs[length].token_ids == gen
    m = outs[length].metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time


def test_eos_ends_a_request_unless_ignored():
    engine, ex = make_engine()
    real_step = ex.step

    def eos_after_two(chunks):
        logits = real_step(chunks)
        for i, c in enumerate(c for c in chunks if c.sample):
            if len(ex.history[c.slot]) >= 5:
                logits[i, EOS] = 100.0
        return logits

    ex.step = eos_after_two
    stops = engine.add_request(prompt_token_ids=[3, 4, 5], params=SamplingParams(temperature=0, max_tokens=6))
    ignores = engine.add_request(prompt_token_ids=[3, 4, 5],
                                 params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outs = run_all(engine)
    assert outs[stops].finish_reason == "stop" and outs[stops].token_ids[-1] == EOS
    assert len(outs[stops].token_ids) == 3 and outs[stops].stop_reason == EOS
    assert outs[ignores].finish_reason == "length" and len(outs[ignores].token_ids) == 6


def test_seeded_sampling_does_not_depend_on_batch_or_preemption():
    params = SamplingParams(temperature=2.0, top_p=0.9, seed=1234, max_tokens=10)
    alone, _ = make_engine(num_slots=1, num_pages=40, max_model_len=20)
    rid = alone.add_request(prompt_token_ids=[7, 8, 9], params=params)
    ref = run_all(alone)[rid].token_ids
    crowded, _ = make_engine(num_slots=4, num_pages=6, max_model_len=20, max_num_batched_tokens=3)
    others = [crowded.add_request(prompt_token_ids=[3 + i] * (2 + i), params=SamplingParams(seed=i, max_tokens=10))
              for i in range(3)]
    rid = crowded.add_request(prompt_token_ids=[7, 8, 9], params=params)
    outs = run_all(crowded)
    assert crowded.scheduler.num_preemptions > 0
    assert outs[rid].token_ids == ref
    assert len(set(ref)) > 3  # temperature 2 over a spread distribution really samples
    assert all(outs[o].finish_reason == "length" for o in others)


def test_request_and_engine_errors_are_one_line():
    engine, _ = make_engine(max_model_len=16)
    for kwargs, needle in [({"prompt_token_ids": []}, "empty"), ({"prompt": ""}, "empty"),
                           ({"prompt_token_ids": [3] * 17}, "max_model_len"),
                           ({"prompt_token_ids": [3, VOCAB]}, "not an id"), ({}, "prompt")]:
        with pytest.raises(RequestError) as e:
            engine.add_request(**kwargs)
        assert needle in str(e.value) and "\n" not in str(e.value)
    engine.add_request(prompt_token_ids=[3], request_id="x")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request(prompt_token_ids=[3], request_id="x")
    assert engine.abort_request("x") and not engine.abort_request("x") and not engine.abort_request("nope")
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    with pytest.raises(EngineConfigError, match="max_model_len 100 needs 25 pages"):
        make_engine(num_pages=8, max_model_len=100)
    with pytest.raises(EngineConfigError, match="max_num_seqs"):
        make_engine(num_slots=2, max_num_seqs=3)
    assert isinstance(FakeExecutor(1, 1), Executor)


def drive_load(engine, rng, request, abort_rate, n=40):
    """Requests request(i) -> (prompt ids, params) for i < n, 0-3 added before each step, a random
    one aborted at `abort_rate` a step, until all end; then nothing leaks (9 pages, 4 slots).
    Returns request id -> (finish reason, token ids)."""
    outs, ids, pending = {}, [], list(range(n))
    while pending or engine.has_unfinished_requests():
        for _ in range(min(len(pending), rng.randint(0, 3))):
            i = pending.pop(0)
            prompt, params = request(i)
            ids.append(engine.add_request(prompt_token_ids=prompt, params=params, request_id=f"r{i}"))
        if ids and rng.random() < abort_rate:
            engine.abort_request(rng.choice(ids))
        for o in engine.step():
            outs[o.request_id] = (o.finish_reason, o.token_ids)
    engine.cache.check_no_leak()
    assert engine.cache.free_pages == 9 and engine.cache.free_slots == 4
    return outs


def test_overlapped_scheduling_gives_the_same_outputs():
    """With overlap the engine plans step N+1 (placeholder tokens for step N's samples) before it
    samples step N. Same load with preemptions, aborts and stop tokens, with and without: every
    request ends the same way with the same tokens, and nothing leaks."""
    import random

    def run(overlap):
        engine, ex = make_engine(num_slots=4, num_pages=9, page_tokens=4, max_num_batched_tokens=12,
                                 max_model_len=28, overlap=overlap)
        rng = random.Random(5)

        def request(i):
            params = SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=rng.randint(1, 9),
                                    stop_token_ids=[7] if i % 5 == 0 else None)
            return [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 10))], params

        outs = drive_load(engine, rng, request, abort_rate=0.1)
        return outs, engine.scheduler.num_preemptions, engine.num_steps

    plain, pre_a, steps_a = run(False)
    overlapped, pre_b, steps_b = run(True)
    assert pre_a and pre_b  # the load preempts in both
    assert len(plain) == 40
    # aborts land at other points of a request's life when a step is in flight: compare the rest
    done = {k for k, v in plain.items() if v[0] != "abort"} & {k for k, v in overlapped.items() if v[0] != "abort"}
    assert len(done) >= 25
    assert {k: plain[k] for k in done} == {k: overlapped[k] for k in done}



class SubmitFakeExecutor(FakeExecutor):
    """FakeExecutor with the CUDA executor's submit: `argmax` returns each row's argmax id (int64)
    in place of the logits; `feed` (with feed_steps) puts rows of an earlier step's argmax ids
    into token rows, as the device would; counts the steps of each kind."""
    argmax_steps = True

    def __init__(self, *a, feed_steps=False, **kw):
        super().__init__(*a, **kw)
        self.feed_steps = feed_steps
        self.kinds = {"logits": 0, "argmax": 0, "fed": 0}

    def submit(self, chunks, argmax=False, feed=None):
        if feed is not None:
            prev, pairs = feed
            assert self.feed_steps and pairs
            flat = [t for c in chunks for t in c.tokens]
            for dst, src in pairs:
                assert flat[dst] == -1, "fed into a row that holds a known token"
                flat[dst] = int(prev.ids[src])
            it = iter(flat)
            chunks = [dataclasses.replace(c, tokens=[next(it) for _ in c.tokens]) for c in chunks]
            self.kinds["fed"] += 1
        assert all(t >= 0 for c in chunks for t in c.tokens), "a placeholder reached the model"
        logits = self.step(chunks)
        self.kinds["argmax" if argmax else "logits"] += 1
        out = logits.argmax(-1) if argmax else logits

        class Handle:
            ids = logits.argmax(-1)

            def result(self):
                return out
        return Handle()


def test_greedy_steps_take_argmax_ids_with_the_same_tokens():
    """A step whose sampled rows are all plain greedy (no penalties, masks, logprobs or drafts)
    asks the executor for argmax ids, not logits (LLMEngine._argmax_only); any other row makes the
    step take logits. A mixed load (greedy, sampled, penalised greedy, logprobs, min_tokens) gives
    the tokens of an executor without submit."""
    import random

    def run(ex_cls):
        ex = ex_cls(4, 9, 4)
        engine = LLMEngine(ex, FakeTokenizer(), max_num_seqs=4, max_num_batched_tokens=12, max_model_len=28)
        rng = random.Random(7)
        outs = {}
        for i in range(24):
            kind = i % 6
            params = SamplingParams(temperature=2.0 if kind == 1 else 0, seed=i, max_tokens=rng.randint(1, 8),
                                    repetition_penalty=1.5 if kind == 2 else 1.0,
                                    logprobs=2 if kind == 3 else None, min_tokens=2 if kind == 4 else 0)
            engine.add_request(prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))],
                               params=params, request_id=f"r{i}")
        outs = {k: (o.finish_reason, o.token_ids) for k, o in run_all(engine).items()}
        return outs, ex

    plain, _ = run(FakeExecutor)
    fast, ex = run(SubmitFakeExecutor)
    assert fast == plain and len(plain) == 24
    assert ex.kinds["argmax"] > 0 and ex.kinds["logits"] > 0, ex.kinds


# ---- speculative decoding -----------------------------------------------------------------------

class SpecFakeExecutor(FakeExecutor):
    """Runs verify chunks the way the model does: caches keyed by position (a chunk may start
    before the end of its slot's history, where rejected draft rows were, and rewrites from
    there). Its drafts are the fake model's own continuation after t*, each replaced by a wrong
    token with probability `wrong` (a seeded stream), and its confidence logits vary by sequence
    and row, so verification accepts and rejects at every offset and the confidence split has
    something to rank."""
    rollback = True
    max_draft_len = 3

    def __init__(self, *args, wrong=0.3, seed=0, **kw):
        super().__init__(*args, **kw)
        self.rng, self.wrong = random.Random(seed), wrong
        self.proposed = {}  # (slot, position of t*) -> the drafts proposed there
        self.chunks = []  # every step's chunks

    def step(self, chunks):
        self.chunks.append(list(chunks))
        return super().step(chunks)

    def draft(self, seqs, block=3):
        drafts, conf = super().draft(seqs, block)
        for i, d in enumerate(seqs):
            for j in range(block):
                if self.rng.random() < self.wrong:
                    drafts[i, j] = 2 + (int(drafts[i, j]) - 1) % (VOCAB - 2)  # another token, never EOS
                conf[i, j] = ((d.slot * 7 + d.start * 3 + j * 5) % 11 - 5) / 2
            self.proposed[d.slot, d.start] = drafts[i].tolist()
        return drafts, conf


def make_spec_engine(num_slots=4, num_pages=8, page_tokens=4, wrong=0.3, **kw):
    ex = SpecFakeExecutor(num_slots, num_pages, page_tokens, wrong=wrong)
    kw.setdefault("max_num_seqs", num_slots)
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_model_len", 32)
    return LLMEngine(ex, FakeTokenizer(), **kw), ex


def check_pages_exact(engine):
    """Between steps every running sequence holds exactly the pages of its cached tokens."""
    engine.cache.check_no_leak()
    for seq in engine.scheduler.running:
        assert len(engine.cache.pages(seq.request_id)) == engine.cache.pages_for(seq.num_cached), seq.request_id


def random_load(engine, rng, specs, check=None):
    """Queue `specs` [(prompt, params)] a few per step, abort some; returns {index: output}."""
    outs, ids, queued = {}, {}, 0
    while queued < len(specs) or engine.has_unfinished_requests():
        for _ in range(min(len(specs) - queued, rng.randint(0, 5))):
            prompt, params = specs[queued]
            ids[engine.add_request(prompt_token_ids=prompt, params=params)] = queued
            queued += 1
        if ids and rng.random() < 0.12:
            engine.abort_request(rng.choice(sorted(ids)))
        for o in engine.step():
            outs[ids[o.request_id]] = o
        if check:
            check(engine)
    return outs


def load_specs(rng, n):
    specs = []
    text = FakeTokenizer().decode
    for i in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 16))]
        max_tokens = rng.randint(1, 10)
        gen = expected(prompt, max_tokens)
        kind = i % 5
        if kind == 0:
            params = SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=max_tokens)
        elif kind == 1:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[gen[len(gen) // 2]])
        elif kind == 2 and len(gen) > 3:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=[text(gen)[2:4]])
        else:
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
        specs.append((prompt, params))
    return specs


def test_speculative_load_gives_the_plain_tokens_and_leaks_nothing():
    """200 requests (greedy, stop tokens, stop strings, seeded sampling) arriving over time with
    aborts, on a pool small enough to preempt and a budget small enough to chunk prompts and cut
    drafts: with speculation every finished greedy request ends exactly as without it (tokens,
    text, reason); aborted ones hold a prefix of it; between steps every running sequence holds
    exactly the pages of its cached tokens and nothing leaks; the same load twice gives the same
    outputs, sampled requests included."""
    specs = load_specs(random.Random(3), 200)

    def run(spec):
        kw = dict(num_slots=6, num_pages=10, page_tokens=4, max_num_batched_tokens=12, max_model_len=24)
        engine, ex = make_spec_engine(**kw, speculative=3) if spec else make_engine(**kw)
        outs = random_load(engine, random.Random(9), specs, check_pages_exact if spec else None)
        assert len(outs) == len(specs) and not engine.scheduler.running and not engine.scheduler.waiting
        assert engine.cache.free_pages == 10 and engine.cache.free_slots == 6
        engine.cache.check_no_leak()
        return {i: (o.finish_reason, o.token_ids, o.text, o.stop_reason) for i, o in outs.items()}, engine

    plain, plain_engine = run(False)
    spec, engine = run(True)
    st = engine.spec_stats
    assert st.drafts_accepted > 100 and st.drafts_verified - st.drafts_accepted > 100
    assert engine.scheduler.num_preemptions > 0 and engine.num_steps < plain_engine.num_steps
    compared = 0
    for i, (prompt, params) in enumerate(specs):
        if not params.greedy or plain[i][0] == "abort":
            continue
        if spec[i][0] == "abort":
            assert plain[i][1][:len(spec[i][1])] == spec[i][1], i
        else:
            assert spec[i] == plain[i], i
            compared += 1
    assert compared > 100
    for i, (prompt, params) in enumerate(specs):
        if not params.greedy and spec[i][0] != "abort":
            assert spec[i][0] == "length" and len(spec[i][1]) == min(params.max_tokens, 24 - len(prompt))
    again, _ = run(True)
    assert again == spec


def test_bucketed_verification_keeps_verify_steps_in_their_buckets():
    """An executor that verifies in buckets of at most 2 sequences (a device plan's verify
    buckets): under a random load with aborts and preemption, a step carries drafts only when it
    is decode rows alone of at most 2 sequences and no waiting request could be admitted instead;
    the tokens are the plain run's, and nothing leaks."""
    specs = [(p, SamplingParams(temperature=0, max_tokens=m.max_tokens))
             for p, m in load_specs(random.Random(5), 80)]
    kw = dict(num_slots=6, num_pages=10, page_tokens=4, max_num_batched_tokens=12, max_model_len=24)
    plain_engine, _ = make_engine(**kw)
    plain = random_load(plain_engine, random.Random(2), specs)
    engine, ex = make_spec_engine(**kw, speculative=3)
    engine.scheduler.verify_seqs = 2
    spec = random_load(engine, random.Random(2), specs, check_pages_exact)
    with_drafts = [c for c in ex.chunks if any(len(x.tokens) > 1 and x.logit_rows > 1 for x in c)]
    assert with_drafts and engine.spec_stats.verifies > 0
    for chunks in with_drafts:
        assert len(chunks) <= 2 and all(x.logit_rows == len(x.tokens) for x in chunks), chunks
    assert any(len(c) > 2 for c in ex.chunks)  # wider steps ran, without drafts
    for i, o in spec.items():
        if o.finish_reason != "abort" and plain[i].finish_reason != "abort":
            assert o.token_ids == plain[i].token_ids, i
    engine.cache.check_no_leak()


def test_stops_inside_accepted_drafts_emit_nothing_past_them():
    """Drafts always right: a verify accepts all 3 and the stop lands inside them. Stop token,
    stop string, max_tokens and max_model_len end the request exactly where a plain run does."""
    prompt = [4, 5, 6]
    gen = expected(prompt, 9)
    text = FakeTokenizer().decode(gen)
    cases = [SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[gen[2]]),
             SamplingParams(temperature=0, max_tokens=9, stop=[text[5:7]]),
             SamplingParams(temperature=0, max_tokens=6),
             SamplingParams(temperature=0, max_tokens=20)]  # max_model_len 12 ends it first
    results = []
    for spec in (False, True):
        engine, ex = (make_spec_engine(wrong=0.0, max_model_len=12, num_pages=40) if spec
                      else make_engine(max_model_len=12, num_pages=40))
        ids = [engine.add_request(prompt_token_ids=prompt, params=p) for p in cases]
        outs = run_all(engine)
        results.append([(outs[r].finish_reason, outs[r].token_ids, outs[r].text, outs[r].stop_reason) for r in ids])
        if spec:
            assert engine.spec_stats.drafts_accepted == engine.spec_stats.drafts_verified > 0
            assert all(max(c.logit_rows for c in step) <= 4 for step in ex.chunks)
        engine.cache.check_no_leak()
    assert results[0] == results[1]
    assert [r[0] for r in results[1]] == ["stop", "stop", "length", "length"]
    assert len(results[1][3][1]) == 12 - 3


def test_a_short_token_budget_verifies_fewer_drafts():
    engine, ex = make_spec_engine(num_pages=40, wrong=0.0, max_num_batched_tokens=5, speculative=3)
    prompts = [[3, 4], [5, 6, 7], [8]]
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=12)) for p in prompts]
    outs = run_all(engine)
    for rid, p in zip(ids, prompts):
        assert outs[rid].token_ids == expected(p, 12)
    assert all(sum(len(c.tokens) for c in step) <= 5 for step in ex.chunks)
    fed = [c.logit_rows - 1 for step in ex.chunks for c in step if c.logit_rows > 1]
    assert 3 in fed and (1 in fed or 2 in fed)  # some verified all drafts, some fewer for lack of budget


def test_split_by_confidence_ranks_rates_with_ties_to_the_lower_sequence_and_draft():
    rates = [[0.9, 0.5, 0.2], [0.9, 0.8, 0.1], [0.3, 0.3, 0.3]]
    assert split_by_confidence(rates, 3) == [0, 0, 0]  # a row each for t*: nothing left to verify
    assert split_by_confidence(rates, 2) == [0, 0, 0]  # fewer rows than sequences: no drafts at all
    assert split_by_confidence(rates, 4) == [1, 0, 0]  # 0.9 tie: the lower sequence first
    assert split_by_confidence(rates, 3 + 4) == [2, 2, 0]  # 0.9, 0.9, 0.8, 0.5
    assert split_by_confidence(rates, 3 + 5) == [2, 2, 1]  # 0.3 ties inside sequence 2: its first draft
    assert split_by_confidence(rates, 3 + 9) == [3, 3, 3] == split_by_confidence(rates, 100)
    assert split_by_confidence([[0.5], [0.5]], 3) == [1, 0]
    assert split_by_confidence([], 4) == []
    rng = random.Random(1)
    for _ in range(200):  # cumulative products: the chosen pairs are always prefixes, and as many as fit
        rates = [list(torch.cumprod(torch.rand(rng.randint(0, 5), generator=torch.Generator().manual_seed(
            rng.randrange(10**6))), 0).tolist()) for _ in range(rng.randint(1, 6))]
        budget = rng.randint(1, 30)
        counts = split_by_confidence(rates, budget)
        total = sum(len(r) for r in rates)
        assert sum(counts) == min(max(budget - len(rates), 0), total)
        ranked = sorted((-a, i, j) for i, r in enumerate(rates) for j, a in enumerate(r))
        assert {(i, j) for _, i, j in ranked[:sum(counts)]} == {(i, j) for i, c in enumerate(counts) for j in range(c)}


def test_verify_budget_gives_each_sequence_a_prefix_of_its_drafts_within_the_budget():
    budget = 6
    engine, ex = make_spec_engine(num_slots=4, num_pages=60, max_num_batched_tokens=64, max_model_len=40,
                                  speculative=3, verify_budget=budget)
    prompts = [[3 + i] * (2 + i) for i in range(4)]
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=20)) for p in prompts]
    outs = run_all(engine)
    for rid, p in zip(ids, prompts):
        assert outs[rid].token_ids == expected(p, 20)
    binding = 0
    for step in ex.chunks:
        decode = [c for c in step if (c.slot, c.start) in ex.proposed]  # chunks that started at a drafted t*
        for c in decode:
            assert c.tokens[1:] == ex.proposed[c.slot, c.start][:len(c.tokens) - 1]  # a prefix of its drafts
        rows = sum(len(c.tokens) for c in decode)
        assert rows <= max(budget, len(decode))
        binding += rows == budget and len(decode) > 1
    assert binding >= 3  # the budget really cut the drafts, among several sequences
    unbudgeted, ex2 = make_spec_engine(num_slots=4, num_pages=60, max_num_batched_tokens=64, max_model_len=40,
                                       speculative=3)
    for p in prompts:
        unbudgeted.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=20))
    run_all(unbudgeted)
    assert max(sum(len(c.tokens) for c in step if (c.slot, c.start) in ex2.proposed) for step in ex2.chunks) > budget


def test_speculation_settings():
    for kwargs, needle in [({"speculative": 4}, "exceeds the draft block (3 drafts)"),
                           ({"speculative": -1}, "speculative must be"), ({"speculative": "3"}, "speculative must be"),
                           ({"speculative": 1.5}, "speculative must be"), ({"verify_budget": 0}, "verify_budget"),
                           ({"speculative": 2, "overlap": True}, "overlap")]:
        with pytest.raises(EngineConfigError) as e:
            make_spec_engine(**kwargs)
        assert needle in str(e.value) and "\n" not in str(e.value), kwargs
    with pytest.raises(EngineConfigError, match="cannot run") as e:
        make_engine(speculative=2)  # an executor without verify steps
    assert "\n" not in str(e.value)
    assert make_engine(speculative=None)[0].num_speculative == 0  # default: off where it cannot verify
    assert make_engine(speculative=False)[0].num_speculative == 0
    on = make_spec_engine()[0]
    assert on.num_speculative == 3 and not on.overlap  # default: on, and no overlap with it
    assert make_spec_engine(speculative=True)[0].num_speculative == 3
    assert make_spec_engine(speculative=2)[0].num_speculative == 2
    off, ex = make_spec_engine(speculative=0)
    rid = off.add_request(prompt_token_ids=[5, 6], params=SamplingParams(temperature=0, max_tokens=5))
    assert run_all(off)[rid].token_ids == expected([5, 6], 5) and not ex.proposed


def replay_fixed_acceptance(chunks_per_step, p: float, seed: int) -> int:
    """The drafts fixed acceptance accepts over these steps: per verify chunk in order, one draw
    from a torch.Generator seeded with `seed` per draft until the first draw >= p."""
    g, accepted = torch.Generator().manual_seed(seed), 0
    for chunks in chunks_per_step:
        for c in chunks:
            for _ in range(c.logit_rows - 1 if c.sample else 0):
                if float(torch.rand((), generator=g, dtype=torch.float64)) >= p:
                    break
                accepted += 1
    return accepted


def test_fixed_acceptance_accepts_each_draft_with_p_from_a_seeded_stream():
    """Benchmark mode: each draft is accepted while a draw from the engine-seeded stream is < p,
    whatever the target thinks of it; the token after the accepted drafts is the target's own
    (the fake model's argmax after them); rollback, pages and stats are the normal path's."""
    prompts = [[3 + i] * (2 + i) for i in range(4)]

    def run(p, seed=5, wrong=0.3):
        engine, ex = make_spec_engine(num_slots=4, num_pages=60, max_num_batched_tokens=64, max_model_len=40,
                                      speculative=3, wrong=wrong, fixed_acceptance=p, seed=seed)
        outs, ids = {}, [engine.add_request(prompt_token_ids=q, params=SamplingParams(temperature=0, max_tokens=20))
                         for q in prompts]
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = o.token_ids
            check_pages_exact(engine)
            for seq in engine.scheduler.running:  # the rates §5.6 ranks: this mode's own acceptance
                assert seq.draft_rates == pytest.approx([p ** (j + 1) for j in range(len(seq.drafts))])
        assert engine.cache.free_pages == 60
        return [outs[r] for r in ids], engine, ex

    plain = [expected(q, 20) for q in prompts]
    outs, engine, _ = run(0.0)  # every draft rejected: the target's own tokens, a plain run's
    assert outs == plain and engine.spec_stats.drafts_verified > 0 == engine.spec_stats.drafts_accepted
    outs, engine, _ = run(1.0, wrong=1.0)  # every draft accepted, every draft wrong
    st = engine.spec_stats
    assert st.drafts_accepted == st.drafts_verified > 0
    # a wrong draft never equals the fake model's choice; every other token is that choice
    off_path = sum(t != next_token(q + o[:i]) for q, o in zip(prompts, outs) for i, t in enumerate(o))
    assert off_path == st.drafts_accepted and all(len(o) == 20 for o in outs)
    outs, engine, ex = run(0.75)
    st = engine.spec_stats
    assert st.drafts_accepted == replay_fixed_acceptance(ex.chunks, 0.75, 5)
    assert 0 < st.drafts_accepted < st.drafts_verified
    assert run(0.75)[0] == outs and run(0.75, seed=6)[1].spec_stats.drafts_accepted != st.drafts_accepted
    for bad in (1.5, -0.1, True, "0.5", float("nan")):
        with pytest.raises(EngineConfigError, match="^fixed_acceptance must be") as e:
            make_spec_engine(fixed_acceptance=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(EngineConfigError, match="speculative decoding, which is off"):
        make_spec_engine(fixed_acceptance=0.5, speculative=0)


def test_budget_from_curve_maximises_expected_tokens_per_second():
    rates = [[0.9, 0.8, 0.1], [0.5, 0.2, 0.1]]
    decode, ragged = ("decode_b2", 2, 2, 1.0), ("verify_b2r4", 2, 4, 1.1)
    # decode 2 / 1.0; 4 rows: 2 + 0.9 + 0.8 = 3.7 / 1.1 = 3.36; all 8 rows: 4.6 / 1.5 = 3.07
    assert budget_from_curve(rates, 0, [decode, ragged, ("verify_b2", 2, 8, 1.5)]) == 4
    assert budget_from_curve(rates, 0, [decode, ragged, ("verify_b2", 2, 8, 1.2)]) == 8  # 4.6 / 1.2 = 3.83
    assert budget_from_curve(rates, 0, [decode, ("verify_b2", 2, 8, 9.0)]) == 2  # verifying costs more than it gives
    assert budget_from_curve([[0.0] * 3] * 2, 0, [decode, ragged]) == 2  # nothing to gain
    assert budget_from_curve(rates + [[0.5]], 0, [decode, ragged]) is None  # no shape holds 3 sequences
    # a sequence without drafts takes one of the rows; a budget whose drafts fit a smaller shape
    # costs that shape's time (ties to the smaller budget)
    assert budget_from_curve([[0.9]], 1, [decode, ("verify_b2r4", 2, 4, 1.0)]) == 3
    assert budget_from_curve([[0.9], [0.9]], 0, [decode, ("verify_b2r4", 2, 4, 1.0), ("verify_b2", 2, 8, 1.0)]) == 4
    # drafts still to be made cost their draft call too: 4.6 / (1.2 + 1.5) < 2 / 1.0
    assert budget_from_curve(rates, 0, [decode, ("verify_b2", 2, 8, 1.2)], draft_seconds=1.5) == 2
    # a decode shape holds only steps without drafts: 1 draft needs the verify shape's time
    assert budget_from_curve([[0.9], [0.0]], 0, [("decode_b4", 4, 4, 1.0), ("verify_b2", 2, 8, 1.8)]) == 2


def curve_run(curve=None, shapes=None, **kw):
    engine, ex = make_spec_engine(num_slots=4, num_pages=60, max_num_batched_tokens=64, max_model_len=40,
                                  speculative=3, **kw)
    if curve is not None:
        ex.step_time_curve = curve
    if shapes is not None:
        ex.verify_shapes = shapes
    prompts = [[3 + i] * (2 + i) for i in range(4)]
    ids = [engine.add_request(prompt_token_ids=q, params=SamplingParams(temperature=0, max_tokens=20))
           for q in prompts]
    outs = run_all(engine)
    assert [outs[r].token_ids for r in ids] == [expected(q, 20) for q in prompts]
    # per step: its sequences, and the rows of its chunks that started at a drafted t*
    steps = [(len(step), sum(len(c.tokens) for c in step if (c.slot, c.start) in ex.proposed)) for step in ex.chunks]
    st = engine.spec_stats
    st.draft_seconds = st.step_seconds = 0.0  # (the counts are compared, not the times)
    return st, steps


def test_the_verify_budget_comes_from_the_step_time_curve():
    """Without verify_budget the engine chooses each step's budget from the executor's curve:
    verify buckets that cost more than their drafts bring are not used, a cheap ragged bucket
    caps the rows, a curve of cheap buckets and no curve verify every draft."""
    every, steps = curve_run()
    assert every.drafts_verified > 0 and max(r for _, r in steps) > 8
    decode = ("decode_b4", 4, 4, 1.0)
    assert curve_run([decode, ("verify_b4", 4, 16, 1.0)])[0] == every
    none, _ = curve_run([decode, ("verify_b4", 4, 16, 100.0)])
    # and the draft graph is not run for drafts no step would verify, even all accepted
    assert none.drafts_verified == 0 and none.spec_steps == 0 and none.draft_calls == 0
    capped, steps = curve_run([decode, ("verify_b4r8", 4, 8, 1.2), ("verify_b4", 4, 16, 100.0)])
    assert 0 < capped.drafts_verified < every.drafts_verified and max(r for _, r in steps) <= 8
    assert curve_run([decode, ("verify_b4", 4, 16, 100.0)], verify_budget=16)[0] == every  # an explicit budget rules


def test_drafts_that_cost_more_than_they_bring_are_not_made(monkeypatch):
    """A cheap verify bucket pays for its drafts only while the draft call is cheap: once a draft
    call has cost more than the expected gain, the engine stops drafting (and verifying)."""
    import deepinfer.runtime.engine as eng

    cheap, _ = curve_run([("decode_b4", 4, 4, 1.0), ("verify_b4", 4, 16, 1.2)])
    assert cheap.drafts_verified > 0
    clock = iter(range(0, 10 ** 9, 1000))  # every perf_counter call a 1000 s later: draft calls cost 1000 s
    monkeypatch.setattr(eng.time, "perf_counter", lambda: float(next(clock)))
    dear, _ = curve_run([("decode_b4", 4, 4, 1.0), ("verify_b4", 4, 16, 1.2)])
    assert dear.draft_calls == 1 and dear.drafts_verified <= cheap.drafts_verified
    assert dear.spec_steps <= 1


def test_verify_steps_never_outgrow_the_bucket_holding_their_sequences():
    """An executor that verifies in buckets (verify_shapes): without a curve every draft is
    verified as far as the largest bucket holding the step's sequences has rows."""
    every, _ = curve_run()
    st, steps = curve_run(shapes=[(2, 5), (4, 6)])
    assert 0 < st.drafts_verified < every.drafts_verified
    assert all(r <= 6 for _, r in steps) and any(r == 6 for _, r in steps)


def test_the_engine_warms_the_executor_up_for_its_curve():
    calls = []

    class Warm(SpecFakeExecutor):
        def warm_up(self, max_seqs):
            calls.append(max_seqs)
            self.step_time_curve = [("decode_b4", 4, 4, 1.0), ("verify_b4", 4, 16, 100.0)]

    for kw in ({}, {"verify_budget": 8}, {"speculative": 0}):
        LLMEngine(Warm(4, 60, 4), FakeTokenizer(), max_num_seqs=3, max_num_batched_tokens=64, max_model_len=40,
                  **{"speculative": 3, **kw})
    assert calls == [3]  # only an engine that speculates without a budget asks for the curve


# ---- vLLM's sampling extras through the engine ------------------------------------------------------

def char_of(token: int) -> str:
    """A character FakeTokenizer encodes as `token` (3 <= token < VOCAB)."""
    return chr(VOCAB - 3 + token - 3)


def test_n_samples_are_seeded_per_sample_and_reported_together():
    from deepinfer.runtime.sampler import sample_seed

    params = SamplingParams(temperature=2.0, seed=77, max_tokens=8)
    engine, _ = make_engine(num_slots=2, num_pages=40)  # 3 samples on 2 slots: one waits
    rid = engine.add_request(prompt_token_ids=[7, 8, 9], params=SamplingParams(n=3, temperature=2.0, seed=77,
                                                                              max_tokens=8), request_id="r")
    singles = [engine.add_request(prompt_token_ids=[7, 8, 9], params=SamplingParams(
        temperature=2.0, seed=sample_seed(77, i), max_tokens=8)) for i in range(3)]
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request(prompt_token_ids=[3], request_id="r")
    outs = run_all(engine)
    out = outs[rid]
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [outs[s].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    engine2, _ = make_engine(num_slots=4, num_pages=40)
    alone = engine2.add_request(prompt_token_ids=[7, 8, 9], params=params)
    assert run_all(engine2)[alone].token_ids == out.outputs[0].token_ids == out.token_ids  # sample 0: as n=1
    engine.cache.check_no_leak()
    # aborting a request aborts each of its samples; one output comes back
    rid = engine.add_request(prompt_token_ids=[5], params=SamplingParams(n=2, max_tokens=8, ignore_eos=True))  # no sample may end first
    engine.step()
    assert engine.abort_request(rid) and not engine.abort_request(rid)
    (o,) = [o for o in engine.step() if o.request_id == rid]
    assert [c.finish_reason for c in o.outputs] == ["abort", "abort"]
    assert not engine.has_unfinished_requests()


def test_min_tokens_masks_eos_and_stop_ids_and_defers_stop_strings():
    prompt = [4, 5, 6]
    gen = expected(prompt, 9)
    text = FakeTokenizer().decode(gen)
    engine, ex = make_engine(num_pages=40)
    real_step = ex.step

    def eos_always(chunks):  # EOS is the most likely token from the first sample on
        logits = real_step(chunks)
        logits[:, EOS] = 9.0
        return logits

    ex.step = eos_always
    stops = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=9))
    later = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=9,
                                                                              min_tokens=3))
    outs = run_all(engine)
    assert outs[stops].token_ids == [EOS]
    assert outs[later].token_ids == gen[:3] + [EOS] and outs[later].finish_reason == "stop"
    ex.step = real_step
    cases = {"id": SamplingParams(temperature=0, max_tokens=9, min_tokens=4, stop_token_ids=[gen[0]]),
             "str": SamplingParams(temperature=0, max_tokens=9, min_tokens=4, stop=[text[1:3]]),
             "str_after": SamplingParams(temperature=0, max_tokens=9, min_tokens=4, stop=[text[2:4]])}
    ids = {k: engine.add_request(prompt_token_ids=prompt, params=p) for k, p in cases.items()}
    outs = run_all(engine)
    toks = outs[ids["id"]].token_ids
    assert len(toks) > 4 and gen[0] not in toks[:4]
    assert gen[0] not in toks[:-1] and (toks[-1] == gen[0]) == (outs[ids["id"]].finish_reason == "stop")
    # (one character per token) a stop string that ends in the first 3 tokens is never matched there;
    # one that ends in token 4 stops the request
    at = text.find(text[1:3], 2)
    assert (outs[ids["str"]].finish_reason, outs[ids["str"]].text) == (("stop", text[:at]) if at >= 0
                                                                       else ("length", text))
    assert outs[ids["str_after"]].finish_reason == "stop" and outs[ids["str_after"]].text == text[:2]


def test_include_stop_str_in_output_keeps_the_stop_string():
    prompt = [4, 5, 6]
    text = FakeTokenizer().decode(expected(prompt, 9))
    engine, _ = make_engine(num_pages=40)
    kept = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(
        temperature=0, max_tokens=9, stop=[text[3:5]], include_stop_str_in_output=True))
    cut = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=9,
                                                                            stop=[text[3:5]]))
    outs = run_all(engine)
    at = text.find(text[3:5])
    assert outs[kept].text == text[:at + 2] and outs[cut].text == text[:at]
    assert outs[kept].stop_reason == outs[cut].stop_reason == text[3:5]


def test_bad_words_are_never_completed():
    prompt = [4, 5, 6]
    gen = expected(prompt, 6)
    assert min(gen[:3]) >= 3  # (FakeTokenizer spells tokens from 3 on)
    engine, _ = make_engine(num_pages=40)
    one = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(
        temperature=0, max_tokens=6, bad_words=[char_of(gen[0])]))
    two = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(
        temperature=0, max_tokens=6, bad_words=[char_of(gen[0]) + char_of(gen[1])]))
    outs = run_all(engine)
    assert gen[0] not in outs[one].token_ids
    assert outs[two].token_ids[0] == gen[0] and outs[two].token_ids[1] != gen[1]  # the word's prefix is allowed


def test_history_dependent_requests_do_not_speculate_and_logprobs_do():
    """Penalties, min_tokens and bad_words: no drafts are proposed for the request, and its tokens
    are a plain engine's. logprobs and min_p speculate, and the logprobs of the verified tokens are
    those of a plain run, row for row."""
    prompt = [4, 5, 6]
    history = [SamplingParams(temperature=0, max_tokens=9, presence_penalty=1.0),
               SamplingParams(temperature=0, max_tokens=9, min_tokens=2),
               SamplingParams(temperature=0, max_tokens=9, bad_words=[char_of(3)])]
    speculated = [SamplingParams(temperature=0, max_tokens=9, logprobs=2),
                  SamplingParams(temperature=1.0, seed=3, max_tokens=9, min_p=0.05, logprobs=0)]
    for group in (history, speculated):
        results = []
        for spec in (False, True):
            engine, ex = make_spec_engine(wrong=0.0, num_pages=40) if spec else make_engine(num_pages=40)
            ids = [engine.add_request(prompt_token_ids=prompt, params=p) for p in group]
            outs = run_all(engine)
            results.append([outs[r].outputs[0] for r in ids])
            if spec and group is history:
                assert not ex.proposed and engine.spec_stats.verifies == 0
            elif spec:
                assert engine.spec_stats.drafts_accepted > 0
        plain, spec = results
        assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    for p, s in zip(plain, spec):
        assert s.logprobs == p.logprobs and s.cumulative_logprob == p.cumulative_logprob
        assert len(s.logprobs) == len(s.token_ids)
        assert s.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(s.token_ids, s.logprobs)))
    assert all(len(e) == 2 and e[t].rank == 1 for t, e in zip(spec[0].token_ids, spec[0].logprobs))
    assert all(len(e) == 1 for e in spec[1].logprobs)
    engine, _ = make_engine(num_pages=40)
    rid = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=3))
    out = run_all(engine)[rid].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None  # not asked for


# ---- random request streams (issue #17, Build 4) -------------------------------------------------

@st.composite
def request_stream(draw):
    """An engine shape (pool, budget, speculation, verify buckets) and a stream of requests, each
    arriving at a step with a random prompt and length, some aborted at a later step."""
    page_tokens = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(4, 24))
    shape = dict(num_slots=draw(st.integers(1, 6)), page_tokens=page_tokens, max_model_len=max_model_len,
                 num_pages=-(-max_model_len // page_tokens) + draw(st.integers(0, 8)),
                 max_num_batched_tokens=draw(st.integers(1, 20)), speculative=draw(st.sampled_from([0, 1, 3])),
                 verify_seqs=draw(st.sampled_from([None, 1, 2])))
    requests = draw(st.lists(st.tuples(
        st.integers(0, 30),  # arrival step
        st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=max_model_len - 1),
        st.integers(1, 10),  # max_tokens
        st.none() | st.integers(0, 15),  # aborted this many steps after arriving
        st.booleans(),  # sampled (seeded) or greedy
    ), min_size=1, max_size=12))
    return shape, requests


@fuzz_settings(300, 1_000)
@given(request_stream())
def test_random_request_streams_end_every_request_and_leak_nothing(stream):
    """CI 300 streams, 1,000 with DEEPINFER_FUZZ_FULL=1 (scripts/fuzz.sh): every request ends
    finished (length: max_tokens or max_model_len; EOS only when sampled) or aborted, greedy ones
    with the fake model's tokens; between steps every running sequence holds exactly its cached
    tokens' pages; at the end every slot and page is free."""
    shape, requests = stream
    verify_seqs, spec = shape.pop("verify_seqs"), shape.pop("speculative")
    kw = dict(shape, max_num_seqs=shape["num_slots"])
    if spec:
        engine, _ = make_spec_engine(**kw, speculative=spec)
        engine.scheduler.verify_seqs = verify_seqs
    else:
        engine, _ = make_engine(**kw)
    ids, outs, step = {}, {}, 0
    while len(ids) < len(requests) or engine.has_unfinished_requests():
        for k, (arrive, prompt, max_tokens, abort_after, sampled) in enumerate(requests):
            if arrive == step:
                params = (SamplingParams(temperature=0.9, seed=k, max_tokens=max_tokens) if sampled
                          else SamplingParams(temperature=0, max_tokens=max_tokens))
                ids[k] = engine.add_request(prompt_token_ids=prompt, params=params)
            if abort_after is not None and k in ids and arrive + abort_after == step:
                engine.abort_request(ids[k])
        for o in engine.step():
            outs[o.request_id] = o
        check_pages_exact(engine)
        step += 1
        assert step < 5_000, "the engine did not finish"
    assert sorted(outs) == sorted(ids.values())
    for k, (arrive, prompt, max_tokens, abort_after, sampled) in enumerate(requests):
        o = outs[ids[k]]
        # a sampled request may draw EOS (the fake model never picks it greedily)
        assert o.finish_reason in (("length", "abort", "stop") if sampled else ("length", "abort")), (k, o)
        n = min(max_tokens, shape["max_model_len"] - len(prompt))
        if o.finish_reason == "length":
            assert len(o.token_ids) == n
        if not sampled:
            assert o.token_ids == expected(prompt, n)[:len(o.token_ids)]
    assert not engine.scheduler.running and not engine.scheduler.waiting
    engine.cache.check_no_leak()
    assert (engine.cache.free_pages, engine.cache.free_slots) == (shape["num_pages"], shape["num_slots"])


def test_host_argmax_is_torchs_first_maximum():
    """The CUDA executor's host-side argmax (argmax steps of few rows) picks what torch.argmax
    picks, ties to the lowest id included."""
    from deepinfer.runtime.cuda_executor import host_argmax

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 129280, generator=g)
    x[1, [7, 9000, 129279]] = 50.0  # a three-way tie: the lowest id
    x[2] = 0.0  # all equal: id 0
    x[3, -1] = float("inf")
    got = host_argmax(x)
    assert got.dtype == torch.int64 and got.tolist() == x.argmax(-1).tolist() and got[1] == 7 and got[2] == 0


def test_input_staging_loads_a_steps_inputs_in_one_buffer():
    """A captured graph's inputs are views of one buffer at aligned offsets, loaded from a step's
    host tensors (two host buffers in turn); inputs of another name, dtype or shape are refused
    and leave the views as they were (the executor then copies them one by one). On the CPU."""
    from deepinfer.runtime.cuda_executor import InputStaging

    first = {"token_ids": torch.tensor([1, 2, 3]), "positions": torch.tensor([[4, 5]], dtype=torch.int32),
             "mask": torch.tensor([True, False])}
    st = InputStaging(first, "cpu")
    assert [st.layout[k][0] for k in first] == [0, 256, 512]
    assert all(torch.equal(st.views[k], v) and st.views[k].dtype == v.dtype for k, v in first.items())
    for step in range(3):
        nxt = {"token_ids": torch.tensor([7, 8, 9]) + step, "positions": torch.tensor([[6, 7]], dtype=torch.int32),
               "mask": torch.tensor([False, True])}
        assert st.load(nxt) and all(torch.equal(st.views[k], v) for k, v in nxt.items())
        assert st.turn == (step + 1) % 2
    before = {k: v.clone() for k, v in st.views.items()}
    for bad in ({**nxt, "token_ids": torch.tensor([1, 2])}, {**nxt, "positions": torch.tensor([[6, 7]])},
                {k: v for k, v in nxt.items() if k != "mask"}):
        assert not st.load(bad) and all(torch.equal(st.views[k], v) for k, v in before.items())



def test_early_submitted_steps_give_the_same_tokens():
    """With an executor that takes `feed` (feed_steps), a step after an all-greedy one is
    submitted before that step's tokens reach the host, its placeholders fed from the step's
    argmax ids on the device (LLMEngine._submit_early). A load with stop tokens, stop-free and
    max_tokens ends, sampled requests, preemptions and aborts gives the tokens of the plain
    engine, leaks nothing, and some steps ran fed, some of them rows of sequences that had just
    stopped."""
    def run(feed):
        ex = SubmitFakeExecutor(4, 9, 4, feed_steps=feed) if feed is not None else FakeExecutor(4, 9, 4)
        engine = LLMEngine(ex, FakeTokenizer(), max_num_seqs=4, max_num_batched_tokens=12, max_model_len=28)
        early, ex.fed_seqs = engine._submit_early, []

        def recording(prepared, handle, planned):  # the sequences of each early-submitted step
            got = early(prepared, handle, planned)
            ex.fed_seqs += [] if got is None else [s.seq for s in got[0].batch]
            return got
        engine._submit_early = recording
        rng = random.Random(11)

        def request(i):
            stop = [next_token([3] * (1 + i % 4))] if i % 3 == 0 else None  # some stop at their first token
            params = SamplingParams(temperature=2.0 if i % 7 == 0 else 0, seed=i, max_tokens=rng.randint(1, 9),
                                    stop_token_ids=stop)
            prompt = [3] * (1 + i % 4) if i % 3 == 0 else [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 10))]
            return prompt, params

        return drive_load(engine, rng, request, abort_rate=0.05), ex

    plain, _ = run(None)
    fed, ex = run(True)
    unfed, ex0 = run(False)
    done = {k for k, v in plain.items() if v[0] != "abort"} & {k for k, v in fed.items() if v[0] != "abort"}
    assert len(done) >= 25 and {k: plain[k] for k in done} == {k: fed[k] for k in done}
    assert ex.kinds["fed"] > 0 and ex0.kinds["fed"] == 0, (ex.kinds, ex0.kinds)
    # rows computed for nothing: sequences that stopped at their first token, already in the next step
    assert sum(s.finish_reason == "stop" and len(s.output_token_ids) == 1 for s in ex.fed_seqs) > 0
