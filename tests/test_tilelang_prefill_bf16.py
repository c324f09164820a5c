"""The prefill GEMMs on bf16 MMAs (codegen/library/tilelang_moe_prefill.py, the MoE experts';
tilelang_prefill_bf16.py, the fp8 linears'): which calls take them, that their programs render and
build for sm_90a without spills, and the MoE weight's widening on the host's twin of its device
code. Their numerics run on the GPU (bench/kernels_tilelang.py's `bf16` cases)."""
import dataclasses
import json
import re
import shutil

import pytest

from deepinfer.codegen.targets import get_target
from deepinfer.codegen.template import BATCH_INVARIANT, KernelSpec, select, templates
from deepinfer.ir.types import quantized, tensor

TILES = {"block_M": 128, "block_N": 128, "block_K": 128, "stages": 2, "threads": 256}


def moe_spec(rows, n=4608, k=5120, experts=96):
    return KernelSpec("grouped_gemm_fp4", (), (quantized("fp8e4m3", (rows, k), "e8m0", (1, 32)),
                                               quantized("fp4e2m1", (experts, n, k), "e8m0", (1, 1, 32)),
                                               tensor("i32", experts + 1)), (tensor("bf16", rows, n),))


def gemm_spec(m, n, k):
    return KernelSpec("gemm_fp8", (("out_dtype", "bf16"),),
                      (quantized("fp8e4m3", (m, k), "e8m0", (1, 32)), quantized("fp8e4m3", (n, k), "e8m0", (32, 32))),
                      (tensor("bf16", m, n),))


def enabled(tiles=TILES, key="tilelang_grouped_gemm_fp4_bf16"):
    sm90 = get_target("sm90")
    return dataclasses.replace(sm90, defaults=dict(sm90.defaults, **{key: dict(tiles)}))


def test_tiles_without_a_target_entry():
    """A template chosen into a plan by a variant build keeps a config where the code's target
    names no tiles (the tuner reads the code's target, not the plan's)."""
    from deepinfer.codegen.library import tilelang_moe_prefill as mp
    from deepinfer.codegen.library import tilelang_prefill_bf16 as pb
    from deepinfer.codegen.template import templates

    sm90 = get_target("sm90")
    bare = dataclasses.replace(sm90, defaults={k: v for k, v in sm90.defaults.items()
                                               if k not in ("tilelang_grouped_gemm_fp4_bf16", "tilelang_gemm_fp8_bf16")})
    assert templates()["tilelang_grouped_gemm_fp4_bf16"].default_config(bare, moe_spec(4096)) == mp.MOE_TILES
    assert templates()["tilelang_gemm_fp8_bf16"].default_config(bare, gemm_spec(4096, 5120, 8192)) == pb.ROWS_TILES
    # and a target that names them takes its own
    assert templates()["tilelang_gemm_fp8_bf16"].default_config(sm90, gemm_spec(4096, 5120, 8192))["inflight"] == 1


