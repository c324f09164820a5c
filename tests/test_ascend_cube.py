"""ascend950 cube-core templates for the grouped MoE GEMMs, grouped_linear, the gemm_fp8 shapes the
MX template declines, and sparse / window / DSpark block attention: selection, rendered AscendC
structure (the cube MMA, the GM tensors read and written), and the buffer plans against the
capacity check. TileLang-Ascend cannot execute here, so these are rendering tests: nothing is run,
nothing numerical is verified."""
import re

import pytest

from deepinfer.codegen.library.ascend_attention import attention_plan
from deepinfer.codegen.library.ascend_common import SIMT_CONTEXT_BYTES
from deepinfer.codegen.library.ascend_gemm import dequant_plan
from deepinfer.codegen.library.ascend_moe import grouped_plan
from deepinfer.codegen.library.tilelang_attention import attention_dims
from deepinfer.codegen.targets import TARGETS, get_manifest
from deepinfer.codegen.template import KernelSource, KernelSpec, select, templates
from deepinfer.ir.registry import get_op
from deepinfer.ir.types import quantized, tensor

TGT = TARGETS["ascend950"]
CHECK = get_manifest("ascend950").check


def spec(op, ins, attrs):
    a = get_op(op).check_attrs(attrs)
    return KernelSpec(op, tuple(sorted(a.items())), tuple(ins), tuple(get_op(op).infer_types(ins, a)))


def render(target, name, s):
    t = templates()[name]
    return t.render(target, s, t.default_config(target, s))


def plan_check(buffers, grid=1):
    return CHECK(KernelSource("ascendc", "k", "", grid=(grid,), meta={"buffers": buffers}), None)


def params(src):
    """Names of the kernel's GM parameters."""
    sig = re.search(r"__global__.*? void \w+\(([^)]*)\)", src.text).group(1)
    return {p.split("*")[-1].strip() for p in sig.split(",")}


def fp4_gemm(rows, experts, n, k):
    return spec("grouped_gemm_fp4", [quantized("fp8e4m3", (rows, k), "e8m0", (1, 32)),
                                     quantized("fp4e2m1", (experts, n, k), "e8m0", (1, 1, 32)),
                                     tensor("i32", experts + 1)], {})


def grouped_linear(rows, groups, n, k):
    return spec("grouped_linear", [tensor("bf16", rows, groups * k),
                                   quantized("fp8e4m3", (groups * n, k), "e8m0", (32, 32))],
                {"groups": groups, "weight_dtype": "bf16"})


def gemm_fp8(m, n, k):
    return spec("gemm_fp8", [quantized("fp8e4m3", (m, k), "e8m0", (1, 32)),
                             quantized("fp8e4m3", (n, k), "e8m0", (1, 32))], {"out_dtype": "bf16"})


def attention(op, n, d, window, *, topk=0, pages=4, page_entries=64, seqs=None, heads=64):
    seqs = seqs or n
    q, kv = tensor("bf16", n, heads, d), quantized("fp8e4m3", (n, d), "e8m0", (1, 32))
    ring = quantized("fp8e4m3", (seqs + 1, window + 6, d), "e8m0", (1, 1, 32))
    meta = [tensor("f32", heads), tensor("i64", n), tensor("i32", n), tensor("i32", seqs)]
    if op != "sparse_attn":
        return spec(op, [q, kv, ring] + meta, {"window": window})
    ckv = quantized("fp4e2m1", (pages, page_entries, d), "fp8e4m3", (1, 1, 16))
    return spec(op, [q, kv, ring, ckv, tensor("i32", n, topk)] + meta + [tensor("i32", seqs, 8)],
                {"window": window, "ratio": 2, "topk": topk})


def test_grouped_fp4_gemm_widens_both_operands_for_the_cube_mma():
    """Experts: per-expert row ranges read on the device, fp8 rows and fp4 weights dequantised to
    bf16 on the vector core, UB -> L1, cube MMA, and a store guarded to the expert's own rows."""
    s = fp4_gemm(32, 4, 128, 256)
    assert select(TGT, s).name == "ascend_grouped_gemm_fp4"
    src = render(TGT, "ascend_grouped_gemm_fp4", s)
    assert src.language == "ascendc" and "grouped_gemm_fp4_kernel" in src.text
    assert params(src) == {"X", "SX", "W", "SW", "offsets", "C"}
    assert "ascend_gemm_l1<" in src.text and "bfloat16_t>" in src.text  # the bf16 cube MMA
    assert src.text.count("asc_copy_ub2l1") == 2  # both widened tiles reach L1 from the UB
    assert re.search(r"offsets\[", src.text)  # expert row ranges come from the device
    assert re.search(r"< rows", src.text)  # the output store stops at the expert's last row
    assert "asc_copy_l0c2ub" in src.text and "asc_copy_l0c2gm" not in src.text
    assert CHECK(src, None) is None and src.grid == (4,)  # 4 experts x 1 N tile
    # the UB TileLang-Ascend keeps for SIMT thread contexts is part of the plan
    assert SIMT_CONTEXT_BYTES in src.meta["buffers"]["ub"]


