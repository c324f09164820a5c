"""TileLang-Ascend vector-core templates for ascend950's small ops: casts, adds, row gathers, the
Engram token map, concatenation, and mHC (repeat, mean, collapse, expand, and the mix GEMM with its
Sinkhorn); the quantising and RoPE templates are in `ascend_vector_quant`.

Every kernel here has one shape: a 1-D grid of AI cores walks tiles of whole rows (`T.Persistent`),
each tile moved GM -> UB -> GM by DMA with the math in `T.SimtVF` SIMT regions on the Unified
Buffer. A tile holds as many rows as it takes for every GM transfer to start on a 32-byte granule
(a row of four fp32 mixes is 16 B: tiles of such rows are even), grown towards an even share of
the rows per core within half the UB. The last tile is clipped on load and store by the compiler.
Tensors are declared as rows x width ([n, C, H] streams as [n, C*H]); the kernel sees GM pointers.

The buffer plan the capacity check reads (meta['buffers']) is recorded by the allocations
themselves (`UbPlan`), so it is the kernel's UB, each buffer rounded up to the 32-byte granule.
Rendered and capacity-checked here; TileLang 0.1.15's Ascend backend has no CPU interpreter or
simulator (its execution backends compile with CANN's `bisheng` and run through torch_npu), so
these kernels have never run: built only where `bisheng` exists, never run on an Ascend 950,
nothing about them is verified.
"""
# no `from __future__ import annotations`: TileLang evaluates the prim_funcs' T.Tensor((n, w), ...)
# hints, and string annotations would look the sizes up at the wrong time

import functools
import math

from ..targets import building
from ..template import KernelSource, KernelSpec, Template, register
from .ascend_common import BYTES, GRANULE, TL_DTYPE, align32, lower_ascend

FLOATS = ("bf16", "f16", "f32")
THREADS = {"threads": (64, 128, 256)}


def default_threads(target, spec) -> dict:
    return {"threads": 128}


class UbPlan:
    """Allocates UB buffers inside a prim_func and records their granule-rounded sizes."""

    def __init__(self):
        self.sizes: list[int] = []

    def __call__(self, shape, dtype: str):
        import tilelang.ascend.language as T

        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        self.sizes.append(align32(math.prod(shape) * BYTES[dtype]))
        return T.alloc_shared(shape, TL_DTYPE[dtype])


def static(*types) -> bool:
    return all(isinstance(d, int) for t in types for d in getattr(t, "data", t).shape)


def rows_width(t) -> tuple[int, int]:
    """A tensor as rows x last dim."""
    return math.prod(t.shape[:-1]), t.shape[-1]


