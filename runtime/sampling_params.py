"""Per-request sampling and stopping parameters, validated when they are made (vLLM habits)."""
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
            if not all(isinstance(s, str) and s for s in self.stop):
                bad("stop", f"must be a list of non-empty strings, got {self.stop!r}")
            object.__setattr__(self, "stop", list(self.stop))
        if self.stop_token_ids is not None:
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
                bad("stop_token_ids", f"must be a list of token ids >= 0, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
