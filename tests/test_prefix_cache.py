"""Prefix caching (runtime/cache.py): the page hash chain, reference counts, reuse of cached pages
under memory pressure, aborts and preemption, first with a fake model whose caches remember
exactly what they were fed (and refuse a write into a page another sequence may read), then on
the tiny model: an exact-mode hit gives the tokens a miss gives (greedy and seeded sampling),
the compressor state at a page boundary is never read, bounded replay leaves the shared pages
unchanged, and `generate --prefix-cache` reports its hits."""
import json
import random
from types import SimpleNamespace

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main as cli_main
from deepinfer.ir.quant import QTensor
from deepinfer.models.checkpoint import make_checkpoint
from deepinfer.runtime.cache import (ROOT_HASH, CacheFull, CacheManager, PrefixPolicy, check_prefix_caching,
                                     page_hashes)
from deepinfer.runtime.engine import EngineConfigError, LLMEngine
from deepinfer.runtime.state import saved_bytes

MODEL = "v4.1-flash-tiny"
VOCAB = 50
P = 4  # page tokens of the fake


class FakeOps:
    """Slot and page operations over plain lists (what a CacheManager calls)."""

    def __init__(self, num_slots, num_pages):
        self.slots = {s: [] for s in range(num_slots)}
        self.pages = {p: [None] * P for p in range(num_pages)}
        self.copies = []

    def save_slot(self, slot):
        return list(self.slots[slot])

    def restore_slot(self, slot, saved):
        self.slots[slot] = list(saved)

    def reset_slot(self, slot):
        self.slots[slot] = []

    def copy_page(self, src, dst):
        self.copies.append((src, dst))
        self.pages[dst] = list(self.pages[src])


EXACT = PrefixPolicy("exact", 8, window=4, max_backtrack=2, ratios=(2,))


def manager(num_slots=4, num_pages=8, policy=EXACT):
    ops = FakeOps(num_slots, num_pages)
    return CacheManager(num_slots, num_pages, P, prefix=policy, ops=ops), ops


def fill(cm, owner, tokens, hit=None):
    """Admit `owner` for all of `tokens`, computed a page per step (so each page gets a state)."""
    cm.allocate(owner, len(tokens), hit)
    for end in [*range(P, len(tokens), P), len(tokens)]:
        cm.register(owner, tokens, end, end)


def test_the_hash_chain_names_a_page_by_its_whole_prefix():
    a = list(range(3, 15))
    assert page_hashes(a, P, 3) == page_hashes(a + [9, 9], P, 3)
    b = [a[0] + 1] + a[1:]  # only the first token differs: every later page's hash differs too
    assert all(x != y for x, y in zip(page_hashes(a, P, 3), page_hashes(b, P, 3)))
    c = a[:4] + a[8:12] + a[4:8]  # the same pages in another order
    assert page_hashes(a, P, 3)[0] == page_hashes(c, P, 3)[0] and page_hashes(a, P, 3)[1:] != page_hashes(c, P, 3)[1:]
    assert ROOT_HASH not in page_hashes(a, P, 3)

    cm, _ = manager()
    fill(cm, "a", a)
    hit = cm.lookup(a + [20, 21])
    assert hit.pages == cm.pages("a") and hit.num_tokens == hit.start == 12
    assert cm.lookup(a).pages == cm.pages("a")[:2]  # a whole-prompt hit still leaves a token to compute
    assert cm.lookup(b + [1]).pages == [] and cm.lookup(c + [1]).pages == cm.pages("a")[:1]
    assert cm.lookup(a[:7]).pages == cm.pages("a")[:1]


