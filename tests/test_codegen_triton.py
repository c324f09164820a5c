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
