"""Sampler (spec §10): the SplitMix64 RNG against published and hand-derived values, the top-p then
top-k filter, the fp64 inverse CDF, greedy ties; SamplingParams validation; draft verification
(spec §5.5) keeps the target distribution."""
import math

import numpy as np
import pytest
import torch

from deepinfer.runtime.sampler import (
    DRAFT_SEED_OFFSET, FRESH, GOLD, RESIDUAL, VERIFY, SampleRequest, banned_tokens, filter_logits, inverse_cdf,
    probs64, process_logits, sample, sample_from_logits, sample_seed, sample_uniform, splitmix64, token_logprobs,
    uniform, verify_drafts,
)
from deepinfer.runtime.sampling_params import SamplingParams, SamplingParamsError

NEG_INF = float("-inf")


def test_splitmix64_matches_the_published_sequence():
    # SplitMix64 seeded with 0 yields e220a8397b1dcdaf, 6e789e6aa1b965f4, 06c45d188009454f (Vigna's
    # reference generator); our mix(z) includes the increment, so mix(k * GOLD) is output k+1.
    assert GOLD == 0x9E3779B97F4A7C15
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(GOLD) == 0x6E789E6AA1B965F4
    assert splitmix64(2 * GOLD % 2 ** 64) == 0x06C45D188009454F
    assert uniform(0) == (0xE220A8397B1DCDAF >> 11) / 2 ** 53


def _np_mix(z):
    """The same function written with numpy's wrapping uint64 arithmetic (an independent derivation)."""
    with np.errstate(over="ignore"):
        z = np.uint64(z) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return int(z ^ (z >> np.uint64(31)))


@pytest.mark.parametrize("seed,pos", [(0, 0), (12345, 7), (2 ** 64 - 1, 100003), (987654321987654321, 31)])
def test_sample_uniforms_follow_section_10(seed, pos):
    with np.errstate(over="ignore"):
        for case in (FRESH, RESIDUAL):
            s = np.uint64(3 * pos + case) * np.uint64(GOLD)
            z = np.uint64(seed) + (s ^ (s << np.uint64(13)))
            assert sample_uniform(seed, pos, case) == (_np_mix(z) >> 11) * 2.0 ** -53
        z = np.uint64(seed) ^ (np.uint64(3 * pos + 2) * np.uint64(GOLD))
        assert sample_uniform(seed, pos, VERIFY) == (_np_mix(z) >> 11) * 2.0 ** -53
        s = np.uint64(3 * pos) * np.uint64(GOLD)
        z = np.uint64((seed + DRAFT_SEED_OFFSET) % 2 ** 64) + (s ^ (s << np.uint64(13)))
        assert sample_uniform(seed, pos, FRESH, draft=True) == (_np_mix(z) >> 11) * 2.0 ** -53


def test_sample_uniform_pinned_values():
    # computed once from the formulas of §10; pins the function against silent changes
    assert sample_uniform(0, 0) == pytest.approx(0.8833108082136426, abs=0)
    assert sample_uniform(12345, 7) == pytest.approx(0.399495514874043, abs=0)
    assert sample_uniform(12345, 7, VERIFY) == pytest.approx(0.5344270463249408, abs=0)
    assert sample_uniform(12345, 7, draft=True) == pytest.approx(0.8622881021630102, abs=0)
    with pytest.raises(ValueError):
        sample_uniform(0, 0, case=3)


def _kept(logits, **kw):
    out = filter_logits(torch.tensor(logits), kw.get("temperature", 1.0), kw.get("top_p", 1.0), kw.get("top_k", -1))
    return [i for i, v in enumerate(out.tolist()) if v != NEG_INF]


def test_top_p_keeps_tokens_until_the_mass_before_them_exceeds_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert _kept(logits, top_p=0.7) == [0, 1]  # mass before token 2 is 0.8 > 0.7
    assert _kept(logits, top_p=0.4) == [0]  # the top token always stays
    assert _kept(logits, top_p=0.9) == [0, 1, 2]
    assert _kept(logits, top_p=1.0) == [0, 1, 2, 3]
    # order by probability, not by id
    assert _kept([math.log(0.05), math.log(0.3), math.log(0.5), math.log(0.15)], top_p=0.7) == [1, 2]


def test_top_p_applies_before_top_k():
    # top-p on the full distribution keeps {0, 1}; top-k 2 keeps both. (Top-k first would renormalise
    # to [.57, .43] and top-p 0.5 would then keep only token 0.)
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist()
    assert _kept(logits, top_p=0.5, top_k=2) == [0, 1]
    assert _kept(logits, top_k=3) == [0, 1, 2]
    assert _kept(logits, top_k=10 ** 6) == [0, 1, 2, 3]  # k above the vocabulary keeps everything


