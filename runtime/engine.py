"""The engine: requests in, one step at a time, finished requests out.

A step is: `schedule` (scheduler) -> `prepare_inputs` (the ragged batch and what the sampler
needs) -> submit to the executor (device work) -> sample -> `accept` (append tokens, detokenize,
finish). With `overlap` (the default for executors that `submit` asynchronously), the scheduling
of step N+1 runs while the device runs step N: every sequence step N samples is given a
placeholder token, the scheduler plans step N+1 from the token counts, and once step N's tokens
are sampled the placeholders are replaced, sequences that finished are dropped from the plan, and
step N+1 is prepared and submitted before `step()` returns. Tokens do not change: a sequence's
tokens depend only on its own context, seed and positions (the sampler's §10 RNG), so the
occasional different preemption the early plan makes is invisible in the outputs.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from itertools import count


from ..models.deepseek_v41 import PAGE_TOKENS
from ..validate import check_positive_ints
from ..models.tokenizer import Tokenizer
from .batch import SeqChunk
from .cache import CacheManager
from .executor import Executor
from .sampler import SampleRequest, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduled, Scheduler
from .sequence import RequestOutput, Sequence


class RequestError(ValueError):
    """A request the engine cannot take (empty or too long prompt, token outside the vocabulary)."""


class EngineConfigError(ValueError):
    """Engine limits that do not fit together or do not fit the executor's pools."""


def check_limits(**limits) -> None:
    """Engine limits are positive integers (checked before anything is loaded)."""
    check_positive_ints(EngineConfigError, **limits)


@dataclass
class PreparedStep:
    batch: list[Scheduled]
    chunks: list[SeqChunk]
    samples: list[SampleRequest]  # one per sampled chunk, in chunk order
    sampled: list[Sequence]


PLACEHOLDER = -1  # the token a sampled sequence holds while its step runs (never fed to the model)


class _Done:
    """A step an executor without `submit` ran synchronously."""

    def __init__(self, logits):
        self.logits = logits

    def result(self):
        return self.logits


