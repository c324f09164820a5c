"""TileLang-Ascend `indexer_topk` for ascend950 (ir/ops/fused.py): the index scores of a row over
its sequence's compressed entries, restricted to the candidate pool where one is passed, the
top-k entries (lowest position first on equal scores) in ascending order, and at the candidate
source the pool (the top blocks of 8 entries, the newest pinned).

One AI core per row (`T.Persistent` over rows). Per block of `BI` entries (inside one page of the
index-K cache, whose page comes from the block table):
- vector core: the packed fp4 keys and their ue8m0 scales GM -> UB (one DMA each, the block's
  entries are contiguous in the page), widened by SIMT to bf16 (e2m1 x 2^(s-127) is exact in bf16);
- cube: S = q K^T [heads, BI] into L0C (q widened the same way once per row), fp32 accumulation;
- vector, one SIMT thread per entry: sum over heads of w[h] * relu(S[h, e]) (w times `w_scale`
  rounded to w's dtype first, as `scale` does) in the op's bf16 arithmetic (each dot, each term and
  the sum rounded to bf16, ir/numerics.py); entries at or past the row's visible count
  (pos + 1) // ratio, and entries outside the pool, score -inf; the score's order-preserving int32
  key (-0.0 and +0.0 one key) goes to the chunk's key buffer, and at the candidate source each
  8-entry block's largest key to the block-key buffer.
Selection, per chunk of `C` entries (the keys of a row's whole visible range need not fit the
UB): the running picks (at most k keys and positions, in ascending position) and the chunk's
keys, which follow them in position order, are cut to the top min(k, count): the k-th largest key
T is found 6 bits at a time (64 SIMT threads each count the keys at or above one candidate value
of the next 6 bits; 6 passes for 32 bits), then one thread keeps, in position order, every key
above T and the first (k - #above) keys equal to T. Kept in position order, equal keys keep the
lowest positions: the reference's stable top-k, re-sorted ascending. Positions past the visible
count never enter, so a row that sees fewer than k entries gets all of them and -1 after, as the
reference's "not visible -> -1" rule gives. The pool is the same selection over the block keys.

The selection counts against thresholds rather than sorting, so the Ascend vector sort's 32-element
groups are not used; the template still holds every key and pick buffer to whole 32-element
multiples (k, the pool size, BI and C), so a sort-based selection could replace it with the same
buffers.

Numerics: the reference takes each fp4 dot product exactly (fp64) and sums the heads in fp64
before each bf16 rounding; here the cube sums each dot in fp32 and the heads are summed in fp32, so
a score can land on the neighbouring bf16 value and near-equal scores can be picked differently. Rendered and capacity-checked here
(TileLang-Ascend has no CPU execution path in this install), never built with CANN or run on an
Ascend 950: unverified.
"""
# no `from __future__ import annotations`: TileLang evaluates the prim_func's T.Tensor hints

import functools

from ..targets import building
from ..template import KernelSource, KernelSpec, Template, register
from .ascend_common import SIMT_CONTEXT_BYTES, TL_DTYPE, align32, e2m1_f32, lower_ascend
from .ascend_state import static
from .tilelang_gemm import e8m0_f32

BI = 64  # entries per cube block (a page holds 64 or 128)
SEL = 64  # SIMT threads of the threshold search: 6 bits a pass
WIDEN = 128  # SIMT threads of the fp4 widening
NEG_KEY = -2139095041  # order key of -inf (0xFF800000 ^ 0x7FFFFFFF as int32)
POS_KEY = 2139095040  # order key of +inf (0x7F800000)
SHIFTS = (26, 20, 14, 8, 2, 0)  # the threshold's bits, 6 per pass from the top


def indexer_dims(spec: KernelSpec) -> dict:
    qi, w, ik, pos, tseq, bt = spec.in_types[:6]
    n, h, d = qi.shape
    pages, pe, _ = ik.shape
    nseq, maxp = bt.shape
    a = spec.attr
    return {"n": n, "H": h, "D": d, "pages": pages, "PE": pe, "nseq": nseq, "maxp": maxp, "cap": maxp * pe,
            "k": int(a["k"]), "ratio": int(a["ratio"]), "emit": bool(a["emit_candidates"]),
            "pool": len(spec.in_types) > 6, "bs": int(a["block_size"]), "tb": int(a["topk_blocks"]),
            "cand": spec.in_types[6].shape[1] if len(spec.in_types) > 6 else 0, "wdt": w.dtype.name,
            "w_scale": a.get("w_scale")}


