"""Runs a compiled plan: the `Executor` the engine drives, built from a plan directory and a
checkpoint. On the cpu target every kernel call runs its op's torch reference."""
from __future__ import annotations

from pathlib import Path

import torch

from ..codegen.plan import PlanError, load_plan
from ..ir import interpret, parse_graph, parse_type, verify
from ..ir.graph import Graph
from ..ir.registry import get_op
from ..models.checkpoint import load_checkpoint
from ..models.config import config_from_dict, load_config
from ..models.deepseek_v41 import materialize_params
from .batch import DraftSeq, SeqChunk, draft_inputs, step_inputs
from .state import allocate_state


def _step_graph(full: Graph, derived: set[str]) -> Graph:
    """The per-step part of a graph: load-time nodes removed, their outputs become params."""
    g = full.replace_nodes([n for n in full.nodes if not set(n.outputs) & derived])
    for v in sorted(derived):
        if v in full.types and v not in g.params:
            g.types[v] = full.types[v]
            g.params.append(v)
    return g


class PlanExecutor:
    def __init__(self, plan_dir, weights, num_slots: int | None = None, num_pages: int | None = None,
                 check: bool = False):
        root = Path(plan_dir)
        self.plan = plan = load_plan(root)
        # the cache pool the plan was built for; torch kernels (cpu) take any size, so tests may shrink it
        num_slots = num_slots or plan["options"]["num_slots"]
        num_pages = num_pages or plan["options"]["num_pages"]
        if num_slots < 1 or num_pages < 1:
            raise ValueError(f"an executor needs >= 1 slot and >= 1 page, got {num_slots} slots, {num_pages} pages")
        target = plan["target"]["name"]
        if target != "cpu":
            raise PlanError(f"plan {root}: compiled for {target}; this executor runs cpu plans")
        self.cfg = cfg = config_from_dict(plan["model"]["config"], model_id=plan["model"]["id"])
        wcfg = load_config(weights)
        if wcfg.config_hash != plan["model"]["config_hash"]:
            raise PlanError(f"weights {weights} are for model {wcfg.model_id} (config {wcfg.config_hash[:12]}), the plan "
                            f"for {plan['model']['id']} (config {plan['model']['config_hash'][:12]})")
        ckpt = load_checkpoint(weights, cfg)
        self.params = materialize_params({k: v["sources"] for k, v in plan["params"].items()}, ckpt)
        derived = set()
        for call in plan["load_program"]:  # weight layouts the kernels want (e.g. w13 = [w1; w3])
            outs = get_op(call["op"]).ref(*(self.params[v] for v in call["inputs"]), **call["attrs"])
            outs = outs if isinstance(outs, tuple) and len(call["outputs"]) > 1 else (outs,)
            self.params.update(zip(call["outputs"], outs))
            derived.update(call["outputs"])
        if target == "cpu":  # the cpu legalisation: weights dequantised once, at load
            from ..ir.ops.quantized import preload_dequantized

            preload_dequantized(self.params)
        self.graphs = {}
        for name, g in plan["graphs"].items():
            full = verify(parse_graph((root / g["ir"]).read_text()))
            self.graphs[name] = _step_graph(full, derived)
        self.num_slots, self.num_pages = num_slots, num_pages
        self.vocab_size = cfg.vocab_size
        self.check = check
        self.state_types = {k: parse_type(v) for k, v in plan["state"].items()}
        self.state = allocate_state(self.state_types, num_slots=num_slots, num_pages=num_pages)

    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        for c in chunks:
            if not 0 <= c.slot < self.num_slots:
                raise ValueError(f"slot {c.slot} is outside [0, {self.num_slots})")
        graph = self.graphs["step"]
        if "step_decode" in self.graphs and max(len(c.tokens) for c in chunks) <= self.plan["options"]["decode_rows_max"]:
            graph = self.graphs["step_decode"]
        outs, self.state, _ = interpret(graph, step_inputs(chunks), self.params, self.state, check=self.check)
        return outs["logits"]

    def draft(self, seqs: list[DraftSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        if "draft" not in self.graphs:
            raise ValueError(f"model {self.cfg.model_id} has no DSpark draft head")
        inputs = draft_inputs(seqs, self.cfg.dspark_block_size, self.cfg.dspark_noise_token_id)
        outs, self.state, _ = interpret(self.graphs["draft"], inputs, self.params, self.state, check=self.check)
        return outs["drafts"], outs["confidence"]

    def reset_slot(self, slot: int) -> None:
        from ..ir import shapes as sh
        from ..ir.quant import QTensor

        for name, t in self.state_types.items():
            lead = (t.data if hasattr(t, "scale") else t).shape[0]
            if lead == sh.num_slots:
                buf = self.state[name]
                for part in ((buf.data, buf.scale) if isinstance(buf, QTensor) else (buf,)):
                    part[slot].zero_()
