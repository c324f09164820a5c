"""TileLang prefill linears on bf16 tensor cores, where a target's defaults carry their tiles:
`gemm_fp8` (the fp8 linears; `tilelang_gemm_fp8_bf16`, an op of ir/ops/fused.py) and
`grouped_linear` (wo_a, bf16 rows against an fp8 weight; `tilelang_grouped_linear_bf16`). The MoE
experts' program on the same idea is tilelang_moe_prefill.

Both operands carry a ue8m0 scale per 32 K, so an fp8 MMA must promote its fp32 partial into the
accumulator after every 32-deep slice (tilelang_gemm). Here each K tile of the weight is
dequantised into bf16 in shared memory instead, the scale folded in: an e4m3 value times a power
of two is exact in bf16 (8 significant bits, fp32's exponent range), so the products are the same,
and the wgmma accumulates over the whole K in fp32 with no promotion. The sums run in the tensor
core's order rather than slice by slice: the output is rounded as any fp32-accumulated GEMM's.
The raw tiles and their scales stream through a `stages`-deep pipeline; the bf16 tiles are one
buffer each.

One program of bf16 rows against the fp8 weight (one CTA an output tile, the tiles rasterised in
panels, as tilelang_gemm's): wo_a's rows are bf16 already, and gemm_fp8's are dequantised by a
kernel of their own first, once, rather than by each of the GEMM's N tiles.
"""
from typing import Any, Mapping

from ..targets import Target
from .tilelang_host import host_gemm_fp8_rows_bf16, host_grouped_linear
from ..template import KernelSource, KernelSpec, Template, batch_invariant, register

# tilelang_gemm and tilelang_attention are imported where used: importing them here would
# register their templates ahead of the Triton ones (this module is imported before triton_ops,
# so that prefill calls reach these templates first where a target enables them)


KNOBS = {"block_M": (64, 128), "block_N": (64, 128, 256), "block_K": (64, 128), "stages": (2, 3, 4),
         "threads": (128, 256), "scales_once": (0, 1)}
# the programs may also be lowered with TMA copies from a producer warpgroup (tilelang_gemm's tma
# knob)
ROWS_KNOBS = dict(KNOBS, tma=(0, 1))