def granule_rows(gm_row_bytes) -> int:
    """The fewest rows after which every GM row stride is a whole number of 32-byte granules."""
    g = 1
    for b in gm_row_bytes:
        g = math.lcm(g, GRANULE // math.gcd(b, GRANULE))
    return g


def row_tiles(target, rows: int, gm_row_bytes, ub_row_bytes: int, ub_fixed: int = 0, ub_share: float = 0.5):
    """(rows per tile, tiles, grid) for `rows` rows whose GM transfers have `gm_row_bytes` per row
    and whose UB buffers take `ub_row_bytes` per tile row plus `ub_fixed`; None where one granule
    of rows does not fit `ub_share` of the UB."""
    g0 = granule_rows(gm_row_bytes)
    budget = int(target.ub_bytes * ub_share) - ub_fixed
    if g0 * ub_row_bytes > budget:
        return None
    share = -(-(-(-rows // target.cores)) // g0) * g0  # an even share per core, whole granules
    g = max(g0, min(budget // ub_row_bytes // g0 * g0, share))
    tiles = -(-rows // g)
    return g, tiles, min(tiles, target.cores)


def source(entry: str, text_plan, grid: int, threads: int, gm_row_bytes, config) -> KernelSource:
    text, ub = text_plan
    if f" {entry}_kernel(" not in text:
        raise ValueError(f"rendered AscendC has no entry {entry}_kernel")
    return KernelSource(language="ascendc", entry=f"{entry}_kernel", text=text, grid=(grid,), block=(threads,),
                        meta={"buffers": {"ub": list(ub)}, "gm_row_bytes": list(gm_row_bytes), "config": dict(config)})


def fsum(terms):
    """Left-to-right sum of a short list of expressions (the copies of a stream), unrolled when
    the kernel is written."""
    acc = terms[0]
    for t in terms[1:]:
        acc = acc + t
    return acc


def lowered(prim_func, ub: UbPlan) -> tuple[str, tuple[int, ...]]:
    return lower_ascend(prim_func), tuple(ub.sizes)


# ---- cast, add ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=128)
def _elementwise_source(op: str, rows: int, w: int, src: str, dst: str, g: int, tiles: int, grid: int,
                        threads: int):
    import tilelang.ascend.language as T

    ub = UbPlan()
    sdt, ddt = TL_DTYPE[src], TL_DTYPE[dst]

    if op == "cast":
        @T.prim_func
        def cast(X: T.Tensor((rows, w), sdt), Y: T.Tensor((rows, w), ddt)):
            with T.Kernel(grid) as core:
                xb = ub((g, w), src)
                yb = ub((g, w), dst)
                for t in T.Persistent([tiles], grid, core):
                    T.copy(X[t * g, 0], xb)
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(g, w):
                            yb[i, j] = T.cast(T.cast(xb[i, j], "float32"), ddt)
                    T.copy(yb, Y[t * g, 0])
        return lowered(cast, ub)

    @T.prim_func
    def add(A: T.Tensor((rows, w), sdt), B: T.Tensor((rows, w), sdt), Y: T.Tensor((rows, w), sdt)):
        with T.Kernel(grid) as core:
            ab = ub((g, w), src)
            bb = ub((g, w), src)
            for t in T.Persistent([tiles], grid, core):
                T.copy(A[t * g, 0], ab)
                T.copy(B[t * g, 0], bb)
                # fp32 sum rounded once to the operands' dtype (the reference's .float() + .float())
                with T.SimtVF(threads=threads):
                    for i, j in T.Parallel(g, w):
                        ab[i, j] = T.cast(T.cast(ab[i, j], "float32") + T.cast(bb[i, j], "float32"), sdt)
                T.copy(ab, Y[t * g, 0])
    return lowered(add, ub)


def _elementwise_tiles(target, spec: KernelSpec):
    x, y = spec.in_types[0], spec.out_types[0]
    rows, w = rows_width(x)
    per_row = w * (BYTES[x.dtype.name] * (len(spec.in_types)) + (BYTES[y.dtype.name] if spec.op == "cast" else 0))
    return rows, w, [w * BYTES[x.dtype.name], w * BYTES[y.dtype.name]], row_tiles(
        target, rows, [w * BYTES[x.dtype.name], w * BYTES[y.dtype.name]], per_row)


def _elementwise_supports(target, spec: KernelSpec) -> bool:
    ins, y = spec.in_types, spec.out_types[0]
    if not static(*ins, y) or any(hasattr(t, "data") for t in (*ins, y)):
        return False
    if any(t.dtype.name not in FLOATS for t in (*ins, y)) or any(t.shape != y.shape for t in ins):
        return False
    if spec.op == "add" and any(t.dtype != y.dtype for t in ins):
        return False
    return _elementwise_tiles(target, spec)[3] is not None


def _elementwise_render(target, spec: KernelSpec, config) -> KernelSource:
    rows, w, gm, (g, tiles, grid) = _elementwise_tiles(target, spec)
    threads = int(config["threads"])
    text = _elementwise_source(spec.op, rows, w, spec.in_types[0].dtype.name, spec.out_types[0].dtype.name,
                               g, tiles, grid, threads)
    return source(spec.op, text, grid, threads, [b * g for b in gm], config)


register(Template(
    name="ascend_elementwise", ops=("cast", "add"), targets=building("ascendc"), knobs=THREADS,
    render=_elementwise_render, default_config=default_threads, supports=_elementwise_supports))


# ---- mHC stream: repeat, mean, collapse, expand -------------------------------------------------

@functools.lru_cache(maxsize=128)
def _stream_source(op: str, n: int, c: int, h: int, dtype: str, g: int, tiles: int, grid: int, threads: int):
    """hc_repeat: [n, H] -> [n, C, H]; hc_mean / hc_collapse: [n, C, H] (and mixes [n, C]) -> [n, H];
    hc_expand: y [n, H], stream [n, C, H], post [n, C], M [n, C, C] -> [n, C, H]. fp32 math,
    rounded once to the stream's dtype. The few mixes of a tile are read by the SIMT threads
    (a row of four fp32 is no whole DMA granule)."""
    import tilelang.ascend.language as T

    ub = UbPlan()
    tdt, f32 = TL_DTYPE[dtype], "float32"

    if op == "hc_repeat":
        @T.prim_func
        def hc_repeat(X: T.Tensor((n, h), tdt), Y: T.Tensor((n, c * h), tdt)):
            with T.Kernel(grid) as core:
                xb = ub((g, h), dtype)
                yb = ub((g, c * h), dtype)
                for t in T.Persistent([tiles], grid, core):
                    T.copy(X[t * g, 0], xb)
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(g, c * h):
                            yb[i, j] = xb[i, j % h]
                    T.copy(yb, Y[t * g, 0])
        return lowered(hc_repeat, ub)

    if op == "hc_mean":
        @T.prim_func
        def hc_mean(R: T.Tensor((n, c * h), tdt), Y: T.Tensor((n, h), tdt)):
            with T.Kernel(grid) as core:
                rb = ub((g, c * h), dtype)
                yb = ub((g, h), dtype)
                for t in T.Persistent([tiles], grid, core):
                    T.copy(R[t * g, 0], rb)
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(g, h):
                            yb[i, j] = T.cast(fsum([T.cast(rb[i, k * h + j], f32) for k in range(c)]) / c, tdt)
                    T.copy(yb, Y[t * g, 0])
        return lowered(hc_mean, ub)

    if op == "hc_collapse":
        @T.prim_func
        def hc_collapse(R: T.Tensor((n, c * h), tdt), Mix: T.Tensor((n, c), f32), Y: T.Tensor((n, h), tdt)):
            with T.Kernel(grid) as core:
                rb = ub((g, c * h), dtype)
                mb = ub((g, c), "f32")
                yb = ub((g, h), dtype)
                for t in T.Persistent([tiles], grid, core):
                    T.copy(R[t * g, 0], rb)
                    with T.SimtVF(threads=threads):
                        for i, k in T.Parallel(g, c):
                            mb[i, k] = Mix[t * g + i, k]
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(g, h):
                            yb[i, j] = T.cast(fsum([mb[i, k] * T.cast(rb[i, k * h + j], f32) for k in range(c)]), tdt)
                    T.copy(yb, Y[t * g, 0])
        return lowered(hc_collapse, ub)

    @T.prim_func
    def hc_expand(Yl: T.Tensor((n, h), tdt), R: T.Tensor((n, c * h), tdt), Post: T.Tensor((n, c), f32),
                  M: T.Tensor((n, c * c), f32), Out: T.Tensor((n, c * h), tdt)):
        with T.Kernel(grid) as core:
            yb = ub((g, h), dtype)
            rb = ub((g, c * h), dtype)
            pb = ub((g, c), "f32")
            mb = ub((g, c * c), "f32")
            ob = ub((g, c * h), dtype)
            for t in T.Persistent([tiles], grid, core):
                T.copy(Yl[t * g, 0], yb)
                T.copy(R[t * g, 0], rb)
                with T.SimtVF(threads=threads):
                    for i, k in T.Parallel(g, c * c):
                        mb[i, k] = M[t * g + i, k]
                        if k < c:
                            pb[i, k] = Post[t * g + i, k]
                # R'[j] = post[j] * y + sum_i M[i, j] * R[i]
                with T.SimtVF(threads=threads):
                    for i, jh in T.Parallel(g, c * h):
                        j = jh // h
                        x = jh % h
                        mixed = fsum([mb[i, k * c + j] * T.cast(rb[i, k * h + x], f32) for k in range(c)])
                        ob[i, jh] = T.cast(pb[i, j] * T.cast(yb[i, x], f32) + mixed, tdt)
                T.copy(ob, Out[t * g, 0])
    return lowered(hc_expand, ub)


def _stream_dims(spec: KernelSpec):
    """(n, copies, H, dtype, GM bytes per row of each operand, UB bytes per tile row)."""
    op, ins = spec.op, spec.in_types
    if op == "hc_repeat":
        (n, h), c = ins[0].shape, spec.attr["copies"]
    elif op == "hc_expand":
        n, c, h = ins[1].shape
    else:
        n, c, h = ins[0].shape
    e = BYTES[spec.out_types[0].dtype.name]
    gm = {"hc_repeat": [h * e, c * h * e], "hc_mean": [c * h * e, h * e],
          "hc_collapse": [c * h * e, h * e], "hc_expand": [h * e, c * h * e, c * h * e]}[op]
    mixes = {"hc_collapse": c * 4, "hc_expand": c * 4 + c * c * 4}.get(op, 0)
    return n, c, h, spec.out_types[0].dtype.name, gm, sum(gm) + mixes


def _stream_supports(target, spec: KernelSpec) -> bool:
    if not static(*spec.in_types) or spec.out_types[0].dtype.name not in FLOATS:
        return False
    n, c, h, dtype, gm, per_row = _stream_dims(spec)
    src = spec.in_types[1] if spec.op == "hc_expand" else spec.in_types[0]
    mixes = {"hc_collapse": spec.in_types[1:2], "hc_expand": spec.in_types[2:4]}.get(spec.op, ())
    if src.dtype.name != dtype or any(t.dtype.name != "f32" for t in mixes):
        return False
    if spec.op == "hc_expand" and spec.in_types[0].dtype.name != dtype:
        return False
    return row_tiles(target, n, gm, per_row) is not None


def _stream_render(target, spec: KernelSpec, config) -> KernelSource:
    n, c, h, dtype, gm, per_row = _stream_dims(spec)
    g, tiles, grid = row_tiles(target, n, gm, per_row)
    threads = int(config["threads"])
    text = _stream_source(spec.op, n, c, h, dtype, g, tiles, grid, threads)
    return source(spec.op, text, grid, threads, [b * g for b in gm], config)


register(Template(
    name="ascend_hc_stream", ops=("hc_repeat", "hc_mean", "hc_collapse", "hc_expand"), targets=building("ascendc"),
    knobs=THREADS, render=_stream_render, default_config=default_threads, supports=_stream_supports))


# ---- concat along the last dim ------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _concat_source(rows: int, widths: tuple[int, ...], dtype: str, g: int, tiles: int, grid: int):
    """Each operand's tile lands in its column slice of the output tile; one store per tile."""
    import tilelang.ascend.language as T

    ub = UbPlan()
    tdt, total = TL_DTYPE[dtype], sum(widths)
    w0, w1 = widths[0], widths[1]
    if len(widths) == 2:
        @T.prim_func
        def concat(X0: T.Tensor((rows, w0), tdt), X1: T.Tensor((rows, w1), tdt), Y: T.Tensor((rows, total), tdt)):
            with T.Kernel(grid) as core:
                yb = ub((g, total), dtype)
                for t in T.Persistent([tiles], grid, core):
                    T.copy(X0[t * g, 0], yb[:, 0:w0])
                    T.copy(X1[t * g, 0], yb[:, w0:total])
                    T.copy(yb, Y[t * g, 0])
        return lowered(concat, ub)
    w2 = widths[2]

    @T.prim_func
    def concat(X0: T.Tensor((rows, w0), tdt), X1: T.Tensor((rows, w1), tdt), X2: T.Tensor((rows, w2), tdt),
                Y: T.Tensor((rows, total), tdt)):
        with T.Kernel(grid) as core:
            yb = ub((g, total), dtype)
            for t in T.Persistent([tiles], grid, core):
                T.copy(X0[t * g, 0], yb[:, 0:w0])
                T.copy(X1[t * g, 0], yb[:, w0:w0 + w1])
                T.copy(X2[t * g, 0], yb[:, w0 + w1:total])
                T.copy(yb, Y[t * g, 0])
    return lowered(concat, ub)


def _concat_dims(spec: KernelSpec):
    ins, y = spec.in_types, spec.out_types[0]
    e = BYTES[y.dtype.name]
    rows = math.prod(y.shape[:-1])
    widths = tuple(t.shape[-1] for t in ins)
    # every operand row lands at a column offset of the output tile: offsets are granule-aligned too
    gm = [w * e for w in widths] + [y.shape[-1] * e]
    return rows, widths, y.dtype.name, gm


def _concat_supports(target, spec: KernelSpec) -> bool:
    ins, y = spec.in_types, spec.out_types[0]
    if not 2 <= len(ins) <= 3 or not static(*ins) or any(hasattr(t, "data") for t in ins) or y.dtype.name not in BYTES:
        return False
    if spec.attr["axis"] not in (-1, y.rank - 1):
        return False
    rows, widths, dtype, gm = _concat_dims(spec)
    if any((w * BYTES[dtype]) % GRANULE for w in widths):
        return False
    return row_tiles(target, rows, gm, gm[-1]) is not None


def _concat_render(target, spec: KernelSpec, config) -> KernelSource:
    rows, widths, dtype, gm = _concat_dims(spec)
    g, tiles, grid = row_tiles(target, rows, gm, gm[-1])
    return source("concat", _concat_source(rows, widths, dtype, g, tiles, grid), grid, 1, [b * g for b in gm], config)


register(Template(
    name="ascend_concat", ops=("concat",), targets=building("ascendc"), knobs={},
    render=_concat_render, default_config=lambda target, spec: {}, supports=_concat_supports))


# ---- row gathers: embedding, gather_rows --------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _gather_source(op: str, rows: int, n_src: int, h: int, dtype: str, idx: str, grid: int):
    """One row per step, read at its index straight from GM into UB and stored at its place; an
    index outside the source rows moves nothing (the compiler guards the load)."""
    import tilelang.ascend.language as T

    ub = UbPlan()
    tdt, idt = TL_DTYPE[dtype], TL_DTYPE[idx]

    if op == "gather_rows":
        @T.prim_func
        def gather_rows(Src: T.Tensor((n_src, h), tdt), Ids: T.Tensor((rows,), idt), Y: T.Tensor((rows, h), tdt)):
            with T.Kernel(grid) as core:
                xb = ub((h,), dtype)
                for r in T.Persistent([rows], grid, core):
                    T.copy(Src[Ids[r], 0], xb)
                    T.copy(xb, Y[r, 0])
        return lowered(gather_rows, ub)

    @T.prim_func
    def embedding(Ids: T.Tensor((rows,), idt), Table: T.Tensor((n_src, h), tdt), Y: T.Tensor((rows, h), tdt)):
        with T.Kernel(grid) as core:
            xb = ub((h,), dtype)
            for r in T.Persistent([rows], grid, core):
                T.copy(Table[Ids[r], 0], xb)
                T.copy(xb, Y[r, 0])
    return lowered(embedding, ub)


def _gather_dims(spec: KernelSpec):
    src, ids = (spec.in_types[1], spec.in_types[0]) if spec.op == "embedding" else spec.in_types[:2]
    return ids.shape[0], src.shape[0], src.shape[1], src.dtype.name, ids.dtype.name


def _gather_supports(target, spec: KernelSpec) -> bool:
    src, ids = (spec.in_types[1], spec.in_types[0]) if spec.op == "embedding" else spec.in_types[:2]
    if not static(src, ids) or hasattr(src, "data") or src.rank != 2 or ids.rank != 1:
        return False
    if src.dtype.name not in BYTES or ids.dtype.name not in ("i32", "i64"):
        return False
    # each row is its own transfer at an arbitrary index: a row must be whole granules
    return (src.shape[1] * BYTES[src.dtype.name]) % GRANULE == 0 and align32(src.shape[1] * BYTES[src.dtype.name]) \
        <= target.ub_bytes // 2


def _gather_render(target, spec: KernelSpec, config) -> KernelSource:
    rows, n_src, h, dtype, idx = _gather_dims(spec)
    grid = min(rows, target.cores)
    return source(spec.op, _gather_source(spec.op, rows, n_src, h, dtype, idx, grid), grid, 1,
                  [h * BYTES[dtype]], config)


register(Template(
    name="ascend_gather_rows", ops=("embedding", "gather_rows"), targets=building("ascendc"), knobs={},
    render=_gather_render, default_config=lambda target, spec: {}, supports=_gather_supports))


# ---- lookup: the Engram token map ---------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _lookup_source(rows: int, n_tab: int, idx: str, tab: str, dead_ids: tuple[int, ...], dead: int, g: int,
                   tiles: int, grid: int, threads: int):
    """out[t] = table[ids[t]] for ids inside the table and not dead, else DEAD; the table entries
    are read from GM by the SIMT threads (one id each)."""
    import tilelang.ascend.language as T

    ub = UbPlan()
    idt, tdt = TL_DTYPE[idx], TL_DTYPE[tab]

    def live(v):
        ok = T.And(v >= 0, v < n_tab)
        for d in dead_ids:
            ok = T.And(ok, v != d)
        return ok

    @T.prim_func
    def lookup(Table: T.Tensor((n_tab,), tdt), Ids: T.Tensor((rows,), idt), Out: T.Tensor((rows,), "int64")):
        with T.Kernel(grid) as core:
            ib = ub((g,), idx)
            ob = ub((g,), "i64")
            for t in T.Persistent([tiles], grid, core):
                T.copy(Ids[t * g], ib)
                with T.SimtVF(threads=threads):
                    for i in T.Parallel(g):
                        ob[i] = T.if_then_else(live(ib[i]), T.cast(Table[ib[i]], "int64"), T.int64(dead))
                T.copy(ob, Out[t * g])
    return lowered(lookup, ub)


def _lookup_supports(target, spec: KernelSpec) -> bool:
    table, ids = spec.in_types
    return static(table, ids) and table.rank == 1 and ids.rank == 1 and table.dtype.name in ("i32", "i64") \
        and ids.dtype.name in ("i32", "i64")


def _lookup_render(target, spec: KernelSpec, config) -> KernelSource:
    from ...ir.ops.engram import DEAD

    table, ids = spec.in_types
    gm = [BYTES[ids.dtype.name], 8]
    g, tiles, grid = row_tiles(target, ids.shape[0], gm, sum(gm))
    threads = int(config["threads"])
    text = _lookup_source(ids.shape[0], table.shape[0], ids.dtype.name, table.dtype.name,
                          tuple(int(d) for d in spec.attr["dead_ids"]), DEAD, g, tiles, grid, threads)
    return source("lookup", text, grid, threads, [b * g for b in gm], config)


register(Template(
    name="ascend_lookup", ops=("lookup",), targets=building("ascendc"), knobs=THREADS,
    render=_lookup_render, default_config=default_threads, supports=_lookup_supports))


# ---- mHC mixes: the mix GEMM + Sinkhorn (hc_mix), and with the collapse + RMSNorm (hc_pre) -----

@functools.lru_cache(maxsize=64)
def _hc_mix_source(op: str, n: int, c: int, h: int, kc: int, attrs: tuple, g: int, tiles: int, grid: int,
                   threads: int):
    """raw[r, m] = (R[r] . fn[m]) * rsqrt(mean(R[r]^2) + eps) over K = C*H, accumulated over K
    chunks of kc by one SIMT thread per (row, mix) (the last column is the sum of squares); then
    one thread per row runs the Sinkhorn of spec §4.2 on its mixes. hc_pre then collapses each
    row of the stream with the previous `pre` (rounded to the stream's dtype) and RMS-normalises
    it with the norm weight."""
    import tilelang.ascend.language as T

    ub = UbPlan()
    a = dict(attrs)
    k_total, mixes, cc = c * h, 2 * c + c * c, c * c
    bf, f32 = "bfloat16", "float32"
    eps, hc_eps, post_mult = T.float32(a["eps"]), T.float32(a["hc_eps"]), T.float32(a["post_mult"])

    def sigmoid(x):
        return T.float32(1.0) / (T.float32(1.0) + T.exp(-x))

    @T.macro
    def mixes_of_tile(R, FN, Scale, Base, t, rb, fb, acc, pre, post, mm):
        with T.SimtVF(threads=threads):
            for i, m in T.Parallel(g, mixes + 1):
                acc[i, m] = 0.0
        for kt in T.serial(k_total // kc):
            T.copy(R[t * g, kt * kc], rb)
            T.copy(FN[0, kt * kc], fb)
            with T.SimtVF(threads=threads):
                for i, m in T.Parallel(g, mixes + 1):
                    dot = T.alloc_var(f32, init=0.0)
                    for j in T.serial(kc):
                        xv = T.cast(rb[i, j], f32)
                        dot = dot + xv * T.if_then_else(m < mixes, fb[m, j], xv)
                    acc[i, m] = acc[i, m] + dot
        with T.SimtVF(threads=threads):
            for i in T.Parallel(g):
                rs = T.rsqrt(acc[i, mixes] / T.float32(k_total) + eps)
                for j in T.serial(c):
                    pre[i, j] = sigmoid(acc[i, j] * rs * Scale[0] + Base[j]) + hc_eps
                    post[i, j] = post_mult * sigmoid(acc[i, c + j] * rs * Scale[1] + Base[c + j])
                # M[a, b] = softmax over b of the scaled mixes, + eps; then a column step and
                # iters - 1 row / column rounds, each dividing by its sum + eps
                for ra in T.serial(c):
                    mx = T.alloc_var(f32, init=-3.0e38)
                    for b in T.serial(c):
                        mm[i, ra * c + b] = acc[i, 2 * c + ra * c + b] * rs * Scale[2] + Base[2 * c + ra * c + b]
                        mx = T.max(mx, mm[i, ra * c + b])
                    tot = T.alloc_var(f32, init=0.0)
                    for b in T.serial(c):
                        mm[i, ra * c + b] = T.exp(mm[i, ra * c + b] - mx)
                        tot = tot + mm[i, ra * c + b]
                    for b in T.serial(c):
                        mm[i, ra * c + b] = mm[i, ra * c + b] / tot + hc_eps
                for it in T.serial(2 * a["iters"] - 1):
                    # it even: column sums; odd: row sums
                    for u in T.serial(c):
                        tot = T.alloc_var(f32, init=0.0)
                        for v in T.serial(c):
                            tot = tot + T.if_then_else(it % 2 == 0, mm[i, v * c + u], mm[i, u * c + v])
                        for v in T.serial(c):
                            if it % 2 == 0:
                                mm[i, v * c + u] = mm[i, v * c + u] / (tot + hc_eps)
                            else:
                                mm[i, u * c + v] = mm[i, u * c + v] / (tot + hc_eps)

    if op == "hc_mix":
        @T.prim_func
        def hc_mix(R: T.Tensor((n, k_total), bf), FN: T.Tensor((mixes, k_total), f32), Scale: T.Tensor((3,), f32),
                   Base: T.Tensor((mixes,), f32), Pre: T.Tensor((n, c), f32), Post: T.Tensor((n, c), f32),
                   M: T.Tensor((n, cc), f32)):
            with T.Kernel(grid) as core:
                rb = ub((g, kc), "bf16")
                fb = ub((mixes, kc), "f32")
                acc = ub((g, mixes + 1), "f32")
                pre = ub((g, c), "f32")
                post = ub((g, c), "f32")
                mm = ub((g, cc), "f32")
                for t in T.Persistent([tiles], grid, core):
                    mixes_of_tile(R, FN, Scale, Base, t, rb, fb, acc, pre, post, mm)
                    T.copy(pre, Pre[t * g, 0])
                    T.copy(post, Post[t * g, 0])
                    T.copy(mm, M[t * g, 0])
        return lowered(hc_mix, ub)

    lanes = 32

    @T.prim_func
    def hc_pre(R: T.Tensor((n, k_total), bf), FN: T.Tensor((mixes, k_total), f32), Scale: T.Tensor((3,), f32),
               Base: T.Tensor((mixes,), f32), PreIn: T.Tensor((n, c), f32), NormW: T.Tensor((h,), bf),
               X: T.Tensor((n, h), bf), Pre: T.Tensor((n, c), f32), Post: T.Tensor((n, c), f32),
               M: T.Tensor((n, cc), f32)):
        with T.Kernel(grid) as core:
            rb = ub((g, kc), "bf16")
            fb = ub((mixes, kc), "f32")
            acc = ub((g, mixes + 1), "f32")
            pre = ub((g, c), "f32")
            post = ub((g, c), "f32")
            mm = ub((g, cc), "f32")
            rrow = ub((k_total,), "bf16")
            xf = ub((h,), "f32")
            wf = ub((h,), "f32")
            xo = ub((h,), "bf16")
            part = ub((lanes,), "f32")
            stat = ub((8,), "f32")
            T.copy(NormW[0], xo)
            with T.SimtVF(threads=threads):
                for x in T.Parallel(h):
                    wf[x] = T.cast(xo[x], f32)
            for t in T.Persistent([tiles], grid, core):
                mixes_of_tile(R, FN, Scale, Base, t, rb, fb, acc, pre, post, mm)
                T.copy(pre, Pre[t * g, 0])
                T.copy(post, Post[t * g, 0])
                T.copy(mm, M[t * g, 0])
                for i in T.serial(g):
                    if t * g + i < n:
                        T.copy(R[t * g + i, 0], rrow)
                        # the collapse in the stream's dtype is what the reference normalises
                        with T.SimtVF(threads=threads):
                            for x in T.Parallel(h):
                                xf[x] = T.cast(T.cast(fsum([PreIn[t * g + i, j] * T.cast(rrow[j * h + x], f32)
                                                            for j in range(c)]), bf), f32)
                        with T.SimtVF(threads=threads):
                            for p in T.Parallel(lanes):
                                ssq = T.alloc_var(f32, init=0.0)
                                for k in T.serial(h // lanes):
                                    ssq = ssq + xf[k * lanes + p] * xf[k * lanes + p]
                                part[p] = ssq
                        with T.SimtVF(threads=1):
                            stat[0] = T.rsqrt(fsum([part[p] for p in range(lanes)]) / T.float32(h) + eps)
                        with T.SimtVF(threads=threads):
                            for x in T.Parallel(h):
                                xo[x] = T.cast(wf[x] * (xf[x] * stat[0]), bf)
                        T.copy(xo, X[t * g + i, 0])
    return lowered(hc_pre, ub)


def _hc_mix_dims(target, spec: KernelSpec):
    """(n, copies, H, K chunk, attrs, GM bytes per row, UB bytes per tile row, fixed UB bytes)."""
    r, fn = spec.in_types[:2]
    n, c, h = r.shape
    k_total, mixes = c * h, fn.shape[0]
    kc = next((k for k in (256, 128, 64, 32, 16) if k_total % k == 0), None)
    a = spec.attr
    attrs = tuple(sorted({"eps": float(a["eps"]), "hc_eps": float(a["hc_eps"]), "post_mult": float(a["post_mult"]),
                          "iters": int(a["iters"])}.items()))
    gm = [c * 4, c * 4, c * c * 4] + ([h * 2] if spec.op == "hc_pre" else [])
    per_row = (kc or 0) * 2 + (mixes + 1) * 4 + 2 * c * 4 + c * c * 4
    fixed = (mixes * (kc or 0) * 4) + ((k_total * 2 + h * 12 + 32 * 4 + 32) if spec.op == "hc_pre" else 0)
    return n, c, h, kc, attrs, gm, per_row, fixed


def _hc_mix_supports(target, spec: KernelSpec) -> bool:
    if not static(*spec.in_types):
        return False
    r, fn, scale, base = spec.in_types[:4]
    if r.rank != 3 or r.dtype.name != "bf16" or any(t.dtype.name != "f32" for t in (fn, scale, base)):
        return False
    n, c, h, kc, attrs, gm, per_row, fixed = _hc_mix_dims(target, spec)
    if kc is None or fn.shape[0] != 2 * c + c * c or spec.attr["copies"] != c or spec.attr["iters"] < 1:
        return False
    if spec.op == "hc_pre":
        pre_in, norm_w = spec.in_types[4:6]
        if pre_in.dtype.name != "f32" or norm_w.dtype.name != "bf16" or h % 32 or (h * 2) % GRANULE:
            return False
    return row_tiles(target, n, gm, per_row, fixed, ub_share=0.9) is not None


def _hc_mix_render(target, spec: KernelSpec, config) -> KernelSource:
    n, c, h, kc, attrs, gm, per_row, fixed = _hc_mix_dims(target, spec)
    g, tiles, grid = row_tiles(target, n, gm, per_row, fixed, ub_share=0.9)
    threads = int(config["threads"])
    text = _hc_mix_source(spec.op, n, c, h, kc, attrs, g, tiles, grid, threads)
    # the K chunks of R and fn are strided 2-D transfers: kc-element bursts at K-element strides
    chunk = [kc * 2, kc * 4, c * h * 2, c * h * 4]
    rows = [b * g for b in gm[:3]] + ([h * 2] if spec.op == "hc_pre" else [])
    return source(spec.op, text, grid, threads, rows + chunk, config)


register(Template(
    name="ascend_hc_mix", ops=("hc_mix", "hc_pre"), targets=building("ascendc"), knobs=THREADS,
    render=_hc_mix_render, default_config=default_threads, supports=_hc_mix_supports))