def test_shared_pages_are_counted_and_reused_least_recently_released_first():
    cm, ops = manager(num_slots=4, num_pages=6)
    x, y = [5, 6, 7, 8, 9, 10, 11, 12], [30, 31, 32, 33, 34, 35, 36, 37]
    fill(cm, "x", x)
    fill(cm, "y", y)
    xp, yp = list(cm.pages("x")), list(cm.pages("y"))
    ops.slots[cm.slot("x")] = ["state of x"]
    hit = cm.lookup(x + [40, 41])
    assert hit.pages == xp and hit.state == []  # (the state saved when x registered: its slot then)
    cm.allocate("x2", 10, hit)
    cm.count_query(hit)
    assert cm.pages("x2")[:2] == xp and all(cm.refs(p) == 2 for p in xp)
    assert cm.free_pages == 1
    cm.free("x")
    assert all(cm.refs(p) == 1 for p in xp) and cm.free_pages == 1
    cm.free("x2")
    cm.free("y")
    # nobody holds them now, but they stay cached: the free list first, then y's pages (released
    # last, its last page first), then x's
    assert cm.free_pages == 6 and cm.cached_pages == 4
    cm.check_no_leak()
    cm.allocate("z", 4 * 4)
    zp = cm.pages("z")
    assert zp[:2] == sorted(set(range(6)) - set(xp) - set(yp)) and zp[2:] == xp[::-1]
    assert cm.stats.evictions == 2 and cm.lookup(x + [1]).pages == [] and cm.lookup(y + [1]).pages == yp
    # the 2 pages left are y's: a hit on them takes them, so none is left for a third page
    hit = cm.lookup(y + [1])
    assert cm.free_pages == 2 and cm.can_cover("w", 2 * 4, hit) and not cm.can_cover("w", 2 * 4 + 1, hit)
    with pytest.raises(CacheFull):
        cm.allocate("w", 2 * 4 + 1, hit)
    assert cm.pages("z") == zp and cm.free_pages == 2 and not cm.holds("w")  # all or nothing
    cm.check_no_leak()
    assert cm.stats.summary()["hit_rate"] == 8 / 10 and cm.stats.saved_tokens == 8
    cm.reset_prefix()  # z's pages stay z's, y's are free, nothing is found any more
    assert cm.cached_pages == 0 and cm.lookup(y + [1]).pages == [] and cm.free_pages == 2 and cm.pages("z") == zp
    cm.check_no_leak()
    cm.free("z")
    assert cm.free_pages == 6
    cm.check_no_leak()


def test_exact_hits_end_at_a_page_with_a_saved_slot_state():
    cm, ops = manager()
    tokens = list(range(3, 3 + 16))
    cm.allocate("a", 16)
    ops.slots[cm.slot("a")] = ["a after 16"]
    # one step wrote all 16 rows: only page 3 ends within max_backtrack (2) rows of the step's end,
    # so only its state is the slot state at its end
    cm.register("a", tokens, 16, 16)
    assert cm.cached_pages == 4
    assert cm.lookup(tokens + [1]).state == ["a after 16"] and cm.lookup(tokens + [1]).start == 16
    # a prompt sharing pages 0-2 only finds no state to resume from: no hit
    assert cm.lookup(tokens[:13]).pages == [] and cm.lookup(tokens[:13]).start == 0
    # a sequence that decodes across the boundary at 12 gives page 2 its state (the page stays a's)
    hit = cm.lookup(tokens[:11])
    assert hit.start == 0
    cm.allocate("b", 11, hit)
    ops.slots[cm.slot("b")] = ["b after 12"]
    cm.register("b", tokens[:12], 11, 11)  # 11 cached: page 2 is not full yet
    assert cm.lookup(tokens[:13]).start == 0
    cm.register("b", tokens[:13], 12, 13)  # a step of 2 rows (a verify chunk) to 13, 12 of them kept
    assert cm.lookup(tokens[:13]).state == ["b after 12"] and cm.lookup(tokens[:13]).pages == cm.pages("a")[:3]
    assert cm.pages("b")[2] != cm.pages("a")[2]  # b computed its own copy; the registered one is a's
    cm.check_no_leak()


