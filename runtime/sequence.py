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
    # sample `index` of request `group_id`: a request with n samples runs n sequences, whose
    # request_id (the scheduler's and the caches' key) is "{group_id}#{index}" when n > 1
    group_id: str = ""
    index: int = 0
    bad_word_ids: list[list[int]] = field(default_factory=list)  # the params' bad_words, tokenized
    logprobs: list[dict[int, "Logprob"]] | None = None  # per output token, when the params ask for them
    cumulative_logprob: float | None = None
    stop_text_from: int = 0  # stop strings count from this character on (the text before min_tokens)
    grammar: object | None = None  # a structured-output request's matcher (runtime/structured.py)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id

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
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token of the position
    decoded_token: str


@dataclass
class CompletionOutput:
    """One of a request's n samples (vLLM's CompletionOutput)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless the params ask for logprobs
    logprobs: list[dict[int, Logprob]] | None  # per token: the top-N and the sampled token
    finish_reason: str  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    # the fields of one sample, as before n: sample 0's
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @classmethod
    def of(cls, samples: list[Sequence]) -> "RequestOutput":
        """The output of a request from its samples' sequences (index order)."""
        first = samples[0]
        outputs = [CompletionOutput(s.index, s.text, list(s.output_token_ids), s.cumulative_logprob, s.logprobs,
                                    s.finish_reason, s.stop_reason) for s in samples]
        first_tokens = [s.first_token_time for s in samples if s.first_token_time is not None]
        finishes = [s.finish_time for s in samples if s.finish_time is not None]
        metrics = RequestMetrics(first.arrival_time, min(first_tokens, default=None), max(finishes, default=None),
                                 sum(s.num_preemptions for s in samples))
        return cls(first.group_id, first.prompt, list(first.prompt_token_ids), outputs,
                   all(s.finished for s in samples), metrics)
