"""Triton templates against their ops' reference semantics under the Triton interpreter, at tiny
sizes (codegen.library.triton_check states the tolerance rule): the configs and layouts beyond
each template's default (its K splits, row counts, MMA paths), and the template checks that need
no interpreter. Every case at its default config: tests/test_host_recipe.py.

Triton 3.9 fixes interpretation when `triton.language` is first imported (its own jit helpers
such as tl.zeros included), so the cases run in fresh processes started with TRITON_INTERPRET=1
(triton_check.run_interpreted), whatever this session imported before."""
import pytest

from deepinfer.codegen.library import triton_check, triton_ops


def test_hc_rows_below_a_dot_need_a_split():
    """Fewer than 16 rows a block run only the split path's FMAs: unsplit, the mix is a 16-row dot,
    so such a config does not render (and the tuner's legality check drops it)."""
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select

    t = get_target("sm90")
    spec = _spec_from_tiny("hc_pre")
    tpl = select(t, spec)
    with pytest.raises(ValueError, match="BM 8 < 16 needs SPLIT > 1"):
        tpl.render(t, spec, dict(tpl.default_config(t, spec), BM=8, SPLIT=1))


def test_every_template_has_a_check_case():
    assert set(triton_ops.TEMPLATES_BY_OP) <= set(triton_check.OUTPUT_KINDS)


@pytest.mark.parametrize("split,bm,x2", [(5, 16, 0), (40, 16, 0), (5, 1, 0), (40, 8, 0), (5, 16, 1), (40, 16, 1)])
def test_hc_pre_with_split_k_matches_reference_interpreted(split, bm, x2):
    """hc_pre's split path: H = 96 in 32-wide ranges over 5 or 40 programs (all but three empty),
    each doing the mix GEMM's columns of every copy and hc_pre's collapse of its range, on a
    16-row dot or (BM < 16) row by row in FMAs; the main kernel's program p sums the partials of
    row p (40: more splits than one 32-wide pass of the sum) and normalises the p-th 32-wide chunk
    of x. The 5 rows make 5 blocks of 1, or one of 8 with 3 past the end. X2: the dots over the
    weight's two tf32 parts. Against the same reference."""
    dims = dict(triton_check.TINY)
    got = triton_check.run_interpreted(["hc_pre", "hc_mix"], dims, dims["n"],
                                       dict(triton_check.SMALL_BLOCKS, SPLIT=split, BM=bm), force={"X2": x2})
    assert got["hc_pre"] is None, got["hc_pre"]
    assert got["hc_mix"] is None, got["hc_mix"]  # the same mixes without the collapse (layer 0)


ROW_KERNEL_OPS = ["swiglu_quant_fp8", "swiglu_gu_quant_fp8", "swiglu_weighted_quant_fp8", "moe_gather_rows", "quant_fp8"]


@pytest.mark.parametrize("rows", [2, 4])
def test_row_kernels_with_several_rows_a_program_match_reference_interpreted(rows):
    """swiglu_quant_kernel, gather_row_pairs_kernel and quant_fp8_kernel with ROWS rows a program
    (prefill's default, rows_per_program): 5 rows (15 pairs) leave the last block of rows short."""
    dims = dict(triton_check.TINY)
    got = triton_check.run_interpreted(ROW_KERNEL_OPS, dims, dims["n"], dict(triton_check.SMALL_BLOCKS, ROWS=rows))
    assert got == {op: None for op in ROW_KERNEL_OPS}, got


def test_prefill_sized_row_kernels_take_several_rows_a_program():
    """Decode-sized calls keep one row a program (their kernels and launches as before); a
    prefill-sized call's grid covers its rows in blocks of rows_per_program."""
    assert triton_ops.rows_per_program(64) == 1 and triton_ops.rows_per_program(24576) == triton_ops.ROWS_PER_PROGRAM > 1
    import types

    for op in ROW_KERNEL_OPS:
        assert triton_ops.default_config(op, 64)["ROWS"] == 1
        assert triton_ops.default_config(op, 4096)["ROWS"] == triton_ops.ROWS_PER_PROGRAM
        # a target's defaults may name its own (a plan variant timing one row a program again)
        tgt = types.SimpleNamespace(defaults={f"triton_{op}": {"ROWS": 1}})
        assert triton_ops.default_config(op, 4096, tgt)["ROWS"] == 1 and triton_ops.default_config(op, 64, tgt)["ROWS"] == 1


@pytest.mark.parametrize("split", [2, 3])
def test_block_linear_with_split_k_matches_reference_interpreted(split):
    """The block linear's K split (wo_a, and the fp32-compute linear): partial sums per K range,
    added in split order by split_sum_kernel; 3 splits of 32-deep tiles leave the last range short."""
    dims = dict(triton_check.TINY)
    got = triton_check.run_interpreted(["grouped_linear", "linear"], dims, dims["n"],
                                       dict(triton_check.SMALL_BLOCKS, SPLIT=split))
    assert got == {"grouped_linear": None, "linear": None}, got


@pytest.mark.parametrize("bk,split,f8", [(32, 1, 0), (64, 1, 0), (32, 3, 0), (64, 1, 1), (32, 3, 1)],
                         ids=["32deep", "64deep-partial", "split3", "fp8_mma-64deep-partial", "fp8_mma-split3"])
def test_block_linear_on_dot_scaled_matches_reference_interpreted(bk, split, f8):
    """block_linear_mx_kernel: wo_a's fp8 weight (MX) against bf16 rows, and lin8 (gemm_fp8) with
    fp8 rows per 32, each K chunk through tl.dot_scaled with the weight's 32x32 block scales
    repeated to its rows as loaded; and the fp32-compute linear's bf16 operands (bf16 MMAs, fp32
    sums, no scales). K = 96 (gemm_fp8) and 64 per group (wo_a): 64-deep chunks
    leave gemm_fp8's last one half masked; 3 splits leave the last range short or empty. F8:
    lin8 on one fp8 MMA per 32-deep block, its scales applied to the fp32 partial."""
    dims = dict(triton_check.TINY)
    got = triton_check.run_interpreted(["grouped_linear", "gemm_fp8", "linear"], dims, dims["n"],
                                       dict(triton_check.SMALL_BLOCKS, BK=bk, SPLIT=split, MX=1, F8=f8))
    assert got == {"grouped_linear": None, "gemm_fp8": None, "linear": None}, got


