"""The inputs of one engine step, built from the sequences scheduled into it.

A step is a ragged batch: each sequence contributes a contiguous chunk of rows (a prefill chunk or
decode rows). This is the one place that lays out the metadata every graph op shares
(`token_seq`, `seq_slots`, `block_table`, `sample_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqChunk:
    slot: int  # the sequence's state slot (window rings, compressor state, Engram history)
    start: int  # position of the chunk's first token = tokens the caches already hold
    tokens: list[int]
    pages: list[int]  # the sequence's pages of the compressed caches, in order
    sample: bool = True  # compute logits for the last row


def step_inputs(chunks: list[SeqChunk]) -> dict[str, torch.Tensor]:
    if not chunks:
        raise ValueError("a step needs at least one sequence")
    ids, pos, seq, rows = [], [], [], []
    width = max(1, max(len(c.pages) for c in chunks))
    table = torch.full((len(chunks), width), -1, dtype=torch.int32)
    for s, c in enumerate(chunks):
        if not c.tokens:
            raise ValueError(f"sequence in slot {c.slot} has an empty chunk")
        ids += c.tokens
        pos += range(c.start, c.start + len(c.tokens))
        seq += [s] * len(c.tokens)
        if c.sample:
            rows.append(len(ids) - 1)
        table[s, : len(c.pages)] = torch.tensor(c.pages, dtype=torch.int32)
    return {
        "token_ids": torch.tensor(ids, dtype=torch.int64),
        "positions": torch.tensor(pos, dtype=torch.int64),
        "token_seq": torch.tensor(seq, dtype=torch.int32),
        "seq_slots": torch.tensor([c.slot for c in chunks], dtype=torch.int32),
        "block_table": table,
        "sample_rows": torch.tensor(rows, dtype=torch.int64),
    }


@dataclass
class DraftSeq:
    slot: int
    first: int  # t*: the token just sampled for position `start`
    start: int  # P + 1


def draft_inputs(seqs: list[DraftSeq], block: int, noise_id: int) -> dict[str, torch.Tensor]:
    """The DSpark block of every sequence: [t*, noise, ..., noise] at positions P+1 .. P+block."""
    return {
        "draft_first": torch.tensor([d.first for d in seqs], dtype=torch.int64),
        "block_ids": torch.tensor([t for d in seqs for t in [d.first] + [noise_id] * (block - 1)],
                                  dtype=torch.int64),
        "block_positions": torch.tensor([d.start + i for d in seqs for i in range(block)], dtype=torch.int64),
        "block_seq": torch.tensor([s for s in range(len(seqs)) for _ in range(block)], dtype=torch.int32),
        "seq_slots": torch.tensor([d.slot for d in seqs], dtype=torch.int32),
    }
