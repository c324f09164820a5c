"""TileLang-Ascend attention for ascend950: `sparse_attn`, `window_attn` and `dspark_block_attn`
(ir/ops/attention.py) as one cube + vector program with a key-source mode, following the CUDA
template's key rules and operand layouts (codegen/library/tilelang_attention.py: q [n, H, D] bf16,
this step's fp8 window keys, the fp8 ring, the fp4 compressed pages with e4m3 scales per 16, top-k
lists with -1 for none, the sink per head).

A unit is (row, group of `heads` heads); the AI cores walk units (`T.Persistent`). Per block of
`block_I` keys:
- vector core, scalar code: each key's source (this step's rows, the ring, or a compressed page
  through the block table) and validity, and a GM -> UB copy of its row and scales;
- vector core, SIMT: the keys widened to bf16 (fp8 x 2^(s-127) and e2m1 x e4m3 are exact in
  bf16), written twice, as K [keys, D] and as K^T [D, keys]: TileLang-Ascend's L1-input cube GEMM
  is C = A B^T only, and V = K enters P V as B = K^T; both go UB -> L1;
- cube: S = q K^T into L0C, then to the UB;
- vector, one SIMT thread per head: masking, scale D^-1/2 in the exp2 domain, online softmax
  (running max and sum), P rounded to bf16 (spec §3.6) into L1;
- cube: P V into L0C, then to the UB, where the vector core rescales the running output.
The sink enters the denominator only (exp(sink - m)), after the last block.

Rendered and capacity-checked here (TileLang-Ascend has no CPU execution path in this install);
built only where CANN's `bisheng` exists; never run on an Ascend 950, so nothing about it is
verified.
"""
# no `from __future__ import annotations`: TileLang evaluates the prim_func's T.Tensor hints

import functools

from ..targets import building
from ..template import KernelSource, KernelSpec, Template, register
from .ascend_common import SIMT_CONTEXT_BYTES, align32, e2m1_f32, lower_ascend
from .tilelang_attention import LOG2E, MODES, NEG, attention_dims
from .tilelang_gemm import ceil_div, e8m0_f32

_THREADS = 128
MAX_BLOCK = 32  # draft-block rows a dspark row looks back over for its block's first row


