"""TileLang fp8 GEMM at decode on warp MMAs: `gemm_fp8` (ir/ops/quantized.py) for calls of at most
`mma_rows` rows (8 on sm90), on targets whose defaults carry `tilelang_gemm_fp8_mma`.

The same operands as tilelang_gemm's decode program (fp8 e4m3 rows with ue8m0 per 32, an fp8
weight [N, K] with ue8m0 per 32x32 block; the row count a kernel argument, split-K partials added
in split order by its `gemm_split_sum_program`, the same host). That program runs a 64-row wgmma
tile for the one to 64 live rows, rescales the whole 64 x 64 accumulator tile per 32-deep scale
block and waits on each wgmma before it. Here the weight is the 16-row A operand of `mma.sync
m16n8k32` and the rows are the 8-wide B operand, as the MoE decode GEMM does
(tilelang_moe_decode): a lane reads its A fragment's words as they are (both operands are e4m3,
nothing is widened), one MMA per scale block, 16 weight rows and 8 rows, scaled into fp32 by one
weight scale (the 16 rows lie in one 32-row block) and the row's scale.

On the H200 it runs the medium plan's lin8 calls of 1 and 8 rows 1.3 to 2.4 times faster than the
wgmma program (the four shapes timed), and loses at 64 rows (bench/gemm_fp8_decode.py;
docs/performance.md, eleventh session).

The module also holds a program for the 9 to 64 rows it leaves, on a persistent grid
(`gemm_fp8_rows_persistent_program`, template tilelang_gemm_fp8_persistent), which a target
turns on with `tilelang_gemm_fp8_persistent` in its defaults; none does until it is timed.
"""
import dataclasses
import re
from typing import Any, Mapping

import torch

from ..targets import Target, building
from ..template import KernelSource, KernelSpec, Template, batch_invariant, register

# tilelang_gemm is imported where used: importing it here would register its templates ahead of
# the Triton ones (this module is imported before triton_ops), and selection takes the first


