"""DSpark speculation helpers the engine uses: confidence rates and the confidence-scheduled split
of a step's verify rows (spec §5.4, §5.6), and the per-run statistics.

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
