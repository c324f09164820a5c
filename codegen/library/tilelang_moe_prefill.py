"""TileLang prefill MoE GEMM on bf16 tensor cores: `grouped_gemm_fp4` (ir/ops/fused.py) for calls
of many rows per expert, on targets whose defaults carry `tilelang_grouped_gemm_fp4_bf16`.

Both operands carry a ue8m0 scale per 32 K, so an fp8 MMA must promote its partial after every
32-deep slice, which costs as many instructions as the MMA saves (tilelang_moe). An e4m3 value or
an e2m1 code times a power of two is exact in bf16 (8 significant bits, fp32's exponent range), so
here both operands become bf16 with their scales folded in, and one bf16 wgmma chain runs over
the whole K with no promotion: the products are the scaled operands', rounded as any
fp32-accumulated GEMM's.

- The rows are dequantised once, by a first kernel, not by each of the GEMM's N tiles.
- The weight's tile is widened in the CTA a 32-bit word (8 codes) a thread at a time, by shifts and
  masks (fp4_words_to_bf16): codes i and i + 4 of a word sit 16 bits apart, so one shift places
  both of them in a bf16 pair, and one bf16x2 multiply applies the scale. The tile's K is thus in
  the order K_ORDER within each 8; the first kernel writes the rows in the same order, and a dot
  product does not depend on the order of its terms.
- One CTA owns (an N tile, an expert) and walks that expert's row tiles; CTAs of empty experts
  exit at once.
"""
from typing import Any, Mapping

import torch

from ..targets import Target
from ..template import KernelSource, KernelSpec, Template, register

# codes' positions in the widened tile, within each 8 of K: word code K_ORDER[p] at slot p
K_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
# per bf16 pair i (codes i and i + 4): the left shift (negative: right) that puts both codes'
# magnitudes (e1 e0 m) at bits 6..8 of their halves, where bf16 reads them as the exponent's low
# bits over the top mantissa bit (the code's value x 2^-126, the subnormal 0.5 included), and the
# one that puts both sign bits at bit 15 of their halves
PAIR_SHIFTS = tuple((6 - 4 * i, 12 - 4 * i) for i in range(4))
MAG_MASK, SIGN_MASK = 0x01C001C0, 0x80008000


def k_order_source(c):
    """The column of the rows' K that slot c of the widened order holds (K_ORDER within each 8);
    on ints and on TileLang expressions alike."""
    return c - c % 8 + (c % 8) // 2 + 4 * (c % 2)