def test_ties_go_to_the_lowest_id():
    assert _kept([1.0, 3.0, 3.0, 3.0, 0.0], top_k=2) == [1, 2]
    greedy = SamplingParams(temperature=0)
    assert sample(torch.tensor([[1.0, 3.0, 3.0], [5.0, 5.0, 0.0]]), [SampleRequest(greedy, 0, 0)] * 2) == [1, 0]
    # below the 1e-5 clamp is greedy too; the seed plays no part
    tiny_t = SamplingParams(temperature=1e-6)
    assert sample(torch.tensor([[0.0, 2.0, 1.0]]), [SampleRequest(tiny_t, 99, 5)]) == [1]


def test_temperature_scales_logits():
    out = filter_logits(torch.tensor([1.0, 2.0]), 0.5, 1.0, -1)
    assert out.tolist() == [2.0, 4.0]


def test_inverse_cdf_in_fp64():
    logits = torch.tensor([0.25, 0.25, 0.5]).log()
    assert sample_from_logits(logits, 0.0) == 0
    assert sample_from_logits(logits, 0.3) == 1
    assert sample_from_logits(logits, 0.5) == 2  # cdf[1] == 0.5 is not > 0.5
    assert sample_from_logits(logits, 1 - 2 ** -53) == 2
    masked = torch.tensor([NEG_INF, 0.0, NEG_INF, 0.0])
    assert {sample_from_logits(masked, u) for u in (0.0, 0.2, 0.49, 0.51, 0.99)} == {1, 3}


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    probs = torch.tensor([0.1, 0.6, 0.05, 0.25])
    logits = probs.log().unsqueeze(0)
    p = SamplingParams(temperature=1.0, top_k=3)
    draws = [sample(logits, [SampleRequest(p, 42, pos)])[0] for pos in range(4000)]
    assert draws == [sample(logits, [SampleRequest(p, 42, pos)])[0] for pos in range(4000)]
    assert draws != [sample(logits, [SampleRequest(p, 43, pos)])[0] for pos in range(4000)]
    counts = np.bincount(draws, minlength=4) / len(draws)
    assert counts[2] == 0  # the top-k 3 drops the 0.05 token
    kept = probs.clone()
    kept[2] = 0
    kept /= kept.sum()
    # 4000 draws: the standard error of a frequency is <= 0.008; 0.03 is ~4 sigma
    assert np.abs(counts - kept.numpy()).max() < 0.03, counts


@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"n": 0}, "n"),
    ({"n": 2.0}, "n"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # above max_tokens (16)
    ({"bad_words": ["ok", " "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"best_of": 2}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"),
])
def test_sampling_params_reject_bad_values_in_one_line(kwargs, needle):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, ValueError) and e.value.param == needle  # the CLI names the flag from it
    assert str(e.value).startswith(needle) and "\n" not in str(e.value)


def test_sampling_params_accept_edges():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_tokens=1, seed=2 ** 64 - 1)
    assert SamplingParams(top_k=10 ** 9).top_k == 10 ** 9
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-5).greedy
    SamplingParams(n=3, best_of=3, logprobs=0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=2,
                   min_p=1, min_tokens=16, bad_words=["x"])
    assert not SamplingParams(min_p=0.5, logprobs=5, n=2).depends_on_history  # these speculate
    assert all(SamplingParams(**kw).depends_on_history for kw in (
        {"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1}, {"min_tokens": 1},
        {"bad_words": ["x"]}))


# ---- vLLM's extras: n seeds, penalties, masks, min_p, logprobs ------------------------------------

def test_sample_seeds_are_the_request_seed_then_a_splitmix_stream():
    assert sample_seed(42, 0) == 42  # n = 1 samples exactly as before
    seeds = [sample_seed(42, i) for i in range(8)]
    assert len(set(seeds)) == 8 and seeds == [sample_seed(42, i) for i in range(8)]
    assert seeds[1:3] == [splitmix64(42), splitmix64(42 + GOLD)]
    assert sample_seed(2 ** 64 - 1, 3) < 2 ** 64


def test_penalties_follow_vllm():
    """repetition: logits of prompt and output tokens divided (> 0) or multiplied (<= 0) by it;
    then frequency per output occurrence and presence once per output token, subtracted."""
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    req = SampleRequest(p, 0, 9, prompt_ids=[0, 4], output_ids=[1, 3, 3])
    want = torch.tensor([2.0 / 2, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 1.0 - 0.25, -2.0 * 2, 1.0])
    assert torch.allclose(process_logits(row, req), want)
    assert torch.equal(row, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0]))  # the executor's logits stay
    banned = process_logits(row, SampleRequest(SamplingParams(min_tokens=1), 0, 9, banned=[3, 5]))
    assert banned[3] == banned[5] == NEG_INF and banned[0] == 2.0
    # greedy takes the argmax of the processed row; plain greedy rows keep today's argmax
    logits = torch.stack([row, row])
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert sample(logits, [SampleRequest(greedy, 0, 9, prompt_ids=[0, 4], output_ids=[1, 3, 3]),
                           SampleRequest(SamplingParams(temperature=0), 0, 9)]) == [0, 3]  # (0 and 5 tie)


