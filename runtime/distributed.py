"""Running a plan laid out over several ranks (expert parallelism, data-parallel attention; the
layout is passes/moe.py's, recorded in plan["layout"]) under torchrun, one process per device.

Rank 0 runs the engine: it owns the request queue, the scheduler, the sampler and the outputs.
Every step it broadcasts the step's batch, each attention group's chunks in its own local slots
and pages, and every rank runs its group's share of the step (a group with nothing to run takes
one padding row in a scratch slot, because the MoE exchanges need every rank at every layer).
The group leaders' logits come back to rank 0, which samples. The other ranks only follow
(`serve`): they hold no request state beyond the caches of their group's sequences.

Each rank reads only its own expert slots from the checkpoint (RankShard: safetensors tensors
are read on access, so the other experts are never loaded). The cache pool is partitioned by
attention group (PartitionedCache): a sequence lives in one group's slots and pages.

Collectives go through torch.distributed (gloo on CPU, NCCL on GPU) with a timeout
(DEEPINFER_DIST_TIMEOUT seconds, default 300): a rank that died or hangs makes the others fail
with one DistributedError line within it, instead of waiting forever. Drafting is off: the DSpark
head's experts are sharded too, and its steps are not yet part of the protocol.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import replace
from datetime import timedelta

import torch

from ..ir.ops.expert_parallel import EXCHANGE_OPS, SLOTS_SUFFIX, Routing, initial_slots
from .batch import SeqChunk
from .cache import CacheFull, CacheManager, PrefixStats
from .plan_executor import PlanExecutor, reference_call
from .plan_file import load_plan

TIMEOUT_ENV = "DEEPINFER_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
STEP, PLACE, STOP = 1, 2, 3  # commands rank 0 broadcasts
# how gloo and NCCL word a peer that died, hung or went away (any other error is this rank's own bug)
PEER_FAILURES = ("connection", "closed", "reset by peer", "broken pipe", "timed out", "timeout", "transport",
                 "socket", "peer")


class DistributedError(RuntimeError):
    """A collective that failed: another rank died, hung past the timeout, or was interrupted."""


def launched_world() -> int:
    """The process count torchrun (or an equivalent environment) started this process in."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise DistributedError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a process count") from None


def timeout_seconds() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


class ProcessGroup:
    """torch.distributed for one run: the MoE exchanges and rank 0's control messages. Every
    failure of a collective becomes one DistributedError line naming this rank."""

    def __init__(self, timeout_s: float | None = None):
        import torch.distributed as dist

        self.dist = dist
        self.timeout_s = timeout_seconds() if timeout_s is None else timeout_s
        self.broken = False
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() and os.environ.get("DEEPINFER_DIST_BACKEND") != "gloo" \
                else "gloo"
            try:
                dist.init_process_group(backend, timeout=timedelta(seconds=self.timeout_s))
            except (RuntimeError, ValueError) as e:
                raise DistributedError(f"could not join the process group ({_first_line(e)})") from None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        exit_on_interrupt()

    def _run(self, what: str, fn):
        if self.broken:
            raise DistributedError(f"rank {self.rank}: the process group failed earlier; {what} cannot run")
        try:
            return fn()
        except KeyboardInterrupt:
            self.broken = True
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            if not isinstance(e, self.dist.DistBackendError) and not any(w in str(e).lower() for w in PEER_FAILURES):
                raise  # a bug in what this rank passed, not a failed peer
            self.broken = True
            raise DistributedError(f"rank {self.rank}: {what} failed: another rank died or did not answer within "
                                   f"{self.timeout_s:g} s ({_first_line(e)})") from None

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.world, *t.shape), dtype=t.dtype)

        def go():
            self.dist.all_gather_into_tensor(out, t.contiguous()) if hasattr(self.dist, "all_gather_into_tensor") \
                and self.dist.get_backend() != "gloo" else self.dist.all_gather(list(out.unbind(0)), t.contiguous())
            return out
        return self._run("an expert-parallel all-gather", go)

    def all_to_all(self, send: list[torch.Tensor], recv_rows: list[int]) -> list[torch.Tensor]:
        """send[i] ([rows, width], one width and dtype) to rank i; returns what each rank sent here.
        Rows travel as int32 words (gloo's all-to-all takes no 8- or 16-bit types)."""
        like = send[self.rank]
        raw = torch.cat(send).contiguous().view(torch.uint8)
        nbytes = raw.shape[1]
        words = torch.nn.functional.pad(raw, (0, -nbytes % 4)).view(torch.int32)
        out = torch.empty((sum(recv_rows), words.shape[1]), dtype=torch.int32)

        def go():
            self.dist.all_to_all_single(out, words, output_split_sizes=list(recv_rows),
                                        input_split_sizes=[t.shape[0] for t in send])
        self._run("an expert-parallel all-to-all", go)
        back = out.view(torch.uint8)[:, :nbytes].contiguous().view(like.dtype)
        return list(torch.split(back, list(recv_rows)))

    def broadcast_ints(self, values: list[int] | None) -> list[int]:
        """Rank 0's list of ints to every rank (the length first, then the list)."""
        n = torch.tensor([len(values) if values is not None else 0], dtype=torch.int64)
        self._run("waiting for rank 0's next step", lambda: self.dist.broadcast(n, 0))
        data = torch.tensor(values, dtype=torch.int64) if values is not None else torch.empty(int(n), dtype=torch.int64)
        self._run("receiving rank 0's step", lambda: self.dist.broadcast(data, 0))
        return data.tolist()

    def gather_rows(self, t: torch.Tensor, rows: int) -> list[torch.Tensor] | None:
        """Every rank's `t` ([<= rows, width], padded here) at rank 0; None elsewhere."""
        pad = torch.zeros((rows, t.shape[1]), dtype=t.dtype)
        pad[:t.shape[0]] = t
        bufs = [torch.empty_like(pad) for _ in range(self.world)] if self.rank == 0 else None
        self._run("gathering the step's logits", lambda: self.dist.gather(pad, bufs, dst=0))
        return bufs

    def close(self) -> None:
        if self.dist.is_initialized() and not self.broken:
            self.dist.destroy_process_group()


