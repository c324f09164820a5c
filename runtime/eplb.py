"""Expert-parallel load balancing (spec §11): per-expert load over a sliding window of steps, and
a placement of the expert slots, hot experts replicated, that minimises the busiest rank's load.

The policy is spec §11's, in two greedy stages over the window's steps:
  1. replication: the P - E spare slots go one at a time to the expert whose extra replica most
     lowers  sum over steps of  max over experts of (load / replicas);
  2. placement: the replicas, heaviest first (stable), each to the rank that most lowers  sum over
     steps of  max over ranks of the rank's load,  at most P / W per rank, ties to the lowest rank.
A replica carries load / replicas of its expert (the routing spreads an expert's rows over its
replicas: ir/ops/expert_parallel.py). Placement changes no result, only where rows are computed.
"""
from __future__ import annotations

import os
from collections import deque

import torch

WINDOW_ENV, INTERVAL_ENV = "DEEPINFER_EPLB_WINDOW", "DEEPINFER_EPLB_INTERVAL"


class ExpertLoad:
    """Rows per logical expert of each MoE block over the last `window` steps."""

    def __init__(self, window: int = 100):
        if window < 1:
            raise ValueError(f"the EPLB window must be >= 1 step, got {window}")
        self.window = window
        self.steps: dict[str, deque] = {}
        self._current: dict[str, list[int]] = {}

    def record(self, block: str, load: list[int]) -> None:
        """One block's load in the step running now (end_step closes the step)."""
        self._current[block] = load

    def end_step(self) -> None:
        for block, load in self._current.items():
            self.steps.setdefault(block, deque(maxlen=self.window)).append(load)
        self._current = {}

    def history(self, block: str) -> torch.Tensor:
        """[steps, experts] of the window (float)."""
        return torch.tensor(list(self.steps.get(block, ())), dtype=torch.float64)


def replicate(load: torch.Tensor, num_slots: int) -> list[int]:
    """Replicas per expert (stage 1) for a [steps, experts] load."""
    steps, n = load.shape
    if num_slots < n:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts")
    count = torch.ones(n, dtype=torch.float64)
    for _ in range(num_slots - n):
        per = load / count
        top2 = per.topk(min(2, n), dim=1)
        # each step's max over the experts other than e, for every e
        others = top2.values[:, :1].expand(steps, n).clone()
        if n > 1:
            hit = torch.nn.functional.one_hot(top2.indices[:, 0], n).bool()
            others[hit] = top2.values[:, 1].unsqueeze(1).expand(steps, n)[hit]
        else:
            others.zero_()
        cost = torch.maximum(others, load / (count + 1)).sum(0)
        best = int(torch.argmin(cost))  # ties: the lowest expert id (argmin takes the first)
        count[best] += 1
    return [int(c) for c in count]


def place(load: torch.Tensor, count: list[int], ranks: int) -> list[int]:
    """The slots (stage 2): slots[p] = the logical expert slot p holds; rank r owns slots
    [r * P / W, (r + 1) * P / W), each rank's experts in ascending order."""
    steps, n = load.shape
    total = sum(count)
    if total % ranks:
        raise ValueError(f"{total} slots do not divide over {ranks} ranks")
    cap = total // ranks
    jobs = [(e, load[:, e] / count[e]) for e in range(n) for _ in range(count[e])]
    jobs.sort(key=lambda j: -float(j[1].sum()))  # stable: equal loads keep expert order
    rank_load = torch.zeros(steps, ranks, dtype=torch.float64)
    held: list[list[int]] = [[] for _ in range(ranks)]
    for e, job in jobs:
        best, best_cost = None, None
        for r in range(ranks):
            if len(held[r]) >= cap:
                continue
            trial = rank_load.clone()
            trial[:, r] += job
            cost = float(trial.max(dim=1).values.sum())
            if best_cost is None or cost < best_cost:
                best, best_cost = r, cost
        held[best].append(e)
        rank_load[:, best] += job
    return [e for r in range(ranks) for e in sorted(held[r])]


def rebalance(load: torch.Tensor, num_slots: int, ranks: int) -> list[int]:
    """A new placement (slots, as `place` returns them) for a [steps, experts] load window."""
    return place(load, replicate(load, num_slots), ranks)


def rank_loads(load: torch.Tensor, slots: list[int], ranks: int) -> torch.Tensor:
    """[steps, ranks]: each rank's rows under a placement (an expert's rows split evenly over its replicas)."""
    n = load.shape[1]
    count = torch.zeros(n, dtype=torch.float64)
    for e in slots:
        count[e] += 1
    per = len(slots) // ranks
    out = torch.zeros(load.shape[0], ranks, dtype=torch.float64)
    for p, e in enumerate(slots):
        out[:, p // per] += load[:, e] / count[e]
    return out


def imbalance(load: torch.Tensor, slots: list[int], ranks: int) -> float:
    """The busiest rank's load over the mean rank load, summed over the window's steps (1 = even)."""
    r = rank_loads(load, slots, ranks)
    return float(r.max(dim=1).values.sum() / r.mean(dim=1).sum())


def interval_from_env() -> tuple[int, int]:
    """(steps between rebalances, 0 = off; window steps) from DEEPINFER_EPLB_INTERVAL / _WINDOW."""
    out = []
    for name, default in ((INTERVAL_ENV, 0), (WINDOW_ENV, 100)):
        raw = os.environ.get(name, str(default))
        if not raw.isdigit() or (name == WINDOW_ENV and int(raw) < 1):
            raise ValueError(f"{name}={raw!r} must be a whole number of steps{' >= 1' if name == WINDOW_ENV else ''}")
        out.append(int(raw))
    return out[0], out[1]