class LLMEngine:
    def __init__(self, executor: Executor, tokenizer: Tokenizer, *, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, max_model_len: int = 4096, seed: int | None = None,
                 overlap: bool | None = None):
        """`overlap`: schedule step N+1 while step N runs (default: when the executor submits
        asynchronously)."""
        check_limits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len)
        if executor.num_slots < max_num_seqs:
            raise EngineConfigError(f"max_num_seqs {max_num_seqs} needs as many state slots; "
                                    f"the executor has {executor.num_slots}")
        self.cache = CacheManager(executor.num_slots, executor.num_pages,
                                  getattr(executor, "page_tokens", PAGE_TOKENS))
        if self.cache.pages_for(max_model_len) > executor.num_pages:
            # one sequence at max_model_len must fit alone, or preemption could never make room for it
            raise EngineConfigError(f"max_model_len {max_model_len} needs {self.cache.pages_for(max_model_len)} "
                                    f"pages; the executor has {executor.num_pages}")
        self.executor, self.tokenizer = executor, tokenizer
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens)
        self._seeds = random.Random(seed)  # seeds of requests that bring none
        self._ids = count()
        self._sequences: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []  # finished by abort_request, reported by the next step()
        self.num_steps = 0
        self.overlap = hasattr(executor, "submit") if overlap is None else overlap
        self._inflight: tuple[PreparedStep, object] | None = None  # submitted, not yet sampled

    # ---- requests -------------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise RequestError("the prompt is empty (it needs at least one token)")
        if len(prompt_token_ids) > self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_token_ids)} tokens, more than max_model_len "
                               f"{self.max_model_len}")
        vocab = self.executor.vocab_size
        bad = next((t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int)
                    or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token {bad!r} is not an id in [0, {vocab})")

    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None) -> str:
        """Queue a request (text, or token ids); returns its id. Text prompts start with BOS."""
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt, add_bos=True) if prompt else []
        prompt_token_ids = list(prompt_token_ids)
        self.validate_prompt(prompt_token_ids)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._sequences:
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        seq = Sequence(request_id, prompt, prompt_token_ids, params, seed, time.time())
        self._sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """End a waiting or running request now; its output (reason "abort") comes with the next step.
        Returns False for an unknown or already finished request."""
        seq = self.scheduler.abort(str(request_id))
        if seq is None:
            return False
        self._finish(seq, "abort")
        self._aborted.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it (and any aborted since)."""
        finished, self._aborted = self._aborted, []
        if self._inflight is None:
            batch = self.scheduler.schedule()
            if not batch:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("the scheduler found nothing to run while requests are pending")
                return [RequestOutput.of(s) for s in finished]
            self._submit(self.prepare_inputs(batch))
        prepared, handle = self._inflight
        self._inflight = None
        self.scheduler.advance(prepared.batch)  # the caches hold each chunk once the step has run
        planned = None
        if self.overlap:  # while the device runs the step: plan the next one
            for seq in prepared.sampled:
                if not seq.finished:  # (aborted while the step ran)
                    seq.token_ids.append(PLACEHOLDER)
            planned = self.scheduler.schedule()
        logits = handle.result()
        tokens = sample(logits, prepared.samples) if prepared.samples else []
        finished += self.accept(prepared, tokens, replace=self.overlap)
        if planned:
            planned = [s for s in planned if not s.seq.finished]
            if planned:
                self._submit(self.prepare_inputs(planned))
        return [RequestOutput.of(s) for s in finished]

    def _submit(self, prepared: PreparedStep) -> None:
        submit = getattr(self.executor, "submit", None)
        handle = submit(prepared.chunks) if submit else _Done(self.executor.step(prepared.chunks))
        self._inflight = (prepared, handle)

    def prepare_inputs(self, batch: list[Scheduled]) -> PreparedStep:
        chunks, samples, sampled = [], [], []
        for s in batch:
            seq, start = s.seq, s.seq.num_cached
            slot = self.cache.slot(seq.request_id)
            if start == 0:
                self.executor.reset_slot(slot)  # a fresh (or recomputed) sequence starts from a clean slot
            chunks.append(SeqChunk(slot, start, seq.token_ids[start:start + s.num_tokens],
                                   list(self.cache.pages(seq.request_id)), sample=s.samples))
            if s.samples:
                # §10: the sample position is the position the new token takes (seqlen_k)
                samples.append(SampleRequest(seq.params, seq.seed, len(seq.token_ids)))
                sampled.append(seq)
        return PreparedStep(batch, chunks, samples, sampled)

    def accept(self, prepared: PreparedStep, tokens: list[int], replace: bool = False) -> list[Sequence]:
        """The step's sampled tokens into their sequences (`replace`: in place of the placeholder),
        then the stop checks; returns the sequences that finished."""
        now, finished = time.time(), []
        for seq, token in zip(prepared.sampled, tokens):
            if seq.finished:
                continue  # aborted while its step ran: the token is dropped
            if replace:
                seq.token_ids[-1] = token
            else:
                seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._check_stop(seq, token)
            if reason:
                self._finish(seq, reason)
                finished.append(seq)
        self.num_steps += 1
        return finished

    # ---- finishing ------------------------------------------------------------------------------

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token == self.tokenizer.eos_id:
            seq.stop_reason = token
            return "stop"
        if p.stop_token_ids and token in p.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if p.stop:
            text = self._detokenize(seq)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                at, s = min(hits)
                seq.text, seq.stop_reason = text[:at], s  # like vLLM, the stop string is not emitted
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _detokenize(self, seq: Sequence) -> str:
        ids = seq.output_token_ids
        if seq.stop_reason is not None and not isinstance(seq.stop_reason, str):
            ids = ids[:-1]  # the EOS / stop token ends the text; it is not part of it
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if not seq.finished:
            self.scheduler.finish(seq, reason)
        if not isinstance(seq.stop_reason, str):  # a stop string already cut the text
            seq.text = self._detokenize(seq)
        seq.finish_time = time.time()
        del self._sequences[seq.request_id]

    def stats(self) -> dict:
        return {"steps": self.num_steps, "preemptions": self.scheduler.num_preemptions,
                "free_slots": self.cache.free_slots, "free_pages": self.cache.free_pages,
                "free_tokens": self.cache.free_tokens}