def gemm_fp8_mma_rows_program(N: int, K: int, out_dtype: str = "bfloat16", *, RT=4, WK=4, KU=2, STAGES=3, NT=1,
                              split_k=1, rows=64, CLUSTER=0, F16=0):
    """C[m, N] = sum_k A[m, k] sa[m, k//32] * B[n, k] sb[n//32, k//32] for m <= `rows` live rows
    (a kernel argument). CTA (16*RT weight rows, split): WK warps take turns over the split's
    scale blocks, KU each per step, and add their sums through shared memory in warp order; the
    step's weight tile is copied into shared memory STAGES steps ahead (cp.async), its rows
    padded by 16 bytes so the lanes' 4-byte reads hit distinct banks; the weight and row scales
    of the CTA's K range once before the loop. Lane (g, q) reads words q and 4 + q of weight rows
    g and g + 8's 32-byte block (A slots 4q.. and 16+4q..) and the same two words of row g of A
    (B slots). NT tiles of 8 rows per pass over the weights, the tiles past m skipped (a pass wide
    enough for the largest bucket costs the smallest one no MMAs). split_k > 1 writes fp32 partials
    P[split, rows, N] for the combine; with CLUSTER the split's CTAs are one thread-block cluster
    (the source needs `cluster_dims_source`), and after a cluster barrier (release / acquire at
    cluster scope, so the partials in global memory are visible) its first CTA adds them in split
    order, as the combine would, and writes C: no second kernel. F16: the MMAs as f16 pairs
    (tilelang_warp_mma.scaled_mma), the rows' pairs converted once per block."""
    from .tilelang_gemm import _tl, e8m0_f32
    from .tilelang_warp_mma import F16_PRELUDE, f16_x, out_position, scaled_mma, warp_order_sum

    _, T = _tl()
    mma, total = scaled_mma(T, NT, guarded=True, f16=bool(F16)), warp_order_sum(T, WK, RT * NT * 4)
    widen_x = f16_x(T, NT)
    kbs = K // 32
    assert K % 32 == 0 and (kbs // split_k) % WK == 0 and kbs % split_k == 0 and N % (16 * RT) == 0
    assert (16 * RT) % 32 == 0 or 32 % (16 * RT) == 0
    per = kbs // split_k  # scale blocks of a split
    ku = max(u for u in range(1, KU + 1) if (per // WK) % u == 0)
    br, tt, nacc = 16 * RT, 8 * NT, RT * NT * 4
    cw = WK * ku * 8  # a step's weight words per row
    sbr = max(br // 32, 1)  # 32-row scale blocks the CTA's rows span
    m = T.dynamic("m")
    out_shape, c_dtype = ((split_k, rows, N), "float32") if split_k > 1 else ((m, N), out_dtype)
    cluster = cluster_split({"CLUSTER": CLUSTER, "split_k": split_k})
    assert not cluster or split_k <= 8, "a portable cluster holds at most 8 CTAs"
    threads = 32 * WK
    # TileLang's own launcher (the benches) passes the cluster shape at launch; a plan's source
    # carries it (cluster_dims_source)
    launch, launch_kw = (T.ClusterKernel, {"cluster_dims": (1, split_k, 1)}) if cluster else (T.Kernel, {})
    if F16:
        launch_kw["prelude"] = F16_PRELUDE

    @T.macro
    def block(A, B_s, SA_s, SB_s, a, b, c, acc, sx, bx, tb, g, q, kb, kw):
        """Scale block kb (kb - the split's first: its column in the staged scales) for the
        warp's rows; kw: its word column in the staged weight tile."""
        for nt in T.unroll(NT):
            tok = tb + nt * 8 + g
            b[2 * nt] = T.if_then_else(tok < m, A[tok, kb * 8 + q], T.uint32(0))
            b[2 * nt + 1] = T.if_then_else(tok < m, A[tok, kb * 8 + 4 + q], T.uint32(0))
            for j in T.unroll(2):
                tj = nt * 8 + 2 * q + j
                sx[2 * nt + j] = T.if_then_else(tb + tj < m, e8m0_f32(T, SA_s[tj, kb % per]), T.float32(0))
        if F16:
            widen_x(b)
        for rt in T.unroll(RT):
            a[0] = B_s[rt * 16 + g, kw + q]
            a[1] = B_s[rt * 16 + g + 8, kw + q]
            a[2] = B_s[rt * 16 + g, kw + 4 + q]
            a[3] = B_s[rt * 16 + g + 8, kw + 4 + q]
            s = e8m0_f32(T, SB_s[(rt * 16) // 32, kb % per])
            mma(a, b, c, acc, rt * NT * 4, s, s, sx, m - tb)

    @T.macro
    def cluster_combine(P, C, bx, bz, tb, tx):
        """After the split's CTAs wrote their partials: its first CTA adds them in split order."""
        T.cluster_sync()
        if bz == 0:
            for j in T.serial(T.ceildiv(tt * br, threads)):
                e = j * threads + tx
                if e < tt * br and tb + e // br < m:
                    tot = T.alloc_var("float32")
                    tot = T.float32(0)
                    for sp in T.serial(split_k):
                        tot += P[sp, tb + e // br, bx * br + e % br]
                    C[tb + e // br, bx * br + e % br] = T.Cast(out_dtype, tot)

    @T.macro
    def body(A, SA, B, SB, C, P):
        """P: the split partials (C itself unless the cluster combines them)."""
        with launch(N // br, split_k, threads=threads, **launch_kw) as (bx, bz):
            tx = T.get_thread_binding()
            wp = tx // 32
            g = (tx % 32) // 4
            q = tx % 4
            red = T.alloc_shared((WK, nacc, 32), "float32")
            B_s = T.alloc_shared((br, cw + 4), "uint32")
            SB_s = T.alloc_shared((sbr, per), "uint8")
            SA_s = T.alloc_shared((tt, per), "uint8")
            a = T.alloc_local((12 if F16 else 4,), "uint32")
            b = T.alloc_local((6 * NT if F16 else 2 * NT,), "uint32")
            c = T.alloc_local((4,), "float32")
            acc = T.alloc_local((nacc,), "float32")
            sx = T.alloc_local((2 * NT,), "float32")
            T.copy(SB[(bx * br) // 32, bz * per], SB_s)
            for t0 in T.serial(T.ceildiv(m, tt)):
                tb = t0 * tt
                for i in T.unroll(nacc):
                    acc[i] = T.float32(0)
                # rows past m read as zeros (the copy is predicated at m); their columns of the
                # MMA are never stored
                T.copy(SA[tb, bz * per], SA_s)
                for ko in T.Pipelined(per // (WK * ku), num_stages=STAGES):
                    T.copy(B[bx * br:(bx + 1) * br, (bz * per + ko * WK * ku) * 8:(bz * per + (ko + 1) * WK * ku) * 8],
                           B_s[:, 0:cw])
                    for kk in T.unroll(ku):
                        block(A, B_s, SA_s, SB_s, a, b, c, acc, sx, bx, tb, g, q,
                              bz * per + ko * WK * ku + wp * ku + kk, (wp * ku + kk) * 8)
                total(red, acc, wp, tx % 32)
                if wp == 0:
                    for i in T.unroll(nacc):
                        dt, dr = out_position(T, i, NT)
                        if tb + 2 * q + dt < m:
                            if split_k > 1:
                                P[bz, tb + 2 * q + dt, bx * br + g + dr] = acc[i]
                            else:
                                C[tb + 2 * q + dt, bx * br + g + dr] = T.Cast(c_dtype, acc[i])
                if cluster:
                    cluster_combine(P, C, bx, bz, tb, tx)
                if WK > 1:
                    T.sync_threads()

    if cluster:
        @T.prim_func
        def gemm_fp8_mma(A: T.Tensor((m, K // 4), "uint32"), SA: T.Tensor((m, kbs), "uint8"),
                         B: T.Tensor((N, K // 4), "uint32"), SB: T.Tensor(((N + 31) // 32, kbs), "uint8"),
                         C: T.Tensor((m, N), out_dtype), P: T.Tensor((split_k, rows, N), "float32")):
            body(A, SA, B, SB, C, P)
    else:
        @T.prim_func
        def gemm_fp8_mma(A: T.Tensor((m, K // 4), "uint32"), SA: T.Tensor((m, kbs), "uint8"),
                         B: T.Tensor((N, K // 4), "uint32"), SB: T.Tensor(((N + 31) // 32, kbs), "uint8"),
                         C: T.Tensor(out_shape, c_dtype)):
            body(A, SA, B, SB, C, C)

    return gemm_fp8_mma


MMA_KNOBS = {"RT": (2, 4), "WK": (2, 4), "KU": (1, 2), "STAGES": (2, 3, 4), "NT": (1, 2),
             "split_k": (1, 2, 4, 8, 16), "CTAS": (2, 4, 8), "CLUSTER": (0, 1), "F16": (0, 1)}


def _mnk(spec: KernelSpec):
    from .tilelang_gemm import _mnk as mnk  # where used: see the imports above

    return mnk(spec)


def mma_config(target: Target, n: int, k: int, knobs: Mapping[str, Any] | None = None) -> dict:
    """`knobs` over the target's, and (unless given) a K split: the largest that gives each warp
    whole scale blocks and keeps the grid within `CTAS` CTAs per SM. At 1-8 rows a call of few
    weight tiles is latency-bound: without a split most SMs sit idle, and each CTA's steps run
    one after another."""
    c = dict(target.defaults["tilelang_gemm_fp8_mma"], **(knobs or {}))
    ctas = c.pop("CTAS", 2)
    tiles, steps = n // (16 * c["RT"]), k // (32 * c["WK"])
    top = 8 if c.get("CLUSTER") else 64  # a portable cluster: at most 8 CTAs
    c.setdefault("split_k", max((s for s in range(1, top + 1) if steps % s == 0 and tiles * s <= ctas * target.cores),
                                default=1))
    return c


def cluster_split(c: Mapping[str, Any]) -> bool:
    """Whether config `c`'s K split is added inside a cluster (no combine kernel)."""
    return bool(c.get("CLUSTER")) and c.get("split_k", 1) > 1


def cluster_dims_source(text: str, entry: str, dims: tuple[int, int, int]) -> str:
    """The kernel's declaration and definition with a compile-time cluster shape, which a plain
    launch honours (TileLang's own launcher passes it at launch instead)."""
    attr = f"__cluster_dims__({dims[0]}, {dims[1]}, {dims[2]})"
    out, n = re.subn(r"(__global__ void )((?:__launch_bounds__\([^)]*\) )?" + re.escape(entry) + r"\()",
                     lambda mt: mt.group(1) + attr + " " + mt.group(2), text)
    assert n, f"{entry} not found in its source"
    return out


def default_config(target: Target, spec: KernelSpec) -> dict:
    _, n, k = _mnk(spec)
    return mma_config(target, n, k)


def mma_rows(target: Target) -> int:
    """The row counts it serves: one pass of the target's 8-row tiles. Wider calls stay on the
    64-row wgmma program (tilelang_gemm): another pass streams the weight again, and a wider
    pass holds more accumulators, which costs the few-row calls time (docs/performance.md,
    eleventh session)."""
    return 8 * target.defaults["tilelang_gemm_fp8_mma"]["NT"]


def _render(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    from .tilelang_gemm import out_dtype_name, source

    m, n, k = _mnk(spec)
    c = mma_config(target, n, k, config)
    func = gemm_fp8_mma_rows_program(n, k, out_dtype_name(spec), rows=m, **c)
    src = source(func, target.arch, {"template": "tilelang_gemm_fp8_mma", "config": c, "mnk": (m, n, k),
                                     "rows_argument": True})
    if cluster_split(c):
        src = dataclasses.replace(src, text=cluster_dims_source(src.text, src.entry, (1, c["split_k"], 1)))
    elif c["split_k"] > 1:
        _with_split_sum(src, target, spec, c["split_k"])
    return src


def _with_split_sum(src: KernelSource, target: Target, spec: KernelSpec, split_k: int) -> None:
    """The split partials' combine (gemm_split_sum_program over the instance's rows) as the
    source's second kernel, which the host launches after the first."""
    from .tilelang_gemm import gemm_split_sum_program, lower, out_dtype_name

    m, n, _ = _mnk(spec)
    comb = lower(gemm_split_sum_program(n, split_k, m, out_dtype_name(spec)), target.arch)
    src.meta["combine"] = {"entry": comb["entry"], "text": comb["src"], "grid": comb["grid"],
                           "block": comb["block"], "smem_bytes": comb["smem"], "params": comb["params"]}


def fp8_operands(target: Target, spec: KernelSpec, key: str) -> bool:
    """The lin8 programs' operands (warp-MMA, persistent, bf16 prefill): e4m3 rows with ue8m0 per
    32, an e4m3 weight with ue8m0 per 32 x 32 block, static shapes, a bf16 or f32 output; a target
    whose defaults carry `key`, not a batch-invariant plan."""
    from ...ir.types import QuantType

    if key not in target.defaults or batch_invariant(target):
        return False
    x, w = spec.in_types[:2]
    if not (isinstance(x, QuantType) and isinstance(w, QuantType)) or w.rank != 2:
        return False
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape)):
        return False
    return (x.data.dtype.name == "fp8e4m3" and x.scale.dtype.name == "e8m0" and tuple(x.block)[-1] == 32
            and w.data.dtype.name == "fp8e4m3" and w.scale.dtype.name == "e8m0" and tuple(w.block) == (32, 32)
            and spec.out_types[0].dtype.name in ("bf16", "f32"))


def _supports(target: Target, spec: KernelSpec) -> bool:
    """Calls of at most mma_rows rows in the e4m3 / ue8m0 formats the kernel reads, K a multiple
    of the warps' blocks and N of the CTA's rows and the combine's columns; not in a
    batch-invariant plan."""
    if not fp8_operands(target, spec, "tilelang_gemm_fp8_mma"):
        return False
    m, n, k = _mnk(spec)
    c = default_config(target, spec)
    return (m <= mma_rows(target) and k % (32 * c["WK"] * c["split_k"]) == 0 and n % 256 == 0
            and n % (16 * c["RT"]) == 0)


def _host(launch, inputs, attrs, config, meta):
    from .tilelang_host import _torch_dtype, host_gemm_fp8

    if not cluster_split(config):
        return host_gemm_fp8(launch, inputs, attrs, config, meta)
    x, w = inputs  # the cluster's first CTA adds the partials: one launch
    k, n = x.data.shape[-1], w.data.shape[0]
    a = x.data.reshape(-1, k).contiguous()
    m, dev = a.shape[0], a.device
    c = torch.empty(m, n, dtype=_torch_dtype(attrs["out_dtype"]), device=dev)
    p = torch.empty(config["split_k"], meta["mnk"][0], n, dtype=torch.float32, device=dev)
    launch(0, A=a, SA=x.scale.reshape(-1, k // 32).contiguous(), B=w.data, SB=w.scale, C=c, P=p, m=m)
    return c.reshape(*x.data.shape[:-1], n)


def _canonical(target: Target, spec: KernelSpec) -> KernelSpec:
    """Every call it serves shares the mma_rows-row instance (the rows are a kernel argument, as
    in tilelang_gemm.canonical_rows, whose instance is the wgmma tile's 64 rows); the combine
    adds that many rows of partials."""
    from .tilelang_gemm import rows_type

    rows, (m, n, _) = mma_rows(target), _mnk(spec)
    if m == rows:
        return spec
    return KernelSpec(spec.op, spec.attrs, (rows_type(spec.in_types[0], rows),) + tuple(spec.in_types[1:]),
                      (spec.out_types[0].with_shape((rows, n)),) + tuple(spec.out_types[1:]))


register(Template(
    name="tilelang_gemm_fp8_mma",
    ops=("gemm_fp8",),
    targets=building("cuda", defaults="tilelang_gemm_fp8_mma"),
    knobs=MMA_KNOBS,
    render=_render,
    default_config=default_config,
    supports=_supports,
    host=_host,
    canonical=_canonical,
))


# ---- 64 decode rows on a persistent grid (a target enables it: tilelang_gemm_fp8_persistent) ----

def gemm_fp8_rows_persistent_program(N: int, K: int, out_dtype: str = "bfloat16", *, block_N=128, block_K=128,
                                     stages=4, split_k=1, group=1, rows=64, threads=128):
    """gemm_fp8_rows_program's product (up to `rows` live rows, m a kernel argument, split
    partials P [split_k, rows, N] for gemm_split_sum_program) on a persistent grid: CTA (lane,
    split) loads its split's K range of x (all rows, with their scales) into shared memory once,
    then streams the weight tiles of `group` N tiles (lane, lane + lanes, ...) through one
    pipeline of `stages` steps that does not drain between tiles. The 64-row wgmma program
    (tilelang_gemm) reloads x's tile at every step of every CTA and its grid is under one wave of
    a few CTAs an SM, which leaves it latency-bound at 64 rows (ncu: docs/performance.md,
    eighteenth session). At the same K split, the same products and sums as that program in the
    same order; the split it takes is chosen for this grid (persistent_config), so the sums of
    a split shape may differ from that program's by rounding."""
    from .tilelang_gemm import _tl, ceil_div, e8m0_f32

    _, T = _tl()
    kb = block_K // 32
    xk = K // split_k  # the K range of a split
    steps = xk // block_K  # a tile's steps
    n_tiles = N // block_N
    assert N % block_N == 0 and K % split_k == 0 and xk % block_K == 0 and n_tiles % group == 0
    lanes = n_tiles // group
    m = T.dynamic("m")
    out_shape, c_dtype = ((split_k, rows, N), "float32") if split_k > 1 else ((m, N), out_dtype)

    @T.prim_func
    def gemm_fp8(A: T.Tensor((m, K), "float8_e4m3"), SA: T.Tensor((m, K // 32), "uint8"),
                 B: T.Tensor((N, K), "float8_e4m3"), SB: T.Tensor((ceil_div(N, 32), K // 32), "uint8"),
                 C: T.Tensor(out_shape, c_dtype)):
        with T.Kernel(lanes, split_k, threads=threads) as (bx, bz):
            X_s = T.alloc_shared((rows, xk), "float8_e4m3")
            SX_s = T.alloc_shared((rows, xk // 32), "uint8")
            B_s = T.alloc_shared((block_N, block_K), "float8_e4m3")
            SB_s = T.alloc_shared((block_N // 32, kb), "uint8")
            tmp = T.alloc_fragment((rows, block_N), "float32")
            acc = T.alloc_fragment((rows, block_N), "float32")
            # rows past m read as zeros (the copies are predicated); their outputs are not stored
            T.copy(A[0, bz * xk], X_s)
            T.copy(SA[0, bz * (xk // 32)], SX_s)
            for it in T.Pipelined(group * steps, num_stages=stages):
                tile = bx + (it // steps) * lanes
                ks = it % steps
                T.copy(B[tile * block_N, bz * xk + ks * block_K], B_s)
                T.copy(SB[tile * (block_N // 32), bz * (xk // 32) + ks * kb], SB_s)
                if ks == 0:
                    T.clear(acc)
                for kk in T.unroll(kb):
                    T.gemm(X_s[:, ks * block_K + kk * 32:ks * block_K + kk * 32 + 32], B_s[:, kk * 32:(kk + 1) * 32],
                           tmp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    for i, j in T.Parallel(rows, block_N):
                        acc[i, j] += tmp[i, j] * (e8m0_f32(T, SX_s[i, ks * kb + kk]) * e8m0_f32(T, SB_s[j // 32, kk]))
                if ks == steps - 1:
                    if split_k > 1:
                        T.copy(acc, C[bz, 0, tile * block_N])
                    else:
                        T.copy(acc, C[0, tile * block_N])

    return gemm_fp8


# the tuner's space; the K split and the tiles a CTA takes are chosen per shape (persistent_config)
# from the shape's divisors, or taken as given
PERSISTENT_KNOBS = {"block_N": (64, 128), "stages": (3, 4, 6, 8)}
_PERSISTENT_GIVEN = ("block_N", "stages", "split_k", "group")
_PERSISTENT_CTAS_PER_SM = 2  # ~150-240 registers a thread: two CTAs of 128 threads
_SMEM_PER_SM, _SMEM_RESERVED = 228 << 10, 1 << 10  # an SM's shared memory; what each CTA's launch holds back


def persistent_smem(k: int, c: Mapping[str, Any], rows: int = 64) -> int:
    """Shared memory of a CTA, at least what TileLang lays out (x's split range and its scales,
    `stages` weight tiles and their scales; 1 KB for alignment)."""
    xk = k // c["split_k"]
    return rows * xk * 33 // 32 + c["stages"] * (c["block_N"] * 128 + c["block_N"] // 32 * 4) + 1024


_INFLIGHT_PER_SM = 48 << 10  # weight bytes an SM keeps in flight to stream at its share of HBM
_X_BYTES = 96 << 10  # a split's x rows in shared memory: wider ranges spill (the copy's registers)


def persistent_config(target: Target, n: int, k: int, knobs: Mapping[str, Any] | None = None) -> dict | None:
    """`knobs` over the target's, the rest chosen: of the (block_N, stages, split_k, group) whose
    CTAs fit the SMs in one wave, the least modelled cost: weight bytes plus the split partials'
    write and read, over the share of SMs with work, the share of _INFLIGHT_PER_SM their
    pipelines keep in flight, and the share of each CTA's steps outside its pipeline's fill. None
    where nothing fits."""
    base = dict(target.defaults.get("tilelang_gemm_fp8_persistent", {}), **(knobs or {}))
    base = {a: v for a, v in base.items() if a in _PERSISTENT_GIVEN}  # the program's knobs
    base["block_K"] = 128  # the model's steps; the program takes one scale-block pair per wgmma pair
    steps = k // 128

    def choices(name, default):
        return [base[name]] if name in base else default

    best, key = None, None
    for bn in choices("block_N", PERSISTENT_KNOBS["block_N"]):
        if n % bn or k % 128:
            continue
        tiles = n // bn
        for st in choices("stages", PERSISTENT_KNOBS["stages"]):
            for s in choices("split_k", [d for d in range(1, steps + 1) if steps % d == 0]):
                for g in choices("group", [d for d in range(1, tiles + 1) if tiles % d == 0]):
                    c = dict(base, block_N=bn, stages=st, split_k=s, group=g)
                    if steps % s or tiles % g or 64 * (k // s) > _X_BYTES:
                        continue
                    smem = persistent_smem(k, c)
                    per_sm = min(_SMEM_PER_SM // (smem + _SMEM_RESERVED), _PERSISTENT_CTAS_PER_SM)
                    ctas = tiles // g * s
                    if smem > target.smem_bytes:
                        continue
                    if per_sm < 1 or ctas > per_sm * target.cores:
                        continue
                    run = g * steps // s  # a CTA's steps through its one pipeline
                    traffic = 1 + (2 * s * 64 * 4 / k if s > 1 else 0)  # partial bytes per weight byte
                    inflight = min(ctas / target.cores, per_sm) * (st - 1) * bn * 128
                    eff = min(1.0, ctas / target.cores) * min(1.0, inflight / _INFLIGHT_PER_SM) * run / (run + st)
                    if key is None or (traffic / eff, s, g, st) < key:
                        best, key = c, (traffic / eff, s, g, st)
    return best


def _persistent_supports(target: Target, spec: KernelSpec) -> bool:
    """What tilelang_gemm_fp8_mma takes (its formats, not a batch-invariant plan), for the rows it
    leaves (up to 64), where the target's defaults carry `tilelang_gemm_fp8_persistent` (its
    knobs; none is on by default: not yet timed on the H200) and a config fits."""
    from .tilelang_gemm import DECODE_ROWS, SPLIT_SUM_COLS

    if not fp8_operands(target, spec, "tilelang_gemm_fp8_persistent"):
        return False
    m, n, k = _mnk(spec)
    return m <= DECODE_ROWS and n % SPLIT_SUM_COLS == 0 and persistent_config(target, n, k) is not None


def _persistent_render(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    from .tilelang_gemm import DECODE_ROWS, out_dtype_name, source

    m, n, k = _mnk(spec)
    assert m == DECODE_ROWS, "the persistent program renders the canonical 64-row instance"
    c = persistent_config(target, n, k, config)
    if c is None:
        raise ValueError(f"tilelang_gemm_fp8_persistent: no config of {dict(config)} fits {n} x {k}")
    func = gemm_fp8_rows_persistent_program(n, k, out_dtype_name(spec), rows=m, **c)
    src = source(func, target.arch, {"template": "tilelang_gemm_fp8_persistent", "config": c, "mnk": (m, n, k),
                                     "rows_argument": True})
    if c["split_k"] > 1:
        _with_split_sum(src, target, spec, c["split_k"])
    return src


def _persistent_host(launch, inputs, attrs, config, meta):
    from .tilelang_host import host_gemm_fp8

    return host_gemm_fp8(launch, inputs, attrs, config, meta)


def _persistent_canonical(target: Target, spec: KernelSpec) -> KernelSpec:
    from .tilelang_gemm import canonical_rows

    return canonical_rows(target, spec)


register(Template(
    name="tilelang_gemm_fp8_persistent",
    ops=("gemm_fp8",),
    targets=building("cuda", defaults="tilelang_gemm_fp8_mma"),
    knobs=PERSISTENT_KNOBS,
    render=_persistent_render,
    default_config=lambda target, spec: persistent_config(target, *_mnk(spec)[1:]),
    supports=_persistent_supports,
    host=_persistent_host,
    canonical=_persistent_canonical,
))
