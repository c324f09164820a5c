"""The compile driver: model config -> graphs -> target pipeline -> buckets -> kernels -> plan."""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import replace_file
from ..ir import shapes as sh
from ..ir.graph import Graph
from ..ir.registry import get_op
from ..ir.text import print_graph
from ..models.config import load_config
from ..models.deepseek_v41 import PAGE_TOKENS, build_model, max_backtrack, param_sources
from ..validate import check_positive_ints, param_error
from .coverage import TORCH_TEMPLATES, coverage_lines, plan_coverage
from .kernels import kernel_spec
from .memory import plan_memory
from .pipelines import decode_pipeline_differs, pipeline
from .shapes import default_buckets


class CompileOptionsError(ValueError):
    """Compile options that cannot make a usable plan; one line naming the option."""


@dataclass
class CompileOptions:
    target: str
    max_model_len: int = 65536
    max_num_seqs: int = 256
    ep: int = 1
    # attention groups over the ep ranks (dp = ep: every rank its own sequences; 1: replicated)
    dp: int = 1
    redundant_experts: int = 0  # extra expert slots per MoE layer for EPLB's replicas (spec §11)
    jobs: int = 1
    dump_ir: str | None = None
    decode_batches: tuple[int, ...] | None = None
    prefill_tokens: tuple[int, ...] | None = None
    # verify buckets (speculative decoding, logits for every row): B = B sequences of 1 + the draft
    # block's rows each; (B, R) = B sequences sharing R rows (ragged: a step verifying fewer
    # drafts runs in fewer rows); none by default, and only for a model with the DSpark draft head
    verify_batches: tuple[int | tuple[int, int], ...] = ()
    # the tuning database configs come from (autotune/db.py); None: the one shipped for the target
    # where it exists; "" or "none": template defaults only
    tuning_db: str | None = None
    num_slots: int | None = None  # state slots of the cache pool; default int(1.2 * max_num_seqs) + 1
    num_pages: int | None = None  # pages of the compressed caches; default room for max_num_seqs / 4 full contexts
    # every call runs one template with one reduction structure whatever the bucket, so a
    # request's tokens do not depend on what else is in its step (spec-level, not tuned)
    batch_invariant: bool = False

    def __post_init__(self):
        # checked here, not where the sizes are used: a zero or negative size compiled to a plan
        # nothing could run, or failed minutes later inside shape inference
        check_positive_ints(CompileOptionsError, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                            ep=self.ep, dp=self.dp, jobs=self.jobs)
        if self.ep % self.dp:
            raise param_error(CompileOptionsError, "dp", f"{self.dp} does not divide ep {self.ep} (each attention "
                              "group spans ep / dp ranks)")
        if self.redundant_experts < 0 or isinstance(self.redundant_experts, bool):
            raise param_error(CompileOptionsError, "redundant_experts", f"must be >= 0, got {self.redundant_experts!r}")
        if self.redundant_experts and self.ep == 1:
            raise param_error(CompileOptionsError, "redundant_experts", "needs ep > 1 (one rank holds every expert)")
        check_positive_ints(CompileOptionsError, **{k: getattr(self, k) for k in ("num_slots", "num_pages")
                                                    if getattr(self, k) is not None})
        for name in ("decode_batches", "prefill_tokens"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or not all(_positive(v) for v in sizes)):
                raise param_error(CompileOptionsError, name, f"must be positive integers, got {sizes!r}")
        if not all(_positive(v) or (isinstance(v, tuple) and len(v) == 2 and all(map(_positive, v)) and v[1] > v[0])
                   for v in self.verify_batches):
            raise param_error(CompileOptionsError, "verify_batches", "must be positive integers B or (B, R) pairs "
                              f"with R > B (B sequences sharing R rows), got {self.verify_batches!r}")
        # a bucket of more sequences than the plan serves was dropped without a word (a plan of
        # --decode-batches 512 --max-num-seqs 256 had no decode bucket at all)
        for name, sizes in (("decode_batches", self.decode_batches or ()), ("verify_batches", self.verify_batches)):
            over = [v for v in sizes if (v[0] if isinstance(v, tuple) else v) > self.max_num_seqs]
            if over:
                shown = ",".join(f"{v[0]}x{v[1]}" if isinstance(v, tuple) else str(v) for v in over)
                raise param_error(CompileOptionsError, name, f"{shown} exceeds max_num_seqs {self.max_num_seqs} (the "
                                  "largest decode batch the plan serves); raise max_num_seqs or drop the bucket")

    def check_model(self, cfg) -> None:
        """The options that depend on the model."""
        if self.max_model_len > cfg.max_position_embeddings:
            raise param_error(CompileOptionsError, "max_model_len", f"{self.max_model_len} exceeds the model's "
                              f"max_position_embeddings {cfg.max_position_embeddings}")
        experts = {"n_routed_experts": cfg.n_routed_experts}
        if cfg.num_nextn_predict_layers:
            experts["dspark_n_routed_experts"] = cfg.dspark_n_routed_experts
        if self.verify_batches and not cfg.num_nextn_predict_layers:
            raise param_error(CompileOptionsError, "verify_batches", f"model {cfg.model_id} has no DSpark draft "
                              "head to verify")
        for v in self.verify_batches:
            if isinstance(v, tuple) and v[1] > v[0] * max_backtrack(cfg):
                raise param_error(CompileOptionsError, "verify_batches", f"{v[0]}x{v[1]}: {v[0]} sequences bring at "
                                  f"most {v[0] * max_backtrack(cfg)} rows (1 + {max_backtrack(cfg) - 1} drafts each)")
        for key, n in experts.items():
            if n % self.ep and not self.redundant_experts:  # every rank holds an equal share of the experts of each MoE layer
                raise param_error(CompileOptionsError, "ep", f"{self.ep} does not divide the model's {n} routed "
                                  f"experts ({key})")

    @property
    def layout(self):
        from .moe import ExpertLayout

        return ExpertLayout(self.ep, self.dp, self.redundant_experts)

    def pool(self, max_pages: int) -> dict[str, int]:
        """Kernels are built for a fixed cache pool, as DeepInfer sizes its own: slots for every
        running sequence plus headroom for preempted ones, pages for the given share of contexts."""
        slots = self.num_slots or int(1.2 * self.max_num_seqs) + 1
        pages = self.num_pages or max(max_pages, max_pages * self.max_num_seqs // 4)
        return {"num_slots": slots, "num_pages": pages}


def _positive(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@dataclass
class CompileReport:
    plan_dir: Path
    stage_seconds: dict[str, float] = field(default_factory=dict)
    calls_per_template: dict[str, int] = field(default_factory=dict)
    unique_kernels: int = 0
    peak_bytes: dict[str, int] = field(default_factory=dict)
    build_status: dict[str, int] = field(default_factory=dict)  # built / unbuilt / failed / invalid / torch
    coverage: dict = field(default_factory=dict)  # passes/coverage.py: instances, torch instances, kernels per step

    def summary(self) -> str:
        lines = [f"plan written to {self.plan_dir}"]
        lines.append("  calls per template: " + ", ".join(f"{k} {v}" for k, v in
                                                          sorted(self.calls_per_template.items(), key=lambda kv: -kv[1])))
        lines.append(f"  unique kernel instances: {self.unique_kernels} ("
                     + ", ".join(f"{v} {k}" for k, v in sorted(self.build_status.items())) + ")")
        if self.coverage:
            lines += coverage_lines(self.coverage)
        lines.append("  peak activation memory: " + ", ".join(f"{b} {v / 2**20:.1f} MiB"
                                                               for b, v in self.peak_bytes.items()))
        lines.append("  time per stage: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.stage_seconds.items()))
        return "\n".join(lines)


class _Progress:
    def __init__(self, enabled: bool, total: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="compile", unit="stage", leave=False)

    def step(self, what: str):
        if self.bar:
            self.bar.set_postfix_str(what)
            self.bar.update(1)

    def close(self):
        if self.bar:
            self.bar.close()


def run_pipeline(g: Graph, target: str, ep: int = 1, dump_dir: Path | None = None, tag: str = "",
                 timings: dict | None = None, on_stage=None, variant: str = "prefill", dp: int = 1,
                 redundant: int = 0) -> Graph:
    for k, (name, fn) in enumerate(pipeline(target, ep=ep, variant=variant, dp=dp, redundant=redundant)):
        t = time.perf_counter()
        g = fn(g)
        if timings is not None:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t
        if dump_dir is not None:
            replace_file(dump_dir / f"{k:02d}-{name}{tag}.ir", print_graph(g).encode())
        if on_stage:
            on_stage(name)
    return g


def layout_record(layout, graphs: dict[str, Graph]) -> dict:
    """The parallel layout the plan's graphs are one rank of: ranks, attention groups, the
    exchange, and per MoE block its logical experts, its slots and the stacked weights that hold
    this rank's share of them."""
    from .moe import SLOTS_SUFFIX

    blocks = {}
    for g in graphs.values():
        for n in g.nodes:
            if n.op == "ep_dispatch":
                slots = n.inputs[4]
                prefix = slots[: -len(SLOTS_SUFFIX)]
                n_exp = g.types[n.inputs[3]].shape[0] - 1
                weights = sorted({p for p in g.params if p.startswith(prefix + ".experts.")})
                blocks[prefix] = {"experts": n_exp, "slots": g.types[slots].shape[0], "placement": slots,
                                  "weights": weights}
    tables = {n.inputs[1]: {"rows": n.attr["rows"], "rows_per_rank": g.types[n.inputs[1]].shape[0]}
              for g in graphs.values() for n in g.nodes if n.op == "engram_gather_sharded"}
    return dict(layout.record(), moe_blocks=blocks, tables=tables)


def load_time_nodes(g: Graph) -> set[int]:
    """Nodes whose inputs are all params or values derived from params only (weight layout work
    such as w13 = concat(w1, w3)): the plan runs them once at load, not every step."""
    const = set(g.params)
    out = set()
    for i, n in enumerate(g.nodes):
        if n.inputs and all(v in const for v in n.inputs):
            out.add(i)
            const.update(n.outputs)
    return out




def _step_graph_record(g: Graph, load: set[int]) -> dict:
    """What the runtime needs of a graph besides its calls: the step's inputs, the params its calls
    read (load-time outputs such as w13 among them; weights only the load program reads are not
    step params), the state, which value holds each state buffer at the end, and the outputs."""
    read = {v for i, n in enumerate(g.nodes) if i not in load for v in n.inputs} | set(g.outputs)
    derived = [o for i in sorted(load) for o in g.nodes[i].outputs]
    params = [p for p in g.params if p in read] + [d for d in derived if d in read]
    return {"inputs": {v: str(g.types[v]) for v in g.inputs}, "params": params, "state": list(g.state),
            "state_updates": g.state_updates(), "outputs": list(g.outputs)}


class Tuning:
    """Configs for a compile: the tuning database's row for a call where one fits (its rung of
    the lookup ladder recorded with the instance), else the template's default. The compiling
    machine has no device: rows measured elsewhere are borrowed, never exact."""

    def __init__(self, path: str | None, target):
        from ..autotune.db import TuningDB, shipped_db

        # _memo: a call's (config, provenance) by template and spec: a compile asks for the same
        # spec once a layer and bucket, and a `nearest` row renders the call to check that it fits
        self.target, self.db, self._fp, self._memo = target, None, {}, {}
        if path is None:
            shipped = shipped_db(target.name)
            path = str(shipped) if shipped.exists() else ""
        if path and path.lower() != "none":
            if not Path(path).is_file():
                why = "is not a file" if Path(path).exists() else "no such file"  # (a directory was "no such file")
                raise param_error(CompileOptionsError, "tuning_db", f"{path}: {why}")
            self.db = TuningDB.load(path)

    def config(self, t, spec) -> tuple[dict, dict | None]:
        """(config, provenance or None for the default)."""
        if self.db is None:
            return t.default_config(self.target, spec), None
        key = (t.name, spec.key())
        if key not in self._memo:
            self._memo[key] = self._config(t, spec)
        cfg, prov = self._memo[key]
        return dict(cfg), (dict(prov) if prov is not None else None)

    def _config(self, t, spec) -> tuple[dict, dict | None]:
        default = t.default_config(self.target, spec)
        from ..autotune.tuner import fingerprint

        if t.name not in self._fp:
            self._fp[t.name] = fingerprint(self.target, t.name)
        match, _ = self.db.lookup(self._fp[t.name], t.name, spec)
        if match is None:
            return default, None
        cfg = dict(default, **match.row["config"])
        if match.rung == "nearest":  # another row count: only a config that renders and fits
            from ..codegen.targets import get_manifest

            try:
                src = t.render(self.target, spec, cfg)
            except Exception:  # noqa: BLE001
                return default, None
            check = get_manifest(self.target.name).check
            if check and check(src, None):
                return default, None
        from ..autotune.db import provenance

        return cfg, provenance(match, self.db)


def _calls(g: Graph, load: set[int], buckets: dict[str, dict], target, instances: dict,
           tuning: Tuning | None = None) -> list:
    """The plan's call list; every non-view call gets, per bucket, its static shapes and the
    kernel instance that serves it (`instances`: key -> (id, template, spec, config, provenance),
    filled here)."""
    from ..codegen.template import batch_invariant, select, select_common

    invariant = batch_invariant(target)
    calls = []
    producer: dict[str, int] = {}  # value -> index of the call that makes it
    buffer: dict[str, str] = {}  # value -> the value whose memory it is (through in-place writes and views)
    touched: dict[str, list[int]] = {}  # memory (root value) -> the calls so far that read it
    for i, n in enumerate(g.nodes):
        if i in load:
            continue
        kernel = n.attr.get("@kernel")
        # explicit dependencies: the calls whose outputs this one reads (state order is the call
        # order: the verifier keeps each state read before the write that follows it)
        deps = sorted({producer[v] for v in n.inputs if v in producer})
        # a call that writes memory in place comes `after` every earlier reader of that memory,
        # which its inputs do not show (a runtime that runs calls concurrently needs the edge)
        writes = {buffer.get(n.inputs[k], n.inputs[k]) for k in get_op(n.op).inplace.values()}
        after = sorted({j for m in writes for j in touched.get(m, ())} - set(deps))
        call = {"op": n.op, "kernel": kernel, "inputs": list(n.inputs), "outputs": list(n.outputs), "deps": deps,
                "after": after, "attrs": {k: v for k, v in n.attr.items() if not k.startswith("@")}, "launch": {}}
        for v in n.inputs:
            touched.setdefault(buffer.get(v, v), []).append(len(calls))
        for o, k in get_op(n.op).inplace.items():
            buffer[n.outputs[o]] = buffer.get(n.inputs[k], n.inputs[k])
        if kernel == "view":
            buffer.update((o, buffer.get(n.inputs[0], n.inputs[0])) for o in n.outputs)
        producer.update((o, len(calls)) for o in n.outputs)
        common = None
        if invariant and kernel != "view":  # one template for the call at every bucket's shapes
            common = select_common(target, [kernel_spec(g, n, {v: g.types[v].subs(env) for v in (*n.inputs, *n.outputs)})
                                            for env in buckets.values()])
        for bname, env in buckets.items():
            types = {v: g.types[v].subs(env) for v in (*n.inputs, *n.outputs)}
            shapes = {v: [sh.shape_str(p.storage_shape()) for p in ((t.data, t.scale) if hasattr(t, "scale") else (t,))]
                      for v, t in types.items()}
            entry = {"shapes": shapes}
            if kernel != "view":
                spec = kernel_spec(g, n, types)
                # per bucket: decode and prefill shapes may want different templates
                t = common or select(target, spec)
                if t.canonical:
                    spec = t.canonical(target, spec)
                config, tuned = tuning.config(t, spec) if tuning else (t.default_config(target, spec), None)
                key = json.dumps([t.name, spec.key(), config], sort_keys=True, default=str)
                if key not in instances:
                    instances[key] = (f"k{len(instances):05d}", t.name, spec, config, tuned)
                entry["template"] = t.name
                entry["kernel"] = instances[key][0]
            call["launch"][bname] = entry
        calls.append(call)
    return calls


def _kernels(instances: dict, target, jobs: int, files: dict, on_done=None) -> dict:
    """Render (cached) and build every generated instance; their sources, binaries and resource
    reports go into the plan. Torch instances need neither."""
    from ..codegen.instances import kernel_record, render_many
    from ..codegen.build import build_for
    from ..codegen.targets import get_manifest

    gen = [v for v in instances.values() if v[1] not in TORCH_TEMPLATES]
    out = {inst: {"template": t, "spec": spec.key(), "config": cfg, "language": "torch"}
           for inst, t, spec, cfg, _ in instances.values() if t in TORCH_TEMPLATES}
    if not gen:
        return out
    sources = render_many([(t, spec, cfg) for _, t, spec, cfg, _ in gen], target, jobs, on_done)
    results = build_for(get_manifest(target.name), sources, jobs=jobs)
    for (inst, t, spec, cfg, tuned), src, res in zip(gen, sources, results):
        out[inst], inst_files = kernel_record(t, spec, cfg, src, res, f"kernels/{inst}")
        files.update(inst_files)
        if tuned:  # the config came from the tuning database: which row, by which rung of the ladder
            out[inst]["tuning"] = tuned
    return out


def bucket_envs(cfg, options: CompileOptions, split: bool):
    """(max pages, cache pool, buckets, per graph: bucket -> its size symbols) of a compile."""
    max_pages = -(-options.max_model_len // PAGE_TOKENS)
    decode = options.decode_batches or tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= options.max_num_seqs)
    buckets = default_buckets(options.max_num_seqs, decode=decode,
                              prefill=options.prefill_tokens or (512, 2048, 8192), verify=options.verify_batches,
                              rows_per_seq=max_backtrack(cfg))
    pool = options.pool(max_pages)
    # verify steps bring at most max_backtrack rows per sequence: the decode graph's rules hold
    few = ("decode", "verify")
    envs = {"step": {b.name: b.env(max_pages) | pool for b in buckets if not (split and b.kind in few)},
            "step_decode": {b.name: b.env(max_pages) | pool for b in buckets if b.kind in few},
            "draft": {f"draft_b{b}": {"num_seqs": b, "max_pages": max_pages} | pool for b in decode}}
    return max_pages, pool, buckets, envs


def compile_target(options: CompileOptions):
    """The Target a compile renders for: the named one, marked batch-invariant where asked (a
    feature the templates' default configs read, and part of every render and cache key)."""
    import dataclasses

    from ..codegen.targets import get_target
    from ..codegen.template import BATCH_INVARIANT

    target = get_target(options.target)
    if options.batch_invariant:
        target = dataclasses.replace(target, features=tuple(target.features) + (BATCH_INVARIANT,))
    return target


def compile_tuning(options: CompileOptions, target) -> "Tuning":
    # tuned rows pick configs per bucket: a batch-invariant plan takes the template defaults only
    return Tuning("none" if options.batch_invariant else options.tuning_db, target)


def select_calls(model: str, options: CompileOptions) -> tuple[dict, dict]:
    """(per graph: the plan's call list, every kernel instance: key -> (id, template, spec,
    config, tuning)) of a compile, with nothing rendered or built."""
    cfg, _, graphs, split = _pipeline_graphs(model, options)
    _, _, _, envs = bucket_envs(cfg, options, split)
    target, instances = compile_target(options), {}
    tuning = compile_tuning(options, target)
    calls = {name: _calls(g, load_time_nodes(g), envs[name], target, instances, tuning)
             for name, g in graphs.items() if envs[name]}
    return calls, instances


def select_instances(model: str, options: CompileOptions) -> dict:
    """Every kernel instance a compile would make (see select_calls): what the coverage report
    of a target reads."""
    return select_calls(model, options)[1]


def _pipeline_graphs(model: str, options: CompileOptions):
    """(config, program, {graph: its pipeline's output}, whether decode has its own graph): the
    graphs a compile would plan, without its dumps and timings."""
    cfg = load_config(model)
    options.check_model(cfg)
    program = build_model(cfg)
    lay = {"dp": options.dp, "redundant": options.redundant_experts}
    split = decode_pipeline_differs(options.target)
    graphs = {"step": run_pipeline(program.step, options.target, options.ep, **lay)}
    if split:
        graphs["step_decode"] = run_pipeline(program.step, options.target, options.ep, variant="decode", **lay)
    if program.draft.nodes:
        graphs["draft"] = run_pipeline(program.draft, options.target, options.ep, **lay)
    return cfg, program, graphs, split


def rank_memory(graphs: dict[str, Graph], state: dict, envs: dict, pool: dict) -> dict:
    """Device bytes one rank of a plan needs: the weights its steps read (after the load program:
    w13, not w1 and w3), the cache pool's state buffers, and the largest activation arena of its
    buckets. Planned from the graphs alone: no kernel is built for it."""
    from .memory import _bytes

    weights, peaks = {}, {}
    for name, g in graphs.items():
        if not envs.get(name):
            continue
        load = load_time_nodes(g)
        for p in _step_graph_record(g, load)["params"]:
            weights[p] = _bytes(g.types[p], {})
        resident = {o for i in load for o in g.nodes[i].outputs}
        for b, env in envs[name].items():
            peaks[f"{name}/{b}"] = plan_memory(g, env, resident)["peak_bytes"]
    state_bytes = sum(_bytes(t, pool) for t in state.values())
    top = max(peaks, key=peaks.get)
    total = sum(weights.values()) + state_bytes + peaks[top]
    return {"weights_bytes": sum(weights.values()), "state_bytes": state_bytes, "activation_peak_bytes": peaks[top],
            "activation_peak_bucket": top, "total_bytes": total}


def plan_rank_memory(model: str, options: CompileOptions) -> dict:
    """rank_memory of the plan `compile_model` would write for these options, without building
    its kernels (the passes, buckets and memory plan only)."""
    cfg, program, graphs, split = _pipeline_graphs(model, options)
    _, pool, _, envs = bucket_envs(cfg, options, split)
    return dict(rank_memory(graphs, program.state, envs, pool), layout=options.layout.record(), pool=pool)


def compile_model(model: str, options: CompileOptions, out_dir, progress: bool = False) -> CompileReport:
    from ..codegen.plan import PlanError, check_plan_target, versions, write_plan

    target = compile_target(options)
    out = check_plan_target(out_dir)  # before minutes of compiling, not after
    if options.dump_ir and Path(options.dump_ir).resolve().is_relative_to(out.resolve()):
        raise PlanError(f"--dump-ir {options.dump_ir}: lies inside the plan directory {out_dir}, which the plan "
                        "replaces whole; give a directory outside it")
    timings: dict[str, float] = {}
    bar = _Progress(progress, total=2 + 2 * len(pipeline(options.target, ep=options.ep, dp=options.dp)) + 2)
    t = time.perf_counter()
    cfg = load_config(model)
    options.check_model(cfg)
    program = build_model(cfg)
    timings["build"] = time.perf_counter() - t
    bar.step("build")
    dump = Path(options.dump_ir) if options.dump_ir else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        replace_file(dump / "00-input.ir", print_graph(program.step).encode())
    lay = {"dp": options.dp, "redundant": options.redundant_experts}
    graphs = {"step": run_pipeline(program.step, options.target, options.ep, dump, "", timings, bar.step, **lay)}
    split = decode_pipeline_differs(options.target)
    if split:  # decode buckets get their own graph (rules valid only with few rows per sequence)
        graphs["step_decode"] = run_pipeline(program.step, options.target, options.ep, dump, ".decode", timings,
                                             variant="decode", **lay)
    if program.draft.nodes:
        graphs["draft"] = run_pipeline(program.draft, options.target, options.ep, dump, ".draft", timings, bar.step,
                                       **lay)

    t = time.perf_counter()
    max_pages, pool, buckets, envs = bucket_envs(cfg, options, split)
    files: dict[str, bytes] = {}
    instances: dict[str, tuple] = {}
    tuning = compile_tuning(options, target)
    plan_graphs, memory, load_program = {}, {}, []
    seen_load = set()
    for name, g in graphs.items():
        if not envs[name]:
            continue
        load = load_time_nodes(g)
        for i in sorted(load):
            n = g.nodes[i]
            if n.outputs[0] not in seen_load:
                seen_load.update(n.outputs)
                load_program.append({"op": n.op, "inputs": list(n.inputs), "outputs": list(n.outputs),
                                     "attrs": {k: v for k, v in n.attr.items() if not k.startswith("@")},
                                     "types": [str(g.types[o]) for o in n.outputs]})
        files[f"ir/{name}.ir"] = print_graph(g).encode()
        plan_graphs[name] = dict(_step_graph_record(g, load), ir=f"ir/{name}.ir",
                                 calls=_calls(g, load, envs[name], target, instances, tuning))
        resident = {o for i in load for o in g.nodes[i].outputs}
        memory[name] = {b: plan_memory(g, env, resident) for b, env in envs[name].items()}
    timings["specialize"] = time.perf_counter() - t
    t = time.perf_counter()
    kernels = _kernels(instances, target, options.jobs, files)
    timings["render+build"] = time.perf_counter() - t
    bar.step("kernels")
    from ..codegen.host_recipe import host_recipes

    t = time.perf_counter()
    recipes: dict[str, dict] = {}
    for name, g in graphs.items():
        if name in plan_graphs:
            host_recipes(g, plan_graphs[name]["calls"], envs[name], kernels, recipes)
    timings["host recipes"] = time.perf_counter() - t

    params = {}
    sources = param_sources(program)
    for name, g in graphs.items():
        if name not in plan_graphs:
            continue
        for p in g.params:
            # a MoE block's expert placement is no checkpoint tensor: the runtime sets it (EPLB moves it)
            params[p] = {"type": str(g.types[p]), "sources": sources.get(p, [])}
    calls_per_template = Counter(c["kernel"] for pg in plan_graphs.values() for c in pg["calls"])
    per_rank = rank_memory({n: g for n, g in graphs.items() if n in plan_graphs}, program.state, envs, pool)
    plan = {
        # the config.json as read, so loading rebuilds exactly this config (vision flag included)
        "model": {"id": cfg.model_id, "config_hash": cfg.config_hash,
                  "config": json.loads(Path(cfg.source).read_text()) if cfg.source else cfg.canonical_dict()},
        "target": target.key(),
        "versions": versions(),
        "options": {"max_model_len": options.max_model_len, "max_num_seqs": options.max_num_seqs, "ep": options.ep,
                    "batch_invariant": options.batch_invariant,
                    "dp": options.dp,
                    "page_tokens": PAGE_TOKENS, "max_pages": max_pages,
                    # the decode graph serves steps with at most this many rows per sequence
                    "decode_rows_max": max_backtrack(cfg),
                    # drafts a verify bucket's sequence may carry (0: the plan has no verify bucket)
                    "verify_drafts": max_backtrack(cfg) - 1 if options.verify_batches else 0} | pool,
        "layout": layout_record(options.layout, graphs) | {"rank_memory": per_rank},
        "buckets": {name: envs[name] for name in plan_graphs},
        "bucket_kinds": {b.name: b.kind for b in buckets},
        "state": {k: str(v) for k, v in program.state.items()},
        "params": params,
        "load_program": load_program,
        "graphs": plan_graphs,
        "memory": memory,
        "kernels": kernels,
        "recipes": recipes,
    }
    plan["coverage"] = plan_coverage(plan)
    t = time.perf_counter()
    out = write_plan(plan, files, out_dir)
    timings["write"] = time.perf_counter() - t
    bar.step("write")
    bar.close()
    status = Counter(k.get("build", {}).get("status", "torch") for k in kernels.values())
    return CompileReport(out, timings, dict(calls_per_template), len(instances),
                         {b: m["peak_bytes"] for name in ("step_decode", "step") for b, m in memory.get(name, {}).items()},
                         dict(status), plan["coverage"])
