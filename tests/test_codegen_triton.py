"""Every Triton template against its op's reference semantics under the Triton interpreter, at
tiny sizes (codegen.library.triton_check states the tolerance rule).

Whether a `@triton.jit` function is interpreted is fixed when its module executes, and the
normal import of `triton_kernels` (by the template registry) makes compiled-mode functions. So
this module loads a second, private copy of the kernels' source with TRITON_INTERPRET=1 set,
independent of what else the session imported."""
import importlib.util
import os

import pytest
import torch

from deepinfer.codegen.library import triton_check, triton_ops


@pytest.fixture(scope="module")
def interp():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from deepinfer.codegen.library import triton_kernels

        spec = importlib.util.spec_from_file_location("_deepinfer_triton_kernels_interp", triton_kernels.__file__)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


CASES = sorted(triton_check.OUTPUT_KINDS) + ["rope_quant_fp4_e4m3"]


@pytest.mark.parametrize("op", CASES)
def test_template_matches_reference_interpreted(interp, op):
    ref_op = "rope_quant_fp4" if op == "rope_quant_fp4_e4m3" else op
    launch = getattr(interp, triton_ops.LAUNCHERS[ref_op])
    # small blocks so that the loops over chunks and the masks of partial tiles run too
    cfg = dict(triton_ops.TEMPLATES_BY_OP[ref_op].default_config(None, None))
    for k, v in dict(BLOCK_H=64, BLOCK=64, BH=32, BK=32, BM=16).items():
        if k in cfg:
            cfg[k] = v
    dims = dict(triton_check.TINY)
    msg = triton_check.check(op, launch, dims, dims["n"], cfg=cfg)
    assert msg is None, msg


def test_every_template_has_a_check_case():
    assert set(triton_ops.TEMPLATES_BY_OP) <= set(triton_check.OUTPUT_KINDS)
