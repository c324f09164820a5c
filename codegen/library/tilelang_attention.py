"""TileLang attention templates: `sparse_attn`, `window_attn` and `dspark_block_attn`
(ir/ops/attention.py), one program with a key-source mode.

Layout exactly as the ops define it: q [n, H, D] bf16; this step's window keys kv (fp8 e4m3 [n, D]
+ ue8m0 [n, D/32]); the ring (fp8 [slots, R, D] + ue8m0 [slots, R, D/32]) holding position p in
slot p mod R as earlier steps left it; the compressed cache (fp4 e2m1 [pages, E, D/2] + e4m3
[pages, E, D/16]) addressed through block_table[seq][c // E], row c % E; top-k [n, k] (-1 =
none); sink [H] f32; positions [n] i64; token_seq [n] i32 (rows of a sequence contiguous, in
position order); seq_slots [num_seqs] i32.

Keys of row t at position p (mode "sparse" / "window"): window key j (0 <= j < W) is position
kp = p - W + 1 + j, valid when kp >= 0, read from step row t - (p - kp) when that row belongs to
t's sequence (this step wrote it) and from the ring otherwise; then (mode "sparse") the top-k
compressed entries of row t. Mode "dspark": window keys are the W ring positions ending at
P = (first block position) - 1, then every row of t's block (bidirectional).

One CTA = one row x all 64 heads (the wgmma M), a 64-key block at a time: keys are widened to bf16
in shared memory (fp8 x 2^k and e2m1 x e4m3 are exact in bf16), S = q k^T in fp32, online softmax
in the exp2 domain, O += P K with P rounded to bf16 (V = K). `splits` > 1 divides a row's key
blocks over CTAs (decode has too few rows to fill the GPU); a second kernel merges the partial
(m, l, O) and adds the sink to the denominator (exp(sink - m); it never enters the max).
"""
import math
from typing import Any, Mapping

from ..targets import Target, building
from .tilelang_host import host_attention
from ..template import KernelSource, KernelSpec, Template, batch_invariant, register
from .tilelang_gemm import _tl, ceil_div, e8m0_f32, lower

LOG2E = 1.4426950408889634
NEG = -1.0e30  # running-max floor: keeps exp2(NEG - NEG) finite when a block has no valid key


def fp4_value(T, nib):
    """fp32 value of an e2m1 code: codes 2..7 are normal (exponent (c>>1)-1, mantissa c&1), 1 is
    0.5, 0 is 0; bit 3 is the sign."""
    mag = T.bitwise_and(nib, 7)
    bits = T.if_then_else(mag == 0, 0, T.if_then_else(
        mag == 1, 0x3F000000, T.bitwise_or(T.shift_left(T.shift_right(mag, 1) + 126, 23),
                                          T.shift_left(T.bitwise_and(mag, 1), 22))))
    return T.reinterpret(T.bitwise_or(bits, T.shift_left(T.bitwise_and(nib, 8), 28)), "float32")


def fp4_f16_value(T, nib):
    """fp32 value * 2^-14 of an e2m1 code, branch-free: the three magnitude bits placed at fp16
    bits 9..11 are the fp16 exponent and top mantissa bit of value * 2^-14 (code 1, 0.5, lands on
    the subnormal 2^-15, which fp16 conversions keep); bit 3 is the sign."""
    h = T.bitwise_or(T.shift_left(T.bitwise_and(nib, 7), 9), T.shift_left(T.bitwise_and(nib, 8), 12))
    return T.Cast("float32", T.reinterpret(T.Cast("uint16", h), "float16"))


def reduced_angle(T, ang):
    """The fp32 angle reduced mod 2 pi in fp64 (rows reach positions whose angles lose fp32's sin
    and cos), as an fp32 expression within pi, where the fast sine and cosine are within 2^-21 (far
    inside a bf16 step of the rotation's products) and cosf's large-argument path, with its stack
    frame, never runs."""
    a = T.Cast("float64", ang)
    k = T.floor(a * T.float64(0.15915494309189535) + T.float64(0.5))
    return T.Cast("float32", (a - k * T.float64(6.283185307179586)) - k * T.float64(2.4492935982947064e-16))


def rotate_cs(T, re, im, cos, sin, part: int):
    """Part 0 or 1 of the pair (re, im) rotated by the angle of (cos, sin), as the `rope` op does
    (ir/ops/attention.py rotate_tail): products in fp32, rounded to bf16."""
    re, im = T.Cast("float32", re), T.Cast("float32", im)
    if part == 0:
        return T.Cast("bfloat16", re * cos - im * sin)
    return T.Cast("bfloat16", re * sin + im * cos)


