"""The comparison rules the kernel checks use (codegen/library/triton_check.py): what they let
through and what they must catch."""
import torch

from deepinfer.codegen.library import triton_check as tc
from deepinfer.codegen.library.triton_check import ROW_FLOOR, compare_rounded


def _row(n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, n, generator=g) * 3).to(torch.bfloat16)


def _next_up(x: torch.Tensor, k=1) -> torch.Tensor:
    """x moved k bf16 ulps away from zero."""
    return (x.view(torch.int16) + k).view(torch.bfloat16)


def test_identical_and_single_ulp_flips_pass():
    r = _row()
    assert compare_rounded(r.clone(), r) is None
    g = r.clone()
    g[0, :20] = _next_up(g[0, :20])
    assert compare_rounded(g, r) is None


def test_two_ulps_at_a_full_size_element_fail():
    r = _row()
    g = r.clone()
    i = int(torch.argmax(r[1].float().abs()))
    g[1, i] = _next_up(g[1, i], 2)
    msg = compare_rounded(g, r)
    assert msg and "beyond 1 ulp" in msg


def test_cancelled_element_may_miss_by_fp32_error_of_its_row_scale():
    """A result near zero formed from terms of the row's size: an fp32 error of a few ulps of the
    terms is many bf16 ulps of the result, and is allowed up to the floor, not beyond."""
    r = _row()
    r[2, 7] = 3e-5
    scale = r[2].float().abs().max().item()
    g = r.clone()
    g[2, 7] = 3e-5 + 0.5 * ROW_FLOOR * scale
    assert compare_rounded(g, r) is None
    g[2, 7] = 3e-5 + 3 * ROW_FLOOR * scale
    assert "beyond 1 ulp" in compare_rounded(g, r)


def test_index_and_formula_errors_fail():
    r = _row()
    g = r.clone()
    g[3, [5, 6]] = g[3, [6, 5]]  # two outputs swapped
    assert compare_rounded(g, r)
    assert compare_rounded((r.float() * 1.01).to(torch.bfloat16), r)  # 1% off everywhere


def test_too_many_flips_fail():
    r = _row()
    g = _next_up(r.clone())
    assert "flipped" in compare_rounded(g, r)


def test_a_rounded_intermediate_allows_one_more_step_and_no_more():
    """hc_pre rounds its collapse to bf16 before the RMSNorm: a one-ulp flip of that intermediate
    reaches the output as up to 2^-7 of its magnitude on top of the output's own rounding."""
    r = _row()
    g = r.clone()
    i = int(torch.argmax(r[1].float().abs()))
    g[1, i] = _next_up(g[1, i], 2)
    assert compare_rounded(g, r, inner=0)
    assert compare_rounded(g, r, inner=1) is None
    g[1, i] = _next_up(r[1, i], 4)
    assert "1 rounded intermediate" in compare_rounded(g, r, inner=1)


def test_router_rule_with_every_expert_selected():
    """k == E (the smooth preset routes to every expert): the tie rule compares the k picked
    scores alone; a swapped pair without a near tie still fails."""
    from deepinfer.ir.registry import get_op

    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(8)
    for k in (3, 8):
        ref = get_op("moe_router").ref(logits, bias, k=k, scale=1.5, renorm=True)
        assert tc.compare_router(ref, ref, logits, bias) is None
        swapped = (ref[0][:, [1, 0] + list(range(2, k))], ref[1])
        assert "without a near tie" in tc.compare_router(swapped, ref, logits, bias)