@pytest.mark.parametrize("n,split", [(5, 0), (5, 2), (20, 4)], ids=["5rows-auto", "5rows-split2", "20rows-split4"])
def test_block_linear_rows_matches_reference_interpreted(n, split):
    """block_linear_rows_kernel (WL): every row in one tile (16 or 32), the weight as the MMA's
    left operand widened to bf16 with its 32x32 scales in registers (wo_a's fp8 weight against
    bf16 rows, lin8's fp8 rows per 32, the fp32-compute linear's bf16 operands), 32-wide N
    tiles, the K split auto (SPLIT 0) or 2 and 4 ways summed in split order."""
    # run_interpreted applies only overrides whose key the default config has
    assert all("WL" in triton_ops.default_config(op, n) for op in ("grouped_linear", "gemm_fp8", "linear"))
    dims = dict(triton_check.TINY, H=128, E=32, n=n)
    got = triton_check.run_interpreted(["grouped_linear", "gemm_fp8", "linear"], dims, n,
                                       dict(triton_check.SMALL_BLOCKS, WL=1, BN=32, BK=32, SPLIT=split))
    assert got == {"grouped_linear": None, "gemm_fp8": None, "linear": None}, got


def test_block_linear_rows_by_shape():
    """wo_a and the LM head take WL at up to 64 rows (the head's 129280 and wo_a's 8 x 1024
    outputs are whole 128-wide tiles; wo_a splits K in 4 for 256 programs, the head's 1010 tiles
    need no split); the router's 96 experts (no whole tile), a 512-wide linear (4 tiles) and 65
    rows keep the row-tiled block linear."""
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import KernelSpec, select
    from deepinfer.ir import dtypes as dt
    from deepinfer.ir.types import TensorType, quantized

    t = get_target("sm90")

    defs = _jit_defs(triton_ops.kernels_source())

    def launch(op, spec):
        tpl = select(t, spec)
        kernels = tpl.render(t, spec, tpl.default_config(t, spec)).meta["kernels"]
        for k in kernels:  # the ahead-of-time build compiles each launch by its signature
            assert list(k["signature"]) == [p for p, _ in defs[k["entry"]]], k["entry"]
            assert {p for p, c in defs[k["entry"]] if c} == set(k["constexprs"]), k["entry"]
        return kernels

    def wo_a(rows):
        return KernelSpec("grouped_linear", (("groups", 8), ("weight_dtype", "bf16")),
                          (TensorType(dt.bf16, (rows, 8 * 4096)), quantized("fp8e4m3", (8192, 4096), "e8m0", (32, 32))),
                          (TensorType(dt.bf16, (rows, 8192)),))

    def head(rows, vocab=129280):
        return KernelSpec("linear", (("compute", "f32"), ("out_dtype", "f32")),
                          (TensorType(dt.bf16, (rows, 5120)), TensorType(dt.bf16, (vocab, 5120))),
                          (TensorType(dt.f32, (rows, vocab)),))

    k = launch("grouped_linear", wo_a(64))
    assert [x["entry"] for x in k] == ["block_linear_rows_kernel", "split_sum_kernel"]
    assert k[0]["grid"] == [64, 4] and k[0]["constexprs"]["BR"] == 64
    k = launch("linear", head(40))
    assert [x["entry"] for x in k] == ["block_linear_rows_kernel"] and k[0]["grid"] == [1010, 1]
    assert k[0]["constexprs"]["BR"] == 64
    assert launch("linear", head(1))[0]["constexprs"]["BR"] == 16 and launch("grouped_linear", wo_a(8))[0]["grid"] == [64, 4]
    for spec in (wo_a(65), head(64, vocab=96), head(64, vocab=512)):
        assert launch(spec.op, spec)[0]["entry"] == "block_linear_mx_kernel"


def test_bf16_linear_at_decode_rows_sums_its_split_in_order():
    """The bf16-compute linears of a decode step (the indexer's wk and weights_proj) take the
    Triton block linear, whose K split is added in split order by split_sum_kernel: TileLang's
    split-K adds fp32 atomics, and the sums (and the top-k they feed) then depend on timing.
    Prefill rows stay on TileLang's wgmma program; fp32-compute linears take Triton at any row
    count, as before. A batch-invariant plan keeps them on TileLang: its prefill graph runs decode
    rows too, so one call must sum in one order at every row count."""
    import dataclasses

    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import BATCH_INVARIANT, KernelSpec, select
    from deepinfer.ir import dtypes as dt
    from deepinfer.ir.types import TensorType

    def lin(rows, n, compute):
        return KernelSpec("linear", (("compute", compute), ("out_dtype", "bf16")),
                          (TensorType(dt.bf16, (rows, 5120)), TensorType(dt.bf16, (n, 5120))),
                          (TensorType(dt.bf16, (rows, n)),))

    for target in ("sm90", "sm100"):
        t = get_target(target)
        for rows in (1, 8, 64):
            for n in (32, 128):
                spec = lin(rows, n, "bf16")
                tpl = select(t, spec)
                assert tpl.name == "triton_linear", (target, rows, n, tpl.name)
                kernels = tpl.render(t, spec, tpl.default_config(t, spec)).meta["kernels"]
                assert kernels[-1]["entry"] == "split_sum_kernel" and kernels[0]["constexprs"]["SPLIT"] > 1
        assert select(t, lin(65, 128, "bf16")).name == "tilelang_linear"
        assert select(t, lin(4096, 128, "bf16")).name == "tilelang_linear"
        assert select(t, lin(4096, 128, "f32")).name == "triton_linear"
        invariant = dataclasses.replace(t, features=(*t.features, BATCH_INVARIANT))
        assert select(invariant, lin(8, 128, "bf16")).name == "tilelang_linear"