def test_bounded_replay_resumes_keep_tokens_early_on_private_copies():
    policy = PrefixPolicy("bounded", 6, window=3, max_backtrack=2, ratios=(2,))
    cm, ops = manager(num_pages=10, policy=policy)
    tokens = list(range(3, 3 + 16))
    fill(cm, "a", tokens)
    shared = list(cm.pages("a"))
    hit = cm.lookup(tokens + [40, 41, 42])
    # 16 cached tokens, 6 recomputed: resume at 10; the pages holding positions 10..15 (2, 3) are copied
    assert (hit.num_tokens, hit.start, hit.state) == (16, 10, None)
    ops.slots[1] = ["stale"]
    cm.allocate("b", 16, hit)
    assert cm.slot("b") == 1 and ops.slots[1] == []  # resumes from a cleared slot
    pages = list(cm.pages("b"))
    copies = pages[2:]
    assert pages[:2] == shared[:2] and not set(copies) & set(shared) and len(pages) == 4
    assert ops.copies == [(shared[2], pages[2]), (shared[3], pages[3])] and cm.replay_end("b") == 16
    assert [cm.refs(p) for p in shared] == [2, 2, 2, 2]  # (the copied ones stay held for after the replay)
    cm.check_no_leak()
    cm.register("b", tokens, 14, 14)  # the replay is not done yet
    assert cm.pages("b") == pages
    cm.register("b", tokens, 16, 16)  # done: b reads the shared pages, the copies are free again
    assert cm.pages("b") == shared and cm.replay_end("b") is None and all(cm.refs(p) == 0 for p in copies)
    cm.grow("b", 19)
    cm.count_query(hit)
    assert cm.stats.hit_tokens == 16 and cm.stats.saved_tokens == 10
    # a hit that would recompute the whole prefix is no hit
    assert cm.lookup(tokens[:5]).pages == [] and cm.lookup(tokens[:9]).start == 2
    cm.check_no_leak()
    # freed during its replay, a sequence gives back its copies and the shared pages
    hit = cm.lookup(tokens + [1])
    cm.allocate("c", 16, hit)
    cm.free("c")
    cm.free("a")
    cm.free("b")
    assert cm.free_pages == 10
    cm.check_no_leak()


def test_bad_prefix_cache_settings_are_one_line():
    with pytest.raises(EngineConfigError, match=r"^swa_replay_keep 5 is below the window \(4\) plus the largest "
                                                r"rollback \(2\): bounded replay needs >= 6 tokens"):
        check_prefix_caching(PrefixPolicy("bounded", 5, 4, 2, (2,)), 128, EngineConfigError)
    with pytest.raises(EngineConfigError, match="^swa_replay must be one of exact, bounded, got 'fuzzy'"):
        check_prefix_caching(PrefixPolicy("fuzzy", 140, 4, 2, (2,)), 128, EngineConfigError)
    # the ratio-2 boundary: a page must end where no compressor group is open
    with pytest.raises(EngineConfigError, match="a page of 127 tokens leaves a ratio-2 group open at its end"):
        check_prefix_caching(PrefixPolicy("exact", 140, 4, 2, (1, 2)), 127, EngineConfigError)
    check_prefix_caching(PrefixPolicy("exact", 6, 4, 2, (1, 2)), 128, EngineConfigError)


# ---- through the engine, with a fake model -------------------------------------------------------

def next_token(history):
    return 2 + (sum((i + 1) * t for i, t in enumerate(history)) * 2654435761) % (VOCAB - 2)


def expected(prompt, n):
    hist = list(prompt)
    for _ in range(n):
        hist.append(next_token(hist))
    return hist[len(prompt):]


