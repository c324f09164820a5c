"""Shape/dtype inference and specialisation of symbolic sizes into the buckets a plan serves."""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph
from ..ir.registry import ShapeError, get_op
from ..ir.verify import VerifyError


def infer_shapes(g: Graph) -> Graph:
    """Recompute every node's output types from its op's rule (rewrites may leave stale ones)."""
    out = g.copy()
    for n in out.nodes:
        try:
            types = get_op(n.op).infer_types([out.types[v] for v in n.inputs], n.attr)
        except ShapeError as e:
            raise VerifyError(f"node {n.name}: {e}") from None
        out.types.update(zip(n.outputs, types))
    return out


@dataclass(frozen=True)
class Bucket:
    """One shape a plan serves: every step symbol but the cache pool sizes gets a value.

    decode: one row per sequence; verify: up to `rows_per_seq` rows per sequence with logits for
    each ([t*, d_0 .. d_{k-1}] of speculative decoding, spec §5.5), one spare sequence for the
    padding, either every sequence's full rows or fewer rows shared by the sequences (a ragged
    bucket: rows go to sequences through token_seq, so its kernels are those of any other
    bucket at its sizes); prefill: a token budget shared by up to `seqs` sequences (chunked prefill mixes
    prompt chunks and decode rows in one step)."""

    name: str
    kind: str  # "decode" | "verify" | "prefill"
    tokens: int
    seqs: int
    samples: int

    def env(self, max_pages: int) -> dict[str, int]:
        return {"num_tokens": self.tokens, "num_seqs": self.seqs, "num_samples": self.samples,
                "max_pages": max_pages}


DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_TOKENS = (512, 2048, 8192)


def default_buckets(max_num_seqs: int = 256, decode=DECODE_BATCHES, prefill=PREFILL_TOKENS, verify=(),
                    rows_per_seq: int = 1) -> list[Bucket]:
    """`verify`: per bucket B (B sequences of rows_per_seq rows) or (B, R) (B sequences, R rows)."""
    out = [Bucket(f"decode_b{b}", "decode", b, b, b) for b in decode if b <= max_num_seqs]
    # b sequences sharing `rows` rows, all sampled, plus the padding's spare sequence and its row
    shapes = sorted({v if isinstance(v, tuple) else (v, v * rows_per_seq) for v in verify})
    out += [Bucket(f"verify_b{b}" if rows == b * rows_per_seq else f"verify_b{b}r{rows}", "verify", rows, b + 1,
                   rows + 1) for b, rows in shapes if b <= max_num_seqs]
    for t in prefill:
        # one sequence more than the engine runs: a device step pads its rows up to the bucket's
        # token count with a dummy sequence, even when every real sequence is in the step
        s = min(t, max_num_seqs + 1)
        out.append(Bucket(f"prefill_t{t}", "prefill", t, s, s))
    return out