def test_widened_words_are_the_ops_dequantised_weight():
    """Every e2m1 code in every slot of a word, scales from 2^-127 to past 2^1 (the second factor):
    the device code's shifts, masks and factors (run on the host) give the op's values, in the
    order the rows' dequantisation writes x in."""
    import torch

    from deepinfer.codegen.library import tilelang_moe_prefill as mp
    from deepinfer.ir.quant import dequant_fp4_weight

    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (64, 4), generator=g, dtype=torch.uint8)
    packed[:16, 0] = torch.arange(16) * 17  # each code in both nibbles
    scales = torch.tensor([0, 1, 100, 127, 128, 129, 130, 140] * 8, dtype=torch.uint8)
    ref = dequant_fp4_weight(packed, scales[:, None], block=8).double()  # [64, 8] in K order
    words = packed.view(torch.int32)[:, 0]
    got = mp.fp4_words_to_bf16(words, scales)
    order = [mp.k_order_source(c) for c in range(8)]
    assert order == list(mp.K_ORDER) and [mp.k_order_source(c) for c in range(8, 16)] == [8 + c for c in mp.K_ORDER]
    assert torch.equal(got, ref[:, order])
    # rs's order: a permutation within 32 that gives lane q of a quad the codes of word q for
    # its A-fragment slots (2q, 2q + 1, 2q + 8, 2q + 9 of each 16-deep half), as pairs (i, i + 4)
    rs = [mp.rs_order_source(c) for c in range(64)]
    assert sorted(rs[:32]) == list(range(32)) and rs[32:] == [32 + c for c in rs[:32]]
    for q in range(4):
        slots = [h * 16 + e * 8 + 2 * q + b for h in (0, 1) for e in (0, 1) for b in (0, 1)]
        assert sorted(rs[s] for s in slots) == list(range(8 * q, 8 * q + 8))
        assert all(rs[s + 1] == rs[s] + 4 for s in slots[::2])  # the fragment's pair (k, k + 1): codes i, i + 4
    # the device code is generated from the same shifts and masks
    pre = mp.widen_prelude()
    assert "r[0] = ((w << 6u) & 0x01c001c0u) | ((w << 12u) & 0x80008000u);" in pre
    assert "r[3] = ((w >> 6u) & 0x01c001c0u) | (w & 0x80008000u);" in pre
    assert "i == 1u ? (((w << 2u) & 0x01c001c0u) | ((w << 8u) & 0x80008000u))" in pre


def test_prefill_calls_take_it_where_a_target_enables_it():
    sm90, on = get_target("sm90"), enabled()
    prefill = moe_spec(32 * 96 + 1)
    assert select(sm90, prefill).name == "tilelang_grouped_gemm_fp4_bf16"  # in sm90's defaults: on
    off = dataclasses.replace(sm90, defaults={k: v for k, v in sm90.defaults.items()
                                              if k != "tilelang_grouped_gemm_fp4_bf16"})
    assert select(off, prefill).name == "triton_grouped_gemm_fp4"
    assert select(on, prefill).name == "tilelang_grouped_gemm_fp4_bf16"
    # decode-sized calls stay on the warp-MMA decode program, registered first
    assert select(on, moe_spec(384)).name == "tilelang_grouped_gemm_fp4_mma"
    # N not a whole number of its tiles, or a batch-invariant plan: not taken
    assert select(on, moe_spec(32 * 96 + 1, n=4608 + 64)).name != "tilelang_grouped_gemm_fp4_bf16"
    inv = dataclasses.replace(on, features=on.features + (BATCH_INVARIANT,))
    assert select(inv, prefill).name != "tilelang_grouped_gemm_fp4_bf16"
    assert select(get_target("sm100"), prefill).name != "tilelang_grouped_gemm_fp4_bf16"


@pytest.mark.parametrize("over", [{}, {"block_M": 64, "threads": 128}, {"block_M": 256, "block_K": 64},
                                  {"rs": 1, "block_K": 64, "stages": 3},
                                  {"rs": 1, "inflight": 1, "block_M": 256, "block_K": 64, "stages": 4, "ragged": 64},
                                  {"rs": 1, "inflight": 1, "block_M": 128, "block_N": 256, "block_K": 64, "stages": 4,
                                   "threads": 512, "ragged": 64}])
