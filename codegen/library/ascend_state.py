"""TileLang-Ascend vector-core templates for ascend950: the ops that read and write a step's state
(the window ring, the compressor state ring and its paged caches, the Engram history) and the
Engram lookup around them: engram_hash, engram_gather, engram_ngram_ids, engram_hist_write,
engram_gate, swa_write, compress_state_write, compressed_write, compress_pool_norm.

Every kernel is a persistent 1-D grid over AI cores (core c takes work items c, c + grid, ...;
the grid never exceeds the cores). Index math runs on the scalar unit from small UB copies of the
batch metadata (positions, token_seq, seq_slots, block_table); row data moves GM -> UB -> GM by
DMA at a GM address computed from them, and arithmetic runs in `T.SimtVF` regions over UB. State
buffers are kernel parameters that are written in place (no copy of the state is made).

Batch layout they rely on (the same as the op references, ir/ops/attention.py): a sequence's rows
are contiguous and at consecutive positions, so row t - r holds position pos_t - r exactly when it
belongs to the same sequence, and a row survives in a ring of L slots exactly when row t + L is
past its sequence (`ring_keep`: the newest L positions of each sequence).

GM transfers: TileLang lowers every GM <-> UB copy to the padded DMA (`asc_copy_*_align`), which
moves any byte count into a 32-byte-aligned UB buffer, so small index vectors and scale rows
(8 or 16 bytes) go through a buffer of their own granule; `gm_row_bytes` lists the bulk rows
(activation, cache and state rows), and `supports` declines shapes where those are not 32-byte
multiples. Distinct rows write distinct state entries, so cores never write the same bytes.

Numerics: TileLang 0.1.15's Ascend backend has no CPU execution path (its runtime needs torch_npu
and an NPU), so these kernels are rendered and capacity-checked here, built only where CANN's
`bisheng` exists, and have never run on an Ascend 950: nothing about them is verified.
"""
# no `from __future__ import annotations`: TileLang evaluates the prim_func's T.Tensor(...) hints

import functools

from ..targets import building
from ..template import KernelSource, KernelSpec, Template, register
from .ascend_common import GRANULE, SIMT_CONTEXT_BYTES, TL_DTYPE, const_at, lower_ascend, ub_bytes

DEAD = -1  # ir.ops.engram.DEAD: the compressed id of an image token


def storage(t) -> tuple[tuple[int, ...], str]:
    """(storage shape, IR dtype name) of a tensor type: fp4 packs its last dim two per byte."""
    return tuple(t.storage_shape()), t.dtype.name


def static(spec: KernelSpec) -> bool:
    """Every dim of every operand and result is an int (what a rendered kernel needs)."""
    parts = []
    for t in (*spec.in_types, *spec.out_types):
        parts += [t.data, t.scale] if hasattr(t, "scale") else [t]
    return all(isinstance(d, int) for p in parts for d in p.shape)


def fits(target, plan: dict, gm_rows=()) -> bool:
    """The buffer plan fits the target's capacities and the bulk GM rows are whole granules (what
    capacity.ascend_check will hold the rendered kernel to)."""
    return (all(sum(sizes) <= getattr(target, f"{scope}_bytes") for scope, sizes in plan.items())
            and all(r % GRANULE == 0 for r in gm_rows))


