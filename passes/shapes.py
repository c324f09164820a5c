"""Shape/dtype inference and specialisation of symbolic sizes into the buckets a plan serves."""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import shapes as sh
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

    decode: one row per sequence; prefill: a token budget shared by up to `seqs` sequences
    (chunked prefill mixes prompt chunks and decode rows in one step)."""

    name: str
    kind: str  # "decode" | "prefill"
    tokens: int
    seqs: int
    samples: int

    def env(self, max_pages: int) -> dict[str, int]:
        return {"num_tokens": self.tokens, "num_seqs": self.seqs, "num_samples": self.samples,
                "max_pages": max_pages}


DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_TOKENS = (512, 2048, 8192)
POOL_SYMBOLS = ("num_slots", "num_pages")  # sized by the runtime's cache manager, not by the bucket


def default_buckets(max_num_seqs: int = 256, decode=DECODE_BATCHES, prefill=PREFILL_TOKENS) -> list[Bucket]:
    out = [Bucket(f"decode_b{b}", "decode", b, b, b) for b in decode if b <= max_num_seqs]
    for t in prefill:
        s = min(t, max_num_seqs)
        out.append(Bucket(f"prefill_t{t}", "prefill", t, s, s))
    return out


def draft_bucket_env(bucket: Bucket, block: int, max_pages: int) -> dict[str, int]:
    """The draft graph runs for the sequences that just sampled: at most one per sequence."""
    return {"num_seqs": bucket.seqs, "max_pages": max_pages} | {"num_tokens": block * bucket.seqs}


def specialize_types(g: Graph, env: dict[str, int]) -> dict[str, tuple]:
    """Storage shape of every value under `env` (pool symbols stay symbolic): value -> tuple of
    (data shape[, scale shape])."""
    out = {}
    for name, t in g.types.items():
        parts = (t.data, t.scale) if hasattr(t, "scale") else (t,)
        out[name] = tuple(sh.subs(p.storage_shape(), env) for p in parts)
    return out