def test_renders_and_builds_without_spills(over):
    pytest.importorskip("tilelang")
    t = enabled(dict(TILES, **over))
    for n, k in ((4608, 5120), (5120, 2304)):
        spec = moe_spec(4096 * 6, n=n, k=k, experts=384)
        tpl = select(t, spec)
        assert tpl.name == "tilelang_grouped_gemm_fp4_bf16"
        cfg = tpl.default_config(t, spec)
        src = tpl.render(t, spec, cfg)
        assert src.grid == (n // cfg["block_N"], 384, 1) and src.block == (cfg["threads"], 1, 1)
        # one bf16 wgmma chain over the whole K: no fp8 MMA, no per-slice promotion
        assert "kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32" in src.text
        assert "kFloat8_e4m3" not in src.text
        # the weight widened a word at a time, or a pair at a time into the register operand
        assert ("wgmma_rs" in src.text and "deepinfer_fp4_pair_bf16(" in src.text if over.get("rs")
                else "deepinfer_fp4x8_bf16(" in src.text)
        if over.get("inflight"):
            # a step waits for the step before it (the K loop's last step for its own MMAs); the
            # copies run two steps ahead, their wait leaving the next step's two groups in flight
            assert "tl::wait_wgmma<1>();" in src.text and "tl::cp_async_wait<2>();" in src.text
            # one program a width: 256, 192, 128, 64 rows (the MMA's N; sm90's ragged), each
            # warpgroup one m64 MMA of the weight rows
            widths = {int(w) for w in re.findall(r"kFloat32, 64, (\d+), 16,", src.text)}
            assert widths == set(range(64, cfg["block_M"] + 1, 64))
        assert {p for p, _ in src.meta["params"]} == {"C", "SW", "W", "X", "offsets"}
        # the rows come in bf16, dequantised (in the widened K order) by the second kernel
        dq = src.meta["combine"]
        assert [p for p, _ in dq["params"]] == ["A", "A8", "SA"]
        # built: the GEMM at w13's widths, the dequantisation once (nvcc is most of the suite's time here)
        builds = ([src.text] if n == 4608 else []) + ([dq["text"]] if n == 4608 and not over else [])
        if shutil.which("nvcc"):
            from deepinfer.codegen.library.tilelang_gemm import nvcc_report

            for text in builds:
                rep = nvcc_report(text, t.arch)
                assert rep["ok"], rep["log"]
                assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]


def sass_tool() -> str | None:
    """cuobjdump, with the nvdisasm it runs beside it: on PATH, or the test extra's
    nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels (nvidia/cu13/bin)."""
    import os

    try:
        import nvidia

        bins = [os.path.join(p, "cu13", "bin") for p in nvidia.__path__]
    except ImportError:
        bins = []
    path = os.pathsep.join(bins + [os.environ.get("PATH", "")])
    tool = shutil.which("cuobjdump", path=path)
    return tool if tool and shutil.which("nvdisasm", path=path) else None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")  # the plan's build
def test_inflight_epilogue_reads_the_accumulator_after_the_last_mmas(tmp_path):
    """The plan's build of gemm_fp8's inflight program (as the plan builds it: PDL, nvcc -O3): no
    accumulator conversion or store between the last HGMMA and the first wait for every MMA group
    after it. With the last step's MMAs left in flight across the loop's exit, ptxas put 34 of
    them there, and the 4K tiles lost their last K step on an H100 (thirty-seventh session)."""
    import os
    import subprocess

    pytest.importorskip("tilelang")
    tool = sass_tool()
    assert tool, "cuobjdump / nvdisasm missing: the test extra installs them (pyproject.toml)"
    from deepinfer.codegen.build import CompileCache, build_one

    t = enabled(dict(GEMM_TILES, block_K=64, stages=4, inflight=1), "tilelang_gemm_fp8_bf16")
    spec = gemm_spec(4096, 5120, 8192)
    tpl = select(t, spec)
    res = build_one(tpl.render(t, spec, tpl.default_config(t, spec)), t, CompileCache(tmp_path))
    assert res.status == "built", res.reason
    env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
    sass = subprocess.run([tool, "-sass", res.files["cubin"]], capture_output=True, text=True, env=env,
                          check=True).stdout
    ops = [ln.split(";")[0].split("*/")[-1].strip() for ln in sass.splitlines() if ";" in ln and "*/" in ln]
    ops = [o for o in ops if o]
    last = max(i for i, o in enumerate(ops) if "HGMMA" in o)
    wait = next(i for i in range(last, len(ops)) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in ops[i])
    early = [o for o in ops[last + 1:wait] if o.startswith(("F2FP", "STG"))]
    assert not early, early[:4]


