"""ascend950's dspark_heads template on rendered source: selected over torch_device, AscendC that
passes the capacity check, reads the block hidden rows, the head in strided K chunks, the Markov
row of the previous token at a data-dependent row, and writes the drafts and confidences.
Rendered only: no CPU path runs TileLang-Ascend kernels, so numerics are unverified."""
from deepinfer.codegen.library.ascend_heads import BV, KC
from deepinfer.codegen.targets import TARGETS, get_manifest
from deepinfer.codegen.template import select, templates
from deepinfer.ir.types import tensor

from test_ascend_state import gm_reads, gm_writes, spec

TGT = TARGETS["ascend950"]
CHECK = get_manifest("ascend950").check


def heads(n, h=5120, v=129280, r=256, hb="bf16"):
    return spec("dspark_heads", [tensor(hb, n * 5, h), tensor("i64", n), tensor("bf16", h),
                                 tensor("bf16", v, h), tensor("bf16", v, r), tensor("bf16", v, r),
                                 tensor("bf16", 1, h + r)], {"block": 5, "eps": 1e-20})


def test_dspark_heads_renders_at_the_real_widths():
    s = heads(64)
    t = templates()["ascend_dspark_heads"]
    assert select(TGT, s).name == "ascend_dspark_heads"
    src = t.render(TGT, s, t.default_config(TGT, s))
    assert src.language == "ascendc" and src.entry == "dspark_heads_kernel" and CHECK(src, None) is None
    assert src.grid == (64,) and sum(src.meta["buffers"]["ub"]) <= TGT.ub_bytes
    assert gm_reads(src) == {"hb", "norm", "head", "membed", "mhead", "proj"}
    assert gm_writes(src) == {"drafts", "conf"}
    # the head tile: BV rows of KC columns, each a row of the [V, H] head (stride H elements)
    assert f"{BV}, {KC * 2}, 0, 0, 0, static_cast<asc_load_l2_cache_mode>(0), {5120 * 2}, {KC * 2})" in src.text
    assert f"head[((vt * {BV * 5120}) + (kc * {KC}))]" in src.text
    # the Markov row of the previous token: t* (first_tok, a scalar read) at s = 0, else the draft
    assert "first_tok[" in src.text and "membed[(prev * (int64_t)256)]" in src.text
    assert "rsqrt" in src.text  # the RMSNorm
    # the 64 per-thread maxima reduced with the lower id on equal values
    assert "== best) && (" in src.text and "< idx)" in src.text


def test_dspark_heads_declines_what_it_cannot_serve():
    t = templates()["ascend_dspark_heads"]
    assert not t.supports(TGT, heads(2, v=1000))  # the vocabulary no whole number of 64-row tiles
    assert not t.supports(TGT, heads(2, h=768))  # the hidden width no whole number of 512-column chunks
    assert not t.supports(TGT, heads(2, hb="f32"))
    two = spec("dspark_heads", [tensor("bf16", 10, 512), tensor("i64", 2), tensor("bf16", 512),
                                tensor("bf16", 1024, 512), tensor("bf16", 1024, 64), tensor("bf16", 1024, 64),
                                tensor("bf16", 2, 576)], {"block": 5, "eps": 1e-20})
    assert select(TGT, two).name == "torch_device"  # two confidence projections: not the model's


def test_real_model_draft_shapes_select_the_template():
    for n in (1, 8, 256):
        assert select(TGT, heads(n)).name == "ascend_dspark_heads"
