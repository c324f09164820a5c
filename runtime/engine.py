"""The engine: requests in, one step at a time, finished requests out.

A step is: `schedule` (scheduler) -> `prepare_inputs` (the ragged batch and what the sampler
needs) -> submit to the executor (device work) -> sample -> `accept` (append tokens, detokenize,
finish). With `overlap` (the default for executors that `submit` asynchronously), the scheduling
of step N+1 runs while the device runs step N: every sequence step N samples is given a
placeholder token, the scheduler plans step N+1 from the token counts, and once step N's tokens
are sampled the placeholders are replaced, sequences that finished are dropped from the plan, and
step N+1 is prepared and submitted before `step()` returns. Tokens do not change: a sequence's
tokens depend only on its own context, seed and positions (the sampler's §10 RNG), so the
occasional different preemption the early plan makes is invisible in the outputs. Where step N
is all greedy (its ids come back instead of logits) and the executor takes `feed`, step N+1 is
submitted before step N's ids reach the host, its placeholders filled from them on the device
(`_submit_early`): the host's sampling and stop checks of N then run beside N+1 on the device.

Speculative decoding (DSpark, spec §5): after a step samples t* for a sequence (its decode row or
the end of its prompt), the draft graph proposes up to k drafts with their confidences; the
sequence's next chunk is [t*, d_0 .. d_{m-1}], every row gets logits, `sampler.verify_drafts`
accepts a prefix by §5.5 and adds one token, and the stop checks run on each emitted token in
order. Rejected rows need no undo (§6.4): every per-sequence state (window rings of window +
block + 1 slots, compressor state rings, Engram history) and every compressed entry is keyed by
position, so the cached count advances by 1 + accepted and the next step overwrites the rejected
positions before anything reads them; the pages grown for rejected rows go back to the pool.
With a budget of verify rows (`verify_budget`), each sequence verifies the prefix of its drafts
that §5.6's confidence ranking gives it. Without one, the budget of each step comes from the
executor's measured step-time curve where it has one (`step_time_curve`, measured by its
`warm_up` when the engine starts: `speculative.budget_from_curve`), and every draft is verified
where it has none. An executor that verifies in buckets (`verify_shapes`) never gets more rows
than the largest bucket holding the step's sequences. Overlap is off while speculating: the next
step's chunks depend on how many drafts this step accepts. A request whose logits processing reads its own tokens (penalties,
min_tokens, bad_words: `SamplingParams.depends_on_history`) gets no drafts: each of its steps
processes its one row from the sequence as it stands. min_p and logprobs need no history and
speculate (verification filters with min_p; logprobs are taken from the row each token came from).

Prefix caching (`enable_prefix_caching`, runtime/cache.py): after each step the full pages a
sequence has computed are registered (with its slot state in exact mode), and a new sequence
whose tokens start with registered pages shares them and starts after them; `swa_replay`
"bounded" resumes `swa_replay_keep` tokens earlier instead of saving slot states (spec §7).
`stats()["prefix"]` counts the hit rate and the prefill tokens saved.

A request with n samples runs as n sequences (seeds `sampler.sample_seed`); its output comes when
the last of them finishes.

`fixed_acceptance` p is a benchmark mode, not inference: the verifier accepts each draft with
probability p from a seeded stream instead of §5.5's test (random weights almost never draft
right, and DeepSeek's speed-up chart assumes p = 0.75), so the accepted drafts are not the
model's distribution; the token after them is still the target's own sample of its row.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from itertools import count

import torch

from ..models.deepseek_v41 import PAGE_TOKENS, max_backtrack
from ..validate import check_positive_ints, param_error
from ..models.tokenizer import Tokenizer
from .batch import DraftSeq, SeqChunk
from .cache import DEFAULT_SWA_REPLAY_KEEP, SLOT_OPS, CacheManager, PrefixPolicy, check_prefix_caching
from .executor import Executor
from .sampler import MASK64, SampleRequest, banned_tokens, sample, sample_seed, token_logprobs, verify_drafts
from .sampling_params import SamplingParams
from .scheduler import Scheduled, Scheduler
from .sequence import Logprob, ParsedOutput, RequestOutput, Sequence, SeqStatus, StreamOffsets
from .structured import GrammarCompiler
from .speculative import SpecStats, budget_from_curve, confidence_rates, split_by_confidence


class RequestError(ValueError):
    """A request the engine cannot take (empty or too long prompt, token outside the vocabulary)."""


class EngineConfigError(ValueError):
    """Engine limits that do not fit together or do not fit the executor's pools."""