def test_inflight_fits_pairs_of_steps_and_one_mma_a_warpgroup():
    from deepinfer.codegen.library.tilelang_prefill_bf16 import inflight_fits

    c = {"block_N": 128, "block_K": 64, "stages": 4, "threads": 256}
    assert inflight_fits(c, 8192) and inflight_fits(c, 1280) and inflight_fits(c, 128)
    assert not inflight_fits(c, 64 * 3)  # an odd number of steps
    assert not inflight_fits(dict(c, stages=2), 8192)  # no copy ahead of the step in flight
    assert not inflight_fits(dict(c, stages=6), 128)  # fewer steps than the copies issued ahead
    assert not inflight_fits(dict(c, block_N=256), 8192)  # two m64 MMAs a warpgroup
    assert inflight_fits(dict(c, block_N=256, threads=512), 8192)


def test_widened_e4m3_pairs_are_the_ops_dequantised_weight():
    """Every e4m3 byte (subnormals and both zeros included) in both pairs of a word, scales from
    2^-127 to past 2^7 (the second factor): the inflight linear's widening, run on the host from
    the device code's shifts, masks and factors, gives the byte times its scale; and the K order
    gives lane q of a quad its A-fragment slots from one word of the row."""
    import torch

    from deepinfer.codegen.library import tilelang_prefill_bf16 as pb

    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3's NaNs are never weights
    scales = torch.tensor([0, 1, 100, 120, 127, 128, 133, 134, 135, 150, 254], dtype=torch.int64)
    b = codes.repeat_interleave(len(scales)).to(torch.int64)
    sc = scales.repeat(len(codes))
    ref = b.to(torch.uint8).view(torch.float8_e4m3fn).double() * 2.0 ** (sc - 127).double()
    for h in (0, 1):
        for byte in (0, 1):
            words = b << (8 * (2 * h + byte))  # the byte at its place, the others zero
            assert torch.equal(pb.e4m3_pair_values(words, h, sc)[:, byte], ref), (h, byte)
    order = [pb.e4m3_rs_order(c) for c in range(32)]
    assert sorted(order[:16]) == list(range(16)) and order[16:] == [16 + c for c in order[:16]]
    for q in range(4):
        assert [order[s] for s in (2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9)] == [4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3]
    pre = pb.e4m3_prelude()
    assert "((t & 0x007F007Fu) << 4) | ((t & 0x00800080u) << 8)" in pre and "min(s, 134u) + 120u" in pre


GEMM_TILES = {"block_M": 128, "block_N": 128, "block_K": 128, "stages": 3, "threads": 256}


def test_prefill_linears_take_the_gemm_where_a_target_enables_it():
    on = enabled(GEMM_TILES, "tilelang_gemm_fp8_bf16")
    assert select(get_target("sm90"), gemm_spec(4096, 5120, 8192)).name == "tilelang_gemm_fp8_bf16"  # sm90 enables it
    sm90 = dataclasses.replace(on, defaults={k: v for k, v in on.defaults.items() if k != "tilelang_gemm_fp8_bf16"})
    assert select(sm90, gemm_spec(4096, 5120, 8192)).name == "tilelang_gemm_fp8"
    assert select(on, gemm_spec(4096, 5120, 8192)).name == "tilelang_gemm_fp8_bf16"
    for m in (1, 8, 64):  # decode rows keep their programs
        assert select(on, gemm_spec(m, 5120, 8192)).name == select(sm90, gemm_spec(m, 5120, 8192)).name
    assert select(on, gemm_spec(4096 + 32, 5120, 8192)).name != "tilelang_gemm_fp8_bf16"  # not whole tiles
    inv = dataclasses.replace(on, features=on.features + (BATCH_INVARIANT,))
    assert select(inv, gemm_spec(4096, 5120, 8192)).name != "tilelang_gemm_fp8_bf16"
    gated = enabled(dict(GEMM_TILES, min_rows=2048), "tilelang_gemm_fp8_bf16")
    assert select(gated, gemm_spec(1024, 5120, 8192)).name == select(sm90, gemm_spec(1024, 5120, 8192)).name
    assert select(gated, gemm_spec(2048, 5120, 8192)).name == "tilelang_gemm_fp8_bf16"


