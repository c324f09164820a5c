"""Tests of the plain PyTorch reference (tests/reference), on a random v4.1-flash-tiny checkpoint.

The reference is the oracle of the project; these tests pin its self-consistency (chunked prefill,
decode, state carry) and the spec constants, and check that a random checkpoint gives live
(finite, non-degenerate) activations."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import ReferenceModel, engram_constants  # noqa: E402
from reference import numerics as nx  # noqa: E402
from reference.config import Config  # noqa: E402
from reference.engram import hash_columns, ngram_ids  # noqa: E402
from reference.model import DEFAULT_TOKEN_MAP, candidate_pool, hc_mixes  # noqa: E402

from deepinfer.models.checkpoint import make_checkpoint  # noqa: E402

PRESETS = Path(__file__).resolve().parents[1] / "models" / "presets"
N_FULL = 141  # > 100 tokens; ratio-2 clen 70 > top-k 16; ratio-1 clen 141 > the 32-position pool
N_PROMPT = 100  # decode from here to N_FULL - 1: 41 steps, ring wraps, odd and even compressor states
CHUNKS = [(0, 37), (37, 38), (38, 67), (67, 100), (100, N_FULL)]  # odd cuts straddle ratio-2 groups


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("v4.1-flash-tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def ref(ckpt):
    # The reference runs many small ops; one intra-op thread is fastest and robust to a loaded host
    # (two spinning threads on a busy 2-core machine slow it down by an order of magnitude).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ReferenceModel.from_checkpoint(ckpt)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 129280, (N_FULL,), generator=g).tolist()


@pytest.fixture(scope="module")
def full(ref, ids):
    """Whole prefill of N_FULL tokens: all logits, the per-layer trace and the final state."""
    ref.trace = []
    seq = ref.new_sequence()
    logits = ref.prefill(seq, ids, all_logits=True)
    trace, ref.trace = ref.trace, None
    return logits, trace, seq


# ---- spec constants and small pieces -------------------------------------------------------------

def test_engram_constants_tiny():
    cfg = Config.load(PRESETS / "v4.1-flash-tiny" / "config.json")
    k = engram_constants(cfg.engram_layers, cfg.engram_compressed_vocab, cfg.engram_vocab_size,
                         cfg.engram_max_ngram, cfg.engram_heads)
    assert k[1].primes.tolist() == [[1009, 1013], [1019, 1021], [1031, 1033]]
    assert k[4].primes.tolist() == [[1039, 1049], [1051, 1061], [1063, 1069]]
    assert (k[1].rows, k[4].rows) == (6126, 6332) == tuple(cfg.engram_num_embeddings)
    assert k[1].mult.tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert k[4].mult.tolist() == [82260218638837, 5037792023067, 73653454411355, 18954862957863]
    assert k[1].offsets.tolist() == [0, 1009, 2022, 3041, 4062, 5093]


def test_engram_constants_real():
    k = engram_constants([1, 14], 99092, 16_000_000, 4, 8)
    assert (k[1].rows, k[14].rows) == (384006168, 384016682)
    assert k[14].mult.tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    assert k[1].primes[0].tolist()[:3] == [16000057, 16000079, 16000081]
    assert k[14].primes[2].tolist()[-1] == 16000889


def test_engram_ngram_ids_and_hash():
    pad = 7
    hist = [11, 12, 13, 14]
    g = ngram_ids(hist, 4, 0, 4, pad)
    assert g.tolist() == [[11, pad, pad, pad], [12, 11, pad, pad], [13, 12, 11, pad], [14, 13, 12, 11]]
    # a suffix of the history continues the same ids (chunked prefill / decode)
    assert ngram_ids([12, 13, 14, 15], 1, 4, 4, pad).tolist() == [[15, 14, 13, 12]]
    k = engram_constants([1], 99092, 1000, 4, 2)[1]
    cols = hash_columns(g, k)
    p = [v * int(m) for v, m in zip(g[3].tolist(), k.mult.tolist())]
    acc = p[0] ^ p[1]
    assert cols[3, 1] == acc % 1013 + 1009
    acc ^= p[2] ^ p[3]
    assert cols[3, 5] == acc % 1033 + 5093
    assert (cols >= 0).all() and (cols < k.rows).all()


def test_roles_tiny_and_real():
    tiny = Config.load(PRESETS / "v4.1-flash-tiny" / "config.json")
    got = [(r.mode, r.ratio, r.kv_owner, r.candidate_source, r.in_pool, r.engram) for r in tiny.roles]
    assert got == [("W", 0, None, False, False, False), ("W", 0, None, False, False, True),
                   ("FULL", 2, 2, False, False, False), ("REUSE", 2, 2, False, False, False),
                   ("FULL", 2, 4, False, False, True), ("FULL", 1, 5, True, False, False),
                   ("REUSE", 1, 5, False, False, False), ("REINDEX", 1, 5, False, True, False),
                   ("REUSE", 1, 5, False, False, False), ("REUSE", 1, 5, False, False, False)]
    real = Config.load(PRESETS / "v4.1-flash" / "config.json")  # root with text_config
    modes = {l: r.mode for l, r in enumerate(real.roles)}
    assert [l for l, m in modes.items() if m == "FULL"] == [2, 8, 14, 20]
    assert [l for l, m in modes.items() if m == "REINDEX"] == [24, 28, 32, 36]
    assert [l for l, m in modes.items() if m == "W"] == [0, 1]
    assert real.roles[19].kv_owner == 14 and real.roles[39].kv_owner == 20
    assert real.roles[20].candidate_source and real.roles[24].in_pool and not real.roles[20].in_pool
    nested = Config.from_dict({"model_type": "x", "text_config": tiny.raw})
    assert nested.roles == tiny.roles


def test_yarn_ramp_bounds():
    f_plain = nx.rope_freqs(32, 160000.0, None)
    f = nx.rope_freqs(32, 160000.0, dict(factor=16, beta_fast=32, beta_slow=1, original=65536))
    assert torch.equal(f[:8], f_plain[:8])  # i <= low = 7 unchanged
    assert torch.allclose(f[13:], f_plain[13:] / 16)  # i >= high = 13 divided by the factor
    assert ((f[8:13] < f_plain[8:13]) & (f[8:13] > f_plain[8:13] / 16)).all()


def test_fp_codecs():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -2.6, 0.0, 0.74])
    assert nx.e2m1_round(x).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -3.0, 0.0, 0.5]
    # fq8: amax 3.0 -> s = 2^ceil(log2(3/448)) = 2^-7; 1.03 / 2^-7 = 131.84 -> e4m3 128 (step 8 in [128, 256))
    blk = torch.zeros(32)
    blk[0], blk[1] = 3.0, 1.03
    q = nx.fq8(blk)
    assert q[0] == 3.0 and q[1] == 1.0 and (q[2:] == 0).all()
    # fq4 ue8m0: amax 3.0 -> s = 2^ceil(log2(0.5)) = 0.5; 1.1 / 0.5 = 2.2 -> 2 -> 1.0
    assert nx.fq4_ue8m0(blk * torch.tensor([1.0, 1.1 / 1.03] + [1.0] * 30))[:2].tolist() == [3.0, 1.0]
    # fq4 e4m3: amax 7 -> s = e4m3(7/6 = 1.1667) = 1.125; 7 / 1.125 = 6.2 saturates at 6 -> 6.75
    b16 = torch.zeros(16)
    b16[0] = 7.0
    assert nx.fq4_e4m3(b16)[0].item() == 6.75
    # stable top-k: ties go to the lowest index
    v, i = nx.stable_topk(torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0]]), 3)
    assert i.tolist() == [[1, 3, 0]]


def test_candidate_pool_pins_newest_block():
    score = torch.tensor([[5.0] * 8 + [1.0] * 8 + [4.0] * 8 + [0.0] * 3 + [float("-inf")] * 2])
    pool = candidate_pool(score, torch.tensor([27]), block=8, n_blocks=2)
    # block 0 (max 5) wins on score; block 3 holds the newest visible position 26 and is pinned
    assert pool[0].nonzero().flatten().tolist() == list(range(8)) + [24, 25, 26, 27, 28]


def test_sinkhorn_ends_on_column_step(ref):
    R = torch.randn(3, 4, ref.cfg.hidden).bfloat16()
    blk = ref.layers[0]
    pre, post, M = hc_mixes(R, blk.hc_attn, ref.cfg.hc_iters, ref.cfg.hc_eps, ref.cfg.eps)
    assert torch.allclose(M.sum(-2), torch.ones(3, 4), atol=1e-5)  # columns (sum over source i)
    assert torch.allclose(M.sum(-1), torch.ones(3, 4), atol=1e-3)
    assert (pre > 0).all() and (pre < 1 + 2e-6).all() and (post > 0).all() and (post < 2).all()


def test_engram_requantisation_lossless(ref):
    """§3.6 (derived): the gathered FP8 rows are unchanged by lin8's per-32 activation quantisation."""
    E = ref.layers[1].engram
    e = nx.dequant_rows(E.rows[:512], E.scale[:512]).bfloat16()
    assert torch.equal(nx.fq8(e), e.float())


