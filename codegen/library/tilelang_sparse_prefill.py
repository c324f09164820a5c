"""TileLang sparse attention at prefill with its roles apart: the `sparse_attn` calls of one split
(one CTA a row, all 64 heads), knob `ws` of tilelang_sparse_attn (attention_program hands such
calls to sparse_ws_program).

The single-role program (tilelang_attention) has every thread gather a key block, widen it, then
run both MMAs and the softmax, in turn: the gathers wait on memory with nothing in flight and the
widening (a code at a time) takes as many issue slots as the MMAs take cycles. Here three
warpgroups:
- the producer (threads 256..383) reads block b + 1's packed key rows into registers, widens them
  a 32-bit word at a time (deepinfer_fp4x8_bf16n, deepinfer_fp8x4_bf16n: shifts, masks, byte
  permutes and bf16x2 multiplies, exact) and stores them into a two-deep ring of bf16 tiles,
  while
- warpgroup 0 computes block b's scores over all D (S = q k^T, 64 heads x 64 keys, no
  exchange of row maxima between warpgroups), the online softmax and its half of O += P K, and
- warpgroup 1 the other half of O += P K, with the probabilities and the rescale factors that
  warpgroup 0 leaves in shared memory.
mbarriers: k_ready / k_free a ring stage (producer -> both, both -> producer) and s_ready /
s_free (warpgroup 0 -> 1, 1 -> 0; s_ready's last phase carries the softmax denominator).

The numerics are the single-role program's: the same scores (fp32 sums of exact bf16 products),
the same online softmax in the exp2 domain, P rounded to bf16 before P K, the sink in the
denominator, the output rounded to bf16 before the inverse RoPE.
"""
import torch

from .tilelang_attention import LOG2E, NEG, rope_table, rotate_cs, softmax_step
from .tilelang_gemm import _tl, ceil_div
from .tilelang_moe_prefill import BF16X2_MUL, bf16_bits_value, pair_expr, word_pairs

PRODUCER = 128  # the producer warpgroup's threads
# registers a thread of each warpgroup after setmaxnreg: a CTA's 384 threads start at 168 (its
# launch's budget, 64512 registers), and setmaxnreg only moves registers within the CTA, so the
# three must sum to at most 3 x 168 (an increase that cannot be met waits forever)
REGS_WG0, REGS_WG1 = 232, 168
REGS_PRODUCER = 3 * 168 - REGS_WG0 - REGS_WG1
# bf16 exponent fields: 2^120 (an e4m3 byte placed in bf16's bits reads as its value x 2^-120),
# 2^126 (an e2m1 code's pair bits, pair_expr, read as value x 2^-126)
BF16_2P120, BF16_2P126 = 247, 253


def widen_prelude() -> str:
    pairs = "\n".join(f"  unsigned r{i} = {pair_expr(i)};" for i in range(4))
    return BF16X2_MUL + r"""// an e4m3 byte's value as bf16 in both halves (exact: 4 significant bits)
__device__ __forceinline__ unsigned deepinfer_e4m3_bf16x2(unsigned b) {
  unsigned x = ((b & 0x7Fu) << 4) | ((b & 0x80u) << 8);
  return deepinfer_bf16x2_mul(x | (x << 16), """ + f"0x{(BF16_2P120 << 7) | (BF16_2P120 << 23):08x}u" + r""");
}
// eight e2m1 codes (code k at bits 4k..4k+3) times sc (an e4m3 scale as bf16 in both halves), as
// eight bf16 in code order: pairs (code i, code i + 4) placed by shifts and masks (value x 2^-126),
// times 2^126, times the scale (each product exact: at most 6 significant bits), then the pairs'
// halves permuted into order
__device__ __forceinline__ void deepinfer_fp4x8_bf16n(unsigned w, unsigned sc, void* out) {
""" + pairs + r"""
  const unsigned p126 = """ + f"0x{(BF16_2P126 << 7) | (BF16_2P126 << 23):08x}u" + r""";
  r0 = deepinfer_bf16x2_mul(deepinfer_bf16x2_mul(r0, p126), sc);
  r1 = deepinfer_bf16x2_mul(deepinfer_bf16x2_mul(r1, p126), sc);
  r2 = deepinfer_bf16x2_mul(deepinfer_bf16x2_mul(r2, p126), sc);
  r3 = deepinfer_bf16x2_mul(deepinfer_bf16x2_mul(r3, p126), sc);
  unsigned o[4] = {__byte_perm(r0, r1, 0x5410u), __byte_perm(r2, r3, 0x5410u),
                   __byte_perm(r0, r1, 0x7632u), __byte_perm(r2, r3, 0x7632u)};
  __builtin_memcpy(out, o, 16);
}
// two words of four e4m3 values each times 2^(s - 127) (s a ue8m0 byte), as eight bf16 in order:
// each byte placed in bf16's bits (value x 2^-120), times 2^120 (exact), times 2^(s - 127) (one
// rounding, as the fp32 product's cast)
__device__ __forceinline__ void deepinfer_fp8x8_bf16n(unsigned u0, unsigned u1, unsigned s, void* out) {
  const unsigned p120 = """ + f"0x{(BF16_2P120 << 7) | (BF16_2P120 << 23):08x}u" + r""";
  const unsigned f = (s << 7) | (s << 23);
  unsigned o[4] = {__byte_perm(u0, 0u, 0x4140u), __byte_perm(u0, 0u, 0x4342u),
                   __byte_perm(u1, 0u, 0x4140u), __byte_perm(u1, 0u, 0x4342u)};
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    unsigned x = ((o[i] << 4) & 0x07F007F0u) | ((o[i] << 8) & 0x80008000u);
    o[i] = deepinfer_bf16x2_mul(deepinfer_bf16x2_mul(x, p120), f);
  }
  __builtin_memcpy(out, o, 16);
}
"""


