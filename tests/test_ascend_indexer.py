"""ascend950's indexer_topk template on rendered source: selected over torch_device for the three
forms of the V4.1 plans (plain top-k, candidate source emitting its pool, scoring inside a pool),
AscendC that passes the capacity check, reads the GM inputs it should (the metadata as scalars)
and writes its outputs, with the cube's q K^T, the 6-bit threshold passes and the chunked
selection. Rendered only: no CPU path runs TileLang-Ascend kernels, so numerics are unverified."""
import re

import pytest

from deepinfer.codegen.library.ascend_indexer import BI, NEG_KEY, indexer_chunk, indexer_dims, indexer_plan
from deepinfer.codegen.targets import TARGETS, get_manifest
from deepinfer.codegen.template import select, templates
from deepinfer.ir.types import quantized, tensor

from test_ascend_state import gm_reads, gm_writes, spec

TGT = TARGETS["ascend950"]
CHECK = get_manifest("ascend950").check


def indexer(n, variant, pe=64, maxp=8, nseq=2, k=64, tb=32, wdt="bf16"):
    ins = [quantized("fp4e2m1", (n, 32, 128), "e8m0", (1, 1, 32)), tensor(wdt, n, 32),
           quantized("fp4e2m1", (64, pe, 128), "e8m0", (1, 1, 32)), tensor("i64", n), tensor("i32", n),
           tensor("i32", nseq, maxp)]
    attrs = {"ratio": 2, "k": k, "w_scale": 0.015625}
    if variant == "emit":
        attrs.update(ratio=1, emit_candidates=True, topk_blocks=tb)
    if variant == "pool":
        attrs.update(ratio=1)
        ins.append(tensor("i32", n, tb))
    return spec("indexer_topk", ins, attrs)


def params(src) -> dict:
    sig = re.search(r"__global__ __mix__\(1, 2\) void \w+\((.*?)\)", src.text).group(1)
    return {m.group(2): m.group(1) for m in re.finditer(r"__gm__ (\w+)\* (\w+)", sig)}


def rendered(s):
    t = templates()["ascend_indexer_topk"]
    assert select(TGT, s).name == "ascend_indexer_topk"
    src = t.render(TGT, s, t.default_config(TGT, s))
    assert src.language == "ascendc" and src.entry == "indexer_topk_kernel" and CHECK(src, None) is None
    return src


@pytest.mark.parametrize("variant", ["plain", "emit", "pool"])
def test_indexer_topk_renders_each_form(variant):
    s = indexer(4, variant)
    src = rendered(s)
    p = params(src)
    qk = {"qi", "qi_scale", "w", "ik", "ik_scale"}
    assert set(p) == qk | {"positions", "token_seq", "block_table", "top"} | (
        {"pool_out"} if variant == "emit" else {"cand"} if variant == "pool" else set())
    assert gm_reads(src) == qk | ({"cand"} if variant == "pool" else set())
    assert gm_writes(src) == {"top"} | ({"pool_out"} if variant == "emit" else set())
    # the row's visible count and its pages come from the metadata, read as scalars
    ratio = s.attr["ratio"]
    assert "positions[" in src.text and "block_table[" in src.text and "token_seq[" in src.text
    assert (">> (int64_t)1)" in src.text) == (ratio == 2)  # (pos + 1) // 2
    # q K^T on the cube, [32 heads, 64 entries] into L0C, B transposed
    assert "ascend_gemm_l1<32, 128, 64, 128, true" in src.text
    # the score's order key: -inf's key for entries not visible (or outside the pool); the
    # threshold found 6 bits a pass by 64 threads
    assert str(NEG_KEY) in src.text and "(26 - (ps" in src.text and "cce::dim3(64)" in src.text
    if variant == "emit":
        assert "2139095040" in src.text  # the newest block pinned to +inf's key
        assert "!= -2139095041" in src.text  # picked -inf blocks dropped
    if variant == "pool":
        assert "!= 0)" in src.text  # block membership gates the score
    ub = src.meta["buffers"]["ub"]
    assert sum(ub) <= TGT.ub_bytes and src.grid == (4,)


def test_indexer_topk_chunks_long_rows():
    """65536 entries a row (the real model's ratio-1 cache): the keys go chunk by chunk, each
    chunk's positions offset by its start, and the chunk is the largest whose plan (SIMT context included) fits the UB."""
    s = indexer(64, "pool", pe=128, maxp=512, nseq=64, k=512, tb=2048)
    d = indexer_dims(s)
    chunk = indexer_chunk(d, TGT)
    assert d["cap"] == 65536 and BI <= chunk < d["cap"] and chunk % 32 == 0
    src = rendered(s)
    assert src.meta["config"]["chunk"] == chunk and src.grid == (64,)
    assert f"(ci_1 * {chunk}) + i_1) - held)" in src.text  # a chunk entry's position
    # the largest chunk that fits: twice it would not
    assert sum(src.meta["buffers"]["ub"]) <= TGT.ub_bytes
    assert sum(indexer_plan(d, 2 * chunk, TGT.cores)["buffers"]["ub"]) > TGT.ub_bytes


def test_indexer_topk_declines_what_it_cannot_serve():
    t = templates()["ascend_indexer_topk"]
    # k not a multiple of 32 (the pick buffers keep the vector sort's 32-element groups)
    assert not t.supports(TGT, indexer(4, "plain", k=48))
    assert select(TGT, indexer(4, "plain", k=48)).name == "torch_device"
    # pages of 32 entries: a 64-entry cube block would straddle pages
    assert not t.supports(TGT, indexer(4, "plain", pe=32))
    # a pool of 40 blocks: not whole 32-element groups
    assert not t.supports(TGT, indexer(4, "emit", tb=40))


@pytest.mark.parametrize("variant,ratio", [("plain", 2), ("emit", 1), ("pool", 1)])
def test_real_model_indexer_shapes_select_the_template(variant, ratio):
    """Selection only: the real model's decode and largest prefill shapes of each form."""
    pe = 64 if ratio == 2 else 128
    for n, nseq in ((1, 1), (256, 256), (8192, 257)):
        s = indexer(n, variant, pe=pe, maxp=512, nseq=nseq, k=512, tb=2048)
        assert select(TGT, s).name == "ascend_indexer_topk"
