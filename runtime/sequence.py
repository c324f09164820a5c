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
    grammar: object | None = None  # a structured-output request's matcher (runtime/structured.py)
    # the text is decoded as tokens come (stop strings, streaming), by `detok` (Tokenizer.text_stream);
    # else once, when it finishes (a whole decode: the same text, a fraction of the cost per token)
    incremental: bool = False
    detok: object | None = None
    # a chat request's output parsed as the official API does (Tokenizer.output_parser): content,
    # reasoning_content and tool calls
    parser: object | None = None
    parsed: "ParsedOutput | None" = None
    streamed: "StreamOffsets | None" = None  # what a stream has handed out of this sample

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
class FunctionCall:
    name: str
    arguments: str  # JSON text of the arguments


@dataclass
class ToolCall:
    """A tool call the model made (the Chat Completions shape vLLM's `tool_calls` have)."""
    id: str
    function: FunctionCall
    type: str = "function"


@dataclass
class ParsedOutput:
    """A chat output as the official API parses it, gathered from the parser's deltas."""
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta) -> None:
        self.content += delta.content
        self.reasoning_content += delta.reasoning_content
        for call in delta.tool_calls:  # Chat Completions deltas: the first of an index names it
            index, function = call["index"], call.get("function") or {}
            while len(self.tool_calls) <= index:
                self.tool_calls.append(ToolCall("", FunctionCall("", "")))
            out = self.tool_calls[index]
            out.id = call.get("id") or out.id
            out.function.name += function.get("name") or ""
            out.function.arguments += function.get("arguments") or ""


@dataclass
class StreamOffsets:
    tokens: int = 0
    text: int = 0
    reasoning: int = 0


@dataclass
class CompletionOutput:
    """One of a request's n samples (vLLM's CompletionOutput). A chat request's `text` is the
    answer's content, its reasoning in `reasoning_content` and its calls in `tool_calls`, parsed
    as the official API does; a generate request's `text` is the raw decoded output."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless the params ask for logprobs
    logprobs: list[dict[int, Logprob]] | None  # per token: the top-N and the sampled token
    finish_reason: str | None  # "stop", "length" or "abort"; None while a stream is under way
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


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
        outputs = [completion(s) for s in samples]
        first_tokens = [s.first_token_time for s in samples if s.first_token_time is not None]
        finishes = [s.finish_time for s in samples if s.finish_time is not None]
        metrics = RequestMetrics(first.arrival_time, min(first_tokens, default=None), max(finishes, default=None),
                                 sum(s.num_preemptions for s in samples))
        return cls(first.group_id, first.prompt, list(first.prompt_token_ids), outputs,
                   all(s.finished for s in samples), metrics)

    @classmethod
    def delta_of(cls, samples: list[Sequence]) -> "RequestOutput | None":
        """What the request's samples added since its last delta (`stream_delta`), or None."""
        outputs = [d for s in samples if (d := stream_delta(s)) is not None]
        if not outputs:
            return None
        whole = cls.of(samples)
        return cls(whole.request_id, whole.prompt, whole.prompt_token_ids, outputs, whole.finished, whole.metrics)


def completion(seq: Sequence) -> CompletionOutput:
    out = CompletionOutput(seq.index, seq.text, list(seq.output_token_ids), seq.cumulative_logprob, seq.logprobs,
                           seq.finish_reason, seq.stop_reason)
    if seq.parsed is not None:
        out.text, out.reasoning_content = seq.parsed.content, seq.parsed.reasoning_content
        out.tool_calls = list(seq.parsed.tool_calls)
    return out


def stream_delta(seq: Sequence) -> CompletionOutput | None:
    """What `seq` has added since the last delta (vLLM's DELTA output kind), or None when nothing:
    new tokens, and the text no stop string can still take back (while it runs, a raw text's last
    len(longest stop) - 1 characters wait; a parsed chat output's parser holds back itself). The
    tool calls come with the last delta, whole."""
    offsets = seq.streamed
    n_tokens = len(seq.token_ids) - len(seq.prompt_token_ids)
    if seq.parsed is not None:
        text, reasoning = seq.parsed.content, seq.parsed.reasoning_content
    else:
        text, reasoning = seq.text, ""
        if not seq.finished and seq.params.stop:
            text = text[:max(offsets.text, len(text) - max(map(len, seq.params.stop)) + 1)]
    if seq.finished and offsets.tokens < 0:
        return None  # the last delta is out
    if not seq.finished and n_tokens == offsets.tokens and len(text) == offsets.text:
        return None
    out = CompletionOutput(seq.index, text[offsets.text:], list(seq.token_ids[len(seq.prompt_token_ids) +
                                                                              offsets.tokens:]),
                           seq.cumulative_logprob, seq.logprobs[offsets.tokens:] if seq.logprobs is not None else None,
                           seq.finish_reason if seq.finished else None, seq.stop_reason if seq.finished else None)
    if seq.parsed is not None:
        out.reasoning_content = reasoning[offsets.reasoning:]
        out.tool_calls = list(seq.parsed.tool_calls) if seq.finished else []
    offsets.text, offsets.reasoning = len(text), len(reasoning)
    offsets.tokens = -1 if seq.finished else n_tokens
    return out
