"""Runs an sm90 / sm100 plan on its GPU: every generated call of a step replays its host recipe
for the step's bucket (runtime/host_recipe.py: the allocations, padding and views its template's
host code made at compile time, and the launches of the plan's cubins), calls the plan left to
torch run their op's reference on the device, and views are views. Everything comes from the
plan: this module imports nothing of the compiler.

Steps run at a bucket's static shape (`runtime.batch.bucket_inputs`): the last state slot and the
last page of the plan's pool are the scratch the padding writes into, so the engine sees one
slot and one page fewer. Decode buckets are captured as CUDA graphs on first use (inputs copied
into static buffers, state kept in fixed buffers); a bucket whose calls cannot be captured (a
torch reference that synchronises with the host) runs eagerly, and `graph_status` says why.
`warm_up` captures the decode and verify buckets up front and times each (the step-time curve
the engine chooses its verify budget from, spec §5.6).

Data flow of one step: chunks -> choose_bucket -> bucket_inputs (host) -> device copies ->
[graph replay | call list] -> logits[:n] -> host.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ..ir.quant import QTensor
from .batch import DraftSeq, SeqChunk, bucket_inputs
from .cuda_driver import CubinFunction, c_arg, pdl_launches
from .host_recipe import HostRecipe
from .plan_executor import (LoadedPlan, choose_bucket, draft_bucket_inputs, reference_call, time_step_buckets,
                            verify_seqs, verify_shapes)
from .plan_file import PlanError
from .plan_runner import PlanRunner
from .speculative import plan_step_curve
from .state import SlotStateOps, allocate_state
from .triton_aot import TritonKernels

TORCH_TEMPLATES = ("torch_ref", "torch_device")
CAPABILITY = {"sm90": (9, 0), "sm100": (10, 0)}


def to_device(v, device):
    if isinstance(v, QTensor):
        return QTensor(v.data.to(device, non_blocking=True), v.scale.to(device, non_blocking=True))
    return v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v


def lanes_from_env() -> int:
    raw = os.environ.get("DEEPINFER_LANES", "2")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"DEEPINFER_LANES must be a whole number of streams >= 1, got {raw!r}")
    return int(raw)


# sampled rows from which an argmax step reduces on the device: a 64-row step's logits are 33 MB
# over PCIe, its ids 512 bytes; at a few rows the logits' copy costs less than the reduction
# kernel after the graph (docs/performance.md, twenty-sixth session). With feed_steps (the
# default) every argmax step reduces on the device: a later step may be fed from its ids.
ARGMAX_DEVICE_ROWS = 8


class _Pending:
    """A submitted step: its logits on their way into pinned host memory, queued on the step's
    stream behind the step (and ahead of the next step, which rewrites a graph's output buffer).
    `argmax`: `result()` is each row's argmax id (int64; torch.argmax's first maximum on the
    device or the host alike, so a greedy token is the same either way), reduced on the device
    from ARGMAX_DEVICE_ROWS rows, so only the ids cross PCIe."""

    def __init__(self, logits: torch.Tensor, argmax: bool = False, keep_ids: bool = False):
        self.argmax, on_device = argmax, argmax and (keep_ids or logits.shape[0] >= ARGMAX_DEVICE_ROWS)
        # keep_ids: the ids stay on the device too, for a later step to be fed from (`submit`'s feed)
        self.ids = torch.argmax(logits, dim=-1) if on_device else None
        src = self.ids if on_device else logits
        self.host = torch.empty(src.shape, dtype=torch.int64 if on_device else torch.float32, pin_memory=True)
        self.host.copy_(src, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def result(self) -> torch.Tensor:
        self.done.synchronize()
        return host_argmax(self.host) if self.argmax and self.host.dim() == 2 else self.host


class InputStaging:
    """A captured graph's static inputs as views of one device buffer, loaded from a step's host
    tensors by one copy from pinned memory, where a copy each from pageable memory waits for the
    host to stage it. Two pinned buffers alternate; each is rewritten only once its last copy has
    run (a step submitted early queues its copy behind the step still running)."""

    ALIGN = 256

    def __init__(self, inputs: dict[str, torch.Tensor], device):
        self.layout, off = {}, 0
        for k, v in inputs.items():
            n = v.numel() * v.element_size()
            self.layout[k] = (off, n, v.dtype, tuple(v.shape))
            off += -(-n // self.ALIGN) * self.ALIGN
        self.flat = torch.zeros(max(off, self.ALIGN), dtype=torch.uint8, device=device)
        self.views = {k: self.flat[o:o + n].view(dt).view(shape) for k, (o, n, dt, shape) in self.layout.items()}
        for k, v in inputs.items():
            self.views[k].copy_(v)
        pin = self.flat.is_cuda
        self.host = [torch.zeros_like(self.flat, device="cpu", pin_memory=pin) for _ in range(2)]
        self.copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.turn = 0

    def load(self, inputs: dict[str, torch.Tensor]) -> bool:
        """The views take `inputs` (host tensors of the views' names, dtypes and shapes: False,
        and nothing copied, otherwise)."""
        if inputs.keys() != self.layout.keys() or any(
                v.device.type != "cpu" or v.dtype != self.layout[k][2] or tuple(v.shape) != self.layout[k][3]
                for k, v in inputs.items()):
            return False
        i, self.turn = self.turn, 1 - self.turn
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        buf = self.host[i]
        for k, v in inputs.items():
            o, n, _, _ = self.layout[k]
            buf[o:o + n].copy_(v.contiguous().view(-1).view(torch.uint8))
        self.flat.copy_(buf, non_blocking=True)
        if self.copied[i] is not None:
            self.copied[i].record()
        return True


def host_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax id (int64) of host logits: numpy's, the first maximum as torch.argmax
    takes it, on one thread, where torch's CPU reduction of a vocabulary-wide row spends most of
    its time starting its thread pool (docs/performance.md, twenty-sixth session)."""
    return torch.from_numpy(logits.numpy().argmax(-1))