def test_grouped_fp4_real_shapes_fit_and_oversized_tiles_fail():
    tmpl = templates()["ascend_grouped_gemm_fp4"]
    for rows, experts, n, k in ((6, 384, 5120, 2304), (24576, 384, 4608, 5120), (960, 128, 5120, 2304)):
        s = fp4_gemm(rows, experts, n, k)
        assert select(TGT, s).name == "ascend_grouped_gemm_fp4"
        c = tmpl.default_config(TGT, s)
        p = grouped_plan("fp4", rows, n, k, experts * (n // c["block_N"]), c, TGT.cores)
        assert plan_check(p["buffers"], p["grid"]) is None and p["grid"] == 64
    big = grouped_plan("fp4", 24576, 4608, 5120, 384, {"block_M": 128, "block_N": 256, "block_K": 256}, TGT.cores)
    assert "ub" in plan_check(big["buffers"])
    # K not a whole number of 128-deep tiles is declined (torch_device keeps it)
    assert not tmpl.supports(TGT, fp4_gemm(8, 4, 128, 160))


@pytest.mark.slow
def test_grouped_fp4_renders_at_a_real_decode_shape():
    src = render(TGT, "ascend_grouped_gemm_fp4", fp4_gemm(6, 384, 5120, 2304))
    assert CHECK(src, None) is None and src.grid == (64,) and "ascend_gemm_l1<16, " in src.text


def test_grouped_linear_dequantises_block_scaled_weights_into_l1():
    s = grouped_linear(4, 2, 128, 256)
    assert select(TGT, s).name == "ascend_grouped_linear"
    src = render(TGT, "ascend_grouped_linear", s)
    assert params(src) == {"X", "W", "SW", "C"}
    assert "asc_copy_gm2l1_nd2nz" in src.text  # bf16 input rows straight to L1
    assert "asc_copy_ub2l1" in src.text and "ascend_gemm_l1<" in src.text
    assert "asc_copy_l0c2gm" in src.text  # output tiles never overlap: the fixpipe stores them
    assert CHECK(src, None) is None and src.grid == (2,)  # 2 groups x 1 N tile
    tmpl = templates()["ascend_grouped_linear"]
    for rows in (1, 4096):
        real = grouped_linear(rows, 8, 1024, 4096)
        assert select(TGT, real).name == "ascend_grouped_linear"
        c = tmpl.default_config(TGT, real)
        bm = min(c["block_M"], -(-rows // 16) * 16)
        p = grouped_plan("linear", rows, 1024, 4096, -(-rows // bm) * 8 * (1024 // c["block_N"]), c, TGT.cores)
        assert plan_check(p["buffers"], p["grid"]) is None and p["grid"] == 64
    big = grouped_plan("linear", 4096, 1024, 4096, 64, {"block_M": 256, "block_N": 256, "block_K": 256}, 64)
    assert plan_check(big["buffers"]) is not None
    unscaled = KernelSpec(s.op, s.attrs, (s.in_types[0], tensor("bf16", 256, 256)), s.out_types)
    assert not tmpl.supports(TGT, unscaled)


def test_gemm_fp8_with_unaligned_scale_rows_takes_the_dequantising_gemm():
    """K = 1280 / 2304 give 40 / 72-byte scale rows, which the MX template's GM -> L1 scale load
    declines; those calls take the bf16-widening GEMM, the rest stay on the MX MMA."""
    assert select(TGT, gemm_fp8(64, 4096, 5120)).name == "ascend_gemm_mxfp8"
    for m, n, k in ((1, 32768, 1280), (4096, 5120, 2304)):
        s = gemm_fp8(m, n, k)
        assert select(TGT, s).name == "ascend_gemm_fp8_dequant"
        c = templates()["ascend_gemm_fp8_dequant"].default_config(TGT, s)
        p = dequant_plan(m, n, k, c, TGT.cores)
        assert plan_check(p["buffers"], p["grid"]) is None
    src = render(TGT, "ascend_gemm_fp8_dequant", gemm_fp8(16, 128, 1280))
    assert params(src) == {"A", "B", "SA", "SB", "C"}
    assert src.text.count("asc_copy_ub2l1") == 2 and "ascend_gemm_l1<" in src.text
    assert "gemm_blockscaled" not in src.text and CHECK(src, None) is None
    assert "ub" in plan_check(dequant_plan(4096, 4096, 1280, {"block_M": 256, "block_N": 256, "block_K": 256},
                                           64)["buffers"])


@pytest.mark.parametrize("op", ["sparse_attn", "window_attn", "dspark_block_attn"])
def test_attention_real_shapes_select_the_ascend_template_and_fit(op):
    tmpl = templates()[f"ascend_{op}"]
    mode = {"sparse_attn": "sparse", "window_attn": "window", "dspark_block_attn": "dspark"}[op]
    for n in (1, 4096):
        s = attention(op, n, 512, 128, topk=512, pages=1024, page_entries=128)
        assert select(TGT, s).name == f"ascend_{op}"
        p = attention_plan(mode, attention_dims(s), tmpl.default_config(TGT, s), TGT.cores)
        assert plan_check(p["buffers"], p["grid"]) is None and p["units"] == 4 * n  # 16-head groups
    # all 64 heads and 64-key blocks at D = 512 overflow one AIV's UB
    big = attention_plan(mode, attention_dims(s), {"heads": 64, "block_I": 64}, TGT.cores)
    assert "ub" in plan_check(big["buffers"])
    # a window that is not a whole number of key blocks is declined
    assert not tmpl.supports(TGT, attention(op, 2, 512, 48, topk=512, pages=1024, page_entries=128))


def test_sparse_attention_renders_gathers_two_cube_gemms_and_the_sink():
    s = attention("sparse_attn", 2, 128, 32, topk=16, pages=4, page_entries=64)
    assert select(TGT, s).name == "ascend_sparse_attn"
    src = render(TGT, "ascend_sparse_attn", s)
    assert {"Q", "KV", "KVS", "RING", "RINGS", "CKV", "CKVS", "TOP", "BT", "SINK", "O"} <= params(src)
    for gm in ("KV[", "RING[", "CKV[", "CKVS[", "TOP[", "BT[", "SINK["):
        assert gm in src.text, gm  # every key source is read
    assert re.search(r"asc_copy_ub2gm\w*\([^;]*O\[", src.text)  # the output rows are written
    # S = q K^T and O = P V: two cube GEMMs, fed by the K and K^T tiles the vector core writes
    assert len(re.findall(r"ascend_gemm_l1<", src.text)) == 2 and src.text.count("asc_copy_ub2l1") == 3
    assert "exp2" in src.text
    assert CHECK(src, None) is None and src.grid == (8,)  # 2 rows x 4 head groups
    assert SIMT_CONTEXT_BYTES in src.meta["buffers"]["ub"]


@pytest.mark.slow
@pytest.mark.parametrize("op", ["window_attn", "dspark_block_attn"])
def test_window_and_dspark_attention_render(op):
    src = render(TGT, f"ascend_{op}", attention(op, 2, 128, 32))
    assert "CKV[" not in src.text and "RING[" in src.text and "KV[" in src.text
    assert len(re.findall(r"ascend_gemm_l1<", src.text)) == 2 and CHECK(src, None) is None


def _fold(expr):
    """The value of a constant TIR expression as TVM's simplifier leaves it (products of fp32
    constants and bit reinterpretations of int32 constants)."""
    import struct

    from tilelang import tvm

    e = tvm.arith.Analyzer().simplify(expr)

    def ev(x):
        if isinstance(x, (tvm.tirx.FloatImm, tvm.tirx.IntImm)):
            return x.value
        if isinstance(x, tvm.tirx.Mul):
            return ev(x.a) * ev(x.b)
        if isinstance(x, tvm.tirx.Call) and x.op.name == "tirx.reinterpret":
            return struct.unpack("<f", struct.pack("<i", ev(x.args[0])))[0]
        raise AssertionError(f"unexpected term {x!r}")

    return ev(e)


def test_dequant_helpers_decode_every_fp4_code_and_e8m0_scale():
    """The widening arithmetic the vector prologues run (e2m1 code -> fp32, ue8m0 -> 2^(b-127)),
    folded to constants here and compared with the IR's fp4 table."""
    import tilelang.language as T
    from tilelang import tvm

    from deepinfer.codegen.library.ascend_common import e2m1_f32
    from deepinfer.codegen.library.tilelang_gemm import e8m0_f32
    import torch

    from deepinfer.ir.dtypes import fp4_decode

    table = fp4_decode(torch.arange(16)).tolist()
    got = [_fold(e2m1_f32(T, tvm.tirx.IntImm("int32", c))) for c in range(16)]
    assert got == table
    assert [_fold(e8m0_f32(T, tvm.tirx.IntImm("int32", b))) for b in (1, 120, 127, 130, 254)] == \
        [2.0 ** (b - 127) for b in (1, 120, 127, 130, 254)]