class FakeTokenizer:
    eos_id = 1

    def encode(self, text, add_bos=False):
        return [3 + ord(c) % (VOCAB - 3) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


class PrefixFakeModel(FakeOps):
    """A model whose pages hold the tokens of their positions and whose slot is a ring keyed by
    position with the real rings' slack: the tokens of the last window + max_backtrack positions
    written, and the position it was first written from. A step reads the earlier tokens from the chunk's pages, checks that the slot holds
    the last `window` of them (unless cleared for bounded replay), refuses to write
    a page another sequence holds or the prefix cache has registered, and derives each row's
    logits from the whole token history: a wrong page, a lost restore or a write into a shared
    page changes tokens or raises."""

    window = 3

    def __init__(self, num_slots, num_pages):
        super().__init__(num_slots, num_pages)
        self.num_slots, self.num_pages, self.page_tokens, self.vocab_size = num_slots, num_pages, P, VOCAB
        self.cfg = SimpleNamespace(sliding_window=self.window, dspark_block_size=1, compress_ratios=[0, 2, 1])
        self.cache = None
        self.rows = 0

    def step(self, chunks):
        rows = []
        for c in chunks:
            hist = [self.pages[c.pages[q // P]][q % P] for q in range(c.start)]
            assert None not in hist, f"slot {c.slot}: its pages lack an earlier token"
            # a cleared slot's ring starts with the first chunk after it (where bounded replay starts)
            first, ring = self.slots[c.slot] or (c.start, [])
            ring = dict(ring)
            for q in range(max(first, c.start - self.window), c.start):
                assert ring.get(q) == hist[q], f"slot {c.slot}: the ring lacks position {q}"
            for q, t in zip(range(c.start, c.start + len(c.tokens)), c.tokens):
                page = c.pages[q // P]
                assert self.cache.refs(page) == 1 and page not in self.cache._hash_of, \
                    f"slot {c.slot} writes position {q} into page {page}, which others may read"
                self.pages[page][q % P] = t
                ring[q] = t
            hist += c.tokens
            slack = self.window + self.cfg.dspark_block_size + 1
            self.slots[c.slot] = [first, sorted((q, t) for q, t in ring.items() if q >= len(hist) - slack)]
            self.rows += len(c.tokens)
            if c.sample:
                row = torch.linspace(0, 1, VOCAB)
                row[next_token(hist)] = 5.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)


def fake_engine(num_slots=4, num_pages=12, **kw):
    model = PrefixFakeModel(num_slots, num_pages)
    kw.setdefault("max_num_seqs", num_slots)
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_model_len", 40)
    engine = LLMEngine(model, FakeTokenizer(), enable_prefix_caching=True, **kw)
    model.cache = engine.cache
    return engine, model


def run_all(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


GREEDY = SamplingParams(temperature=0, max_tokens=6)


def test_a_hit_skips_the_cached_prefill_and_gives_the_same_tokens():
    engine, model = fake_engine(max_num_seqs=1)
    prompt = list(range(5, 5 + 14))
    a = engine.add_request(prompt_token_ids=prompt, params=GREEDY)
    b = engine.add_request(prompt_token_ids=prompt[:13] + [40, 41], params=GREEDY)
    c = engine.add_request(prompt_token_ids=prompt + expected(prompt, 6) + [7], params=GREEDY)
    outs = run_all(engine)
    assert outs[a].token_ids == expected(prompt, 6)
    assert outs[b].token_ids == expected(prompt[:13] + [40, 41], 6)
    assert outs[c].token_ids == expected(prompt + expected(prompt, 6) + [7], 6)
    st = engine.stats()["prefix"]
    # a: one chunk of 14 rows (it ends 2 rows past page 2's end: within the slack, no cut); b
    # resumes at 12 from the state saved then, c at 16 from the one saved when a decoded position 15
    # (a's page 4 is not full: its last generated token was never fed)
    assert st["hit_tokens"] == 12 + 16 and st["prefill_tokens_saved"] == 28 and st["queries"] == 3
    assert model.rows == (14 + 5) + (3 + 5) + (5 + 5)
    engine.cache.check_no_leak()


def test_prefill_chunks_end_at_page_boundaries_so_their_states_are_saved():
    engine, model = fake_engine(max_num_seqs=1, max_num_batched_tokens=16)
    prompt = list(range(5, 5 + 23))
    engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=1))
    chunks = []
    inner = model.step
    model.step = lambda cs: chunks.append([(c.start, len(c.tokens)) for c in cs]) or inner(cs)
    run_all(engine)
    # [16, 23) would end 3 rows past the page end at 20, more than the slack of 2: cut there
    assert chunks == [[(0, 16)], [(16, 4)], [(20, 3)]]
    assert engine.cache.lookup(prompt + [1]).start == 20 and engine.cache.lookup(prompt[:19]).start == 16


def test_a_prompt_of_whole_pages_saves_the_state_a_repeat_of_it_resumes_from():
    """A lookup leaves the last token to compute, so the deepest exact hit a prompt of whole pages
    can give ends one page short of its end: its prefill is cut there, and the state saved there
    is what a repeat of the prompt (or any prompt sharing those pages) resumes from. Uncut, the
    one chunk saved a state only at the prompt's end (on the H200, 16 requests sharing 3072
    tokens with 128-token tails hit half of what they shared)."""
    engine, model = fake_engine(max_num_seqs=1, max_num_batched_tokens=16)
    prompt = list(range(5, 5 + 16))
    chunks = []
    inner = model.step
    model.step = lambda cs: chunks.append([(c.start, len(c.tokens)) for c in cs]) or inner(cs)
    a = engine.add_request(prompt_token_ids=prompt, params=GREEDY)
    b = engine.add_request(prompt_token_ids=prompt, params=GREEDY)
    outs = run_all(engine)
    assert chunks[:2] == [[(0, 12)], [(12, 4)]]
    assert [(12, 4)] in chunks[2:]  # b: only the last page is computed
    assert outs[a].token_ids == outs[b].token_ids == expected(prompt, 6)
    assert engine.stats()["prefix"]["hit_tokens"] == 12
    engine.cache.check_no_leak()


@pytest.mark.parametrize("mode", ["exact", "bounded"])
def test_random_shared_prefixes_with_aborts_preemption_and_eviction_leak_nothing(mode):
    """300 requests whose prompts start with one of 4 prefixes (or none), on a pool that must
    preempt and reuse cached pages; some aborted. Every request gives the fake model's tokens,
    hits happen, every reference comes back."""
    rng = random.Random(5)
    engine, model = fake_engine(num_slots=6, num_pages=14, max_num_batched_tokens=20, max_model_len=32,
                                **({"swa_replay": "bounded", "swa_replay_keep": 5} if mode == "bounded" else {}))
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 14))] for _ in range(4)] + [[]]
    want, aborted, outs, pending = {}, set(), {}, 300
    while pending or engine.has_unfinished_requests():
        for _ in range(min(rng.randint(0, 3), pending)):
            prompt = rng.choice(prefixes) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 8))]
            n = rng.randint(1, 8)
            rid = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=n))
            want[rid] = expected(prompt, n)
            pending -= 1
        if rng.random() < 0.1 and want:
            victim = rng.choice(sorted(want))
            if engine.abort_request(victim):
                aborted.add(victim)
        for o in engine.step():
            outs[o.request_id] = o
    assert set(outs) == set(want)
    for rid, o in outs.items():
        if rid in aborted:
            assert o.finish_reason == "abort" and o.token_ids == want[rid][:len(o.token_ids)]
        else:
            assert o.finish_reason == "length" and o.token_ids == want[rid], rid
    st = engine.stats()["prefix"]
    assert engine.scheduler.num_preemptions > 0 and st["evictions"] > 0 and st["hit_rate"] > 0.1
    assert st["prefill_tokens_saved"] > 0 and len(aborted) > 5
    engine.cache.check_no_leak()
    assert engine.cache.free_pages == 14 and engine.cache.free_slots == 6 and engine.cache.cached_pages > 0
    assert all(engine.cache.refs(p) == 0 for p in range(14))


