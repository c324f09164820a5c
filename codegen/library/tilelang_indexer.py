"""TileLang indexer scoring: `indexer_scores` (ir/ops/attention.py), optionally fused with
`candidate_mask` (the REINDEX layers' restriction to the candidate-source pool).

score[t, c] = sum_h w[t, h] * relu(qI[t, h] . kI[c]) for c < vis(t) = (pos_t + 1) // ratio, -inf
elsewhere (and, with a pool, -inf outside the pool's blocks), in bf16 arithmetic as the op's (each
dot, each weighted term and the head sum rounded to bf16; ir/numerics.py), over the sequence's entries
gathered through block_table (entry c -> page block_table[seq][c // E], row c % E); the output is
[n, max_pages * E] like the op, -inf past the sequence's clen.

q and k are fp4 e2m1 with ue8m0 per-32 scales; both widen exactly to bf16, so the dot products
run on bf16 tensor cores with fp32 accumulation: S^T = K q^T with the 64 entries of a block as the
wgmma M and the 32 heads as N; relu, the head weights and the head sum follow in registers.

The pool (a candidate_blocks output: ascending block ids, -1 padded at the end) is tested by a
binary search per entry. The top-k selection (`topk_select`, and the fused `indexer_topk`) and the
candidate-block selection are not TileLang kernels yet.
"""
from typing import Any, Mapping

from ..targets import Target, building
from .tilelang_host import host_indexer_scores
from ..template import KernelSource, KernelSpec, Template, register
from .tilelang_attention import fp4_value
from .tilelang_gemm import _tl, ceil_div, e8m0_f32, source


def bf16r(T, v):
    """An fp32 value rounded to bf16 (to nearest even) and back: the op's bf16 arithmetic."""
    return T.Cast("float32", T.Cast("bfloat16", v))


def indexer_scores_program(n: int, H: int, Dq: int, pages: int, PE: int, nseq: int, maxp: int, ratio: int, *,
                           cand_blocks: int = 0, block_size: int = 8, block_C: int = 64, threads: int = 128):
    _, T = _tl()
    assert H % 8 == 0 and Dq % 32 == 0 and block_C == 64
    cap = maxp * PE
    nblk = ceil_div(cap, block_C)
    NC = max(cand_blocks, 1)
    steps = max(NC - 1, 1).bit_length()  # binary-search steps over the pool list

    @T.prim_func
    def indexer_scores(QI: T.Tensor((n, H, Dq // 2), "uint8"), QS: T.Tensor((n, H, Dq // 32), "uint8"),
                       W: T.Tensor((n, H), "bfloat16"), IK: T.Tensor((pages, PE, Dq // 2), "uint8"),
                       IKS: T.Tensor((pages, PE, Dq // 32), "uint8"), POS: T.Tensor((n,), "int64"),
                       TSEQ: T.Tensor((n,), "int32"), BT: T.Tensor((nseq, maxp), "int32"),
                       CAND: T.Tensor((n, NC), "int32"), S: T.Tensor((n, cap), "float32")):
        with T.Kernel(nblk, n, threads=threads) as (cb, t):
            Q_s = T.alloc_shared((H, Dq), "bfloat16")
            K_s = T.alloc_shared((block_C, Dq), "bfloat16")
            w_s = T.alloc_shared((H,), "float32")
            acc = T.alloc_fragment((block_C, H), "float32")
            out = T.alloc_fragment((block_C,), "float32")
            seq = TSEQ[t]
            vis = T.Cast("int32", (POS[t] + 1) // ratio)
            for h, d in T.Parallel(H, Dq):
                Q_s[h, d] = (fp4_value(T, T.bitwise_and(T.shift_right(T.Cast("int32", QI[t, h, d // 2]), (d % 2) * 4), 15))
                             * e8m0_f32(T, QS[t, h, d // 32]))
            for h in T.Parallel(H):
                w_s[h] = T.Cast("float32", W[t, h])
            for i, d in T.Parallel(block_C, Dq):
                c = cb * block_C + i
                pg = BT[seq, T.min(c // PE, maxp - 1)]
                K_s[i, d] = T.if_then_else(
                    c < vis,
                    fp4_value(T, T.bitwise_and(T.shift_right(T.Cast("int32", IK[pg, c % PE, d // 2]), (d % 2) * 4), 15))
                    * e8m0_f32(T, IKS[pg, c % PE, d // 32]), 0.0)
            T.clear(acc)
            T.gemm(K_s, Q_s, acc, transpose_B=True)
            for i, h in T.Parallel(block_C, H):
                acc[i, h] = bf16r(T, T.max(bf16r(T, acc[i, h]), 0.0) * w_s[h])
            T.reduce_sum(acc, out, dim=1)
            for i in T.Parallel(block_C):
                c = cb * block_C + i
                ok = c < vis
                if cand_blocks > 0:
                    # lower bound of block c // block_size in the ascending pool (-1 = past the end)
                    lo = T.alloc_var("int32")
                    hi = T.alloc_var("int32")
                    lo = 0
                    hi = NC
                    for _ in T.serial(steps + 1):
                        if lo < hi:
                            mid = (lo + hi) // 2
                            v = CAND[t, mid]
                            if v >= 0 and v < c // block_size:
                                lo = mid + 1
                            else:
                                hi = mid
                    ok = ok and lo < NC and CAND[t, T.min(lo, NC - 1)] == c // block_size
                if c < cap:
                    S[t, c] = T.if_then_else(ok, bf16r(T, out[i]), -T.infinity("float32"))

    return indexer_scores


def _dims(spec: KernelSpec) -> dict:
    qi, ik, bt = spec.in_types[0], spec.in_types[2], spec.in_types[5]
    return {"n": int(qi.shape[0]), "H": int(qi.shape[1]), "Dq": int(qi.shape[2]), "pages": int(ik.shape[0]),
            "PE": int(ik.shape[1]), "nseq": int(bt.shape[0]), "maxp": int(bt.shape[1]),
            "ratio": int(spec.attr["ratio"])}


def _render(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    d = _dims(spec)
    c = dict({"block_C": 64, "threads": 128}, **config)
    func = indexer_scores_program(**d, **c)
    return source(func, target.arch, {"template": "tilelang_indexer_scores", "config": c, "dims": d})


register(Template(
    name="tilelang_indexer_scores",
    ops=("indexer_scores",),
    targets=building("cuda"),
    knobs={"block_C": (64,), "threads": (128,)},
    render=_render,
    default_config=lambda target, spec: {"block_C": 64, "threads": 128},
    supports=lambda target, spec: _dims(spec)["H"] % 8 == 0 and _dims(spec)["Dq"] % 32 == 0,
    host=host_indexer_scores,
))