def attention_plan(mode: str, d: dict, config: dict, cores: int) -> dict:
    """Units, grid and on-chip bytes per scope (what the capacity check reads)."""
    hg, bi, dd = config["heads"], config["block_I"], d["D"]
    ub = [align32(bi * dd), align32(bi * (dd // 32))]  # gathered fp8 rows and their ue8m0 scales
    if mode == "sparse":
        ub += [align32(bi * dd // 2), align32(bi * (dd // 16))]  # packed fp4 rows, e4m3 scales
    # K and K^T in bf16, each with the nd2nz copy (one row longer) the UB -> L1 scatter writes
    ub += [align32(bi * dd * 2), align32((bi + 1) * dd * 2), align32(dd * bi * 2), align32((dd + 1) * bi * 2)]
    ub += [align32(hg * bi * 4), align32(hg * bi * 2), align32((hg + 1) * bi * 2)]  # S, P (+ nd2nz)
    ub += [align32(hg * dd * 4), align32(hg * dd * 4), align32(hg * dd * 2)]  # running O, block O, O bf16
    ub += [align32(hg * 4)] * 3 + [align32(bi * 4)] * 3  # m, l, alpha; key validity, source, row
    ub.append(SIMT_CONTEXT_BYTES)
    units = d["n"] * (d["H"] // hg)
    return {"units": units, "grid": min(cores, units),
            "buffers": {"ub": ub, "l1": [align32(hg * dd * 2), align32(bi * dd * 2), align32(dd * bi * 2),
                                         align32(hg * bi * 2)],
                        "l0a": [2 * hg * min(dd, 32768 // (hg * 2)) * 2], "l0b": [2 * 32768],
                        "l0c": [align32(hg * bi * 4), align32(hg * dd * 4)]}}


@functools.lru_cache(maxsize=32)
def _attention_source(mode: str, n: int, H: int, D: int, slots: int, R: int, window: int, topk: int, pages: int,
                      PE: int, nseq: int, maxp: int, hg: int, bi: int, grid: int) -> str:
    import tilelang.ascend.language as T

    fp8 = "float8_e4m3fn"
    assert window % bi == 0 and H % hg == 0 and bi * D % _THREADS == 0
    NW = window // bi
    NX = {"sparse": ceil_div(topk, bi), "window": 0, "dspark": ceil_div(MAX_BLOCK, bi)}[mode]
    NB = NW + NX
    groups = H // hg
    scale2 = D ** -0.5 * LOG2E
    k_steps = bi * D // _THREADS
    pages_, topk_, maxp_ = max(pages, 1), max(topk, 1), max(maxp, 1)

    @T.prim_func
    def attn(Q: T.Tensor((n, H, D), T.bfloat16), KV: T.Tensor((n, D), fp8), KVS: T.Tensor((n, D // 32), T.uint8),
             RING: T.Tensor((slots, R, D), fp8), RINGS: T.Tensor((slots, R, D // 32), T.uint8),
             CKV: T.Tensor((pages_, PE, D // 2), T.uint8), CKVS: T.Tensor((pages_, PE, D // 16), fp8),
             TOP: T.Tensor((n, topk_), T.int32), SINK: T.Tensor((H,), T.float32), POS: T.Tensor((n,), T.int64),
             TSEQ: T.Tensor((n,), T.int32), SLOTS: T.Tensor((nseq,), T.int32), BT: T.Tensor((nseq, maxp_), T.int32),
             O: T.Tensor((n, H, D), T.bfloat16)):
        with T.Kernel(grid) as core:
            k8_ub = T.alloc_shared((bi, D), fp8)
            ks_ub = T.alloc_shared((bi, D // 32), T.uint8)
            c4_ub = T.alloc_shared((bi, D // 2) if mode == "sparse" else (1, 32), T.uint8)
            cs_ub = T.alloc_shared((bi, D // 16) if mode == "sparse" else (1, 32), fp8)
            k_ub = T.alloc_shared((bi, D), T.bfloat16)
            kt_ub = T.alloc_shared((D, bi), T.bfloat16)
            s_ub = T.alloc_shared((hg, bi), T.float32)
            p_ub = T.alloc_shared((hg, bi), T.bfloat16)
            o_ub = T.alloc_shared((hg, D), T.float32)
            ob_ub = T.alloc_shared((hg, D), T.float32)
            out_ub = T.alloc_shared((hg, D), T.bfloat16)
            m_ub = T.alloc_shared((hg,), T.float32)
            l_ub = T.alloc_shared((hg,), T.float32)
            a_ub = T.alloc_shared((hg,), T.float32)
            kvalid = T.alloc_shared((bi,), T.int32)
            ksrc = T.alloc_shared((bi,), T.int32)  # 0: step row, 1: ring, 2: compressed
            krow = T.alloc_shared((bi,), T.int32)  # step row / slot * R + ring index / page * PE + entry
            q_l1 = T.alloc_l1((hg, D), T.bfloat16)
            k_l1 = T.alloc_l1((bi, D), T.bfloat16)
            kt_l1 = T.alloc_l1((D, bi), T.bfloat16)
            p_l1 = T.alloc_l1((hg, bi), T.bfloat16)
            s_acc = T.alloc_l0c((hg, bi), T.float32)
            o_acc = T.alloc_l0c((hg, D), T.float32)
            for unit in T.Persistent([n * groups], grid, core):
                t = unit // groups
                h0 = unit % groups * hg
                seq = TSEQ[t]
                p = T.Cast("int32", POS[t])
                slot = T.max(SLOTS[seq], 0)
                r0 = T.alloc_var(T.int32)
                r0 = t
                if mode == "dspark":
                    # first row of t's draft block: rows of a sequence are contiguous
                    for i in T.serial(MAX_BLOCK):
                        if t - i >= 0:
                            if TSEQ[T.max(t - i, 0)] == seq:
                                r0 = t - i
                wend = T.Cast("int32", POS[r0]) - 1 if mode == "dspark" else p  # newest window position
                T.copy(Q[t, h0:h0 + hg, 0:D], q_l1)
                with T.SimtVF(threads=hg):
                    h = T.get_thread_binding()
                    m_ub[h] = NEG
                    l_ub[h] = 0.0
                with T.SimtVF(threads=_THREADS):
                    for h, c in T.Parallel(hg, D):
                        o_ub[h, c] = 0.0
                for b in T.serial(NB):
                    for i in T.serial(bi):
                        if b < NW:
                            kp = wend - window + 1 + b * bi + i
                            rr = t - (p - kp)
                            step = (mode != "dspark") and rr >= 0 and TSEQ[T.max(rr, 0)] == seq
                            kvalid[i] = T.Cast("int32", kp >= 0)
                            ksrc[i] = T.if_then_else(step, 0, 1)
                            krow[i] = T.if_then_else(step, T.max(rr, 0), slot * R + T.max(kp, 0) % R)
                        else:
                            j = (b - NW) * bi + i
                            if mode == "sparse":
                                c = TOP[t, T.min(j, topk_ - 1)]
                                cc = T.max(c, 0)
                                kvalid[i] = T.Cast("int32", j < topk and c >= 0)
                                ksrc[i] = 2
                                krow[i] = T.max(BT[seq, T.min(cc // PE, maxp_ - 1)], 0) * PE + cc % PE
                            else:
                                rr = r0 + j
                                kvalid[i] = T.Cast("int32", j < MAX_BLOCK and rr < n and TSEQ[T.min(rr, n - 1)] == seq)
                                ksrc[i] = 0
                                krow[i] = T.min(rr, n - 1)
                        if ksrc[i] == 0:
                            T.copy(KV[krow[i], 0:D], k8_ub[i, 0:D])
                            T.copy(KVS[krow[i], 0:D // 32], ks_ub[i, 0:D // 32])
                        elif ksrc[i] == 1:
                            T.copy(RING[krow[i] // R, krow[i] % R, 0:D], k8_ub[i, 0:D])
                            T.copy(RINGS[krow[i] // R, krow[i] % R, 0:D // 32], ks_ub[i, 0:D // 32])
                        elif mode == "sparse":
                            T.copy(CKV[krow[i] // PE, krow[i] % PE, 0:D // 2], c4_ub[i, 0:D // 2])
                            T.copy(CKVS[krow[i] // PE, krow[i] % PE, 0:D // 16], cs_ub[i, 0:D // 16])
                    with T.SimtVF(threads=_THREADS):
                        tid = T.get_thread_binding()
                        for s in T.serial(k_steps):
                            i = (s * _THREADS + tid) // D
                            c = (s * _THREADS + tid) % D
                            v = T.alloc_var(T.float32)
                            v = T.cast(k8_ub[i, c], T.float32) * e8m0_f32(T, ks_ub[i, c // 32])
                            if mode == "sparse":
                                if ksrc[i] == 2:
                                    v = e2m1_f32(T, T.bitwise_and(T.shift_right(T.Cast("int32", c4_ub[i, c // 2]),
                                                                                (c % 2) * 4), 15)) \
                                        * T.cast(cs_ub[i, c // 16], T.float32)
                            k_ub[i, c] = T.cast(v, T.bfloat16)
                            kt_ub[c, i] = T.cast(v, T.bfloat16)
                    T.copy(k_ub, k_l1)
                    T.copy(kt_ub, kt_l1)
                    T.gemm(q_l1, k_l1, s_acc, transpose_B=True, clear_accum=True)
                    T.copy(s_acc, s_ub)
                    with T.SimtVF(threads=hg):
                        h = T.get_thread_binding()
                        mx = T.alloc_var(T.float32)
                        sm = T.alloc_var(T.float32)
                        mx = m_ub[h]
                        for i in T.serial(bi):
                            s_ub[h, i] = T.if_then_else(kvalid[i] != 0, s_ub[h, i] * scale2, -T.infinity(T.float32))
                            mx = T.max(mx, s_ub[h, i])
                        a_ub[h] = T.exp2(m_ub[h] - mx)
                        sm = 0.0
                        for i in T.serial(bi):
                            pb = T.cast(T.exp2(s_ub[h, i] - mx), T.bfloat16)
                            p_ub[h, i] = pb
                            sm = sm + T.exp2(s_ub[h, i] - mx)
                        l_ub[h] = l_ub[h] * a_ub[h] + sm
                        m_ub[h] = mx
                    T.copy(p_ub, p_l1)
                    T.gemm(p_l1, kt_l1, o_acc, transpose_B=True, clear_accum=True)
                    T.copy(o_acc, ob_ub)
                    with T.SimtVF(threads=_THREADS):
                        for h, c in T.Parallel(hg, D):
                            o_ub[h, c] = o_ub[h, c] * a_ub[h] + ob_ub[h, c]
                with T.SimtVF(threads=hg):
                    h = T.get_thread_binding()
                    l_ub[h] = l_ub[h] + T.exp2(SINK[h0 + h] * LOG2E - m_ub[h])
                with T.SimtVF(threads=_THREADS):
                    for h, c in T.Parallel(hg, D):
                        out_ub[h, c] = T.cast(o_ub[h, c] / l_ub[h], T.bfloat16)
                T.copy(out_ub, O[t, h0:h0 + hg, 0:D])

    return lower_ascend(attn)


def _supports(target, spec: KernelSpec) -> bool:
    if spec.attr.get("rope_dim"):  # the RoPEs folded in (fuse_attention_rope) are not written here
        return False
    if not all(isinstance(x, int) for t in spec.in_types for x in getattr(t, "data", t).shape):
        return False
    d = attention_dims(spec)
    # the window a whole number of key blocks for every block_I knob
    return d["H"] % 32 == 0 and d["D"] % 128 == 0 and d["window"] % 32 == 0


def _default_config(target, spec: KernelSpec) -> dict:
    # 16 heads (four units a row) and 16-key blocks keep the running output, the block output and
    # both bf16 key layouts inside what TileLang-Ascend leaves of one AIV's UB at D = 512
    return {"heads": 16, "block_I": 16}


def _render(target, spec: KernelSpec, config) -> KernelSource:
    d = attention_dims(spec)
    mode = MODES[spec.op]
    c = {**_default_config(target, spec), **(config or {})}
    p = attention_plan(mode, d, c, target.cores)
    text = _attention_source(mode, d["n"], d["H"], d["D"], d["slots"], d["R"], d["window"], d.get("topk", 0),
                             d.get("pages", 0), d.get("PE", 1), d["nseq"], d.get("maxp", 0), c["heads"],
                             c["block_I"], p["grid"])
    dd = d["D"]
    return KernelSource(language="ascendc", entry="attn_kernel", text=text, grid=(p["grid"],), block=(_THREADS,),
                        meta={"buffers": p["buffers"], "config": c, "dims": d,
                              "gm_row_bytes": [dd * 2, dd, dd // 2] if mode == "sparse" else [dd * 2, dd]})


for _op in MODES:
    register(Template(
        name=f"ascend_{_op}", ops=(_op,), targets=building("ascendc"),
        knobs={"heads": (16, 32), "block_I": (16, 32)},
        render=_render, default_config=_default_config, supports=_supports))
