"""TileLang grouped MoE GEMM at decode on warp MMAs: `grouped_gemm_fp4` (ir/ops/fused.py) for
calls of a few rows per expert, on targets whose defaults carry `tilelang_grouped_gemm_fp4_mma`.

The same operands as codegen/library/tilelang_moe.py (fp8 e4m3 rows with ue8m0 per 32, fp4 e2m1
experts [E, N, K/2] with ue8m0 per output row and 32, expert row offsets; bf16 out). At decode
the weight stream is the whole cost, and the widening TileLang program (tilelang_moe) and the
Triton decode kernels spend several instructions per fp4 code moving operands between layouts.
Here the weights are the MMA's A operand and every lane widens exactly the codes its fragment
holds, in the registers it read them into (grouped_gemm_fp4_mma_program). Registered before the
Triton decode template, so on such targets decode calls take it first.
"""
from typing import Any, Mapping

import torch

from ...ir.types import QuantType
from ..targets import Target, building
from ..template import KernelSource, KernelSpec, Template, batch_invariant, register

# tilelang_gemm is imported where used: importing it here would register its templates ahead of
# the Triton ones (this module is imported first), and selection takes the first that supports


# byte_perm selectors picking x's even and odd bytes of 8 (two words) into one word each: the B
# fragment slots that meet the A slots fp4_lo_e4m3 and fp4_hi_e4m3 fill
X_EVEN, X_ODD = 0x6420, 0x7531


def fp4_lo_e4m3(T, w):
    """The low nibbles of a 32-bit word's four bytes as e4m3 bytes of each code's value * 2^-6:
    the sign to bit 7 and the magnitude (e1 e0 m) to bits 4..2, where e4m3 reads it as exponent
    e1 e0 and top mantissa bit m, subnormal (e = 0) included. A shift-and-mask per part, no table."""
    return T.bitwise_or(T.bitwise_and(T.shift_left(w, T.uint32(2)), T.uint32(0x1C1C1C1C)),
                        T.bitwise_and(T.shift_left(w, T.uint32(4)), T.uint32(0x80808080)))


def fp4_hi_e4m3(T, w):
    """fp4_lo_e4m3 for the high nibbles (the sign is already bit 7)."""
    return T.bitwise_or(T.bitwise_and(T.shift_right(w, T.uint32(2)), T.uint32(0x1C1C1C1C)),
                        T.bitwise_and(w, T.uint32(0x80808080)))