@pytest.mark.parametrize("over", [{}, {"block_K": 64, "stages": 4},
                                  {"block_K": 64, "stages": 4, "inflight": 1, "block_M": 256, "min_rows": 2048}])
def test_gemm_renders_and_builds_without_spills(over):
    pytest.importorskip("tilelang")
    t = enabled(dict(GEMM_TILES, **over), "tilelang_gemm_fp8_bf16")
    for n, k in ((5120, 8192), (32768, 1280)):
        spec = gemm_spec(4096, n, k)
        tpl = select(t, spec)
        cfg = tpl.default_config(t, spec)
        src = tpl.render(t, spec, cfg)
        assert src.grid == (n // 128, 4096 // over.get("block_M", 128), 1) and src.block == (256, 1, 1)
        assert "kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32" in src.text
        assert "kFloat8_e4m3" not in src.text
        if over.get("inflight"):  # the weight a pair at a time into the register operand, MMAs in flight
            assert "wgmma_rs" in src.text and "deepinfer_e4m3_pair_bf16(" in src.text
            assert "tl::wait_wgmma<1>();" in src.text and "tl::cp_async_wait<2>();" in src.text
        # the rows come in bf16, dequantised by the second kernel, which the build makes too
        assert [p for p, _ in src.meta["params"]] == ["C", "SW", "W", "X"]
        dq = src.meta["combine"]
        assert [p for p, _ in dq["params"]] == ["A", "A8", "SA"] and dq["grid"][0] * dq["grid"][1] > 132
        # built: the GEMM at w13's widths, the dequantisation once (nvcc is most of the suite's time here)
        builds = ([src.text] if n == 4608 or over.get("inflight") else []) + \
            ([dq["text"]] if n == 4608 and not over else [])
        if shutil.which("nvcc"):
            from deepinfer.codegen.library.tilelang_gemm import nvcc_report

            for text in builds:
                rep = nvcc_report(text, t.arch)
                assert rep["ok"], rep["log"]
                assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]


def wo_a_spec(m, groups=8, ng=1024, kg=4096):
    return KernelSpec("grouped_linear", (("groups", groups), ("weight_dtype", "bf16")),
                      (tensor("bf16", m, groups * kg), quantized("fp8e4m3", (groups * ng, kg), "e8m0", (32, 32))),
                      (tensor("bf16", m, groups * ng),))


LINEAR_TILES = {"block_M": 128, "block_N": 128, "block_K": 64, "stages": 4, "threads": 256}