def rows_bf16_gemm_program(M: int, G: int, NG: int, KG: int, out_dtype: str = "bfloat16", *, block_M=128,
                           block_N=128, block_K=64, stages=4, threads=256, scales_once=0):
    """C[m, g*NG + n] = sum_k X[m, g*KG + k] * W[g*NG + n, k] sw[(g*NG + n)//32, k//32]: grouped_linear's
    block-diagonal product (group g of X's features meets rows g of W), and with G 1 gemm_fp8's on
    rows dequantised ahead (dequant_rows_program). X is bf16: its tiles go to the wgmma as loaded,
    only the weight's are dequantised. A CTA's N tile lies in one group (NG whole tiles).
    scales_once: the CTA's weight scales for the whole K (block_N/32 x KG/32 bytes) copied before
    the loop, rather than a step's few bytes with plain loads inside it, which every thread then
    waits on once a step (TileLang copies them with cp.async only from 4 bytes a row)."""
    from .tilelang_gemm import _tl, e8m0_f32

    _, T = _tl()
    assert KG % block_K == 0 and block_K % 32 == 0 and NG % block_N == 0 and block_N % 32 == 0
    kb = block_K // 32
    tiles = NG // block_N

    @T.prim_func
    def rows_bf16_gemm(X: T.Tensor((M, G * KG), "bfloat16"), W: T.Tensor((G * NG, KG), "float8_e4m3"),
                       SW: T.Tensor((G * NG // 32, KG // 32), "uint8"), C: T.Tensor((M, G * NG), out_dtype)):
        with T.Kernel(G * tiles, T.ceildiv(M, block_M), threads=threads) as (bx, by):
            X_s = T.alloc_shared((block_M, block_K), "bfloat16")
            W8_s = T.alloc_shared((block_N, block_K), "float8_e4m3")
            SW_s = T.alloc_shared((block_N // 32, KG // 32 if scales_once else kb), "uint8")
            B_s = T.alloc_shared((block_N, block_K), "bfloat16")
            acc = T.alloc_fragment((block_M, block_N), "float32")
            T.use_swizzle(panel_size=8)
            T.clear(acc)
            if scales_once:
                T.copy(SW[bx * (block_N // 32), 0], SW_s)
            for k in T.Pipelined(KG // block_K, num_stages=stages):
                # W's row bx * block_N is group bx // tiles's row (bx % tiles) * block_N
                T.copy(X[by * block_M, (bx // tiles) * KG + k * block_K], X_s)
                T.copy(W[bx * block_N, k * block_K], W8_s)
                if not scales_once:
                    T.copy(SW[bx * (block_N // 32), k * kb], SW_s)
                for j, kk in T.Parallel(block_N, block_K):
                    sb = SW_s[j // 32, k * kb + kk // 32] if scales_once else SW_s[j // 32, kk // 32]
                    B_s[j, kk] = T.Cast("bfloat16", T.Cast("float32", W8_s[j, kk]) * e8m0_f32(T, sb))
                T.fence_proxy_async()  # generic-proxy stores read next by wgmma (async proxy)
                T.gemm(X_s, B_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.copy(acc, C[by * block_M, bx * block_N])

    return rows_bf16_gemm


def dequant_rows_program(M: int, K: int, *, order=None, block_M=16, threads=256):
    """A[m, c] = A8[m, order(c)] * 2^(SA[m, c//32] - 127) in bf16 (exact): the rows dequantised once,
    ahead of a GEMM whose N tiles would each convert them again (gemm_fp8's here). `order`: the
    column of A8 that column c of A takes (a permutation within each 32, on TileLang expressions:
    tilelang_moe_prefill's widened K orders); the identity where None."""
    from .tilelang_gemm import _tl, e8m0_f32

    _, T = _tl()
    bk = next(b for b in (512, 256, 128, 64, 32) if K % b == 0)
    order = order or (lambda c: c)

    @T.prim_func
    def dequant_rows(A8: T.Tensor((M, K), "float8_e4m3"), SA: T.Tensor((M, K // 32), "uint8"),
                     A: T.Tensor((M, K), "bfloat16")):
        with T.Kernel(K // bk, T.ceildiv(M, block_M), threads=threads) as (bx, by):
            for i, kk in T.Parallel(block_M, bk):
                r, c = by * block_M + i, bx * bk + kk
                if r < M:
                    A[r, c] = T.Cast("bfloat16", T.Cast("float32", A8[r, order(c)]) * e8m0_f32(T, SA[r, c // 32]))

    return dequant_rows


# 64 deep on 4 stages: 112 KB of shared memory, two CTAs an SM (128 deep on 3 fits one)
ROWS_TILES = {"block_M": 128, "block_N": 128, "block_K": 64, "stages": 4, "threads": 256}


def _tiles(target: Target, key: str) -> dict:
    """The target's tiles for template `key`, or ROWS_TILES where it names none (a plan variant
    tuned by code whose target lacks them)."""
    return dict(target.defaults.get(key, ROWS_TILES))


def _whole_tiles(c: dict, m: int, n: int, k: int) -> bool:
    """A prefill-sized call (rows past the decode buckets' 64) of whole tiles of config c."""
    return m > 64 and m % c["block_M"] == 0 and n % c["block_N"] == 0 and k % c["block_K"] == 0


def gemm_default_config(target: Target, spec: KernelSpec) -> dict:
    return _tiles(target, "tilelang_gemm_fp8_bf16")


def linear_default_config(target: Target, spec: KernelSpec) -> dict:
    return _tiles(target, "tilelang_grouped_linear_bf16")


def _gemm_render(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    """The rows dequantised by the second kernel (the host launches it first), then
    rows_bf16_gemm_program on one group: the GEMM converts only the weight's tiles."""
    from .tilelang_gemm import _mnk, lower, out_dtype_name, program_knobs, source, tma_pass_configs

    m, n, k = _mnk(spec)
    c = dict(gemm_default_config(target, spec), **config)
    src = source(rows_bf16_gemm_program(m, 1, n, k, out_dtype_name(spec), **program_knobs(c)), target.arch,
                 {"template": "tilelang_gemm_fp8_bf16", "config": c, "dims": {"rows": m, "n": n, "k": k}},
                 tma_pass_configs(c))
    dq = lower(dequant_rows_program(m, k), target.arch)
    src.meta["combine"] = {"entry": dq["entry"], "text": dq["src"], "grid": dq["grid"], "block": dq["block"],
                           "smem_bytes": dq["smem"], "params": dq["params"]}
    return src


def _gemm_supports(target: Target, spec: KernelSpec) -> bool:
    """Prefill-sized calls (rows past the decode buckets' 64, a whole number of the tiles) in the
    formats the decode lin8 programs read (tilelang_gemm_decode.fp8_operands)."""
    from .tilelang_gemm import _mnk
    from .tilelang_gemm_decode import fp8_operands

    if not fp8_operands(target, spec, "tilelang_gemm_fp8_bf16"):
        return False
    return _whole_tiles(gemm_default_config(target, spec), *_mnk(spec))


register(Template(
    name="tilelang_gemm_fp8_bf16",
    ops=("gemm_fp8",),
    targets=("sm90",),  # as tilelang_grouped_gemm_fp4_bf16's
    knobs=ROWS_KNOBS,
    render=_gemm_render,
    default_config=gemm_default_config,
    supports=_gemm_supports,
    host=host_gemm_fp8_rows_bf16,
))


def _linear_dims(spec: KernelSpec) -> tuple[int, int, int, int]:
    """(rows, groups, out features a group, in features a group)."""
    from .tilelang_gemm import _mnk

    m, n, kg = _mnk(spec)
    g = spec.attr["groups"]
    return m, g, n // g, kg


def _linear_render(target: Target, spec: KernelSpec, config: Mapping[str, Any]) -> KernelSource:
    from .tilelang_gemm import program_knobs, source, tma_pass_configs

    m, g, ng, kg = _linear_dims(spec)
    c = dict(linear_default_config(target, spec), **config)
    return source(rows_bf16_gemm_program(m, g, ng, kg, **program_knobs(c)), target.arch,
                  {"template": "tilelang_grouped_linear_bf16", "config": c,
                   "dims": {"rows": m, "groups": g, "ng": ng, "kg": kg}}, tma_pass_configs(c))


def _linear_supports(target: Target, spec: KernelSpec) -> bool:
    """Prefill-sized calls (rows past the decode buckets' 64, a whole number of the tiles) of bf16
    rows against an e4m3 weight with ue8m0 per 32 x 32 block (the checkpoint's wo_a), static
    shapes, a bf16 output; a target whose defaults carry the key, not a batch-invariant plan."""
    from ...ir.types import QuantType

    if "tilelang_grouped_linear_bf16" not in target.defaults or batch_invariant(target):
        return False
    x, w = spec.in_types[:2]
    if isinstance(x, QuantType) or not isinstance(w, QuantType) or w.rank != 2:
        return False
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape)):
        return False
    if not (x.dtype.name == "bf16" and spec.attr.get("weight_dtype") == "bf16" and w.data.dtype.name == "fp8e4m3"
            and w.scale.dtype.name == "e8m0" and tuple(w.block) == (32, 32) and spec.out_types[0].dtype.name == "bf16"):
        return False
    m, _, ng, kg = _linear_dims(spec)
    return _whole_tiles(linear_default_config(target, spec), m, ng, kg)


register(Template(
    name="tilelang_grouped_linear_bf16",
    ops=("grouped_linear",),
    targets=("sm90",),  # as tilelang_grouped_gemm_fp4_bf16's
    knobs=ROWS_KNOBS,
    render=_linear_render,
    default_config=linear_default_config,
    supports=_linear_supports,
    host=host_grouped_linear,
))
