"""Per-request sampling and stopping parameters, validated when they are made (vLLM habits and
vLLM's meanings: penalties, min_p, min_tokens, bad_words and logprobs as vLLM defines them)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..validate import param_error


class SamplingParamsError(ValueError):
    """A sampling parameter out of its range; the message is one line naming it."""


# Below this temperature sampling is greedy (spec §10's clamp; see runtime/sampler.py).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter; values above the vocabulary size keep every token
    max_tokens: int = 16
    seed: int | None = None  # per-request seed: the same seed gives the same tokens
    stop: list[str] | None = None  # stop strings, matched on the detokenized output, not emitted
    stop_token_ids: list[int] | None = None  # ids that end the request besides EOS (kept in token_ids)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # leave control tokens out of the output text
    n: int = 1  # independent samples of the request; sample i draws with sampler.sample_seed(seed, i)
    # top-N logprobs of each position, with the sampled token's own; of the model's raw distribution
    # (vLLM's default "raw_logprobs": before penalties, temperature and the filters)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # refused: see __post_init__
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (after temperature)
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings unchecked, until this many tokens
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None  # words never completed: each one's last token is masked after the rest
    # structured outputs (runtime/structured.py), at most one: the output matches a regular expression,
    # a JSON schema (a dict or its JSON text) or an EBNF grammar (xgrammar's GBNF dialect)
    regex: str | None = None
    json_schema: dict | str | None = None
    grammar: str | None = None
    # vLLM options this runtime does not have: refused unless left at their "off" value
    best_of: int | None = None
    use_beam_search: bool = False

    def __post_init__(self):
        def bad(param: str, what: str):
            raise param_error(SamplingParamsError, param, what)

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            bad("top_k", f"must be -1 (off) or >= 1, got {self.top_k!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 64):
            bad("seed", f"must be a non-negative integer below 2**64, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])  # vLLM accepts one string as a list of one
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
                bad("stop", f"must be a list of non-empty strings, got {self.stop!r}")
            object.__setattr__(self, "stop", list(self.stop))
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
                bad("stop_token_ids", f"must be a list of token ids >= 0, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        if not _is_int(self.n) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", f"must be None or an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            bad("prompt_logprobs", "is not supported: the executors return logits of the sampled rows only "
                "(a prompt's last row and verify rows), not of every prompt row")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                bad(name, f"must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens {self.max_tokens}], got {self.min_tokens!r}")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                bad("bad_words", f"must be a list of non-blank strings, got {self.bad_words!r}")
            object.__setattr__(self, "bad_words", list(self.bad_words))
        for name in ("stop", "bad_words"):  # a lone surrogate never matched as a stop string, and failed
            for s in getattr(self, name) or ():  # in the tokenizer as a bad word
                if not _is_unicode(s):
                    bad(name, f"must be valid Unicode text, got {s!r} (a lone surrogate)")
        self._check_constraint(bad)
        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", f"{self.best_of!r} is not supported (no ranking of extra samples); ask for n samples")
        if self.use_beam_search is not False:
            bad("use_beam_search", "is not supported: this runtime samples (or takes the argmax), it has no beam search")

    def _check_constraint(self, bad) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            bad(given[1], f"cannot be combined with {given[0]}: give one structured-output constraint")
        if not given:
            return
        name = given[0]
        value = getattr(self, name)
        if not (isinstance(value, str) or (name == "json_schema" and isinstance(value, dict))):
            bad(name, f"must be {'a dict or ' if name == 'json_schema' else ''}a string, got {type(value).__name__}")
        if isinstance(value, str) and not value.strip():
            bad(name, "is empty")
        if isinstance(value, dict):
            import json

            try:
                json.dumps(value)
            except (TypeError, ValueError, RecursionError) as e:
                bad(name, f"is not a JSON value: {str(e).splitlines()[0]}")
        if self.min_tokens:
            # before min_tokens EOS is masked, and where the grammar has ended EOS is all it allows
            bad("min_tokens", f"cannot be combined with {name} (EOS may be the only token the grammar allows)")
        from .structured import check_constraint, constraint_of

        reason = check_constraint(*constraint_of(self))
        if reason:
            bad(name, f"is invalid: {reason}")

    @property
    def constrained(self) -> bool:
        return self.regex is not None or self.json_schema is not None or self.grammar is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def depends_on_history(self) -> bool:
        """Its logits processing reads the tokens before each row (penalties, min_tokens, bad_words).
        Such a request does not speculate: verify row j would need that processing redone with the
        drafts d_0 .. d_{j-1} as history, and the simpler correct choice is one row per step,
        processed from the sequence as it stands (the engine proposes it no drafts)."""
        return self.has_penalties or self.min_tokens > 0 or bool(self.bad_words)


CONSTRAINTS = ("regex", "json_schema", "grammar")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
