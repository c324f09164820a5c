"""The decode fp8 GEMM on warp MMAs (codegen/library/tilelang_gemm_decode.py): sm90's calls of at
most 8 rows take it (wider ones the wgmma program), sharing one 8-row instance; it renders and
builds for sm_90a without spills at the medium plan's lin8 widths, and its host is the TileLang
decode GEMM's (the row count an argument, split partials added in order by the combine kernel).
(On the GPU: tests/gpu/test_tilelang_kernels.py.)"""
import dataclasses
import shutil

import pytest
import torch

from deepinfer.codegen.targets import get_target
from deepinfer.codegen.template import KernelSpec, select, templates
from deepinfer.ir.types import quantized, tensor

KNOBS = {"RT": 2, "WK": 4, "KU": 2, "STAGES": 3, "NT": 1, "CTAS": 4}


def gemm_spec(m, n, k):
    return KernelSpec("gemm_fp8", (("out_dtype", "bf16"),),
                      (quantized("fp8e4m3", (m, k), "e8m0", (1, 32)), quantized("fp8e4m3", (n, k), "e8m0", (32, 32))),
                      (tensor("bf16", m, n),))


def enabled(**knobs):
    t = get_target("sm90")
    return dataclasses.replace(t, defaults=dict(t.defaults, tilelang_gemm_fp8_mma=dict(KNOBS, **knobs)))


def test_sm90_takes_it_up_to_one_pass_of_rows():
    tpl, t = templates()["tilelang_gemm_fp8_mma"], get_target("sm90")
    assert tpl.targets == ("sm90",) and t.defaults["tilelang_gemm_fp8_mma"] == KNOBS
    for m in (1, 5, 8):
        assert select(t, gemm_spec(m, 5120, 8192)).name == "tilelang_gemm_fp8_mma"
        assert tpl.canonical(t, gemm_spec(m, 5120, 8192)) == gemm_spec(8, 5120, 8192)
    for m in (9, 64):
        assert select(t, gemm_spec(m, 5120, 8192)).name == "tilelang_gemm_fp8"
    assert select(t, gemm_spec(4096, 5120, 8192)).name == "tilelang_gemm_fp8_bf16"  # prefill rows
    assert select(get_target("sm100"), gemm_spec(1, 5120, 8192)).name == "tilelang_gemm_fp8"
    assert not tpl.supports(t, gemm_spec(1, 5120 + 32, 8192))  # N off the combine's 256 columns
    wide = enabled(NT=2)  # a pass of two tiles serves 16 rows
    assert tpl.supports(wide, gemm_spec(16, 5120, 8192)) and not tpl.supports(wide, gemm_spec(17, 5120, 8192))
    assert tpl.canonical(wide, gemm_spec(3, 5120, 8192)) == gemm_spec(16, 5120, 8192)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_split_is_the_largest_within_the_ctas_per_sm():
    from deepinfer.codegen.library.tilelang_gemm_decode import mma_config

    t = get_target("sm90")
    for (n, k), want in {(512, 5120): 20, (32768, 1280): 1, (5120, 8192): 2, (2304, 5120): 5}.items():
        c = mma_config(t, n, k)
        assert "CTAS" not in c and c["split_k"] == want, (n, k, c)
        tiles, steps = n // 32, k // 128  # 32-row CTAs, 4 warps of 32-deep blocks
        assert steps % want == 0 and (want == 1 or tiles * want <= 4 * t.cores)
        assert not any(steps % s == 0 and tiles * s <= 4 * t.cores for s in range(want + 1, 65))
    assert mma_config(t, 512, 5120, {"CTAS": 2})["split_k"] == 10  # 160 CTAs, where 20 would be 320
    assert mma_config(t, 512, 5120, {"split_k": 4})["split_k"] == 4


