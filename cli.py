"""The `deepinfer` command. Each subcommand is a function that adds its parser; bad input ends
in one line `deepinfer: error: ...` and exit status 2, never a traceback (DEEPINFER_DEBUG=1 shows
one)."""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from pathlib import Path
import warnings

from .version import VERSION

# The errors that are about the user's input, not a bug: (module, class names). They are looked up
# in sys.modules when an error is caught instead of imported then: a module that never loaded raised
# nothing, and importing torch inside an except clause, after a Ctrl-C cut its first import short,
# fails with an error of its own.
_USER_ERRORS = {
    "ir": ("ParseError", "VerifyError"),
    "models.checkpoint": ("CheckpointError",),
    "models.config": ("ConfigError",),
    "models.tokenizer": ("TokenizerError",),
    "models.deepseek_v41": ("BuildError",),
    "runtime.plan_file": ("PlanError",),
    "runtime.distributed": ("DistributedError",),
    "runtime.engine": ("RequestError", "EngineConfigError"),
    "runtime.sampling_params": ("SamplingParamsError",),
    "codegen.targets": ("UnknownTargetError",),
    "passes.driver": ("CompileOptionsError",),
    "autotune.tuner": ("TuneError",),
}
# OSErrors about the user's paths and disks (a read-only or full disk, permissions, missing paths).
_USER_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EEXIST, errno.EISDIR, errno.ENOTDIR,
                errno.ENOTEMPTY, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.ELOOP}
# The status a program killed by SIGPIPE has (as `yes | head` reports it): output cut short by the reader.
EXIT_BROKEN_PIPE = 141
EXIT_INTERRUPTED = 130


