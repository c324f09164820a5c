"""ascend950's vector-core templates for the state, Engram and MoE-routing ops, on rendered source:
each is selected over torch_device, renders AscendC, passes the capacity check, reads the GM
inputs it should and writes its outputs (state buffers in place, no copy of them); shapes it
cannot serve are declined. Rendered only: no CPU path runs TileLang-Ascend kernels, so numerics
are unverified here."""
import re

import pytest

from deepinfer.codegen.library.ascend_common import SIMT_CONTEXT_BYTES
from deepinfer.codegen.targets import TARGETS, get_manifest
from deepinfer.codegen.template import KernelSource, KernelSpec, select, templates
from deepinfer.ir.registry import get_op
from deepinfer.ir.types import quantized, tensor

TGT = TARGETS["ascend950"]
CHECK = get_manifest("ascend950").check


def spec(op, ins, attrs):
    a = get_op(op).check_attrs(attrs)
    return KernelSpec(op, tuple(sorted(a.items())), tuple(ins), tuple(get_op(op).infer_types(ins, a)))


def rendered(s, name):
    t = templates()[name]
    assert select(TGT, s).name == name
    src = t.render(TGT, s, t.default_config(TGT, s))
    assert src.language == "ascendc" and f"{s.op}_kernel" in src.text and src.entry == f"{s.op}_kernel"
    assert CHECK(src, None) is None
    return src


def params(src) -> dict:
    """The kernel's GM parameters: name -> element type."""
    sig = re.search(r"__global__ __vector__ void \w+\((.*?)\)", src.text).group(1)
    return {m.group(2): m.group(1) for m in re.finditer(r"__gm__ (\w+)\* (\w+)", sig)}


def gm_reads(src) -> set:
    return set(re.findall(r"asc_copy_gm2ub_align\([^;]*?\(__gm__ \w+\*\)\(\(&\((\w+)\[", src.text))


def gm_writes(src) -> set:
    return set(re.findall(r"asc_copy_ub2gm_align\(\(__gm__ \w+\*\)\(\(&\((\w+)\[", src.text))


META = (tensor("i64", 8), tensor("i32", 8))  # positions, token_seq


def test_engram_hash_is_the_multiplicative_xor_hash_in_int64():
    mult, primes = (7, 11, 13), (101, 103, 107, 109)
    offs = (0, 101, 204, 311)
    s = spec("engram_hash", [tensor("i64", 256, 3)], {"multipliers": mult, "primes": primes, "offsets": offs,
                                                        "heads": 2})
    src = rendered(s, "ascend_engram_hash")
    assert params(src) == {"grams": "int64_t", "table_rows": "int64_t"}
    assert gm_reads(src) == {"grams"} and gm_writes(src) == {"table_rows"}
    # the constants are folded per column: every prime appears as a floor-mod operand
    assert all(f"% (int64_t){p})" in src.text for p in primes) and "^" in src.text
    assert src.grid == (64,)  # 256 rows in 4-row tiles spread over the cores
    # a 4-column output row of one grams row is 32 B: tiles are aligned; one row of 2 columns is not
    odd = spec("engram_hash", [tensor("i64", 1, 2)], {"multipliers": (7, 11), "primes": (101, 103),
                                                        "offsets": (0, 101), "heads": 2})
    assert not templates()["ascend_engram_hash"].supports(TGT, odd) and select(TGT, odd).name == "torch_device"


def test_engram_gather_copies_table_rows_and_packs_their_scales():
    s = spec("engram_gather", [tensor("i64", 8, 4), quantized("fp8e4m3", (100000, 256), "e8m0", (1, 32))], {})
    src = rendered(s, "ascend_engram_gather")
    assert set(params(src)) == {"cols", "table", "table_scale", "out", "out_scale"}
    assert gm_reads(src) == {"cols", "table", "table_scale"} and gm_writes(src) == {"out", "out_scale"}
    # each column's 8-byte scale row lands in its own granule before packing: 4 x 32 B
    assert 4 * 32 in src.meta["buffers"]["ub"] and SIMT_CONTEXT_BYTES in src.meta["buffers"]["ub"]
    odd = spec("engram_gather", [tensor("i64", 8, 3), quantized("fp8e4m3", (1000, 64), "e8m0", (1, 32))], {})
    assert not templates()["ascend_engram_gather"].supports(TGT, odd)  # 3 x 2 scale bytes: no whole granule


