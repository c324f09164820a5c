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