def test_gemm_fp8_selection_by_row_count():
    """Where a target names a row limit for it (sm90 names none: measured slower), decode rows of
    lin8 take the Triton template, its K split picked from the shape (the same at every row count)
    and its row tile from the rows; more rows, and sm100 (its block-scaled TileLang program), stay
    on TileLang, as do batch-invariant plans (one template at every bucket, and prefill rows have
    only TileLang's). sm90 itself runs up to 8 rows on warp MMAs (tilelang_gemm_fp8_mma, taken
    out of the copy that names the Triton limit) and more on the wgmma program."""
    import dataclasses

    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import BATCH_INVARIANT, KernelSpec, select, select_common
    from deepinfer.ir.types import TensorType, quantized
    from deepinfer.ir import dtypes as dt

    def spec(rows, n=512, k=5120):
        return KernelSpec("gemm_fp8", (("out_dtype", "bf16"),),
                          (quantized("fp8e4m3", (rows, k), "e8m0", (1, 32)),
                           quantized("fp8e4m3", (n, k), "e8m0", (32, 32))), (TensorType(dt.bf16, (rows, n)),))

    sm90 = get_target("sm90")
    assert [select(sm90, spec(m)).name for m in (1, 8, 9, 64)] == ["tilelang_gemm_fp8_mma"] * 2 + ["tilelang_gemm_fp8"] * 2
    own = {k: v for k, v in sm90.defaults.items() if k != "tilelang_gemm_fp8_mma"}
    t = dataclasses.replace(sm90, defaults={**own, "triton_gemm_fp8": {"decode_rows": 64}})
    for rows, tile in ((1, 16), (8, 16), (32, 32), (64, 64)):
        chosen = select(t, spec(rows))
        assert chosen.name == "triton_gemm_fp8", chosen.name
        launch = chosen.render(t, spec(rows), chosen.default_config(t, spec(rows))).meta["kernels"]
        assert [k["entry"] for k in launch] == ["block_linear_mx_kernel", "split_sum_kernel"]
        # 512 / 64 = 8 N tiles: split 16 gives 128 programs, each over 320 of K
        assert launch[0]["grid"] == [1, 8, 16] and launch[0]["constexprs"]["BM"] == tile
        assert launch[0]["constexprs"]["XQ"] is True and launch[0]["constexprs"]["WQ"] is True
    assert select(t, spec(65)).name == "tilelang_gemm_fp8"
    assert select(get_target("sm100"), spec(8)).name == "tilelang_gemm_fp8"
    bi = dataclasses.replace(t, features=t.features + (BATCH_INVARIANT,))
    assert select_common(bi, [spec(1), spec(4096)]).name == "tilelang_gemm_fp8"


@pytest.mark.parametrize("words,mx,f8,gemv,bm", [(0, 0, 0, 0, 16), (1, 0, 0, 0, 16), (0, 1, 0, 0, 16),
                                                (0, 0, 1, 0, 16), (0, 0, 0, 1, 1), (0, 0, 0, 1, 2)],
                         ids=["bytes", "words", "dot_scaled", "fp8_mma", "cuda_cores-1row", "cuda_cores-2rows"])
def test_grouped_gemm_fp4_with_a_partial_k_tile_matches_reference_interpreted(words, mx, f8, gemv, bm):
    """The MoE GEMM with 64-deep K tiles over K = 96 (w13) and 64 (w2): the last tile of w13 is
    half masked; the other cases' tiles divide K. Both widenings of the fp4 codes (bytes, and
    32-bit words two codes at a time, which reorders K inside each block), and tl.dot_scaled on
    the MX operands as they are (MX), the codes widened to e4m3 bytes for fp8 MMAs (F8), and the
    CUDA-core path (GEMV) one and two rows at a time over experts with more rows than that."""
    dims = dict(triton_check.TINY)
    cases = [c for c in triton_check.CASES if triton_check.case_op(c) == "grouped_gemm_fp4"]
    got = triton_check.run_interpreted(cases, dims, dims["n"], dict(triton_check.SMALL_BLOCKS, BK=64, WORDS=words,
                                                                    MX=mx, F8=f8, GEMV=gemv, BM=bm))
    assert got == {c: None for c in cases}


def test_dspark_heads_over_several_tiles_matches_reference_interpreted():
    """The draft heads with 16-wide vocabulary tiles (4 over V = 50, the last short), the Markov rank
    in two 16-deep chunks and the tiles' maxima picked 2 at a time: the two-level argmax and the
    step-to-step hand-over of the previous draft, against the sequential reference."""
    dims = dict(triton_check.TINY)
    got = triton_check.run_interpreted(["dspark_heads"], dims, dims["n"], dict(BV=16, BR=16, BT=2, BH=32))
    assert got == {"dspark_heads": None}, got


@pytest.mark.parametrize("mx", [0, 1], ids=["words", "dot_scaled"])
def test_grouped_gemm_fp4_with_split_k_matches_reference_interpreted(mx):
    """The MoE GEMM's K split: 32-deep tiles over K = 96 (w13) and 64 (w2) in 3 splits (w2's last
    one empty), partials and the zeroed rows in part[s], summed in split order."""
    dims = dict(triton_check.TINY)
    cases = [c for c in triton_check.CASES if triton_check.case_op(c) == "grouped_gemm_fp4"]
    got = triton_check.run_interpreted(cases, dims, dims["n"],
                                       dict(triton_check.SMALL_BLOCKS, BK=32, SPLIT=3, WORDS=1, MX=mx))
    assert got == {c: None for c in cases}