def test_token_map_file():
    m = np.load(DEFAULT_TOKEN_MAP, allow_pickle=False)
    assert m.dtype == np.int32 and m.shape == (129280,)
    assert m.min() >= 0 and m.max() + 1 == 99092


# ---- the model on the random tiny checkpoint ----------------------------------------------------

def test_prefill_finite_and_live(ref, full):
    logits, trace, _ = full
    assert [name for name, _ in trace] == [f"layers.{l}" for l in range(10)]
    for name, R in trace:
        Rf = R.float()
        assert torch.isfinite(Rf).all(), name
        rms = Rf.pow(2).mean(-1).sqrt()
        assert (rms > 0.1).all() and (rms < 100).all(), (name, rms.min(), rms.max())
        assert (Rf - Rf.mean(1, keepdim=True)).abs().amax() > 0, f"{name}: the 4 copies are identical"
        assert Rf.std(0).mean() > 0.1, f"{name}: the positions collapsed to one vector"
    assert logits.shape == (N_FULL, 129280) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert (logits.std(-1) > 0.1).all(), "constant logit rows"
    assert logits.argmax(-1).unique().numel() > N_FULL // 2, "degenerate next-token predictions"


def test_causal_window_at_layer0(ref, ids, full):
    """Layer 0 is window-only (16): its output at t depends on tokens t-15..t only."""
    _, trace, _ = full
    t, W = 60, ref.cfg.window
    for j, same in ((t - W, True), (t - W + 1, False)):
        alt = list(ids[: t + 1])
        alt[j] = (alt[j] + 1) % 129280
        ref.trace = []
        ref.prefill(ref.new_sequence(), alt)
        R0, ref.trace = ref.trace[0][1], None
        assert torch.equal(R0[:j], trace[0][1][:j])
        assert torch.equal(R0[t], trace[0][1][t]) == same, (j, same)