def row_tile(n: int, cores: int, options=(64, 32, 16, 8, 4, 2, 1)) -> int:
    """Rows per work item: the largest option dividing n (no partial tile to clip) that still
    leaves every core an item when there are rows enough."""
    return next(b for b in options if n % b == 0 and b <= max(1, n // cores))


def kernel_source(entry: str, text: str, grid: int, threads: int, plan: dict, gm_rows, config) -> KernelSource:
    return KernelSource(language="ascendc", entry=f"{entry}_kernel", text=text, grid=(grid,),
                        block=(threads,) if threads else (), meta={"buffers": plan, "gm_row_bytes": list(gm_rows),
                                                                   "config": dict(config)})


def _threads(config) -> int:
    return int(config["threads"])


_THREADS = {"threads": (32, 64, 128)}


def _default_threads(target, spec):
    return {"threads": 64}


# ---- engram_hash --------------------------------------------------------------------------------

def _hash_plan(bm: int, g: int, cols: int) -> dict:
    return {"ub": [ub_bytes((bm, g), "i64"), ub_bytes((bm, cols), "i64"), SIMT_CONTEXT_BYTES]}


@functools.lru_cache(maxsize=32)
def _hash_source(n: int, g: int, heads: int, mult: tuple, primes: tuple, offs: tuple, bm: int, grid: int,
                 threads: int) -> str:
    import tilelang.ascend.language as T

    cols = (g - 1) * heads
    tiles = n // bm
    per = -(-tiles // grid)

    @T.prim_func
    def engram_hash(grams: T.Tensor((n, g), T.int64), table_rows: T.Tensor((n, cols), T.int64)):
        with T.Kernel(grid) as core:
            gb = T.alloc_shared((bm, g), T.int64)
            ob = T.alloc_shared((bm, cols), T.int64)
            for it in T.serial(per):
                tile = it * grid + core
                if tile < tiles:
                    T.copy(grams[tile * bm, 0], gb)
                    # acc = g0*m0 ^ g1*m1 ^ ... in int64 (wrapping products, as torch's); column
                    # (o, h) = acc after o + 1 terms, floor-mod its prime, plus its offset
                    with T.SimtVF(threads=threads):
                        for i in T.Parallel(bm):
                            acc = T.alloc_var(T.int64)
                            acc = gb[i, 0] * mult[0]
                            for o in T.unroll(1, g, explicit=True):
                                acc = acc ^ (gb[i, o] * const_at(mult, o, "int64"))
                                for h in T.unroll(heads, explicit=True):
                                    ob[i, (o - 1) * heads + h] = (acc % const_at(primes, (o - 1) * heads + h, "int64")
                                                                  + const_at(offs, (o - 1) * heads + h, "int64"))
                    T.copy(ob, table_rows[tile * bm, 0])

    return lower_ascend(engram_hash)


def _hash_supports(target, spec):
    if not static(spec):
        return False
    (n, g), _ = storage(spec.in_types[0])
    bm, cols = row_tile(n, target.cores), len(spec.attr["primes"])
    return fits(target, _hash_plan(bm, g, cols), [bm * g * 8, bm * cols * 8])


def _hash_render(target, spec, config):
    (n, g), _ = storage(spec.in_types[0])
    a = spec.attr
    bm = row_tile(n, target.cores)
    grid = min(n // bm, target.cores)
    text = _hash_source(n, g, int(a["heads"]), tuple(a["multipliers"]), tuple(a["primes"]), tuple(a["offsets"]),
                        bm, grid, _threads(config))
    cols = len(a["primes"])
    return kernel_source("engram_hash", text, grid, _threads(config), _hash_plan(bm, g, cols),
                         [bm * g * 8, bm * cols * 8], config)


register(Template(
    name="ascend_engram_hash", ops=("engram_hash",), targets=building("ascendc"), knobs=_THREADS,
    render=_hash_render, default_config=_default_threads, supports=_hash_supports))


# ---- engram_gather ------------------------------------------------------------------------------

def _gather_plan(c: int, d: int, nb: int) -> dict:
    # one granule per column's scale row (the DMA lands each in its own aligned slot), then packed
    return {"ub": [ub_bytes((c,), "i64"), ub_bytes((c * d,), "fp8e4m3"), ub_bytes((c, 32), "e8m0"),
                   ub_bytes((c * nb,), "e8m0"), SIMT_CONTEXT_BYTES]}


@functools.lru_cache(maxsize=32)
def _gather_source(n: int, c: int, rows: int, d: int, nb: int, grid: int, threads: int) -> str:
    import tilelang.ascend.language as T

    fp8 = TL_DTYPE["fp8e4m3"]
    per = -(-n // grid)

    @T.prim_func
    def engram_gather(cols: T.Tensor((n, c), T.int64), table: T.Tensor((rows, d), fp8),
                      table_scale: T.Tensor((rows, nb), T.uint8), out: T.Tensor((n, c * d), fp8),
                      out_scale: T.Tensor((n, c * nb), T.uint8)):
        with T.Kernel(grid) as core:
            ib = T.alloc_shared((c,), T.int64)
            ob = T.alloc_shared((c * d,), fp8)
            sb = T.alloc_shared((c, 32), T.uint8)
            osb = T.alloc_shared((c * nb,), T.uint8)
            for it in T.serial(per):
                t = it * grid + core
                if t < n:
                    T.copy(cols[t, 0], ib)
                    for j in T.serial(c):
                        r = ib[j]
                        T.copy(table[r, 0:d], ob[j * d:(j + 1) * d])
                        T.copy(table_scale[r, 0:nb], sb[j, 0:nb])
                    with T.SimtVF(threads=threads):
                        for e in T.Parallel(c * nb):
                            osb[e] = sb[e // nb, e % nb]
                    T.copy(ob, out[t, 0])
                    T.copy(osb, out_scale[t, 0])

    return lower_ascend(engram_gather)


def _gather_dims(spec):
    (n, c), _ = storage(spec.in_types[0])
    table = spec.in_types[1]
    (rows, d), _ = storage(table.data)
    return n, c, rows, d, table.scale.shape[1]


def _gather_supports(target, spec):
    if not static(spec) or spec.in_types[1].data.dtype.name != "fp8e4m3":
        return False
    n, c, rows, d, nb = _gather_dims(spec)
    return d % 32 == 0 and nb <= 32 and (c * nb) % 32 == 0 and fits(target, _gather_plan(c, d, nb))


def _gather_render(target, spec, config):
    n, c, rows, d, nb = _gather_dims(spec)
    grid = min(n, target.cores)
    text = _gather_source(n, c, rows, d, nb, grid, _threads(config))
    return kernel_source("engram_gather", text, grid, _threads(config), _gather_plan(c, d, nb),
                         [d, c * d, c * nb], config)


register(Template(
    name="ascend_engram_gather", ops=("engram_gather",), targets=building("ascendc"), knobs=_THREADS,
    render=_gather_render, default_config=_default_threads, supports=_gather_supports))


# ---- engram_ngram_ids ---------------------------------------------------------------------------

def _ngram_plan(n: int, ns: int, ring: int, bm: int, g: int) -> dict:
    ring_pad = -(-ring // 4) * 4  # a history row per granule-aligned slot
    return {"ub": [ub_bytes((n,), "i64"), ub_bytes((n,), "i64"), ub_bytes((n,), "i32"), ub_bytes((ns,), "i32"),
                   ub_bytes((bm, ring_pad), "i64"), ub_bytes((bm, g), "i64"), SIMT_CONTEXT_BYTES]}


@functools.lru_cache(maxsize=32)
def _ngram_source(n: int, slots: int, ring: int, ns: int, g: int, pad: int, bm: int, grid: int, threads: int) -> str:
    import tilelang.ascend.language as T

    ring_pad = -(-ring // 4) * 4
    tiles = n // bm
    per = -(-tiles // grid)

    @T.prim_func
    def engram_ngram_ids(cids: T.Tensor((n,), T.int64), hist: T.Tensor((slots, ring), T.int64),
                         positions: T.Tensor((n,), T.int64), token_seq: T.Tensor((n,), T.int32),
                         seq_slots: T.Tensor((ns,), T.int32), grams: T.Tensor((n, g), T.int64)):
        with T.Kernel(grid) as core:
            cb = T.alloc_shared((n,), T.int64)
            pb = T.alloc_shared((n,), T.int64)
            tb = T.alloc_shared((n,), T.int32)
            sb = T.alloc_shared((ns,), T.int32)
            hb = T.alloc_shared((bm, ring_pad), T.int64)
            ob = T.alloc_shared((bm, g), T.int64)
            T.copy(cids[0], cb)
            T.copy(positions[0], pb)
            T.copy(token_seq[0], tb)
            T.copy(seq_slots[0], sb)
            for it in T.serial(per):
                tile = it * grid + core
                if tile < tiles:
                    for i in T.serial(bm):
                        T.copy(hist[sb[tb[tile * bm + i]], 0:ring], hb[i, 0:ring])
                    # look-back r: this step's row t - r when it is the same sequence, else the
                    # history ring; a slot before the sequence start or DEAD blocks it and every
                    # longer look-back (pad id)
                    with T.SimtVF(threads=threads):
                        for i in T.Parallel(bm):
                            t = tile * bm + i
                            blocked = T.alloc_var(T.int32)
                            blocked = 0
                            for r in T.unroll(g, explicit=True):
                                src = pb[t] - r
                                prev = T.max(t - r, 0)
                                same = T.if_then_else(t >= r, T.if_then_else(tb[prev] == tb[t], 1, 0), 0)
                                v = T.if_then_else(same == 1, cb[prev], hb[i, T.max(src, 0) % ring])
                                blocked = T.if_then_else(src < 0, 1, T.if_then_else(v == DEAD, 1, blocked))
                                ob[i, r] = T.if_then_else(blocked == 1, T.int64(pad), v)
                    T.copy(ob, grams[tile * bm, 0])

    return lower_ascend(engram_ngram_ids)


def _ngram_dims(spec):
    (n,), _ = storage(spec.in_types[0])
    (slots, ring), _ = storage(spec.in_types[1])
    (ns,), _ = storage(spec.in_types[4])
    return n, slots, ring, ns


def _ngram_supports(target, spec):
    if not static(spec):
        return False
    n, slots, ring, ns = _ngram_dims(spec)
    bm, g = row_tile(n, target.cores), int(spec.attr["max_ngram"])
    return fits(target, _ngram_plan(n, ns, ring, bm, g), [bm * g * 8])


def _ngram_render(target, spec, config):
    n, slots, ring, ns = _ngram_dims(spec)
    g, bm = int(spec.attr["max_ngram"]), row_tile(n, target.cores)
    grid = min(n // bm, target.cores)
    text = _ngram_source(n, slots, ring, ns, g, int(spec.attr["pad"]), bm, grid, _threads(config))
    return kernel_source("engram_ngram_ids", text, grid, _threads(config), _ngram_plan(n, ns, ring, bm, g),
                         [bm * g * 8], config)


register(Template(
    name="ascend_engram_ngram_ids", ops=("engram_ngram_ids",), targets=building("ascendc"), knobs=_THREADS,
    render=_ngram_render, default_config=_default_threads, supports=_ngram_supports))


# ---- engram_hist_write --------------------------------------------------------------------------

def _hist_plan(n: int, ns: int) -> dict:
    return {"ub": [ub_bytes((n,), "i64"), ub_bytes((n,), "i32"), ub_bytes((ns,), "i32"), ub_bytes((4,), "i64")]}


@functools.lru_cache(maxsize=32)
def _hist_source(n: int, slots: int, ring: int, ns: int, grid: int) -> str:
    import tilelang.ascend.language as T

    per = -(-n // grid)

    @T.prim_func
    def engram_hist_write(hist: T.Tensor((slots, ring), T.int64), cids: T.Tensor((n,), T.int64),
                          positions: T.Tensor((n,), T.int64), token_seq: T.Tensor((n,), T.int32),
                          seq_slots: T.Tensor((ns,), T.int32)):
        with T.Kernel(grid) as core:
            pb = T.alloc_shared((n,), T.int64)
            tb = T.alloc_shared((n,), T.int32)
            sb = T.alloc_shared((ns,), T.int32)
            vb = T.alloc_shared((4,), T.int64)
            T.copy(positions[0], pb)
            T.copy(token_seq[0], tb)
            T.copy(seq_slots[0], sb)
            for it in T.serial(per):
                t = it * grid + core
                if t < n:
                    # ring_keep: row t + ring is past the sequence (else a newer row takes the slot)
                    if t + ring >= n or tb[T.min(t + ring, n - 1)] != tb[t]:
                        slot = sb[tb[t]]
                        idx = pb[t] % ring
                        T.copy(cids[t:t + 1], vb[0:1])
                        T.copy(vb[0:1], hist[slot, idx:idx + 1])

    return lower_ascend(engram_hist_write)


def _hist_dims(spec):
    (slots, ring), _ = storage(spec.in_types[0])
    (n,), _ = storage(spec.in_types[1])
    (ns,), _ = storage(spec.in_types[4])
    return n, slots, ring, ns


def _hist_supports(target, spec):
    if not static(spec):
        return False
    n, slots, ring, ns = _hist_dims(spec)
    return fits(target, _hist_plan(n, ns))


def _hist_render(target, spec, config):
    n, slots, ring, ns = _hist_dims(spec)
    grid = min(n, target.cores)
    return kernel_source("engram_hist_write", _hist_source(n, slots, ring, ns, grid), grid, 0, _hist_plan(n, ns),
                         [], config)


register(Template(
    name="ascend_engram_hist_write", ops=("engram_hist_write",), targets=building("ascendc"), knobs={},
    render=_hist_render, default_config=lambda target, spec: {}, supports=_hist_supports))


# ---- engram_gate --------------------------------------------------------------------------------

def _gate_plan(n: int, c: int, h: int, threads: int, with_ids: bool) -> dict:
    ub = [ub_bytes((c, h), "f32"), ub_bytes((h,), "bf16"), ub_bytes((h,), "bf16"), ub_bytes((h,), "bf16"),
          ub_bytes((3, threads), "f32"), ub_bytes((8,), "f32"), SIMT_CONTEXT_BYTES]
    return {"ub": ub + ([ub_bytes((n,), "i64")] if with_ids else [])}


@functools.lru_cache(maxsize=32)
def _gate_source(n: int, c: int, h: int, dtype: str, eps: float, image_id, grid: int, threads: int) -> str:
    import tilelang.ascend.language as T

    tdt = TL_DTYPE[dtype]
    items = n * c
    per = -(-items // grid)
    per_thread = -(-h // threads)
    inv_sqrt_h = float(h) ** -0.5
    with_ids = image_id is not None

    @T.macro
    def body(r, kv, q_weight, k_weight, out, ids):
        with T.Kernel(grid) as core:
            w = T.alloc_shared((c, h), T.float32)
            rb = T.alloc_shared((h,), tdt)
            kb = T.alloc_shared((h,), tdt)
            vb = T.alloc_shared((h,), tdt)
            part = T.alloc_shared((3, threads), T.float32)
            stat = T.alloc_shared((8,), T.float32)
            if with_ids:
                ib = T.alloc_shared((n,), T.int64)
                T.copy(ids[0], ib)
            # w = q_weight * k_weight in fp32, once per core (rb / kb stage the bf16 rows)
            for cc in T.serial(c):
                T.copy(q_weight[cc, 0], rb)
                T.copy(k_weight[cc, 0], kb)
                with T.SimtVF(threads=threads):
                    for i in T.Parallel(h):
                        w[cc, i] = T.cast(rb[i], T.float32) * T.cast(kb[i], T.float32)
            for it in T.serial(per):
                item = it * grid + core
                if item < items:
                    t = item // c
                    cc = item % c
                    T.copy(r[t, cc, 0], rb)
                    T.copy(kv[t, cc * h:(cc + 1) * h], kb)
                    T.copy(kv[t, c * h:(c + 1) * h], vb)
                    # per-thread strided partials of (r*w).key, r.r and key.key
                    with T.SimtVF(threads=threads):
                        tid = T.get_thread_binding()
                        part[0, tid] = 0.0
                        part[1, tid] = 0.0
                        part[2, tid] = 0.0
                        for j in T.serial(per_thread):
                            if j * threads + tid < h:
                                x = T.cast(rb[j * threads + tid], T.float32)
                                k = T.cast(kb[j * threads + tid], T.float32)
                                part[0, tid] = part[0, tid] + x * w[cc, j * threads + tid] * k
                                part[1, tid] = part[1, tid] + x * x
                                part[2, tid] = part[2, tid] + k * k
                    with T.SimtVF(threads=1):
                        stat[0] = 0.0
                        stat[1] = 0.0
                        stat[2] = 0.0
                        for u in T.serial(threads):
                            stat[0] = stat[0] + part[0, u]
                            stat[1] = stat[1] + part[1, u]
                            stat[2] = stat[2] + part[2, u]
                        stat[3] = (stat[0] * T.rsqrt(stat[1] / h + eps) * T.rsqrt(stat[2] / h + eps)
                                   * inv_sqrt_h)
                        # sigmoid of the signed square root of |dot| clamped at 1e-6
                        stat[4] = T.sqrt(T.max(T.abs(stat[3]), 1e-6))
                        stat[4] = T.if_then_else(stat[3] < 0, -stat[4], stat[4])
                        stat[5] = 1.0 / (1.0 + T.exp(-stat[4]))
                        if with_ids:
                            stat[5] = T.if_then_else(ib[t] == image_id, 0.0, stat[5])
                    with T.SimtVF(threads=threads):
                        for i in T.Parallel(h):
                            rb[i] = T.cast(T.cast(rb[i], T.float32) + stat[5] * T.cast(vb[i], T.float32), tdt)
                    T.copy(rb, out[t, cc, 0])

    if with_ids:
        @T.prim_func
        def engram_gate(r: T.Tensor((n, c, h), tdt), kv: T.Tensor((n, (c + 1) * h), tdt),
                        q_weight: T.Tensor((c, h), tdt), k_weight: T.Tensor((c, h), tdt),
                        ids: T.Tensor((n,), T.int64), out: T.Tensor((n, c, h), tdt)):
            body(r, kv, q_weight, k_weight, out, ids)
    else:
        @T.prim_func
        def engram_gate(r: T.Tensor((n, c, h), tdt), kv: T.Tensor((n, (c + 1) * h), tdt),
                        q_weight: T.Tensor((c, h), tdt), k_weight: T.Tensor((c, h), tdt),
                        out: T.Tensor((n, c, h), tdt)):
            body(r, kv, q_weight, k_weight, out, None)

    return lower_ascend(engram_gate)


def _gate_dims(spec):
    (n, c, h), dtype = storage(spec.in_types[0])
    return n, c, h, dtype


def _gate_supports(target, spec):
    if not static(spec):
        return False
    n, c, h, dtype = _gate_dims(spec)
    if dtype not in ("bf16", "f16") or any(t.dtype.name != dtype for t in spec.in_types[1:4]):
        return False
    return (h * 2) % 32 == 0 and fits(target, _gate_plan(n, c, h, 128, len(spec.in_types) == 5))


def _gate_render(target, spec, config):
    n, c, h, dtype = _gate_dims(spec)
    threads = _threads(config)
    image = spec.attr.get("image_token_id")
    grid = min(n * c, target.cores)
    text = _gate_source(n, c, h, dtype, float(spec.attr["eps"]), None if image is None else int(image), grid, threads)
    return kernel_source("engram_gate", text, grid, threads, _gate_plan(n, c, h, threads, image is not None),
                         [h * 2, (c + 1) * h * 2], config)


register(Template(
    name="ascend_engram_gate", ops=("engram_gate",), targets=building("ascendc"), knobs=_THREADS,
    render=_gate_render, default_config=_default_threads, supports=_gate_supports))


# ---- ring and paged-cache writers ---------------------------------------------------------------

def _meta_plan(n: int, ns: int, seq_table=(1,)) -> list:
    """positions (i64), token_seq (i32) and the per-sequence table (seq_slots or block_table)."""
    return [ub_bytes((n,), "i64"), ub_bytes((n,), "i32"), ub_bytes((ns, *seq_table), "i32")]


def _swa_plan(n: int, ns: int, d: int, nb: int) -> dict:
    return {"ub": _meta_plan(n, ns) + [ub_bytes((d,), "fp8e4m3"), ub_bytes((32,), "e8m0")]}


@functools.lru_cache(maxsize=32)
def _swa_source(n: int, slots: int, ring: int, d: int, nb: int, ns: int, grid: int) -> str:
    import tilelang.ascend.language as T

    fp8 = TL_DTYPE["fp8e4m3"]
    per = -(-n // grid)

    @T.prim_func
    def swa_write(ring_data: T.Tensor((slots, ring, d), fp8), ring_scale: T.Tensor((slots, ring, nb), T.uint8),
                  kv: T.Tensor((n, d), fp8), kv_scale: T.Tensor((n, nb), T.uint8),
                  positions: T.Tensor((n,), T.int64), token_seq: T.Tensor((n,), T.int32),
                  seq_slots: T.Tensor((ns,), T.int32)):
        with T.Kernel(grid) as core:
            pb = T.alloc_shared((n,), T.int64)
            tb = T.alloc_shared((n,), T.int32)
            sb = T.alloc_shared((ns,), T.int32)
            row = T.alloc_shared((d,), fp8)
            sc = T.alloc_shared((32,), T.uint8)
            T.copy(positions[0], pb)
            T.copy(token_seq[0], tb)
            T.copy(seq_slots[0], sb)
            for it in T.serial(per):
                t = it * grid + core
                if t < n:
                    if t + ring >= n or tb[T.min(t + ring, n - 1)] != tb[t]:  # ring_keep
                        slot = sb[tb[t]]
                        idx = pb[t] % ring
                        T.copy(kv[t, 0], row)
                        T.copy(row, ring_data[slot, idx, 0])
                        T.copy(kv_scale[t, 0:nb], sc[0:nb])
                        T.copy(sc[0:nb], ring_scale[slot, idx, 0:nb])

    return lower_ascend(swa_write)


def _swa_dims(spec):
    ring, kv = spec.in_types[0], spec.in_types[1]
    (slots, length, d), _ = storage(ring.data)
    (n, _), _ = storage(kv.data)
    (ns,), _ = storage(spec.in_types[4])
    return n, slots, length, d, ring.scale.shape[2], ns


def _swa_supports(target, spec):
    if not static(spec) or spec.in_types[0].scale.dtype.name != "e8m0" or spec.in_types[1].scale.dtype.name != "e8m0":
        return False
    n, slots, length, d, nb, ns = _swa_dims(spec)
    return d % 32 == 0 and nb <= 32 and fits(target, _swa_plan(n, ns, d, nb))


def _swa_render(target, spec, config):
    n, slots, length, d, nb, ns = _swa_dims(spec)
    grid = min(n, target.cores)
    return kernel_source("swa_write", _swa_source(n, slots, length, d, nb, ns, grid), grid, 0,
                         _swa_plan(n, ns, d, nb), [d], config)


register(Template(
    name="ascend_swa_write", ops=("swa_write",), targets=building("ascendc"), knobs={},
    render=_swa_render, default_config=lambda target, spec: {}, supports=_swa_supports))


def _state_plan(n: int, ns: int, d: int) -> dict:
    return {"ub": _meta_plan(n, ns) + [ub_bytes((d,), "f32")]}


@functools.lru_cache(maxsize=32)
def _state_source(n: int, slots: int, ring: int, d: int, ns: int, grid: int) -> str:
    import tilelang.ascend.language as T

    per = -(-n // grid)

    @T.prim_func
    def compress_state_write(state: T.Tensor((slots, ring, 2, d), T.float32), l: T.Tensor((n, d), T.float32),
                             s: T.Tensor((n, d), T.float32), positions: T.Tensor((n,), T.int64),
                             token_seq: T.Tensor((n,), T.int32), seq_slots: T.Tensor((ns,), T.int32)):
        with T.Kernel(grid) as core:
            pb = T.alloc_shared((n,), T.int64)
            tb = T.alloc_shared((n,), T.int32)
            sb = T.alloc_shared((ns,), T.int32)
            row = T.alloc_shared((d,), T.float32)
            T.copy(positions[0], pb)
            T.copy(token_seq[0], tb)
            T.copy(seq_slots[0], sb)
            for it in T.serial(per):
                t = it * grid + core
                if t < n:
                    if t + ring >= n or tb[T.min(t + ring, n - 1)] != tb[t]:  # ring_keep
                        slot = sb[tb[t]]
                        idx = pb[t] % ring
                        T.copy(l[t, 0], row)
                        T.copy(row, state[slot, idx, 0, 0])
                        T.copy(s[t, 0], row)
                        T.copy(row, state[slot, idx, 1, 0])

    return lower_ascend(compress_state_write)


def _state_dims(spec):
    (slots, ring, _, d), _ = storage(spec.in_types[0])
    (n, _), _ = storage(spec.in_types[1])
    (ns,), _ = storage(spec.in_types[5])
    return n, slots, ring, d, ns


def _state_supports(target, spec):
    if not static(spec) or any(t.dtype.name != "f32" for t in spec.in_types[:3]):
        return False
    n, slots, ring, d, ns = _state_dims(spec)
    return (d * 4) % 32 == 0 and fits(target, _state_plan(n, ns, d))


def _state_render(target, spec, config):
    n, slots, ring, d, ns = _state_dims(spec)
    grid = min(n, target.cores)
    return kernel_source("compress_state_write", _state_source(n, slots, ring, d, ns, grid), grid, 0,
                         _state_plan(n, ns, d), [d * 4], config)


register(Template(
    name="ascend_compress_state_write", ops=("compress_state_write",), targets=building("ascendc"), knobs={},
    render=_state_render, default_config=lambda target, spec: {}, supports=_state_supports))


def _cw_plan(n: int, pages: int, dp: int, scale_dtype: str) -> dict:
    """positions and token_seq whole; of the block table only the one granule (8 entries) holding
    the page of the entry being written: the whole table ([257, 512] i32 at the real model's
    prefill buckets, 514 KiB) is no UB buffer"""
    return {"ub": [ub_bytes((n,), "i64"), ub_bytes((n,), "i32"), ub_bytes((_cw_granule(pages),), "i32"),
                   ub_bytes((dp,), "u8"), ub_bytes((32,), scale_dtype)]}


def _cw_granule(pages: int) -> int:
    return min(GRANULE // 4, pages)


@functools.lru_cache(maxsize=32)
def _cw_source(n: int, npages: int, entries: int, dp: int, nb: int, scale_dtype: str, ns: int, pages: int,
               ratio: int, grid: int) -> str:
    import tilelang.ascend.language as T

    sdt = TL_DTYPE[scale_dtype]
    per = -(-n // grid)
    gb = _cw_granule(pages)

    @T.prim_func
    def compressed_write(cache: T.Tensor((npages, entries, dp), T.uint8),
                         cache_scale: T.Tensor((npages, entries, nb), sdt), rows: T.Tensor((n, dp), T.uint8),
                         rows_scale: T.Tensor((n, nb), sdt), positions: T.Tensor((n,), T.int64),
                         token_seq: T.Tensor((n,), T.int32), block_table: T.Tensor((ns, pages), T.int32)):
        with T.Kernel(grid) as core:
            pb = T.alloc_shared((n,), T.int64)
            tb = T.alloc_shared((n,), T.int32)
            bt = T.alloc_shared((gb,), T.int32)
            row = T.alloc_shared((dp,), T.uint8)
            sc = T.alloc_shared((32,), sdt)
            T.copy(positions[0], pb)
            T.copy(token_seq[0], tb)
            for it in T.serial(per):
                t = it * grid + core
                if t < n:
                    # the row completing entry c = (pos + 1) / ratio - 1 writes it to its page
                    if (pb[t] + 1) % ratio == 0:
                        entry = (pb[t] + 1) // ratio - 1
                        # the block-table granule holding the entry's page index (clamped to the
                        # row's last granule, so the copy never reads past the sequence's row)
                        pidx = entry // entries
                        start = T.min(pidx // gb * gb, pages - gb)
                        T.copy(block_table[tb[t], start:start + gb], bt[0:gb])
                        page = bt[pidx - start]
                        slot = entry % entries
                        T.copy(rows[t, 0], row)
                        T.copy(row, cache[page, slot, 0])
                        T.copy(rows_scale[t, 0:nb], sc[0:nb])
                        T.copy(sc[0:nb], cache_scale[page, slot, 0:nb])

    return lower_ascend(compressed_write)


def _cw_dims(spec):
    cache, rows = spec.in_types[0], spec.in_types[1]
    (npages, entries, dp), _ = storage(cache.data)
    (n, _), _ = storage(rows.data)
    (ns, pages), _ = storage(spec.in_types[4])
    return n, npages, entries, dp, cache.scale.shape[2], cache.scale.dtype.name, ns, pages


def _cw_supports(target, spec):
    if not static(spec) or spec.in_types[0].scale.dtype != spec.in_types[1].scale.dtype:
        return False
    n, npages, entries, dp, nb, sdt, ns, pages = _cw_dims(spec)
    return (sdt in ("e8m0", "fp8e4m3") and dp % 32 == 0 and nb <= 32
            and fits(target, _cw_plan(n, pages, dp, sdt)))


def _cw_render(target, spec, config):
    n, npages, entries, dp, nb, sdt, ns, pages = _cw_dims(spec)
    grid = min(n, target.cores)
    text = _cw_source(n, npages, entries, dp, nb, sdt, ns, pages, int(spec.attr["ratio"]), grid)
    return kernel_source("compressed_write", text, grid, 0, _cw_plan(n, pages, dp, sdt), [dp], config)


register(Template(
    name="ascend_compressed_write", ops=("compressed_write",), targets=building("ascendc"), knobs={},
    render=_cw_render, default_config=lambda target, spec: {}, supports=_cw_supports))


# ---- compress_pool_norm -------------------------------------------------------------------------

def _pool_plan(n: int, ns: int, d: int, ratio: int, threads: int) -> dict:
    return {"ub": _meta_plan(n, ns) + [ub_bytes((ratio, d), "f32"), ub_bytes((ratio, d), "f32"),
                                       ub_bytes((d,), "f32"), ub_bytes((d,), "f32"), ub_bytes((d,), "bf16"),
                                       ub_bytes((threads,), "f32"), ub_bytes((8,), "f32"),
                                       SIMT_CONTEXT_BYTES]}


@functools.lru_cache(maxsize=32)
def _pool_source(n: int, slots: int, ring: int, d: int, ns: int, ratio: int, eps: float, grid: int,
                 threads: int) -> str:
    import tilelang.ascend.language as T

    per = -(-n // grid)
    per_thread = -(-d // threads)

    @T.prim_func
    def compress_pool_norm(l: T.Tensor((n, d), T.float32), s: T.Tensor((n, d), T.float32),
                           state: T.Tensor((slots, ring, 2, d), T.float32), positions: T.Tensor((n,), T.int64),
                           token_seq: T.Tensor((n,), T.int32), seq_slots: T.Tensor((ns,), T.int32),
                           norm_w: T.Tensor((d,), T.bfloat16), out: T.Tensor((n, d), T.bfloat16)):
        with T.Kernel(grid) as core:
            pb = T.alloc_shared((n,), T.int64)
            tb = T.alloc_shared((n,), T.int32)
            sb = T.alloc_shared((ns,), T.int32)
            lb = T.alloc_shared((ratio, d), T.float32)
            gb = T.alloc_shared((ratio, d), T.float32)
            zf = T.alloc_shared((d,), T.float32)
            wf = T.alloc_shared((d,), T.float32)
            ob = T.alloc_shared((d,), T.bfloat16)
            part = T.alloc_shared((threads,), T.float32)
            stat = T.alloc_shared((8,), T.float32)
            T.copy(positions[0], pb)
            T.copy(token_seq[0], tb)
            T.copy(seq_slots[0], sb)
            T.copy(norm_w[0], ob)
            with T.SimtVF(threads=threads):
                for j in T.Parallel(d):
                    wf[j] = T.cast(ob[j], T.float32)
            for it in T.serial(per):
                t = it * grid + core
                if t < n:
                    if (pb[t] + 1) % ratio == 0:
                        # the entry's group: tokens of this step from their rows, earlier ones
                        # from the state ring (slot pos mod ring length)
                        for i in T.serial(ratio):
                            back = ratio - 1 - i
                            if t >= back and tb[T.max(t - back, 0)] == tb[t]:
                                T.copy(l[t - back, 0:d], lb[i, 0:d])
                                T.copy(s[t - back, 0:d], gb[i, 0:d])
                            else:
                                slot = sb[tb[t]]
                                gi = T.max(pb[t] - back, 0) % ring
                                T.copy(state[slot, gi, 0, 0:d], lb[i, 0:d])
                                T.copy(state[slot, gi, 1, 0:d], gb[i, 0:d])
                        # softmax over the group of S per column, weights times L summed; the
                        # latent rounds to bf16 before the norm
                        with T.SimtVF(threads=threads):
                            for j in T.Parallel(d):
                                m = T.alloc_var(T.float32)
                                se = T.alloc_var(T.float32)
                                z = T.alloc_var(T.float32)
                                m = gb[0, j]
                                for i in T.serial(1, ratio):
                                    m = T.max(m, gb[i, j])
                                se = 0.0
                                for i in T.serial(ratio):
                                    se = se + T.exp(gb[i, j] - m)
                                z = 0.0
                                for i in T.serial(ratio):
                                    z = z + T.exp(gb[i, j] - m) / se * lb[i, j]
                                zf[j] = T.cast(T.cast(z, T.bfloat16), T.float32)
                        with T.SimtVF(threads=threads):
                            tid = T.get_thread_binding()
                            part[tid] = 0.0
                            for u in T.serial(per_thread):
                                if u * threads + tid < d:
                                    part[tid] = part[tid] + zf[u * threads + tid] * zf[u * threads + tid]
                        with T.SimtVF(threads=1):
                            stat[0] = 0.0
                            for u in T.serial(threads):
                                stat[0] = stat[0] + part[u]
                            stat[1] = T.rsqrt(stat[0] / d + eps)
                        with T.SimtVF(threads=threads):
                            for j in T.Parallel(d):
                                ob[j] = T.cast(wf[j] * (zf[j] * stat[1]), T.bfloat16)
                    else:  # no entry completes here: the pooled row is zero, and so is its norm
                        with T.SimtVF(threads=threads):
                            for j in T.Parallel(d):
                                ob[j] = T.cast(0.0, T.bfloat16)
                    T.copy(ob, out[t, 0])

    return lower_ascend(compress_pool_norm)


def _pool_dims(spec):
    (n, d), _ = storage(spec.in_types[0])
    (slots, ring, _, _), _ = storage(spec.in_types[2])
    (ns,), _ = storage(spec.in_types[5])
    return n, slots, ring, d, ns


def _pool_supports(target, spec):
    if not static(spec) or any(t.dtype.name != "f32" for t in spec.in_types[:3]):
        return False
    if spec.in_types[6].dtype.name != "bf16":
        return False
    n, slots, ring, d, ns = _pool_dims(spec)
    return fits(target, _pool_plan(n, ns, d, int(spec.attr["ratio"]), 128), [d * 4, d * 2])


def _pool_render(target, spec, config):
    n, slots, ring, d, ns = _pool_dims(spec)
    threads, ratio = _threads(config), int(spec.attr["ratio"])
    grid = min(n, target.cores)
    text = _pool_source(n, slots, ring, d, ns, ratio, float(spec.attr["eps"]), grid, threads)
    return kernel_source("compress_pool_norm", text, grid, threads, _pool_plan(n, ns, d, ratio, threads),
                         [d * 4, d * 2], config)


register(Template(
    name="ascend_compress_pool_norm", ops=("compress_pool_norm",), targets=building("ascendc"), knobs=_THREADS,
    render=_pool_render, default_config=_default_threads, supports=_pool_supports))
