"""TileLang-Ascend vector-core templates for ascend950's MoE routing and dispatch (spec §4.5):
moe_router (sqrt-softplus scores, top-k of score + bias, renormalised weights), moe_permute (pairs
grouped by expert), moe_gather_rows (the quantised token row of each pair) and moe_combine (each
token's expert rows summed in fp32, in ascending expert order).

Kernel conventions, and what is and is not verified, as in ascend_state.py: rendered and
capacity-checked here, never run on an Ascend 950, so nothing about them is verified.
"""
# no `from __future__ import annotations`: TileLang evaluates the prim_func's T.Tensor(...) hints

import functools

from ..targets import building
from ..template import Template, register
from .ascend_common import SIMT_CONTEXT_BYTES, TL_DTYPE, lower_ascend, ub_bytes
from .ascend_state import _THREADS, _default_threads, _threads, fits, kernel_source, row_tile, static, storage

SOFTPLUS_LINEAR = 20.0  # torch's softplus threshold: above it softplus(x) is x


# ---- moe_router ---------------------------------------------------------------------------------

def _router_plan(n: int, e: int, k: int, bm: int, with_ids: bool) -> dict:
    ub = [ub_bytes((e,), "f32"), ub_bytes((bm, e), "f32"), ub_bytes((bm, e), "f32"), ub_bytes((bm, k), "i32"),
          ub_bytes((bm, k), "f32"), SIMT_CONTEXT_BYTES]
    return {"ub": ub + ([ub_bytes((e,), "f32"), ub_bytes((n,), "i64")] if with_ids else [])}