def test_chunked_prefill_matches_whole(ref, ids, full):
    logits, _, seq_full = full
    seq = ref.new_sequence()
    parts = [ref.prefill(seq, ids[a:b], all_logits=True) for a, b in CHUNKS]
    torch.testing.assert_close(torch.cat(parts), logits, rtol=0, atol=1e-4)
    # the caches end identical too: rings, compressed KV, index K, compressor state, DSpark rings
    assert seq.pos == seq_full.pos == N_FULL
    for l in seq.rings:
        assert torch.equal(seq.rings[l], seq_full.rings[l]), l
    for l in seq.comp_kv:
        assert seq.comp_kv[l].shape[0] == N_FULL // ref.cfg.ratios[l]
        assert torch.equal(seq.comp_kv[l], seq_full.comp_kv[l]) and torch.equal(seq.index_k[l], seq_full.index_k[l])
    for i in seq.mtp_rings:
        assert torch.equal(seq.mtp_rings[i], seq_full.mtp_rings[i]), i
    assert seq.comp_state[2] is not None  # N_FULL is odd: an open ratio-2 group waits in the state
    assert torch.equal(seq.comp_state[2][0], seq_full.comp_state[2][0])


def test_decode_matches_prefill(ref, ids, full):
    logits, _, _ = full
    seq = ref.new_sequence()
    first = ref.prefill(seq, ids[:N_PROMPT])
    torch.testing.assert_close(first, logits[N_PROMPT - 1], rtol=0, atol=1e-4)
    assert N_FULL - N_PROMPT >= 40
    longer = ref.prefill(ref.new_sequence(), ids[:N_PROMPT + 1])  # prefill of N+1, literally
    torch.testing.assert_close(longer, logits[N_PROMPT], rtol=0, atol=1e-4)
    for t in range(N_PROMPT, N_FULL):
        got = ref.decode(seq, ids[t])
        torch.testing.assert_close(got, logits[t], rtol=0, atol=1e-4, msg=lambda m: f"decode pos {t}: {m}")