def test_engram_history_ops_read_and_write_the_ring():
    ids = spec("engram_ngram_ids", [tensor("i64", 8), tensor("i64", 5, 9), *META, tensor("i32", 8)],
               {"max_ngram": 4, "pad": 2})
    src = rendered(ids, "ascend_engram_ngram_ids")
    assert gm_reads(src) == {"cids", "hist", "positions", "token_seq", "seq_slots"} and gm_writes(src) == {"grams"}
    assert "== (int64_t)-1)" in src.text  # the DEAD id blocks the n-gram
    write = spec("engram_hist_write", [tensor("i64", 5, 9), tensor("i64", 8), *META, tensor("i32", 8)], {})
    src = rendered(write, "ascend_engram_hist_write")
    assert set(params(src)) == {"hist", "cids", "positions", "token_seq", "seq_slots"}  # in place: no output
    assert gm_writes(src) == {"hist"} and "hist" not in gm_reads(src)
    huge = spec("engram_hist_write", [tensor("i64", 5, 9), tensor("i64", 20000), tensor("i64", 20000),
                                      tensor("i32", 20000), tensor("i32", 20000)], {})
    assert not templates()["ascend_engram_hist_write"].supports(TGT, huge)  # the metadata outgrows the UB


def test_engram_gate_reads_stream_kv_and_weights():
    s = spec("engram_gate", [tensor("bf16", 2, 4, 256), tensor("bf16", 2, 5 * 256), tensor("bf16", 4, 256),
                             tensor("bf16", 4, 256), tensor("i64", 2)], {"eps": 1e-20, "image_token_id": 9})
    src = rendered(s, "ascend_engram_gate")
    assert gm_reads(src) == {"r", "kv", "q_weight", "k_weight", "ids"} and gm_writes(src) == {"out"}
    assert "rsqrtf" in src.text and "expf" in src.text and "== (int64_t)9)" in src.text
    assert src.grid == (8,)  # one (row, copy) pair per core


def test_ring_and_cache_writers_write_state_in_place():
    ring = quantized("fp8e4m3", (5, 134, 512), "e8m0", (1, 1, 32))
    swa = spec("swa_write", [ring, quantized("fp8e4m3", (8, 512), "e8m0", (1, 32)), *META, tensor("i32", 8)], {})
    src = rendered(swa, "ascend_swa_write")
    assert set(params(src)) == {"ring_data", "ring_scale", "kv", "kv_scale", "positions", "token_seq", "seq_slots"}
    assert gm_writes(src) == {"ring_data", "ring_scale"}
    assert gm_reads(src) == {"kv", "kv_scale", "positions", "token_seq", "seq_slots"}
    assert "% (int64_t)134)" in src.text  # slot = position mod ring length

    st = spec("compress_state_write", [tensor("f32", 5, 7, 2, 512), tensor("f32", 8, 512), tensor("f32", 8, 512),
                                       *META, tensor("i32", 8)], {})
    src = rendered(st, "ascend_compress_state_write")
    assert gm_writes(src) == {"state"} and gm_reads(src) == {"l", "s", "positions", "token_seq", "seq_slots"}

    for cache, rows, ratio in ((quantized("fp4e2m1", (16, 64, 128), "e8m0", (1, 1, 32)),
                                quantized("fp4e2m1", (8, 128), "e8m0", (1, 32)), 4),
                               (quantized("fp4e2m1", (16, 128, 512), "fp8e4m3", (1, 1, 16)),
                                quantized("fp4e2m1", (8, 512), "fp8e4m3", (1, 16)), 1)):
        cw = spec("compressed_write", [cache, rows, *META, tensor("i32", 2, 8)], {"ratio": ratio})
        src = rendered(cw, "ascend_compressed_write")
        assert gm_writes(src) == {"cache", "cache_scale"}
        assert gm_reads(src) == {"rows", "rows_scale", "positions", "token_seq", "block_table"}
        assert f"% (int64_t){ratio})" in src.text or ratio == 1
    # the real model's prefill buckets: 257 sequences' block tables (514 KiB) are no UB buffer;
    # the kernel reads the one 32-byte granule of the table row holding the entry's page
    big = spec("compressed_write", [quantized("fp4e2m1", (32768, 128, 512), "fp8e4m3", (1, 1, 16)),
                                    quantized("fp4e2m1", (8192, 512), "fp8e4m3", (1, 16)), tensor("i64", 8192),
                                    tensor("i32", 8192), tensor("i32", 257, 512)], {"ratio": 1})
    src = rendered(big, "ascend_compressed_write")
    assert 32 in src.meta["buffers"]["ub"] and 257 * 512 * 4 not in src.meta["buffers"]["ub"]
    assert gm_reads(src) == {"rows", "rows_scale", "positions", "token_seq", "block_table"}
    assert re.search(r"asc_copy_gm2ub_align\([^;]*block_table\[[^;]*\* \(int64_t\)512\) \+ \(min\(", src.text)
    # a 24-byte ring row is no whole granule: declined, torch serves it
    odd = spec("swa_write", [quantized("fp8e4m3", (5, 6, 24), "e8m0", (1, 1, 8)),
                             quantized("fp8e4m3", (8, 24), "e8m0", (1, 8)), *META, tensor("i32", 8)], {})
    assert select(TGT, odd).name == "torch_device"