def _is_user_error(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in _USER_ERRNOS or isinstance(e, (FileNotFoundError, FileExistsError, PermissionError,
                                                          IsADirectoryError, NotADirectoryError))
    for module, names in _USER_ERRORS.items():
        loaded = sys.modules.get(f"{__package__}.{module}")
        if loaded is not None and isinstance(e, tuple(getattr(loaded, n) for n in names)):
            return True
    return False


def _error_line(e: BaseException, args: argparse.Namespace) -> str:
    if isinstance(e, OSError) and e.filename:
        return f"{e.strerror}: {e.filename}"
    line = str(e).splitlines()[0] if str(e) else type(e).__name__
    param = getattr(e, "param", None)  # validate.param_error: the API's argument name, which has a flag here
    if param and param in vars(args) and line.startswith(param):
        line = "--" + param.replace("_", "-") + line[len(param):]
    return line


# ---- inspect ------------------------------------------------------------------------------------

def _fmt_params(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def cmd_inspect(args) -> int:
    """Sizes, cache bytes and op counts of a model, built from its config with no weights."""
    from .models.config import load_config
    from .models.deepseek_v41 import build_model
    from .models.sizes import model_sizes

    cfg = load_config(args.model)
    t = time.perf_counter()
    prog = build_model(cfg)
    build_s = time.perf_counter() - t
    sizes = model_sizes(cfg)
    report = {
        "model": cfg.model_id, "config_hash": cfg.config_hash,
        "params": {k[len("params_"):]: v for k, v in sizes.items() if k.startswith("params_")},
        "bytes_as_shipped": {k[len("bytes_"):]: v for k, v in sizes.items() if k.startswith("bytes_")},
        "global_kv_bytes_per_token": sizes["global_kv_bytes_per_token"],
        "window_ring_bytes_per_sequence": sizes["window_ring_bytes_per_sequence"],
        "checkpoint_tensors": sizes["n_tensors"],
        "graphs": {name: {"nodes": len(g.nodes), "params": len(g.params), "ops": g.op_counts()}
                   for name, g in prog.graphs.items()},
        "state_buffers": len(prog.state),
        "graph_build_seconds": round(build_s, 2),
    }
    limits = {k: v for k in ("max_model_len", "max_num_seqs") if (v := getattr(args, k)) is not None}
    if args.target:
        from .passes.driver import CompileOptions, plan_rank_memory

        opts = CompileOptions(args.target, ep=args.ep, dp=args.dp, redundant_experts=args.redundant_experts, **limits)
        report["rank_memory"] = plan_rank_memory(args.model, opts)
    else:  # (they were ignored: the report without them looked like their answer)
        from .passes.driver import CompileOptionsError

        given = [k for k in limits] + [k for k, off in (("ep", 1), ("dp", 1), ("redundant_experts", 0))
                                       if getattr(args, k) != off]
        if given:
            raise CompileOptionsError(", ".join("--" + k.replace("_", "-") for k in given) + " size one rank of "
                                      "the plan for --target: only with --target")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    p, b = report["params"], report["bytes_as_shipped"]
    print(f"model {cfg.model_id}  (config {cfg.config_hash[:12]})")
    print(f"  parameters  total {_fmt_params(p['total'])}  backbone {_fmt_params(p['backbone'])}  "
          f"Engram {_fmt_params(p['engram'])}  DSpark {_fmt_params(p['dspark'])}  "
          f"activated/decode token {_fmt_params(p['activated'])}")
    print(f"  as shipped  {b['total'] / 1e9:.1f} GB in {report['checkpoint_tensors']} tensors")
    print(f"  KV cache    {report['global_kv_bytes_per_token']:.0f} B/token global, "
          f"{report['window_ring_bytes_per_sequence']} B/sequence of window rings (128-slot)")
    for name, gr in report["graphs"].items():
        top = sorted(gr["ops"].items(), key=lambda kv: -kv[1])[:8]
        print(f"  graph {name:5s} {gr['nodes']} nodes, {gr['params']} params; "
              + ", ".join(f"{k} {v}" for k, v in top))
    print(f"  built in {build_s:.2f} s, {report['state_buffers']} state buffers")
    if "rank_memory" in report:
        m, lay = report["rank_memory"], report["rank_memory"]["layout"]
        print(f"  per rank on {args.target} (ep {lay['ep']}, dp {lay['dp']}, {lay['attention']} attention, "
              f"{lay['exchange']} exchange): {m['total_bytes'] / 1e9:.1f} GB = weights {m['weights_bytes'] / 1e9:.1f}"
              f" + caches {m['state_bytes'] / 1e9:.1f} ({m['pool']['num_slots']} slots, {m['pool']['num_pages']} "
              f"pages) + activations {m['activation_peak_bytes'] / 1e9:.1f} (largest: {m['activation_peak_bucket']})")
    return 0


def add_inspect(sub):
    p = sub.add_parser("inspect", help="sizes, KV bytes and op counts of a model (no weights needed)")
    p.add_argument("--model", required=True, help="preset name (v4.1-flash, v4.1-flash-medium, "
                   "v4.1-flash-tiny) or a directory holding config.json")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--target", help="with it: the device memory one rank of the plan for this target and layout "
                   "needs (planned from the graphs; no kernel is built)")
    _add_layout(p)
    p.add_argument("--max-model-len", type=int, help="as compile's (for --target; default 65536)")
    p.add_argument("--max-num-seqs", type=int, help="as compile's, per rank (for --target; default 256)")
    p.set_defaults(func=cmd_inspect)


# ---- make-checkpoint ----------------------------------------------------------------------------

def cmd_make_checkpoint(args) -> int:
    from .models.checkpoint import checkpoint_bytes, make_checkpoint
    from .models.config import load_config

    cfg = load_config(args.model)
    t = time.perf_counter()
    out = make_checkpoint(cfg, args.output, seed=args.seed, overwrite=args.overwrite, force=args.force)
    print(f"wrote {out} ({checkpoint_bytes(cfg) / 1e6:.1f} MB, seed {args.seed}) in {time.perf_counter() - t:.1f} s")
    return 0


def add_make_checkpoint(sub):
    p = sub.add_parser("make-checkpoint", help="write a random checkpoint in the real format (deterministic per seed)")
    p.add_argument("--model", required=True, help="preset name or a directory holding config.json")
    p.add_argument("-o", "--output", required=True, help="checkpoint directory to create")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint directory")
    p.add_argument("--force", action="store_true", help="allow a checkpoint larger than the size guard")
    p.set_defaults(func=cmd_make_checkpoint)


# ---- compile ------------------------------------------------------------------------------------

def cmd_compile(args) -> int:
    from .passes.driver import CompileOptions, compile_model

    opts = CompileOptions(args.target, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          ep=args.ep, dp=args.dp, redundant_experts=args.redundant_experts, jobs=args.jobs,
                          dump_ir=args.dump_ir,
                          decode_batches=args.decode_batches, prefill_tokens=args.prefill_tokens,
                          verify_batches=tuple(args.verify_batches), tuning_db=args.tuning_db,
                          batch_invariant=args.batch_invariant)
    t = time.perf_counter()
    report = compile_model(args.model, opts, args.output, progress=sys.stderr.isatty())
    print(report.summary())
    print(f"  total {time.perf_counter() - t:.1f} s")
    return 0


def _add_layout(p) -> None:
    p.add_argument("--ep", type=int, default=1, help="ranks the routed experts are spread over (one per GPU; "
                   "run with torchrun --nproc-per-node EP)")
    p.add_argument("--dp", type=int, default=1, help="attention groups over the EP ranks: EP = each rank runs its "
                   "own sequences (data-parallel attention), 1 = every rank runs all of them")
    p.add_argument("--redundant-experts", type=int, default=0, metavar="N",
                   help="extra expert slots per MoE layer for EPLB's replicas of hot experts")


def add_compile(sub):
    from .codegen.targets import TARGETS

    p = sub.add_parser("compile", help="compile a model for a target into a plan directory")
    p.add_argument("--model", required=True, help="preset name or a directory holding config.json")
    p.add_argument("--target", required=True, help=f"one of {', '.join(TARGETS)}")
    p.add_argument("-o", "--output", required=True, help="plan directory (replaced atomically)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel kernel builds")
    p.add_argument("--dump-ir", metavar="DIR", help="write every pipeline stage as NN-passname.ir")
    p.add_argument("--max-model-len", type=int, default=65536, help="longest sequence the plan serves")
    p.add_argument("--max-num-seqs", type=int, default=256, help="largest decode batch the plan serves")
    _add_layout(p)
    p.add_argument("--decode-batches", type=_int_list, metavar="B,B,...",
                   help="decode bucket sizes (default: powers of two up to --max-num-seqs)")
    p.add_argument("--prefill-tokens", type=_int_list, metavar="T,T,...",
                   help="prefill bucket token budgets (default: 512,2048,8192)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="one template and reduction structure per call at every bucket (no batch-dependent split "
                        "or kernel choice; tuning rows are not read): a request's tokens do not depend on its batch")
    p.add_argument("--tuning-db", metavar="PATH",
                   help="tuning database to take kernel configs from (default: the one shipped for the target, "
                        "where it exists; 'none': template defaults)")
    p.add_argument("--verify-batches", type=_verify_list, metavar="B,BxR,...", default=(),
                   help="verify buckets for speculative decoding on a device plan: B = B sequences of 1 + the "
                        "draft block's rows, logits for each; BxR = B sequences sharing R rows (a step verifying "
                        "fewer drafts runs in fewer rows) (default: none; device plans then do not speculate)")
    p.set_defaults(func=cmd_compile)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(sorted(set(vals)))


def _verify_list(text: str) -> tuple[int | tuple[int, int], ...]:
    """B,B,BxR,...: ints, and (B, R) pairs for BxR (the range checks are CompileOptions')."""
    vals = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        try:
            nums = tuple(int(v) for v in parts)
        except ValueError:
            nums = ()
        if len(nums) not in (1, 2):
            raise argparse.ArgumentTypeError(f"expected comma-separated B or BxR (sequences x rows), got {text!r}")
        vals.append(nums[0] if len(nums) == 1 else nums)
    return tuple(sorted(set(vals), key=lambda v: v if isinstance(v, tuple) else (v, 0)))


# ---- generate -----------------------------------------------------------------------------------

def _read_prompts(args) -> list:
    """--prompt TEXT, or --prompts FILE.jsonl: each line a JSON string, {"prompt": TEXT} or, for
    --chat, {"messages": [...]}; blank lines are skipped."""
    from .models.tokenizer import check_messages
    from .runtime.engine import RequestError

    if args.prompt is not None:
        return [[{"role": "user", "content": args.prompt}] if args.chat else args.prompt]
    items = []
    with open(args.prompts, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{args.prompts} line {number}"
            try:  # a BOM (an editor's UTF-8 signature) on the first line is not part of the prompt
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise RequestError(f"{where}: not JSON ({e.msg})") from None
            except RecursionError:
                raise RequestError(f"{where}: not JSON (nested too deeply)") from None
            if isinstance(item, dict) and "messages" in item and args.chat:
                try:
                    check_messages(item["messages"])
                except ValueError as e:
                    raise RequestError(f"{where}: {e}") from None
                items.append(item["messages"])
            elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
                items.append([{"role": "user", "content": item["prompt"]}] if args.chat else item["prompt"])
            elif isinstance(item, str):
                items.append([{"role": "user", "content": item}] if args.chat else item)
            else:
                raise RequestError(f"{where}: expected a JSON string, {{\"prompt\": ...}}"
                                   + (" or {\"messages\": [...]}" if args.chat else ""))
    if not items:
        raise RequestError(f"{args.prompts}: no prompts")
    return items


def _load_llm(args):
    """The engine the arguments name. (The compiled-plan form, `generate PLAN_DIR`, is decided here.)"""
    from .llm import LLM
    from .runtime.engine import EngineConfigError

    if args.plan is None and args.model is None:
        raise EngineConfigError("no model: give a compiled PLAN_DIR or --model")
    if args.plan is not None and args.model is not None:
        raise EngineConfigError("give a compiled PLAN_DIR or --model, not both")
    return LLM(args.model, args.weights, plan=args.plan, target=args.target, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
               speculative=_speculative(args.speculative), enable_prefix_caching=args.prefix_cache,
               batch_invariant=getattr(args, "batch_invariant", False),
               **{k: v for k, v in (("swa_replay", args.swa_replay), ("swa_replay_keep", args.swa_replay_keep))
                  if v is not None})


def _speculative(text: str | None):
    """--speculative: absent = on where the executor can verify drafts; off / 0 = off; N drafts."""
    from .runtime.engine import EngineConfigError

    if text is None:
        return None
    if text.strip().lower() == "off":
        return 0
    if not text.strip().isdigit():
        raise EngineConfigError(f"--speculative takes off or a number of drafts >= 0, got {text!r}")
    return int(text)


def _constraint(args) -> dict:
    """--regex TEXT, --json-schema FILE, --grammar FILE (EBNF) as SamplingParams arguments."""
    from .runtime.sampling_params import SamplingParamsError
    from .validate import param_error

    out = {"regex": args.regex} if args.regex is not None else {}
    for name in ("json_schema", "grammar"):
        path = getattr(args, name)
        if path is None:
            continue
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise param_error(SamplingParamsError, name, f"{path}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset "
                                                         f"{e.start})") from None
        if name == "json_schema":
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                raise param_error(SamplingParamsError, name, f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
            except RecursionError:
                raise param_error(SamplingParamsError, name, f"{path}: not JSON (nested too deeply)") from None
        out[name] = text
    return out


def cmd_generate(args) -> int:
    from .runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, **_constraint(args))
    prompts = _read_prompts(args)
    llm = _load_llm(args)
    t = time.perf_counter()
    outs = llm.chat(prompts, params) if args.chat else llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    for i, out in enumerate(outs):
        prompt = out.prompt if out.prompt is not None else str(out.prompt_token_ids)
        print(f"[{i}] prompt: {json.dumps(prompt, ensure_ascii=False)}")
        if out.outputs[0].reasoning_content:
            print(f"[{i}] reasoning: {json.dumps(out.outputs[0].reasoning_content, ensure_ascii=False)}")
        for call in out.outputs[0].tool_calls or []:
            print(f"[{i}] tool call: {call.function.name} {call.function.arguments}")
        print(f"[{i}] output: {json.dumps(out.text, ensure_ascii=False)}  "
              f"({len(out.token_ids)} tokens, {out.finish_reason})")
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    n_gen = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {n_prompt} prompt tokens, {n_gen} generated tokens in {seconds:.2f} s: "
          f"{n_gen / seconds:.1f} generated tokens/s, {(n_prompt + n_gen) / seconds:.1f} total tokens/s")
    st = llm.last_run_stats
    if st.get("speculative"):
        print(f"speculative ({st['speculative']} drafts): mean accepted length {st['mean_accepted_length']:.2f} "
              f"tokens, {st['verify_rows_per_step']:.1f} verify rows/step, acceptance {st['acceptance_rate']:.1%}, "
              f"draft time {st['draft_time_share']:.0%} of the run's steps")
    if "prefix" in st:
        px = st["prefix"]
        print(f"prefix cache: hit rate {px['hit_rate']:.1%} ({px['hit_tokens']} of {px['query_tokens']} prompt tokens), "
              f"{px['prefill_tokens_saved']} prefill tokens saved")
    return 0


def add_generate(sub):
    p = sub.add_parser("generate", help="generate text from prompts with a compiled plan (or a model on the "
                       "graph interpreter), continuous batching")
    p.add_argument("plan", nargs="?", metavar="PLAN_DIR", help="a compiled plan (deepinfer compile)")
    p.add_argument("--model", help="instead of a plan: preset name or a directory holding config.json")
    p.add_argument("--weights", required=True, help="checkpoint directory (deepinfer make-checkpoint writes one)")
    p.add_argument("--target", help="where the model runs (default: the plan's; cpu, the interpreter's, with --model); "
                   "a plan compiled for another target is refused")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", metavar="FILE.jsonl", help="one prompt per line (a JSON string or {\"prompt\": ...})")
    p.add_argument("--chat", action="store_true", help="render each prompt as a user turn of the chat format "
                   "(a --prompts line may also be {\"messages\": [...]})")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="sampling seed of every request (reproducible output)")
    p.add_argument("--max-num-seqs", type=int, help="sequences running at once (default: the plan's; 16 on the "
                   "interpreter)")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step (default: 512, at most a GPU "
                   "plan's largest step bucket)")
    p.add_argument("--max-model-len", type=int, help="longest sequence, prompt + output (default: the plan's; 4096 on "
                   "the interpreter)")
    p.add_argument("--speculative", metavar="off|N", help="DSpark drafts verified per step (default: the draft "
                   "block where the executor can verify drafts; off where it cannot)")
    p.add_argument("--prefix-cache", action="store_true", help="share the cached pages of common prompt prefixes "
                   "between requests (prints the hit rate and the prefill tokens saved)")
    p.add_argument("--swa-replay", metavar="exact|bounded", help="with --prefix-cache: restore the window rings "
                   "saved with each page (exact, the default) or recompute the hit's last KEEP tokens (bounded)")
    p.add_argument("--swa-replay-keep", type=int, metavar="KEEP",
                   help="tokens bounded replay recomputes (default 140; >= window + the largest rollback)")
    p.add_argument("--batch-invariant", action="store_true", help="refuse a plan compiled without "
                   "--batch-invariant: each request's tokens must not depend on the others in its steps")
    p.add_argument("--regex", help="structured output: every output matches this regular expression")
    p.add_argument("--json-schema", metavar="FILE", help="structured output: every output is JSON valid under the "
                   "schema in FILE")
    p.add_argument("--grammar", metavar="FILE", help="structured output: every output is a sentence of the EBNF "
                   "grammar in FILE (xgrammar's GBNF dialect, start rule root)")
    p.set_defaults(func=cmd_generate)


# ---- autotune -----------------------------------------------------------------------------------

def cmd_autotune(args) -> int:
    from .autotune.db import TuningDB, shipped_db
    from .autotune.tuner import TuneError, table, tune

    modes = [m for m, on in (("--cost-model-only", args.cost_model_only), ("--build-candidates", args.build_candidates),
                             ("--measure", args.measure), ("--apply", args.apply)) if on]
    if len(modes) != 1:
        raise TuneError("give one of --cost-model-only (rank by the cost model here), --build-candidates DIR (build "
                        "the candidates to measure, here), --measure DIR (time them, on the GPU machine) or --apply "
                        "DIR (write the tuned plan from them, there)" + (f", not {' and '.join(modes)}" if modes else ""))
    if args.output and not args.apply:
        raise TuneError("-o names the tuned plan that --apply writes")
    if args.step_curve and not args.apply:
        raise TuneError("--step-curve times the tuned plan that --apply writes: only with --apply")
    if args.prune_stale and not args.cost_model_only:
        raise TuneError("--prune-stale rewrites the database that --cost-model-only updates here: only with it")
    if (args.model or args.target) and not args.cost_model_only:
        raise TuneError("--model and --target rank a compile's instances by the cost model: only with "
                        "--cost-model-only (the other modes read a compiled plan's kernels)")
    if args.measure:
        return _autotune_measure(args)
    if args.plan is not None and (args.model or args.target):
        raise TuneError("give PLAN_DIR or --model and --target, not both")
    if args.plan is None and not (args.cost_model_only and args.model and args.target):
        raise TuneError(f"{modes[0]} tunes a compiled plan: give PLAN_DIR"
                        + (" (or --model and --target, which need no built kernels)" if args.cost_model_only else ""))
    if args.apply:
        return _autotune_apply(args)
    if args.build_candidates:
        from .autotune.candidates import build_candidates

        t = time.perf_counter()
        report = build_candidates(args.plan, args.build_candidates, only=args.only, top_k=args.top_k,
                                  limit=args.limit, jobs=args.jobs, progress=sys.stderr.isatty())
        print(report.summary())
        print(f"  total {time.perf_counter() - t:.1f} s")
        return 0
    from .runtime.plan_file import load_plan

    if args.plan is not None:
        plan, target = args.plan, load_plan(Path(args.plan))["target"]["name"]
    else:  # the instances a compile would make, nothing rendered or built but the candidates
        from .autotune.tuner import selected_plan
        from .passes.driver import CompileOptions

        target = args.target
        limits = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs is not None else {}
        plan = selected_plan(args.model, CompileOptions(target, decode_batches=args.decode_batches,
                                                        prefill_tokens=args.prefill_tokens, **limits))
    db_path = Path(args.db) if args.db else shipped_db(target)
    db = TuningDB.load(db_path)
    run = tune(plan, db, budget_s=args.budget_s, only=args.only, limit=args.limit, progress=_progress_line,
               jobs=args.jobs)
    _end_progress_line()
    if not run.results:
        what = args.plan if args.plan is not None else f"{args.model} on {target}"
        why = " (the cpu target runs the ops' torch references, which have no configs)" if target == "cpu" else ""
        raise TuneError(f"nothing to tune in {what}" + (f" for {args.only}" if args.only else "") + why)
    print(table(run))
    pruned = ""
    if args.prune_stale:
        from .autotune.tuner import fingerprint
        from .codegen.targets import get_manifest

        t = get_manifest(target).target
        current = {name: fingerprint(t, name)["toolchain"] for name in sorted({r.template for r in run.results})}
        gone = db.prune_stale(current, t.arch)
        db.save(db_path)
        pruned = f", {gone} stale rows of the tuned templates dropped"
    print(f"wrote {db_path} ({len(db.rows)} rows{pruned}) in {run.seconds:.1f} s")
    return 0


def _autotune_measure(args) -> int:
    from .autotune.db import TuningDB
    from .autotune.measure import IsolatedRunner, measure
    from .autotune.tuner import TuneError, table

    if args.plan is not None:
        raise TuneError("--measure reads its candidates directory, not a plan: drop PLAN_DIR")
    if not args.db:
        raise TuneError("--measure needs --db OUT.jsonl, the database to write the measured rows into")
    runner = IsolatedRunner(timeout_s=args.timeout_s,
                            settings={"sets": args.sets, "repeats": args.repeats, "warmup": args.warmup})
    db = TuningDB.load(args.db)
    run = measure(args.measure, db, runner=runner, budget_s=args.budget_s, only=args.only, progress=_progress_line)
    _end_progress_line()
    print(table(run, configs=True))
    from .autotune.candidates import load_manifest
    from .autotune.cost import agreement, agreement_lines

    print("\n".join(agreement_lines(agreement(load_manifest(args.measure), db.rows))))
    left = f"; the budget left {run.left} instances: run again to go on" if run.left else ""
    print(f"wrote {args.db} ({len(db.rows)} rows) in {run.seconds:.1f} s{left}")
    return 0


def _autotune_apply(args) -> int:
    from .autotune.apply import apply_tuning
    from .autotune.db import TuningDB
    from .autotune.tuner import TuneError

    if not args.db or not args.output:
        raise TuneError("--apply needs --db DB.jsonl (the measured rows) and -o TUNED_PLAN_DIR (the plan to write)")
    if not Path(args.db).is_file():
        raise TuneError(f"{args.db}: {'is not a file' if Path(args.db).exists() else 'no such file'}")
    report = apply_tuning(args.plan, args.apply, TuningDB.load(args.db), args.output)
    print(report.summary())
    if args.step_curve:  # the tuned plan's step per bucket on this GPU, into the plan (autotune/steps.py)
        import torch

        from .autotune.steps import measure_step_curve, record_step_curve

        curve = measure_step_curve(args.output)
        rec = record_step_curve(args.output, curve, torch.cuda.get_device_name())
        print(f"step-time curve of {args.output} on the {rec['device']}: "
              + ", ".join(f"{b['bucket']} {b['seconds'] * 1e3:.2f} ms" for b in rec["buckets"]))
    return 0


def _progress_line(i, n, name):
    if sys.stderr.isatty():
        print(f"\r[{i + 1}/{n}] {name[:50]:<50}", end="", file=sys.stderr, flush=True)


def _end_progress_line():
    if sys.stderr.isatty():
        print(file=sys.stderr)


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return v
    return parse


def add_autotune(sub):
    p = sub.add_parser("autotune", help="tune a compiled plan's kernels into a tuning database: by the cost model "
                       "here, or measured on a GPU machine in two steps (--build-candidates here, --measure there)")
    p.add_argument("plan", nargs="?", metavar="PLAN_DIR", help="plan directory (deepinfer compile -o); not with --measure")
    p.add_argument("--model", help="with --target and --cost-model-only, instead of PLAN_DIR: rank the instances a "
                   "compile of this model would make (nothing built)")
    p.add_argument("--target", help="the target of --model's compile")
    p.add_argument("--decode-batches", type=_int_list, metavar="B,B,...", help="--model's decode buckets (default: "
                   "compile's)")
    p.add_argument("--prefill-tokens", type=_int_list, metavar="T,T,...", help="--model's prefill buckets "
                   "(default: compile's)")
    p.add_argument("--max-num-seqs", type=int, help="--model's largest decode batch (default: compile's, 256)")
    p.add_argument("--db", help="tuning database to update (default with --cost-model-only: the shipped one for "
                   "the plan's target; --measure needs one)")
    p.add_argument("--budget-s", type=_positive(float), help="start no instance after this many seconds (what was "
                   "tuned is kept; a rerun goes on)")
    p.add_argument("--cost-model-only", action="store_true",
                   help="rank candidates by the analytic cost model (no hardware); rows are marked measured: false")
    p.add_argument("--prune-stale", action="store_true",
                   help="with --cost-model-only: afterwards drop the database's rows of the tuned templates that "
                        "builds here can no longer use (another toolchain or template code)")
    p.add_argument("--build-candidates", metavar="DIR",
                   help="build each instance's top-k configs by the cost model and its default, with this host's "
                        "toolchain, into DIR (a manifest and cubins; rerunning skips what DIR holds)")
    p.add_argument("--measure", metavar="DIR", help="time the candidates of DIR on this machine's GPU (no compiler "
                   "needed) and write measured rows into --db; the compile that built DIR's kernels takes them")
    p.add_argument("--apply", metavar="DIR", help="write PLAN_DIR tuned to -o: each instance whose --db row is one "
                   "of DIR's built candidates takes that candidate's kernel (no compiler needed: the GPU machine's "
                   "last step)")
    p.add_argument("-o", "--output", metavar="TUNED_PLAN_DIR", help="the tuned plan --apply writes (PLAN_DIR is kept)")
    p.add_argument("--step-curve", action="store_true", help="with --apply, on the GPU: time each decode and verify "
                   "bucket's step of the tuned plan and record the curve in it (the speculative verifier's budget)")
    p.add_argument("--only", metavar="NAME,...", help="these templates' instances only, or these instances (by id, "
                   "as plan.json names them)")
    p.add_argument("--top-k", type=_positive(int), default=8, help="configs built per instance, besides the default "
                   "(--build-candidates; default 8)")
    p.add_argument("--limit", type=_positive(int), default=64, help="configs sampled from a larger space before the "
                   "cost model ranks them (default 64; a TileLang render lowers, seconds each)")
    p.add_argument("--jobs", type=_positive(int), default=os.cpu_count() or 1, help="parallel renders and builds")
    p.add_argument("--timeout-s", type=_positive(float), default=60.0, help="a candidate running longer is recorded "
                   "as failed (--measure; default 60)")
    p.add_argument("--sets", type=_positive(int), default=5, help="repeat sets, each on fresh inputs (--measure)")
    p.add_argument("--repeats", type=_positive(int), default=20, help="timed calls per set (--measure)")
    p.add_argument("--warmup", type=_positive(int), default=3, help="untimed calls before each set (--measure)")
    p.set_defaults(func=cmd_autotune)


COMMANDS = [add_inspect, add_compile, add_make_checkpoint, add_generate, add_autotune]


class _OneLineParser(argparse.ArgumentParser):
    """argparse's errors as DeepInfer's: one line naming the problem and exit 2, without the usage
    text (`deepinfer COMMAND --help` prints that)."""

    def error(self, message):
        self.exit(2, f"deepinfer: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="deepinfer", description="DeepInfer: compile a model graph into a plan of generated kernels and run it.")
    parser.add_argument("--version", action="version", version=f"deepinfer {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_OneLineParser)
    for add in COMMANDS:
        add(sub)
    return parser


def _one_line_warnings(show):
    """showwarning printing DeepInfer's own warnings as one line, like its errors; others as `show` does."""
    def show_warning(message, category, filename, lineno, file=None, line=None):
        if category.__module__.startswith(f"{__package__}."):
            print(f"deepinfer: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)
    return show_warning


def _run(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(warnings.showwarning)
            return args.func(args)
    except Exception as e:
        if not _is_user_error(e) or os.environ.get("DEEPINFER_DEBUG"):
            raise
        print(f"deepinfer: error: {_error_line(e, args)}", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    """After the reader of stdout went away: point stdout at /dev/null, so the interpreter's last
    flush does not fail again (which prints an 'Exception ignored' and exits 120). The recipe of
    Python's signal docs."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a file (a test's capture): nothing will flush it to the pipe


def main(argv=None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, where it is handled, not at interpreter exit
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("deepinfer: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