def rs_order_source(c):
    """rs's K order within each 32 (the weight as the register operand): slot c holds code
    8q + 2h + e + 4b of its 32, where h, e, q, b are slot bits 4, 3, 2..1 and 0, so that lane q of
    a quad finds the eight codes of its A-fragment slots (2q, 2q + 1, 2q + 8, 2q + 9 of each
    16-deep half) in word q of the block, as the pairs (codes i, i + 4) fp4x8 widens."""
    r = c % 32
    return c - r + 8 * ((r % 8) // 2) + 2 * (r // 16) + (r % 16) // 8 + 4 * (r % 2)


def _shift(expr: str, s: int) -> str:
    return f"({expr} << {s}u)" if s > 0 else f"({expr} >> {-s}u)" if s < 0 else expr


def pair_expr(i: int) -> str:
    """Pair i of a word w (codes i and i + 4) placed in bf16's bits, as C source (value x 2^-126)."""
    m, s = PAIR_SHIFTS[i]
    return f"({_shift('w', m)} & 0x{MAG_MASK:08x}u) | ({_shift('w', s)} & 0x{SIGN_MASK:08x}u)"


# TileLang has no bf16x2 multiply on raw words: the programs' preludes start with this one
BF16X2_MUL = r"""
__device__ __forceinline__ unsigned deepinfer_bf16x2_mul(unsigned a, unsigned b) {
  unsigned r;  // fma with -0: exact for powers of two, subnormal inputs included
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  return r;
}
"""


def widen_prelude() -> str:
    """The device functions the programs call."""
    pairs = "\n".join(f"  r[{i}] = {pair_expr(i)};" for i in range(4))
    return BF16X2_MUL + r"""// a word of eight e2m1 codes (low nibble first) times 2^(s - 127) as eight bf16, codes in the
// order 0 4 1 5 2 6 3 7; the pair bits hold value x 2^-126, so the factor is 2^(s - 1), in two
// steps where that passes bf16's largest exponent
__device__ __forceinline__ void deepinfer_fp4x8_bf16(unsigned w, unsigned s, void* out) {
  unsigned r[4];
""" + pairs + r"""
  unsigned e1 = s < 129u ? s + 126u : 254u;
  unsigned m1 = (e1 << 7) | (e1 << 23);
  #pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = deepinfer_bf16x2_mul(r[i], m1);
  if (s > 128u) {
    unsigned m2 = ((s - 1u) << 7) | ((s - 1u) << 23);
    #pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = deepinfer_bf16x2_mul(r[i], m2);
  }
  __builtin_memcpy(out, r, 16);
}
// pair i of a word (codes i and i + 4) times 2^(s - 127), as deepinfer_fp4x8_bf16's r[i]
__device__ __forceinline__ unsigned deepinfer_fp4_pair_bf16(unsigned w, unsigned i, unsigned s) {
  unsigned r = i == 0u ? """ + "(" + pair_expr(0) + ") : i == 1u ? (" + pair_expr(1) + ") : i == 2u ? (" + pair_expr(2) + ") : (" + pair_expr(3) + r""");
  // 2^(min(s, 128) - 1), then 2^(max(s, 128) - 128): no branch in the fragment's fill
  unsigned e1 = min(s, 128u) + 126u, e2 = max(s, 128u) - 1u;
  r = deepinfer_bf16x2_mul(r, (e1 << 7) | (e1 << 23));
  return deepinfer_bf16x2_mul(r, (e2 << 7) | (e2 << 23));
}
"""


def fp4_words_to_bf16(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What deepinfer_fp4x8_bf16 computes, on the host from the same shifts, masks and factors
    (words [...] as int64, one ue8m0 scale each -> float64 [..., 8], slot p holding code
    K_ORDER[p]): the tests hold it to the op's dequantisation."""
    w, s = words.to(torch.int64) & 0xFFFFFFFF, scales.to(torch.int64)
    e1 = torch.where(s < 129, s + 126, torch.full_like(s, 254))
    factor = 2.0 ** (e1 - 127).double() * torch.where(s > 128, 2.0 ** (s - 128).double(), torch.ones_like(s).double())
    out = []
    for pair in word_pairs(w):
        for half in (0, 1):  # code i, then code i + 4: K_ORDER's order
            out.append(bf16_bits_value((pair >> (16 * half)) & 0xFFFF) * factor)
    return torch.stack(out, -1)


def word_pairs(w: torch.Tensor) -> list[torch.Tensor]:
    """The four pairs pair_expr places, on the host (int64 words -> int64 bf16x2 bit patterns)."""
    return [(((w << m) if m >= 0 else (w >> -m)) & MAG_MASK) | (((w << s) if s >= 0 else (w >> -s)) & SIGN_MASK)
            for m, s in PAIR_SHIFTS]


def bf16_bits_value(bits: torch.Tensor) -> torch.Tensor:
    """float64 values of bf16 bit patterns (int64, 16 bits each), subnormals included."""
    e, mant = (bits >> 7) & 0xFF, bits & 0x7F
    mag = torch.where(e == 0, mant.double() * 2.0 ** -133, (128 + mant).double() * 2.0 ** (e - 134).double())
    return torch.where((bits >> 15) == 1, -mag, mag)


def grouped_gemm_fp4_bf16_program(Mtot: int, N: int, K: int, E: int, *, block_M=128, block_N=128, block_K=64,
                                  stages=3, threads=256, rs=0, skip_empty=0, inflight=0, ragged=0):
    """X: the rows in bf16, K in K_ORDER within each 8 (dequant_rows_program's output). rs:
    rs_program instead (with inflight, rs_inflight_program). skip_empty: a warpgroup skips its MMAs where its rows of the tile all lie
    past the expert's end (the last tile of an expert of 257-320 rows, of 129-192, ...). (The
    scales read as 32-bit words, cp.async copies rather than plain loads in the loop, were 6%
    slower at the medium 4K on an H100: docs/performance.md, twenty-eighth session.) (Widening each step in two halves with the first half's wgmma
    in flight lost 13% at the medium 4K: docs/performance.md, twenty-seventh session.) (A producer
    warpgroup widening each step while consumer warpgroups ran the wgmma chain, by hand with
    mbarriers, was 1.4-1.7x slower at the medium 4K on an H100: twenty-ninth session.)"""
    if rs and inflight:
        return rs_inflight_program(Mtot, N, K, E, block_M=block_M, block_N=block_N, block_K=block_K, stages=stages,
                                   threads=threads, ragged=ragged)
    if rs:
        return rs_program(Mtot, N, K, E, block_M=block_M, block_N=block_N, block_K=block_K, stages=stages,
                          threads=threads)
    from .tilelang_gemm import _tl

    _, T = _tl()
    assert K % block_K == 0 and block_K % 32 == 0 and N % block_N == 0
    kb, kw = block_K // 32, block_K // 8
    assert (block_N * kw) % threads == 0
    per_thread = block_N * kw // threads  # words a thread a step
    skip = skip_empty and threads // 128 == block_M // 64 > 1  # FullRow: warpgroup w owns rows 64w..
    @T.macro
    def widen(Wp_s, SW_s, B_s, wide, tx):
        """The step's weight tile into B_s, bf16, a word a thread at a time."""
        for it in T.serial(per_thread):
            j = (it * threads + tx) // kw
            c = (it * threads + tx) % kw
            T.evaluate(T.call_extern("handle", "deepinfer_fp4x8_bf16", Wp_s[j, c],
                                     T.Cast("uint32", SW_s[j, c // 4]), T.address_of(wide[0])))
            for v in T.vectorized(8):
                B_s[j, c * 8 + v] = wide[v]

    @T.prim_func
    def grouped_gemm_fp4_bf16(X: T.Tensor((Mtot, K), "bfloat16"), W: T.Tensor((E, N, K // 8), "uint32"),
                              SW: T.Tensor((E, N, K // 32), "uint8"), offsets: T.Tensor((E + 1,), "int32"),
                              C: T.Tensor((Mtot, N), "bfloat16")):
        with T.Kernel(N // block_N, E, threads=threads, prelude=widen_prelude()) as (bx, e):
            X_s = T.alloc_shared((block_M, block_K), "bfloat16")
            Wp_s = T.alloc_shared((block_N, kw), "uint32")
            SW_s = T.alloc_shared((block_N, kb), "uint8")
            B_s = T.alloc_shared((block_N, block_K), "bfloat16")
            wide = T.alloc_local((8,), "bfloat16")
            acc = T.alloc_fragment((block_M, block_N), "float32")
            tx = T.get_thread_binding()
            start = offsets[e]
            rows = offsets[e + 1] - start
            for mt in T.serial(T.ceildiv(rows, block_M)):
                r0 = start + mt * block_M
                T.clear(acc)
                for k in T.Pipelined(K // block_K, num_stages=stages):
                    # rows past the expert's end are read (other experts' rows, or guarded at
                    # Mtot) and never stored
                    T.copy(X[r0, k * block_K], X_s)
                    T.copy(W[e, bx * block_N, k * kw], Wp_s)
                    T.copy(SW[e, bx * block_N, k * kb], SW_s)
                    widen(Wp_s, SW_s, B_s, wide, tx)
                    # generic-proxy stores read next by wgmma (async proxy) need this fence
                    T.fence_proxy_async()
                    if skip:  # a warpgroup whose 64 rows all lie past the expert's end skips its MMAs
                        if mt * block_M + (tx // 128) * 64 < rows:
                            T.gemm(X_s, B_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    else:
                        T.gemm(X_s, B_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(block_M, block_N):
                    if mt * block_M + i < rows:
                        C[r0 + i, bx * block_N + j] = acc[i, j]

    return grouped_gemm_fp4_bf16


def rs_program(Mtot: int, N: int, K: int, E: int, *, block_M=128, block_N=128, block_K=64, stages=3, threads=256):
    """The weight as wgmma's register operand: C^T = W x^T, a CTA's block_N weight rows the MMA's
    M (64 a warpgroup), block_M rows of x its N, x the shared-memory operand. The codes go from
    the packed word straight into the A fragment (deepinfer_fp4_pair_bf16, one pair a call), so
    the widened tile never passes through shared memory: per step the warpgroups read x and the
    packed words only. X: the rows in bf16 in rs_order_source's K order. Each fragment element
    is written by its own expression; which lane holds it is TileLang's layout, the order only
    decides that a lane's elements share a word (whatever the layout, the values are right)."""
    from .tilelang_gemm import _tl

    _, T = _tl()
    assert K % block_K == 0 and block_K % 32 == 0 and N % block_N == 0
    kb, kw = block_K // 32, block_K // 8

    @T.prim_func
    def grouped_gemm_fp4_bf16_rs(X: T.Tensor((Mtot, K), "bfloat16"), W: T.Tensor((E, N, K // 8), "uint32"),
                                 SW: T.Tensor((E, N, K // 32), "uint8"), offsets: T.Tensor((E + 1,), "int32"),
                                 C: T.Tensor((Mtot, N), "bfloat16")):
        with T.Kernel(N // block_N, E, threads=threads, prelude=widen_prelude()) as (bx, e):
            X_s = T.alloc_shared((block_M, block_K), "bfloat16")
            Wp_s = T.alloc_shared((block_N, kw), "uint32")
            SW_s = T.alloc_shared((block_N, kb), "uint8")
            Wf = T.alloc_fragment((block_N, block_K), "bfloat16")
            acc = T.alloc_fragment((block_N, block_M), "float32")
            start = offsets[e]
            rows = offsets[e + 1] - start
            for mt in T.serial(T.ceildiv(rows, block_M)):
                r0 = start + mt * block_M
                T.clear(acc)
                for k in T.Pipelined(K // block_K, num_stages=stages):
                    T.copy(X[r0, k * block_K], X_s)
                    T.copy(W[e, bx * block_N, k * kw], Wp_s)
                    T.copy(SW[e, bx * block_N, k * kb], SW_s)
                    for j, c in T.Parallel(block_N, block_K):
                        code = rs_order_source(c)  # the code slot c holds: pair code % 4, half code % 8 // 4
                        pair = T.call_extern("uint32", "deepinfer_fp4_pair_bf16", Wp_s[j, code // 8],
                                             T.Cast("uint32", code % 4), T.Cast("uint32", SW_s[j, c // 32]))
                        Wf[j, c] = T.reinterpret("bfloat16", T.Cast("uint16", T.shift_right(
                            pair, T.Cast("uint32", 16 * ((code % 8) // 4)))))
                    T.gemm(Wf, X_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for j, i in T.Parallel(block_N, block_M):
                    if mt * block_M + i < rows:
                        C[r0 + i, bx * block_N + j] = acc[j, i]

    return grouped_gemm_fp4_bf16_rs


def rs_inflight_program(Mtot: int, N: int, K: int, E: int, *, block_M=256, block_N=128, block_K=64, stages=4,
                        threads=256, ragged=0):
    """rs_program with each step's MMAs left in flight while the next step's fragment is widened
    (tilelang_prefill_bf16.inflight_tiles: T.gemm waits for its wgmma chain before anything else
    runs, so the widening, the barriers and the copies' issue all stood between one step's MMAs
    and the next's). The weight's scales for the CTA's whole K are read once (a step's two scale
    bytes a row are too small for cp.async). ragged G: an expert's last tile is the smallest
    multiple of G rows (one program each, the MMA's N) that holds the rest of its rows, not a
    whole block_M (the medium 4K's experts of 256 +- 16 rows filled 1.5 tiles of 256)."""
    from .tilelang_gemm import _tl
    from .tilelang_prefill_bf16 import inflight_tiles

    _, T = _tl()
    assert K % block_K == 0 and block_K % 32 == 0 and N % block_N == 0
    kb, kw = block_K // 32, block_K // 8
    assert not ragged or (ragged % 8 == 0 and block_M % ragged == 0)
    widths = list(range(block_M, 0, -ragged)) if ragged else [block_M]  # the MMA's N of each program

    @T.macro
    def copy_w(W, Wp_s, kn, s, e, bx):
        T.async_copy(W[e, bx * block_N:(bx + 1) * block_N, kn * kw:(kn + 1) * kw], Wp_s[s, :, :])

    @T.macro
    def fill(Wp_s, SW_s, Wf, b, k):
        for j, c in T.Parallel(block_N, block_K):
            code = rs_order_source(c)
            pair = T.call_extern("uint32", "deepinfer_fp4_pair_bf16", Wp_s[b, j, code // 8],
                                 T.Cast("uint32", code % 4), T.Cast("uint32", SW_s[j, k * kb + c // 32]))
            Wf[j, c] = T.reinterpret("bfloat16", T.Cast("uint16", T.shift_right(
                pair, T.Cast("uint32", 16 * ((code % 8) // 4)))))

    tiles = inflight_tiles(T, widths, block_N=block_N, block_K=block_K, stages=stages, threads=threads, K=K,
                           copy_w=copy_w, fill=fill)
    # each program runs where the rest of the expert's rows lie in (lo, hi]: the narrowest that
    # holds them, and the widest for every tile before the last
    bounds = [(n, tile, n - ragged if ragged else 0, n if n < block_M else Mtot) for n, tile in tiles]

    @T.prim_func
    def grouped_gemm_fp4_bf16_rsi(X: T.Tensor((Mtot, K), "bfloat16"), W: T.Tensor((E, N, K // 8), "uint32"),
                                  SW: T.Tensor((E, N, K // 32), "uint8"), offsets: T.Tensor((E + 1,), "int32"),
                                  C: T.Tensor((Mtot, N), "bfloat16")):
        with T.Kernel(N // block_N, E, threads=threads, prelude=widen_prelude()) as (bx, e):
            X_s = T.alloc_shared((stages, block_M, block_K), "bfloat16")
            Wp_s = T.alloc_shared((stages, block_N, kw), "uint32")
            SW_s = T.alloc_shared((block_N, K // 32), "uint8")
            Wf0 = T.alloc_fragment((block_N, block_K), "bfloat16")
            Wf1 = T.alloc_fragment((block_N, block_K), "bfloat16")
            start = offsets[e]
            rows = offsets[e + 1] - start
            T.copy(SW[e, bx * block_N:(bx + 1) * block_N, :], SW_s)
            for mt in T.serial(T.ceildiv(rows, block_M)):
                rest = rows - mt * block_M
                for n, tile, lo, hi in bounds:
                    if rest > lo and rest <= hi:
                        tile(X, W, C, X_s, Wp_s, SW_s, Wf0, Wf1, e, bx, start + mt * block_M, T.min(rest, n))

    return grouped_gemm_fp4_bf16_rsi


def dequant_rows_program(M: int, K: int, *, rs=0):
    """The rows dequantised into bf16 once, ahead of the GEMM, in its widened weight tile's K order
    (K_ORDER within each 8; with rs, rs_order_source's within each 32)."""
    from .tilelang_prefill_bf16 import dequant_rows_program as dequant

    return dequant(M, K, order=rs_order_source if rs else k_order_source)


def _dims(spec: KernelSpec):
    from .tilelang_moe import _dims as dims  # where used: importing tilelang_moe registers its template

    return dims(spec)


KNOBS = {"block_M": (64, 128, 256), "block_N": (64, 128, 256), "block_K": (64, 128), "stages": (2, 3, 4),
         "threads": (128, 256, 512), "rs": (0, 1), "skip_empty": (0, 1), "inflight": (0, 1),
         "ragged": (0, 32, 64)}
# (512 threads: the in-flight program's 256 weight rows as four warpgroups of one m64 MMA each, with
# 128 x rows: each x tile then serves twice the weight rows, and x's reads from L2 halve; 110
# registers and no spills, not yet run on a GPU: docs/performance.md, forty-first session)
# (skip_empty passed its tiny case on an H100 and timed even at the medium 4K: a tuner's choice,
# off in the defaults; docs/performance.md, twenty-eighth session)
# the tiles where a target's defaults name none (a plan built with the template on and tuned by
# code whose target lacks it): sm90's (the medium config's 4K prefill routes about 256 rows to an
# expert)
MOE_TILES = {"block_M": 256, "block_N": 128, "block_K": 64, "stages": 4, "threads": 256, "rs": 1, "inflight": 1,
             "ragged": 64}
# the shared-memory program's (the weight widened into a bf16 tile, T.gemm's synchronous chain)
SS_TILES = {"block_M": 128, "block_N": 128, "block_K": 128, "stages": 2, "threads": 256, "rs": 0, "inflight": 0,
            "ragged": 0}


def default_config(target: Target, spec: KernelSpec) -> dict:
    return dict(target.defaults.get("tilelang_grouped_gemm_fp4_bf16", MOE_TILES))


def _render(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    """The GEMM, and the rows' dequantisation as the second kernel (the host launches it first)."""
    from .tilelang_gemm import lower, source

    mtot, n, k, e = _dims(spec)
    c = dict(default_config(target, spec), **config)
    src = source(grouped_gemm_fp4_bf16_program(mtot, n, k, e, **c), target.arch,
                 {"template": "tilelang_grouped_gemm_fp4_bf16", "config": c,
                  "dims": {"rows": mtot, "n": n, "k": k, "experts": e}})
    dq = lower(dequant_rows_program(mtot, k, rs=c.get("rs", 0)), target.arch)
    src.meta["combine"] = {"entry": dq["entry"], "text": dq["src"], "grid": dq["grid"], "block": dq["block"],
                           "smem_bytes": dq["smem"], "params": dq["params"]}
    return src


def _supports(target: Target, spec: KernelSpec) -> bool:
    """Prefill-sized calls (at least 2 rows per expert on average: below that the decode templates
    stream the weight once per few rows) with static shapes in the formats the kernel reads, K and
    N whole tiles of the target's config, the rows a whole number of the dequantisation's 16; not
    in a batch-invariant plan (its prefill buckets run the decode template)."""
    from .tilelang_moe_decode import fp4_moe_operands

    if not fp4_moe_operands(target, spec, "tilelang_grouped_gemm_fp4_bf16"):
        return False
    mtot, n, k, e = _dims(spec)
    from .tilelang_prefill_bf16 import inflight_fits

    c = default_config(target, spec)
    fits = not (c.get("rs") and c.get("inflight")) or inflight_fits(c, k)
    return mtot >= 2 * e and k % c["block_K"] == 0 and n % c["block_N"] == 0 and fits


def host_grouped_gemm_fp4_bf16(launch, inputs, attrs, config, meta):
    """The rows dequantised into bf16 (in K_ORDER) by the second kernel, then the GEMM on them.
    Rows past the last expert's range are not computed by the kernel; the op leaves them 0.
    Here rather than in tilelang_host: a host there would re-key the older templates' renders."""
    x, w, offsets = inputs
    m, k = x.data.shape
    rows = max(meta["dims"]["rows"], m)
    dev = x.data.device
    a8, sa = x.data, x.scale
    if rows != m:
        a8 = torch.cat([a8, torch.zeros(rows - m, k, dtype=a8.dtype, device=dev)])
        sa = torch.cat([sa, torch.zeros(rows - m, sa.shape[1], dtype=sa.dtype, device=dev)])
    a = torch.empty(rows, k, dtype=torch.bfloat16, device=dev)
    launch(1, A8=a8.contiguous(), SA=sa.contiguous(), A=a)
    c = torch.zeros(rows, w.data.shape[1], dtype=torch.bfloat16, device=dev)
    launch(0, X=a, W=w.data, SW=w.scale, offsets=offsets, C=c)
    return c[:m]


register(Template(
    name="tilelang_grouped_gemm_fp4_bf16",
    ops=("grouped_gemm_fp4",),
    # sm90 only (sm100 multiplies e4m3 by e2m1 natively: tilelang_moe), and there only where its
    # defaults carry the tiles (_supports): a plan variant or a test turns it on
    targets=("sm90",),
    knobs=KNOBS,
    render=_render,
    default_config=default_config,
    supports=_supports,
    host=host_grouped_gemm_fp4_bf16,
))
