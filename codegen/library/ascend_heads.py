"""TileLang-Ascend `dspark_heads` for ascend950 (ir/ops/heads.py, spec §5.4): per sequence, for each
block row s in turn, logits = RMSNorm(hb_s) . head^T + membed[prev] . mhead^T (prev: the sequence's
t* for s = 0, else draft s-1), draft s = the first maximal vocabulary id, confidence logit
z_s = [hb_s ; membed[prev]] . proj.

Vector core only, one AI core per sequence (`T.Persistent` over sequences): each draft depends on
the previous one's argmax over the whole vocabulary, and TileLang-Ascend's kernels have no
cross-core reduction, so one core owns a sequence's five steps. Per step: the row's RMSNorm in
SIMT (fp32 sum of squares, rounded to bf16 as the reference rounds), then the vocabulary in tiles
of 64 rows: the head tile GM -> UB in K chunks of 512 (strided DMA), one SIMT thread per vocabulary
row accumulating its dot in fp32 across the chunks, the Markov tile likewise, and a running
(value, id) maximum per thread (strict >, ids ascending per thread); the 64 threads' maxima are
reduced with the lower id on equal values. The head is streamed once per step and sequence (5 x
1.3 GB at the real model's 129280 x 5120): a correct program, not a fast one; a cube GEMM of the
block rows with a cross-core argmax is the way to speed it up.

Numerics: the reference sums each dot product in fp64 and rounds once to fp32 (`mm32`); here the
dots are summed in fp32, so logits can differ in the last bits and a near-tie can pick another id.
Rendered and capacity-checked here (no CPU path runs TileLang-Ascend kernels), never built with
CANN or run on an Ascend 950: unverified.
"""
# no `from __future__ import annotations`: TileLang evaluates the prim_func's T.Tensor hints

import functools

from ..targets import building
from ..template import KernelSource, KernelSpec, Template, register
from .ascend_common import SIMT_CONTEXT_BYTES, TL_DTYPE, align32, lower_ascend
from .ascend_state import static

BV = 64  # vocabulary rows per tile: one SIMT thread each
KC = 512  # head columns per DMA chunk


def heads_dims(spec: KernelSpec) -> dict:
    hb, first, norm, head, membed, mhead, proj = spec.in_types
    rows, h = hb.shape
    return {"rows": rows, "H": h, "n": first.shape[0], "B": int(spec.attr["block"]), "V": head.shape[0],
            "R": membed.shape[1], "first": first.dtype.name, "eps": float(spec.attr["eps"])}


def heads_plan(d: dict, cores: int) -> dict:
    h, r, b = d["H"], d["R"], d["B"]
    ub = [align32(h * 2), align32(h * 2), align32(h * 4), align32((h + r) * 2)]  # hb row, norm w, normed, proj
    ub += [align32(r * 2), align32(BV * KC * 2), align32(BV * r * 2)]  # Markov row, head chunk, Markov tile
    ub += [align32(BV * 4)] * 3 + [align32(BV * 4)]  # dots, best values, best ids, partial sums
    ub += [align32(b * 8), align32(b * 4), align32(8 * 4)]  # drafts, confidences, scalars
    ub.append(SIMT_CONTEXT_BYTES)
    return {"grid": min(d["n"], cores), "buffers": {"ub": ub}}


