"""TileLang-Ascend grouped GEMMs for ascend950: the MoE experts' `grouped_gemm_fp4` and the grouped
low-rank output projection `grouped_linear` (ir/ops/fused.py, ir/ops/quantized.py), as mixed
cube + vector kernels.

Operand formats. The 950's cube has an MX block-scaled MMA, documented for fp4 x fp4 (e2m1 /
e1m2) and fp8 x fp8 (e4m3 / e5m2) operand pairs with ue8m0 scales per 32 K (CANN asc-devkit
`asc_mmad_mx`, docs/api/c_api/cube_compute/asc_mmad_mx.md: "Ascend 950PR/Ascend 950DT"); that page
lists no fp8 x fp4 pair, and TileLang 0.1.15's `T.gemm_blockscaled` names a single element type
for both operands. The experts meet fp8 e4m3 rows with fp4 e2m1 weights, so the MX MMA cannot
take them as they are, and widening the weights to fp8 on the vector core cannot reach L1 either:
TileLang-Ascend's UB -> L1 transfer (its nd2nz scatter) carries only f16 / bf16 / f32 (lowering an
fp8 one stops in src/ascend/transform/insert_nd2nz.cc: "The UB scatter supports only
float16/bfloat16/float32"). So both
operands are dequantised in the vector-core prologue into bf16 (code x 2^(scale-127): every e4m3
and e2m1 value times a power of two is exact in bf16), moved UB -> L1, and multiplied by the
cube's bf16 MMA with fp32 accumulation in L0C: the same products as the reference's fp32
matmul of the dequantised operands, summed in another order. `grouped_linear`'s weight is fp8
with 32x32 block scales, dequantised to bf16 the same way (the op rounds it to bf16 first, which
is exact); its bf16 input goes GM -> L1 directly.

Work split. `grouped_gemm_fp4`: a unit is (expert, N tile); the AI cores walk units
(`T.Persistent`), each unit reads its expert's row range from `offsets` on the device and loops
over those rows' M tiles, so empty experts cost one scalar read. The last M tile of an expert
reaches into the next expert's rows: the tile leaves L0C through the UB and a SIMT store writes
only the expert's own rows. `grouped_linear`: a unit is (M tile, group, N tile); output tiles
never overlap, so L0C goes to GM through the fixpipe.

Rendered and capacity-checked here (TileLang-Ascend has no CPU execution path in this install);
built only where CANN's `bisheng` exists; never run on an Ascend 950, so nothing about it is
verified.
"""
# no `from __future__ import annotations`: TileLang evaluates the prim_func's T.Tensor hints

import functools

from ..targets import building
from ..template import KernelSource, KernelSpec, Template, register
from .ascend_common import SIMT_CONTEXT_BYTES, align32, e2m1_f32, lower_ascend
from .tilelang_gemm import e8m0_f32

_THREADS = 128


def _nd2nz(rows: int, cols: int, elem: int = 2) -> list[int]:
    """A UB tile bound for L1: the tile itself and the fractal (nd2nz) copy the scatter writes,
    which TileLang-Ascend allocates one row longer (seen in the rendered offsets)."""
    return [align32(rows * cols * elem), align32((rows + 1) * cols * elem)]