class _TileLangKernels:
    """A TileLang instance's cubins: the main kernel, and the combine of a split attention."""

    def __init__(self, root: Path, k: dict, device: int):
        files, pdl = k["build"]["files"], bool(k["build"].get("pdl"))
        self.kernels = [CubinFunction((root / files["cubin"]).read_bytes(), k["entry"], k["grid"], k["block"],
                                      k["smem_bytes"], device, pdl)]
        if "combine" in k["meta"]:
            c = k["meta"]["combine"]
            self.kernels.append(CubinFunction((root / files["cubin_combine"]).read_bytes(), c["entry"], c["grid"],
                                              c["block"], c["smem_bytes"], device, pdl))

    def launch(self, i: int, grid, args: list) -> None:
        self.kernels[i].launch(args, grid=grid)


def load_instance(root: Path, inst: str, k: dict, device: int):
    """The binaries of one kernel instance record (a plan's, or a tuning candidate's: the same
    record, autotune/candidates.py), files relative to `root`, loaded through the driver; its
    `launch(i, grid, args)` is what a host recipe calls."""
    if k["build"]["status"] != "built":
        raise PlanError(f"instance {inst} ({k['template']}) was not built: {k['build']['reason']}")
    files = k["build"]["files"]
    if k["language"] == "cuda":
        return _TileLangKernels(root, k, device)
    launches = json.loads((root / files["launches"]).read_text())
    cubins = [(root / files[f"cubin{i}"]).read_bytes() for i in range(len(launches))]
    return TritonKernels(inst, launches, cubins, device, bool(k["build"].get("pdl")))


