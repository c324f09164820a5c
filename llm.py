"""`LLM`: offline generation in the vLLM style.

    from deepinfer import LLM, SamplingParams
    llm = LLM(model="v4.1-flash-tiny", weights="ckpt/")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

`LLM(model=...)` runs the graph interpreter on the CPU; `LLM(plan=...)` runs a compiled plan:
cpu plans through their torch kernels, sm90 / sm100 plans through their cubins on the GPU
(runtime/cuda_executor.py), behind the same engine.

Speculative decoding (DSpark drafts verified by the target, spec §5) is on by default where the
model has the draft head and the executor runs verify steps (the interpreter, cpu plans, and GPU
plans compiled with verify buckets, `deepinfer compile --verify-batches`). `llm.last_run_stats`
reports the last generate/chat call: mean accepted length, verify rows per step, draft time share.

`LLM(enable_prefix_caching=True)` shares the compressed-KV pages of common prompt prefixes
between requests (vLLM's flag; runtime/cache.py), with the window rings restored exactly from the
slot state saved with each page, or, with `swa_replay="bounded"`, rebuilt by recomputing the
last `swa_replay_keep` tokens (spec §7); `last_run_stats["prefix"]` reports the hit rate and the
prefill tokens saved.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

from tqdm import tqdm

from .models.checkpoint import CheckpointError, checkpoint_config, load_checkpoint
from .models.config import config_from_dict, load_config
from .models.deepseek_v41 import PAGE_TOKENS, build_model, load_params
from .models.tokenizer import Tokenizer
from .runtime.cache import DEFAULT_SWA_REPLAY_KEEP
from .runtime.engine import (EngineConfigError, LLMEngine, RequestError, check_fixed_acceptance, check_limits,
                             check_prefix_options, check_speculative, prefix_policy)
from .runtime.executor import InterpreterExecutor
from .runtime.sampling_params import SamplingParams
from .runtime.sequence import RequestOutput
from .validate import param_error

__all__ = ["LLM", "SamplingParams", "RequestOutput"]

INTERPRETER_TARGETS = ("cpu",)
PROMPT_KEYS = ("prompt", "prompt_token_ids")  # of vLLM's prompt dicts, those a text model takes
# Limits of the graph interpreter's engine; a plan's own limits are the defaults of LLM(plan=...).
DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


@contextlib.contextmanager
def _cache_allocation(max_num_seqs, num_pages):
    """The executor's state and page pool, allocated for the limits asked: a request for more
    memory than the machine has is the caller's limits, said in one line (torch's allocator
    raises a RuntimeError, or MemoryError)."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if not isinstance(e, MemoryError) and "allocate" not in str(e):
            raise
        raise EngineConfigError(f"cannot allocate the state and cache pool for max_num_seqs={max_num_seqs}, "
                                f"num_pages={num_pages}: lower max_num_seqs, max_model_len or num_pages") from None


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, weights: str | os.PathLike | None = None, *,
                 plan: str | os.PathLike | None = None, target: str | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, num_pages: int | None = None, seed: int | None = None,
                 tokenizer: str | os.PathLike | None = None, speculative: int | bool | None = None,
                 verify_budget: int | None = None, fixed_acceptance: float | None = None,
                 tensor_parallel_size: int = 1, enable_prefix_caching: bool = False, swa_replay: str = "exact",
                 swa_replay_keep: int = DEFAULT_SWA_REPLAY_KEEP, batch_invariant: bool = False):
        """`model`: a preset name or a directory with config.json; `weights`: a checkpoint directory.
        `max_num_seqs`, `max_model_len`: by default 16 and 4096, or the plan's own limits (larger
        values than the plan's are refused). `max_num_batched_tokens`: by default 512 (at most the
        largest step bucket of a GPU plan). `num_pages`: pages (128 tokens each) of the
        compressed-cache pool; by default enough for `max_num_seqs` sequences of `max_model_len`
        tokens (at most the pool the plan was compiled for). `seed` seeds the seeds of requests
        that bring none. `tokenizer`: a tokenizer.json (default: the bundled one).
        `plan`: a compiled plan directory (deepinfer compile) to run instead of `model`. `target`:
        the interpreter's device (cpu, the default); beside `plan`, the plan's target (another is refused).
        `speculative`: DSpark drafts per sequence and step; None = the model's draft block where
        the executor can verify drafts (else off), 0 / False = off. `verify_budget`: verify rows
        per step shared out by draft confidence (§5.6); None = chosen per step from the executor's
        measured step-time curve (GPU plans), else every draft. `fixed_acceptance`: a benchmark
        mode, not inference: each draft is accepted with this probability (seeded by `seed`), so
        the output is not the model's distribution (runtime/engine.py).
        `tensor_parallel_size`: vLLM's; only 1 (one device) runs here.
        `enable_prefix_caching`: share cached prompt prefixes (module doc); `swa_replay`: "exact"
        (window rings restored from the state saved with each page) or "bounded" (the last
        `swa_replay_keep` tokens of a hit recomputed, >= window + the largest rollback).
        `batch_invariant`: a request's tokens must not depend on what else is in its steps or how
        its prompt was chunked: the graph interpreter is so as it stands; a plan must have been
        compiled with `--batch-invariant` (one template and reduction structure per call at every
        bucket), else this is refused."""
        check_limits(tensor_parallel_size=tensor_parallel_size)
        if tensor_parallel_size != 1:
            raise param_error(EngineConfigError, "tensor_parallel_size",
                              f"{tensor_parallel_size} is not supported: the runtime runs a model on one device")
        check_speculative(speculative)
        if verify_budget is not None:
            check_limits(verify_budget=verify_budget)
        check_fixed_acceptance(fixed_acceptance)
        check_prefix_options(enable_prefix_caching, swa_replay, swa_replay_keep)
        self._engine_options = {"speculative": speculative, "verify_budget": verify_budget, "fixed_acceptance": fixed_acceptance,
                      "enable_prefix_caching": enable_prefix_caching, "swa_replay": swa_replay,
                      "swa_replay_keep": swa_replay_keep}
        self.last_run_stats: dict = {}
        if plan is None and model is None:
            raise EngineConfigError("no model: give model= (a preset or config directory) or plan= (a compiled plan)")
        if plan is not None and model is not None:
            raise EngineConfigError("give model= or plan=, not both")
        if not isinstance(batch_invariant, bool):
            raise param_error(EngineConfigError, "batch_invariant", f"must be True or False, got {batch_invariant!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64):
            # the range SamplingParams takes for a request's seed
            raise param_error(EngineConfigError, "seed", f"must be a non-negative integer below 2**64, got {seed!r}")
        for name, value in (("model", model), ("weights", weights), ("plan", plan), ("tokenizer", tokenizer)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise param_error(EngineConfigError, name, f"must be a path, got {type(value).__name__}")
        self.batch_invariant = batch_invariant
        if plan is not None:
            self._init_plan(plan, weights, max_num_seqs, max_num_batched_tokens, max_model_len, num_pages, seed,
                            tokenizer, target)
            return
        target = "cpu" if target is None else target
        if target not in INTERPRETER_TARGETS:
            raise EngineConfigError(f"target {target!r}: LLM(model=...) runs the graph interpreter on "
                                    f"{', '.join(INTERPRETER_TARGETS)} only; other targets need a compiled plan")
        if weights is None:
            raise EngineConfigError("weights: a checkpoint directory is needed (deepinfer make-checkpoint writes one)")
        max_num_seqs = DEFAULT_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs
        max_model_len = DEFAULT_MAX_MODEL_LEN if max_model_len is None else max_model_len
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        check_limits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len)
        if num_pages is None:
            num_pages = max_num_seqs * -(-max_model_len // PAGE_TOKENS)
        check_limits(num_pages=num_pages)
        cfg = load_config(model)
        if max_model_len > cfg.max_position_embeddings:  # as compile refuses it for a plan
            raise param_error(EngineConfigError, "max_model_len", f"{max_model_len} exceeds the model's "
                              f"max_position_embeddings {cfg.max_position_embeddings}")
        prefix_policy(cfg, PAGE_TOKENS, enable_prefix_caching, swa_replay, swa_replay_keep)  # (before the weights load)
        self.tokenizer = Tokenizer(tokenizer)  # a bad tokenizer file is said before the weights load
        # weights of another model (its config.json) are refused, as a plan refuses them: tensors of
        # the same shapes loaded into a model of other settings ran silently wrong
        wcfg = checkpoint_config(weights)
        if wcfg.config_hash != cfg.config_hash:
            raise CheckpointError(f"weights {weights} are for model {wcfg.model_id} (config {wcfg.config_hash[:12]}), "
                                  f"not {cfg.model_id} (config {cfg.config_hash[:12]})")
        program = build_model(cfg)
        params = load_params(program, load_checkpoint(weights, cfg))
        with _cache_allocation(max_num_seqs, num_pages):
            executor = InterpreterExecutor(program, params, num_slots=max_num_seqs, num_pages=num_pages)
        self.config = cfg
        self.engine = LLMEngine(executor, self.tokenizer, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                seed=seed, **self._engine_options)

    def _init_plan(self, plan, weights, max_num_seqs, max_num_batched_tokens, max_model_len, num_pages, seed,
                   tokenizer, target=None):
        from .runtime.distributed import launch_executor, launched_world
        from .runtime.plan_file import load_plan
        from .runtime.plan_executor import PlanExecutor

        if weights is None:
            raise EngineConfigError("weights: a checkpoint directory is needed (deepinfer make-checkpoint writes one)")
        # a target named beside a plan must be the plan's (it was ignored: a cpu plan ran for target="sm90")
        loaded = load_plan(plan, target=target)
        opts, target = loaded["options"], loaded["target"]["name"]
        if self.batch_invariant and not opts.get("batch_invariant"):
            raise EngineConfigError(f"batch_invariant: plan {plan} was compiled without --batch-invariant (its "
                                    "kernels may split work by the batch); compile it with --batch-invariant")
        prefix = [self._engine_options[k] for k in ("enable_prefix_caching", "swa_replay", "swa_replay_keep")]
        check_prefix_options(*prefix)
        if prefix[0]:  # the model's window and rollback bound bounded replay: checked before the weights load
            prefix_policy(config_from_dict(loaded["model"]["config"], model_id=loaded["model"]["id"]),
                          opts["page_tokens"], *prefix)
        # the plan's limits are the defaults: a plan compiled for less than the interpreter's
        # defaults runs without repeating its flags
        max_model_len = opts["max_model_len"] if max_model_len is None else max_model_len
        max_num_seqs = opts["max_num_seqs"] if max_num_seqs is None else max_num_seqs
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if target != "cpu":  # a GPU plan's steps must fit its largest step bucket
                largest = max(e["num_tokens"] for e in loaded["buckets"]["step"].values())
                max_num_batched_tokens = min(max_num_batched_tokens, largest)
        if target != "cpu" and not opts.get("verify_drafts") and self._engine_options["speculative"] not in (None, False, 0):
            # said before the weights load: the engine would refuse it after
            raise EngineConfigError(f"speculative decoding needs verify steps, which this {target} plan has no "
                                    "buckets for (compile it with --verify-batches); use speculative=0 / "
                                    "--speculative off")
        check_limits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len)
        for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
            if value > opts[name]:
                raise param_error(EngineConfigError, name, f"{value} exceeds the plan's {opts[name]}")
        if target == "cpu":
            if num_pages is None:
                # no more than the pool the plan was compiled for: max_num_seqs full contexts of the
                # plan's limits can be far more memory than that (one sequence must still fit)
                pages = -(-max_model_len // PAGE_TOKENS)
                num_pages = min(max_num_seqs * pages, max(opts.get("num_pages", 0), pages))
            check_limits(num_pages=num_pages)
            self.tokenizer = Tokenizer(tokenizer)  # a bad tokenizer file is said before the weights load
            if launched_world() > 1:
                # one rank of a multi-rank plan (under torchrun): rank 0 runs the engine, the others
                # follow it inside this call and exit when it stops (runtime/distributed.py)
                executor = launch_executor(plan, weights, num_slots=max_num_seqs, num_pages=num_pages)
            else:
                with _cache_allocation(max_num_seqs, num_pages):
                    executor = PlanExecutor(plan, weights, num_slots=max_num_seqs, num_pages=num_pages)
        elif launched_world() > 1:
            raise EngineConfigError(f"plan {plan}: multi-rank runs of {target} plans are not wired yet (the CUDA "
                                    "executor takes no expert shard); cpu plans run under torchrun")
        else:
            self.tokenizer = Tokenizer(tokenizer)
            executor = self._device_executor(plan, weights, loaded, max_num_batched_tokens, num_pages)
        self.config = executor.cfg
        self.engine = LLMEngine(executor, self.tokenizer, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                seed=seed, **self._engine_options)

    @staticmethod
    def _device_executor(plan, weights, loaded, max_num_batched_tokens, num_pages):
        """A GPU plan's kernels are built for its buckets and its cache pool: steps must fit the
        largest prefill bucket, and the pool is the plan's."""
        import torch

        from .runtime.cuda_executor import CAPABILITY, CudaPlanExecutor

        target = loaded["target"]["name"]
        if target not in CAPABILITY:
            raise EngineConfigError(f"plan {plan}: compiled for {target}, which this runtime cannot run here "
                                    f"(it runs cpu, {', '.join(CAPABILITY)} plans)")
        if not torch.cuda.is_available():
            raise EngineConfigError(f"plan {plan}: compiled for {target}; it needs an NVIDIA GPU and none is visible")
        largest = max(e["num_tokens"] for e in loaded["buckets"]["step"].values())
        if max_num_batched_tokens > largest:
            raise EngineConfigError(f"max_num_batched_tokens {max_num_batched_tokens} exceeds the plan's largest "
                                    f"step bucket ({largest} tokens)")
        if num_pages is not None and num_pages > loaded["options"]["num_pages"] - 1:
            raise EngineConfigError(f"num_pages {num_pages} exceeds the plan's pool "
                                    f"({loaded['options']['num_pages'] - 1} usable pages)")
        return CudaPlanExecutor(plan, weights)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (vLLM's); False where prefix caching is off."""
        if self.engine.cache.prefix is None:
            return False
        self.engine.cache.reset_prefix()
        return True

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(self, prompts: str | Mapping | list[str | Mapping] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[int] | list[list[int]] | None = None,
                 use_tqdm: bool = True, stream: bool = False) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Run the prompts (text, which gets BOS, or token ids) to completion; outputs in input order.
        `stream`: instead, an iterator of RequestOutputs as the requests advance, each holding what
        its request added since the last (vLLM's DELTA output kind: per sample the new text and
        token ids; `finished` on a request's last). A request's deltas concatenate to its whole
        output. Closing the iterator early aborts the requests still running.
        A prompt is a string, {"prompt": text} or {"prompt_token_ids": ids} (vLLM's prompt dicts; with
        both keys the ids are the prompt and the text its display form), alone or in a list.
        With both arguments given, `prompt_token_ids` are the prompts and `prompts` their display text.
        Text prompts are raw: spellings of control tokens in them (`<｜User｜>`) are those tokens;
        `chat` renders the chat format and keeps them plain text."""
        if not isinstance(stream, bool):
            raise RequestError(f"stream must be True or False, got {stream!r}")
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        if prompts is not None:
            _check_list("prompts", prompts)
        if prompt_token_ids is None:
            if prompts is None:
                raise RequestError("generate needs prompts or prompt_token_ids")
            texts, ids = zip(*(self._prompt(i, p) for i, p in enumerate(prompts))) if prompts else ((), ())
            return self._run(list(texts), list(ids), sampling_params, use_tqdm, stream)
        _check_list("prompt_token_ids", prompt_token_ids)
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        for i, ids in enumerate(prompt_token_ids):
            _check_list(f"prompt_token_ids[{i}]", ids)
        if prompts is not None:
            for i, p in enumerate(prompts):
                if not isinstance(p, str):  # the display text of prompt_token_ids[i]
                    raise RequestError(f"prompt {i} must be a string beside prompt_token_ids, got {type(p).__name__}")
            if len(prompts) != len(prompt_token_ids):
                raise RequestError(f"{len(prompts)} prompts but {len(prompt_token_ids)} prompt_token_ids")
        texts = list(prompts) if prompts is not None else [None] * len(prompt_token_ids)
        return self._run(texts, [list(ids) for ids in prompt_token_ids], sampling_params, use_tqdm, stream)

    def _prompt(self, i: int, prompt: str | Mapping) -> tuple[str | None, list[int]]:
        """(display text, token ids) of prompt i, a string or a prompt dict."""
        if isinstance(prompt, str):
            return prompt, self._encode(i, prompt)
        if not isinstance(prompt, Mapping):
            raise RequestError(f"prompt {i} must be a string or a prompt dict, got {type(prompt).__name__}")
        unknown = [k for k in prompt if k not in PROMPT_KEYS]
        if unknown:
            raise RequestError(f"prompt {i}: unknown keys {', '.join(map(repr, unknown))} (a prompt dict takes "
                               f"{' and/or '.join(PROMPT_KEYS)})")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if text is None and ids is None:
            raise RequestError(f"prompt {i}: a prompt dict needs {' or '.join(PROMPT_KEYS)}")
        if text is not None and not isinstance(text, str):
            raise RequestError(f"prompt {i}: prompt must be a string, got {type(text).__name__}")
        if ids is None:
            return text, self._encode(i, text)
        _check_list(f"prompt {i}: prompt_token_ids", ids)
        return text, list(ids)

    def _encode(self, i: int, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_bos=True) if text else []
        except ValueError as e:  # (was the binding's UnicodeEncodeError)
            raise RequestError(f"prompt {i}: {e}") from None

    def chat(self, messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             thinking: bool = False, reasoning_effort: str | None = None,
             stream: bool = False) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Generate the assistant turn of one conversation (a list of messages) or of several.
        Message text is encoded as plain text: a control token spelt in it stays those characters.
        The turn is parsed as the official API parses it: `outputs[i].text` is the answer,
        `reasoning_content` the reasoning (thinking mode), `tool_calls` the DSML tool calls
        (`ToolCall(id, function=FunctionCall(name, arguments))`). `stream` as in `generate`."""
        if not isinstance(stream, bool):
            raise RequestError(f"stream must be True or False, got {stream!r}")
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise RequestError(f"chat: expected a list of messages or a list of conversations, "
                               f"got {type(messages).__name__}")
        conversations = [messages] if not messages or isinstance(messages[0], Mapping) else list(messages)
        texts, ids = [], []
        for conv in conversations:
            try:
                texts.append(self.tokenizer.render_chat_prompt(conv, thinking, reasoning_effort))
                ids.append(self.tokenizer.render_chat(conv, thinking, reasoning_effort))
            except (ValueError, KeyError, TypeError) as e:
                raise RequestError(f"chat: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        return self._run(texts, ids, sampling_params, use_tqdm, stream, chat={"thinking": thinking})

    def _run(self, texts: list[str | None], ids: list[list[int]], sampling_params, use_tqdm: bool,
             stream: bool = False, chat: dict | None = None):
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(ids)
        elif not isinstance(sampling_params, (list, tuple)):
            raise RequestError("sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                               f"{type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
            if len(params) != len(ids):
                raise RequestError(f"{len(params)} sampling params for {len(ids)} prompts")
        # all checked before any is queued: a bad one queues nothing; the error names which of them it is
        for i, (prompt_ids, p) in enumerate(zip(ids, params)):
            try:
                self.engine.validate_prompt(prompt_ids)
            except RequestError as e:
                raise RequestError(f"prompt {i}: {e}") from None
            if not isinstance(p, SamplingParams):
                raise RequestError(f"sampling params {i} must be SamplingParams, got {type(p).__name__}")
        if stream:  # (a generator: nothing is queued until it is iterated)
            return self._stream(texts, ids, params, chat)
        before, steps = self.engine.spec_stats.copy(), self.engine.num_steps
        prefix_before = self.engine.cache.stats.copy()
        request_ids = self._add(texts, ids, params, chat)
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm)
        try:
            while len(done) < len(request_ids):
                for out in self.engine.step():
                    if out.request_id not in wanted:
                        continue  # a request of an earlier, interrupted call
                    done[out.request_id] = out
                    bar.update(1)
        finally:
            bar.close()
            for rid in request_ids:  # an interrupted call leaves nothing queued behind it
                if rid not in done:
                    self.engine.abort_request(rid)
            self.last_run_stats = {"steps": self.engine.num_steps - steps, "speculative": self.engine.num_speculative,
                                   **self.engine.spec_stats.since(before).summary()}
            if self.engine.cache.prefix is not None:
                self.last_run_stats["prefix"] = self.engine.cache.stats.since(prefix_before).summary()
        return [done[rid] for rid in request_ids]

    def _add(self, texts, ids, params, chat: dict | None, stream: bool = False) -> list[str]:
        extra = {"chat": True, **chat} if chat is not None else {}
        return [self.engine.add_request(text, p, prompt_ids, stream=stream, **extra)
                for text, p, prompt_ids in zip(texts, params, ids)]

    def _stream(self, texts, ids, params, chat: dict | None) -> Iterator[RequestOutput]:
        before, steps = self.engine.spec_stats.copy(), self.engine.num_steps
        prefix_before = self.engine.cache.stats.copy()
        request_ids = self._add(texts, ids, params, chat, stream=True)
        samples = {rid: self.engine.request_samples(rid) for rid in request_ids}
        try:
            while samples:
                self.engine.step()
                for rid in list(samples):
                    delta = RequestOutput.delta_of(samples[rid])
                    if delta is not None:
                        if delta.finished:
                            del samples[rid]
                        yield delta
        finally:
            for rid in samples:  # closed early: nothing stays queued behind the stream
                self.engine.abort_request(rid)
            if samples:
                self.engine.step()  # (it reports the aborted requests, which the engine then forgets)
            self.last_run_stats = {"steps": self.engine.num_steps - steps, "speculative": self.engine.num_speculative,
                                   **self.engine.spec_stats.since(before).summary()}
            if self.engine.cache.prefix is not None:
                self.last_run_stats["prefix"] = self.engine.cache.stats.since(prefix_before).summary()


def _check_list(name: str, value) -> None:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise RequestError(f"{name} must be a list, got {type(value).__name__}")