def active_expert(T, E: int, threads: int):
    """(expert, first row, end row) of the s-th expert with rows (offsets[e + 1] > offsets[e]) in
    expert order, into `found` (shared; all zero when fewer than s + 1 experts have rows). Thread
    tx tests experts tx, tx + threads, ...; each warp's ballot of its tests goes to `masks`, and a
    thread's rank among the experts with rows is the popcount of the ballots before its own and of
    its own below its lane: two barriers, no loop over the experts."""
    passes = -(-E // threads)
    nm = passes * threads // 32

    def popc(v):
        return T.call_extern("int32", "__popc", v)

    def rank(masks, own, below):
        """Experts with rows before this thread's: the macro's builder would make a loop of this
        (its loops are the kernel's), so the sum is built here as one expression."""
        r = popc(T.bitwise_and(masks[own], below))
        for i in range(nm):
            r = r + T.if_then_else(i < own, popc(masks[i]), 0)
        return r

    @T.macro
    def find(offsets, found, masks, flag, s, tx):
        lane = tx % 32
        if tx == 0:
            for i in T.unroll(3):
                found[i] = 0
        for p in T.unroll(passes):
            et = T.min(p * threads + tx, E - 1)
            flag[p] = T.if_then_else(p * threads + tx < E, T.Cast("int32", offsets[et + 1] > offsets[et]), 0)
            m = T.call_extern("uint32", "__ballot_sync", T.uint32(0xFFFFFFFF), flag[p])
            if lane == 0:
                masks[p * (threads // 32) + tx // 32] = m
        T.sync_threads()
        below = T.shift_left(T.uint32(1), T.Cast("uint32", lane)) - T.uint32(1)
        for p in T.unroll(passes):
            if flag[p] != 0 and rank(masks, p * (threads // 32) + tx // 32, below) == s:
                found[0] = p * threads + tx
                found[1] = offsets[p * threads + tx]
                found[2] = offsets[p * threads + tx + 1]
        T.sync_threads()

    return find


def grouped_gemm_fp4_mma_program(Mtot: int, N: int, K: int, E: int, *, WK=4, RT=1, KU=4, NT=1, STAGES=0, XS=0,
                                 ACT=0, F16=0):
    """The decode grouped GEMM on warp MMAs with the weight as the 16-row A operand (swap AB: the
    few rows of x are the 8-wide B operand), each fragment widened in the registers it was loaded
    into. A lane (group g, q) of a warp takes the 32-bit word at byte 4q of output rows g and
    g + 8's 16-byte scale block; its low nibbles fill A slots 4q..4q+3 and its high nibbles
    16+4q..16+4q+3 (fp4_lo_e4m3 / fp4_hi_e4m3, exact at 2^-6), and the same permutation of K picks
    x's bytes into the B fragment (one byte_perm each), so the MMA's sum is the scale block's dot
    product. One m16n8k32 e4m3 MMA per scale block and 8 x rows, scaled by the row's and x's
    ue8m0 scales into fp32. Nothing moves between layouts.

    CTA (16*RT output rows, expert): WK warps split K and add their sums through shared memory in
    warp order (deterministic); NT tiles of 8 rows of x per pass over the weights; KU scale blocks
    per warp and step. STAGES = 0: the lanes load their words and scales from global memory, 4 or
    1 bytes per lane and row, which costs the L1 a wavefront per row touched; STAGES > 0: each
    step's [16*RT, WK*KU*16 B] weight tile is copied asynchronously into shared memory STAGES
    steps ahead in 16-byte pieces (bytes in flight cost no registers), its rows padded by 16 B so
    the lanes' reads hit distinct banks, and the tile's scales and x's rows' scales are copied
    whole before the K loop. XS (with STAGES): x's rows of the step go through the same pipeline
    (rows padded by 32 B: each half-warp's 8-byte reads hit distinct banks) instead of a global
    load per block and lane. ACT, where min(E, Mtot) is at most a quarter of the experts: the
    grid's second axis is the experts with rows, at most min(E, Mtot) of them (a CTA finds its
    expert: active_expert), not every expert; else CTAs of idle experts exit at once, which at one
    sequence's six rows is 90 of every 96 CTAs. Rows past offsets[E] (which only expert
    parallelism leaves) are written as zeros by the first slot's CTAs, each for its columns. F16:
    the MMAs as f16 pairs (tilelang_warp_mma.scaled_mma), x's pairs converted once per block."""
    from .tilelang_gemm import _tl, e8m0_f32
    from .tilelang_warp_mma import F16_PRELUDE, f16_x, out_position, scaled_mma, warp_order_sum

    _, T = _tl()
    mma, total = scaled_mma(T, NT, f16=bool(F16)), warp_order_sum(T, WK, RT * NT * 4)
    widen_x = f16_x(T, NT)
    kbs = K // 32
    assert K % 32 == 0 and kbs % WK == 0 and N % (16 * RT) == 0
    XS = XS if STAGES else 0  # x rides the weight tile's pipeline: none without stages
    kbw = kbs // WK
    ku = max(u for u in range(1, KU + 1) if kbw % u == 0)
    br, tt, nacc = 16 * RT, 8 * NT, RT * NT * 4
    cw = WK * ku * 4  # a step's weight words per row (STAGES > 0)
    # over the experts with rows only where they are few: the search costs every CTA two barriers
    # before its first weight load, which lost 4% at 64 rows (all 96 experts) on the H200 and 3%
    # of the 8-row step (48 CTAs); one sequence's 6 rows gained 1.2-1.4x
    ACT = ACT and 4 * min(E, Mtot) <= E
    slots = min(E, Mtot) if ACT else E
    find = active_expert(T, E, 32 * WK)

    @T.macro
    def block(X, SX, W, SW, Ws, SWs, SXs, Xs, a, b, c, acc, sx, e, bx, tb, end, g, q, kb, kw):
        """Scale block kb for the warp's rows: its weight words at word column kw of the staged
        tile and its scales from shared memory (STAGES > 0), or all of them from global memory;
        with XS, x's 8-byte words at the same column of theirs."""
        for nt in T.unroll(NT):
            tok = tb + nt * 8 + g
            if XS:
                xv = T.if_then_else(tok < end, Xs[nt * 8 + g, kw], T.uint64(0))
            else:
                xv = T.if_then_else(tok < end, X[tok, kb * 4 + q], T.uint64(0))
            xl = T.Cast("uint32", xv)
            xh = T.Cast("uint32", T.shift_right(xv, T.uint64(32)))
            b[2 * nt] = T.call_extern("uint32", "__byte_perm", xl, xh, T.uint32(X_EVEN))
            b[2 * nt + 1] = T.call_extern("uint32", "__byte_perm", xl, xh, T.uint32(X_ODD))
            for j in T.unroll(2):
                tj = tb + nt * 8 + 2 * q + j
                if STAGES:
                    sx[2 * nt + j] = T.if_then_else(tj < end, e8m0_f32(T, SXs[nt * 8 + 2 * q + j, kb]),
                                                    T.float32(0))
                else:
                    sx[2 * nt + j] = T.if_then_else(tj < end, e8m0_f32(T, SX[tj, kb]), T.float32(0))
        if F16:
            widen_x(b)
        for rt in T.unroll(RT):
            r0 = bx * br + rt * 16 + g
            if STAGES:
                a[0] = Ws[rt * 16 + g, kw]
                a[1] = Ws[rt * 16 + g + 8, kw]
            else:
                a[0] = W[e, r0, kb * 4 + q]
                a[1] = W[e, r0 + 8, kb * 4 + q]
            a[2] = fp4_hi_e4m3(T, a[0])
            a[3] = fp4_hi_e4m3(T, a[1])
            a[0] = fp4_lo_e4m3(T, a[0])
            a[1] = fp4_lo_e4m3(T, a[1])
            if STAGES:
                s0 = e8m0_f32(T, SWs[rt * 16 + g, kb])
                s1 = e8m0_f32(T, SWs[rt * 16 + g + 8, kb])
            else:
                s0 = e8m0_f32(T, SW[e, r0, kb])
                s1 = e8m0_f32(T, SW[e, r0 + 8, kb])
            mma(a, b, c, acc, rt * NT * 4, s0, s1, sx)

    @T.prim_func
    def grouped_gemm_fp4_mma(X: T.Tensor((Mtot, K // 8), "uint64"), SX: T.Tensor((Mtot, kbs), "uint8"),
                             W: T.Tensor((E, N, K // 8), "uint32"), SW: T.Tensor((E, N, kbs), "uint8"),
                             offsets: T.Tensor((E + 1,), "int32"), C: T.Tensor((Mtot, N), "bfloat16")):
        with T.Kernel(N // br, slots, threads=32 * WK, prelude=F16_PRELUDE if F16 else None) as (bx, slot):
            tx = T.get_thread_binding()
            wp = tx // 32
            g = (tx % 32) // 4
            q = tx % 4
            red = T.alloc_shared((WK, nacc, 32), "float32")
            Ws = T.alloc_shared((br, cw + 4), "uint32")
            SWs = T.alloc_shared((br, kbs), "uint8")
            SXs = T.alloc_shared((tt, kbs), "uint8")
            Xs = T.alloc_shared((tt, cw + 4), "uint64") if XS else None
            a = T.alloc_local((12 if F16 else 4,), "uint32")
            b = T.alloc_local((6 * NT if F16 else 2 * NT,), "uint32")
            c = T.alloc_local((4,), "float32")
            acc = T.alloc_local((nacc,), "float32")
            sx = T.alloc_local((2 * NT,), "float32")
            if ACT:
                found = T.alloc_shared((3,), "int32")
                masks = T.alloc_shared((-(-E // (32 * WK)) * WK,), "uint32")
                flag = T.alloc_local((-(-E // (32 * WK)),), "int32")
                ex = T.alloc_local((3,), "int32")
                find(offsets, found, masks, flag, slot, tx)
                for i in T.unroll(3):
                    ex[i] = found[i]
                e, start, end = ex[0], ex[1], ex[2]
            else:
                e, start, end = slot, offsets[slot], offsets[slot + 1]
            if slot == 0:
                # rows no expert covers (past offsets[E]: only expert parallelism leaves them) stay
                # zero, as the op leaves them; the first slot's CTAs write those of their columns
                tail = offsets[E]
                for j in T.serial(T.ceildiv((Mtot - tail) * br, 32 * WK)):
                    if tail + (j * 32 * WK + tx) // br < Mtot:
                        C[tail + (j * 32 * WK + tx) // br, bx * br + (j * 32 * WK + tx) % br] = T.bfloat16(0)
            for t0 in T.serial(T.ceildiv(end - start, tt)):
                tb = start + t0 * tt
                for i in T.unroll(nacc):
                    acc[i] = T.float32(0)
                if STAGES:
                    T.copy(SW[e, bx * br:(bx + 1) * br, 0:kbs], SWs)
                    # rows past the expert's end are other experts' (or guarded at Mtot): their
                    # columns of the MMA are never stored
                    T.copy(SX[tb, 0], SXs)
                    for ko in T.Pipelined(kbs // (WK * ku), num_stages=STAGES):
                        T.copy(W[e, bx * br:(bx + 1) * br, ko * cw:(ko + 1) * cw], Ws[:, 0:cw])
                        if XS:
                            T.copy(X[tb:tb + tt, ko * cw:(ko + 1) * cw], Xs[:, 0:cw])
                        for kk in T.unroll(ku):
                            block(X, SX, W, SW, Ws, SWs, SXs, Xs, a, b, c, acc, sx, e, bx, tb, end, g, q,
                                  ko * WK * ku + wp * ku + kk, (wp * ku + kk) * 4 + q)
                else:
                    for ko in T.serial(kbw // ku):
                        for kk in T.unroll(ku):
                            block(X, SX, W, SW, Ws, SWs, SXs, Xs, a, b, c, acc, sx, e, bx, tb, end, g, q,
                                  wp * kbw + ko * ku + kk, 0)
                total(red, acc, wp, tx % 32)
                if wp == 0:
                    for i in T.unroll(nacc):
                        dt, dr = out_position(T, i, NT)
                        if tb + 2 * q + dt < end:
                            # 64: the widened codes' 2^-6
                            C[tb + 2 * q + dt, bx * br + g + dr] = T.Cast("bfloat16", acc[i] * T.float32(64))
                if WK > 1:
                    T.sync_threads()

    return grouped_gemm_fp4_mma


# the warpgroup MMA on e4m3 with its A operand in registers, which sm_90's warp MMAs lack (ptxas
# runs an e4m3 mma.sync as two f16 MMAs after converting every operand pair); B through a
# no-swizzle shared-memory descriptor: core matrices of 8 rows x 16 bytes, 128 bytes apart along K
WGMMA_PRELUDE = r"""
__device__ __forceinline__ unsigned long long deepinfer_gmma_desc(const void* smem) {
  unsigned long long a = (unsigned long long)__cvta_generic_to_shared(smem);
  return ((a >> 4) & 0x3FFFull) | (8ull << 16) | (8ull << 32);
}
__device__ __forceinline__ void deepinfer_wgmma_e4m3_n8(float* d, unsigned a0, unsigned a1, unsigned a2,
                                                        unsigned a3, const void* b) {
  unsigned long long desc = deepinfer_gmma_desc(b);
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\nwgmma.fence.sync.aligned;\n"
               "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n"
               "wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(0) : "memory");
}
// the same MMA in pieces, for several in one group: fence, MMAs, commit, wait, then each product
// held (its registers are the finished MMA's from there on, for the compiler too)
__device__ __forceinline__ void deepinfer_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void deepinfer_wgmma_mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                                    const void* b) {
  unsigned long long desc = deepinfer_gmma_desc(b);
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(0) : "memory");
}
__device__ __forceinline__ void deepinfer_wgmma_commit_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void deepinfer_wgmma_hold(float* d) {
  asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) :: "memory");
}
__device__ __forceinline__ void deepinfer_fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
"""


def xp_word(kb, r, odd, i):
    """The word of x's staged pass (grouped_gemm_fp4_wgmma_program) holding bytes 4i..4i+3 of row
    r's half of scale block kb (odd: its odd bytes, else its even ones): a block is two 8 x
    16-byte core matrices, the even bytes' then the odd bytes', 128 bytes apart (the descriptor's
    K stride)."""
    return kb * 64 + odd * 32 + r * 4 + i


def grouped_gemm_fp4_wgmma_program(Mtot: int, N: int, K: int, E: int, *, KB=8, STAGES=3, ACT=0, WGS=1, BATCH=0,
                                   XR=0):
    """grouped_gemm_fp4_mma_program's product on warpgroup MMAs (`wgmma m64n8k32` e4m3, A from
    registers: no operand conversions, no added C). CTA (64 output rows, expert): warp w holds rows
    16w..16w+15 and every lane widens the words its A fragment needs, as the warp-MMA program's
    lanes do (the same fragment per warp, the same permuted K order); the four warps step through
    all of K together, so nothing is added across warps. Each pass's 8 rows of x are staged once in
    shared memory in that K order (a block's even bytes, then its odd ones: two 8 x 16-byte core
    matrices), the MMA's B operand; the step's [64, KB scale blocks] weight tile is copied STAGES
    steps ahead (cp.async), rows padded by 16 bytes; the tile's weight scales and x's scales once
    before the K loop. ACT: as the warp-MMA program's (CTAs over the experts with rows). WGS
    warpgroups a CTA, each its own 64 rows, sharing the staged x. Each MMA is waited on before
    its product is scaled (ptxas serialises warpgroup MMAs whose accumulators other instructions
    read while a later one is in flight), one at a time, or with BATCH the step's KB MMAs in one
    group (KB fragments and products in registers), waited on once a step. XR (with BATCH): x's
    step tile rides the weight tile's pipeline raw and is put in that K order each step, so the
    CTA holds a step of x, not all of it (more CTAs an SM)."""
    from .tilelang_gemm import _tl, e8m0_f32

    _, T = _tl()
    kbs = K // 32
    assert K % 32 == 0 and kbs % KB == 0 and N % (64 * WGS) == 0
    br, tt, threads = 64 * WGS, 8, 128 * WGS
    cw = KB * 4  # a step's weight words per row
    ACT = ACT and 4 * min(E, Mtot) <= E
    slots = min(E, Mtot) if ACT else E
    find = active_expert(T, E, threads)
    xwords = kbs * 64  # x's staged pass: 256 bytes a scale block (8 rows x 32 bytes)

    @T.macro
    def stage_x(X, Xp, tb, end, tx):
        """Xp[block kb] = rows tb.. of x's block kb as two core matrices: its even bytes, its odd."""
        for j in T.serial(T.ceildiv(tt * kbs, threads)):
            idx = j * threads + tx
            r = idx // kbs
            kb = idx % kbs
            if idx < tt * kbs:
                for h in T.unroll(2):
                    v0 = T.if_then_else(tb + r < end, X[tb + r, kb * 4 + 2 * h], T.uint64(0))
                    v1 = T.if_then_else(tb + r < end, X[tb + r, kb * 4 + 2 * h + 1], T.uint64(0))
                    w0 = T.Cast("uint32", v0)
                    w1 = T.Cast("uint32", T.shift_right(v0, T.uint64(32)))
                    w2 = T.Cast("uint32", v1)
                    w3 = T.Cast("uint32", T.shift_right(v1, T.uint64(32)))
                    # x bytes 16h..16h+15 of the block give words 2h, 2h + 1 of each half's row
                    for odd, sel in ((0, X_EVEN), (1, X_ODD)):
                        Xp[xp_word(kb, r, odd, 2 * h)] = T.call_extern("uint32", "__byte_perm", w0, w1,
                                                                       T.uint32(sel))
                        Xp[xp_word(kb, r, odd, 2 * h + 1)] = T.call_extern("uint32", "__byte_perm", w2, w3,
                                                                           T.uint32(sel))

    assert not XR or (BATCH and tt * KB * 2 <= threads), "XR: a thread a 16-byte piece of the step's x"

    @T.macro
    def permute_x(Xr, Xp, xv, tx):
        """Xp = the step's raw x tile (Xr) in stage_x's layout, a thread a 16-byte piece (through
        xv, a local pair: the software pipeline's rewriting loses let-bound values)."""
        if tx < tt * KB * 2:
            for i in T.unroll(2):
                xv[i] = Xr[tx // (KB * 2), ((tx // 2) % KB) * 4 + 2 * (tx % 2) + i]
            for odd, sel in ((0, X_EVEN), (1, X_ODD)):
                for i in T.unroll(2):
                    Xp[xp_word((tx // 2) % KB, tx // (KB * 2), odd, 2 * (tx % 2) + i)] = T.call_extern(
                        "uint32", "__byte_perm", T.Cast("uint32", xv[i]),
                        T.Cast("uint32", T.shift_right(xv[i], T.uint64(32))), T.uint32(sel))

    @T.macro
    def widen(Ws, a, o, r0, kw):
        """The lane's A fragment of a block into a[o..o+3] (rows r0, r0 + 8; the warp-MMA order)."""
        a[o] = Ws[r0, kw]
        a[o + 1] = Ws[r0 + 8, kw]
        a[o + 2] = fp4_hi_e4m3(T, a[o])
        a[o + 3] = fp4_hi_e4m3(T, a[o + 1])
        a[o] = fp4_lo_e4m3(T, a[o])
        a[o + 1] = fp4_lo_e4m3(T, a[o + 1])

    @T.macro
    def scale(SWs, SXs, c, o, acc, sx, r0, kb, tb, end, q):
        """acc += block kb's product c[o..o+3] times its weight rows' and x rows' scales."""
        s0 = e8m0_f32(T, SWs[r0, kb])
        s1 = e8m0_f32(T, SWs[r0 + 8, kb])
        for j in T.unroll(2):
            sx[j] = T.if_then_else(tb + 2 * q + j < end, e8m0_f32(T, SXs[2 * q + j, kb]), T.float32(0))
        acc[0] += c[o] * (s0 * sx[0])
        acc[1] += c[o + 1] * (s0 * sx[1])
        acc[2] += c[o + 2] * (s1 * sx[0])
        acc[3] += c[o + 3] * (s1 * sx[1])

    @T.prim_func
    def grouped_gemm_fp4_wgmma(X: T.Tensor((Mtot, K // 8), "uint64"), SX: T.Tensor((Mtot, kbs), "uint8"),
                               W: T.Tensor((E, N, K // 8), "uint32"), SW: T.Tensor((E, N, kbs), "uint8"),
                               offsets: T.Tensor((E + 1,), "int32"), C: T.Tensor((Mtot, N), "bfloat16")):
        with T.Kernel(N // br, slots, threads=threads, prelude=WGMMA_PRELUDE) as (bx, slot):
            tx = T.get_thread_binding()
            wp = tx // 32
            g = (tx % 32) // 4
            q = tx % 4
            Ws = T.alloc_shared((br, cw + 4), "uint32")
            SWs = T.alloc_shared((br, kbs), "uint8")
            SXs = T.alloc_shared((tt, kbs), "uint8")
            Xp = T.alloc_shared((KB * 64 if XR else xwords,), "uint32")
            Xr = T.alloc_shared((tt, KB * 4 + 2), "uint64") if XR else None
            xv = T.alloc_local((2,), "uint64") if XR else None
            a = T.alloc_local((4 * KB if BATCH else 4,), "uint32")
            c = T.alloc_local((4 * KB if BATCH else 4,), "float32")
            acc = T.alloc_local((4,), "float32")
            sx = T.alloc_local((2,), "float32")
            if ACT:
                found = T.alloc_shared((3,), "int32")
                masks = T.alloc_shared((-(-E // threads) * (threads // 32),), "uint32")
                flag = T.alloc_local((-(-E // threads),), "int32")
                ex = T.alloc_local((3,), "int32")
                find(offsets, found, masks, flag, slot, tx)
                for i in T.unroll(3):
                    ex[i] = found[i]
                e, start, end = ex[0], ex[1], ex[2]
            else:
                e, start, end = slot, offsets[slot], offsets[slot + 1]
            if slot == 0:  # rows no expert covers stay zero (the warp-MMA program's rule)
                tail = offsets[E]
                for j in T.serial(T.ceildiv((Mtot - tail) * br, threads)):
                    if tail + (j * threads + tx) // br < Mtot:
                        C[tail + (j * threads + tx) // br, bx * br + (j * threads + tx) % br] = T.bfloat16(0)
            r0 = wp * 16 + g  # the lane's weight rows in the CTA: r0 and r0 + 8
            for t0 in T.serial(T.ceildiv(end - start, tt)):
                tb = start + t0 * tt
                for i in T.unroll(4):
                    acc[i] = T.float32(0)
                T.copy(SW[e, bx * br:(bx + 1) * br, 0:kbs], SWs)
                T.copy(SX[tb, 0], SXs)
                if not XR:
                    stage_x(X, Xp, tb, end, tx)
                    T.call_extern("handle", "deepinfer_fence_proxy_async")
                T.sync_threads()
                for ko in T.Pipelined(kbs // KB, num_stages=STAGES):
                    T.copy(W[e, bx * br:(bx + 1) * br, ko * cw:(ko + 1) * cw], Ws[:, 0:cw])
                    if XR:
                        # rows past the expert's end are other experts' (or zeros past Mtot): their
                        # columns of the MMA are never stored
                        T.copy(X[tb:tb + tt, ko * KB * 4:(ko + 1) * KB * 4], Xr[:, 0:KB * 4])
                        permute_x(Xr, Xp, xv, tx)
                        T.call_extern("handle", "deepinfer_fence_proxy_async")
                        T.sync_threads()
                    if BATCH:
                        for kk in T.unroll(KB):
                            widen(Ws, a, 4 * kk, r0, kk * 4 + q)
                        T.call_extern("handle", "deepinfer_wgmma_fence")
                        for kk in T.unroll(KB):
                            T.call_extern("handle", "deepinfer_wgmma_mma", T.address_of(c[4 * kk]), a[4 * kk],
                                          a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3],
                                          T.address_of(Xp[xp_word(kk if XR else ko * KB + kk, 0, 0, 0)]))
                        T.call_extern("handle", "deepinfer_wgmma_commit_wait")
                        for kk in T.unroll(KB):
                            T.call_extern("handle", "deepinfer_wgmma_hold", T.address_of(c[4 * kk]))
                            scale(SWs, SXs, c, 4 * kk, acc, sx, r0, ko * KB + kk, tb, end, q)
                    else:
                        for kk in T.unroll(KB):
                            kb = ko * KB + kk
                            widen(Ws, a, 0, r0, kk * 4 + q)
                            T.call_extern("handle", "deepinfer_wgmma_e4m3_n8", T.address_of(c[0]), a[0], a[1], a[2],
                                          a[3], T.address_of(Xp[xp_word(kb, 0, 0, 0)]))
                            scale(SWs, SXs, c, 0, acc, sx, r0, kb, tb, end, q)
                for i in T.unroll(4):
                    if tb + 2 * q + i % 2 < end:
                        # 64: the widened codes' 2^-6
                        C[tb + 2 * q + i % 2, bx * br + r0 + 8 * (i // 2)] = T.Cast("bfloat16", acc[i] * T.float32(64))
                T.sync_threads()  # every warp is done with Xp and the scales before the next pass restages them

    return grouped_gemm_fp4_wgmma


WG_ONLY = ("WGS", "BATCH", "XR")  # the warpgroup program's own knobs


def decode_program(Mtot: int, N: int, K: int, E: int, *, WG=0, WG_ROWS=0, KB=8, **knobs):
    """The program a config names: WG the warpgroup one (its own few knobs), else the warp-MMA one.
    WG_ROWS > 0 keeps WG to calls of at most that many rows (a b1 step's 6), so one plan can hold
    both: its isolated calls led at b1 and trailed at b8 / b64 on an H100 (thirty-fifth session),
    though in the medium20 plan it trailed at all three (docs/performance.md, fortieth session)."""
    if WG and (not WG_ROWS or Mtot <= WG_ROWS):
        return grouped_gemm_fp4_wgmma_program(Mtot, N, K, E, KB=KB, STAGES=knobs.get("STAGES") or 3,
                                              ACT=knobs.get("ACT", 0), WGS=knobs.get("WGS", 1),
                                              BATCH=knobs.get("BATCH", 0), XR=knobs.get("XR", 0))
    return grouped_gemm_fp4_mma_program(Mtot, N, K, E, **{k: v for k, v in knobs.items() if k not in WG_ONLY})


def _dims(spec: KernelSpec):
    from .tilelang_moe import _dims as dims  # where used: importing tilelang_moe registers its template

    return dims(spec)


MMA_KNOBS = {"RT": (1, 2, 4), "WK": (2, 4), "KU": (2, 4), "STAGES": (0, 3, 4), "NT": (1, 2), "XS": (0, 1), "ACT": (0, 1),
             "F16": (0, 1), "WG": (0, 1), "WG_ROWS": (0, 8), "KB": (4, 8), "WGS": (1, 2), "BATCH": (0, 1),
             "XR": (0, 1)}


def _config(target: Target, spec: KernelSpec, config: Mapping[str, Any] | None = None) -> dict:
    return {"ACT": 0, **target.defaults["tilelang_grouped_gemm_fp4_mma"], **(config or {})}


def _render(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    from .tilelang_gemm import source

    mtot, n, k, e = _dims(spec)
    c = _config(target, spec, config)
    func = decode_program(mtot, n, k, e, **c)
    return source(func, target.arch, {"template": "tilelang_grouped_gemm_fp4_mma", "config": c,
                                      "dims": {"rows": mtot, "n": n, "k": k, "experts": e}})


def fp4_moe_operands(target: Target, spec: KernelSpec, key: str) -> bool:
    """The fp4 MoE programs' operands (this one, the bf16 prefill one): e4m3 rows with ue8m0 per
    32, an e2m1 [E, N, K] weight with ue8m0 per 32, static shapes; a target whose defaults carry
    `key`, not a batch-invariant plan. (Written out here, not imported from triton_ops: an import
    would put the Triton templates' code into these templates' render keys.)"""
    x, w = spec.in_types[:2]
    if key not in target.defaults or batch_invariant(target):
        return False
    if not (isinstance(x, QuantType) and isinstance(w, QuantType)) or w.rank != 3:
        return False
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape)):
        return False
    return (x.data.dtype.name == "fp8e4m3" and x.scale.dtype.name == "e8m0" and tuple(x.block) == (1, 32)
            and w.data.dtype.name == "fp4e2m1" and w.scale.dtype.name == "e8m0" and tuple(w.block) == (1, 1, 32))


def _supports(target: Target, spec: KernelSpec) -> bool:
    """Decode- and verify-sized calls (at most 32 rows per expert on average, as the Triton decode
    template takes) with the quantisation the kernel reads; not in a batch-invariant plan, whose
    prefill buckets must run the same template as its decode ones."""
    if not fp4_moe_operands(target, spec, "tilelang_grouped_gemm_fp4_mma"):
        return False
    mtot, n, k, e = _dims(spec)
    c = _config(target, spec)
    if c.get("WG"):
        return mtot <= 32 * e and k % (32 * c.get("KB", 8)) == 0 and n % (64 * c.get("WGS", 1)) == 0
    return mtot <= 32 * e and k % (32 * c["WK"]) == 0 and n % (16 * c["RT"]) == 0


def host_grouped_gemm_fp4_mma(launch, inputs, attrs, config, meta):
    """The kernel writes every row of C, those no expert covers as zeros: no fill launch. It
    reads x, W and their scales through wider words (its parameters' types): the launch passes
    pointers. Here rather than in tilelang_host: that module is in the older TileLang
    templates' code, and a host for this one would re-key their renders."""
    x, w, offsets = inputs
    c = torch.empty(x.data.shape[0], w.data.shape[1], dtype=torch.bfloat16, device=x.data.device)
    launch(0, X=x.data, SX=x.scale, W=w.data, SW=w.scale, offsets=offsets, C=c)
    return c


register(Template(
    name="tilelang_grouped_gemm_fp4_mma",
    ops=("grouped_gemm_fp4",),
    targets=building("cuda", defaults="tilelang_grouped_gemm_fp4_mma"),
    knobs=MMA_KNOBS,
    render=_render,
    default_config=lambda target, spec: _config(target, spec),
    supports=_supports,
    host=host_grouped_gemm_fp4_mma,
))