@pytest.mark.parametrize("over", [{}, {"F16": 1}])
def test_renders_and_builds_without_spills(over):
    pytest.importorskip("tilelang")
    from deepinfer.codegen.library.tilelang_gemm import nvcc_report

    t, tpl = enabled(), templates()["tilelang_gemm_fp8_mma"]
    for n, k in ((5120, 8192), (1280, 5120), (32768, 1280)):
        spec = tpl.canonical(t, gemm_spec(1, n, k))
        cfg = dict(tpl.default_config(t, spec), **over)
        src = tpl.render(t, spec, cfg)
        assert src.grid == (n // 32, cfg["split_k"], 1) and src.block == (128, 1, 1)
        if over:  # f16 MMAs on pairs converted by the prelude's functions (tilelang_warp_mma)
            assert "kFloat16, tl::DataType::kFloat16, tl::DataType::kFloat32, 16, 8, 16" in src.text
            assert "cvt.rn.f16x2.e4m3x2" in src.text
        else:
            assert "kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 16, 8, 32" in src.text
        assert "cp_async" in src.text and src.meta["rows_argument"]
        assert ("combine" in src.meta) == (cfg["split_k"] > 1)
        if cfg["split_k"] > 1:  # the combine adds the instance's 8 rows of partials, not 64
            assert tuple(src.meta["combine"]["grid"]) == (n // 256, 1, 1)
        assert [p for p, _ in src.meta["params"]] == ["A", "B", "C", "SA", "SB", "m"]
        for text in [src.text] + ([src.meta["combine"]["text"]] if "combine" in src.meta else []):
            rep = nvcc_report(text, t.arch)
            assert rep["ok"], rep["log"]
            assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]


def _recorded_launches(config: dict, params: tuple, grid: list, template: str = "tilelang_gemm_fp8_mma",
                       rows: int = 8, **meta) -> list[dict]:
    """The launches `template`'s host records for a 3-row call of the 1280 x 5120 lin8 (an
    instance of `rows` rows)."""
    from deepinfer.codegen.host_recipe import record_tilelang
    from deepinfer.ir.quant import QTensor

    meta = {"params": [[n, "void*"] for n in params] + [["m", "int32_t"]], "rows_argument": True,
            "mnk": (rows, 1280, 5120), **meta}
    kernel = {"template": template, "config": config, "meta": meta, "grid": grid, "language": "cuda"}
    with torch.device("meta"):
        x = QTensor(torch.empty(3, 5120, dtype=torch.float8_e4m3fn), torch.empty(3, 160, dtype=torch.uint8))
        w = QTensor(torch.empty(1280, 5120, dtype=torch.float8_e4m3fn), torch.empty(40, 160, dtype=torch.uint8))
        rec, (out,) = record_tilelang(templates()[template].host, kernel, [x, w],
                                      {"out_dtype": "bf16"}, [False])
    assert tuple(out.shape) == (3, 1280)
    return [s for s in rec["steps"] if "launch" in s]


def test_host_passes_the_rows_and_sums_the_splits():
    launches = _recorded_launches(
        dict(KNOBS, split_k=8), ("A", "B", "C", "SA", "SB"), [20, 8, 1],
        combine={"params": [["C", "void*"], ["P", "void*"], ["m", "int32_t"]], "grid": [5, 1, 1]})
    assert [s["launch"] for s in launches] == [0, 1] and [s["args"][-1] for s in launches] == [3, 3]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cluster_split_is_one_kernel_that_adds_the_partials():
    """CLUSTER: the split's CTAs form a thread-block cluster (declared in the source, so a plain
    launch honours it) whose first CTA adds the partials after a cluster barrier: no combine."""
    pytest.importorskip("tilelang")
    from deepinfer.codegen.library.tilelang_gemm import nvcc_report

    t, tpl = enabled(CLUSTER=1), templates()["tilelang_gemm_fp8_mma"]
    spec = tpl.canonical(t, gemm_spec(1, 1280, 5120))
    cfg = tpl.default_config(t, spec)
    assert cfg["split_k"] == 8  # a portable cluster's most (20 without one)
    src = tpl.render(t, spec, cfg)
    assert "combine" not in src.meta and src.grid == (40, 8, 1)
    assert src.text.count("__cluster_dims__(1, 8, 1)") == 2 and "tl::cluster_sync()" in src.text
    assert [p for p, _ in src.meta["params"]] == ["A", "B", "C", "P", "SA", "SB", "m"]
    rep = nvcc_report(src.text, t.arch)
    assert rep["ok"] and rep["spill_bytes"] == 0, rep["log"]


def test_cluster_host_launches_once():
    launches = _recorded_launches(dict(KNOBS, split_k=8, CLUSTER=1), ("A", "B", "C", "P", "SA", "SB"), [40, 8, 1])
    assert [s["launch"] for s in launches] == [0] and launches[0]["args"][-1] == 3


# ---- the persistent-grid program for 9 to 64 rows (off unless a target's defaults carry it) ----

MEDIUM_LIN8 = ((1280, 5120), (32768, 1280), (512, 5120), (5120, 8192), (4608, 5120), (5120, 2304), (4096, 1280),
               (25600, 6144), (5120, 15360))


def persistent_on():
    t = get_target("sm90")
    return dataclasses.replace(t, defaults=dict(t.defaults, tilelang_gemm_fp8_persistent={}))


def test_persistent_is_off_by_default_and_takes_what_warp_mmas_leave_when_on():
    t, on = get_target("sm90"), persistent_on()
    assert "tilelang_gemm_fp8_persistent" not in t.defaults
    for m, off_name, on_name in ((1, "tilelang_gemm_fp8_mma", "tilelang_gemm_fp8_mma"),
                                 (9, "tilelang_gemm_fp8", "tilelang_gemm_fp8_persistent"),
                                 (64, "tilelang_gemm_fp8", "tilelang_gemm_fp8_persistent"),
                                 (65, "tilelang_gemm_fp8", "tilelang_gemm_fp8")):
        assert select(t, gemm_spec(m, 5120, 8192)).name == off_name, m
        assert select(on, gemm_spec(m, 5120, 8192)).name == on_name, m
    tpl = templates()["tilelang_gemm_fp8_persistent"]
    assert tpl.canonical(on, gemm_spec(9, 5120, 8192)) == gemm_spec(64, 5120, 8192)


def test_persistent_config_is_one_wave_within_shared_memory():
    """Every medium lin8 shape gets a config: its CTAs fit the SMs at most two an SM in one
    wave, its shared memory fits, its x range is at most 96 KB, and knobs given are kept."""
    from deepinfer.codegen.library.tilelang_gemm_decode import persistent_config, persistent_smem

    on = persistent_on()
    for n, k in MEDIUM_LIN8:
        c = persistent_config(on, n, k)
        assert c is not None, (n, k)
        tiles, steps = n // c["block_N"], k // c["block_K"]
        assert tiles % c["group"] == 0 and steps % c["split_k"] == 0
        per_sm = min((228 << 10) // (persistent_smem(k, c) + 1024), 2)
        assert per_sm >= 1 and tiles // c["group"] * c["split_k"] <= per_sm * on.cores, (n, k, c)
        assert persistent_smem(k, c) <= on.smem_bytes
        assert 64 * (k // c["split_k"]) <= 96 << 10
    c = persistent_config(on, 32768, 1280, {"stages": 3, "block_N": 128, "unknown": 1})
    assert c["stages"] == 3 and c["block_N"] == 128 and "unknown" not in c
    assert persistent_config(on, 32768, 1280, {"split_k": 3}) is None  # 10 K steps: no whole split


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_persistent_renders_and_builds_without_spills():
    pytest.importorskip("tilelang")
    from deepinfer.codegen.library.tilelang_gemm import nvcc_report

    on, tpl = persistent_on(), templates()["tilelang_gemm_fp8_persistent"]
    for n, k in ((32768, 1280), (5120, 8192)):
        spec = tpl.canonical(on, gemm_spec(16, n, k))
        cfg = tpl.default_config(on, spec)
        src = tpl.render(on, spec, cfg)
        assert src.grid == (n // cfg["block_N"] // cfg["group"], cfg["split_k"], 1) and src.block == (128, 1, 1)
        assert src.meta["rows_argument"] and ("combine" in src.meta) == (cfg["split_k"] > 1)
        assert [p for p, _ in src.meta["params"]] == ["A", "B", "C", "SA", "SB", "m"]
        assert "wgmma_ss" in src.text and "cp_async" in src.text
        from deepinfer.codegen.library.tilelang_gemm_decode import persistent_smem

        assert src.smem_bytes <= persistent_smem(k, cfg) <= on.smem_bytes  # the config search's model bounds it
        for text in [src.text] + ([src.meta["combine"]["text"]] if "combine" in src.meta else []):
            rep = nvcc_report(text, on.arch)
            assert rep["ok"], rep["log"]
            assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]


def test_persistent_host_passes_the_rows_and_sums_the_splits():
    launches = _recorded_launches(
        {"split_k": 8}, ("A", "B", "C", "SA", "SB"), [20, 8, 1], template="tilelang_gemm_fp8_persistent", rows=64,
        combine={"params": [["C", "void*"], ["P", "void*"], ["m", "int32_t"]], "grid": [5, 8, 1]})
    assert [s["launch"] for s in launches] == [0, 1] and [s["args"][-1] for s in launches] == [3, 3]