def test_odd_length_prompt(ref, ids, full):
    logits, _, _ = full
    seq = ref.new_sequence()
    n = 61
    torch.testing.assert_close(ref.prefill(seq, ids[:n]), logits[n - 1], rtol=0, atol=1e-4)
    assert seq.comp_state[2] is not None and seq.comp_state[4] is not None
    for t in (n, n + 1, n + 2):  # the pending odd token completes its group in decode
        torch.testing.assert_close(ref.decode(seq, ids[t]), logits[t], rtol=0, atol=1e-4)
    assert seq.comp_kv[2].shape[0] == (n + 3) // 2 and seq.comp_kv[5].shape[0] == n + 3


def test_dspark_draft(ref, ids, full):
    logits, _, seq_full = full
    seq = ref.new_sequence()
    ref.prefill(seq, ids[:N_PROMPT])
    last = int(logits[N_PROMPT - 1].argmax())
    ref.trace = []
    drafts, conf = ref.draft(seq, last)
    trace, ref.trace = ref.trace, None
    assert [name for name, _ in trace] == ["mtp.0", "mtp.1", "mtp.2"]
    assert all(torch.isfinite(R.float()).all() for _, R in trace)
    assert len(drafts) == 5 and all(0 <= d < 129280 for d in drafts)
    assert conf.shape == (5,) and conf.dtype == torch.float32 and torch.isfinite(conf).all()
    assert conf.unique().numel() > 1
    # drafting reads the sequence but leaves it untouched
    again, conf_again = ref.draft(seq, last)
    assert again == drafts and torch.equal(conf_again, conf) and seq.pos == N_PROMPT
    # the context keys matter: another history with the same last token drafts differently
    other = ref.new_sequence()
    ref.prefill(other, ids[1:N_PROMPT + 1])
    assert not torch.equal(ref.draft(other, last)[1], conf)
    # a second draft step after one decode step (the decode writes the new context key first)
    nxt = int(ref.decode(seq, last).argmax())
    drafts2, conf2 = ref.draft(seq, nxt)
    assert len(drafts2) == 5 and torch.isfinite(conf2).all() and not torch.equal(conf2, conf)
    # HF-REF Gumbel sampling path
    g = torch.Generator().manual_seed(0)
    sampled, conf3 = ref.draft(seq, last, temperature=1.0, generator=g)
    assert len(sampled) == 5 and all(0 <= d < 129280 for d in sampled) and torch.isfinite(conf3).all()