def test_prefill_wo_a_takes_the_grouped_linear_where_a_target_enables_it():
    sm90, on = get_target("sm90"), enabled(LINEAR_TILES, "tilelang_grouped_linear_bf16")
    assert select(sm90, wo_a_spec(4096)).name == "tilelang_grouped_linear_bf16"  # on in sm90's defaults
    off = dataclasses.replace(sm90, defaults={k: v for k, v in sm90.defaults.items()
                                              if k != "tilelang_grouped_linear_bf16"})
    assert select(off, wo_a_spec(4096)).name == "triton_grouped_linear"
    assert select(on, wo_a_spec(4096)).name == "tilelang_grouped_linear_bf16"
    for m in (1, 8, 64):  # decode rows keep the row-tiled Triton kernel
        assert select(on, wo_a_spec(m)).name == "triton_grouped_linear"
    assert select(on, wo_a_spec(4096 + 32)).name != "tilelang_grouped_linear_bf16"  # not whole row tiles
    assert select(on, wo_a_spec(4096, ng=1024 + 32)).name != "tilelang_grouped_linear_bf16"
    bf16_weight = KernelSpec("grouped_linear", (("groups", 8), ("weight_dtype", "bf16")),
                             (tensor("bf16", 4096, 8 * 4096), tensor("bf16", 8192, 4096)), (tensor("bf16", 4096, 8192),))
    assert select(on, bf16_weight).name != "tilelang_grouped_linear_bf16"
    inv = dataclasses.replace(on, features=on.features + (BATCH_INVARIANT,))
    assert select(inv, wo_a_spec(4096)).name != "tilelang_grouped_linear_bf16"
    assert select(get_target("sm100"), wo_a_spec(4096)).name != "tilelang_grouped_linear_bf16"


INFLIGHT = {"block_M": 256, "block_K": 64, "stages": 4, "inflight": 1}


@pytest.mark.parametrize("over", [{}, {"block_N": 256, "stages": 3}, INFLIGHT])
def test_grouped_linear_renders_and_builds_without_spills(over):
    """inflight: gemm_fp8's register-operand program over wo_a's groups: a CTA's weight rows in
    one group, X's columns from that group's first (8 groups of 4096 features: column 4096 * g),
    the weight's bytes in their own order (X comes from the attention, not dequantised ahead in
    e4m3_rs_order's order)."""
    pytest.importorskip("tilelang")
    t = enabled(dict(LINEAR_TILES, **over), "tilelang_grouped_linear_bf16")
    spec = wo_a_spec(4096)
    tpl = select(t, spec)
    assert tpl.name == "tilelang_grouped_linear_bf16"
    cfg = tpl.default_config(t, spec)
    src = tpl.render(t, spec, cfg)
    assert src.grid == (8192 // cfg["block_N"], 4096 // cfg["block_M"], 1) and src.block == (256, 1, 1)
    assert "kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32" in src.text
    assert [p for p, _ in src.meta["params"]] == ["C", "SW", "W", "X"]
    if over.get("inflight"):
        assert "wgmma_rs" in src.text and "deepinfer_e4m3_pair_bf16(" in src.text
        assert "((int)blockIdx.x) >> 3) * 4096)" in src.text  # group bx // 8's columns of X
        # the two orders differ only in which bytes fill which slots
        rs = tpl.render(t, wo_a_spec(4096, groups=1, ng=8192), cfg).text
        assert "((int)blockIdx.x) >> 3) * 4096)" not in rs
    if shutil.which("nvcc"):
        from deepinfer.codegen.library.tilelang_gemm import nvcc_report

        rep = nvcc_report(src.text, t.arch)
        assert rep["ok"], rep["log"]
        assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]


