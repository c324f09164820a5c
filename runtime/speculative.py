"""DSpark speculation helpers the engine uses: confidence rates, the confidence-scheduled split
of a step's verify rows and its budget from a step-time curve (spec §5.4, §5.6), and the
per-run statistics.

The verification rule itself is `sampler.verify_drafts` (spec §5.5)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

CONFIDENCE_TEMPERATURE_ENV = "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE"


def confidence_rates(conf_logits: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
    """a_j = prod_{t <= j} sigmoid(clamp(z_t / T, -60, 60)) per row of confidence logits [n, block]
    (§5.4's probability, §5.6's cumulative rate; non-increasing in j). T from the environment as
    in DeepInfer, default 1."""
    if temperature is None:
        temperature = float(os.environ.get(CONFIDENCE_TEMPERATURE_ENV, "1.0"))
    conf = torch.sigmoid(torch.clamp(conf_logits.double() / temperature, -60, 60))
    return torch.cumprod(conf, dim=-1)


def split_by_confidence(rates: list[list[float]], budget: int) -> list[int]:
    """Drafts to verify per sequence under a budget of `budget` verify rows for the N sequences
    (each takes its own row t* first), §5.6: rank every (sequence i, draft j) by its rate a_ij,
    descending, ties to the lower i and then the lower j, and give each sequence the pairs of its
    own among the top budget - N. Rates are non-increasing in j, so every count is a prefix; the
    engine verifies drafts[:count] (a rate list that is not monotone still gets a prefix)."""
    n = len(rates)
    extra = max(budget - n, 0)
    pairs = sorted(((-a, i, j) for i, r in enumerate(rates) for j, a in enumerate(r)))
    counts = [0] * n
    for _, i, _ in pairs[:extra]:
        counts[i] += 1
    return counts


def plan_step_curve(plan: dict, device: str) -> list[tuple[str, int, int, float]]:
    """The step-time curve a plan carries (`deepinfer autotune --apply --step-curve` measured it:
    autotune/steps.py) as (bucket, sequences, rows, seconds), where it was measured on a device
    of this name; [] otherwise (a step's cost belongs to the device that ran it)."""
    rec = plan.get("step_time_curve")
    if not isinstance(rec, dict) or rec.get("device") != device:
        return []
    return [(b["bucket"], b["seqs"], b["rows"], b["seconds"]) for b in rec.get("buckets", [])]


def budget_from_curve(rates: list[list[float]], others: int, curve, draft_seconds: float = 0.0) -> int | None:
    """§5.6's choice of the verify budget from a measured step-time curve: `curve` holds
    (bucket, sequences, rows, seconds) per step shape the executor runs; the step has len(rates)
    sequences with drafts and `others` sequences of one row each. Each shape that holds the step's
    sequences is a candidate: its rows (less the others') are the budget, split_by_confidence
    shares it out, and the step then runs in the smallest shape holding the rows it uses (a shape
    of one row per sequence holds only steps without drafts, as a decode bucket does). Returns
    the budget that maximises expected tokens per second, sum over sequences of (1 + the rates of
    its verified drafts) / that shape's seconds (ties to the smaller budget); None where no shape
    holds the sequences. Step time is a step function of the rows (one shape per bucket), so
    within a shape the most rows it holds is the best budget: the candidates are exact.
    `draft_seconds` is added to every step that verifies drafts: the draft call's cost where the
    drafts are still to be made (once they exist it is spent, and the split leaves it out)."""
    seqs = len(rates) + others
    shapes = sorted((rows, t, s) for _, s, rows, t in curve if s >= seqs and rows >= seqs)
    if not shapes:
        return None

    def seconds(used: int) -> float | None:
        # as choose_bucket picks: a step without drafts runs in a decode shape where one holds it
        decode = [(rows, t) for rows, t, s in shapes if rows == s] if used == seqs else []
        fits = decode or [(rows, t) for rows, t, s in shapes if rows > s and rows >= used]
        return min(fits)[1] if fits else None

    best = None
    for rows, _, s in shapes:
        budget = rows - others if rows > s else len(rates)  # (a decode shape: no drafts)
        counts = split_by_confidence(rates, budget)
        t = seconds(seqs + sum(counts))
        if t is None or t <= 0:
            continue
        t += draft_seconds if sum(counts) else 0.0
        rate = (seqs + sum(sum(r[:c]) for r, c in zip(rates, counts))) / t
        if best is None or rate > best[0]:
            best = (rate, budget)
    return None if best is None else best[1]


@dataclass
class SpecStats:
    """Counters of one engine since it started (or of one run: `since`)."""
    verifies: int = 0  # (sequence, step) pairs that verified drafts
    drafts_verified: int = 0  # draft rows fed to the target
    drafts_accepted: int = 0
    spec_steps: int = 0  # steps with at least one verify chunk
    verify_rows: int = 0  # rows of verify chunks (1 + drafts each), summed over spec steps
    draft_calls: int = 0
    draft_seconds: float = 0.0
    step_seconds: float = 0.0  # whole engine steps, drafts included

    def since(self, before: "SpecStats") -> "SpecStats":
        return SpecStats(*(getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__))

    def copy(self) -> "SpecStats":
        return self.since(SpecStats())

    def summary(self) -> dict:
        """Mean accepted length: tokens a verify yields per sequence (accepted drafts + 1)."""
        return {
            "mean_accepted_length": (self.verifies + self.drafts_accepted) / self.verifies if self.verifies else 0.0,
            "acceptance_rate": self.drafts_accepted / self.drafts_verified if self.drafts_verified else 0.0,
            "verify_rows_per_step": self.verify_rows / self.spec_steps if self.spec_steps else 0.0,
            "draft_time_share": self.draft_seconds / self.step_seconds if self.step_seconds else 0.0,
            "verifies": self.verifies, "drafts_verified": self.drafts_verified,
            "drafts_accepted": self.drafts_accepted, "spec_steps": self.spec_steps,
        }