# ---- the tiny model ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(MODEL, tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


def random_tokens(n, seed):
    return torch.randint(3, 129280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def saved_states(engine) -> dict:
    """page -> the slot state the prefix cache saved with it."""
    return engine.cache._state


@pytest.mark.usefixtures("one_torch_thread")
def test_exact_hits_give_the_tokens_and_logprobs_of_misses_on_the_tiny_model(ckpt):
    """Three prompts of 140 tokens, run twice through one engine: the first run misses and saves
    each first page's slot state, the second resumes at 128 from it. Greedy and seeded sampling
    give the same tokens and bit-identical logprobs, also when the saved compressor state is
    replaced by noise (nothing is open in a ratio-2 group at a page's end: it is never read);
    noise in a saved window ring does change them (the restore is what makes the hit exact)."""
    llm = LLM(MODEL, ckpt, max_num_seqs=3, max_model_len=256, speculative=0, enable_prefix_caching=True)
    prompts = [random_tokens(140, seed) for seed in (1, 2, 3)]
    params = [SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=3, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True)]
    miss = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.last_run_stats["prefix"]["hit_tokens"] == 0
    engine = llm.engine
    states = saved_states(engine)
    first = {p: engine.cache.lookup(prompt).pages[0] for p, prompt in enumerate(prompts)}
    assert all(first[p] in states for p in first)
    one = states[first[0]]
    # what a page's saved state costs: 13 fp8 rings of 16 + 6 slots (128 B + 4 scale bytes each), 2
    # ratio-2 compressor rings of 2 + 6 - 1 slots of fp32 (kv, score) x 128, 3 + 6 Engram ids
    assert saved_bytes(one) == 13 * 22 * (128 + 4) + 2 * 7 * 2 * 128 * 4 + 9 * 8 == 52160
    gen = torch.Generator().manual_seed(0)
    compressor = [k for k in one if k.startswith("cstate.")]
    assert compressor and any(float(one[k][0].abs().sum()) > 0 for k in compressor)  # it holds completed groups
    for k in compressor:
        states[first[1]][k] = (torch.randn(states[first[1]][k][0].shape, generator=gen),)
    ring = states[first[2]]["swa.0"]
    states[first[2]]["swa.0"] = (torch.randint(-100, 100, ring[0].shape, generator=gen).to(ring[0].dtype), ring[1])
    hit = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    st = llm.last_run_stats["prefix"]
    assert st["hit_tokens"] == st["prefill_tokens_saved"] == 3 * 128 and st["hit_rate"] == 3 * 128 / (3 * 140)
    for p in (0, 1):
        assert hit[p].token_ids == miss[p].token_ids, p
        assert hit[p].outputs[0].logprobs == miss[p].outputs[0].logprobs, p
    assert hit[2].outputs[0].logprobs != miss[2].outputs[0].logprobs
    engine.cache.check_no_leak()


