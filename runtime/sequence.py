"""A request as the scheduler sees it, and what the engine hands back when it ends."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: two requests with equal fields are still two requests
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the 64-bit sequence seed of the sampler's RNG (§10)
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_cached: int = 0  # tokens the caches hold = position of the next token to feed
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text: str = ""
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # speculation: the draft head's proposals for the tokens after the last one, and their
    # cumulative confidences (§5.6 rates); the next step verifies a prefix of them
    drafts: list[int] = field(default_factory=list)
    draft_rates: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncached(self) -> int:
        """Tokens still to feed before the next sample (a whole prompt after a preemption, else 1)."""
        return len(self.token_ids) - self.num_cached

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0  # times it lost its caches and was recomputed


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "abort"
    stop_reason: int | str | None
    metrics: RequestMetrics

    @classmethod
    def of(cls, seq: Sequence) -> "RequestOutput":
        return cls(seq.request_id, seq.prompt, list(seq.prompt_token_ids), seq.text, list(seq.output_token_ids),
                   seq.finish_reason, seq.stop_reason,
                   RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time,
                                  seq.num_preemptions))