_WAKEUP: list = []  # the socket pair of exit_on_interrupt


def exit_on_interrupt() -> None:
    """Ctrl-C ends this rank at once with one line and exit status 130, wherever it is: Python's
    own handler runs only between bytecodes, which a rank blocked in a collective never reaches.
    The interpreter's C handler still writes the signal to the wakeup fd, which a thread watches."""
    import signal
    import socket
    import sys
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (an embedding application keeps its own)
    if _WAKEUP:
        return
    reader, writer = socket.socketpair()
    _WAKEUP.extend((reader, writer))  # kept open for the life of the process
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno())
    signal.signal(signal.SIGINT, lambda *_: None)  # the watcher below answers it

    def watch():
        while True:
            data = reader.recv(64)
            if not data:
                return
            if signal.SIGINT in data:
                print("deepinfer: interrupted", file=sys.stderr, flush=True)
                os._exit(130)
    threading.Thread(target=watch, name="deepinfer-interrupt", daemon=True).start()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


class RankShard:
    """This rank's part of a plan's layout: its attention group, and per MoE block the logical
    experts its slots hold (the placement, initially spec §11's)."""

    def __init__(self, plan: dict, rank: int, world: int):
        layout = plan["layout"]
        self.rank, self.world, self.dp = rank, world, layout["dp"]
        self.group_size = world // self.dp
        self.group = rank // self.group_size
        self.blocks = layout["moe_blocks"]
        self.tables = layout.get("tables", {})
        self.placements = {prefix: initial_slots(b["experts"], b["slots"]) for prefix, b in self.blocks.items()}

    def local_experts(self, prefix: str) -> list[int]:
        per = self.blocks[prefix]["slots"] // self.world
        return self.placements[prefix][self.rank * per:(self.rank + 1) * per]

    def sources(self, plan: dict, sources: dict[str, list[str]], only: set[str] | None = None) -> dict:
        """The checkpoint tensors of this rank's params: each stacked expert weight from its local
        slots' experts only (the full list holds [e0.weight, e0.scale, e1.weight, ...])."""
        own = {b["placement"] for b in self.blocks.values()} | set(self.tables)  # local_params makes these
        out = {k: v for k, v in sources.items() if k not in own}
        for prefix, b in self.blocks.items():
            if only is not None and prefix not in only:
                continue
            experts = self.local_experts(prefix)
            for w in b["weights"]:
                full = sources[w]
                out[w] = [name for e in experts for name in full[2 * e:2 * e + 2]]
        return out if only is None else {k: out[k] for b in only for k in self.blocks[b]["weights"]}

    def local_params(self, plan: dict, checkpoint) -> dict:
        """The expert placements, and this rank's rows of each Engram table (a safetensors slice
        of each; the last rank's share padded with zero rows)."""
        from ..ir.quant import QTensor

        out = {b["placement"]: torch.tensor(self.placements[p], dtype=torch.int32) for p, b in self.blocks.items()}
        for name, t in self.tables.items():
            per = t["rows_per_rank"]
            start, stop = self.rank * per, min((self.rank + 1) * per, t["rows"])
            weight, scale = plan["params"][name]["sources"]
            parts = []
            for src in (weight, scale):
                rows = checkpoint.rows(src, start, stop) if hasattr(checkpoint, "rows") else checkpoint[src][start:stop]
                pad = torch.zeros((per - rows.shape[0], *rows.shape[1:]), dtype=rows.dtype)
                parts.append(torch.cat([rows, pad]) if len(pad) else rows)
            out[name] = QTensor(*parts)
        return out


