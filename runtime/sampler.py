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


def sample_from_logits(filtered: torch.Tensor, u: float) -> int:
    """Inverse CDF in fp64: the smallest id whose cumulative probability exceeds u * total."""
    probs = torch.exp(torch.log_softmax(filtered.float(), -1).double())
    cdf = torch.cumsum(probs, -1)
    token = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    return min(token, cdf.shape[-1] - 1)  # only reachable through rounding at u -> 1


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
    out = []
    for row, req in zip(logits, requests):
        p = req.params
        if p.greedy:
            out.append(int(torch.argmax(row)))  # first maximum = lowest id
            continue
        filtered = filter_logits(row, p.temperature, p.top_p, p.top_k)
        out.append(sample_from_logits(filtered, sample_uniform(req.seed, req.pos, FRESH)))
    return out