@pytest.mark.usefixtures("one_torch_thread")
def test_a_conversation_resumes_from_a_state_saved_while_decoding(ckpt):
    """Turn 1 (125 tokens, 6 generated with speculation on: verify chunks cross the page end at
    128) saves page 0's state while decoding; turn 2 (turn 1 + its answer + 2 tokens) resumes
    there and gives the independent reference's greedy tokens."""
    from reference import ReferenceModel

    llm = LLM(MODEL, ckpt, max_num_seqs=1, max_model_len=256, enable_prefix_caching=True)
    assert llm.engine.num_speculative == 5
    turn1 = random_tokens(125, 4)
    out1 = llm.generate(prompt_token_ids=[turn1], use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert llm.engine.spec_stats.drafts_verified > 0
    turn2 = turn1 + out1.token_ids + random_tokens(2, 5)
    out2 = llm.generate(prompt_token_ids=[turn2], use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert llm.last_run_stats["prefix"]["hit_tokens"] == 128
    ref = ReferenceModel.from_checkpoint(ckpt)
    logits = ref.prefill(ref.new_sequence(), turn2 + out2.token_ids[:-1], all_logits=True)[len(turn2) - 1:]
    assert torch.argmax(logits, dim=-1).tolist() == out2.token_ids


def paged(engine, page) -> list[torch.Tensor]:
    ex = engine.executor
    return [part[page].clone() for name in ex.page_names
            for part in ((ex.state[name].data, ex.state[name].scale) if isinstance(ex.state[name], QTensor)
                         else (ex.state[name],))]


@pytest.mark.usefixtures("one_torch_thread")
def test_bounded_replay_recomputes_keep_tokens_and_leaves_the_shared_pages_unchanged(ckpt):
    # 3 pages: the hit's private copy of page 0 is one more than a miss needs
    llm = LLM(MODEL, ckpt, max_num_seqs=1, max_model_len=256, num_pages=3, speculative=0, enable_prefix_caching=True,
              swa_replay="bounded", swa_replay_keep=22)
    prompt = random_tokens(150, 6)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    miss = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False)[0]
    engine = llm.engine
    (page,) = engine.cache.lookup(prompt).pages
    assert not saved_states(engine)  # bounded replay keeps no slot state
    before = paged(engine, page)
    rows = []
    inner = engine.executor.step
    engine.executor.step = lambda chunks: rows.append([(c.start, len(c.tokens)) for c in chunks]) or inner(chunks)
    hit = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False)[0]
    # the replay of 106..127 on a private copy of page 0, then the prompt's rest on the shared page,
    # which is as it was
    assert rows[:2] == [[(106, 22)], [(128, 150 - 128)]]
    assert all(torch.equal(a, b) for a, b in zip(before, paged(engine, page)))
    st = llm.last_run_stats["prefix"]
    assert st["hit_tokens"] == 128 and st["prefill_tokens_saved"] == 106
    assert len(hit.token_ids) == len(miss.token_ids) == 4  # (how close they are: bench/prefix_replay.py)
    engine.cache.check_no_leak()


def test_cli_generate_with_the_prefix_cache_reports_its_hits(ckpt, tmp_path, capsys):
    shared = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 10  # 139 tokens with BOS
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(shared + tail) for tail in ("Why?", "How?")) + "\n")
    args = ["generate", "--model", MODEL, "--weights", str(ckpt), "--prompts", str(prompts), "--max-tokens", "2",
            "--temperature", "0", "--max-num-seqs", "1", "--speculative", "off"]
    assert cli_main(args + ["--prefix-cache"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("prefix cache: "))
    assert "128 prefill tokens saved" in line and "(128 of " in line, line
