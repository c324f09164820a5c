"""The prefill sparse attention with its roles apart (codegen/library/tilelang_sparse_prefill.py):
its widening held to the ops' dequantisation on the host twins, and its render and build on the
CPU (a target default, on in sm90's: timed and checked in the medium plan on an H100)."""
import dataclasses
import shutil

import torch

import pytest

from deepinfer.codegen.library import tilelang_sparse_prefill as sp
from deepinfer.ir import dtypes as dt
from deepinfer.ir.quant import QTensor, dequant_fp4_e4m3, dequant_fp8_32


def test_fp4_words_widen_to_the_ops_values_in_code_order():
    """Every e2m1 code in every slot of a word, times e4m3 scales from the smallest subnormal to
    448: the twin of deepinfer_fp4x8_bf16n (the same shifts and masks) equals the op's
    dequantisation exactly, in code order (the byte permutes undo the pairs' order)."""
    codes = torch.stack([torch.roll(torch.arange(16), k) for k in range(16)])  # [16 rows, 16 codes]
    packed = dt.fp4_pack(codes)  # [16, 8] bytes: two codes a byte, low nibble first
    byts = torch.tensor([0x01, 0x07, 0x08, 0x30, 0x38, 0x3F, 0x40, 0x55, 0x77, 0x7E, 0xB8, 0xFE] + [0x38] * 4,
                        dtype=torch.uint8)
    scales = byts.view(torch.float8_e4m3fn).view(16, 1)
    ref = dequant_fp4_e4m3(QTensor(packed, scales), block=16).double()
    words = packed.view(torch.int32)  # [16, 2]
    got = sp.fp4_words_to_bf16n(words, scales.float().expand(16, 2)).flatten(1)
    assert torch.equal(got, ref)
    # the device code is generated from the same shifts and masks
    pre = sp.widen_prelude()
    assert "unsigned r0 = ((w << 6u) & 0x01c001c0u) | ((w << 12u) & 0x80008000u);" in pre
    assert "unsigned r3 = ((w >> 6u) & 0x01c001c0u) | (w & 0x80008000u);" in pre


def test_fp8_words_widen_to_the_ops_values_after_one_rounding():
    """Every finite e4m3 byte times 2^(s - 127) for ue8m0 scales from 1 to 200: the twin of
    deepinfer_fp8x8_bf16n (bytes placed in bf16's bits, times 2^120, times the scale) rounded to
    bf16 equals the op's fp32 dequantisation rounded to bf16 (what the single-role program stores)."""
    vals = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN
    vals = torch.cat([vals, vals[:2]])  # 256 bytes: 64 words
    for s in (1, 5, 7, 8, 100, 127, 134, 140, 200):
        data = vals.view(torch.float8_e4m3fn).view(8, 32)
        scale = torch.full((8, 1), s, dtype=torch.uint8)
        ref = dequant_fp8_32(QTensor(data, scale)).to(torch.bfloat16)
        words = vals.view(torch.int32).view(8, 8)
        got = sp.fp8_words_to_bf16n(words, scale.expand(8, 8).to(torch.int64)).flatten(1)
        assert torch.equal(got.to(torch.bfloat16), ref), s


pytest.importorskip("tilelang")


def _spec(n, rope=0):
    from deepinfer.codegen.template import KernelSpec
    from deepinfer.ir.types import quantized, tensor

    attrs = (("ratio", 2), ("topk", 512), ("window", 128))
    if rope:
        attrs = tuple(sorted(dict(attrs, rope_dim=rope, rope_theta=10000.0, rope_yarn=(16, 65536, 32, 1)).items()))
    return KernelSpec(
        "sparse_attn", attrs,
        (tensor("bf16", n, 64, 512), quantized("fp8e4m3", (n, 512), "e8m0", (1, 32)),
         quantized("fp8e4m3", (1, 134, 512), "e8m0", (1, 1, 32)),
         quantized("fp4e2m1", (64, 64, 512), "fp8e4m3", (1, 1, 16)), tensor("i32", n, 512), tensor("f32", 64),
         tensor("i64", n), tensor("i32", n), tensor("i32", 1), tensor("i32", 1, 64)),
        (tensor("bf16", n, 64, 512),))


def test_prefill_calls_take_it_where_a_target_enables_it_and_it_builds():
    """`prefill_ws` in a target's tilelang_attention defaults: unsplit sparse calls render the
    program with its roles apart (384 threads: two consumer warpgroups and a producer, their
    registers moved by setmaxnreg, four mbarrier kinds), split decode calls keep theirs; sm90's
    defaults set it. It builds for sm_90a without spills, in one SM's shared memory."""
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select

    on = get_target("sm90")
    assert on.defaults["tilelang_attention"]["prefill_ws"] == 1
    off = dataclasses.replace(on, defaults=dict(on.defaults, tilelang_attention=dict(
        on.defaults["tilelang_attention"], prefill_ws=0)))
    prefill, decode = _spec(4096, rope=64), _spec(64)
    tpl = select(on, prefill)
    assert "ws" not in tpl.default_config(off, prefill)
    assert tpl.default_config(on, decode) == tpl.default_config(off, decode)
    cfg = tpl.default_config(on, prefill)
    assert cfg["ws"] == 1 and cfg["splits"] == 1
    src = tpl.render(on, prefill, cfg)
    assert src.block[0] == 384 and src.grid[0] == 4096
    for s in ("warpgroup_reg_alloc<232>", "warpgroup_reg_dealloc<104>", "k_ready", "k_free", "s_ready", "s_free",
              "deepinfer_fp4x8_bf16n(", "deepinfer_fp8x8_bf16n(", "__cosf"):
        assert s in src.text, s
    # Q's two halves (64 KB), the ring of two stages of two 64 x 256 bf16 tiles (128 KB), P (8 KB)
    assert 200 * 1024 < src.smem_bytes <= on.smem_bytes
    if shutil.which("nvcc"):
        from deepinfer.codegen.library.tilelang_gemm import nvcc_report

        rep = nvcc_report(src.text, on.arch)
        assert rep["ok"], rep["log"]
        assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]
