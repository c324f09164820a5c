"""The GPU suite's TileLang cases (bench/kernels_tilelang.py, run by tests/gpu/test_tilelang_kernels.py
on the H200) build their programs here, with no GPU: a config the program does not take fails
here, not in a device call."""
import os
import sys

import pytest

pytest.importorskip("tilelang")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import kernels_tilelang as kt  # noqa: E402


@pytest.mark.parametrize("case", [c for c in kt.tiny_cases() + kt.real_cases()
                                  if c["template"] in ("tilelang_gemm_fp8_mma", "tilelang_gemm_fp8_persistent",
                                                      "tilelang_grouped_gemm_fp4_mma", "tilelang_grouped_gemm_fp4_bf16",
                                                      "tilelang_gemm_fp8_bf16", "tilelang_grouped_linear_bf16")],
                         ids=lambda c: c["name"])
def test_case_builds_its_program(case):
    progs = case["program"]()
    assert progs and all(callable(p) or hasattr(p, "script") for p in progs)


def test_inflight_check_edits_reach_the_program():
    """bench/inflight_check.py's rows edit the inflight program's CUDA as they say: the last K
    step's MMAs left in flight across the loop's exit (the thirty-seventh session's bug), or none
    in flight (a device call spent on an edit that matched nothing would report the program
    unchanged)."""
    import inflight_check as ic
    from deepinfer.codegen.library import tilelang_prefill_bf16 as pb
    from deepinfer.codegen.library.tilelang_gemm import lower

    gemm, _ = pb.gemm_programs(128, 512, 512, "bfloat16", dict(pb.ROWS_TILES, inflight=1))
    text = lower(gemm, "sm_90a")["src"]
    # two steps a loop pass; the last step waits for its own MMAs
    assert text.count("tl::wait_wgmma<1>();") == 2 and text.count("tl::wait_wgmma<0>();") == 1
    bug = ic.last_step_in_flight(text)
    # the last step's wait moved past the loop's end, before the epilogue's stores
    assert bug.count("tl::wait_wgmma<1>();") == 2 and bug.count("tl::wait_wgmma<0>();") == 1
    assert "kk == " not in bug and bug.index("tl::wait_wgmma<0>();") > bug.rindex("tl::wait_wgmma<1>();")
    assert bug.index("tl::wait_wgmma<0>();") < bug.index("= ((bfloat16_t)acc[")
    assert "tl::wait_wgmma<1>();" not in ic.no_mma_in_flight(text)
    assert all(edit is None or edit(text) != text for _, _, edit in ic.ROWS)
    assert len({n for n, _, _ in ic.ROWS}) == len(ic.ROWS)  # rows are told apart by name
