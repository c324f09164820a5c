"""What the runtime needs from whatever runs the model: one engine step, one draft block, and the
cache state it owns. The scheduler and engine only talk to this interface, so the graph
interpreter (here) and the compiled-plan executor are interchangeable."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..ir import interpret
from ..ir.ops.quantized import preload_dequantized
from ..models.deepseek_v41 import PAGE_TOKENS, ModelProgram
from .batch import DraftSeq, SeqChunk, draft_inputs, step_inputs
from .state import SlotStateOps, allocate_state, paged_buffers, slot_buffers


@runtime_checkable
class Executor(Protocol):
    """An executor may also declare `page_tokens` (raw tokens per page); without it the engine uses
    the V4.1 graphs' PAGE_TOKENS. And `max_draft_len`: the drafts one sequence's verify chunk may
    carry, [t*, d_0 .. d_{m-1}] with logits for all of its rows (`SeqChunk.logit_rows`); absent or
    0, the executor cannot run verify steps and the engine does not speculate. For prefix caching
    it needs `cfg` (the ModelConfig: window, draft block, compressor ratios) and `save_slot`,
    `restore_slot` and `copy_page` (runtime/state.SlotStateOps)."""

    num_slots: int  # state slots (window rings, compressor rings, Engram history) in the pool
    num_pages: int  # pages of the compressed caches in the pool
    vocab_size: int

    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Run one engine step over a ragged batch; fp32 logits [sampled rows, vocab] in chunk order."""
        ...

    def draft(self, seqs: list[DraftSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """The DSpark block of each sequence: (drafts [n, block] i64, confidence logits [n, block] f32)."""
        ...

    def reset_slot(self, slot: int) -> None:
        """Clear a state slot before a new sequence takes it."""
        ...


class InterpreterExecutor(SlotStateOps):
    """Runs the model program's graphs with the IR interpreter (each op's torch reference) on CPU."""

    def __init__(self, program: ModelProgram, params: dict, num_slots: int, num_pages: int, check: bool = False):
        if num_slots < 1 or num_pages < 1:
            raise ValueError(f"an executor needs >= 1 slot and >= 1 page, got {num_slots} slots, {num_pages} pages")
        self.program, self.params, self.cfg = program, params, program.cfg
        # weights dequantised once, at load, as the cpu plan's executor does: each step otherwise
        # widened every routed expert's fp4 weight again (half an engine step's time on the tiny model)
        preload_dequantized(params)
        self.num_slots, self.num_pages, self.page_tokens = num_slots, num_pages, PAGE_TOKENS
        self.vocab_size = program.cfg.vocab_size
        # the interpreter takes any shape, so any chunk up to the draft block
        self.max_draft_len = program.cfg.dspark_block_size if program.cfg.n_mtp else 0
        # type checks of every value cost ~10% a step and the graphs are verified already; tests may turn them on
        self.check = check
        self.state = allocate_state(program.state, num_slots=num_slots, num_pages=num_pages)
        # which state buffers are indexed by slot (the rest are paged); dim 0 is the slot/page index
        self.slot_names, self.page_names = slot_buffers(program.state), paged_buffers(program.state)

    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        for c in chunks:
            if not 0 <= c.slot < self.num_slots:
                raise ValueError(f"slot {c.slot} is outside [0, {self.num_slots})")
            if any(not 0 <= p < self.num_pages for p in c.pages):
                raise ValueError(f"slot {c.slot}: page outside [0, {self.num_pages}) in {c.pages}")
        outs, self.state, _ = interpret(self.program.step, step_inputs(chunks), self.params, self.state,
                                        check=self.check)
        return outs["logits"]

    def draft(self, seqs: list[DraftSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.program.cfg
        if not cfg.n_mtp:
            raise ValueError(f"model {cfg.model_id} has no DSpark draft head")
        inputs = draft_inputs(seqs, cfg.dspark_block_size, cfg.dspark_noise_token_id)
        outs, self.state, _ = interpret(self.program.draft, inputs, self.params, self.state, check=self.check)
        return outs["drafts"], outs["confidence"]
