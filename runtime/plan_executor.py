"""Runs a compiled plan: the `Executor` the engine drives, built from a plan directory and a
checkpoint. On the cpu target every kernel call runs its op's torch reference.

`LoadedPlan` is the part every target shares: the plan checked and read, the weights materialised
in the plan's layouts (its load program run once), and the per-step graphs. All of it comes from
plan.json (and the kernel files it names): the runtime reads no IR and no compiler code."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..ir import parse_type
from ..ir.registry import get_op
from ..models.checkpoint import checkpoint_config, load_checkpoint
from ..models.config import config_from_dict
from ..models.deepseek_v41 import materialize_params
from .batch import DraftSeq, SeqChunk, bucket_inputs, draft_inputs, step_inputs
from .plan_file import PlanError, load_plan
from .plan_runner import PlanGraph, PlanRunner
from .state import SlotStateOps, allocate_state, paged_buffers, slot_buffers


class LoadedPlan:
    """A plan and its weights. `checkpoint` may be given instead of `weights`: any mapping of
    checkpoint tensor names to tensors (e.g. weights generated on the device), checked against the
    plan's model by `config_hash`."""

    def __init__(self, plan_dir, weights=None, *, checkpoint=None, config_hash: str | None = None, shard=None):
        """`shard`: this process's rank of a multi-rank plan (runtime/distributed.RankShard): which
        checkpoint tensors its expert weights are made of, and its expert placements."""
        self.root = root = Path(plan_dir)
        self.plan = plan = load_plan(root)
        check_world(plan, root, shard.world if shard is not None else 1)
        self.target = plan["target"]["name"]
        self.cfg = cfg = config_from_dict(plan["model"]["config"], model_id=plan["model"]["id"])
        given = "given"
        if checkpoint is None:
            wcfg = checkpoint_config(weights)  # (a bad path is a checkpoint error, not an unknown model)
            config_hash, given = wcfg.config_hash, wcfg.model_id
        if config_hash != plan["model"]["config_hash"]:
            raise PlanError(f"weights {weights or ''} are for model {given} (config {str(config_hash)[:12]}), the plan "
                            f"for {plan['model']['id']} (config {plan['model']['config_hash'][:12]})")
        if checkpoint is None:
            checkpoint = load_checkpoint(weights, cfg)
        try:
            self.graphs = {name: PlanGraph(name, g) for name, g in plan["graphs"].items()}
        except KeyError as e:
            raise PlanError(f"plan {root}: a graph record lacks {e}") from None
        self.page_tokens = plan["options"]["page_tokens"]
        needed = {p for g in self.graphs.values() for p in g.params}
        self.checkpoint, self.needed = checkpoint, needed
        sources = {k: v["sources"] for k, v in plan["params"].items()}
        extra = {}
        if shard is not None:  # this rank's expert slots only: no rank reads the whole model
            sources, extra = shard.sources(plan, sources), shard.local_params(plan, checkpoint)
        self.params = materialize_params(sources, checkpoint) | extra
        self.run_load_program(self.params)
        self.state_types = {k: parse_type(v) for k, v in plan["state"].items()}
        self.slot_buffers = slot_buffers(self.state_types)
        self.paged_buffers = paged_buffers(self.state_types)

    def run_load_program(self, params: dict, only: set[str] | None = None) -> None:
        """The weight layouts the kernels want (e.g. w13 = [w1; w3]), made from `params` in place;
        `only`: just the calls that read these params (weights re-read after a re-placement)."""
        program = self.plan["load_program"]
        for i, call in enumerate(program):
            if only is not None and not only.intersection(call["inputs"]):
                continue
            outs = get_op(call["op"]).ref(*(params[v] for v in call["inputs"]), **call["attrs"])
            outs = outs if isinstance(outs, tuple) and len(call["outputs"]) > 1 else (outs,)
            params.update(zip(call["outputs"], outs))
            # sources no later call and no step reads are dropped at once: the peak stays one layer's copy
            later = {v for c in program[i + 1:] for v in c["inputs"]}
            for v in call["inputs"]:
                if v not in self.needed and v not in later:
                    params.pop(v, None)