def test_grouped_gemm_fp4_selection_by_row_count():
    """Decode and verify calls (up to 32 rows per expert on average) take the Triton template,
    each row count its own instance; prefill row counts stay on TileLang on sm100 and take the
    Triton template's prefill tiles on sm90, whose defaults say `prefill`. (sm90 as a target
    without the warp-MMA and bf16 prefill templates' defaults, which take its decode and prefill
    calls first: tests/test_tilelang_moe_decode.py, tests/test_tilelang_prefill_bf16.py.)"""
    import dataclasses

    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import KernelSpec, select
    from deepinfer.ir.types import TensorType, quantized
    from deepinfer.ir import dtypes as dt

    def spec(rows, e=16, n=256, k=128):
        return KernelSpec("grouped_gemm_fp4", (), (quantized("fp8e4m3", (rows, k), "e8m0", (1, 32)),
                                                   quantized("fp4e2m1", (e, n, k), "e8m0", (1, 1, 32)),
                                                   TensorType(dt.i32, (e + 1,))),
                          (TensorType(dt.bf16, (rows, n)),))

    sm90 = get_target("sm90")
    assert select(sm90, spec(8)).name == "tilelang_grouped_gemm_fp4_mma"
    assert select(sm90, spec(513)).name == "tilelang_grouped_gemm_fp4_bf16"
    sm90 = dataclasses.replace(sm90, defaults={k: v for k, v in sm90.defaults.items()
                                               if k not in ("tilelang_grouped_gemm_fp4_mma",
                                                            "tilelang_grouped_gemm_fp4_bf16")})
    for target, t in (("sm90", sm90), ("sm100", get_target("sm100"))):
        for rows in (4, 8, 9, 32, 64, 512):
            chosen = select(t, spec(rows))
            assert chosen.name == "triton_grouped_gemm_fp4" and chosen.canonical is None
            launch = chosen.render(t, spec(rows), chosen.default_config(t, spec(rows))).meta["kernels"][0]
            ce = launch["constexprs"]
            assert ce["MTOT"] == rows and launch["grid"][1] == min(16, rows) + 1
            if target == "sm90" and rows <= 8:
                # sm90 names 8 rows for the CUDA-core path: one row a pass, 256 columns, K in 4
                assert ce["GEMV"] == 1 and ce["BM"] == 1 and ce["BN"] == 256 and launch["grid"][2] == 4
                continue
            # tl.dot_scaled elsewhere; from 16 rows, 256-wide N tiles (the faster there on the H200)
            assert ce["GEMV"] == 0 and ce["MX"] == 1 and ce["BN"] == (256 if rows >= 16 else 128)
        chosen = select(t, spec(513))
        if target == "sm100":
            assert chosen.name == "tilelang_grouped_gemm_fp4"
            continue
        assert chosen.name == "triton_grouped_gemm_fp4"
        ce = chosen.render(t, spec(513), chosen.default_config(t, spec(513))).meta["kernels"][0]["constexprs"]
        assert {k: ce[k] for k in ("BM", "BN", "BK", "MX")} == {"BM": 128, "BN": 128, "BK": 64, "MX": 1}


def test_moe_permute_launches_by_pair_count():
    """Every pair in one block (decode): the sort alone, one program; more pairs: the per-block
    counts, the scan over experts and the per-block sort, in that order."""
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import KernelSpec, select
    from deepinfer.ir import dtypes as dt
    from deepinfer.ir.types import TensorType

    t = get_target("sm90")
    for tokens, entries, grid in [(64, ["moe_permute_kernel"], [1]),
                                  (4096, ["moe_permute_count_kernel", "moe_permute_scan_kernel",
                                          "moe_permute_kernel"], [24, 13, 24])]:
        spec = KernelSpec("moe_permute", (("n_experts", 384),), (TensorType(dt.i32, (tokens, 6)),),
                          (TensorType(dt.i32, (tokens * 6,)), TensorType(dt.i32, (385,))))
        tpl = select(t, spec)
        launches = tpl.render(t, spec, tpl.default_config(t, spec)).meta["kernels"]
        assert tpl.name == "triton_moe_permute"
        assert [k["entry"] for k in launches] == entries and [k["grid"][0] for k in launches] == grid


# ---- rendered launch metadata against the kernel text (structure, not bytes) ----------------------

DECODE_ENV = {"num_tokens": 8, "num_seqs": 2, "num_samples": 2, "max_pages": 8, "num_slots": 4, "num_pages": 16}


def _spec_from_tiny(op, variant="prefill", absent=()):
    """The first `op` call of the tiny sm90 graph (`variant`: the pipeline's, "decode" with the
    decode-only fusions) at an 8-row decode bucket; `absent`: ops the fusions must have left none of."""
    from deepinfer.models.deepseek_v41 import build_model
    from deepinfer.passes.kernels import kernel_spec
    from deepinfer.passes.pipelines import pipeline

    g = build_model("v4.1-flash-tiny").step
    for name, fn in pipeline("sm90", variant=variant):
        if not (op == "hc_pre" and name == "split_hc_pre"):  # sm90 splits it (for its second stream)
            g = fn(g)
    assert not set(absent) & set(g.op_counts()), set(absent) & set(g.op_counts())
    n = next(n for n in g.nodes if n.op == op)
    return kernel_spec(g, n, {v: g.types[v].subs(DECODE_ENV) for v in (*n.inputs, *n.outputs)})


def _render_from_tiny(op):
    """That call rendered with its template's default config."""
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select

    t = get_target("sm90")
    spec = _spec_from_tiny(op)
    tpl = select(t, spec)
    return tpl, tpl.render(t, spec, tpl.default_config(t, spec))


def _jit_defs(text):
    """name -> [(parameter, is constexpr)] of every @triton.jit function of a kernel text."""
    import ast

    out = {}
    for f in ast.parse(text).body:
        if isinstance(f, ast.FunctionDef) and any(ast.unparse(d).endswith("jit") for d in f.decorator_list):
            out[f.name] = [(a.arg, a.annotation is not None and ast.unparse(a.annotation).endswith("constexpr"))
                           for a in f.args.args]
    return out