@functools.lru_cache(maxsize=32)
def _heads_source(n: int, B: int, H: int, V: int, R: int, first: str, eps: float, grid: int) -> str:
    import tilelang.ascend.language as T

    fdt = TL_DTYPE[first]
    nk = H // KC
    nv = V // BV

    @T.prim_func
    def dspark_heads(hb: T.Tensor((n * B, H), T.bfloat16), first_tok: T.Tensor((n,), fdt),
                     norm: T.Tensor((H,), T.bfloat16), head: T.Tensor((V, H), T.bfloat16),
                     membed: T.Tensor((V, R), T.bfloat16), mhead: T.Tensor((V, R), T.bfloat16),
                     proj: T.Tensor((1, H + R), T.bfloat16), drafts: T.Tensor((n, B), T.int64),
                     conf: T.Tensor((n, B), T.float32)):
        with T.Kernel(grid) as core:
            xb = T.alloc_shared((H,), T.bfloat16)
            wb = T.alloc_shared((H,), T.bfloat16)
            nb = T.alloc_shared((H,), T.float32)
            pb = T.alloc_shared((H + R,), T.bfloat16)
            mb = T.alloc_shared((R,), T.bfloat16)
            hc = T.alloc_shared((BV, KC), T.bfloat16)
            mh = T.alloc_shared((BV, R), T.bfloat16)
            dot = T.alloc_shared((BV,), T.float32)
            bv = T.alloc_shared((BV,), T.float32)
            bi = T.alloc_shared((BV,), T.int32)
            part = T.alloc_shared((BV,), T.float32)
            dr = T.alloc_shared((B,), T.int64)
            cf = T.alloc_shared((B,), T.float32)
            sc = T.alloc_shared((8,), T.float32)
            T.copy(norm[0:H], wb)
            T.copy(proj[0, 0:H + R], pb)
            for q in T.Persistent([n], grid, core):
                for s in T.serial(B):
                    prev = T.if_then_else(s == 0, T.Cast("int64", first_tok[q]), dr[T.max(s - 1, 0)])
                    T.copy(membed[prev, 0:R], mb)
                    T.copy(hb[q * B + s, 0:H], xb)
                    # RMSNorm: fp32 sum of squares in 64 strided partials, then one thread
                    with T.SimtVF(threads=BV):
                        j = T.get_thread_binding()
                        a = T.alloc_var(T.float32)
                        a = 0.0
                        for i in T.serial(H // BV):
                            x = T.cast(xb[i * BV + j], T.float32)
                            a = a + x * x
                        part[j] = a
                    with T.SimtVF(threads=1):
                        tot = T.alloc_var(T.float32)
                        tot = 0.0
                        for j in T.serial(BV):
                            tot = tot + part[j]
                        sc[0] = T.rsqrt(tot / T.float32(H) + T.float32(eps))
                    with T.SimtVF(threads=BV):
                        for i in T.Parallel(H):
                            nb[i] = T.cast(T.cast(T.cast(wb[i], T.float32) * (T.cast(xb[i], T.float32) * sc[0]),
                                                  T.bfloat16), T.float32)
                        for j in T.Parallel(BV):
                            bv[j] = -T.infinity(T.float32)
                            bi[j] = 0
                    for vt in T.serial(nv):
                        with T.SimtVF(threads=BV):
                            for j in T.Parallel(BV):
                                dot[j] = 0.0
                        for kc in T.serial(nk):
                            T.copy(head[vt * BV:(vt + 1) * BV, kc * KC:(kc + 1) * KC], hc)
                            with T.SimtVF(threads=BV):
                                j = T.get_thread_binding()
                                a = T.alloc_var(T.float32)
                                a = dot[j]
                                for i in T.serial(KC):
                                    a = a + nb[kc * KC + i] * T.cast(hc[j, i], T.float32)
                                dot[j] = a
                        T.copy(mhead[vt * BV:(vt + 1) * BV, 0:R], mh)
                        with T.SimtVF(threads=BV):
                            j = T.get_thread_binding()
                            a = T.alloc_var(T.float32)
                            a = 0.0
                            for i in T.serial(R):
                                a = a + T.cast(mb[i], T.float32) * T.cast(mh[j, i], T.float32)
                            lg = dot[j] + a
                            if lg > bv[j]:  # strict: this thread's ids come in ascending order
                                bv[j] = lg
                                bi[j] = vt * BV + j
                    with T.SimtVF(threads=1):
                        best = T.alloc_var(T.float32)
                        idx = T.alloc_var(T.int32)
                        best = bv[0]
                        idx = bi[0]
                        for j in T.serial(1, BV):
                            if bv[j] > best or (bv[j] == best and bi[j] < idx):
                                best = bv[j]
                                idx = bi[j]
                        dr[s] = T.Cast("int64", idx)
                        z = T.alloc_var(T.float32)
                        z = 0.0
                        for i in T.serial(H):
                            z = z + T.cast(xb[i], T.float32) * T.cast(pb[i], T.float32)
                        for i in T.serial(R):
                            z = z + T.cast(mb[i], T.float32) * T.cast(pb[H + i], T.float32)
                        cf[s] = z
                T.copy(dr, drafts[q, 0:B])
                T.copy(cf, conf[q, 0:B])

    return lower_ascend(dspark_heads)


def _supports(target, spec: KernelSpec) -> bool:
    if not static(spec):
        return False
    hb, first, norm, head, membed, mhead, proj = spec.in_types
    if any(hasattr(t, "scale") for t in spec.in_types):
        return False
    if not (all(t.dtype.name == "bf16" for t in (hb, norm, head, membed, mhead, proj))
            and first.dtype.name in ("i32", "i64") and proj.shape[0] == 1):
        return False
    d = heads_dims(spec)
    return (d["V"] % BV == 0 and d["H"] % KC == 0 and d["H"] % BV == 0 and (d["R"] * 2) % 32 == 0
            and sum(heads_plan(d, target.cores)["buffers"]["ub"]) <= target.ub_bytes)


def _render(target, spec: KernelSpec, config) -> KernelSource:
    d = heads_dims(spec)
    p = heads_plan(d, target.cores)
    text = _heads_source(d["n"], d["B"], d["H"], d["V"], d["R"], d["first"], d["eps"], p["grid"])
    return KernelSource(language="ascendc", entry="dspark_heads_kernel", text=text, grid=(p["grid"],), block=(BV,),
                        meta={"buffers": p["buffers"], "config": dict(config or {}), "dims": d,
                              "gm_row_bytes": [d["H"] * 2, KC * 2, d["R"] * 2]})


register(Template(
    name="ascend_dspark_heads", ops=("dspark_heads",), targets=building("ascendc"), knobs={},
    render=_render, default_config=lambda target, spec: {}, supports=_supports))