def grouped_plan(kind: str, m: int, n: int, k: int, units: int, config: dict, cores: int) -> dict:
    """Tiles, grid and on-chip bytes per scope of one config (what the capacity check reads).
    `kind` "fp4": fp8 rows + fp4 weights dequantised in UB; "linear": bf16 rows straight to L1,
    fp8 weights dequantised in UB."""
    bm = min(config["block_M"], -(-m // 16) * 16)
    bn, bk = config["block_N"], config["block_K"]
    ub = _nd2nz(bn, bk) + [align32(bn * bk // 32 if kind == "fp4" else -(-bn // 32) * (bk // 32))]
    if kind == "fp4":
        ub += [align32(bn * bk // 2), align32(bm * bk), align32(bm * bk // 32)] + _nd2nz(bm, bk)
        ub += [align32(bm * bn * 2)]  # the output tile on its way to the guarded store
    else:
        ub += [align32(bn * bk)]
    ub.append(SIMT_CONTEXT_BYTES)
    from .ascend_gemm import _k_chunk

    kc = _k_chunk(bm, bn, bk)
    return {"block_M": bm, "units": units, "grid": min(cores, units), "k_chunk": kc,
            "buffers": {"ub": ub, "l1": [align32(bm * bk * 2), align32(bn * bk * 2)],
                        "l0a": [2 * bm * kc * 2], "l0b": [2 * bn * kc * 2], "l0c": [bm * bn * 4]}}


# ---- grouped_gemm_fp4 ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _fp4_source(mtot: int, n: int, k: int, e: int, bm: int, bn: int, bk: int, grid: int) -> str:
    import tilelang.ascend.language as T

    fp8, kb, n_tiles = "float8_e4m3fn", bk // 32, n // bn
    x_steps, w_steps = bm * bk // _THREADS, bn * bk // 2 // _THREADS

    @T.prim_func
    def grouped_gemm_fp4(X: T.Tensor((mtot, k), fp8), SX: T.Tensor((mtot, k // 32), T.uint8),
                         W: T.Tensor((e, n, k // 2), T.uint8), SW: T.Tensor((e, n, k // 32), T.uint8),
                         offsets: T.Tensor((e + 1,), T.int32), C: T.Tensor((mtot, n), T.bfloat16)):
        with T.Kernel(grid) as core:
            x_ub = T.alloc_shared((bm, bk), fp8)
            sx_ub = T.alloc_shared((bm, kb), T.uint8)
            w_ub = T.alloc_shared((bn, bk // 2), T.uint8)
            sw_ub = T.alloc_shared((bn, kb), T.uint8)
            xb_ub = T.alloc_shared((bm, bk), T.bfloat16)
            wb_ub = T.alloc_shared((bn, bk), T.bfloat16)
            c_ub = T.alloc_shared((bm, bn), T.bfloat16)
            a_l1 = T.alloc_l1((bm, bk), T.bfloat16)
            b_l1 = T.alloc_l1((bn, bk), T.bfloat16)
            acc = T.alloc_l0c((bm, bn), T.float32)
            for unit in T.Persistent([e * n_tiles], grid, core):
                ex = unit // n_tiles
                n0 = unit % n_tiles * bn
                start = offsets[ex]
                rows = offsets[ex + 1] - start
                for mt in T.serial(T.ceildiv(rows, bm)):
                    r0 = start + mt * bm
                    for kt in T.serial(k // bk):
                        T.copy(X[r0, kt * bk], x_ub)
                        T.copy(SX[r0, kt * kb], sx_ub)
                        T.copy(W[ex, n0, kt * (bk // 2)], w_ub)
                        T.copy(SW[ex, n0, kt * kb], sw_ub)
                        # one element per thread and step: TileLang-Ascend's SIMT vectoriser has no
                        # uint8 vector type, so the byte loads stay scalar
                        with T.SimtVF(threads=_THREADS):
                            tid = T.get_thread_binding()
                            for s in T.serial(x_steps):
                                i = (s * _THREADS + tid) // bk
                                j = (s * _THREADS + tid) % bk
                                xb_ub[i, j] = T.cast(T.cast(x_ub[i, j], T.float32) * e8m0_f32(T, sx_ub[i, j // 32]),
                                                     T.bfloat16)
                        with T.SimtVF(threads=_THREADS):
                            tid = T.get_thread_binding()
                            for s in T.serial(w_steps):
                                i = (s * _THREADS + tid) // (bk // 2)
                                jj = (s * _THREADS + tid) % (bk // 2)
                                byte = T.Cast("int32", w_ub[i, jj])
                                scale = e8m0_f32(T, sw_ub[i, jj // 16])
                                for h in T.serial(2):  # low nibble = even element
                                    wb_ub[i, jj * 2 + h] = T.cast(
                                        e2m1_f32(T, T.bitwise_and(T.shift_right(byte, h * 4), 15)) * scale, T.bfloat16)
                        T.copy(xb_ub, a_l1)
                        T.copy(wb_ub, b_l1)
                        T.gemm(a_l1, b_l1, acc, transpose_B=True, clear_accum=(kt == 0))
                    T.copy(acc, c_ub)
                    with T.SimtVF(threads=_THREADS):
                        for i, j in T.Parallel(bm, bn):
                            if mt * bm + i < rows:
                                C[r0 + i, n0 + j] = c_ub[i, j]

    return lower_ascend(grouped_gemm_fp4)


def _fp4_dims(spec: KernelSpec):
    x, w = spec.in_types[0].data, spec.in_types[1].data
    return x.shape[0], w.shape[1], w.shape[2], w.shape[0]


def _fp4_supports(target, spec: KernelSpec) -> bool:
    x, w = spec.in_types[:2]
    if getattr(x, "block", None) != (1, 32) or getattr(w, "block", None) != (1, 1, 32):
        return False
    if not all(isinstance(d, int) for t in (x.data, w.data) for d in t.shape):
        return False
    m, n, k, _ = _fp4_dims(spec)
    # 32-byte GM rows: K fp8 bytes, K/2 packed fp4 bytes; the K/32-byte scale rows go GM -> UB by
    # the padding DMA (byte-granular bursts), so they need no granule
    return n % 64 == 0 and k % 128 == 0


def _fp4_default_config(target, spec: KernelSpec) -> dict:
    m, n, k, e = _fp4_dims(spec)
    bn = 128 if n % 128 == 0 else 64
    # decode (under ~2 rows per expert): 16-row tiles, prefill: 64-row tiles
    return {"block_M": 16 if m <= 2 * e else 64, "block_N": bn, "block_K": 128}


def _fp4_render(target, spec: KernelSpec, config) -> KernelSource:
    m, n, k, e = _fp4_dims(spec)
    c = {**_fp4_default_config(target, spec), **(config or {})}
    p = grouped_plan("fp4", m, n, k, e * (n // c["block_N"]), c, target.cores)
    text = _fp4_source(m, n, k, e, p["block_M"], c["block_N"], c["block_K"], p["grid"])
    return KernelSource(language="ascendc", entry="grouped_gemm_fp4_kernel", text=text, grid=(p["grid"],),
                        block=(_THREADS,), meta={"buffers": p["buffers"], "config": c,
                                                 "gm_row_bytes": [k, k // 2, n * 2]})


register(Template(
    name="ascend_grouped_gemm_fp4", ops=("grouped_gemm_fp4",), targets=building("ascendc"),
    knobs={"block_M": (16, 32, 64, 128), "block_N": (64, 128, 256), "block_K": (64, 128, 256)},
    render=_fp4_render, default_config=_fp4_default_config, supports=_fp4_supports))


# ---- grouped_linear -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _grouped_linear_source(m: int, groups: int, ng: int, kg: int, bm: int, bn: int, bk: int, grid: int) -> str:
    import tilelang.ascend.language as T

    fp8 = "float8_e4m3fn"
    m_tiles, n_tiles = -(-m // bm), ng // bn
    units = m_tiles * groups * n_tiles
    w_steps = bn * bk // _THREADS
    sb_rows = -(-bn // 32)

    @T.prim_func
    def grouped_linear(X: T.Tensor((m, groups * kg), T.bfloat16), W: T.Tensor((groups * ng, kg), fp8),
                       SW: T.Tensor((groups * ng // 32, kg // 32), T.uint8), C: T.Tensor((m, groups * ng), T.bfloat16)):
        with T.Kernel(grid) as core:
            w_ub = T.alloc_shared((bn, bk), fp8)
            sw_ub = T.alloc_shared((sb_rows, bk // 32), T.uint8)
            wb_ub = T.alloc_shared((bn, bk), T.bfloat16)
            a_l1 = T.alloc_l1((bm, bk), T.bfloat16)
            b_l1 = T.alloc_l1((bn, bk), T.bfloat16)
            acc = T.alloc_l0c((bm, bn), T.float32)
            for unit in T.Persistent([units], grid, core):
                m0 = unit // (groups * n_tiles) * bm
                g = unit // n_tiles % groups
                w0 = g * ng + unit % n_tiles * bn  # weight row = output column
                for kt in T.serial(kg // bk):
                    T.copy(X[m0, g * kg + kt * bk], a_l1)
                    T.copy(W[w0, kt * bk], w_ub)
                    T.copy(SW[w0 // 32, kt * (bk // 32)], sw_ub)
                    with T.SimtVF(threads=_THREADS):
                        tid = T.get_thread_binding()
                        for s in T.serial(w_steps):
                            i = (s * _THREADS + tid) // bk
                            j = (s * _THREADS + tid) % bk
                            wb_ub[i, j] = T.cast(T.cast(w_ub[i, j], T.float32) * e8m0_f32(T, sw_ub[i // 32, j // 32]),
                                                 T.bfloat16)
                    T.copy(wb_ub, b_l1)
                    T.gemm(a_l1, b_l1, acc, transpose_B=True, clear_accum=(kt == 0))
                T.copy(acc, C[m0, w0])

    return lower_ascend(grouped_linear)


def _gl_dims(spec: KernelSpec):
    x, w = spec.in_types[0], spec.in_types[1].data
    m = 1
    for d in x.shape[:-1]:
        m *= d
    g = dict(spec.attrs)["groups"]
    return m, g, w.shape[0] // g, w.shape[1]


def _gl_supports(target, spec: KernelSpec) -> bool:
    x, w = spec.in_types
    if getattr(w, "block", None) != (32, 32) or w.dtype.name != "fp8e4m3" or x.dtype.name != "bf16":
        return False
    if dict(spec.attrs).get("weight_dtype") != "bf16" or spec.out_types[0].dtype.name != "bf16":
        return False
    if not all(isinstance(d, int) for t in (x, w.data) for d in t.shape):
        return False
    _, g, ng, kg = _gl_dims(spec)
    # 32-byte GM rows: bf16 inputs (straight to L1), fp8 weight rows; scale rows as in grouped_gemm_fp4
    return ng % 64 == 0 and kg % 128 == 0


def _gl_default_config(target, spec: KernelSpec) -> dict:
    m, g, ng, _ = _gl_dims(spec)
    bn = 128 if ng % 128 == 0 else 64
    return {"block_M": 16 if m <= 64 else 128, "block_N": bn, "block_K": 128}


def _gl_render(target, spec: KernelSpec, config) -> KernelSource:
    m, g, ng, kg = _gl_dims(spec)
    c = {**_gl_default_config(target, spec), **(config or {})}
    bm = min(c["block_M"], -(-m // 16) * 16)
    p = grouped_plan("linear", m, ng, kg, -(-m // bm) * g * (ng // c["block_N"]), c, target.cores)
    text = _grouped_linear_source(m, g, ng, kg, p["block_M"], c["block_N"], c["block_K"], p["grid"])
    return KernelSource(language="ascendc", entry="grouped_linear_kernel", text=text, grid=(p["grid"],),
                        block=(_THREADS,), meta={"buffers": p["buffers"], "config": c,
                                                 "gm_row_bytes": [g * kg * 2, kg, g * ng * 2]})


register(Template(
    name="ascend_grouped_linear", ops=("grouped_linear",), targets=building("ascendc"),
    knobs={"block_M": (16, 64, 128), "block_N": (64, 128, 256), "block_K": (64, 128, 256)},
    render=_gl_render, default_config=_gl_default_config, supports=_gl_supports))
