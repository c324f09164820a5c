"""One pipeline per target: a flat list of graph passes, each with why it is there and what it
must precede. Bucket specialisation and memory planning follow in the compile driver (they turn
the final graph into per-bucket launch shapes and arenas)."""
from __future__ import annotations

from functools import partial

from ..codegen.target import get_target
from ..ir.verify import verify
from .attention import lower_sparse_attention
from .fuse import fuse
from .kernels import select_kernels
from .moe import lower_moe_dispatch
from .quant import legalize_quant
from .shapes import infer_shapes


def _pipeline(target: str, ep: int = 1):
    t = get_target(target)
    return [
        # the builder's graph must be sound before any pass reads it; errors name the node
        ("verify", verify),
        # every later rule reads value types; make them the op rules' output, not the builder's
        ("infer_shapes", infer_shapes),
        # check the spec's activation quantisation and record the target's operand formats;
        # before fusion, which would hide the quantisation nodes it checks
        ("legalize_quant", partial(legalize_quant, target=target)),
        # rule-list fusion (norm+quant, rope+quant, mHC entry, router, swiglu+quant, pooling+norm,
        # indexer); before the lowerings so they see the fused indexer and quantised activations
        ("fuse", fuse),
        # share top-k buffers (REUSE layers) and check each attention against its indexer's cache
        ("lower_sparse_attention", lower_sparse_attention),
        # MoE into permute / grouped GEMMs / combine (+ all-to-all for ep > 1); after fusion so the
        # router's outputs feed it, before kernel selection which needs the grouped GEMMs
        ("lower_moe_dispatch", partial(lower_moe_dispatch, ep=ep)),
        # rewrites introduced values; recompute and verify every type before choosing kernels
        ("infer_shapes_final", infer_shapes),
        ("verify_final", verify),
        # every node becomes a call of one named template of this target; last, as it reads the
        # final ops and their operand formats
        ("select_kernels", partial(select_kernels, target=t)),
    ]


PIPELINES = {name: partial(_pipeline, name) for name in ("cpu", "sm90", "sm100", "ascend950")}
