"""No sm90 TileLang program at the medium plan's shapes copies global memory into shared memory an
element at a time behind a branch in each pass. A copy whose extent the CTA's threads do not
divide lowers that way, and each pass's load then waits for the pass before it: one memory
latency after another (the ws attention's copy of q cost 43 of them a row before the thirtieth
session; docs/performance.md)."""
import dataclasses
import re

import pytest

pytest.importorskip("tilelang")

from test_tilelang_moe_decode import moe_spec  # noqa: E402
from test_tilelang_render import _with_rope, attn_spec, gemm_spec  # noqa: E402

from deepinfer.codegen.targets import get_target  # noqa: E402
from deepinfer.codegen.template import select  # noqa: E402

# an unrolled pass whose body is `if (guard) { ((type*)shared)[...] = param[...]; ...`
GUARDED_COPY = re.compile(r"for \(int \w+ = 0; \w+ < (\d+); \+\+\w+\) \{\s*if \([^{]*\) \{\s*"
                          r"\(\(\w+\*\)(\w+)\)\[[^;]*\] = (\w+)\[")


def guarded_element_copies(text: str, params) -> list[tuple[str, str]]:
    """(shared buffer, global parameter) of every pass loop of more than one pass that copies an
    element from a kernel parameter into shared memory behind a branch of its own."""
    return [(m.group(2), m.group(3)) for m in GUARDED_COPY.finditer(text)
            if int(m.group(1)) > 1 and m.group(3) in params]


def test_the_pattern_is_found_where_it_was():
    """The ws attention's copy of q as TileLang lowered it over 384 threads (abridged)."""
    old = """  #pragma unroll
  for (int i = 0; i < 43; ++i) {
    if (((i * 3) + (((int)threadIdx.x) >> 7)) < 128) {
      ((bfloat16_t*)Q_l)[((i * 6) + (((int)threadIdx.x) >> 6))] = Q[((((int)blockIdx.x) * 32768) + i)];
    }
  }"""
    assert guarded_element_copies(old, {"Q"}) == [("Q_l", "Q")]
    # a single guarded load (one latency), a register destination, a guard-free pass: none
    assert guarded_element_copies(old.replace("i < 43", "i < 1"), {"Q"}) == []
    assert guarded_element_copies(old, {"K"}) == []
    assert guarded_element_copies(old.replace("if (((i * 3) + (((int)threadIdx.x) >> 7)) < 128) {", "{"),
                                  {"Q"}) == []


def _specs():
    sm90 = get_target("sm90")
    ws_off = dataclasses.replace(sm90, defaults=dict(sm90.defaults, tilelang_attention=dict(
        sm90.defaults["tilelang_attention"], prefill_ws=0)))
    prefill = attn_spec(4096, slots=1, pages=64, maxp=64)
    # decode (split) and prefill (single-role, ws) attention, lin8 at 64 and 4096 rows, the MoE
    # GEMM at decode and prefill: one program of each template the medium plan runs on sm90
    out = [(sm90, _with_rope(attn_spec(64))), (sm90, prefill), (ws_off, _with_rope(prefill))]
    out += [(sm90, gemm_spec(m, n, k)) for m, n, k in ((64, 5120, 8192), (4096, 4608, 5120))]
    out += [(sm90, moe_spec(rows)) for rows in (384, 4096)]
    # the prefill fp8 linears on gemm_fp8's register-operand program (off in sm90 until a plan
    # A/B; its byte scales took three guarded passes at K 5120)
    inflight = dataclasses.replace(sm90, defaults=dict(sm90.defaults, tilelang_gemm_fp8_bf16={
        "block_M": 256, "block_N": 128, "block_K": 64, "stages": 4, "threads": 256, "inflight": 1}))
    out += [(inflight, gemm_spec(4096, 4608, 5120))]
    return out


@pytest.mark.parametrize("k", range(8))
def test_medium_programs_copy_no_global_element_behind_a_branch_a_pass(k):
    target, spec = _specs()[k]
    tpl = select(target, spec)
    src = tpl.render(target, spec, tpl.default_config(target, spec))
    params = {p for p, _ in src.meta["params"]}
    assert guarded_element_copies(src.text, params) == [], (tpl.name, spec.op)