def test_host_recipes_dequantise_the_rows_first_and_bind_by_name():
    """The fp8 linear's recipe runs the rows' dequantisation (the second kernel) and then the GEMM
    on its output; wo_a's runs the one GEMM on the rows as they are. Recorded on meta tensors."""
    pytest.importorskip("tilelang")
    import torch

    from deepinfer.codegen.host_recipe import record_tilelang
    from deepinfer.ir.quant import QTensor

    cases = [(enabled(GEMM_TILES, "tilelang_gemm_fp8_bf16"), gemm_spec(256, 512, 1024), {"out_dtype": "bf16"}),
             (enabled(LINEAR_TILES, "tilelang_grouped_linear_bf16"), wo_a_spec(256, groups=2, ng=256, kg=512),
              {"groups": 2, "weight_dtype": "bf16"})]
    for t, spec, attrs in cases:
        tpl = select(t, spec)
        src = tpl.render(t, spec, tpl.default_config(t, spec))
        kernel = {"template": tpl.name, "config": src.meta["config"], "meta": src.meta, "grid": list(src.grid),
                  "language": "cuda"}
        with torch.device("meta"):
            if spec.op == "gemm_fp8":
                x = QTensor(torch.empty(256, 1024, dtype=torch.float8_e4m3fn), torch.empty(256, 32, dtype=torch.uint8))
                w = QTensor(torch.empty(512, 1024, dtype=torch.float8_e4m3fn), torch.empty(16, 32, dtype=torch.uint8))
            else:
                x = torch.empty(256, 1024, dtype=torch.bfloat16)
                w = QTensor(torch.empty(512, 512, dtype=torch.float8_e4m3fn), torch.empty(16, 16, dtype=torch.uint8))
            rec, (out,) = record_tilelang(tpl.host, kernel, [x, w], attrs, [False])
        assert tuple(out.shape) == (256, 512) and out.dtype == torch.bfloat16
        launches = [s for s in rec["steps"] if "launch" in s]
        if spec.op == "gemm_fp8":
            assert [s["launch"] for s in launches] == [1, 0]
            assert launches[1]["grid"] == list(src.grid) and launches[0]["grid"] == list(src.meta["combine"]["grid"])
            # the GEMM reads (X) the tensor the dequantisation wrote (A): both bind it first / last
            assert launches[0]["args"][0] == launches[1]["args"][-1]
        else:
            assert [s["launch"] for s in launches] == [0]


def test_tma_knob_maps_the_copied_buffers_and_the_recipe_binds_them():
    """With `tma` on, the program is lowered with TMA copies from a producer warpgroup: each copied
    buffer becomes a CUtensorMap parameter whose type carries its encoding (the buffer, extents
    innermost first, byte strides, box), the block grows by the producer, and the host recipe binds
    the map's parameter to its buffer (16-byte aligned); a buffer of another layout is refused."""
    pytest.importorskip("tilelang")
    import torch

    from deepinfer.codegen.host_recipe import RecipeError, record_tilelang
    from deepinfer.ir.quant import QTensor
    from deepinfer.runtime.tensor_map import tensor_map_spec

    assert "tma" not in templates()["tilelang_grouped_gemm_fp4_bf16"].knobs  # its TMA lowering failed its check
    t = enabled(dict(GEMM_TILES, tma=1), "tilelang_gemm_fp8_bf16")
    spec = gemm_spec(256, 512, 1024)
    tpl = select(t, spec)
    src = tpl.render(t, spec, tpl.default_config(t, spec))
    plain = tpl.render(t, spec, dict(tpl.default_config(t, spec), tma=0))
    maps = {n: tensor_map_spec(ct) for n, ct in src.meta["params"] if tensor_map_spec(ct)}
    assert set(maps) == {"W_desc", "X_desc"} and not any(tensor_map_spec(ct) for _, ct in plain.meta["params"])
    assert "__grid_constant__ const CUtensorMap X_desc" in src.text
    # X: the dequantised bf16 rows [256, 1024]; W: the fp8 weight [512, 1024]
    assert maps["X_desc"]["buffer"] == "X" and maps["X_desc"]["dims"] == [1024, 256]
    assert maps["X_desc"]["elem_size"] == 2 and maps["X_desc"]["strides"] == [2048]
    assert maps["W_desc"]["buffer"] == "W" and maps["W_desc"]["dims"] == [1024, 512]
    assert maps["W_desc"]["strides"] == [1024] and maps["W_desc"]["box"][1] == GEMM_TILES["block_N"]
    assert src.block[0] > plain.block[0]  # the producer warpgroup
    kernel = {"template": tpl.name, "config": src.meta["config"], "meta": src.meta, "grid": list(src.grid),
              "language": "cuda"}
    with torch.device("meta"):
        x = QTensor(torch.empty(256, 1024, dtype=torch.float8_e4m3fn), torch.empty(256, 32, dtype=torch.uint8))
        w = QTensor(torch.empty(512, 1024, dtype=torch.float8_e4m3fn), torch.empty(16, 32, dtype=torch.uint8))
        rec, _ = record_tilelang(tpl.host, kernel, [x, w], {"out_dtype": "bf16"}, [False])
        gemm = [s for s in rec["steps"] if s.get("launch") == 0][0]
        names = [n for n, _ in src.meta["params"]]
        assert sorted(gemm["aligned"]) == sorted(names.index(n) for n in maps)
        assert gemm["args"][names.index("W_desc")] == {"t": rec["inputs"][1][0]}  # the weight's data slot
        bad = dict(maps["W_desc"], dims=[1024, 1024])
        wrong = dict(kernel, meta=dict(src.meta, params=[[n, "CUtensorMap " + json.dumps(bad)] if n == "W_desc"
                                                         else [n, ct] for n, ct in src.meta["params"]]))
        with pytest.raises(RecipeError, match="buffer W for W_desc"):
            record_tilelang(tpl.host, wrong, [x, w], {"out_dtype": "bf16"}, [False])