class PartitionedCache:
    """The engine's cache pool over attention groups: each group its own slots and pages (a
    sequence's state lives on its group's ranks). Slots are global (group * slots + local), pages
    local to the group. A new sequence goes to the group with the most free slots (ties: the
    lowest), so placement depends only on the request order."""

    # no prefix cache across groups (the engine refuses one on multi-rank plans): the engine and
    # scheduler see the single-process pool's prefix interface, always empty
    prefix = None

    def __init__(self, groups: int, num_slots: int, num_pages: int, page_tokens: int):
        self.parts = [CacheManager(num_slots, num_pages, page_tokens) for _ in range(groups)]
        self.stats = PrefixStats()
        self.slots_per_group, self.page_tokens = num_slots, page_tokens
        self.num_slots, self.num_pages = groups * num_slots, num_pages
        self._group: dict[object, int] = {}

    def _part(self, owner) -> CacheManager:
        g = self._group.get(owner)
        if g is None:  # where allocate would put it
            g = max(range(len(self.parts)), key=lambda i: (self.parts[i].free_slots, -i))
        return self.parts[g]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    @property
    def free_slots(self) -> int:
        return sum(p.free_slots for p in self.parts)

    @property
    def free_pages(self) -> int:
        return sum(p.free_pages for p in self.parts)

    @property
    def free_tokens(self) -> int:
        return sum(p.free_tokens for p in self.parts)

    def slot(self, owner) -> int:
        return self._group[owner] * self.slots_per_group + self.parts[self._group[owner]].slot(owner)

    def pages(self, owner) -> list[int]:
        return self._part(owner).pages(owner)

    def holds(self, owner) -> bool:
        return owner in self._group

    def extra_pages(self, owner, num_tokens: int) -> int:
        return self._part(owner).extra_pages(owner, num_tokens)

    def can_cover(self, owner, num_tokens: int, hit=None) -> bool:
        return self._part(owner).can_cover(owner, num_tokens)

    def allocate(self, owner, num_tokens: int, hit=None) -> int:
        part = self._part(owner)
        if not part.free_slots:
            raise CacheFull(f"no free state slot ({self.num_slots} in use)")
        part.allocate(owner, num_tokens)
        self._group[owner] = self.parts.index(part)
        return self.slot(owner)

    def grow(self, owner, num_tokens: int) -> list[int]:
        return self._part(owner).grow(owner, num_tokens)

    def shrink(self, owner, num_tokens: int) -> list[int]:
        return self._part(owner).shrink(owner, num_tokens)

    def free(self, owner) -> None:
        g = self._group.pop(owner, None)
        if g is not None:
            self.parts[g].free(owner)

    def check_no_leak(self) -> None:
        for p in self.parts:
            p.check_no_leak()


# ---- the step protocol: rank 0's commands as int64 lists -------------------------------------

def encode_step(resets: list[int], groups: list[list[SeqChunk]]) -> list[int]:
    out = [STEP, len(resets), *resets, len(groups)]
    for chunks in groups:
        out.append(len(chunks))
        for c in chunks:
            out += [c.slot, c.start, len(c.tokens), len(c.pages), int(c.sample), c.logit_rows, *c.tokens, *c.pages]
    return out


def decode_step(cmd: list[int]) -> tuple[list[int], list[list[SeqChunk]]]:
    n = cmd[1]
    resets, i = cmd[2:2 + n], 2 + n
    groups = []
    n_groups, i = cmd[i], i + 1
    for _ in range(n_groups):
        n_chunks, i = cmd[i], i + 1
        chunks = []
        for _ in range(n_chunks):
            slot, start, nt, npg, sample, rows = cmd[i:i + 6]
            i += 6
            tokens, pages = cmd[i:i + nt], cmd[i + nt:i + nt + npg]
            i += nt + npg
            chunks.append(SeqChunk(slot, start, tokens, pages, bool(sample), rows))
        groups.append(chunks)
    return resets, groups


def sampled_rows(chunks: list[SeqChunk]) -> int:
    return sum(c.logit_rows for c in chunks if c.sample)