@functools.lru_cache(maxsize=32)
def _router_source(n: int, e: int, k: int, scale: float, renorm: bool, image_id, bm: int, grid: int,
                   threads: int) -> str:
    import tilelang.ascend.language as T

    tiles = n // bm
    per = -(-tiles // grid)
    with_ids = image_id is not None
    renorm = renorm and k > 1

    @T.macro
    def body(logits, bias, bias_vl, ids, sel, weights):
        with T.Kernel(grid) as core:
            bb = T.alloc_shared((e,), T.float32)
            s = T.alloc_shared((bm, e), T.float32)
            score = T.alloc_shared((bm, e), T.float32)
            sb = T.alloc_shared((bm, k), T.int32)
            wb = T.alloc_shared((bm, k), T.float32)
            T.copy(bias[0], bb)
            if with_ids:
                vb = T.alloc_shared((e,), T.float32)
                ib = T.alloc_shared((n,), T.int64)
                T.copy(bias_vl[0], vb)
                T.copy(ids[0], ib)
            for it in T.serial(per):
                tile = it * grid + core
                if tile < tiles:
                    T.copy(logits[tile * bm, 0], s)
                    # one thread a row: s = sqrt(softplus(logit)), the selection score s + bias
                    # (bias_vl on image rows), k passes of a strict-> argmax so equal scores go to
                    # the lower expert id, each pick masked to -inf for the next pass
                    with T.SimtVF(threads=threads):
                        for i in T.Parallel(bm):
                            for x in T.serial(e):
                                v = s[i, x]
                                s[i, x] = T.sqrt(T.if_then_else(v > SOFTPLUS_LINEAR, v, T.log1p(T.exp(v))))
                                if with_ids:
                                    score[i, x] = s[i, x] + T.if_then_else(ib[tile * bm + i] == image_id, vb[x], bb[x])
                                else:
                                    score[i, x] = s[i, x] + bb[x]
                            total = T.alloc_var(T.float32)
                            best = T.alloc_var(T.float32)
                            pick = T.alloc_var(T.int32)
                            total = 0.0
                            for j in T.serial(k):
                                best = -T.infinity(T.float32)
                                pick = 0
                                for x in T.serial(e):
                                    if score[i, x] > best:
                                        best = score[i, x]
                                        pick = x
                                sb[i, j] = pick
                                wb[i, j] = s[i, pick]
                                total = total + s[i, pick]
                                score[i, pick] = -T.infinity(T.float32)
                            for j in T.serial(k):
                                if renorm:
                                    wb[i, j] = wb[i, j] / (total + 1e-20) * scale
                                else:
                                    wb[i, j] = wb[i, j] * scale
                    T.copy(sb, sel[tile * bm, 0])
                    T.copy(wb, weights[tile * bm, 0])

    if with_ids:
        @T.prim_func
        def moe_router(logits: T.Tensor((n, e), T.float32), bias: T.Tensor((e,), T.float32),
                       bias_vl: T.Tensor((e,), T.float32), ids: T.Tensor((n,), T.int64),
                       sel: T.Tensor((n, k), T.int32), weights: T.Tensor((n, k), T.float32)):
            body(logits, bias, bias_vl, ids, sel, weights)
    else:
        @T.prim_func
        def moe_router(logits: T.Tensor((n, e), T.float32), bias: T.Tensor((e,), T.float32),
                       sel: T.Tensor((n, k), T.int32), weights: T.Tensor((n, k), T.float32)):
            body(logits, bias, None, None, sel, weights)

    return lower_ascend(moe_router)


def _router_tile(n: int, e: int, k: int, cores: int, with_ids: bool, ub: int) -> int:
    """Rows per tile: row_tile's choice, halved until the tile's buffers fit the UB."""
    bm = row_tile(n, cores)
    while bm > 1 and sum(_router_plan(n, e, k, bm, with_ids)["ub"]) > ub:
        bm //= 2
    return bm


def _router_supports(target, spec):
    if not static(spec) or any(t.dtype.name != "f32" for t in spec.in_types[:2]):
        return False
    (n, e), _ = storage(spec.in_types[0])
    k, with_ids = int(spec.attr["k"]), len(spec.in_types) == 4
    if with_ids and (spec.in_types[1].shape != (e,) or spec.in_types[2].dtype.name != "f32"):
        return False  # a per-row [n, E] bias is not what this kernel reads
    if spec.in_types[1].shape != (e,) or k > e:
        return False
    bm = _router_tile(n, e, k, target.cores, with_ids, target.ub_bytes)
    return fits(target, _router_plan(n, e, k, bm, with_ids), [bm * e * 4])


def _router_render(target, spec, config):
    (n, e), _ = storage(spec.in_types[0])
    a = spec.attr
    k, image = int(a["k"]), a.get("image_token_id")
    with_ids = len(spec.in_types) == 4
    bm = _router_tile(n, e, k, target.cores, with_ids, target.ub_bytes)
    grid = min(n // bm, target.cores)
    text = _router_source(n, e, k, float(a["scale"]), bool(a["renorm"]), int(image) if with_ids else None, bm,
                          grid, _threads(config))
    return kernel_source("moe_router", text, grid, _threads(config), _router_plan(n, e, k, bm, with_ids),
                         [bm * e * 4], config)


register(Template(
    name="ascend_moe_router", ops=("moe_router",), targets=building("ascendc"), knobs=_THREADS,
    render=_router_render, default_config=_default_threads, supports=_router_supports))


# ---- moe_permute --------------------------------------------------------------------------------

def _permute_plan(pairs: int, e: int, chunk: int) -> dict:
    """the sorted pair ids and the expert counts whole, the selection streamed `chunk` pairs at a
    time (a prefill's selection and its order do not both fit the UB)"""
    return {"ub": [ub_bytes((chunk,), "i32"), ub_bytes((pairs,), "i32"), ub_bytes((e + 1,), "i32"),
                   SIMT_CONTEXT_BYTES]}


def _permute_chunk(n: int, k: int, e: int, ub: int) -> int:
    """Pairs per selection chunk: the whole selection where it fits (one padded DMA of any
    length), else whole rows of k ids (n divisible by the rows) in 32-byte granules, the largest
    such that the plan fits `ub`; 0 where none does."""
    for rows in (n, 4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        c = rows * k
        if (rows == n or (rows < n and n % rows == 0 and (c * 4) % 32 == 0)) \
                and sum(_permute_plan(n * k, e, c)["ub"]) <= ub:
            return c
    return 0


@functools.lru_cache(maxsize=32)
def _permute_source(n: int, k: int, e: int, chunk: int, threads: int) -> str:
    import tilelang.ascend.language as T

    pairs = n * k
    chunks = pairs // chunk

    # sel is the [n, k] selection read as its flat pair ids (row-major, contiguous): chunks of
    # whole rows are single 32-byte-granular DMAs
    @T.prim_func
    def moe_permute(sel: T.Tensor((pairs,), T.int32), order: T.Tensor((pairs,), T.int32),
                    offsets: T.Tensor((e + 1,), T.int32)):
        # one core: a counting sort by expert. Each thread owns experts and scans every pair
        # in pair order (the selection streamed chunk by chunk, chunks in order), so the pairs of
        # an expert keep token order (a stable sort)
        with T.Kernel(1) as core:  # noqa: F841
            sb = T.alloc_shared((chunk,), T.int32)
            ob = T.alloc_shared((pairs,), T.int32)
            cnt = T.alloc_shared((e + 1,), T.int32)
            with T.SimtVF(threads=threads):
                for x in T.Parallel(e + 1):
                    cnt[x] = 0
            for ci in T.serial(chunks):
                T.copy(sel[ci * chunk:(ci + 1) * chunk], sb)
                with T.SimtVF(threads=threads):
                    for x in T.Parallel(e):
                        c = T.alloc_var(T.int32)
                        c = cnt[x + 1]
                        for p in T.serial(chunk):
                            if sb[p] == x:
                                c = c + 1
                        cnt[x + 1] = c
            with T.SimtVF(threads=1):
                for x in T.serial(e):
                    cnt[x + 1] = cnt[x + 1] + cnt[x]
            # cnt[x] is now expert x's start; placing advances it to expert x's end
            for ci in T.serial(chunks):
                T.copy(sel[ci * chunk:(ci + 1) * chunk], sb)
                with T.SimtVF(threads=threads):
                    for x in T.Parallel(e):
                        at = T.alloc_var(T.int32)
                        at = cnt[x]
                        for p in T.serial(chunk):
                            if sb[p] == x:
                                ob[at] = ci * chunk + p
                                at = at + 1
                        cnt[x] = at
            # after placing, cnt[x] holds expert x's end = the start of x + 1: shift it up one
            with T.SimtVF(threads=1):
                for x in T.serial(e):
                    cnt[e - x] = cnt[e - x - 1]
                cnt[0] = 0
            T.copy(ob, order[0])
            T.copy(cnt, offsets[0])

    return lower_ascend(moe_permute)


def _permute_supports(target, spec):
    if not static(spec):
        return False
    (n, k), _ = storage(spec.in_types[0])
    return _permute_chunk(n, k, int(spec.attr["n_experts"]), target.ub_bytes) > 0


def _permute_render(target, spec, config):
    (n, k), _ = storage(spec.in_types[0])
    e = int(spec.attr["n_experts"])
    chunk = _permute_chunk(n, k, e, target.ub_bytes)
    text = _permute_source(n, k, e, chunk, _threads(config))
    return kernel_source("moe_permute", text, 1, _threads(config), _permute_plan(n * k, e, chunk), [], config)


register(Template(
    name="ascend_moe_permute", ops=("moe_permute",), targets=building("ascendc"), knobs=_THREADS,
    render=_permute_render, default_config=_default_threads, supports=_permute_supports))


# ---- moe_gather_rows ----------------------------------------------------------------------------

def _mgather_plan(pairs: int, d: int, nb: int) -> dict:
    return {"ub": [ub_bytes((pairs,), "i32"), ub_bytes((d,), "fp8e4m3"), ub_bytes((nb,), "e8m0")]}


@functools.lru_cache(maxsize=32)
def _mgather_source(n: int, d: int, nb: int, pairs: int, k: int, grid: int) -> str:
    import tilelang.ascend.language as T

    fp8 = TL_DTYPE["fp8e4m3"]
    per = -(-pairs // grid)

    @T.prim_func
    def moe_gather_rows(x: T.Tensor((n, d), fp8), x_scale: T.Tensor((n, nb), T.uint8),
                        pair_ids: T.Tensor((pairs,), T.int32), out: T.Tensor((pairs, d), fp8),
                        out_scale: T.Tensor((pairs, nb), T.uint8)):
        with T.Kernel(grid) as core:
            pb = T.alloc_shared((pairs,), T.int32)
            row = T.alloc_shared((d,), fp8)
            sc = T.alloc_shared((nb,), T.uint8)
            T.copy(pair_ids[0], pb)
            for it in T.serial(per):
                p = it * grid + core
                if p < pairs:
                    tok = pb[p] // k
                    T.copy(x[tok, 0], row)
                    T.copy(row, out[p, 0])
                    T.copy(x_scale[tok, 0], sc)
                    T.copy(sc, out_scale[p, 0])

    return lower_ascend(moe_gather_rows)


def _mgather_dims(spec):
    x = spec.in_types[0]
    (n, d), _ = storage(x.data)
    (pairs,), _ = storage(spec.in_types[1])
    return n, d, x.scale.shape[1], pairs


def _mgather_supports(target, spec):
    if not static(spec) or spec.in_types[0].scale.dtype.name != "e8m0":
        return False
    n, d, nb, pairs = _mgather_dims(spec)
    return d % 32 == 0 and nb % 32 == 0 and fits(target, _mgather_plan(pairs, d, nb))


def _mgather_render(target, spec, config):
    n, d, nb, pairs = _mgather_dims(spec)
    grid = min(pairs, target.cores)
    text = _mgather_source(n, d, nb, pairs, int(spec.attr["k"]), grid)
    return kernel_source("moe_gather_rows", text, grid, 0, _mgather_plan(pairs, d, nb), [d, nb], config)


register(Template(
    name="ascend_moe_gather_rows", ops=("moe_gather_rows",), targets=building("ascendc"), knobs={},
    render=_mgather_render, default_config=lambda target, spec: {}, supports=_mgather_supports))


# ---- moe_combine --------------------------------------------------------------------------------

def _combine_plan(chunk: int, per_core: int, k: int, d: int) -> dict:
    """pair ids streamed `chunk` at a time (a prefill's 49152 do not fit beside the rows), this
    core's inverse permutation, a token's k rows, one bf16 row and the fp32 sum"""
    return {"ub": [ub_bytes((chunk,), "i32"), ub_bytes((per_core * k,), "i32"), ub_bytes((k,), "i32"),
                   ub_bytes((d,), "bf16"), ub_bytes((d,), "f32"), SIMT_CONTEXT_BYTES]}


def _combine_chunk(pairs: int, per_core: int, k: int, d: int, ub: int) -> int:
    """Pair ids per chunk: all of them where they fit, else the largest power of two (from 8:
    whole granules) dividing the pairs that fits; 0 where none does."""
    options = (pairs,) + tuple(c for c in (16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8)
                               if c < pairs and pairs % c == 0)
    return next((c for c in options if sum(_combine_plan(c, per_core, k, d)["ub"]) <= ub), 0)


@functools.lru_cache(maxsize=32)
def _combine_source(n: int, d: int, pairs: int, e: int, k: int, grid: int, chunk: int, threads: int) -> str:
    import tilelang.ascend.language as T

    per = -(-n // grid)  # core c sums tokens [c * per, (c + 1) * per)
    chunks = pairs // chunk

    @T.prim_func
    def moe_combine(y: T.Tensor((pairs, d), T.bfloat16), pair_ids: T.Tensor((pairs,), T.int32),
                    offsets: T.Tensor((e + 1,), T.int32), like: T.Tensor((n, k), T.int32),
                    out: T.Tensor((n, d), T.float32)):
        with T.Kernel(grid) as core:
            pb = T.alloc_shared((chunk,), T.int32)
            where = T.alloc_shared((per * k,), T.int32)
            rows = T.alloc_shared((k,), T.int32)
            yb = T.alloc_shared((d,), T.bfloat16)
            acc = T.alloc_shared((d,), T.float32)
            # where[(t - t0) * k + lane] = the expert-ordered row of pair t * k + lane (the
            # permutation inverted for this core's tokens), the pair ids read chunk by chunk
            for ci in T.serial(chunks):
                T.copy(pair_ids[ci * chunk:(ci + 1) * chunk], pb)
                with T.SimtVF(threads=threads):
                    for p in T.Parallel(chunk):
                        if pb[p] >= core * per * k and pb[p] < (core + 1) * per * k:
                            where[pb[p] - core * per * k] = ci * chunk + p
            for tl in T.serial(per):
                t = core * per + tl
                if t < n:
                    # a token's rows in ascending row order = ascending expert order
                    with T.SimtVF(threads=1):
                        for j in T.serial(k):
                            rows[j] = where[tl * k + j]
                        for j in T.serial(1, k):
                            for u in T.serial(j):
                                if rows[j - u - 1] > rows[j - u]:
                                    tmp = rows[j - u]
                                    rows[j - u] = rows[j - u - 1]
                                    rows[j - u - 1] = tmp
                    with T.SimtVF(threads=threads):
                        for i in T.Parallel(d):
                            acc[i] = 0.0
                    for j in T.serial(k):
                        T.copy(y[rows[j], 0], yb)
                        with T.SimtVF(threads=threads):
                            for i in T.Parallel(d):
                                acc[i] = acc[i] + T.cast(yb[i], T.float32)
                    T.copy(acc, out[t, 0])

    return lower_ascend(moe_combine)


def _combine_dims(spec):
    (pairs, d), _ = storage(spec.in_types[0])
    (e1,), _ = storage(spec.in_types[2])
    (n, k), _ = storage(spec.in_types[3])
    return n, d, pairs, e1 - 1, k


def _combine_supports(target, spec):
    if not static(spec) or spec.in_types[0].dtype.name != "bf16":
        return False
    n, d, pairs, e, k = _combine_dims(spec)
    if pairs != n * k or k != int(spec.attr["k"]):
        return False  # every (token, lane) pair once: the inverse permutation needs it
    per = -(-n // min(n, target.cores))
    return (d * 2) % 32 == 0 and _combine_chunk(pairs, per, k, d, target.ub_bytes) > 0


def _combine_render(target, spec, config):
    n, d, pairs, e, k = _combine_dims(spec)
    grid = min(n, target.cores)
    per = -(-n // grid)
    chunk = _combine_chunk(pairs, per, k, d, target.ub_bytes)
    text = _combine_source(n, d, pairs, e, k, grid, chunk, _threads(config))
    return kernel_source("moe_combine", text, grid, _threads(config), _combine_plan(chunk, per, k, d),
                         [d * 2, d * 4], config)


register(Template(
    name="ascend_moe_combine", ops=("moe_combine",), targets=building("ascendc"), knobs=_THREADS,
    render=_combine_render, default_config=_default_threads, supports=_combine_supports))