@pytest.mark.parametrize("op,template,entries", [
    ("rms_norm_quant_fp8", "triton_rms_norm_quant_fp8", ["rms_norm_kernel"]),
    ("hc_pre", "triton_hc_pre", ["hc_mix_split_kernel", "hc_pre_kernel"]),  # decode rows: K split first
])
def test_launch_metadata_matches_the_kernel_text(op, template, entries):
    tpl, src = _render_from_tiny(op)
    assert tpl.name == template and src.language == "triton"
    launches = src.meta["kernels"]
    assert [k["entry"] for k in launches] == entries and src.entry == entries[-1]
    defs = _jit_defs(src.text)
    cfg = src.meta["config"]
    for k in launches:
        params = defs[k["entry"]]
        # the launcher passes arguments by the signature's order: it must be the kernel's own
        assert list(k["signature"]) == [p for p, _ in params]
        assert {p for p, c in params if c} == {p for p, s in k["signature"].items() if s == "constexpr"} \
            == set(k["constexprs"])
        assert k["constexprs"]["H"] == 256  # the tiny model's hidden size, fixed per instance
        assert k["num_warps"] == cfg["num_warps"] and src.block == (32 * cfg["num_warps"],)
    main = launches[-1]
    assert tuple(main["grid"]) == tuple(src.grid)
    if op == "rms_norm_quant_fp8":
        sig = main["signature"]
        assert main["grid"] == [8] and main["constexprs"]["QUANT"] is True  # one program per row
        want = {"x_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", "eps": "fp32"}
        assert {k: sig[k] for k in want} == want
    else:
        split = launches[0]
        blocks = -(-8 // cfg["BM"])
        # the split kernel collapses into the output, which the main kernel's programs (row block,
        # p) normalise in place by chunks of H; programs p < BM also finish row p's mixes
        assert cfg["SPLIT"] > 1 and split["grid"] == [blocks, cfg["SPLIT"]]
        assert main["grid"] == [blocks, max(cfg["BM"], -(-256 // cfg["BH"]))] and split["constexprs"]["COLLAPSE"] is True
        assert split["signature"]["part_ptr"] == main["signature"]["part_ptr"] == "*fp32"  # partials handed over
        assert src.meta["launch_attrs"] == {"eps": 1e-20, "copies": 4, "iters": 20, "hc_eps": 1e-06, "post_mult": 2.0}


def test_every_rendered_launch_follows_its_kernels_parameters():
    """The ahead-of-time build compiles each launch by its signature: every Triton call of the tiny
    sm90 decode graphs (step and draft) must name its kernel's parameters in order, constexprs
    exactly."""
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select
    from deepinfer.models.deepseek_v41 import build_model
    from deepinfer.passes.driver import run_pipeline
    from deepinfer.passes.kernels import kernel_spec

    t = get_target("sm90")
    defs = _jit_defs(triton_ops.kernels_source())
    prog = build_model("v4.1-flash-tiny")
    seen = set()
    for g in (run_pipeline(prog.step, "sm90", variant="decode"), run_pipeline(prog.draft, "sm90")):
        for n in g.nodes:
            if n.attr.get("@kernel") in (None, "view"):
                continue
            spec = kernel_spec(g, n, {v: g.types[v].subs(DECODE_ENV) for v in (*n.inputs, *n.outputs)})
            tpl = select(t, spec)
            if not tpl.name.startswith("triton_"):
                continue
            for k in tpl.render(t, spec, tpl.default_config(t, spec)).meta["kernels"]:
                params = defs[k["entry"]]
                assert list(k["signature"]) == [p for p, _ in params], (tpl.name, k["entry"])
                assert {p for p, c in params if c} == set(k["constexprs"]), (tpl.name, k["entry"])
            seen.add(tpl.name)
    assert {"triton_compress_pool_norm", "triton_hc_mix", "triton_engram_ngram_ids", "triton_lookup",
            "triton_concat", "triton_hc_mean", "triton_hc_collapse", "triton_hc_repeat"} <= seen


def test_every_indexer_call_of_the_tiny_graph_takes_the_triton_template():
    """The fused indexer at every index source (plain, the candidate source emitting the pool, the
    layers scoring inside it), with the head weights' factor folded in; the launches' signatures
    follow the kernels' parameters."""
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select
    from deepinfer.models.deepseek_v41 import build_model
    from deepinfer.passes.driver import run_pipeline
    from deepinfer.passes.kernels import kernel_spec

    t = get_target("sm90")
    g = run_pipeline(build_model("v4.1-flash-tiny").step, "sm90")
    calls = [n for n in g.nodes if n.op == "indexer_topk"]
    assert {(n.attr.get("emit_candidates", False), len(n.inputs)) for n in calls} == {(False, 6), (True, 6), (False, 7)}
    for n in calls:
        spec = kernel_spec(g, n, {v: g.types[v].subs(DECODE_ENV) for v in (*n.inputs, *n.outputs)})
        tpl = select(t, spec)
        assert tpl.name == "triton_indexer_topk" and n.attr["w_scale"] == 0.0625
        src = tpl.render(t, spec, tpl.default_config(t, spec))
        entries = ["indexer_score_kernel", "indexer_select_kernel"]
        assert [k["entry"] for k in src.meta["kernels"]] == (["indexer_block_map_kernel"] if len(n.inputs) == 7 else []) + entries
        defs = _jit_defs(src.text)
        for k in src.meta["kernels"]:
            assert list(k["signature"]) == [p for p, _ in defs[k["entry"]]]
        score, sel = src.meta["kernels"][-2:]
        assert score["constexprs"]["SCALE"] and score["constexprs"]["EMIT"] == bool(n.attr.get("emit_candidates"))
        assert score["grid"][0] == sel["grid"][0] == 8 and sel["grid"][1] == 1 + score["constexprs"]["EMIT"]
        assert src.meta["launch_attrs"]["w_scale"] == 0.0625


def test_a_target_sets_the_prefill_mix_tiles():
    """hc_mix's unsplit (prefill) calls take the knobs under the target defaults' `prefill` key of
    `triton_hc_mix`; decode rows keep their split path whatever it says."""
    import dataclasses

    from deepinfer.codegen.targets import get_target

    sm90 = get_target("sm90")
    assert triton_ops.default_config("hc_mix", 4096, sm90)["SPLIT"] == 8  # sm90's: the split path
    # sm90's wide row blocks from 2048 rows (prefill_wide), 16-row ones below
    assert [triton_ops.default_config("hc_mix", n, sm90)["BM"] for n in (512, 2048, 4096)] == [16, 128, 128]
    t = dataclasses.replace(sm90, defaults={k: v for k, v in sm90.defaults.items() if k != "triton_hc_mix"})
    tiles = {"BM": 64, "BK": 64, "num_warps": 8, "num_stages": 3}
    tuned = dataclasses.replace(t, defaults=dict(t.defaults, triton_hc_mix={"prefill": tiles}))
    assert triton_ops.default_config("hc_mix", 4096, t)["BM"] == 16
    got = triton_ops.default_config("hc_mix", 4096, tuned)
    assert {k: got[k] for k in tiles} == tiles and got["SPLIT"] == 1
    assert triton_ops.default_config("hc_mix", 64, tuned) == triton_ops.default_config("hc_mix", 64, t)
    # prefill_wide: its knobs over `prefill`'s from min_rows rows on; shorter prefills keep `prefill`'s
    wide = dataclasses.replace(sm90, defaults=dict(sm90.defaults, triton_hc_mix=dict(
        sm90.defaults["triton_hc_mix"], prefill_wide={"min_rows": 2048, "BM": 128, "BK": 8, "num_warps": 8})))
    long_, short = triton_ops.default_config("hc_mix", 4096, wide), triton_ops.default_config("hc_mix", 512, wide)
    assert (long_["BM"], long_["BK"], long_["num_warps"], long_["SPLIT"]) == (128, 8, 8, 8) and "min_rows" not in long_
    assert short == triton_ops.default_config("hc_mix", 512, sm90)
    bad = dataclasses.replace(sm90, defaults=dict(sm90.defaults, triton_hc_mix={"prefill_wide": {"BM": 128}}))
    with pytest.raises(ValueError, match="prefill_wide defaults need min_rows"):
        triton_ops.default_config("hc_mix", 4096, bad)


def test_a_target_sets_the_prefill_moe_tiles():
    """A target whose `triton_grouped_gemm_fp4.prefill` default is an object gives prefill-sized
    MoE calls MOE_PREFILL with those knobs over it; decode calls are untouched."""
    import dataclasses

    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import KernelSpec, select
    from deepinfer.ir.types import quantized, tensor

    def moe(rows):
        return KernelSpec("grouped_gemm_fp4", (), (quantized("fp8e4m3", (rows, 5120), "e8m0", (1, 32)),
                                                   quantized("fp4e2m1", (96, 4608, 5120), "e8m0", (1, 1, 32)),
                                                   tensor("i32", 97)), (tensor("bf16", rows, 4608),))

    t = get_target("sm90")  # without the bf16 prefill program's defaults, which take such calls first
    t = dataclasses.replace(t, defaults={k: v for k, v in t.defaults.items() if k != "tilelang_grouped_gemm_fp4_bf16"})
    tuned = dataclasses.replace(t, defaults=dict(t.defaults, triton_grouped_gemm_fp4={"gemv_rows": 8,
                                                                                       "prefill": {"BK": 32}}))
    pre = moe(24576)
    assert select(t, pre).default_config(t, pre) == triton_ops.MOE_PREFILL
    assert select(tuned, pre).default_config(tuned, pre) == dict(triton_ops.MOE_PREFILL, BK=32)
    dec = moe(384)
    assert select(tuned, dec).name == select(t, dec).name


def test_a_ring_write_whose_rows_fit_the_ring_launches_no_newest_position_kernel():
    """A step with at most ring-length rows (every decode bucket at the window rings) keeps every
    row, so its ring write is one launch (KEEP_ALL); more rows than the ring (prefill) first find
    each sequence's newest position, which decides the rows a ring keeps."""
    import dataclasses

    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select

    t = get_target("sm90")
    spec = _spec_from_tiny("swa_write")
    ring_len = spec.in_types[0].data.shape[1]
    tpl = select(t, spec)

    def rows(n):
        kv = spec.in_types[1]
        ins = list(spec.in_types)
        ins[1] = dataclasses.replace(kv, data=dataclasses.replace(kv.data, shape=(n, kv.data.shape[1])),
                                     scale=dataclasses.replace(kv.scale, shape=(n, kv.scale.shape[1])))
        ins[2:4] = [dataclasses.replace(x, shape=(n,)) for x in ins[2:4]]
        s = dataclasses.replace(spec, in_types=tuple(ins))
        return [(k["entry"], k["constexprs"].get("KEEP_ALL")) for k in tpl.render(t, s, tpl.default_config(t, s)).meta["kernels"]]

    assert 8 <= ring_len and rows(8) == [("ring_write_kernel", 1)]
    assert rows(ring_len) == [("ring_write_kernel", 1)]
    assert rows(ring_len + 1) == [("seq_newest_kernel", None), ("ring_write_kernel", 0)]


def test_a_decode_combine_finds_its_pairs_without_an_inverse_permutation_launch():
    """The MoE combine of at most COMBINE_SCAN_MAX pairs (decode and verify) searches the pairs
    for each token's in the combine program itself: one launch; prefill-sized calls read the
    inverse permutation a first kernel writes. On sm90 the combine is expanded into the streams
    in the same program (fuse_combine_expand: no moe_combine_shared call left)."""
    import dataclasses

    from deepinfer.codegen.library.triton_ops import COMBINE_SCAN_MAX
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select

    t = get_target("sm90")
    spec = _spec_from_tiny("moe_combine_hc_expand")
    tpl = select(t, spec)
    k = spec.attr["k"]

    def launches(tokens):
        y, pairs = spec.in_types[:2]
        ins = list(spec.in_types)
        ins[0] = dataclasses.replace(y, shape=(tokens * k, y.shape[1]))
        ins[1] = dataclasses.replace(pairs, shape=(tokens * k,))
        ins[3:] = [dataclasses.replace(x, shape=(tokens, *x.shape[1:])) for x in ins[3:]]
        s = dataclasses.replace(spec, in_types=tuple(ins))
        return [(x["entry"], x["constexprs"].get("SCAN")) for x in tpl.render(t, s, tpl.default_config(t, s)).meta["kernels"]]

    for tokens in (1, 8, 64):
        assert launches(tokens) == [("moe_combine_expand_kernel", 1 << (tokens * k - 1).bit_length())]
    big = COMBINE_SCAN_MAX // k + 1
    assert launches(big) == [("inverse_perm_kernel", None), ("moe_combine_expand_kernel", 0)]


def test_the_fused_decode_ring_write_takes_the_ring_writes_rule():
    """norm_rope_quant_fp8_cache_write (fuse_decode, then fuse_decode_norm: decode graphs): one
    launch while the call's rows fit the ring, the newest-position kernel first beyond (a
    256-sequence decode bucket of the real model's 134-entry rings): never a torch fallback."""
    import dataclasses

    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select

    spec = _spec_from_tiny("norm_rope_quant_fp8_cache_write", "decode", absent=("rope_quant_fp8_cache_write", "swa_write"))
    t = get_target("sm90")
    tpl = select(t, spec)
    ring_len = spec.in_types[3].data.shape[1]

    def launches(rows):
        ins = list(spec.in_types)
        ins[0] = dataclasses.replace(ins[0], shape=(rows, ins[0].shape[1]))
        ins[2] = dataclasses.replace(ins[2], shape=(rows,))
        ins[4] = dataclasses.replace(ins[4], shape=(rows,))
        s = dataclasses.replace(spec, in_types=tuple(ins))
        assert select(t, s).name == "triton_norm_rope_quant_fp8_cache_write"
        return [(k["entry"], k["constexprs"].get("KEEP_ALL")) for k in tpl.render(t, s, tpl.default_config(t, s)).meta["kernels"]]

    assert tpl.name == "triton_norm_rope_quant_fp8_cache_write"
    assert launches(8) == launches(ring_len) == [("rope_fp8_ring_kernel", 1)]
    assert launches(ring_len + 1) == [("seq_newest_kernel", None), ("rope_fp8_ring_kernel", 0)]


def _interpreted_at_splits(op, splits):
    """`op`'s check case on the interpreter at each K split: every one agrees with the reference."""
    dims = dict(triton_check.TINY)
    for split in splits:
        res = triton_check.run_interpreted([op], dims, dims["n"], dict(triton_check.SMALL_BLOCKS, SPLIT=split))
        assert res[op] is None, (split, res)


def test_wo_a_rows_quantised_by_the_k_split_sum():
    """grouped_linear_quant_fp8 (fuse_decode_linear_quant, decode graphs): with a K split its sum
    kernel writes the fp8 rows and scales (no quant_fp8 launch left: two launches where the
    unfused pair made three); unsplit, quant_fp8_kernel follows the linear. Both paths agree with
    the op's reference on the interpreter."""
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select

    spec = _spec_from_tiny("grouped_linear_quant_fp8", "decode", absent=("grouped_linear",))
    t = get_target("sm90")
    tpl = select(t, spec)
    assert tpl.name == "triton_grouped_linear_quant_fp8"

    def entries(**over):
        return [k["entry"] for k in tpl.render(t, spec, tpl.default_config(t, spec) | over).meta["kernels"]]

    assert entries()[1:] == ["split_sum_quant_kernel"]
    assert entries(SPLIT=1, WL=0)[1:] == ["quant_fp8_kernel"]
    _interpreted_at_splits("grouped_linear_quant_fp8", (1, 4))


def test_the_router_sums_its_logits_gemms_k_split():
    """linear_moe_router (fuse_decode_router_linear, decode graphs): with a K split the router
    kernel reads the GEMM's partials and sums them in split order (two launches where the linear's
    sum made three); unsplit, it reads the logits. Both agree with the reference on the
    interpreter, near ties aside as for moe_router."""
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select

    spec = _spec_from_tiny("linear_moe_router", "decode", absent=("moe_router",))
    t = get_target("sm90")
    tpl = select(t, spec)
    assert tpl.name == "triton_linear_moe_router"

    def launches(**over):
        meta = tpl.render(t, spec, tpl.default_config(t, spec) | over).meta["kernels"]
        return [(k["entry"], k["constexprs"].get("PARTS")) for k in meta]

    # (sm90's decode split comes from the shape, which leaves the tiny router's K whole: name one)
    split = launches(SPLIT=8)[1][1]
    assert split > 1 and [e for e, _ in launches(SPLIT=8)] == ["block_linear_mx_kernel", "moe_router_kernel"]
    assert launches() == launches(SPLIT=1)
    assert launches(SPLIT=1, WL=0)[1:] == [("moe_router_kernel", 1)]
    _interpreted_at_splits("linear_moe_router", (1, 3))


def test_the_per_call_check_takes_the_routers_logits_from_its_gate_gemm():
    """judge (the GPU per-call check, the tuner's check) on linear_moe_router: the near-tie rule
    reads the logits the gate GEMM's reference makes from x and the weight, and the bias third;
    the reference's own output passes, a row with another expert selected fails."""
    from deepinfer.ir.registry import get_op

    dims = dict(triton_check.TINY)
    ins, attrs = triton_check.make_case("linear_moe_router", dims, dims["n"])
    sel, w = get_op("linear_moe_router").ref(*ins, **attrs)
    ok, why = triton_check.judge("linear_moe_router", "triton_linear_moe_router", (sel, w), (sel, w), ins[:3], attrs)
    assert ok, why
    bad = sel.clone()
    bad[0, 0] = next(e for e in range(dims["E"]) if e not in sel[0].tolist())
    ok, why = triton_check.judge("linear_moe_router", "triton_linear_moe_router", (bad, w), (sel, w), ins[:3], attrs)
    assert not ok, why


FUSED_NORM_AGREES = """
import torch
from deepinfer.codegen.library import triton_check as tc, triton_launchers as L, triton_ops as ops
dims = dict(tc.TINY)
ins, attrs = tc.make_case("norm_rope_quant_fp8_cache_write", dict(dims, slots=64), 64)
def cl(v):
    return v.clone() if isinstance(v, torch.Tensor) else type(v)(v.data.clone(), v.scale.clone())
cfg = ops.default_config("norm_rope_quant_fp8_cache_write", 64)
fused = L.launch_norm_rope_fp8_ring(*[cl(v) for v in ins], **ops.launch_attrs("norm_rope_quant_fp8_cache_write", attrs),
                                    cfg=cfg)
xn = L.launch_rms_norm(ins[0], ins[1], eps=attrs["eps"], cfg=dict(ops.default_config("rms_norm", 64), BLOCK_H=64))
rest = {k: v for k, v in attrs.items() if k != "eps"}
plain = L.launch_rope_fp8_ring(xn, *[cl(v) for v in ins[2:]], **ops.launch_attrs("rope_quant_fp8_cache_write", rest),
                               cfg=cfg)
print("SAME" if all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fused, plain)) else "DIFF")
"""


def test_the_fused_key_norm_agrees_with_rms_norm_kernel_bit_for_bit():
    """The decode graph's fused key write and the prefill graph's rms_norm_kernel + ring write take
    the same rstd (triton_kernels._rstd: fp64 statistics), so a key is the same bytes whichever
    graph writes it (chunked prefill, batch-invariant plans), though rms_norm_kernel sums in
    64-wide chunks here and the fused kernel over the whole row."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", FUSED_NORM_AGREES], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("SAME"), r.stdout[-500:]


MIX_PARTIALS = """
import torch, triton, triton.language as tl
from deepinfer.codegen.library import triton_kernels as K, triton_launchers as L, triton_ops as ops

@triton.jit
def high_kernel(v_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, K._tf32_high(tl.load(v_ptr + i)))

g = torch.Generator().manual_seed(0)
v = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-40, 40, (4096,), generator=g).float())
v[:4] = torch.tensor([1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, -(1.0 + 2.0 ** -11), 2.0 ** -126])  # ties, a subnormal's edge
hi = torch.empty_like(v)
high_kernel[(1,)](v, hi, N=4096)
low_bits = int((hi.view(torch.int32) & 0x1FFF).abs().max())
print("HIGH", low_bits, float(((v - hi).abs() / v.abs()).max()))

n, c, h = 37, 4, 96
r = torch.randn(n, c, h, generator=g).to(torch.bfloat16)
fn = torch.randn(24, c * h, generator=g)
ref = r.reshape(n, -1).double() @ fn.double().T
mag = r.reshape(n, -1).double().abs() @ fn.double().abs().T
for x2 in (0, 1):
    cfg = dict(ops.default_config("hc_mix", n), SPLIT=5, BM=16, BK=32, X2=x2)
    part = L._hc_mix_partials(r, fn, cfg, None)
    got = part.double().sum(0)[:, :24]
    print("X2", x2, float(((got - ref).abs() / mag).max()))
"""


def test_the_mix_gemm_on_two_tf32_parts_of_its_weight(tmp_path):
    """X2 (hc_mix_split_kernel): the weight's tf32 high part has no bits past tf32's 10 and is
    within 2^-11 of it, and the two-dot GEMM is as close to the fp64 product as tf32x3's (the
    interpreter multiplies in fp32: a dropped low part is 2^-11 off)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "mix_partials.py"  # a file: the interpreter reads a kernel's source
    script.write_text(MIX_PARTIALS)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = {ln.split()[0] + (ln.split()[1] if ln.startswith("X2") else ""): ln.split()[1:] for ln in r.stdout.splitlines()}
    low_bits, rel = out["HIGH"]
    assert int(low_bits) == 0 and float(rel) <= 2.0 ** -11, out
    assert float(out["X21"][1]) < 1e-6 and float(out["X20"][1]) < 1e-6, out


def test_a_target_sets_the_decode_linears_k_split():
    """The decode linears (linear, linear_moe_router) split K in 8 unless a target names its
    `decode_split` (0: from the shape, block_linear_split); prefill-sized calls keep their tiles."""
    import types

    for op in ("linear", "linear_moe_router"):
        assert triton_ops.default_config(op, 1)["SPLIT"] == 8 and triton_ops.default_config(op, 64)["SPLIT"] == 8
        tgt = types.SimpleNamespace(defaults={f"triton_{op}": {"decode_split": 0}})
        assert triton_ops.default_config(op, 1, tgt)["SPLIT"] == 0 == triton_ops.default_config(op, 64, tgt)["SPLIT"]
        assert triton_ops.default_config(op, 4096, tgt) == triton_ops.default_config(op, 4096)
    # the router's 3 tiles of 32 over K 5120 in 128-deep steps: the split from the shape is 16
    assert triton_ops.block_linear_split({"SPLIT": 0, "BK": 128}, 3, 5120) == 16


def test_split_rows_take_the_decode_k_split_in_64_row_tiles():
    """A target's `split_rows` (sm90 variants): linear, linear_moe_router and wo_a's
    grouped_linear_quant_fp8 calls of 65 to split_rows rows split K in 64-row tiles (unsplit, a
    128-row router ran 4 programs); fewer rows and prefill rows keep their configs. On the
    interpreter 100 rows (a short second row tile) in those tiles with a K split agree with the
    references."""
    import types

    on = {"decode_split": 0, "split_rows": 128}
    for op in ("linear", "linear_moe_router", "grouped_linear_quant_fp8"):
        tgt = types.SimpleNamespace(defaults={f"triton_{op}": on})
        got = triton_ops.default_config(op, 128, tgt)
        assert got["BM"] == 64 and got["BK"] == 128 and got["SPLIT"] == (8 if op.startswith("grouped") else 0), got
        assert triton_ops.default_config(op, 129, tgt) == triton_ops.default_config(op, 129)
        assert triton_ops.default_config(op, 4096, tgt) == triton_ops.default_config(op, 4096)
        assert triton_ops.default_config(op, 128) == triton_ops.default_config(op, 4096)  # (off: as before)
    dims = dict(triton_check.TINY)
    ops = ["linear", "linear_moe_router", "grouped_linear_quant_fp8"]
    res = triton_check.run_interpreted(ops, dims, 100, dict(triton_check.SMALL_BLOCKS, BM=64, SPLIT=2))
    assert res == {op: None for op in ops}, res