def rotated(T, re, im, ang, part: int):
    """rotate_cs by the fp32 angle `ang` (reduced_angle). An expression of the operands, not a
    value: callers read the pair from another buffer than the one they write."""
    r = reduced_angle(T, ang)
    return rotate_cs(T, re, im, T.call_extern("float32", "__cosf", r), T.call_extern("float32", "__sinf", r), part)


def rope_table(T, hr: int):
    """A macro: the row's RoPE cosines and sines into cs_s [hr, 4] (cos, sin of +angle; cos, sin of
    -angle, for the output's inverse rotation), once a row rather than once for each of the heads
    (the same fp32 angle and reduction as `rotated`)."""
    @T.macro
    def table(cs_s, POS, FREQ, t):
        for j in T.Parallel(hr):
            ang = T.Cast("float32", POS[t]) * FREQ[j]
            cs_s[j, 0] = T.call_extern("float32", "__cosf", reduced_angle(T, ang))
            cs_s[j, 1] = T.call_extern("float32", "__sinf", reduced_angle(T, ang))
            cs_s[j, 2] = T.call_extern("float32", "__cosf", reduced_angle(T, -ang))
            cs_s[j, 3] = T.call_extern("float32", "__sinf", reduced_angle(T, -ang))

    return table


def softmax_step(T, H: int, BI: int, width: int):
    """The online softmax's step (a macro) over a key block's scaled, masked scores acc_s [H, BI]
    in the exp2 domain: the running max m (m_prev its last value), the rescale factor alpha, the
    block's probabilities into acc_s, the running sums l (l_blk the block's), and the output
    accumulator acc_o [H, width] rescaled."""
    @T.macro
    def step(acc_s, acc_o, m, m_prev, alpha, l, l_blk):
        T.copy(m, m_prev)
        T.reduce_max(acc_s, m, dim=1, clear=False)
        for h in T.Parallel(H):
            alpha[h] = T.exp2(m_prev[h] - m[h])
        for h, i in T.Parallel(H, BI):
            acc_s[h, i] = T.exp2(acc_s[h, i] - m[h])
        T.reduce_sum(acc_s, l_blk, dim=1)
        for h in T.Parallel(H):
            l[h] = l[h] * alpha[h] + l_blk[h]
        for h, d in T.Parallel(H, width):
            acc_o[h, d] = acc_o[h, d] * alpha[h]

    return step