def fp4_words_to_bf16n(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What deepinfer_fp4x8_bf16n computes, on the host from the same shifts and masks (words
    int64 [...], e4m3 scales as float [...] -> float64 [..., 8] in code order); the two multiplies
    are exact, so their product is the placed value times 2^126 times the scale. The tests hold it
    to the op's dequantisation."""
    pairs = word_pairs(words.to(torch.int64) & 0xFFFFFFFF)
    out = [bf16_bits_value(p & 0xFFFF) for p in pairs] + [bf16_bits_value(p >> 16) for p in pairs]
    return torch.stack(out, -1) * 2.0 ** 126 * scales.double().unsqueeze(-1)


def fp8_words_to_bf16n(u: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What deepinfer_fp8x8_bf16n computes for one word (int64 [...] of four e4m3 bytes, ue8m0
    bytes s) -> float64 [..., 4] before the final rounding (the tests compare after rounding to
    bf16 on both sides)."""
    u = u.to(torch.int64) & 0xFFFFFFFF
    out = []
    for k in range(4):
        b = (u >> (8 * k)) & 0xFF
        out.append(bf16_bits_value(((b & 0x7F) << 4) | ((b & 0x80) << 8)))
    return torch.stack(out, -1) * 2.0 ** 120 * 2.0 ** (s.to(torch.int64) - 127).double().unsqueeze(-1)


def sparse_ws_program(n: int, H: int, D: int, slots: int, R: int, window: int, *, topk: int, pages: int = 1,
                      PE: int = 1, nseq: int = 1, maxp: int = 1, block_I: int = 64, rope: int = 0, **_):
    """The program (one CTA a row, 384 threads). The key buffers are read through 32-bit words
    (the launch passes pointers): the step's and the ring's fp8 rows [.., D/4] with their ue8m0
    scales [.., D/128], the compressed fp4 rows [.., D/8] with their e4m3 scales [.., D/64]."""
    _, T = _tl()
    assert H == 64 and block_I == 64 and D % 256 == 0 and window % 64 == 0 and rope % 2 == 0
    DH = D // 2
    assert D - rope >= DH, "the rotated tail lies in warpgroup 1's half"
    assert rope % 8 == 0 and rope <= block_I, "the tail is staged in S_s in 16-byte pieces"
    BI = block_I
    NW, NX = window // BI, ceil_div(topk, BI)
    NB = NW + NX
    scale2 = D ** -0.5 * LOG2E
    pages_ = max(pages, 1)
    HW8, HW4 = DH // 8, DH // 4  # a half row's words: fp4 (8 codes a word), fp8 (4 values)
    NT = 256 + PRODUCER
    hr = max(rope // 2, 1)

    softmax = softmax_step(T, H, BI, DH)

    @T.macro
    def load_topk(CKV, CKVS, kidx, cw, sw, x, i, hf):
        """Top-k block x's half row of codes and scales for key i into registers (a row of -1:
        row 0's, never used)."""
        r = T.max(kidx[x * BI + i], 0)
        for v in T.vectorized(HW8):
            cw[v] = CKV[r // PE, r % PE, hf * HW8 + v]
        for v in T.vectorized(4):
            sw[v] = CKVS[r // PE, r % PE, hf * (D // 128) + v]

    @T.macro
    def produce_topk(CKV, CKVS, kidx, kvalid, K_s, k_free, k_ready, cw, sw, cwn, swn, wide, x, i, hf):
        """Top-k block x (block NW + x of the ring's sequence) from cw / sw, block x + 1's words
        loaded into cwn / swn first."""
        b = NW + x
        s = b % 2
        if x + 1 < NX:
            load_topk(CKV, CKVS, kidx, cwn, swn, x + 1, i, hf)
        T.mbarrier_wait_parity(k_free[s], ((b // 2) & 1) ^ 1)
        if hf == 0:
            kvalid[s, i] = T.Cast("int32", kidx[x * BI + i] >= 0)
        for k in T.unroll(HW8):  # a word: 8 codes, half a scale block
            T.evaluate(T.call_extern(
                "handle", "deepinfer_fp4x8_bf16n", cw[k],
                T.call_extern("uint32", "deepinfer_e4m3_bf16x2", T.bitwise_and(
                    T.shift_right(sw[k // 8], T.Cast("uint32", 8 * ((k // 2) % 4))), T.uint32(0xFF))),
                T.address_of(wide[0])))
            for v in T.vectorized(8):
                K_s[2 * s + hf, i, 8 * k + v] = wide[v]
        T.fence_proxy_async()  # the tiles are read next by wgmma (the async proxy)
        T.mbarrier_arrive(k_ready[s])

    @T.prim_func
    def attn_ws(Q: T.Tensor((n, H, D), "bfloat16"), KV: T.Tensor((n, D // 4), "uint32"),
                KVS: T.Tensor((n, D // 128), "uint32"), RING: T.Tensor((slots, R, D // 4), "uint32"),
                RINGS: T.Tensor((slots, R, D // 128), "uint32"), CKV: T.Tensor((pages_, PE, D // 8), "uint32"),
                CKVS: T.Tensor((pages_, PE, D // 64), "uint32"), TOP: T.Tensor((n, max(topk, 1)), "int32"),
                SINK: T.Tensor((H,), "float32"), POS: T.Tensor((n,), "int64"), TSEQ: T.Tensor((n,), "int32"),
                SLOTS: T.Tensor((nseq,), "int32"), BT: T.Tensor((nseq, maxp), "int32"),
                O: T.Tensor((n, H, D), "bfloat16"), OP: T.Tensor((1, 1, 1, 1), "float32"),
                ML: T.Tensor((1, 1, 1, 2), "float32"), FREQ: T.Tensor((hr,), "float32")):
        with T.Kernel(n, 1, threads=NT, prelude=widen_prelude()) as (t, sp):
            Q_l = T.alloc_shared((H, DH), "bfloat16")
            Q_r = T.alloc_shared((H, DH), "bfloat16")
            K_s = T.alloc_shared((4, BI, DH), "bfloat16")  # [2 * stage + half]
            S_s = T.alloc_shared((H, BI), "bfloat16")
            alpha_s = T.alloc_shared((H,), "float32")
            lsum_s = T.alloc_shared((H,), "float32")
            kvalid = T.alloc_shared((2, BI), "int32")
            cs_s = T.alloc_shared((hr, 4), "float32")  # cos, sin of +angle; cos, sin of -angle
            k_ready = T.alloc_barrier([PRODUCER] * 2)
            k_free = T.alloc_barrier([256] * 2)
            s_ready = T.alloc_barrier(128)
            s_free = T.alloc_barrier(128)
            acc_s = T.alloc_fragment((H, BI), "float32")
            acc_o = T.alloc_fragment((H, DH), "float32")
            acc_o2 = T.alloc_fragment((H, DH), "float32")
            m = T.alloc_fragment((H,), "float32")
            m_prev = T.alloc_fragment((H,), "float32")
            alpha = T.alloc_fragment((H,), "float32")
            l = T.alloc_fragment((H,), "float32")
            l_blk = T.alloc_fragment((H,), "float32")
            cw = T.alloc_local((HW4 // 2,), "uint32")  # a window pass's words
            sw = T.alloc_local((4,), "uint32")
            cwa = T.alloc_local((HW8,), "uint32")  # two top-k blocks' words, in turn
            cwb = T.alloc_local((HW8,), "uint32")
            swa = T.alloc_local((4,), "uint32")
            swb = T.alloc_local((4,), "uint32")
            kidx = T.alloc_shared((NX * BI,), "int32")
            wide = T.alloc_local((8,), "bfloat16")
            tx = T.get_thread_binding()

            seq = TSEQ[t]
            p = T.Cast("int32", POS[t])
            slot = SLOTS[seq]
            # q in 16-byte pieces, one a thread a pass, the last pass's spare threads clamped to the
            # last piece (a second write of the same value): an element-wise copy over 384 threads,
            # which do not divide q's halves, puts each pass's load behind a branch of its own, one
            # memory latency after another. The rotated tail is staged as it is in S_s (free until
            # the first block) and rotated from there, so every load of q is issued before the
            # first barrier rather than a pair at a time behind the previous pass's stores.
            for j in T.unroll(ceil_div(H * DH // 8, NT)):
                c = T.min(j * NT + tx, H * DH // 8 - 1)
                for v in T.vectorized(8):
                    Q_l[c // (DH // 8), c % (DH // 8) * 8 + v] = Q[t, c // (DH // 8), c % (DH // 8) * 8 + v]
            WR = (DH - rope) // 8
            for j in T.unroll(ceil_div(H * WR, NT)):
                c = T.min(j * NT + tx, H * WR - 1)
                for v in T.vectorized(8):
                    Q_r[c // WR, c % WR * 8 + v] = Q[t, c // WR, DH + c % WR * 8 + v]
            if rope:
                RW = rope // 8
                for j in T.unroll(ceil_div(H * RW, NT)):
                    c = T.min(j * NT + tx, H * RW - 1)
                    for v in T.vectorized(8):
                        S_s[c // RW, c % RW * 8 + v] = Q[t, c // RW, D - rope + c % RW * 8 + v]
                rope_table(T, hr)(cs_s, POS, FREQ, t)  # the angles' cosines and sines once a row
                T.sync_threads()
                for j in T.unroll(ceil_div(H * hr, NT)):
                    c = T.min(j * NT + tx, H * hr - 1)
                    h, jj = c // hr, c % hr
                    col = D - rope + 2 * jj - DH
                    Q_r[h, col] = rotate_cs(T, S_s[h, 2 * jj], S_s[h, 2 * jj + 1], cs_s[jj, 0], cs_s[jj, 1], 0)
                    Q_r[h, col + 1] = rotate_cs(T, S_s[h, 2 * jj], S_s[h, 2 * jj + 1], cs_s[jj, 0], cs_s[jj, 1], 1)
            T.fence_proxy_async()  # q's tiles are read next by wgmma (the async proxy)
            T.sync_threads()

            if tx < 128:  # warpgroup 0: scores, softmax, O's first half
                T.set_max_nreg(REGS_WG0, 1)
                T.fill(acc_o, 0)
                T.fill(l, 0)
                T.fill(m, NEG)
                for b in T.serial(NB):
                    s = b % 2
                    T.mbarrier_wait_parity(k_ready[s], (b // 2) & 1)
                    for h, i in T.Parallel(H, BI):
                        acc_s[h, i] = T.if_then_else(kvalid[s, i] != 0, 0, -T.infinity("float32"))
                    T.gemm(Q_l, K_s[2 * s, :, :], acc_s, transpose_B=True)
                    T.gemm(Q_r, K_s[2 * s + 1, :, :], acc_s, transpose_B=True)
                    for h, i in T.Parallel(H, BI):
                        acc_s[h, i] = acc_s[h, i] * scale2
                    softmax(acc_s, acc_o, m, m_prev, alpha, l, l_blk)
                    if b > 0:  # warpgroup 1 has read the previous block's P and factors
                        T.mbarrier_wait_parity(s_free, (b - 1) & 1)
                    T.copy(acc_s, S_s)
                    T.copy(alpha, alpha_s)
                    T.fence_proxy_async()  # S_s is read next by wgmma (the async proxy)
                    T.mbarrier_arrive(s_ready)
                    T.gemm(S_s, K_s[2 * s, :, :], acc_o)
                    T.mbarrier_arrive(k_free[s])
                for h in T.Parallel(H):
                    l[h] = l[h] + T.exp2(SINK[h] * LOG2E - m[h])
                T.mbarrier_wait_parity(s_free, (NB - 1) & 1)
                T.copy(l, lsum_s)
                T.mbarrier_arrive(s_ready)  # its last phase: the denominators
                for h, d in T.Parallel(H, DH):
                    acc_o[h, d] = acc_o[h, d] / l[h]
                T.copy(acc_o, Q_l)
                T.copy(Q_l, O[t, :, 0:DH])
            elif tx < 256:  # warpgroup 1: O's second half
                T.set_max_nreg(REGS_WG1, 1)
                T.fill(acc_o2, 0)
                for b in T.serial(NB):
                    s = b % 2
                    T.mbarrier_wait_parity(s_ready, b & 1)
                    for h, d in T.Parallel(H, DH):
                        acc_o2[h, d] = acc_o2[h, d] * alpha_s[h]
                    T.gemm(S_s, K_s[2 * s + 1, :, :], acc_o2)
                    T.mbarrier_arrive(s_free)
                    T.mbarrier_arrive(k_free[s])
                T.mbarrier_wait_parity(s_ready, NB & 1)
                for h, d in T.Parallel(H, DH):
                    acc_o2[h, d] = acc_o2[h, d] / lsum_s[h]
                T.copy(acc_o2, Q_r)  # rounded to bf16 (q's buffer: no MMA reads it now)
                for h, d in T.Parallel(H, DH - rope):
                    O[t, h, DH + d] = Q_r[h, d]
                if rope:
                    for h, j in T.Parallel(H, rope // 2):
                        c = D - rope + 2 * j
                        O[t, h, c] = rotate_cs(T, Q_r[h, c - DH], Q_r[h, c + 1 - DH], cs_s[j, 2], cs_s[j, 3], 0)
                        O[t, h, c + 1] = rotate_cs(T, Q_r[h, c - DH], Q_r[h, c + 1 - DH], cs_s[j, 2], cs_s[j, 3], 1)
            else:  # the producer: two threads a key row, a half row (one of the two tiles) each
                T.set_max_nreg(REGS_PRODUCER, 0)
                q = tx - 256
                i = q // 2
                hf = q % 2
                # every top-k entry's cache row (page x PE + row; -1: none), resolved once a row:
                # the block loop then reads its rows' words with one memory latency, not three
                for jj in T.unroll(ceil_div(NX * BI, PRODUCER)):
                    j = jj * PRODUCER + q
                    if j < NX * BI:
                        c = TOP[t, T.min(j, topk - 1)]
                        cc = T.max(c, 0)
                        kidx[j] = T.if_then_else(j < topk and c >= 0,
                                                 T.max(BT[seq, T.min(cc // PE, maxp - 1)], 0) * PE + cc % PE, -1)
                for b in T.serial(NW):  # window keys: this step's rows or the ring, fp8, ue8m0 per 32
                    s = b % 2
                    T.mbarrier_wait_parity(k_free[s], ((b // 2) & 1) ^ 1)
                    kp = p - window + 1 + b * BI + i
                    rr = t - (p - kp)
                    step = rr >= 0 and TSEQ[T.max(rr, 0)] == seq
                    sr = T.min(T.max(rr, 0), n - 1)
                    rs = T.max(slot, 0)
                    ri = T.max(kp, 0) % R
                    if hf == 0:
                        kvalid[s, i] = T.Cast("int32", kp >= 0)
                    for half in T.unroll(2):  # a half row in two passes of 32 words
                        if step:
                            for v in T.vectorized(HW4 // 2):
                                cw[v] = KV[sr, hf * HW4 + half * (HW4 // 2) + v]
                            for v in T.vectorized(2):
                                sw[v] = KVS[sr, hf * (D // 256) + v]
                        else:
                            for v in T.vectorized(HW4 // 2):
                                cw[v] = RING[rs, ri, hf * HW4 + half * (HW4 // 2) + v]
                            for v in T.vectorized(2):
                                sw[v] = RINGS[rs, ri, hf * (D // 256) + v]
                        for k in T.unroll(HW4 // 4):  # 8 values (two words) at a time
                            col = half * (DH // 2) + 8 * k  # within the half row
                            T.evaluate(T.call_extern(
                                "handle", "deepinfer_fp8x8_bf16n", cw[2 * k], cw[2 * k + 1],
                                T.bitwise_and(T.shift_right(sw[col // 128], T.Cast("uint32", 8 * ((col // 32) % 4))),
                                              T.uint32(0xFF)),
                                T.address_of(wide[0])))
                            for v in T.vectorized(8):
                                K_s[2 * s + hf, i, col + v] = wide[v]
                    T.fence_proxy_async()  # the tiles are read next by wgmma (the async proxy)
                    T.mbarrier_arrive(k_ready[s])
                # the top-k blocks, e2m1 with an e4m3 scale per 16: block x + 1's words are loaded
                # (into the other register buffer) before block x is widened, so their latency
                # overlaps the widening
                load_topk(CKV, CKVS, kidx, cwa, swa, 0, i, hf)
                for x2 in T.serial(ceil_div(NX, 2)):
                    produce_topk(CKV, CKVS, kidx, kvalid, K_s, k_free, k_ready, cwa, swa, cwb, swb, wide,
                                 2 * x2, i, hf)
                    if 2 * x2 + 1 < NX:
                        produce_topk(CKV, CKVS, kidx, kvalid, K_s, k_free, k_ready, cwb, swb, cwa, swa, wide,
                                     2 * x2 + 1, i, hf)

    return attn_ws
