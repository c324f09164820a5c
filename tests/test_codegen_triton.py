"""Every Triton template against its op's reference semantics under the Triton interpreter, at
tiny sizes (codegen.library.triton_check states the tolerance rule).

Triton 3.9 fixes interpretation when `triton.language` is first imported (its own jit helpers
such as tl.zeros included), so the cases run in one fresh process started with
TRITON_INTERPRET=1 (triton_check.run_interpreted), whatever this session imported before."""
import pytest

from deepinfer.codegen.library import triton_check, triton_ops

CASES = triton_check.CASES


@pytest.fixture(scope="module")
def interpreted():
    dims = dict(triton_check.TINY)
    return triton_check.run_interpreted(CASES, dims, dims["n"], triton_check.SMALL_BLOCKS)


@pytest.mark.parametrize("op", CASES)
def test_template_matches_reference_interpreted(interpreted, op):
    assert interpreted[op] is None, interpreted[op]


def test_every_template_has_a_check_case():
    assert set(triton_ops.TEMPLATES_BY_OP) <= set(triton_check.OUTPUT_KINDS)


def test_hc_pre_with_split_k_matches_reference_interpreted():
    """hc_pre's split-K path (the mix GEMM's K over 5 programs, the last one empty at these sizes,
    partials summed in split order by the main kernel), against the same reference."""
    dims = dict(triton_check.TINY)
    got = triton_check.run_interpreted(["hc_pre"], dims, dims["n"], dict(triton_check.SMALL_BLOCKS, SPLIT=5))
    assert got["hc_pre"] is None, got["hc_pre"]


def test_grouped_gemm_fp4_with_a_partial_k_tile_matches_reference_interpreted():
    """The MoE GEMM with 64-deep K tiles over K = 96 (w13) and 64 (w2): the last tile of w13 is
    half masked; the other cases' tiles divide K."""
    dims = dict(triton_check.TINY)
    cases = [c for c in CASES if triton_check.case_op(c) == "grouped_gemm_fp4"]
    got = triton_check.run_interpreted(cases, dims, dims["n"], dict(triton_check.SMALL_BLOCKS, BK=64))
    assert got == {c: None for c in cases}


def test_grouped_gemm_fp4_selection_by_row_count():
    """Decode calls (up to 4 rows per expert on average) take the Triton template, each row count
    its own instance; prefill row counts stay on TileLang."""
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import KernelSpec, select
    from deepinfer.ir.types import TensorType, quantized
    from deepinfer.ir import dtypes as dt

    def spec(rows, e=16, n=256, k=128):
        return KernelSpec("grouped_gemm_fp4", (), (quantized("fp8e4m3", (rows, k), "e8m0", (1, 32)),
                                                   quantized("fp4e2m1", (e, n, k), "e8m0", (1, 1, 32)),
                                                   TensorType(dt.i32, (e + 1,))),
                          (TensorType(dt.bf16, (rows, n)),))

    for target in ("sm90", "sm100"):
        t = get_target(target)
        for rows in (4, 32, 64):
            chosen = select(t, spec(rows))
            assert chosen.name == "triton_grouped_gemm_fp4" and chosen.canonical is None
            launch = chosen.render(t, spec(rows), chosen.default_config(t, spec(rows))).meta["kernels"][0]
            assert launch["constexprs"]["MTOT"] == rows and launch["grid"][1] == min(16, rows) + 1
        assert select(t, spec(65)).name == "tilelang_grouped_gemm_fp4"