class RankRunner:
    """One rank's share of every step: its group's chunks on its local executor, whose MoE
    exchanges run over the process group."""

    def __init__(self, plan_dir, weights, group: ProcessGroup, num_slots: int | None, num_pages: int | None,
                 on_load=None):
        plan = load_plan(plan_dir)
        self.group = group
        self.shard = RankShard(plan, group.rank, group.world) if "moe_blocks" in plan.get("layout", {}) else None
        self.on_load = on_load  # rank 0's EPLB statistics: called with (block, load per logical expert)
        opts = plan["options"]
        groups = self.shard.dp if self.shard else 1
        # `num_slots` is the engine's (all groups'); each group holds its share, `num_pages` each
        slots, pages = -(-(num_slots or opts["num_slots"]) // groups), num_pages or opts["num_pages"]
        # one more slot and page: the scratch a group with nothing to run computes its padding row in
        self.local = PlanExecutor(plan_dir, weights, num_slots=slots + 1, num_pages=pages + 1, shard=self.shard,
                                  call_fn=self._call_fn)
        self.num_slots, self.num_pages = slots, pages
        self.cfg, self.plan = self.local.cfg, self.local.plan

    def _call_fn(self, call: dict, bucket):
        fn = EXCHANGE_OPS.get(call["op"])
        if fn is None:
            return reference_call(call, bucket)
        attrs = dict(call["attrs"])
        group = self.group
        if call["op"] != "ep_dispatch" or self.on_load is None:
            return lambda *xs: fn(*xs, **attrs, exchange=group)
        block = call["inputs"][4][: -len(SLOTS_SUFFIX)]

        def dispatch(*xs):
            out = fn(*xs, **attrs, exchange=group)
            self.on_load(block, Routing(xs[4].tolist(), out[4], attrs["ep"], attrs["dp"]).load())
            return out
        return dispatch

    def run(self, cmd: list[int]) -> torch.Tensor | None:
        """Run a step command; the group's logits (every rank of a group computes the same)."""
        resets, groups = decode_step(cmd)
        per = self.shard.group_size if self.shard else 1
        g = self.group.rank // per
        for slot in resets:
            if slot // self.num_slots == g:
                self.local.reset_slot(slot % self.num_slots)
        mine = groups[g]
        if not mine:  # the exchanges need this rank: one padding row in the scratch slot and page
            self.local.step([SeqChunk(self.num_slots, 0, [self.cfg.pad_token_id], [self.num_pages], True, 1)])
            return None
        return self.local.step(mine)

    def apply_placement(self, cmd: list[int]) -> None:
        """PLACE: new expert placements (block index, slots...) take effect before the next step:
        this rank re-reads the experts its slots now hold from the checkpoint."""
        names = list(self.shard.blocks)
        i, changed = 1, set()
        while i < len(cmd):
            b, n = cmd[i], cmd[i + 1]
            slots = cmd[i + 2:i + 2 + n]
            prefix = names[b]
            if self.shard.local_experts(prefix) != slots[self.shard.rank * (n // self.shard.world):
                                                         (self.shard.rank + 1) * (n // self.shard.world)]:
                changed.add(prefix)
            self.shard.placements[prefix] = slots
            self.local.params[self.shard.blocks[prefix]["placement"]].copy_(torch.tensor(slots, dtype=torch.int32))
            i += 2 + n
        if changed:
            from ..ir.ops.quantized import preload_dequantized
            from ..models.deepseek_v41 import materialize_params

            lp = self.local.loaded
            full = {k: v["sources"] for k, v in self.plan["params"].items()}
            fresh = materialize_params(self.shard.sources(self.plan, full, only=changed), lp.checkpoint)
            self.local.params.update(fresh)
            lp.run_load_program(self.local.params, only=set(fresh))
            preload_dequantized(self.local.params)


def serve(runner: RankRunner) -> None:
    """A rank other than 0: follow rank 0's commands until it stops."""
    group = runner.group
    while True:
        cmd = group.broadcast_ints(None)
        if not cmd or cmd[0] == STOP:
            return
        if cmd[0] == PLACE:
            runner.apply_placement(cmd)
            continue
        logits = runner.run(cmd)
        _, groups = decode_step(cmd)
        rows = max(sampled_rows(c) for c in groups)
        leader = runner.shard is None or runner.group.rank % runner.shard.group_size == 0
        group.gather_rows(logits if logits is not None and leader else torch.zeros(0, runner.cfg.vocab_size), rows)


class DistributedExecutor:
    """Rank 0's executor: the engine's steps spread over the plan's ranks (module doc)."""

    max_draft_len = 0  # drafting is not part of the protocol yet (module doc)

    def __init__(self, runner: RankRunner, load=None, eplb_interval: int = 0):
        """`load` (eplb.ExpertLoad): the window the runner's dispatches record into; with
        `eplb_interval` > 0 the experts are re-placed from it every that many steps."""
        self.runner, self.group = runner, runner.group
        self.load, self.eplb_interval = load, eplb_interval
        self.num_rebalances = 0
        self.cfg, self.plan = runner.cfg, runner.plan
        self.vocab_size = self.cfg.vocab_size
        self.page_tokens = runner.local.page_tokens
        self.groups = runner.shard.dp if runner.shard else 1
        self.group_size = self.group.world // self.groups
        self.slots_per_group = runner.num_slots
        self.num_slots, self.num_pages = self.groups * runner.num_slots, runner.num_pages
        self._resets: list[int] = []
        self.num_steps = 0
        self.stopped = False
        atexit.register(self.stop)

    def make_cache(self) -> PartitionedCache:
        return PartitionedCache(self.groups, self.slots_per_group, self.num_pages, self.page_tokens)

    def reset_slot(self, slot: int) -> None:
        self._resets.append(slot)  # done by the slot's group, before the next step

    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        groups: list[list[SeqChunk]] = [[] for _ in range(self.groups)]
        where = []
        for c in chunks:
            g, local = divmod(c.slot, self.slots_per_group)
            where.append(g)
            groups[g].append(replace(c, slot=local))
        cmd = encode_step(self._resets, groups)
        self._resets = []
        self.group.broadcast_ints(cmd)
        mine = self.runner.run(cmd)
        rows = max(sampled_rows(c) for c in groups)
        got = self.group.gather_rows(mine if mine is not None else torch.zeros(0, self.vocab_size), rows)
        self.num_steps += 1
        if self.load is not None:
            self.load.end_step()
            if self.eplb_interval and self.num_steps % self.eplb_interval == 0:
                self.rebalance()
        taken = [0] * self.groups
        out = []
        for c, g in zip(chunks, where):
            if c.sample:
                block = got[g * self.group_size]
                out.append(block[taken[g]:taken[g] + c.logit_rows])
                taken[g] += c.logit_rows
        return torch.cat(out) if out else torch.zeros(0, self.vocab_size)

    def draft(self, seqs):
        raise ValueError("drafting does not run on a multi-rank plan yet (speculative=0)")

    def place(self, placements: dict[str, list[int]]) -> None:
        """New expert placements, applied by every rank before the next step (between steps, so no
        request sees a half-moved model)."""
        names = list(self.runner.shard.blocks)
        cmd = [PLACE]
        for prefix, slots in placements.items():
            cmd += [names.index(prefix), len(slots), *slots]
        self.group.broadcast_ints(cmd)
        self.runner.apply_placement(cmd)

    def rebalance(self) -> dict[str, list[int]]:
        """Re-place every MoE block's experts from the load window (spec §11), between steps."""
        from .eplb import rebalance

        shard = self.runner.shard
        new = {}
        for prefix, b in shard.blocks.items():
            history = self.load.history(prefix)
            if len(history):
                new[prefix] = rebalance(history, b["slots"], self.group.world)
        changed = {p: s for p, s in new.items() if s != shard.placements[p]}
        if changed:
            self.place(changed)
            self.num_rebalances += 1
        return changed

    def stop(self) -> None:
        """Tell the other ranks to exit (once; not after the group failed or was interrupted)."""
        if self.stopped:
            return
        self.stopped = True
        if not self.group.broken:
            try:
                self.group.broadcast_ints([STOP])
            except DistributedError:
                pass  # they are gone already: nothing is waiting for the message
            self.group.close()


def launch_executor(plan_dir, weights, num_slots: int | None = None,
                    num_pages: int | None = None) -> DistributedExecutor:
    """Join the run's process group and load this rank's shard. On rank 0: the executor the
    engine drives, re-placing experts every DEEPINFER_EPLB_INTERVAL steps (0 = never) from a
    window of DEEPINFER_EPLB_WINDOW steps. Elsewhere: follow rank 0 until it stops, then exit."""
    from .eplb import ExpertLoad, interval_from_env

    try:
        interval, window = interval_from_env()
    except ValueError as e:
        raise DistributedError(str(e)) from None
    group = ProcessGroup()
    load = ExpertLoad(window) if group.rank == 0 else None
    runner = RankRunner(plan_dir, weights, group, num_slots, num_pages, on_load=load.record if load else None)
    if group.rank == 0:
        return DistributedExecutor(runner, load, interval)
    try:
        serve(runner)
    finally:
        group.close()
    raise SystemExit(0)