def test_compress_pool_norm_reads_the_state_ring_and_normalises():
    s = spec("compress_pool_norm", [tensor("f32", 8, 512), tensor("f32", 8, 512), tensor("f32", 5, 7, 2, 512),
                                    *META, tensor("i32", 8), tensor("bf16", 512)], {"ratio": 4, "eps": 1e-20})
    src = rendered(s, "ascend_compress_pool_norm")
    assert gm_reads(src) == {"l", "s", "state", "positions", "token_seq", "seq_slots", "norm_w"}
    assert gm_writes(src) == {"out"} and "expf" in src.text and "rsqrtf" in src.text
    assert "% (int64_t)4)" in src.text  # the row completing an entry: (pos + 1) mod ratio == 0


def test_moe_routing_templates():
    r = spec("moe_router", [tensor("f32", 64, 384), tensor("f32", 384), tensor("f32", 384), tensor("i64", 64)],
             {"k": 6, "scale": 1.5, "renorm": True, "image_token_id": 7})
    src = rendered(r, "ascend_moe_router")
    assert gm_reads(src) == {"logits", "bias", "bias_vl", "ids"} and gm_writes(src) == {"sel", "weights"}
    assert "log1pf" in src.text and "sqrtf" in src.text
    plain = spec("moe_router", [tensor("f32", 5, 128), tensor("f32", 128)], {"k": 3, "scale": 1.5, "renorm": True})
    assert select(TGT, plain).name == "ascend_moe_router"

    p = spec("moe_permute", [tensor("i32", 64, 6)], {"n_experts": 384})
    src = rendered(p, "ascend_moe_permute")
    assert gm_reads(src) == {"sel"} and gm_writes(src) == {"order", "offsets"} and src.grid == (1,)

    g = spec("moe_gather_rows", [quantized("fp8e4m3", (8, 5120), "e8m0", (1, 32)), tensor("i32", 48)], {"k": 6})
    src = rendered(g, "ascend_moe_gather_rows")
    assert gm_reads(src) == {"x", "x_scale", "pair_ids"} and gm_writes(src) == {"out", "out_scale"}

    c = spec("moe_combine", [tensor("bf16", 48, 5120), tensor("i32", 48), tensor("i32", 385), tensor("i32", 8, 6)],
             {"k": 6})
    src = rendered(c, "ascend_moe_combine")
    assert {"y", "pair_ids"} <= gm_reads(src) and gm_writes(src) == {"out"}
    # the real model's largest prefill (8192 tokens x 6 lanes): the selection and the pair ids are
    # streamed in chunks (one DMA per chunk, in pair order), the sorted ids stay whole in the UB
    for n in (4096, 8192):
        p = spec("moe_permute", [tensor("i32", n, 6)], {"n_experts": 384})
        src = rendered(p, "ascend_moe_permute")
        chunk = src.meta["buffers"]["ub"][0] // 4
        assert n * 6 % chunk == 0 and (chunk == n * 6 or f"sel[(ci * {chunk})]" in src.text)
        assert (n, chunk < n * 6) in ((4096, False), (8192, True))
        assert n * 6 * 4 in src.meta["buffers"]["ub"]  # the whole order
        assert sum(src.meta["buffers"]["ub"]) <= TGT.ub_bytes
        c = spec("moe_combine", [tensor("bf16", n * 6, 5120), tensor("i32", n * 6), tensor("i32", 385),
                                 tensor("i32", n, 6)], {"k": 6})
        src = rendered(c, "ascend_moe_combine")
        chunk = src.meta["buffers"]["ub"][0] // 4
        assert n * 6 % chunk == 0 and sum(src.meta["buffers"]["ub"]) <= TGT.ub_bytes
        assert gm_reads(src) == {"y", "pair_ids"} and gm_writes(src) == {"out"}
        assert chunk == n * 6 or f"pair_ids[(ci * {chunk})]" in src.text
    # a draft step's 5 rows x 6 lanes (120 B, no whole granule) are one padded copy of the selection
    odd = spec("moe_permute", [tensor("i32", 5, 6)], {"n_experts": 384})
    assert rendered(odd, "ascend_moe_permute").meta["buffers"]["ub"][0] == 128
    # 100k pairs' sorted ids alone outgrow the UB: declined
    big = spec("moe_permute", [tensor("i32", 20000, 6)], {"n_experts": 384})
    assert not templates()["ascend_moe_permute"].supports(TGT, big)


