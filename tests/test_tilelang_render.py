"""TileLang templates render on the CPU for sm90/sm100 through the registry, and their sm90 builds
have the instructions they are meant to use and no register spills (ptxas report)."""
import shutil

import pytest

pytest.importorskip("tilelang")

from deepinfer.codegen.targets import get_target  # noqa: E402
from deepinfer.codegen.template import KernelSpec, select, templates  # noqa: E402
from deepinfer.ir.types import quantized, tensor  # noqa: E402


def gemm_spec(m, n, k):
    return KernelSpec("gemm_fp8", (("out_dtype", "bf16"),),
                      (quantized("fp8e4m3", (m, k), "e8m0", (1, 32)), quantized("fp8e4m3", (n, k), "e8m0", (32, 32))),
                      (tensor("bf16", m, n),))


def attn_spec(n, slots=64, pages=512, maxp=16):
    return KernelSpec(
        "sparse_attn", (("ratio", 2), ("topk", 512), ("window", 128)),
        (tensor("bf16", n, 64, 512), quantized("fp8e4m3", (n, 512), "e8m0", (1, 32)),
         quantized("fp8e4m3", (slots, 134, 512), "e8m0", (1, 1, 32)),
         quantized("fp4e2m1", (pages, 64, 512), "fp8e4m3", (1, 1, 16)), tensor("i32", n, 512), tensor("f32", 64),
         tensor("i64", n), tensor("i32", n), tensor("i32", slots), tensor("i32", slots, maxp)),
        (tensor("bf16", n, 64, 512),))


def test_registered():
    names = set(templates())
    assert {"tilelang_gemm_fp8", "tilelang_linear", "tilelang_grouped_gemm_fp4", "tilelang_sparse_attn",
            "tilelang_window_attn", "tilelang_dspark_block_attn", "tilelang_indexer_scores"} <= names


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_gemm_fp8_renders(target):
    t = get_target(target)
    spec = gemm_spec(64, 1280, 5120)
    tpl = select(t, spec)
    assert tpl.name == "tilelang_gemm_fp8"
    src = tpl.render(t, spec, tpl.default_config(t, spec))
    assert src.language == "cuda" and src.entry and src.grid[2] == tpl.default_config(t, spec)["split_k"]
    assert ("wgmma" in src.text) == (target == "sm90")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_sm90_builds_without_spills():
    from deepinfer.codegen.library.tilelang_gemm import nvcc_report

    t = get_target("sm90")
    for spec in (gemm_spec(64, 1280, 5120), attn_spec(64)):
        tpl = select(t, spec)
        src = tpl.render(t, spec, tpl.default_config(t, spec))
        assert "wgmma" in src.text
        rep = nvcc_report(src.text, t.arch)
        assert rep["ok"], rep["log"]
        assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]
