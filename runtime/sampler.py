"""Token sampling with DeepInfer's semantics (spec §10): temperature, top-p then top-k, and a
counter-based SplitMix64 RNG, so a request's tokens depend only on its seed, its logits and the
positions it samples at, never on which other requests share the step.

One deliberate difference from DeepInfer: below the temperature clamp (1e-5) DeepInfer samples at
T = 1e-5; here that case is an exact argmax (lowest id on ties), so greedy decoding equals the
reference model's argmax even where the top two logits are within a few 1e-5 of each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams

MASK64 = (1 << 64) - 1
GOLD = 0x9E3779B97F4A7C15  # the golden-ratio increment of SplitMix64
DRAFT_SEED_OFFSET = 1000000007  # draft sampling (tag "mtp") uses seq_seed + this as its base

# The three uniforms §10 defines per sample position.
FRESH, RESIDUAL, VERIFY = 0, 1, 2


def splitmix64(z: int) -> int:
    """SplitMix64's output function, including its increment (all arithmetic mod 2**64)."""
    z = (z + GOLD) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(z: int) -> float:
    """A double in [0, 1) from the top 53 bits of splitmix64(z)."""
    return (splitmix64(z) >> 11) * 2.0 ** -53


def sample_uniform(seed: int, pos: int, case: int = FRESH, draft: bool = False) -> float:
    """The uniform of sample position `pos` for `case` (FRESH, RESIDUAL or VERIFY), spec §10."""
    base = (seed + DRAFT_SEED_OFFSET) & MASK64 if draft else seed & MASK64
    if case == VERIFY:
        return uniform(base ^ (((3 * pos + 2) * GOLD) & MASK64))
    if case not in (FRESH, RESIDUAL):
        raise ValueError(f"sample case must be FRESH (0), RESIDUAL (1) or VERIFY (2), got {case}")
    s = ((3 * pos + case) * GOLD) & MASK64
    return uniform((base + (s ^ ((s << 13) & MASK64))) & MASK64)


def filter_logits(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """One row's logits / T with the tokens top-p and then top-k drop set to -inf (fp32)."""
    scaled = logits.float() / temperature
    vocab = scaled.shape[-1]
    if top_p < 1:  # at 1 every token stays (fp32 rounding of the cumsum could otherwise cut the far tail)
        probs = torch.softmax(scaled, -1)
        # stable descending sort: among equal probabilities the lower id ranks first
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        # drop a token once the mass strictly before it already exceeds top_p (the first always stays)
        drop_sorted = (torch.cumsum(sorted_probs, -1) - sorted_probs) > top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if 0 < top_k < vocab:
        order = torch.sort(scaled, descending=True, stable=True).indices
        drop = torch.ones(vocab, dtype=torch.bool).scatter_(-1, order[:top_k], False)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def probs64(filtered: torch.Tensor) -> torch.Tensor:
    """The fp64 distribution the sampler draws from (softmax of the filtered logits)."""
    return torch.exp(torch.log_softmax(filtered.float(), -1).double())


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The smallest id whose cumulative probability (fp64) exceeds u * total."""
    cdf = torch.cumsum(probs, -1)
    token = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    return min(token, cdf.shape[-1] - 1)  # only reachable through rounding at u -> 1


def sample_from_logits(filtered: torch.Tensor, u: float) -> int:
    """Inverse CDF in fp64: the smallest id whose cumulative probability exceeds u * total."""
    return inverse_cdf(probs64(filtered), u)


@dataclass
class SampleRequest:
    """What the sampler needs for one logits row."""
    params: SamplingParams
    seed: int  # the request's 64-bit sequence seed
    pos: int  # the sample position (§10): the position the new token will take


def sample(logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
    """One token per row of `logits` [n, V]."""
    if logits.shape[0] != len(requests):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} sample requests")
    greedy = [i for i, req in enumerate(requests) if req.params.greedy]
    out = [0] * len(requests)
    if greedy:  # one argmax over all greedy rows (first maximum = lowest id, as per row)
        best = torch.argmax(logits[greedy] if len(greedy) < len(requests) else logits, dim=-1).tolist()
        for i, t in zip(greedy, best):
            out[i] = t
    for i, (row, req) in enumerate(zip(logits, requests)):
        p = req.params
        if not p.greedy:
            filtered = filter_logits(row, p.temperature, p.top_p, p.top_k)
            out[i] = sample_from_logits(filtered, sample_uniform(req.seed, req.pos, FRESH))
    return out


def verify_drafts(logits: torch.Tensor, drafts: list[int], req: SampleRequest) -> tuple[list[int], int]:
    """Spec §5.5 over one sequence's verify rows: `logits` [1 + m, V] are the target's rows for
    [t*, d_0 .. d_{m-1}], row j predicting position req.pos + j and verifying d_j. Returns the
    emitted tokens (the accepted drafts, then one token from the first rejecting row or, if all
    m are accepted, a fresh sample from row m) and the number of accepted drafts.

    The draft head proposes argmax tokens, so the draft distribution p_j is a point mass at d_j
    and the rule reduces to: accept d_j iff U_verify < q_j(d_j) (min(q/p, 1) with p = 1); on the
    first rejection draw from the residual max(q_j - p_j, 0), i.e. q_j without d_j, with the
    RESIDUAL uniform. Each emitted token then has exactly the target's distribution:
    P(d_j) = q_j(d_j) and P(y != d_j) = (1 - q_j(d_j)) * q_j(y) / (1 - q_j(d_j)) = q_j(y), so
    speculation changes how many tokens a step yields, never their distribution. (DeepInfer's
    residual subtracts exp(log p - 5e-5), a rounding allowance for a sampled p; a point mass is
    exact.) At the greedy clamp this is: accept iff d_j is the argmax; then emit the argmax."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{logits.shape[0]} verify rows for {len(drafts)} drafts (want drafts + 1)")
    p = req.params
    out = []
    for j, x in enumerate(drafts):
        row, pos = logits[j], req.pos + j
        if p.greedy:
            best = int(torch.argmax(row))
            if best != x:
                return out + [best], j
            out.append(x)
            continue
        q = probs64(filter_logits(row, p.temperature, p.top_p, p.top_k))
        qx, total = float(q[x]), float(q.sum())
        # (nothing but x left in fp64: the residual is empty and x is the only outcome)
        if sample_uniform(req.seed, pos, VERIFY) < qx / total or total - qx <= 0:
            out.append(x)
            continue
        q[x] = 0
        return out + [inverse_cdf(q, sample_uniform(req.seed, pos, RESIDUAL))], j
    last = logits[len(drafts)]
    if p.greedy:
        return out + [int(torch.argmax(last))], len(drafts)
    u = sample_uniform(req.seed, req.pos + len(drafts), FRESH)
    return out + [sample_from_logits(filter_logits(last, p.temperature, p.top_p, p.top_k), u)], len(drafts)