def check_limits(**limits) -> None:
    """Engine limits are positive integers (checked before anything is loaded)."""
    check_positive_ints(EngineConfigError, **limits)


def check_speculative(speculative) -> None:
    """None (on where possible), False / 0 (off), True or a draft count >= 1."""
    if not (speculative is None or isinstance(speculative, bool) or (isinstance(speculative, int) and speculative >= 0)):
        raise EngineConfigError(f"speculative must be None, False, True or a draft count >= 0, got {speculative!r}")


def check_fixed_acceptance(p) -> None:
    """None (verification by §5.5) or an acceptance probability in [0, 1] (benchmark mode)."""
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1):
        raise EngineConfigError(f"fixed_acceptance must be None or a probability in [0, 1], got {p!r}")


def check_prefix_options(enable_prefix_caching, swa_replay, swa_replay_keep) -> None:
    """The prefix-cache settings on their own (before any model is loaded)."""
    if not isinstance(enable_prefix_caching, bool):
        raise param_error(EngineConfigError, "enable_prefix_caching",
                          f"must be True or False, got {enable_prefix_caching!r}")
    check_prefix_caching(PrefixPolicy(swa_replay, swa_replay_keep), PAGE_TOKENS, EngineConfigError, model=False)
    if not enable_prefix_caching and (swa_replay != "exact" or swa_replay_keep != DEFAULT_SWA_REPLAY_KEEP):
        raise EngineConfigError("swa_replay and swa_replay_keep apply to prefix caching, which is off "
                                "(enable_prefix_caching=True turns it on)")


def prefix_policy(cfg, page_tokens: int, enable_prefix_caching: bool, swa_replay: str,
                  swa_replay_keep: int) -> PrefixPolicy | None:
    """The prefix cache's policy for a model (its ModelConfig `cfg`), checked; None: off."""
    check_prefix_options(enable_prefix_caching, swa_replay, swa_replay_keep)
    if not enable_prefix_caching:
        return None
    policy = PrefixPolicy(swa_replay, swa_replay_keep, cfg.sliding_window, max_backtrack(cfg),
                          tuple(sorted({r for r in cfg.compress_ratios if r})))
    check_prefix_caching(policy, page_tokens, EngineConfigError)
    return policy


def resolve_speculative(speculative, max_draft_len: int) -> int:
    """The drafts per sequence the engine proposes: None = every draft the executor can verify
    (0 where it cannot); an explicit request the executor cannot honour is an error."""
    check_speculative(speculative)
    if speculative is None:
        return max_draft_len
    if speculative is False or speculative == 0:
        return 0
    if not max_draft_len:
        raise EngineConfigError("speculative decoding needs verify steps, which this executor cannot run (a model "
                                "without the draft head, or a compiled plan whose buckets take one row per "
                                "sequence); use speculative=0")
    if speculative is True:
        return max_draft_len
    if speculative > max_draft_len:
        raise EngineConfigError(f"speculative {speculative} exceeds the draft block ({max_draft_len} drafts)")
    return speculative