@pytest.mark.parametrize("key,tiles", [("tilelang_grouped_linear_bf16", LINEAR_TILES),
                                       ("tilelang_gemm_fp8_bf16", {"block_M": 128, "block_N": 128, "block_K": 64,
                                                                   "stages": 4, "threads": 256})])
def test_tma_programs_build_without_spills(key, tiles):
    pytest.importorskip("tilelang")
    t = enabled(dict(tiles, tma=1), key)
    spec = wo_a_spec(4096) if key.endswith("linear_bf16") else gemm_spec(4096, 32768, 1280)
    tpl = select(t, spec)
    assert tpl.name == key
    src = tpl.render(t, spec, tpl.default_config(t, spec))
    assert "CUtensorMap" in src.text
    if shutil.which("nvcc"):
        from deepinfer.codegen.library.tilelang_gemm import nvcc_report

        rep = nvcc_report(src.text, t.arch)
        assert rep["ok"], rep["log"]
        assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]


def test_moe_recipe_dequantises_the_rows_first_and_pads_them():
    """The MoE recipe runs the rows' dequantisation (the second kernel) on the rows padded to the
    instance's count, then the GEMM on its output; the op's rows come back. On meta tensors."""
    pytest.importorskip("tilelang")
    import torch

    from deepinfer.codegen.host_recipe import record_tilelang
    from deepinfer.ir.quant import QTensor

    t = enabled({"block_M": 64, "block_N": 64, "block_K": 64, "stages": 2, "threads": 128})
    spec = moe_spec(300, n=128, k=256, experts=8)  # past the decode programs' 32 rows an expert
    tpl = select(t, spec)
    assert tpl.name == "tilelang_grouped_gemm_fp4_bf16"
    src = tpl.render(t, spec, tpl.default_config(t, spec))
    kernel = {"template": tpl.name, "config": src.meta["config"], "meta": src.meta, "grid": list(src.grid),
              "language": "cuda"}
    with torch.device("meta"):
        x = QTensor(torch.empty(290, 256, dtype=torch.float8_e4m3fn), torch.empty(290, 8, dtype=torch.uint8))
        w = QTensor(torch.empty(8, 128, 128, dtype=torch.uint8), torch.empty(8, 128, 8, dtype=torch.uint8))
        offs = torch.empty(9, dtype=torch.int32)
        rec, (out,) = record_tilelang(tpl.host, kernel, [x, w, offs], {}, [False])
    assert tuple(out.shape) == (290, 128) and out.dtype == torch.bfloat16
    launches = [s for s in rec["steps"] if "launch" in s]
    assert [s["launch"] for s in launches] == [1, 0]
    assert launches[0]["grid"] == list(src.meta["combine"]["grid"]) and launches[1]["grid"] == list(src.grid)