class CudaPlanExecutor(SlotStateOps):
    def __init__(self, plan_dir, weights=None, *, checkpoint=None, config_hash=None, device: int = 0,
                 cuda_graphs: bool = True):
        if not torch.cuda.is_available():
            raise PlanError("this plan runs on a CUDA GPU and none is visible")
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        t0 = time.perf_counter()
        lp = LoadedPlan(plan_dir, weights, checkpoint=checkpoint, config_hash=config_hash)
        self.loaded, self.plan, self.cfg, self.root = lp, lp.plan, lp.cfg, lp.root
        if lp.target not in CAPABILITY:
            raise PlanError(f"plan {plan_dir}: compiled for {lp.target}; this executor runs sm90 / sm100 plans")
        cap = torch.cuda.get_device_capability(self.device)
        if cap != CAPABILITY[lp.target]:
            raise PlanError(f"plan {plan_dir}: compiled for {lp.target}, the GPU is sm_{cap[0]}{cap[1]}")
        # submit(feed=...): a step's tokens from an earlier step's ids on the device, so that the
        # engine submits a step after an all-greedy one before its ids reach the host (the device
        # idled 28% of a b1 step through LLM.generate without it on the H200, 2% with it:
        # docs/performance.md, twenty-seventh session). DEEPINFER_EARLY_SUBMIT=0 turns it off.
        self.feed_steps = os.environ.get("DEEPINFER_EARLY_SUBMIT", "1") != "0"
        # a graph step's host inputs in one copy from pinned memory (InputStaging);
        # DEEPINFER_STAGED_INPUTS=0: one copy an input from pageable memory, as before
        self.staged_inputs = os.environ.get("DEEPINFER_STAGED_INPUTS", "1") != "0"
        self.params = {k: to_device(v, self.device) for k, v in lp.params.items()}
        lp.params = None
        opts = self.plan["options"]
        pool_slots, pool_pages = opts["num_slots"], opts["num_pages"]
        state = allocate_state(lp.state_types, num_slots=pool_slots, num_pages=pool_pages)
        self.state = {k: to_device(v, self.device) for k, v in state.items()}
        # slot states a prefix cache saves stay on the device with the state
        self.slot_names, self.page_names = lp.slot_buffers, lp.paged_buffers
        self.num_slots, self.num_pages = pool_slots - 1, pool_pages - 1  # the last of each is the padding's scratch
        self.vocab_size = self.cfg.vocab_size
        self.page_tokens = lp.page_tokens
        # verify chunks [t*, d_0 .. d_{m-1}] run in the plan's verify buckets; without them (the
        # compile's --verify-batches) the engine does not speculate on this plan
        self.max_draft_len = self.plan["options"].get("verify_drafts", 0) if "draft" in lp.graphs else 0
        self.max_verify_seqs = verify_seqs(self.plan)
        self.verify_shapes = verify_shapes(self.plan)
        # (bucket, sequences, rows, seconds) per decode / verify bucket: the plan's own where the
        # tuner measured it on a GPU of this name, and what warm_up measures of the rest
        self.step_time_curve: list[tuple[str, int, int, float]] = plan_step_curve(
            self.plan, torch.cuda.get_device_name(self.device))
        self._kernels: dict[str, object] = {}
        self._recipes: dict[str, HostRecipe] = {}
        self.cuda_graphs = cuda_graphs
        # streams a decode, verify or draft step's calls are spread over (DEEPINFER_LANES; 2 beat
        # 1 at every decode bucket of the medium plan on the H200 and 3 did not beat 2 overall,
        # docs/performance.md, fifteenth session)
        self.lanes = lanes_from_env()
        # DEEPINFER_SYNC_CALLS=1: wait for every call, so a failing kernel is named (debugging only)
        sync = os.environ.get("DEEPINFER_SYNC_CALLS") == "1"
        self.runner = PlanRunner(lp, self.params, self.state, self._call_fn, self.device,
                                 after_call=self._sync if sync else None)
        self._graphs: dict[tuple[str, str], tuple] = {}
        self.graph_status: dict[str, str] = {}  # bucket -> "captured" or why not
        self.load_seconds = time.perf_counter() - t0

    # ---- kernels ----

    def _kernel(self, inst: str):
        if inst not in self._kernels:
            self._kernels[inst] = load_instance(self.root, inst, self.plan["kernels"][inst], self.device.index)
        return self._kernels[inst]

    def _call_fn(self, call: dict, bucket: str):
        """The function one call runs in one bucket: (inputs) -> the op's outputs."""
        launch = call["launch"][bucket]
        inst = launch.get("kernel")
        if inst is None or launch.get("template") in TORCH_TEMPLATES:
            return reference_call(call, bucket)
        rid = launch.get("recipe")
        if rid is None:
            raise PlanError(f"call {call['op']} ({call['outputs'][0]}) in {bucket} has no host recipe")
        if (rid, inst) not in self._recipes:
            self._recipes[rid, inst] = HostRecipe(self.plan["recipes"][rid], self._kernel(inst).launch, self.device,
                                                  f"{call['op']} ({call['outputs'][0]}) in {bucket}", c_arg)
        return self._recipes[rid, inst]

    def _sync(self, graph: str, bucket: str, i: int) -> None:
        try:
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            c = self.loaded.graphs[graph].calls[i]
            raise PlanError(f"{c['op']} ({c['outputs'][0]}) in {bucket} failed on the GPU: "
                            f"{str(e).splitlines()[0]}") from e

    # ---- Executor ----

    # submit(argmax=True) returns the sampled rows' argmax ids in place of their logits (the engine's
    # greedy steps: runtime/engine.LLMEngine._argmax_only)
    argmax_steps = True

    def step(self, chunks: list[SeqChunk], argmax: bool = False) -> torch.Tensor:
        return self.submit(chunks, argmax).result()

    def submit(self, chunks: list[SeqChunk], argmax: bool = False, feed=None) -> "_Pending":
        """Launch one step and return at once; `.result()` waits for its logits (on the host), or
        with `argmax` for each sampled row's argmax id. The engine plans the next step in between.
        `feed` (with `feed_steps`): (an earlier argmax step's handle, [(token row, its row)]): those
        token rows (placeholders on the host) take that step's ids on the device, so this step
        can be submitted before they reach the host (LLMEngine._submit_early)."""
        for c in chunks:
            if not 0 <= c.slot < self.num_slots:
                raise ValueError(f"slot {c.slot} is outside [0, {self.num_slots})")
            if any(not 0 <= p < self.num_pages for p in c.pages):
                raise ValueError(f"slot {c.slot}: page outside [0, {self.num_pages}) in {c.pages}")
        graph, bucket = choose_bucket(self.plan, chunks)
        inputs, n = bucket_inputs(chunks, self.plan["buckets"][graph][bucket], self.num_slots, self.num_pages,
                                  self.cfg.pad_token_id)
        if feed is not None:
            inputs = self._fed(inputs, *feed)
        return _Pending(self.run_bucket(graph, bucket, inputs)["logits"][:n], argmax, self.feed_steps)

    def _fed(self, inputs: dict, prev: "_Pending", pairs: list[tuple[int, int]]) -> dict:
        """The inputs on the device with token rows taken from `prev`'s ids there. Through pinned
        memory: a copy from pageable memory would wait for the step still running."""
        if not self.feed_steps or prev.ids is None:
            raise ValueError("feed needs feed_steps and an argmax step to feed from")
        dev = {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in inputs.items()}
        dst, src = torch.tensor(pairs, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True).unbind(1)
        dev["token_ids"][dst] = prev.ids[src]
        return dev

    def run_bucket(self, graph: str, bucket: str, inputs: dict) -> dict:
        """One step at a bucket's shape from its inputs (host tensors, or device ones from _fed);
        through its CUDA graph when it has one."""
        if self.cuda_graphs and self.plan["bucket_kinds"].get(bucket) in ("decode", "verify"):
            cg = self._capture(graph, bucket, inputs)
            if cg is not None:
                staging, cuda_graph, static_out = cg
                # host inputs in one copy from pinned memory; device ones (a fed step's) as they are
                if not (self.staged_inputs and staging.load(inputs)):
                    for k, v in inputs.items():
                        staging.views[k].copy_(v, non_blocking=True)
                cuda_graph.replay()
                return static_out
        return self._run(graph, bucket, {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()})

    def _run(self, graph: str, bucket: str, inputs: dict) -> dict:
        """The plan runner's step, its kernels launched with PDL except in a prefill step: its
        kernels are long, so there is no launch gap to hide, and on the H200 PDL cost the medium
        plan's 4096-token prefill 4% (docs/performance.md, thirteenth session). Steps other than
        prefill spread their calls over `self.lanes` streams (plan_runner.schedule_lanes)."""
        few = self.plan["bucket_kinds"].get(bucket) != "prefill"
        with pdl_launches(few):
            return self.runner.run(graph, bucket, inputs, lanes=self.lanes if few else 1)

    def _capture(self, graph: str, bucket: str, inputs: dict):
        key = (graph, bucket)
        if key in self._graphs:
            return self._graphs[key]
        staging = InputStaging({k: v.to(self.device) for k, v in inputs.items()}, self.device)
        static_in = staging.views
        self._graphs[key] = None
        try:
            # warm-up on a side stream (loads modules, fills the allocator's pools), as torch asks
            # before capture; it runs this step once more, and its cache writes are the same values
            # the replay then writes again
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._run(graph, bucket, static_in)
            torch.cuda.current_stream().wait_stream(s)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                static_out = self._run(graph, bucket, static_in)
        except Exception as e:  # noqa: BLE001  (any capture failure means: run this bucket eagerly)
            g, i = self.runner.at
            c = self.loaded.graphs[g].calls[i]
            where = f"{c['op']} ({c['outputs'][0]})"
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001  (the failed capture's error resurfaces here once)
                pass
            self.graph_status[bucket] = f"eager: {where}: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            return None
        self.graph_status[bucket] = "captured"
        self._graphs[key] = (staging, cuda_graph, static_out)
        return self._graphs[key]

    def warm_up(self, max_seqs: int | None = None, reps: int = 5) -> list[tuple[str, int, int, float]]:
        """Capture every decode and verify bucket a step of at most `max_seqs` sequences runs in
        and time its replay (median of `reps`, on padding in the scratch slot and page), adding
        the buckets not yet measured to `step_time_curve`; returns the curve."""
        known = {b for b, *_ in self.step_time_curve}
        self.step_time_curve += time_step_buckets(self, max_seqs, reps, sync=torch.cuda.synchronize, skip=known)
        return self.step_time_curve

    def draft(self, seqs: list[DraftSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        if "draft" not in self.loaded.graphs:
            raise ValueError(f"model {self.cfg.model_id} has no DSpark draft head")
        b = len(seqs)
        bucket, inputs = draft_bucket_inputs(self.plan, self.cfg, seqs, self.num_slots)
        outs = self._run("draft", bucket, {k: v.to(self.device) for k, v in inputs.items()})
        return outs["drafts"][:b].cpu(), outs["confidence"][:b].float().cpu()