@dataclass
class PreparedStep:
    batch: list[Scheduled]
    chunks: list[SeqChunk]
    samples: list[SampleRequest]  # one per sampled chunk, in chunk order
    sampled: list[Sequence]
    drafts: list[list[int]]  # per sampled chunk: the drafts it verifies (its logits rows are 1 + these)


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
                 overlap: bool | None = None, speculative: int | bool | None = None,
                 verify_budget: int | None = None, fixed_acceptance: float | None = None,
                 enable_prefix_caching: bool = False, swa_replay: str = "exact",
                 swa_replay_keep: int = DEFAULT_SWA_REPLAY_KEEP):
        """`overlap`: schedule step N+1 while step N runs (default: when the executor submits
        asynchronously and the engine does not speculate). `speculative`: drafts proposed per
        sequence; None = the draft block where the executor can run verify steps, 0 / False = off.
        `verify_budget`: verify rows per step for the decoding sequences (1 + drafts each), shared
        out by confidence (§5.6); None = from the executor's step-time curve where it has one,
        else every draft. `fixed_acceptance`: benchmark mode (module doc): each draft accepted
        with this probability, from a stream seeded by `seed`; the drafts' rates (§5.6) become
        p, p^2, ..., the acceptance this mode gives them. `enable_prefix_caching`, `swa_replay`
        ("exact" or "bounded"), `swa_replay_keep`: prefix caching (module doc)."""
        check_limits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len)
        if verify_budget is not None:
            check_limits(verify_budget=verify_budget)
        check_fixed_acceptance(fixed_acceptance)
        self.num_speculative = resolve_speculative(speculative, getattr(executor, "max_draft_len", 0) or 0)
        if self.num_speculative and overlap:
            raise EngineConfigError("overlap and speculative decoding do not combine (the next step depends on "
                                    "the drafts this one accepts); turn one off")
        if fixed_acceptance is not None and not self.num_speculative:
            raise EngineConfigError("fixed_acceptance applies to speculative decoding, which is off for this engine")
        self.verify_budget = verify_budget
        self.fixed_acceptance = fixed_acceptance
        # its own stream: the draws do not move the request seeds drawn from `seed`
        self._acceptance_rng = torch.Generator()
        if seed is not None:
            self._acceptance_rng.manual_seed(seed & MASK64)
        else:
            self._acceptance_rng.seed()
        if executor.num_slots < max_num_seqs:
            raise EngineConfigError(f"max_num_seqs {max_num_seqs} needs as many state slots; "
                                    f"the executor has {executor.num_slots}")
        check_prefix_options(enable_prefix_caching, swa_replay, swa_replay_keep)
        cfg = getattr(executor, "cfg", None)
        if enable_prefix_caching and (cfg is None or not all(hasattr(executor, op) for op in SLOT_OPS)):
            raise EngineConfigError(f"{type(executor).__name__} cannot save and restore slot states, which prefix "
                                    "caching needs")
        prefix = prefix_policy(cfg, getattr(executor, "page_tokens", PAGE_TOKENS), enable_prefix_caching, swa_replay,
                               swa_replay_keep)
        make_cache = getattr(executor, "make_cache", None)  # a multi-rank executor partitions its pool
        if make_cache is not None:
            if prefix is not None:
                raise EngineConfigError(f"{type(executor).__name__}: prefix caching is not supported on multi-rank "
                                        "plans")
            self.cache = make_cache()
        else:
            self.cache = CacheManager(executor.num_slots, executor.num_pages,
                                      getattr(executor, "page_tokens", PAGE_TOKENS), prefix=prefix,
                                      ops=executor if prefix else None)
        if self.cache.pages_for(max_model_len) > executor.num_pages:
            # one sequence at max_model_len must fit alone, or preemption could never make room for it
            raise EngineConfigError(f"max_model_len {max_model_len} needs {self.cache.pages_for(max_model_len)} "
                                    f"pages; the executor has {executor.num_pages}")
        self.executor, self.tokenizer = executor, tokenizer
        self.grammars = GrammarCompiler(tokenizer, executor.vocab_size)  # compiled constraints, cached
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens)
        self.scheduler.verify_seqs = getattr(executor, "max_verify_seqs", None)
        self._seeds = random.Random(seed)  # seeds of requests that bring none
        self._ids = count()
        self._sequences: dict[str, Sequence] = {}  # by sequence (Sequence.request_id)
        self._requests: dict[str, list[Sequence]] = {}  # by request: its unfinished or unreported samples
        self._aborted: list[Sequence] = []  # finished by abort_request, reported by the next step()
        self.num_steps = 0
        self.overlap = hasattr(executor, "submit") and not self.num_speculative if overlap is None else overlap
        self.spec_stats = SpecStats()
        self._draft_cost: dict[int, float] = {}  # seconds of the last draft call, by its sequence count
        # submitted, not yet sampled; True where the handle gives argmax ids, not logits
        self._inflight: tuple[PreparedStep, object, bool] | None = None
        warm_up = getattr(executor, "warm_up", None)
        if self.num_speculative and verify_budget is None and warm_up is not None:
            warm_up(max_num_seqs)  # the step-time curve each step's verify budget is chosen from

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
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None, *,
                    chat: bool = False, thinking: bool = False, stream: bool = False) -> str:
        """Queue a request (text, or token ids); returns its id. Text prompts start with BOS.
        `chat`: the output is an assistant turn, parsed as the official API does (content,
        reasoning_content, tool_calls); `thinking`: the prompt opened its reasoning. `stream`:
        its text is wanted as it grows (`RequestOutput.delta_of`)."""
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("a request needs a prompt or prompt_token_ids")
            if not isinstance(prompt, str):  # (was the tokenizer binding's TypeError)
                raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
            try:
                prompt_token_ids = self.tokenizer.encode(prompt, add_bos=True) if prompt else []
            except ValueError as e:
                raise RequestError(f"prompt: {e}") from None
        elif isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
            raise RequestError(f"prompt_token_ids must be a list of token ids, got {type(prompt_token_ids).__name__}")
        prompt_token_ids = list(prompt_token_ids)
        self.validate_prompt(prompt_token_ids)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if request_id in self._requests or any(s in self._sequences for s in seq_ids):
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        bad_word_ids = self._bad_word_ids(params.bad_words or [])
        grammars = [self._grammar(params) for _ in seq_ids] if params.constrained else [None] * len(seq_ids)
        now, group = time.time(), []
        for i, seq_id in enumerate(seq_ids):
            seq = Sequence(seq_id, prompt, prompt_token_ids, params, sample_seed(seed, i), now, group_id=request_id,
                           index=i, bad_word_ids=bad_word_ids, grammar=grammars[i],
                           streamed=StreamOffsets(), incremental=stream or bool(params.stop))
            if seq.incremental:
                seq.detok = self.tokenizer.text_stream(params.skip_special_tokens)
            if chat:
                seq.parser = self.tokenizer.output_parser(thinking=thinking, tool_calls=True, stop=params.stop or ())
                seq.parsed = ParsedOutput()
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            self._sequences[seq_id] = seq
            self.scheduler.add(seq)
            group.append(seq)
        self._requests[request_id] = group
        return request_id

    def _grammar(self, params: SamplingParams):
        """A matcher of the params' constraint (compiled once per constraint: the compiler caches)."""
        try:
            return self.grammars.matcher(params)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word alone and after a space (a word inside text
        is usually its spaced token), without BOS; duplicates once."""
        out = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_bos=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_id: str) -> bool:
        """End a waiting or running request now; its output (reason "abort") comes with the next step.
        Returns False for an unknown or already finished request."""
        aborted = False
        for seq in self._requests.get(str(request_id), []):
            if self.scheduler.abort(seq.request_id) is not None:  # (None: this sample already finished)
                self._finish(seq, "abort")
                self._aborted.append(seq)
                aborted = True
        return aborted

    def request_samples(self, request_id: str) -> list[Sequence]:
        """The sequences of a queued request (its n samples), for streaming its deltas
        (`RequestOutput.delta_of`); they stay valid after it finishes."""
        return list(self._requests[str(request_id)])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it (and any aborted since)."""
        t0 = time.perf_counter()
        finished, self._aborted = self._aborted, []
        if self._inflight is None:
            if self.num_speculative:
                self._split_verify_budget()
            batch = self.scheduler.schedule()
            if not batch:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("the scheduler found nothing to run while requests are pending")
                return self._outputs(finished)
            self._submit(self.prepare_inputs(batch))
        prepared, handle, argmax = self._inflight
        self._inflight = None
        self.scheduler.advance(prepared.batch)  # the caches hold each chunk once the step has run
        planned = early = None
        if self.overlap:  # while the device runs the step: plan the next one
            for seq in prepared.sampled:
                if not seq.finished:  # (aborted while the step ran)
                    seq.token_ids.append(PLACEHOLDER)
            planned = self.scheduler.schedule()
            if planned and argmax:
                early = self._submit_early(prepared, handle, planned)
        logits = handle.result()
        emitted = [[t] for t in logits.tolist()] if argmax else self.sample(prepared, logits)
        finished += self.accept(prepared, emitted, replace=self.overlap,
                                logprobs=self._logprobs(prepared, logits, emitted))
        for sch, chunk in zip(prepared.batch, prepared.chunks):
            self._register_pages(sch.seq, chunk)
        if early is not None:
            self._inflight = early
        elif planned:
            planned = [s for s in planned if not s.seq.finished]
            if planned:
                self._submit(self.prepare_inputs(planned))
        if self.num_speculative:
            self._propose([seq for seq in prepared.sampled if seq.status is SeqStatus.RUNNING])
        self.spec_stats.step_seconds += time.perf_counter() - t0
        return self._outputs(finished)

    def _outputs(self, finished: list[Sequence]) -> list[RequestOutput]:
        """The requests whose last sample is among `finished`, each once."""
        outs = []
        for seq in finished:
            group = self._requests.get(seq.group_id)
            if group is not None and all(s.finished for s in group):
                del self._requests[seq.group_id]
                outs.append(RequestOutput.of(group))
        return outs

    def _submit(self, prepared: PreparedStep) -> None:
        submit = getattr(self.executor, "submit", None)
        argmax = bool(submit) and getattr(self.executor, "argmax_steps", False) and self._argmax_only(prepared)
        if not submit:
            handle = _Done(self.executor.step(prepared.chunks))
        else:
            handle = submit(prepared.chunks, argmax=True) if argmax else submit(prepared.chunks)
        self._inflight = (prepared, handle, argmax)

    def _submit_early(self, prepared: PreparedStep, handle, planned: list[Scheduled]):
        """Step N+1 submitted before step N's tokens reach the host, where N is an argmax step and
        the executor takes `feed` (`feed_steps`): each placeholder of the planned chunks is the
        device's argmax id of its sequence's row in N, copied there on the device, so the host's
        sampling, detokenising and stop checks of step N overlap step N+1 instead of idling the
        device. A sequence that step N ends (a stop token or string) has one row computed for
        nothing in N+1, which is dropped: it finished, and its pages and slot go to a later step,
        which the device runs after N+1. Sequences that N surely ends (max_tokens, max_model_len)
        are left out. Returns the in-flight (prepared, handle, argmax) of N+1, or None."""
        if not getattr(self.executor, "feed_steps", False):
            return None
        keep = [s for s in planned if not self._ends_at_its_sample(s.seq)]
        if not keep:
            return None
        row_of = {id(seq): i for i, seq in enumerate(prepared.sampled)}  # an argmax step: one row each
        nxt = self.prepare_inputs(keep)
        feed, row = [], 0
        for sch, chunk in zip(nxt.batch, nxt.chunks):
            feed += [(row + j, row_of[id(sch.seq)]) for j, t in enumerate(chunk.tokens) if t == PLACEHOLDER]
            row += len(chunk.tokens)
        argmax = self._argmax_only(nxt)
        kw = {"argmax": True} if argmax else {}
        if feed:
            kw["feed"] = (handle, feed)
        return nxt, self.executor.submit(nxt.chunks, **kw), argmax

    def _ends_at_its_sample(self, seq: Sequence) -> bool:
        """The sequence ends with the token its placeholder stands for, whatever that token is."""
        return len(seq.output_token_ids) >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len

    @staticmethod
    def _argmax_only(prepared: PreparedStep) -> bool:
        """Every sampled row is plain greedy: no penalties, masks, grammar, logprobs or drafts, so
        its token is the row's argmax (sampler.sample's greedy rows) and the executor may return
        the ids in place of the logits."""
        return bool(prepared.samples) and all(
            req.params.greedy and not req.processed and req.params.logprobs is None and seq.grammar is None
            and not drafts for req, seq, drafts in zip(prepared.samples, prepared.sampled, prepared.drafts))

    def prepare_inputs(self, batch: list[Scheduled]) -> PreparedStep:
        chunks, samples, sampled, drafts = [], [], [], []
        for s in batch:
            seq, start = s.seq, s.seq.num_cached
            slot = self.cache.slot(seq.request_id)
            if start == 0:
                self.executor.reset_slot(slot)  # a fresh (or recomputed) sequence starts from a clean slot
            chunks.append(SeqChunk(slot, start, s.tokens, list(self.cache.pages(seq.request_id)), sample=s.samples,
                                   logit_rows=1 + s.num_drafts))
            if s.samples:
                # §10: the sample position is the position the new token takes (seqlen_k); a verify
                # chunk's row j predicts (and samples at) that position + j
                samples.append(self._sample_request(seq))
                sampled.append(seq)
                drafts.append(seq.drafts[:s.num_drafts])
        return PreparedStep(batch, chunks, samples, sampled, drafts)

    def _sample_request(self, seq: Sequence) -> SampleRequest:
        req = SampleRequest(seq.params, seq.seed, len(seq.token_ids))
        p = seq.params
        if p.depends_on_history:
            req.prompt_ids, req.output_ids = list(seq.prompt_token_ids), seq.output_token_ids
            stop_ids = ([] if p.ignore_eos else [self.tokenizer.eos_id]) + (p.stop_token_ids or [])
            req.banned = banned_tokens(req.output_ids, p.min_tokens, stop_ids, seq.bad_word_ids)
        return req

    def sample(self, prepared: PreparedStep, logits) -> list[list[int]]:
        """The tokens each sampled chunk emits: one, or a verify chunk's accepted drafts and one
        more (§5.5). A structured-output sequence's rows are masked by its grammar, and its
        matcher takes the emitted tokens (module doc of runtime/structured.py)."""
        checked = [self._grammar_rows(seq, req, drafts) if seq.grammar is not None else drafts
                   for seq, req, drafts in zip(prepared.sampled, prepared.samples, prepared.drafts)]
        if not any(prepared.drafts):
            out = [[t] for t in sample(logits, prepared.samples)] if prepared.samples else []
            self._grammar_take(prepared, checked, out)
            return out
        out, row, st = [], 0, self.spec_stats
        accept = self._fixed_accept if self.fixed_acceptance is not None else None
        for req, drafts, kept in zip(prepared.samples, prepared.drafts, checked):
            rows = logits[row:row + 1 + len(kept)]
            row += 1 + len(drafts)
            if not drafts:
                out.append(sample(rows, [req]))
                continue
            if not kept:  # (the grammar disallows the first draft: the row samples as a plain one)
                out.append(sample(rows, [req]))
                st.verifies += 1
                st.drafts_verified += len(drafts)
                st.verify_rows += 1 + len(drafts)
                continue
            tokens, accepted = verify_drafts(rows, kept, req, accept)
            out.append(tokens)
            st.verifies += 1
            st.drafts_verified += len(drafts)
            st.drafts_accepted += accepted
            st.verify_rows += 1 + len(drafts)
        if row != logits.shape[0]:
            raise RuntimeError(f"the step returned {logits.shape[0]} logits rows for {row} sampled rows")
        st.spec_steps += 1
        self._grammar_take(prepared, checked, out)
        return out

    @staticmethod
    def _grammar_rows(seq: Sequence, req: SampleRequest, drafts: list[int]) -> list[int]:
        """Sets `req.allowed` (a mask per row) by walking the matcher through the drafts; returns
        the drafts up to the first one its row disallows (the matcher has accepted those)."""
        grammar = seq.grammar
        req.allowed = [grammar.allowed()]
        kept = 0
        for d in drafts:
            if not (0 <= d < len(req.allowed[-1]) and req.allowed[-1][d]) or not grammar.accept(d):
                break
            if grammar.terminated:  # a drafted EOS: its row samples it fresh (no row after an ended grammar)
                grammar.rollback(1)
                break
            kept += 1
            req.allowed.append(grammar.allowed())
        return drafts[:kept]

    @staticmethod
    def _grammar_take(prepared: PreparedStep, checked: list[list[int]], emitted: list[list[int]]) -> None:
        """Each matcher rolls back the drafts it accepted that the verification rejected and
        takes the token the verification drew."""
        for seq, kept, tokens in zip(prepared.sampled, checked, emitted):
            if seq.grammar is not None:
                accepted = len(tokens) - 1
                seq.grammar.rollback(len(kept) - accepted)
                seq.grammar.take(tokens[-1])

    def _fixed_accept(self, j: int) -> bool:
        return float(torch.rand((), generator=self._acceptance_rng, dtype=torch.float64)) < self.fixed_acceptance

    def _logprobs(self, prepared: PreparedStep, logits, emitted: list[list[int]]) -> list[list[dict] | None]:
        """Per sampled chunk that asks for logprobs: per emitted token, {id: Logprob} of the top-N
        and the token itself, from the row it came from (emitted token i of a verify chunk is
        sampled from its row i: an accepted draft's row, then the row that drew the last)."""
        out, row = [], 0
        for req, drafts, tokens in zip(prepared.samples, prepared.drafts, emitted):
            top = req.params.logprobs
            if top is None:
                out.append(None)
            else:
                entries = []
                for token, (lp, rank, ids, lps) in zip(tokens, token_logprobs(logits[row:row + len(tokens)], tokens,
                                                                             top)):
                    entry = {t: Logprob(v, r, self.tokenizer.decode([t])) for r, (t, v) in enumerate(zip(ids, lps), 1)}
                    entry[token] = Logprob(lp, rank, self.tokenizer.decode([token]))
                    entries.append(entry)
                out.append(entries)
            row += 1 + len(drafts)
        return out

    def accept(self, prepared: PreparedStep, emitted: list[list[int]], replace: bool = False,
               logprobs: list[list[dict] | None] | None = None) -> list[Sequence]:
        """Each sampled sequence's emitted tokens in order (`replace`: the first in place of the
        placeholder), with the stop checks after each: nothing past a stop is kept. A sequence
        that verified drafts then counts the accepted ones as cached and gives back the pages of
        the rejected rows. Returns the sequences that finished."""
        now, finished = time.time(), []
        logprobs = logprobs or [None] * len(emitted)
        chunk_of = {id(s.seq): c for s, c in zip(prepared.batch, prepared.chunks)}
        for seq, tokens, drafts, entries in zip(prepared.sampled, emitted, prepared.drafts, logprobs):
            if seq.finished:
                continue  # aborted while its step ran: the tokens are dropped
            seq.drafts, seq.draft_rates = [], []  # spent: the next step verifies new ones
            for i, token in enumerate(tokens):
                if replace and i == 0:
                    seq.token_ids[-1] = token
                else:
                    seq.token_ids.append(token)
                if entries is not None:
                    seq.logprobs.append(entries[i])
                    seq.cumulative_logprob += entries[i][token].logprob
                if seq.first_token_time is None:
                    seq.first_token_time = now
                reason = self._check_stop(seq, token)
                if reason:
                    self._register_pages(seq, chunk_of[id(seq)])  # (before its pages are released)
                    self._finish(seq, reason)
                    finished.append(seq)
                    break
            if drafts and not seq.finished:
                # the accepted drafts' rows are in the caches; the rejected rows' positions are
                # rewritten by the next step before anything reads them (spec §6.4)
                seq.num_cached += len(tokens) - 1
                self.cache.shrink(seq.request_id, seq.num_cached)
        self.num_steps += 1
        return finished

    def _register_pages(self, seq: Sequence, chunk: SeqChunk) -> None:
        """The prefix cache takes the sequence's newly computed full pages (`chunk`: the rows the
        step wrote into its slot)."""
        if self.cache.prefix is not None and not seq.finished:
            self.cache.register(seq.request_id, seq.token_ids, seq.num_cached, chunk.start + len(chunk.tokens))

    # ---- speculation ----------------------------------------------------------------------------

    def _propose(self, seqs: list[Sequence]) -> None:
        """Drafts for the sequences that just emitted t* (the draft graph reads the DSpark rings
        up to t*'s position - 1, which the step just wrote). A sequence gets no more drafts than
        tokens it may still emit after the next one (max_tokens, max_model_len)."""
        want = []
        for seq in seqs:
            if seq.params.depends_on_history:
                continue  # its processing is computed per step from the sequence as it stands (module doc)
            room = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - len(seq.token_ids))
            if room > 1:
                if seq.num_cached != len(seq.token_ids) - 1:
                    raise RuntimeError(f"request {seq.request_id}: {seq.num_cached} tokens cached of "
                                       f"{len(seq.token_ids)} after its sample")
                want.append((seq, min(self.num_speculative, room - 1)))
        if not want or not self._drafts_can_pay(want, len(seqs) - len(want)):
            return
        t = time.perf_counter()
        drafts, conf = self.executor.draft([DraftSeq(self.cache.slot(seq.request_id), seq.token_ids[-1],
                                                     seq.num_cached) for seq, _ in want])
        self._draft_cost[len(want)] = time.perf_counter() - t
        rates = confidence_rates(conf)
        if self.fixed_acceptance is not None:
            rates = torch.full_like(rates, self.fixed_acceptance).cumprod(-1)
        for (seq, k), d, r in zip(want, drafts.tolist(), rates.tolist()):
            seq.drafts, seq.draft_rates = d[:k], r[:k]
        self.spec_stats.draft_calls += 1
        self.spec_stats.draft_seconds += time.perf_counter() - t

    def _drafts_can_pay(self, want: list[tuple[Sequence, int]], others: int) -> bool:
        """Whether the next step could verify any of these drafts by the step-time curve (no
        fixed verify_budget): its budget at the best rates the drafts can have (p^(j+1) at a fixed
        acceptance p, else every draft accepted), with the draft call priced at what the last
        call for as many sequences took (the most any call took before the first of that size).
        Where that prices every verify bucket above the tokens its drafts could bring, the draft
        graph does not run at all: drafts that no step verifies, or that cost more than they
        bring, would only cost the draft time."""
        curve = getattr(self.executor, "step_time_curve", None)
        if self.verify_budget is not None or not curve:
            return True
        p = 1.0 if self.fixed_acceptance is None else self.fixed_acceptance
        best = [[p ** (j + 1) for j in range(k)] for _, k in want]
        cost = self._draft_cost.get(len(want), max(self._draft_cost.values(), default=0.0))
        budget = budget_from_curve(best, others, curve, cost)
        return budget is None or sum(split_by_confidence(best, budget)) > 0

    def _split_verify_budget(self) -> None:
        """§5.6: the running sequences' drafts cut to the prefixes the confidence ranking gives
        them under this step's budget of verify rows (module doc: `verify_budget`, else the
        step-time curve's choice, within what a verify bucket holds). The running sequences
        without drafts count one row each."""
        running = self.scheduler.running
        seqs = [seq for seq in running if seq.drafts]
        if not seqs:
            return
        rates, others = [seq.draft_rates for seq in seqs], len(running) - len(seqs)
        budget = self.verify_budget
        curve = getattr(self.executor, "step_time_curve", None)
        if budget is None and curve:
            budget = budget_from_curve(rates, others, curve)
        shapes = getattr(self.executor, "verify_shapes", None)
        cap = max((rows for n, rows in shapes if n >= len(running)), default=None) if shapes else None
        if cap is not None:  # (no bucket holds them all: the scheduler verifies nothing this step)
            budget = cap - others if budget is None else min(budget, cap - others)
        if budget is not None:
            counts = split_by_confidence(rates, budget)
            for seq, n in zip(seqs, counts):
                seq.drafts, seq.draft_rates = seq.drafts[:n], seq.draft_rates[:n]

    # ---- finishing ------------------------------------------------------------------------------

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        """Why `token` ends the sequence, or None. A token that does not end it as a token (EOS,
        stop_token_ids, the grammar's end) is part of the text, decoded incrementally; a stop
        string is looked for where the new text could complete one (earlier text was searched)."""
        p = seq.params
        if len(seq.output_token_ids) >= p.min_tokens:  # (before, EOS and the stop ids were masked)
            if ((seq.grammar is not None and seq.grammar.terminated)  # it took EOS where the grammar may end
                    or (not p.ignore_eos and token == self.tokenizer.eos_id)
                    or (p.stop_token_ids and token in p.stop_token_ids)):
                seq.stop_reason = token  # the token ends the text; it is not part of it
                return "stop"
        if not seq.incremental:  # (its text is decoded once, when it finishes)
            return "length" if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len \
                else None
        before = len(seq.text)
        seq.text += seq.detok.push(token)
        if seq.parser is not None:
            seq.parsed.add(seq.parser.push([token]))
        if len(seq.output_token_ids) < p.min_tokens:  # vLLM checks no stop string before min_tokens
            return "length" if len(seq.token_ids) >= self.max_model_len else None
        if p.stop:
            text = seq.text
            hits = [(at, s) for s in p.stop if (at := text.find(s, max(0, before - len(s) + 1))) >= 0]
            if hits:
                at, s = min(hits)
                # like vLLM, the stop string is not emitted unless include_stop_str_in_output
                seq.text = text[:at + len(s)] if p.include_stop_str_in_output else text[:at]
                seq.stop_reason = s
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if not seq.finished:
            self.scheduler.finish(seq, reason)
        if not seq.incremental:
            ids = seq.output_token_ids
            if seq.stop_reason is not None:
                ids = ids[:-1]  # the EOS / stop token ends the text; it is not part of it
            seq.text = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
            if seq.parser is not None and ids:
                seq.parsed.add(seq.parser.push(ids))
        elif not isinstance(seq.stop_reason, str):  # (a stop string cut the text: nothing after it is output)
            seq.text += seq.detok.finish()
        if seq.parser is not None:
            seq.parsed.add(seq.parser.finish())
        seq.finish_time = time.time()
        del self._sequences[seq.request_id]

    def stats(self) -> dict:
        return {"steps": self.num_steps, "preemptions": self.scheduler.num_preemptions,
                "free_slots": self.cache.free_slots, "free_pages": self.cache.free_pages,
                "free_tokens": self.cache.free_tokens, "speculative": self.num_speculative,
                **({"spec": self.spec_stats.summary()} if self.num_speculative else {}),
                **({"prefix": self.cache.stats.summary()} if self.cache.prefix else {})}
