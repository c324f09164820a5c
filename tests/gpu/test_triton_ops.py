"""Triton templates on an NVIDIA GPU (the H200 machine), compiled for real, against their ops'
reference semantics (computed on the CPU): tiny sizes, and real V4.1-Flash widths at decode
batch 1 and 64 and a 4096-token prefill. Tolerances: codegen.library.triton_check.

Run: python -m pytest -m gpu tests/gpu/test_triton_ops.py
"""
import pytest
import torch

from deepinfer.codegen.library import triton_check, triton_ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

OPS = triton_check.CASES
_launcher = triton_check.launcher


@pytest.mark.parametrize("op", OPS)
def test_tiny(op):
    dims = triton_check.TINY
    msg = triton_check.check(op, _launcher(op), dims, dims["n"], device="cuda")
    assert msg is None, msg


@pytest.mark.parametrize("n", [1, 64, 4096], ids=["decode1", "decode64", "prefill4k"])
@pytest.mark.parametrize("op", OPS)
def test_real_widths(op, n):
    msg = triton_check.check(op, _launcher(op), triton_check.REAL, n, device="cuda", seed=n)
    assert msg is None, msg


@pytest.mark.parametrize("op", ["rms_norm_quant_fp8", "hc_pre", "rope_quant_fp8", "moe_router", "engram_gate"])
def test_every_knob_point_of_the_space_agrees(op):
    """Each config of the tuning space is a different kernel; all of them must match. Spaces of
    more than 32 points (hc_pre: 648) are checked on a seeded sample of 32 that holds every value
    of every knob."""
    t = triton_ops.TEMPLATES_BY_OP[op]
    dims = dict(triton_check.REAL)
    configs = list(t.configs(None, None))
    if len(configs) > 32:
        import random

        pick = random.Random(0).sample(configs, 32)
        for knob, values in t.knobs.items():  # every value of every knob at least once
            for v in values:
                if not any(c[knob] == v for c in pick):
                    pick.append(next(c for c in configs if c[knob] == v))
        configs = pick
    for cfg in configs:
        msg = triton_check.check(op, _launcher(op), dims, 64, device="cuda", cfg=cfg)
        assert msg is None, f"{cfg}: {msg}"


@pytest.mark.parametrize("n", [1, 8, 40, 64])
@pytest.mark.parametrize("op,dims", [("grouped_linear", {}), ("linear", {"E": 129280})], ids=["wo_a", "head"])
def test_block_linear_rows_at_real_widths(op, dims, n):
    """block_linear_rows_kernel (WL) as the plan takes it for wo_a and the LM head at decode rows:
    compiled for the GPU (bf16 MMAs with the weight widened in registers), against the reference."""
    cfg = dict(triton_ops.default_config(op, n), **triton_ops.BLOCK_LINEAR_WL)
    msg = triton_check.check(op, _launcher(op), dict(triton_check.REAL, **dims), n, device="cuda", seed=n, cfg=cfg)
    assert msg is None, msg
