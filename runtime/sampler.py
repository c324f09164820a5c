"""Token sampling with DeepInfer's semantics (spec §10): temperature, top-p then top-k, and a
counter-based SplitMix64 RNG, so a request's tokens depend only on its seed, its logits and the
positions it samples at, never on which other requests share the step. vLLM's extras keep that
property: masks (min_tokens, bad words) and penalties first, each from the request's own tokens,
then temperature and min_p before top-p / top-k (vLLM's order; min_p is not in §10).

One deliberate difference from DeepInfer: below the temperature clamp (1e-5) DeepInfer samples at
T = 1e-5; here that case is an exact argmax (lowest id on ties), so greedy decoding equals the
reference model's argmax even where the top two logits are within a few 1e-5 of each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


def sample_seed(seed: int, index: int) -> int:
    """The sequence seed of sample `index` of a request: the request's seed for sample 0 (so n = 1
    samples as ever), else output `index` of a SplitMix64 stream started at it; distinct per
    sample (splitmix64 is a bijection) and fixed by the request's seed alone."""
    return seed & MASK64 if index == 0 else splitmix64((seed + (index - 1) * GOLD) & MASK64)


def filter_logits(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  min_p: float = 0.0) -> torch.Tensor:
    """One row's logits / T with the tokens min_p, top-p and then top-k drop set to -inf (fp32)."""
    scaled = logits.float() / temperature
    vocab = scaled.shape[-1]
    if min_p > 0:
        probs = torch.softmax(scaled, -1)
        scaled = scaled.masked_fill(probs < min_p * probs.max(), float("-inf"))
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
    # for a request whose processing reads its history (SamplingParams.depends_on_history):
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    banned: list[int] = field(default_factory=list)  # ids masked at this row (banned_tokens)
    # a structured-output request: per logits row (a verify chunk's 1 + m), the ids its grammar allows
    allowed: list[torch.Tensor] | None = None

    @property
    def processed(self) -> bool:
        return bool(self.banned) or self.params.has_penalties or self.allowed is not None


def banned_tokens(output_ids: list[int], min_tokens: int, stop_ids: list[int],
                  bad_words: list[list[int]]) -> list[int]:
    """The ids vLLM masks at the next row: the stop ids (EOS, stop_token_ids) while fewer than
    min_tokens tokens are out; the last token of each bad word whose other tokens end the output."""
    banned = list(stop_ids) if len(output_ids) < min_tokens else []
    for word in bad_words:
        prefix = word[:-1]
        if len(output_ids) >= len(prefix) and output_ids[len(output_ids) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def grammar_masked(row: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`row` with the ids a grammar disallows at -inf (before every other processing and filter)."""
    return row.float().masked_fill(~allowed.to(row.device), float("-inf"))


def process_logits(row: torch.Tensor, req: SampleRequest) -> torch.Tensor:
    """One row (fp32) with vLLM's history-dependent processing: the banned ids at -inf, then the
    repetition penalty (prompt and output tokens), then frequency and presence (output tokens)."""
    p, row = req.params, row.float().clone()
    if req.allowed is not None:
        row = grammar_masked(row, req.allowed[0])
    if req.banned:
        row[req.banned] = float("-inf")
    vocab = row.shape[-1]
    if p.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[torch.tensor(req.prompt_ids + req.output_ids, dtype=torch.long, device=row.device)] = True
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row = torch.where(seen, penalized, row)
    if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
        ids = torch.tensor(req.output_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(ids, minlength=vocab).float()
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return row


def sample(logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
    """One token per row of `logits` [n, V]."""
    if logits.shape[0] != len(requests):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} sample requests")
    processed = {i: process_logits(logits[i], req) for i, req in enumerate(requests) if req.processed}
    greedy = [i for i, req in enumerate(requests) if req.params.greedy and i not in processed]
    out = [0] * len(requests)
    if greedy:  # one argmax over all plain greedy rows (first maximum = lowest id, as per row)
        best = torch.argmax(logits[greedy] if len(greedy) < len(requests) else logits, dim=-1).tolist()
        for i, t in zip(greedy, best):
            out[i] = t
    for i, req in enumerate(requests):
        p, row = req.params, processed.get(i, logits[i])
        if p.greedy and i in processed:
            out[i] = int(torch.argmax(row))
        elif not p.greedy:
            filtered = filter_logits(row, p.temperature, p.top_p, p.top_k, p.min_p)
            out[i] = sample_from_logits(filtered, sample_uniform(req.seed, req.pos, FRESH))
    return out


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, int, list[int], list[float]]]:
    """Per row [m, V] and the token emitted from it: (its logprob, its rank (1 = most likely), the
    ids and logprobs of the `top` most likely tokens), of the raw distribution log_softmax(row)."""
    lps = torch.log_softmax(rows.float(), -1)
    out = []
    for row, token in zip(lps, tokens):
        lp = float(row[token])
        best_lps, best = torch.sort(row, descending=True, stable=True)
        out.append((lp, int((row > lp).sum()) + 1, best[:top].tolist(), best_lps[:top].tolist()))
    return out


def verify_drafts(logits: torch.Tensor, drafts: list[int], req: SampleRequest,
                  accept=None) -> tuple[list[int], int]:
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
    exact.) At the greedy clamp this is: accept iff d_j is the argmax; then emit the argmax.

    `accept(j) -> bool` replaces the acceptance test of row j (benchmark mode: the engine's
    fixed acceptance); a row it rejects emits what the rule emits at a rejection there, so the
    tokens after a forced acceptance are the target's, but the accepted drafts are not."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{logits.shape[0]} verify rows for {len(drafts)} drafts (want drafts + 1)")
    p = req.params
    if p.depends_on_history:  # row j's history would hold d_0 .. d_{j-1}: such requests do not speculate
        raise ValueError("verify_drafts does not apply penalties, min_tokens or bad_words")
    if req.allowed is not None:  # a structured-output request: row j masked by its grammar after d_0 .. d_{j-1}
        if len(req.allowed) != logits.shape[0]:
            raise ValueError(f"{len(req.allowed)} grammar masks for {logits.shape[0]} verify rows")
        logits = torch.stack([grammar_masked(row, allowed) for row, allowed in zip(logits, req.allowed)])
    out = []
    for j, x in enumerate(drafts):
        row, pos = logits[j], req.pos + j
        if p.greedy:
            best = int(torch.argmax(row))
            if not (accept(j) if accept is not None else best == x):
                return out + [best], j
            out.append(x)
            continue
        q = probs64(filter_logits(row, p.temperature, p.top_p, p.top_k, p.min_p))
        qx, total = float(q[x]), float(q.sum())
        if accept is not None:
            accepted = accept(j)
        else:  # (nothing but x left in fp64: the residual is empty and x is the only outcome)
            accepted = sample_uniform(req.seed, pos, VERIFY) < qx / total or total - qx <= 0
        if accepted:
            out.append(x)
            continue
        if total - qx <= 0:  # a forced rejection of the only token the row can give: the row gives it
            return out + [x], j
        q[x] = 0
        return out + [inverse_cdf(q, sample_uniform(req.seed, pos, RESIDUAL))], j
    last = logits[len(drafts)]
    if p.greedy:
        return out + [int(torch.argmax(last))], len(drafts)
    u = sample_uniform(req.seed, req.pos + len(drafts), FRESH)
    return out + [sample_from_logits(filter_logits(last, p.temperature, p.top_p, p.top_k, p.min_p), u)], len(drafts)