def check_world(plan: dict, root, world: int) -> None:
    """A plan is one rank of its layout: it runs in exactly as many processes."""
    layout = plan.get("layout", {})
    want = layout.get("world_size", 1)
    if want != world:
        how = f"torchrun --nproc-per-node {want}" if want > 1 else "one process"
        raise PlanError(f"plan {root} is laid out for {want} rank{'s' * (want > 1)} (ep {layout.get('ep', 1)}, dp "
                        f"{layout.get('dp', 1)}); this run has {world} process{'es' * (world > 1)}: launch it with "
                        f"{how}")


class PlanExecutor(SlotStateOps):
    def __init__(self, plan_dir, weights=None, num_slots: int | None = None, num_pages: int | None = None,
                 pad_to_buckets: bool = False, *, checkpoint=None, config_hash: str | None = None, shard=None,
                 call_fn=None):
        """`pad_to_buckets` runs every step at its bucket's shape, padded as a device executor pads
        it (tests use it to check the padding never changes a real row). `checkpoint` and
        `config_hash` instead of `weights`: as LoadedPlan takes them. `shard` and `call_fn` (the
        calls' implementations; default their references): one rank of a multi-rank plan."""
        root = Path(plan_dir)
        target = load_plan(root)["target"]["name"]
        if target != "cpu":
            raise PlanError(f"plan {root}: compiled for {target}; this executor runs cpu plans "
                            "(runtime.cuda_executor runs sm90 / sm100 plans on their GPU)")
        self.loaded = lp = LoadedPlan(root, weights, checkpoint=checkpoint, config_hash=config_hash, shard=shard)
        self.plan, self.cfg, self.graphs = lp.plan, lp.cfg, lp.graphs
        from ..ir.ops.quantized import preload_dequantized

        self.params = lp.params
        preload_dequantized(self.params)  # the cpu legalisation: weights dequantised once, at load
        # the cache pool the plan was built for; torch kernels (cpu) take any size, so tests may shrink it
        num_slots = num_slots or self.plan["options"]["num_slots"]
        num_pages = num_pages or self.plan["options"]["num_pages"]
        if num_slots < 1 or num_pages < 1:
            raise ValueError(f"an executor needs >= 1 slot and >= 1 page, got {num_slots} slots, {num_pages} pages")
        self.pad = pad_to_buckets
        if pad_to_buckets:  # the last slot and page take the padding rows' writes
            num_slots, num_pages = num_slots + 1, num_pages + 1
        self.state = allocate_state(lp.state_types, num_slots=num_slots, num_pages=num_pages)
        self.slot_names, self.page_names = lp.slot_buffers, lp.paged_buffers
        self.num_slots, self.num_pages = num_slots - self.pad, num_pages - self.pad
        # padded steps run the plan's call lists the way a device executor does, with references
        self.runner = PlanRunner(lp, self.params, self.state, call_fn or reference_call, torch.device("cpu"))
        self.vocab_size = self.cfg.vocab_size
        self.page_tokens = lp.page_tokens
        self.state_types = lp.state_types
        # at its own shapes a step takes verify chunks; padded, it needs the plan's verify buckets
        drafts = self.plan["options"].get("verify_drafts", 0) if self.pad else self.cfg.dspark_block_size
        self.max_draft_len = drafts if "draft" in self.graphs else 0
        self.max_verify_seqs = verify_seqs(self.plan) if self.pad else None
        self.verify_shapes = verify_shapes(self.plan) if self.pad else None

    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        for c in chunks:
            if not 0 <= c.slot < self.num_slots:
                raise ValueError(f"slot {c.slot} is outside [0, {self.num_slots})")
        name = "step"
        if "step_decode" in self.graphs and max(len(c.tokens) for c in chunks) <= self.plan["options"]["decode_rows_max"]:
            name = "step_decode"
        if not self.pad:  # references take any shape: the step runs at its own
            return self.runner.run(name, None, step_inputs(chunks))["logits"]
        name, bucket = choose_bucket(self.plan, chunks)
        inputs, n = bucket_inputs(chunks, self.plan["buckets"][name][bucket], self.num_slots, self.num_pages,
                                  self.cfg.pad_token_id)
        return self.run_bucket(name, bucket, inputs)["logits"][:n]

    def run_bucket(self, graph: str, bucket: str, inputs: dict) -> dict:
        """One step at a bucket's shape from its (padded) inputs."""
        return self.runner.run(graph, bucket, inputs)

    def draft(self, seqs: list[DraftSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        if "draft" not in self.graphs:
            raise ValueError(f"model {self.cfg.model_id} has no DSpark draft head")
        if self.pad:
            bucket, inputs = draft_bucket_inputs(self.plan, self.cfg, seqs, self.num_slots)
            outs = self.runner.run("draft", bucket, inputs)
            return outs["drafts"][:len(seqs)], outs["confidence"][:len(seqs)]
        inputs = draft_inputs(seqs, self.cfg.dspark_block_size, self.cfg.dspark_noise_token_id)
        outs = self.runner.run("draft", None, inputs)
        return outs["drafts"], outs["confidence"]


def step_shapes(plan: dict, kinds=("decode", "verify")) -> list[tuple[str, str, int, int]]:
    """(graph, bucket, sequences, rows) of the plan's buckets of these kinds, sequences as the
    engine may fill them (a verify bucket's spare padding sequence aside)."""
    names = plan["bucket_kinds"]
    return [(g, b, e["num_seqs"] - (names[b] == "verify"), e["num_tokens"])
            for g, envs in plan["buckets"].items() for b, e in envs.items() if names.get(b) in kinds]


def verify_shapes(plan: dict) -> list[tuple[int, int]]:
    """(sequences, rows) of each verify bucket, smallest first."""
    return sorted((s, rows) for _, _, s, rows in step_shapes(plan, ("verify",)))


def verify_seqs(plan: dict) -> int:
    """The most sequences a verify bucket of the plan holds."""
    return max((s for s, _ in verify_shapes(plan)), default=0)


def time_step_buckets(ex, max_seqs: int | None = None, reps: int = 5, sync=None, skip=(), context: int = 1024,
                      seed: int = 0) -> list[tuple[str, int, int, float]]:
    """The step-time curve of a padded executor (`plan`, `run_bucket`, scratch slot and page =
    its num_slots and num_pages): (bucket, sequences, rows, seconds) of each decode and verify
    bucket a step of at most `max_seqs` sequences runs in (all where None), each the median of
    `reps` runs after one that warms it up (a CUDA graph's capture); `sync` waits for the device.
    The timed step fills the bucket with random tokens (a routed MoE costs what its spread of
    experts costs, which one repeated padding token would not show) at positions from `context`
    on, every row in the scratch slot and page: no real sequence's state is touched."""
    shapes = [x for x in step_shapes(ex.plan) if x[1] not in skip]
    if max_seqs is not None:  # the buckets up to the smallest that holds max_seqs sequences
        enough = min((s for *_, s, _ in step_shapes(ex.plan) if s >= max_seqs), default=None)
        shapes = [x for x in shapes if enough is None or x[2] <= enough]
    gen = torch.Generator().manual_seed(seed)
    cfg = ex.cfg
    start = max(0, min(context, ex.plan["options"]["max_model_len"] - ex.plan["options"]["decode_rows_max"]))
    pages = [ex.num_pages] * -(-(start + ex.plan["options"]["decode_rows_max"]) // ex.page_tokens)
    curve = []
    for graph, bucket, seqs, rows in shapes:
        env = ex.plan["buckets"][graph][bucket]
        per = [rows // seqs + (i < rows % seqs) for i in range(seqs)]
        chunks = [SeqChunk(ex.num_slots, start, torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist(),
                           pages, logit_rows=n) for n in per]
        inputs, _ = bucket_inputs(chunks, env, ex.num_slots, ex.num_pages, cfg.pad_token_id)
        times = []
        for i in range(reps + 1):
            if sync:
                sync()
            t = time.perf_counter()
            ex.run_bucket(graph, bucket, inputs)
            if sync:
                sync()
            if i:
                times.append(time.perf_counter() - t)
        times.sort()
        curve.append((bucket, seqs, rows, times[len(times) // 2]))
    return curve


def draft_bucket_inputs(plan: dict, cfg, seqs: list[DraftSeq], scratch_slot: int) -> tuple[str, dict]:
    """The smallest draft bucket holding `seqs`, and its inputs: dummy sequences (one row each, in
    the scratch slot) fill it; their drafts are dropped."""
    b = len(seqs)
    fits = sorted((e["num_seqs"], name) for name, e in plan["buckets"]["draft"].items() if e["num_seqs"] >= b)
    if not fits:
        raise ValueError(f"{b} draft sequences exceed the plan's draft buckets")
    size, bucket = fits[0]
    pad = [DraftSeq(scratch_slot, cfg.pad_token_id, 1)] * (size - b)
    return bucket, draft_inputs(list(seqs) + pad, cfg.dspark_block_size, cfg.dspark_noise_token_id)


def reference_call(call: dict, bucket: str):
    """A call run by its op's torch reference (any bucket)."""
    op = get_op(call["op"])
    attrs = op.check_attrs(call["attrs"])
    return lambda *xs: op.ref(*xs, **attrs)


def choose_bucket(plan: dict, chunks: list[SeqChunk]) -> tuple[str, str]:
    """(graph, bucket) a step runs at: a decode bucket when every sequence brings one row, else a
    verify bucket when every sequence brings at most its rows (a speculative step: logits for the
    verified rows), else the smallest prefill bucket that holds its rows and sequences (one spare
    sequence for padding). Each must hold the step's sampled rows and its padding's."""
    rows, seqs = sum(len(c.tokens) for c in chunks), len(chunks)
    sampled = sum(c.logit_rows for c in chunks if c.sample)
    kinds = plan["bucket_kinds"]
    few = "step_decode" if "step_decode" in plan["buckets"] else "step"  # where decode and verify buckets live
    if rows == seqs:
        fits = [(e["num_tokens"], b) for b, e in plan["buckets"][few].items()
                if kinds.get(b) == "decode" and e["num_seqs"] >= seqs]
        if fits:
            return few, min(fits)[1]
    if max(len(c.tokens) for c in chunks) <= plan["options"]["decode_rows_max"]:
        fits = [(e["num_tokens"], b) for b, e in plan["buckets"][few].items()
                if kinds.get(b) == "verify" and _holds(e, rows, seqs, sampled)]
        if fits:
            return few, min(fits)[1]
    fits = [(e["num_tokens"], b) for b, e in plan["buckets"]["step"].items()
            if kinds.get(b, "prefill") == "prefill" and _holds(e, rows, seqs, sampled)]
    if not fits:
        raise ValueError(f"a step of {rows} rows over {seqs} sequences fits no bucket of the plan "
                         f"({', '.join(plan['buckets']['step'])}); schedule smaller steps")
    return "step", min(fits)[1]


def _holds(env: dict, rows: int, seqs: int, sampled: int) -> bool:
    """A padded bucket holds the step: its rows, its sequences with a spare one for the padding
    rows (unless the step fills the bucket exactly), and the sampled rows plus one per dummy
    that gets padding rows (bucket_inputs samples each such dummy's last row)."""
    exact = env["num_seqs"] == seqs and env["num_tokens"] == rows
    dummies = min(env["num_seqs"] - seqs, env["num_tokens"] - rows)
    return (env["num_tokens"] >= rows and (env["num_seqs"] > seqs or exact)
            and sampled + dummies <= env["num_samples"])
