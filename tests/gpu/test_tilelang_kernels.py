"""TileLang templates vs their ops' reference semantics on the GPU (fresh random inputs, tiny and
real V4.1 shapes). Skipped on CPU; run on the H200 with `pytest -m gpu tests/gpu`."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import kernels_tilelang as kt  # noqa: E402

pytest.importorskip("tilelang")

CASES = kt.tiny_cases() + kt.real_cases()


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_template_matches_op_reference(case):
    kernels = [kt.tlg.compile_kernel(p) for p in case["program"]()]
    x = case["inputs"]()
    out = case["run"](kernels, x)
    torch.cuda.synchronize()
    mx, _ = kt.rel_err(out.float(), case["ref"](x).float())
    assert mx <= case["tol"], f"max relative error {mx:.3e} > {case['tol']}"