def indexer_plan(d: dict, chunk: int, cores: int) -> dict:
    """Grid and on-chip bytes per scope for `chunk` entries' keys per selection round."""
    h, dd, k, nbl = d["H"], d["D"], d["k"], d["cap"] // d["bs"]
    ub = [align32(h * dd // 2), align32(h * dd // 32), align32(h * 4)]  # packed q, its scales, w
    ub += [align32(h * dd * 2), align32((h + 1) * dd * 2)]  # q in bf16 (+ the nd2nz copy to L1)
    ub += [align32(BI * dd // 2), align32(BI * dd // 32)]  # a block's packed keys and scales
    ub += [align32(BI * dd * 2), align32((BI + 1) * dd * 2)]  # keys in bf16 (+ nd2nz)
    ub += [align32(h * BI * 4)]  # S
    ub += [align32(chunk * 4), align32(k * 4), align32(k * 4), align32(k * 4)]  # chunk keys, picks, out
    ub += [align32(SEL * 4), align32(8 * 8)]  # per-thread counts, selection state
    if d["emit"]:
        ub += [align32(nbl * 4), align32(d["tb"] * 4)]  # block keys, pool out
    if d["pool"]:
        ub += [align32(d["cand"] * 4), align32(nbl * 4)]  # the row's pool, block membership
    ub.append(SIMT_CONTEXT_BYTES)
    return {"grid": min(d["n"], cores),
            "buffers": {"ub": ub, "l1": [align32(h * dd * 2), align32(BI * dd * 2)],
                        "l0a": [2 * h * dd * 2], "l0b": [2 * BI * dd * 2], "l0c": [align32(h * BI * 4)]}}


def indexer_chunk(d: dict, target) -> int:
    """The largest chunk (whole blocks, at most the row's capacity) whose plan fits the UB; 0 where
    none does."""
    for c in (65536, 32768, 16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64):
        if c <= max(d["cap"], BI) and sum(indexer_plan(d, c, target.cores)["buffers"]["ub"]) <= target.ub_bytes:
            return c
    return 0


@functools.lru_cache(maxsize=32)
def _indexer_source(n: int, H: int, D: int, pages: int, PE: int, nseq: int, maxp: int, k: int, ratio: int,
                    emit: bool, pool: bool, bs: int, tb: int, ncand: int, wdt: str, w_scale, chunk: int,
                    grid: int) -> str:
    import tilelang.ascend.language as T

    cap = maxp * PE
    nbl = cap // bs
    nch = -(-cap // chunk)
    wt = TL_DTYPE[wdt]

    @T.macro
    def threshold(total, want, st, cnt, pk, ck, bk, blocks):
        """st[0] <- the largest u-value T with #(u >= T) >= want over `total` keys (u = key + 2^31;
        want >= 1 and at most total, so T exists): 6 bits a pass, 64 candidates a pass."""
        with T.SimtVF(threads=1):
            st[0] = 0
        for ps in T.serial(len(SHIFTS)):
            with T.SimtVF(threads=SEL):
                j = T.get_thread_binding()
                cnd = st[0] + T.shift_left(T.Cast("int64", j), T.Cast("int64", T.max(26 - 6 * ps, 0)))
                c = T.alloc_var(T.int32)
                c = 0
                for i in T.serial(total):
                    if blocks:
                        if T.Cast("int64", bk[i]) + 2147483648 >= cnd:
                            c = c + 1
                    else:
                        if T.Cast("int64", T.if_then_else(i < st[1], pk[T.min(i, k - 1)],
                                                          ck[T.max(T.Cast("int32", i - st[1]), 0)])) \
                                + 2147483648 >= cnd:
                            c = c + 1
                cnt[j] = c
            with T.SimtVF(threads=1):
                best = T.alloc_var(T.int64)
                best = 0
                for j in T.serial(SEL):
                    if cnt[j] >= want:
                        best = T.Cast("int64", j)
                st[0] = st[0] + T.shift_left(best, T.Cast("int64", T.max(26 - 6 * ps, 0)))

    @T.macro
    def body(QI, QIS, W, IK, IKS, POS, TSEQ, BT, CAND, TOP, POOL):
        with T.Kernel(grid) as core:
            q4 = T.alloc_shared((H, D // 2), T.uint8)
            qs = T.alloc_shared((H, D // 32), T.uint8)
            wb = T.alloc_shared((H,), wt)
            q_ub = T.alloc_shared((H, D), T.bfloat16)
            k4 = T.alloc_shared((BI, D // 2), T.uint8)
            ks = T.alloc_shared((BI, D // 32), T.uint8)
            k_ub = T.alloc_shared((BI, D), T.bfloat16)
            s_ub = T.alloc_shared((H, BI), T.float32)
            ck = T.alloc_shared((chunk,), T.int32)
            pk = T.alloc_shared((k,), T.int32)  # picks: keys
            pi = T.alloc_shared((k,), T.int32)  # picks: positions
            out = T.alloc_shared((k,), T.int32)
            cnt = T.alloc_shared((SEL,), T.int32)
            st = T.alloc_shared((8,), T.int64)  # threshold, picks held, row's visible count
            if emit:
                bk = T.alloc_shared((nbl,), T.int32)
                pout = T.alloc_shared((tb,), T.int32)
            if pool:
                cb = T.alloc_shared((ncand,), T.int32)
                mem = T.alloc_shared((nbl,), T.int32)
            q_l1 = T.alloc_l1((H, D), T.bfloat16)
            k_l1 = T.alloc_l1((BI, D), T.bfloat16)
            s_acc = T.alloc_l0c((H, BI), T.float32)
            for t in T.Persistent([n], grid, core):
                seq = TSEQ[t]
                vis = T.min(T.Cast("int32", (POS[t] + 1) // ratio), cap)
                T.copy(QI[t, 0:H, 0:D // 2], q4)
                T.copy(QIS[t, 0:H, 0:D // 32], qs)
                T.copy(W[t, 0:H], wb)
                with T.SimtVF(threads=WIDEN):
                    tid = T.get_thread_binding()
                    for s in T.serial(H * D // WIDEN):
                        h = (s * WIDEN + tid) // D
                        c = (s * WIDEN + tid) % D
                        nib = T.bitwise_and(T.shift_right(T.Cast("int32", q4[h, c // 2]), (c % 2) * 4), 15)
                        q_ub[h, c] = T.cast(e2m1_f32(T, nib) * e8m0_f32(T, qs[h, c // 32]), T.bfloat16)
                T.copy(q_ub, q_l1)
                with T.SimtVF(threads=1):
                    st[1] = 0
                    st[2] = T.Cast("int64", vis)
                if emit:
                    with T.SimtVF(threads=SEL):
                        for b in T.Parallel(nbl):
                            bk[b] = NEG_KEY
                if pool:
                    T.copy(CAND[t, 0:ncand], cb)
                    with T.SimtVF(threads=SEL):
                        for b in T.Parallel(nbl):
                            mem[b] = 0
                    with T.SimtVF(threads=SEL):
                        for j in T.Parallel(ncand):
                            if cb[j] >= 0 and cb[j] < nbl:
                                mem[cb[j]] = 1
                for ci in T.serial(nch):
                    c0 = ci * chunk
                    if c0 < vis:
                        for b in T.serial(chunk // BI):
                            e0 = c0 + b * BI
                            if e0 < vis:
                                page = T.max(BT[seq, e0 // PE], 0)
                                T.copy(IK[page, e0 % PE:e0 % PE + BI, 0:D // 2], k4)
                                T.copy(IKS[page, e0 % PE:e0 % PE + BI, 0:D // 32], ks)
                                with T.SimtVF(threads=WIDEN):
                                    tid = T.get_thread_binding()
                                    for s in T.serial(BI * D // WIDEN):
                                        i = (s * WIDEN + tid) // D
                                        c = (s * WIDEN + tid) % D
                                        nib = T.bitwise_and(T.shift_right(T.Cast("int32", k4[i, c // 2]),
                                                                          (c % 2) * 4), 15)
                                        k_ub[i, c] = T.cast(e2m1_f32(T, nib) * e8m0_f32(T, ks[i, c // 32]),
                                                            T.bfloat16)
                                T.copy(k_ub, k_l1)
                                T.gemm(q_l1, k_l1, s_acc, transpose_B=True, clear_accum=True)
                                T.copy(s_acc, s_ub)
                                with T.SimtVF(threads=BI):
                                    i = T.get_thread_binding()
                                    acc = T.alloc_var(T.float32)
                                    acc = 0.0
                                    for h in T.serial(H):
                                        wv = T.alloc_var(T.float32)
                                        wv = T.cast(wb[h], T.float32)
                                        if w_scale is not None:
                                            wv = T.cast(T.cast(wv * T.float32(w_scale), wt), T.float32)
                                        # bf16 arithmetic (ir/numerics.py): the dot, each term, the sum
                                        dot = T.alloc_var(T.float32)
                                        dot = T.cast(T.cast(T.max(s_ub[h, i], T.float32(0.0)), T.bfloat16), T.float32)
                                        acc = acc + T.cast(T.cast(wv * dot, T.bfloat16), T.float32)
                                    acc = T.cast(T.cast(acc, T.bfloat16), T.float32)
                                    bits = T.reinterpret(acc, "int32")
                                    # order key; -0.0 and +0.0 one key (0)
                                    key = T.if_then_else(acc == T.float32(0.0), 0, T.if_then_else(
                                        bits < 0, T.bitwise_xor(bits, 2147483647), bits))
                                    if pool:
                                        ck[b * BI + i] = T.if_then_else(
                                            e0 + i < vis and mem[(e0 + i) // bs] != 0, key, NEG_KEY)
                                    else:
                                        ck[b * BI + i] = T.if_then_else(e0 + i < vis, key, NEG_KEY)
                                if emit:
                                    with T.SimtVF(threads=BI // bs):
                                        g = T.get_thread_binding()
                                        m = T.alloc_var(T.int32)
                                        m = NEG_KEY
                                        for j in T.serial(bs):
                                            if e0 + g * bs + j < vis:
                                                m = T.max(m, ck[b * BI + g * bs + j])
                                        bk[(e0 + g * bs) // bs] = m
                        # the picks so far, then this chunk's visible keys, in position order
                        total = T.Cast("int32", st[1]) + T.min(chunk, vis - c0)
                        threshold(total, T.min(k, total), st, cnt, pk, ck, None, False)
                        with T.SimtVF(threads=1):
                            above = T.alloc_var(T.int32)
                            above = 0
                            held = T.Cast("int32", st[1])
                            for i in T.serial(total):
                                kv = T.if_then_else(i < held, pk[T.min(i, k - 1)], ck[T.max(i - held, 0)])
                                if T.Cast("int64", kv) + 2147483648 > st[0]:
                                    above = above + 1
                            need = T.alloc_var(T.int32)
                            need = T.min(k, total) - above
                            w = T.alloc_var(T.int32)
                            w = 0
                            for i in T.serial(total):
                                kv = T.if_then_else(i < held, pk[T.min(i, k - 1)], ck[T.max(i - held, 0)])
                                u = T.Cast("int64", kv) + 2147483648
                                pos_i = T.if_then_else(i < held, pi[T.min(i, k - 1)], c0 + i - held)
                                if u > st[0] or (u == st[0] and need > 0):
                                    if u == st[0]:
                                        need = need - 1
                                    pk[w] = kv
                                    pi[w] = pos_i
                                    w = w + 1
                            st[1] = T.Cast("int64", w)
                with T.SimtVF(threads=SEL):
                    for j in T.Parallel(k):
                        out[j] = T.if_then_else(j < st[1], pi[j], -1)
                T.copy(out, TOP[t, 0:k])
                if emit:
                    with T.SimtVF(threads=1):
                        if vis > 0:
                            bk[(vis - 1) // bs] = POS_KEY
                    threshold(nbl, min(tb, nbl), st, cnt, None, None, bk, True)
                    with T.SimtVF(threads=1):
                        above = T.alloc_var(T.int32)
                        above = 0
                        for i in T.serial(nbl):
                            if T.Cast("int64", bk[i]) + 2147483648 > st[0]:
                                above = above + 1
                        need = T.alloc_var(T.int32)
                        need = min(tb, nbl) - above
                        w = T.alloc_var(T.int32)
                        w = 0
                        for i in T.serial(nbl):
                            u = T.Cast("int64", bk[i]) + 2147483648
                            if u > st[0] or (u == st[0] and need > 0):
                                if u == st[0]:
                                    need = need - 1
                                if bk[i] != NEG_KEY:  # picked -inf blocks are dropped
                                    pout[w] = i
                                    w = w + 1
                        for j in T.serial(tb):
                            if j >= w:
                                pout[j] = -1
                    T.copy(pout, POOL[t, 0:tb])

    if emit:
        @T.prim_func
        def indexer_topk(qi: T.Tensor((n, H, D // 2), T.uint8), qi_scale: T.Tensor((n, H, D // 32), T.uint8),
                         w: T.Tensor((n, H), wt), ik: T.Tensor((pages, PE, D // 2), T.uint8),
                         ik_scale: T.Tensor((pages, PE, D // 32), T.uint8), positions: T.Tensor((n,), T.int64),
                         token_seq: T.Tensor((n,), T.int32), block_table: T.Tensor((nseq, maxp), T.int32),
                         top: T.Tensor((n, k), T.int32), pool_out: T.Tensor((n, tb), T.int32)):
            body(qi, qi_scale, w, ik, ik_scale, positions, token_seq, block_table, None, top, pool_out)
    elif pool:
        @T.prim_func
        def indexer_topk(qi: T.Tensor((n, H, D // 2), T.uint8), qi_scale: T.Tensor((n, H, D // 32), T.uint8),
                         w: T.Tensor((n, H), wt), ik: T.Tensor((pages, PE, D // 2), T.uint8),
                         ik_scale: T.Tensor((pages, PE, D // 32), T.uint8), positions: T.Tensor((n,), T.int64),
                         token_seq: T.Tensor((n,), T.int32), block_table: T.Tensor((nseq, maxp), T.int32),
                         cand: T.Tensor((n, ncand), T.int32), top: T.Tensor((n, k), T.int32)):
            body(qi, qi_scale, w, ik, ik_scale, positions, token_seq, block_table, cand, top, None)
    else:
        @T.prim_func
        def indexer_topk(qi: T.Tensor((n, H, D // 2), T.uint8), qi_scale: T.Tensor((n, H, D // 32), T.uint8),
                         w: T.Tensor((n, H), wt), ik: T.Tensor((pages, PE, D // 2), T.uint8),
                         ik_scale: T.Tensor((pages, PE, D // 32), T.uint8), positions: T.Tensor((n,), T.int64),
                         token_seq: T.Tensor((n,), T.int32), block_table: T.Tensor((nseq, maxp), T.int32),
                         top: T.Tensor((n, k), T.int32)):
            body(qi, qi_scale, w, ik, ik_scale, positions, token_seq, block_table, None, top, None)

    return lower_ascend(indexer_topk)


def _supports(target, spec: KernelSpec) -> bool:
    if not static(spec):
        return False
    qi, w, ik = spec.in_types[:3]
    fmt = all(hasattr(x, "scale") and x.data.dtype.name == "fp4e2m1" and x.scale.dtype.name == "e8m0"
              and tuple(x.block)[-1] == 32 for x in (qi, ik))
    if not fmt or w.dtype.name not in ("bf16", "f32"):
        return False
    d = indexer_dims(spec)
    if d["emit"] and d["pool"]:
        return False  # a candidate source scoring inside another pool: not in the V4.1 graph
    return (d["D"] % 128 == 0 and d["H"] % 16 == 0 and d["PE"] % BI == 0 and d["cap"] % d["bs"] == 0
            and BI % d["bs"] == 0 and d["k"] % 32 == 0 and (not d["emit"] or d["tb"] % 32 == 0)
            and indexer_chunk(d, target) > 0)


def _render(target, spec: KernelSpec, config) -> KernelSource:
    d = indexer_dims(spec)
    chunk = indexer_chunk(d, target)
    p = indexer_plan(d, chunk, target.cores)
    ws = d["w_scale"]
    text = _indexer_source(d["n"], d["H"], d["D"], d["pages"], d["PE"], d["nseq"], d["maxp"], d["k"], d["ratio"],
                           d["emit"], d["pool"], d["bs"], d["tb"], d["cand"], d["wdt"],
                           None if ws is None else float(ws), chunk, p["grid"])
    return KernelSource(language="ascendc", entry="indexer_topk_kernel", text=text, grid=(p["grid"],),
                        block=(WIDEN,), meta={"buffers": p["buffers"], "config": {"chunk": chunk, **(config or {})},
                                              "dims": d, "gm_row_bytes": [d["D"] // 2 * BI]})


register(Template(
    name="ascend_indexer_topk", ops=("indexer_topk",), targets=building("ascendc"), knobs={},
    render=_render, default_config=lambda target, spec: {}, supports=_supports))