def test_simt_kernels_charge_the_thread_context_to_the_ub():
    """TileLang-Ascend reserves 32 KiB of UB for SIMT thread context: a plan that leaves it out can
    pass the 248 KiB check and still fail TileLang's own scheduling."""
    r = spec("moe_router", [tensor("f32", 4096, 384), tensor("f32", 384), tensor("f32", 384), tensor("i64", 4096)],
             {"k": 6, "scale": 1.5, "renorm": True, "image_token_id": 7})
    from deepinfer.codegen.library.ascend_moe_route import _router_plan, _router_tile

    bm = _router_tile(4096, 384, 6, TGT.cores, True, TGT.ub_bytes)
    assert bm < 64 and templates()["ascend_moe_router"].supports(TGT, r)
    full = _router_plan(4096, 384, 6, 64, True)
    assert SIMT_CONTEXT_BYTES in full["ub"]
    assert "exceed" in CHECK(KernelSource("ascendc", "k", "", grid=(64,), meta={"buffers": full}), None)


@pytest.mark.parametrize("op", ["swa_write", "compressed_write", "moe_gather_rows"])
def test_real_model_shapes_select_the_ascend_templates(op):
    """Selection only (rendering the real shapes is the coverage script's job): the decode-batch
    shapes of the real model's plan pick the generated template, not torch_device."""
    shapes = {
        "swa_write": spec("swa_write", [quantized("fp8e4m3", (77, 134, 512), "e8m0", (1, 1, 32)),
                                        quantized("fp8e4m3", (64, 512), "e8m0", (1, 32)), tensor("i64", 64),
                                        tensor("i32", 64), tensor("i32", 64)], {}),
        "compressed_write": spec("compressed_write", [quantized("fp4e2m1", (1024, 128, 512), "fp8e4m3", (1, 1, 16)),
                                                      quantized("fp4e2m1", (4096, 512), "fp8e4m3", (1, 16)),
                                                      tensor("i64", 4096), tensor("i32", 4096),
                                                      tensor("i32", 65, 64)], {"ratio": 1}),
        "moe_gather_rows": spec("moe_gather_rows", [quantized("fp8e4m3", (4096, 5120), "e8m0", (1, 32)),
                                                    tensor("i32", 24576)], {"k": 6}),
    }
    assert select(TGT, shapes[op]).name == f"ascend_{op}"