def test_banned_tokens_mask_stops_before_min_tokens_and_complete_bad_words():
    stops = [1, 7]
    assert banned_tokens([5, 6], 3, stops, []) == stops
    assert banned_tokens([5, 6, 8], 3, stops, []) == []
    words = [[9], [4, 5], [6, 4, 5]]
    assert banned_tokens([], 0, stops, words) == [9]  # a one-token word: always
    assert banned_tokens([2, 4], 0, stops, words) == [9, 5]  # [4, 5]'s prefix ends the output
    assert banned_tokens([6, 4], 0, stops, words) == [9, 5, 5]
    assert banned_tokens([4, 2], 0, stops, words) == [9]


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    kept = filter_logits(probs.log(), 1.0, 1.0, -1, min_p=0.19) > NEG_INF  # keeps p >= 0.095
    assert kept.tolist() == [True, True, True, False, False]
    hot = filter_logits(probs.log(), 2.0, 1.0, -1, min_p=0.2) > NEG_INF  # after temperature: flatter
    assert hot.tolist() == [True] * 5
    # verification filters with min_p too: a draft min_p drops is never accepted
    p = SamplingParams(temperature=1.0, min_p=0.2)
    logits = torch.stack([probs.log(), probs.log()])
    for seed in range(30):
        out, accepted = verify_drafts(logits, [4], SampleRequest(p, seed, 3))
        assert accepted == 0 and out[0] in (0, 1, 2)
    with pytest.raises(ValueError, match="penalties"):
        verify_drafts(logits, [0], SampleRequest(SamplingParams(presence_penalty=1.0), 0, 3))


def test_token_logprobs_of_the_raw_distribution():
    rows = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 5.0, -1.0]])
    lps = torch.log_softmax(rows, -1)
    (lp0, rank0, ids0, top0), (lp1, rank1, ids1, top1) = token_logprobs(rows, [2, 2], 2)
    assert lp0 == pytest.approx(float(lps[0, 2])) and rank0 == 3  # behind the two tied 3.0s
    assert ids0 == [1, 3] and top0 == pytest.approx(lps[0, [1, 3]].tolist())  # ties: the lower id first
    assert rank1 == 1 and ids1 == [2, 0] and lp1 == pytest.approx(top1[0])
    assert token_logprobs(rows, [0, 3], 0)[1][1:3] == (4, [])


# ---- draft verification (spec §5.5) ---------------------------------------------------------------