def key_words(T, BI: int, D: int, threads: int, n: int, R: int, PE: int):
    """Macros that widen a 64-key block into K_s [BI, D] (bf16) from 32-bit words, `threads` //
    BI threads a key, each PV = D / that of its values: the step's rows or the ring (fp8 words of
    four values, ue8m0 scale words of four 32-value blocks), read from the key's one source (a
    branch per thread, not both read and one kept), or the compressed rows (fp4 words of eight
    codes, e4m3 scale words of four 16-code blocks); 8 values at a time by the prelude's
    deepinfer_fp8x8_bf16n / deepinfer_fp4x8_bf16n (tilelang_sparse_prefill), stored 16 bytes at a
    time. The element-wise widening spent about ten instructions a value."""
    from types import SimpleNamespace

    TPR = threads // BI
    PV = D // TPR
    assert threads % BI == 0 and D % TPR == 0 and PV % 32 == 0, "a thread's values are whole 32-value scale blocks"
    assert PV % 128 == 0 or 128 % PV == 0, "a thread's values start a scale word or lie inside one"
    NW8, NW4 = PV // 4, PV // 8  # a thread's words: fp8, fp4
    NS8, NS4 = -(-PV // 128), -(-PV // 64)  # its scale words (a part of one where PV is smaller)

    def scale(sw, c0, k: int, per: int):
        """The scale byte of the thread's values 8k.. (c0 its first, `per` values a scale): the
        word and byte known here where the thread's values start a scale word, else the byte
        from c0."""
        off = 8 * k
        if PV % (4 * per) == 0:
            return T.bitwise_and(T.shift_right(sw[off // (4 * per)], T.uint32(8 * ((off // per) % 4))), T.uint32(0xFF))
        byte = T.Cast("uint32", 8 * (((c0 + off) // per) % 4))
        return T.bitwise_and(T.shift_right(sw[0], byte), T.uint32(0xFF))

    @T.macro
    def fp8(KV, KVS, RING, RINGS, ksrc, krow, K_s, cw, sw, wide, tx):
        i = tx // TPR
        c0 = (tx % TPR) * PV  # the thread's first value in the key
        sr = T.min(krow[i], n - 1)
        rs = krow[i] // R
        ri = krow[i] % R
        if ksrc[i] == 0:
            for v in T.vectorized(NW8):
                cw[v] = KV[sr, c0 // 4 + v]
            for v in T.vectorized(NS8):
                sw[v] = KVS[sr, c0 // 128 + v]
        else:
            for v in T.vectorized(NW8):
                cw[v] = RING[rs, ri, c0 // 4 + v]
            for v in T.vectorized(NS8):
                sw[v] = RINGS[rs, ri, c0 // 128 + v]
        for k in T.unroll(PV // 8):  # 8 values (two words) at a time
            col = c0 + 8 * k
            T.evaluate(T.call_extern("handle", "deepinfer_fp8x8_bf16n", cw[2 * k], cw[2 * k + 1], scale(sw, c0, k, 32),
                                     T.address_of(wide[0])))
            for v in T.vectorized(8):
                K_s[i, col + v] = wide[v]

    @T.macro
    def fp4(CKV, CKVS, krow, K_s, cw, sw, wide, tx):
        i = tx // TPR
        c0 = (tx % TPR) * PV
        r = krow[i]
        for v in T.vectorized(NW4):
            cw[v] = CKV[r // PE, r % PE, c0 // 8 + v]
        for v in T.vectorized(NS4):
            sw[v] = CKVS[r // PE, r % PE, c0 // 64 + v]
        for k in T.unroll(NW4):  # a word: 8 codes, half a scale block
            col = c0 + 8 * k
            T.evaluate(T.call_extern(
                "handle", "deepinfer_fp4x8_bf16n", cw[k],
                T.call_extern("uint32", "deepinfer_e4m3_bf16x2", scale(sw, c0, k, 16)),
                T.address_of(wide[0])))
            for v in T.vectorized(8):
                K_s[i, col + v] = wide[v]

    from .tilelang_sparse_prefill import widen_prelude  # (it imports this module)

    return SimpleNamespace(fp8=fp8, fp4=fp4, NW=max(NW8, NW4), NS=max(NS8, NS4), prelude=widen_prelude())


def reads_words(mode: str, H: int, D: int, topk: int, c: Mapping[str, Any], rope: int = 0) -> bool:
    """Whether attention_program with config `c` declares its key buffers as 32-bit words (the ws
    program; kwords outside the pipelined loop), so that a caller passing tensors, not pointers,
    views them so."""
    if takes_ws(mode, H, D, rope, c):
        return True
    return bool(c.get("kwords")) and not pipelined(mode, topk, c)


def takes_ws(mode: str, H: int, D: int, rope: int, c: Mapping[str, Any]) -> bool:
    """attention_program renders the program with its roles apart (tilelang_sparse_prefill)."""
    return bool(c.get("ws")) and mode == "sparse" and c.get("splits", 1) == 1 and \
        ws_supports(dict(H=H, D=D, rope=rope)) and c.get("block_I", 64) == 64


def pipelined(mode: str, topk: int, c: Mapping[str, Any]) -> bool:
    """The top-k blocks run in the software pipeline (fewer blocks than stages: nothing to overlap)."""
    stages = c.get("stages", 1)
    return stages > 1 and mode == "sparse" and c.get("splits", 1) == 1 and ceil_div(topk, c.get("block_I", 64)) >= stages


def ws_supports(d: Mapping[str, Any]) -> bool:
    """Shapes the program with its roles apart takes: 64 heads, D in two halves of whole 128-wide
    word groups, the rotated tail inside the second half (tilelang_sparse_prefill)."""
    return d["H"] == 64 and d["D"] % 256 == 0 and d["D"] - d.get("rope", 0) >= d["D"] // 2


def attention_program(mode: str, n: int, H: int, D: int, slots: int, R: int, window: int, *, topk: int = 0,
                      pages: int = 1, PE: int = 1, nseq: int = 1, maxp: int = 1, max_block: int = 32,
                      block_I: int = 64, splits: int = 1, threads: int = 256, stages: int = 1, rope: int = 0,
                      ws: int = 0, kwords: int = 0):
    """The attention kernel (and, when splits > 1, the partial-output layout the combine reads).
    `stages` 2 (mode "sparse", one split: prefill): the top-k blocks in a software pipeline, the
    packed rows of block b + 1 copied asynchronously while block b is widened and multiplied,
    instead of each gather waiting on memory with nothing else in flight. `ws` (mode "sparse",
    one split): the program with its roles apart (tilelang_sparse_prefill). `kwords`: the key
    blocks of the plain loop read through 32-bit words (the parameters' types; the launch passes
    pointers) and widened a word at a time, each key from its one source (key_words)."""
    cfg = dict(splits=splits, stages=stages, block_I=block_I, ws=ws, kwords=kwords)
    if takes_ws(mode, H, D, rope, cfg):
        from .tilelang_sparse_prefill import sparse_ws_program

        return sparse_ws_program(n, H, D, slots, R, window, topk=topk, pages=pages, PE=PE, nseq=nseq, maxp=maxp,
                                 block_I=block_I, rope=rope)
    _, T = _tl()
    assert mode in ("sparse", "window", "dspark")
    assert window % block_I == 0 and H == 64 and D % 64 == 0 and rope % 2 == 0 and rope <= D
    NW = window // block_I
    NX = {"sparse": ceil_div(topk, block_I), "window": 0, "dspark": ceil_div(max_block, block_I)}[mode]
    NB = NW + NX
    per = ceil_div(NB, splits)
    piped = pipelined(mode, topk, cfg)
    serial_blocks = NW if piped else per  # the blocks of the plain loop (all of a split's without piped)
    scale2 = D ** -0.5 * LOG2E
    BI = block_I
    pages_ = max(pages, 1)
    # partial outputs exist only when a row is split (a 1-element placeholder otherwise)
    op_shape = (splits, n, H, D) if splits > 1 else (1, 1, 1, 1)
    ml_shape = (splits, n, H, 2) if splits > 1 else (1, 1, 1, 2)

    softmax = softmax_step(T, H, BI, D)

    @T.macro
    def attend(Q_s, K_s, P_s, kvalid, acc_s, acc_o, m, m_prev, alpha, l, l_blk):
        """One key block: S = q k^T, the online softmax's step, O += P K."""
        T.clear(acc_s)
        T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        for h, i in T.Parallel(H, BI):
            acc_s[h, i] = T.if_then_else(kvalid[i] != 0, acc_s[h, i] * scale2, -T.infinity("float32"))
        softmax(acc_s, acc_o, m, m_prev, alpha, l, l_blk)
        T.copy(acc_s, P_s)
        T.gemm(P_s, K_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

    @T.macro
    def widen_packed(C_s, CS_s, K_s):
        """The staged packed rows (two e2m1 codes a byte, an e4m3 scale per 16) widened to bf16."""
        for i, d in T.Parallel(BI, D):
            K_s[i, d] = (fp4_f16_value(T, T.bitwise_and(T.shift_right(
                T.Cast("int32", C_s[i, d // 2]), (d % 2) * 4), 15))
                * (T.Cast("float32", CS_s[i, d // 16]) * 16384.0))

    kwords = reads_words(mode, H, D, topk, cfg, rope)
    if kwords:
        kw = key_words(T, BI, D, threads, n, R, PE)
        tkv, tkvs, trg, trgs = ((n, D // 4), "uint32"), ((n, D // 128), "uint32"), ((slots, R, D // 4), "uint32"), \
            ((slots, R, D // 128), "uint32")
        tckv, tckvs = ((pages_, PE, D // 8), "uint32"), ((pages_, PE, D // 64), "uint32")
    else:
        tkv, tkvs, trg, trgs = ((n, D), "float8_e4m3"), ((n, D // 32), "uint8"), ((slots, R, D), "float8_e4m3"), \
            ((slots, R, D // 32), "uint8")
        tckv, tckvs = ((pages_, PE, D // 2), "uint8"), ((pages_, PE, D // 16), "float8_e4m3")

    @T.prim_func
    def attn(Q: T.Tensor((n, H, D), "bfloat16"), KV: T.Tensor(*tkv), KVS: T.Tensor(*tkvs), RING: T.Tensor(*trg),
             RINGS: T.Tensor(*trgs), CKV: T.Tensor(*tckv), CKVS: T.Tensor(*tckvs),
             TOP: T.Tensor((n, max(topk, 1)), "int32"),
             SINK: T.Tensor((H,), "float32"), POS: T.Tensor((n,), "int64"), TSEQ: T.Tensor((n,), "int32"),
             SLOTS: T.Tensor((nseq,), "int32"), BT: T.Tensor((nseq, maxp), "int32"),
             O: T.Tensor((n, H, D), "bfloat16"), OP: T.Tensor(op_shape, "float32"),
             ML: T.Tensor(ml_shape, "float32"), FREQ: T.Tensor((max(rope // 2, 1),), "float32")):
        with T.Kernel(n, splits, threads=threads, prelude=kw.prelude if kwords else None) as (t, sp):
            Q_s = T.alloc_shared((H, D), "bfloat16")
            K_s = T.alloc_shared((BI, D), "bfloat16")
            P_s = T.alloc_shared((H, BI), "bfloat16")
            C_s = T.alloc_shared((BI, D // 2) if mode == "sparse" else (1, 1), "uint8")
            CS_s = T.alloc_shared((BI, D // 16) if mode == "sparse" else (1, 1), "float8_e4m3")
            # the rotation's cosines and sines in shared memory: reloaded after the key loop's
            # barriers, not held in registers across it from q's rotation (which spilled in the
            # pipelined loop); q's rotated tail staged as it is in QR_s
            cs_s = T.alloc_shared((max(rope // 2, 1), 4), "float32")
            QR_s = T.alloc_shared((H, max(rope, 2)), "bfloat16")
            kvalid = T.alloc_shared((BI,), "int32")
            ksrc = T.alloc_shared((BI,), "int32")  # 0: step row, 1: ring, 2: compressed
            krow = T.alloc_shared((BI,), "int32")  # step row / ring row (slot * R + idx) / page * PE + row
            if piped:  # every top-k entry's page * PE + row, read by the pipeline's copies
                kidx = T.alloc_shared((NX * BI,), "int32")
            acc_s = T.alloc_fragment((H, BI), "float32")
            acc_o = T.alloc_fragment((H, D), "float32")
            m = T.alloc_fragment((H,), "float32")
            m_prev = T.alloc_fragment((H,), "float32")
            alpha = T.alloc_fragment((H,), "float32")
            l = T.alloc_fragment((H,), "float32")
            l_blk = T.alloc_fragment((H,), "float32")
            r0 = T.alloc_var("int32")
            if kwords:  # a thread's words of one key and their scales, and 8 values widened
                cw = T.alloc_local((kw.NW,), "uint32")
                sw = T.alloc_local((kw.NS,), "uint32")
                wide = T.alloc_local((8,), "bfloat16")
                tx = T.get_thread_binding()

            seq = TSEQ[t]
            p = T.Cast("int32", POS[t])
            slot = SLOTS[seq]
            # first row of t's sequence in this step (rows of a sequence are contiguous; a draft
            # block has at most max_block rows)
            r0 = t
            if mode == "dspark":
                for i in T.serial(max_block):
                    if t - i >= 0:
                        if TSEQ[t - i] == seq:
                            r0 = t - i
            wend = T.Cast("int32", POS[r0]) - 1 if mode == "dspark" else p  # newest window position

            if rope:  # q's RoPE (rope_around): its tail rotated at the row's position on the way in
                rope_table(T, rope // 2)(cs_s, POS, FREQ, t)
                # the tail is copied whole first and rotated from shared memory: rotating it from
                # global memory put a load latency behind each pass's branch-free but dependent
                # stores (one latency after another, a pass at a time). q is copied whole (its tail
                # overwritten after the barrier): a copy of its D - rope columns (448 at the medium
                # widths) put a division by 7 into every 16-byte piece's address
                T.copy(Q[t, 0, 0], Q_s)
                for h, d in T.Parallel(H, rope):
                    QR_s[h, d] = Q[t, h, D - rope + d]
                T.sync_threads()
                for h, j in T.Parallel(H, rope // 2):
                    c = D - rope + 2 * j
                    Q_s[h, c] = rotate_cs(T, QR_s[h, 2 * j], QR_s[h, 2 * j + 1], cs_s[j, 0], cs_s[j, 1], 0)
                    Q_s[h, c + 1] = rotate_cs(T, QR_s[h, 2 * j], QR_s[h, 2 * j + 1], cs_s[j, 0], cs_s[j, 1], 1)
            else:
                T.copy(Q[t, 0, 0], Q_s)
            if piped:  # (ahead of the accumulators' first use: its index math holds no registers of theirs)
                for j in T.Parallel(NX * BI):
                    cc = T.max(TOP[t, T.min(j, topk - 1)], 0)
                    kidx[j] = T.max(BT[seq, T.min(cc // PE, maxp - 1)], 0) * PE + cc % PE
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, NEG)
            for bi in T.serial(serial_blocks):
                b = sp * per + bi
                if b < NB:
                    for i in T.Parallel(BI):
                        if b < NW:
                            kp = wend - window + 1 + b * BI + i
                            rr = t - (p - kp)
                            step = (mode != "dspark") and rr >= 0 and TSEQ[T.max(rr, 0)] == seq
                            kvalid[i] = T.Cast("int32", kp >= 0)
                            ksrc[i] = T.if_then_else(step, 0, 1)
                            krow[i] = T.if_then_else(step, T.max(rr, 0), T.max(slot, 0) * R + T.max(kp, 0) % R)
                        else:
                            j = (b - NW) * BI + i
                            if mode == "sparse":
                                c = TOP[t, T.min(j, topk - 1)]
                                ok = (j < topk) and c >= 0
                                cc = T.max(c, 0)
                                kvalid[i] = T.Cast("int32", ok)
                                ksrc[i] = 2
                                krow[i] = T.max(BT[seq, T.min(cc // PE, maxp - 1)], 0) * PE + cc % PE
                            else:
                                rr = r0 + j
                                ok = (j < max_block) and rr < n and TSEQ[T.min(rr, n - 1)] == seq
                                kvalid[i] = T.Cast("int32", ok)
                                ksrc[i] = 0
                                krow[i] = T.min(rr, n - 1)
                    if kwords:
                        if mode != "sparse" or b < NW:
                            kw.fp8(KV, KVS, RING, RINGS, ksrc, krow, K_s, cw, sw, wide, tx)
                        else:
                            kw.fp4(CKV, CKVS, krow, K_s, cw, sw, wide, tx)
                    elif mode != "sparse" or b < NW:
                        # fp8 keys of this step's rows or the ring: both read (clamped rows), one
                        # kept, so that the copy has no branch and vectorises along d
                        for i, d in T.Parallel(BI, D):
                            sr = T.min(krow[i], n - 1)
                            rs = krow[i] // R
                            ri = krow[i] % R
                            K_s[i, d] = T.if_then_else(
                                ksrc[i] == 0, T.Cast("float32", KV[sr, d]) * e8m0_f32(T, KVS[sr, d // 32]),
                                T.Cast("float32", RING[rs, ri, d]) * e8m0_f32(T, RINGS[rs, ri, d // 32]))
                    else:
                        # the packed rows are staged as bytes first: a plain row copy vectorises,
                        # the decode (two codes a byte) then reads shared memory
                        for i, j in T.Parallel(BI, D // 2):
                            C_s[i, j] = CKV[krow[i] // PE, krow[i] % PE, j]
                        for i, j in T.Parallel(BI, D // 16):
                            CS_s[i, j] = CKVS[krow[i] // PE, krow[i] % PE, j]
                        widen_packed(C_s, CS_s, K_s)
                    attend(Q_s, K_s, P_s, kvalid, acc_s, acc_o, m, m_prev, alpha, l, l_blk)
            if piped:
                # the top-k blocks: the statements that copy global rows into shared memory are
                # the pipeline's producer (C_s, CS_s multi-buffered, cp.async), the rest its consumer
                for bx in T.Pipelined(NX, num_stages=stages):
                    for i, j in T.Parallel(BI, D // 2):
                        C_s[i, j] = CKV[kidx[bx * BI + i] // PE, kidx[bx * BI + i] % PE, j]
                    for i, j in T.Parallel(BI, D // 16):
                        CS_s[i, j] = CKVS[kidx[bx * BI + i] // PE, kidx[bx * BI + i] % PE, j]
                    for i in T.Parallel(BI):
                        kvalid[i] = T.Cast("int32", (bx * BI + i < topk) and TOP[t, T.min(bx * BI + i, topk - 1)] >= 0)
                    widen_packed(C_s, CS_s, K_s)
                    attend(Q_s, K_s, P_s, kvalid, acc_s, acc_o, m, m_prev, alpha, l, l_blk)
            if splits == 1:
                for h in T.Parallel(H):
                    l[h] = l[h] + T.exp2(SINK[h] * LOG2E - m[h])
                for h, d in T.Parallel(H, D):
                    acc_o[h, d] = acc_o[h, d] / l[h]
                if rope:  # the output rounded to bf16 (into q's buffer, read by no MMA now), de-rotated
                    T.copy(acc_o, Q_s)
                    for h, d in T.Parallel(H, D - rope):
                        O[t, h, d] = Q_s[h, d]
                    for h, j in T.Parallel(H, rope // 2):
                        c = D - rope + 2 * j
                        O[t, h, c] = rotate_cs(T, Q_s[h, c], Q_s[h, c + 1], cs_s[j, 2], cs_s[j, 3], 0)
                        O[t, h, c + 1] = rotate_cs(T, Q_s[h, c], Q_s[h, c + 1], cs_s[j, 2], cs_s[j, 3], 1)
                else:
                    T.copy(acc_o, O[t, 0, 0])
            else:
                T.copy(acc_o, OP[sp, t, 0, 0])
                for h in T.Parallel(H):
                    ML[sp, t, h, 0] = m[h]
                    ML[sp, t, h, 1] = l[h]

    return attn


def combine_program(n: int, H: int, D: int, splits: int, *, threads: int = 128, rope: int = 0):
    """O[t, h] = sum_s OP[s] 2^(m_s - M) / (sum_s l_s 2^(m_s - M) + 2^(sink' - M)), M = max(m_s, sink')
    (every m here is in the exp2 domain, sink' = sink * log2 e); with `rope`, its tail de-rotated
    at the row's position after the bf16 rounding."""
    _, T = _tl()
    HB = 8  # heads per CTA

    @T.prim_func
    def combine(OP: T.Tensor((splits, n, H, D), "float32"), ML: T.Tensor((splits, n, H, 2), "float32"),
                SINK: T.Tensor((H,), "float32"), O: T.Tensor((n, H, D), "bfloat16"),
                POS: T.Tensor((n,), "int64"), FREQ: T.Tensor((max(rope // 2, 1),), "float32")):
        with T.Kernel(n, H // HB, threads=threads) as (t, hb):
            w = T.alloc_shared((splits, HB), "float32")
            inv = T.alloc_shared((HB,), "float32")
            o_s = T.alloc_shared((HB, D) if rope else (1, 1), "bfloat16")
            acc = T.alloc_fragment((HB, D), "float32")
            for h in T.Parallel(HB):
                mx = T.alloc_var("float32")
                den = T.alloc_var("float32")
                mx = SINK[hb * HB + h] * LOG2E
                for s in T.serial(splits):
                    mx = T.max(mx, ML[s, t, hb * HB + h, 0])
                den = T.exp2(SINK[hb * HB + h] * LOG2E - mx)
                for s in T.serial(splits):
                    w[s, h] = T.exp2(ML[s, t, hb * HB + h, 0] - mx)
                    den = den + ML[s, t, hb * HB + h, 1] * w[s, h]
                inv[h] = 1.0 / den
            T.fill(acc, 0)
            for s in T.serial(splits):
                for h, d in T.Parallel(HB, D):
                    acc[h, d] += OP[s, t, hb * HB + h, d] * w[s, h]
            if rope:
                for h, d in T.Parallel(HB, D):
                    o_s[h, d] = T.Cast("bfloat16", acc[h, d] * inv[h])
                for h, d in T.Parallel(HB, D - rope):
                    O[t, hb * HB + h, d] = o_s[h, d]
                for h, j in T.Parallel(HB, rope // 2):
                    c = D - rope + 2 * j
                    ang = -(T.Cast("float32", POS[t]) * FREQ[j])
                    O[t, hb * HB + h, c] = rotated(T, o_s[h, c], o_s[h, c + 1], ang, 0)
                    O[t, hb * HB + h, c + 1] = rotated(T, o_s[h, c], o_s[h, c + 1], ang, 1)
            else:
                for h, d in T.Parallel(HB, D):
                    O[t, hb * HB + h, d] = acc[h, d] * inv[h]

    return combine


# ---- templates ----------------------------------------------------------------------------------

def attention_dims(spec: KernelSpec) -> dict:
    ins = spec.in_types
    a = spec.attr
    q, ring = ins[0], ins[2]
    d = {"n": int(q.shape[0]), "H": int(q.shape[1]), "D": int(q.shape[2]), "slots": int(ring.shape[0]),
         "R": int(ring.shape[1]), "window": int(a["window"]), "rope": int(a.get("rope_dim") or 0)}
    if spec.op == "sparse_attn":
        ckv, top, bt = ins[3], ins[4], ins[9]
        d.update(topk=int(top.shape[1]), pages=int(ckv.shape[0]), PE=int(ckv.shape[1]), nseq=int(bt.shape[0]),
                 maxp=int(bt.shape[1]))
    else:
        d.update(nseq=int(ins[6].shape[0]))
    return d


# every gathered row index is clamped into its buffer in the program itself, so the bounds
# checks TileLang would wrap around each indirect load (which also stop it vectorising) are off
ATTN_PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}
MODES = {"sparse_attn": "sparse", "window_attn": "window", "dspark_block_attn": "dspark"}
ATTN_KNOBS = {"block_I": (64,), "splits": (1, 2, 3, 4, 5, 10), "threads": (256,), "stages": (1,), "kwords": (0, 1)}
# stages 2 and ws (tilelang_sparse_prefill) change the program of unsplit sparse calls alone
KNOBS_BY_OP = {"sparse_attn": dict(ATTN_KNOBS, stages=(1, 2), ws=(0, 1))}


def attention_default_config(target: Target, spec: KernelSpec) -> dict:
    """Enough CTAs to cover the SMs: decode rows get their key blocks split, prefill rows do not,
    unless the target's unsplit program spills (`target.defaults["tilelang_attention"]`). An
    unsplit sparse call takes the target's `prefill_stages` (the pipelined top-k blocks; 1: off) and
    `prefill_ws` (the program with its roles apart; 0: off); the other calls its `kwords` (keys
    widened a word at a time; 0: off)."""
    d = attention_dims(spec)
    mode = MODES[spec.op]
    nb = d["window"] // 64 + {"sparse": ceil_div(d.get("topk", 0), 64), "window": 0, "dspark": 1}[mode]
    splits = 1
    for s in (10, 5, 4, 2):
        # a batch-invariant target: the key blocks are never split by the row count
        if nb % s == 0 and d["n"] * s <= 2 * target.cores and d["n"] < target.cores and not batch_invariant(target):
            splits = s
            break
    tdef = target.defaults["tilelang_attention"]
    if splits < tdef["min_splits"]:
        splits = next((s for s in (2, 3, 4, 5) if s >= tdef["min_splits"] and nb % s == 0), 1)
    unsplit = mode == "sparse" and splits == 1
    stages = tdef.get("prefill_stages", 1) if unsplit else 1
    out = {"block_I": 64, "splits": splits, "threads": 256, "stages": stages}
    if unsplit and tdef.get("prefill_ws", 0) and ws_supports(d):
        return dict(out, ws=1)
    return dict(out, kwords=1) if tdef.get("kwords", 0) and stages == 1 else out


def render_attention(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    d = attention_dims(spec)
    c = dict(attention_default_config(target, spec), **config)
    if target.arch != "sm_90a":  # ws is Hopper's program (wgmma, setmaxnreg): elsewhere the plain one
        c.pop("ws", None)
    func = attention_program(MODES[spec.op], **d, **c)
    r = lower(func, target.arch, ATTN_PASS_CONFIGS)
    meta = {"template": f"tilelang_{spec.op}", "config": c, "dims": d, "params": r["params"]}
    if c["splits"] > 1:
        comb = lower(combine_program(d["n"], d["H"], d["D"], c["splits"], rope=d["rope"]), target.arch)
        meta["combine"] = {"entry": comb["entry"], "text": comb["src"], "grid": comb["grid"], "block": comb["block"],
                           "smem_bytes": comb["smem"], "params": comb["params"]}
    return KernelSource("cuda", r["entry"], r["src"], grid=r["grid"], block=r["block"], smem_bytes=r["smem"],
                        meta=meta)


def _supports(target: Target, spec: KernelSpec) -> bool:
    d = attention_dims(spec)
    return d["H"] == 64 and d["D"] % 64 == 0 and d["window"] % 64 == 0 and d["rope"] % 2 == 0 and d["rope"] <= d["D"]


for _op in MODES:
    register(Template(
        name=f"tilelang_{_op}",
        ops=(_op,),
        targets=building("cuda", defaults="tilelang_attention"),
        knobs=KNOBS_BY_OP.get(_op, ATTN_KNOBS),
        render=render_attention,
        default_config=attention_default_config,
        supports=_supports,
        host=host_attention,
    ))

__all__ = ["attention_program", "combine_program", "fp4_value", "math"]
