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
    sample: bool = True  # compute logits for the last `logit_rows` rows
    logit_rows: int = 1  # 1 + drafts for a verify chunk [t*, d_0 .. d_{m-1}]: every row verifies


def step_inputs(chunks: list[SeqChunk]) -> dict[str, torch.Tensor]:
    if not chunks:
        raise ValueError("a step needs at least one sequence")
    ids, pos, seq, rows = [], [], [], []  # rows: the logits rows, in chunk order
    width = max(1, max(len(c.pages) for c in chunks))
    table = torch.full((len(chunks), width), -1, dtype=torch.int32)
    for s, c in enumerate(chunks):
        if not c.tokens:
            raise ValueError(f"sequence in slot {c.slot} has an empty chunk")
        ids += c.tokens
        pos += range(c.start, c.start + len(c.tokens))
        seq += [s] * len(c.tokens)
        if c.sample:
            if not 1 <= c.logit_rows <= len(c.tokens):
                raise ValueError(f"sequence in slot {c.slot}: logits of {c.logit_rows} rows of a "
                                 f"{len(c.tokens)}-row chunk")
            rows += range(len(ids) - c.logit_rows, len(ids))
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


def bucket_inputs(chunks: list[SeqChunk], env: dict, scratch_slot: int, scratch_page: int,
                  pad_token: int) -> tuple[dict[str, torch.Tensor], int]:
    """The step's inputs at a bucket's static shape (kernels are built per bucket), and the number
    of real sampled rows (the first rows of the logits).

    Padding: dummy sequences fill the bucket's sequence count; the spare rows go to them at
    positions 0.. (a dummy may hold none). They live in the scratch slot and page, which the
    executor keeps out of the cache manager's pool, so their cache writes touch no real sequence;
    every op is row- or sequence-local, so real rows never read them. Sampled rows past the real
    ones repeat row 0 and are dropped."""
    tokens, seqs, samples, width = env["num_tokens"], env["num_seqs"], env["num_samples"], env["max_pages"]
    rows = sum(len(c.tokens) for c in chunks)
    extra_rows, extra_seqs = tokens - rows, seqs - len(chunks)
    if extra_rows < 0 or extra_seqs < 0 or (extra_rows and not extra_seqs):
        raise ValueError(f"{rows} rows over {len(chunks)} sequences do not fit a bucket of {tokens} rows over {seqs}")
    real = step_inputs(chunks)
    n_samples = len(real["sample_rows"])
    pad_ids, pad_pos, pad_seq, pad_sample = [], [], [], []
    for j in range(extra_seqs):
        k = extra_rows // extra_seqs + (j < extra_rows % extra_seqs)
        pad_ids += [pad_token] * k
        pad_pos += range(k)
        pad_seq += [len(chunks) + j] * k
        if k:
            pad_sample.append(rows + len(pad_ids) - 1)
    sample_rows = real["sample_rows"].tolist() + pad_sample
    sample_rows += [0] * (samples - len(sample_rows))
    if len(sample_rows) != samples:
        raise ValueError(f"{len(sample_rows)} sampled rows do not fit a bucket of {samples}")
    table = torch.full((seqs, width), scratch_page, dtype=torch.int32)
    table[: len(chunks)] = -1
    got = real["block_table"]
    if got.shape[1] > width:
        raise ValueError(f"a sequence holds {got.shape[1]} pages; the plan's buckets hold {width}")
    table[: len(chunks), : got.shape[1]] = got
    return {
        "token_ids": torch.cat([real["token_ids"], torch.tensor(pad_ids, dtype=torch.int64)]),
        "positions": torch.cat([real["positions"], torch.tensor(pad_pos, dtype=torch.int64)]),
        "token_seq": torch.cat([real["token_seq"], torch.tensor(pad_seq, dtype=torch.int32)]),
        "seq_slots": torch.cat([real["seq_slots"], torch.full((extra_seqs,), scratch_slot, dtype=torch.int32)]),
        "block_table": table,
        "sample_rows": torch.tensor(sample_rows, dtype=torch.int64),
    }, n_samples