# the 99.99% quantiles of chi-square with 3 and 5 degrees of freedom
CHI2_9999 = {3: 21.108, 5: 25.745}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the support of `probs`, and its degrees of freedom."""
    support = probs > 0
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_verification_keeps_the_target_distribution(params):
    """A fixed 3-row verify fixture over a 6-token vocabulary ([t*, d_0, d_1] with a likely d_0 and
    an unlikely d_1), verified under 6000 seeds: the first emitted token follows row 0's target
    distribution, the second (given d_0 was accepted) row 1's, the third (given both were) row 2's,
    each within the chi-square bound; masked tokens never appear."""
    logits = torch.tensor([[0.1, 1.2, -0.5, 1.5, 0.3, -1.0],
                           [0.9, 0.2, 1.1, -0.3, 0.0, 0.4],
                           [-0.2, 0.6, 0.1, 1.0, -0.7, 0.8]])
    drafts = [3, 1]  # q_0(3) is the mode; q_1(1) is small (and survives the top-k)
    q = [probs64(filter_logits(row, params.temperature, params.top_p, params.top_k)).numpy() for row in logits]
    first, second, third = np.zeros(6), np.zeros(6), np.zeros(6)
    for seed in range(6000):
        out, accepted = verify_drafts(logits, drafts, SampleRequest(params, seed, 57))
        assert out[:accepted] == drafts[:accepted] and len(out) == accepted + 1
        first[out[0]] += 1
        if accepted >= 1:
            second[out[1]] += 1
        if accepted == 2:
            third[out[2]] += 1
    for counts, probs in ((first, q[0]), (second, q[1]), (third, q[2])):
        stat, df = chi_square(counts, probs)
        assert stat < CHI2_9999[df], (stat, counts, probs)
        assert counts[probs == 0].sum() == 0
    assert second.sum() > 1000 and third.sum() > 200  # every row was reached often enough to judge


def test_verification_uses_the_verify_residual_and_fresh_uniforms():
    """Which uniform decides what: row j (sample position pos + j) accepts iff VERIFY < q(d_j);
    a rejection draws from q without d_j with RESIDUAL; the row after the last accepted draft
    draws with FRESH, the uniform a plain decode step uses there."""
    p = SamplingParams(temperature=1.0)
    logits = torch.tensor([[0.0, 0.5, 1.0, 0.2], [0.3, 0.1, 0.0, 0.9]])
    q0 = probs64(filter_logits(logits[0], 1.0, 1.0, -1))
    seed, pos = 99, 20
    for x in range(4):
        out, accepted = verify_drafts(logits, [x], SampleRequest(p, seed, pos))
        if sample_uniform(seed, pos, VERIFY) < float(q0[x]):
            assert accepted == 1 and out == [x, sample(logits[1:], [SampleRequest(p, seed, pos + 1)])[0]]
        else:
            residual = q0.clone()
            residual[x] = 0
            cdf = torch.cumsum(residual, 0)
            want = int(torch.searchsorted(cdf, torch.tensor([sample_uniform(seed, pos, RESIDUAL) * float(cdf[-1])],
                                                            dtype=torch.float64), right=True))
            assert accepted == 0 and out == [want] and want != x
    # no drafts: exactly the plain sampler at that position
    for s in range(50):
        assert verify_drafts(logits[:1], [], SampleRequest(p, s, pos))[0] == sample(logits[:1], [SampleRequest(p, s, pos)])


def test_greedy_verification_accepts_the_argmax_only():
    g = SamplingParams(temperature=0)
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 3.0], [0.0, 0.0, 5.0]])
    req = SampleRequest(g, 1, 10)
    assert verify_drafts(logits, [1, 0], req) == ([1, 0, 2], 2)  # ties go to the lowest id, like sample()
    assert verify_drafts(logits, [1, 2], req) == ([1, 0], 1)  # rejected: the argmax instead
    assert verify_drafts(logits, [2, 0], req) == ([1], 0)
    # a draft the request's top-k masks is never accepted
    top1 = SamplingParams(temperature=1.0, top_k=1)
    assert all(verify_drafts(logits[:2], [0], SampleRequest(top1, s, 10)) == ([1], 0) for s in range(20))
    with pytest.raises(ValueError, match="3 verify rows for 1 drafts"):
        verify_drafts(logits, [1], req)


def test_forced_acceptance_emits_what_the_rule_emits_at_that_row():
    """verify_drafts(accept=...), the engine's fixed-acceptance benchmark mode: the callback
    decides each draft in order until it rejects one; the token after the accepted drafts is the
    one §5.5 gives at that row: where the rule itself rejects there, the very same token (the
    residual draw without the draft); after all m drafts, row m's FRESH sample."""
    p = SamplingParams(temperature=1.0)
    logits = torch.tensor([[0.0, 0.5, 1.0, 0.2], [0.3, 0.1, 0.0, 0.9], [1.0, 0.0, 0.2, 0.1]])
    drafts, pos = [2, 3], 40
    seen = set()
    for seed in range(300):
        req = SampleRequest(p, seed, pos)
        normal, accepted = verify_drafts(logits, drafts, req)
        asked = []

        def same_decisions(j):
            asked.append(j)
            return j < accepted

        assert verify_drafts(logits, drafts, req, same_decisions) == (normal, accepted)
        assert asked == list(range(min(accepted + 1, len(drafts))))  # no draw past the first rejection
        seen.add(accepted)
    assert seen == {0, 1, 2}
    # drafts the target would reject, accepted anyway: the row after them samples as a plain step there
    req = SampleRequest(p, 5, pos)
    out, accepted = verify_drafts(logits, [0, 2], req, lambda j: True)
    assert accepted == 2 and out == [0, 2, sample(logits[2:], [SampleRequest(p, 5, pos + 2)])[0]]
    out, accepted = verify_drafts(logits, [0, 2], req, lambda j: j == 0)
    residual = probs64(filter_logits(logits[1], 1.0, 1.0, -1))
    residual[2] = 0
    assert (out, accepted) == ([0, inverse_cdf(residual, sample_uniform(5, pos + 1, RESIDUAL))], 1)
    # greedy: a forced rejection emits the argmax, even where it is the draft
    g = SampleRequest(SamplingParams(temperature=0), 1, pos)
    assert verify_drafts(logits, [2, 3], g, lambda j: False) == ([2], 0)
    assert verify_drafts(logits, [0, 0], g, lambda j: True) == ([0, 0, 0], 2)
    # a forced rejection of the only token the row allows (top-k 1): that token
    top1 = SampleRequest(SamplingParams(temperature=1.0, top_k=1), 3, pos)
    assert verify_drafts(logits, [2, 0], top1, lambda j: False) == ([2], 0)
