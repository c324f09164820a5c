"""TileLang templates render on the CPU for sm90/sm100 through the registry, and their sm90 builds
have the instructions they are meant to use and no register spills (ptxas report)."""
import re
import shutil

import torch

import pytest

pytest.importorskip("tilelang")

from deepinfer.codegen.targets import get_target  # noqa: E402
from deepinfer.codegen.template import KernelSpec, select, templates  # noqa: E402
from deepinfer.ir.types import quantized, tensor  # noqa: E402


def gemm_spec(m, n, k):
    return KernelSpec("gemm_fp8", (("out_dtype", "bf16"),),
                      (quantized("fp8e4m3", (m, k), "e8m0", (1, 32)), quantized("fp8e4m3", (n, k), "e8m0", (32, 32))),
                      (tensor("bf16", m, n),))


def attn_spec(n, slots=64, pages=512, maxp=16):
    return KernelSpec(
        "sparse_attn", (("ratio", 2), ("topk", 512), ("window", 128)),
        (tensor("bf16", n, 64, 512), quantized("fp8e4m3", (n, 512), "e8m0", (1, 32)),
         quantized("fp8e4m3", (slots, 134, 512), "e8m0", (1, 1, 32)),
         quantized("fp4e2m1", (pages, 64, 512), "fp8e4m3", (1, 1, 16)), tensor("i32", n, 512), tensor("f32", 64),
         tensor("i64", n), tensor("i32", n), tensor("i32", slots), tensor("i32", slots, maxp)),
        (tensor("bf16", n, 64, 512),))


def test_registered():
    names = set(templates())
    assert {"tilelang_gemm_fp8", "tilelang_linear", "tilelang_grouped_gemm_fp4", "tilelang_sparse_attn",
            "tilelang_window_attn", "tilelang_dspark_block_attn", "tilelang_indexer_scores"} <= names


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_gemm_fp8_renders(target):
    t = get_target(target)
    spec = gemm_spec(64, 1280, 5120)
    tpl = select(t, spec)
    assert tpl.name == "tilelang_gemm_fp8"
    cfg = tpl.default_config(t, spec)
    src = tpl.render(t, spec, cfg)
    assert src.language == "cuda" and src.entry and cfg["split_k"] > 1
    assert ("wgmma" in src.text) == (target == "sm90")
    if target == "sm90":  # the decode program: N tiles x splits, the splits added by a second kernel
        assert src.grid == (1280 // cfg["block_N"], cfg["split_k"], 1) and src.meta["rows_argument"]
        assert "combine" in src.meta
    else:
        assert src.grid[2] == cfg["split_k"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_sm90_builds_without_spills():
    from deepinfer.codegen.library.tilelang_gemm import nvcc_report

    t = get_target("sm90")
    for spec in (gemm_spec(64, 1280, 5120), attn_spec(64)):
        tpl = select(t, spec)
        src = tpl.render(t, spec, tpl.default_config(t, spec))
        assert "wgmma" in src.text
        texts = [src.text] + ([src.meta["combine"]["text"]] if "combine" in src.meta else [])
        for text in texts:
            rep = nvcc_report(text, t.arch)
            assert rep["ok"], rep["log"]
            assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]
        if spec.op == "gemm_fp8":
            _decode_gemm_reads_the_live_rows(t, tpl, spec, src)


def _decode_gemm_reads_the_live_rows(t, tpl, spec, src):
    """The decode GEMM takes its row count as an argument: the activation and its scales are
    loaded through predicated copies (rows past m read as zeros, never from memory), and a
    one-row call's host recipe is the GEMM and the in-order split sum, with nothing padded,
    zeroed or cast around them."""
    import torch

    from deepinfer.codegen.host_recipe import record_tilelang
    from deepinfer.ir.quant import QTensor

    cfg = src.meta["config"]
    assert ("m", "int") in _signature(src)
    assert src.text.count("cp_async_gs_conditional") >= 2 and "< m)" in src.text
    assert "atomicAdd" not in src.text and "AtomicAdd" not in src.text
    kernel = {"template": tpl.name, "config": cfg, "meta": src.meta, "grid": list(src.grid), "language": "cuda"}
    with torch.device("meta"):
        x = QTensor(torch.empty(1, 5120, dtype=torch.float8_e4m3fn), torch.empty(1, 160, dtype=torch.uint8))
        w = QTensor(torch.empty(1280, 5120, dtype=torch.float8_e4m3fn), torch.empty(40, 160, dtype=torch.uint8))
        rec, (out,) = record_tilelang(tpl.host, kernel, [x, w], {"out_dtype": "bf16"}, [False])
    assert tuple(out.shape) == (1, 1280) and out.dtype == torch.bfloat16
    kernels = [s for s in rec["steps"] if "launch" in s or not s["op"].startswith(("aten.empty", "aten.view",
                                                                                  "aten._reshape", "aten.reshape"))]
    assert [s.get("launch") for s in kernels] == [0, 1], kernels
    assert [s["args"][-1] for s in kernels] == [1, 1]  # m = 1, the last parameter of both kernels
    assert kernels[1]["grid"] == [1280 // 256, 64 // 8, 1] and cfg["split_k"] > 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_sm100_gemm_fp8_scales_inside_the_block_scaled_mma():
    """sm100: the tcgen05 mxf8f6f4 block-scaled MMA with the ue8m0 scales in tensor memory (no
    promotion in registers), for decode (split K) and prefill rows; built without spills. K steps
    that are not 128 deep keep the promotion program."""
    from deepinfer.codegen.library.tilelang_gemm import nvcc_report

    t = get_target("sm100")
    for spec in (gemm_spec(64, 1280, 5120), gemm_spec(256, 1024, 512)):
        tpl = select(t, spec)
        cfg = tpl.default_config(t, spec)
        src = tpl.render(t, spec, cfg)
        assert "tcgen05mma_blockscaled_ss<tl::DataType::kFloat8_e4m3" in src.text and "tcgen05_cp" in src.text
        assert "wgmma" not in src.text and src.grid[2] == cfg["split_k"]
        # the [rows, K/32] scale bytes are read as [rows, K/128] words: four K-blocks per word
        assert dict((n, ty.removeprefix("const ")) for n, ty in _signature(src))["SA"] == "uint*"
        rep = nvcc_report(src.text, t.arch)
        assert rep["ok"], rep["log"]
        assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]
    assert tpl.default_config(t, gemm_spec(64, 1280, 5120))["split_k"] > 1
    spec = gemm_spec(64, 1280, 160)
    src = select(t, spec).render(t, spec, select(t, spec).default_config(t, spec))
    assert "tcgen05mma_blockscaled" not in src.text


# ---- rendered structure (not bytes): entry, parameters, launch shape, shared memory, MMAs -------

def _signature(src):
    """[(name, C type)] of the entry's parameters, read from the rendered CUDA."""
    import re

    m = re.search(r'extern "C" __global__ void (?:__launch_bounds__\(\d+(?:, \d+)?\) )?' + src.entry + r"\(([^)]*)\)",
                  src.text)
    assert m, f"no __global__ {src.entry} in the source"
    out = []
    for p in m.group(1).split(","):
        words = p.replace("__restrict__", "").split()
        out.append((words[-1], " ".join(words[:-1])))
    return out


GEMM_PARAMS = [("A", "const fp8_e4_t*"), ("B", "const fp8_e4_t*"), ("SA", "const uchar*"), ("SB", "const uchar*")]


@pytest.mark.slow  # a TileLang lowering takes 10-50 s of one core
@pytest.mark.parametrize("m,out_ctype,grid", [
    (64, "float*", (20, 8, 1)),  # decode: the row count an argument, split K into fp32 partials
    (4096, "bfloat16_t*", (10, 32, 1)),  # prefill: 128x128 tiles, bf16 out
])
def test_gemm_fp8_sm90_structure(m, out_ctype, grid):
    t = get_target("sm90")
    spec = gemm_spec(m, 1280, 5120)
    tpl = select(t, spec)
    cfg = tpl.default_config(t, spec)
    src = tpl.render(t, spec, cfg)
    params = _signature(src)
    decode = m == 64
    assert sorted(params) == sorted(GEMM_PARAMS + [("C", out_ctype)] + ([("m", "int")] if decode else []))
    assert src.grid == grid
    assert src.block == (cfg["threads"], 1, 1) and 0 < src.smem_bytes <= t.smem_bytes
    assert src.meta.get("rows_argument", False) == decode and src.meta["mnk"] == (m, 1280, 5120)
    assert src.text.count("__shared__") == 1  # one dynamic arena; the pipeline's stages are carved from it
    assert "wgmma" in src.text and " mma." not in src.text  # Hopper warpgroup MMAs, not the Ampere ones


@pytest.mark.slow
def test_sparse_attn_sm90_structure():
    t = get_target("sm90")
    spec = attn_spec(64)
    tpl = select(t, spec)
    cfg = tpl.default_config(t, spec)
    src = tpl.render(t, spec, cfg)
    assert tpl.name == "tilelang_sparse_attn" and src.entry == "attn_kernel"
    params = dict(_signature(src))
    # (sm90 reads the key buffers through 32-bit words: kwords, test_decode_keys_widen_a_word_at_a_time)
    assert params == {"Q": "const bfloat16_t*", "KV": "const uint*", "KVS": "const uint*",
                      "RING": "const uint*", "RINGS": "const uint*", "CKV": "const uint*",
                      "CKVS": "const uint*", "TOP": "const int*", "POS": "const int64_t*", "TSEQ": "const int*",
                      "SLOTS": "const int*", "BT": "const int*", "OP": "float*", "ML": "float*"}
    # rows x splits of the key range; each split writes partial outputs and (max, sum) for the combine
    assert src.grid == (64, cfg["splits"], 1) and src.block == (cfg["threads"], 1, 1)
    assert 0 < src.smem_bytes <= t.smem_bytes and src.text.count("__shared__") == 1 and "wgmma" in src.text
    assert src.meta["dims"]["topk"] == 512 and src.meta["dims"]["window"] == 128
    assert "combine_kernel" in str(src.meta["combine"])
    # keys are gathered a row piece at a time (16 bytes of fp4 codes or of fp8 values), not byte by byte
    assert "*(uint4*)(CKV" in src.text and "*(uint4*)(RING" in src.text


@pytest.mark.parametrize("op,n", [("sparse_attn", 1), ("sparse_attn", 64), ("window_attn", 1), ("dspark_block_attn", 64)])
def test_decode_keys_widen_a_word_at_a_time(op, n):
    """`kwords` in a target's tilelang_attention defaults (sm90 sets it): the decode program reads
    each key from its one source through 32-bit words and widens 8 values a call (the fp8 window
    keys by deepinfer_fp8x8_bf16n, the fp4 compressed ones by deepinfer_fp4x8_bf16n), where the
    element-wise path read both fp8 sources and converted a value at a time. Off, it is that
    path. Its sparse programs (the widest: both key kinds) build for sm_90a without spills."""
    import dataclasses

    on = get_target("sm90")
    assert on.defaults["tilelang_attention"]["kwords"] == 1
    off = dataclasses.replace(on, defaults=dict(on.defaults, tilelang_attention={
        k: v for k, v in on.defaults["tilelang_attention"].items() if k != "kwords"}))
    spec = attn_spec(n)
    if op != "sparse_attn":
        q, kv, ring, sink, pos, tseq, slots = (spec.in_types[i] for i in (0, 1, 2, 5, 6, 7, 8))
        spec = KernelSpec(op, (("window", 128),), (q, kv, ring, sink, pos, tseq, slots), spec.out_types)
    tpl = select(on, spec)
    cfg = tpl.default_config(on, spec)
    assert cfg["kwords"] == 1 and "kwords" not in tpl.default_config(off, spec)
    src, plain = tpl.render(on, spec, cfg), tpl.render(off, spec, tpl.default_config(off, spec))
    assert "deepinfer_fp8x8_bf16n(cw" in src.text and "deepinfer_fp8x8_bf16n(cw" not in plain.text
    assert ("deepinfer_fp4x8_bf16n(cw" in src.text) == (op == "sparse_attn")
    assert dict(_signature(src))["RING"] == "const uint*" and dict(_signature(plain))["RING"] == "const fp8_e4_t*"
    if shutil.which("nvcc") and op == "sparse_attn":
        from deepinfer.codegen.library.tilelang_gemm import nvcc_report

        rep = nvcc_report(src.text, on.arch)
        assert rep["ok"], rep["log"]
        assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]


def test_lin8_decode_default_on_the_wgmma_program():
    """lin8 at decode rows (sm90's wgmma program): a split shape doubles its split, cut to whole K
    tiles, on 2 stages; an unsplit one takes 128-wide N tiles on 3 stages; prefill rows, sm100's
    block-scaled program and batch-invariant plans keep the general GEMM default (sm90's prefill
    tiles with its overlapped scaling)."""
    import dataclasses

    from deepinfer.codegen.library import tilelang_gemm as tlg
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import BATCH_INVARIANT

    sm90 = get_target("sm90")
    c = tlg.gemm_fp8_default_config(sm90, 64, 5120, 8192)
    assert (c["split_k"], c["stages"], c["block_N"]) == (4, 2, 64)
    c = tlg.gemm_fp8_default_config(sm90, 64, 5120, 2304)  # 18 K tiles: 2 x 2 is cut to 3
    assert (c["split_k"], c["stages"]) == (3, 2)
    c = tlg.gemm_fp8_default_config(sm90, 64, 32768, 1280)
    assert (c["split_k"], c["stages"], c["block_N"]) == (1, 3, 128)
    for t, m in ((sm90, 4096), (get_target("sm100"), 64),
                 (dataclasses.replace(sm90, features=sm90.features + (BATCH_INVARIANT,)), 64)):
        got = tlg.gemm_fp8_default_config(t, m, 5120, 8192)
        assert got.pop("overlap", 0) == (t is sm90)
        assert got == tlg.gemm_default_config(t, m, 5120, 8192)


def test_prefill_overlap_is_a_target_default_and_builds_without_spills():
    """`prefill_overlap` in a target's tilelang_gemm defaults (sm90 sets it) gives prefill tiles
    the overlapped scaling: each 32-deep block's wgmma issued before the one before it is scaled,
    waiting for all but the newest. Off, the source is the plain program's."""
    import dataclasses

    from deepinfer.codegen.library import tilelang_gemm as tlg

    on = get_target("sm90")
    assert on.defaults["tilelang_gemm"]["prefill_overlap"] == 1
    # sm90's prefill linears take the bf16 in-flight program; the fp8 program's prefill tiles are
    # those of a target naming no tilelang_gemm_fp8_bf16 entry
    on = dataclasses.replace(on, defaults={k: v for k, v in on.defaults.items() if k != "tilelang_gemm_fp8_bf16"})
    sm90 = dataclasses.replace(on, defaults=dict(on.defaults, tilelang_gemm={
        k: v for k, v in on.defaults["tilelang_gemm"].items() if k != "prefill_overlap"}))
    assert "overlap" not in tlg.gemm_fp8_default_config(sm90, 4096, 1280, 5120)
    assert tlg.gemm_fp8_default_config(on, 4096, 1280, 5120)["overlap"] == 1
    assert "overlap" not in tlg.gemm_fp8_default_config(on, 64, 1280, 5120)  # decode rows: the rows program
    spec = gemm_spec(4096, 1280, 5120)
    tpl = select(on, spec)
    src = tpl.render(on, spec, tpl.default_config(on, spec))
    assert "tl::wait_wgmma<1>()" in src.text and "tl::wait_wgmma<0>()" in src.text
    assert "tl::wait_wgmma" not in tpl.render(sm90, spec, tpl.default_config(sm90, spec)).text
    if shutil.which("nvcc"):
        rep = tlg.nvcc_report(src.text, on.arch)
        assert rep["ok"], rep["log"]
        assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]


def test_sparse_attn_prefill_pipeline_is_a_target_default():
    """`prefill_stages` in a target's tilelang_attention defaults pipelines an unsplit sparse call's
    top-k blocks: every top-k entry's row resolved once into shared memory, then the packed rows of
    later blocks copied with cp.async into double buffers while a block is widened and multiplied.
    Split (decode) calls and sm90's defaults keep the plain loop (the single-role program's, with
    sm90's prefill_ws off here: that program takes no stages; and kwords off, whose plain loop
    stages no packed rows)."""
    import dataclasses

    sm90 = get_target("sm90")
    sm90 = dataclasses.replace(sm90, defaults=dict(sm90.defaults, tilelang_attention=dict(
        sm90.defaults["tilelang_attention"], prefill_ws=0, kwords=0)))
    on = dataclasses.replace(sm90, defaults=dict(sm90.defaults, tilelang_attention=dict(
        sm90.defaults["tilelang_attention"], prefill_stages=2)))
    prefill, decode = attn_spec(4096, slots=1, pages=64, maxp=64), attn_spec(64)
    tpl = select(sm90, prefill)
    assert tpl.default_config(sm90, prefill)["stages"] == 1
    assert tpl.default_config(on, decode) == tpl.default_config(sm90, decode)
    cfg = tpl.default_config(on, prefill)
    assert cfg["stages"] == 2 and cfg["splits"] == 1
    plain, piped = tpl.render(sm90, prefill, tpl.default_config(sm90, prefill)), tpl.render(on, prefill, cfg)
    assert "cp_async" not in plain.text
    assert piped.text.count("cp_async_commit") >= 2 and "cp_async_wait<1>" in piped.text
    # two stages of the packed rows (16 KB) and their scales (2 KB), and the resolved rows (2 KB)
    assert piped.smem_bytes - plain.smem_bytes == 16384 + 2048 + 2048
    if shutil.which("nvcc"):
        from deepinfer.codegen.library.tilelang_gemm import nvcc_report

        rep = nvcc_report(piped.text, on.arch)
        # (the unrolled wgmma descriptors of the loop's prologue and epilogue copies spill: about
        # 0.7 KB of local memory, reloaded from L1; docs/performance.md, twenty-first session)
        assert rep["ok"], rep["log"]


def _with_rope(spec):
    import dataclasses

    return dataclasses.replace(spec, attrs=tuple(sorted(dict(spec.attrs, rope_dim=64, rope_theta=10000.0,
                                                             rope_yarn=(16, 65536, 32, 1)).items())))


def test_attention_with_its_rope_folded_in_rotates_q_on_load_and_the_output_on_store():
    """rope_dim (fuse_attention_rope): q's last 64 dims are rotated as the row's q goes into shared
    memory, the output's de-rotated as it is stored (the unsplit program) or in the combine (split
    decode rows), each at the row's position with the frequencies the host passes (FREQ); the
    angles are reduced mod 2 pi in fp64, their cosines and sines taken once a row (not once a
    head). q is read from global memory only by whole-row copies: the rotated tail is staged and
    rotated from shared memory (QR_s; element loads of q in the rotation put one memory latency
    after another), and the ws program copies its halves in 16-byte pieces (no element stores into
    Q_l). The split and unsplit programs build without spills."""
    import dataclasses

    from deepinfer.codegen.library.tilelang_host import rope_frequencies
    from deepinfer.ir.ops.attention import yarn_freqs

    ws_on = get_target("sm90")
    sm90 = dataclasses.replace(ws_on, defaults=dict(ws_on.defaults, tilelang_attention=dict(
        ws_on.defaults["tilelang_attention"], prefill_ws=0)))
    piped_on = dataclasses.replace(sm90, defaults=dict(sm90.defaults, tilelang_attention=dict(
        sm90.defaults["tilelang_attention"], prefill_stages=2)))
    for n, target in ((64, sm90), (4096, sm90), (4096, piped_on), (4096, ws_on)):
        spec = attn_spec(n, slots=1 if n > 64 else 64, pages=64, maxp=64)
        rope = _with_rope(spec)
        tpl = select(target, rope)
        cfg = tpl.default_config(target, rope)
        plain, src = tpl.render(target, spec, cfg), tpl.render(target, rope, cfg)
        assert "FREQ" in [p for p, _ in src.meta["params"]]
        assert "__cosf" not in plain.text and src.text.count("floor(") >= (4 if cfg["splits"] == 1 else 2)
        assert src.text.count("__cosf") == 2
        if cfg.get("ws"):
            assert not re.search(r"\(\(bfloat16_t\*\)Q_l\)\[[^;]*\] = Q\[", src.text)
        else:
            assert "QR_s" in src.text and "(float)Q[" not in src.text
        if cfg["splits"] > 1:
            comb = src.meta["combine"]
            assert "__cosf" in comb["text"] and {"POS", "FREQ"} <= {p for p, _ in comb["params"]}
            assert "__cosf" not in plain.meta["combine"]["text"]
        # (the ws build: test_tilelang_sparse_prefill; the pipelined one, an sm90 knob left off,
        # renders only)
        if shutil.which("nvcc") and not cfg.get("ws") and cfg["stages"] == 1:
            from deepinfer.codegen.library.tilelang_gemm import nvcc_report

            for b in [src.text] + ([src.meta["combine"]["text"]] if cfg["splits"] > 1 else []):
                rb = nvcc_report(b, target.arch)
                assert rb["ok"], rb["log"]
                assert rb["spill_bytes"] == rb["stack_bytes"] == 0, rb["log"]  # plain or with the rotation
    attrs = dict(_with_rope(attn_spec(1)).attrs)
    freq = rope_frequencies(attrs, torch.device("cpu"))
    assert torch.equal(freq, yarn_freqs(64, 10000.0, (16, 65536, 32, 1)))
    assert rope_frequencies({}, torch.device("cpu")).shape == (1,)


def test_word_scales_are_async_copies_in_the_pipeline():
    """`words` in a target's tilelang_gemm defaults reads lin8's ue8m0 scales as 32-bit words (four
    32-deep blocks a word), so each K step's scales are cp.async copies like the operands': with
    bytes, TileLang loads a step's two bytes a row with plain loads that every thread waits on
    inside the loop. Only for K steps and K in whole words; the host's uint8 tensors are the same."""
    import dataclasses
    import re

    from deepinfer.codegen.library import tilelang_gemm as tlg

    sm90 = get_target("sm90")  # less the bf16 prefill program's entry: the fp8 program's 4096 rows
    sm90 = dataclasses.replace(sm90, defaults={k: v for k, v in sm90.defaults.items() if k != "tilelang_gemm_fp8_bf16"})
    on = dataclasses.replace(sm90, defaults=dict(sm90.defaults, tilelang_gemm=dict(
        sm90.defaults["tilelang_gemm"], words=1)))
    off = dataclasses.replace(sm90, defaults=dict(sm90.defaults, tilelang_gemm={
        k: v for k, v in sm90.defaults["tilelang_gemm"].items() if k != "words"}))
    assert "words" not in tlg.gemm_fp8_default_config(off, 64, 5120, 8192)
    for m in (64, 4096):
        assert tlg.gemm_fp8_default_config(on, m, 5120, 8192)["words"] == 1
    assert "words" not in tlg.gemm_fp8_default_config(on, 64, 5120, 2336)  # K not whole words
    for m, n, k in ((64, 5120, 8192), (4096, 1280, 5120)):
        spec = gemm_spec(m, n, k)
        tpl = select(on, spec)
        src = tpl.render(on, spec, tpl.default_config(on, spec)).text
        plain = tpl.render(off, spec, tpl.default_config(off, spec)).text
        assert re.search(r"cp_async_gs(_conditional)?<4>\(\(&\(\(\(uint\*\)SA_s\)", src)
        assert re.search(r"cp_async_gs(_conditional)?<4>\(\(&\(\(\(uint\*\)SB_s\)", src)
        assert "(uchar*)SA_s" not in src and "(uchar*)SA_s" in plain
        assert "const uint* __restrict__ SA" in src and "const uchar* __restrict__ SA" in plain


def test_grouped_linear_scales_once_reads_them_before_the_loop():
    """`scales_once` (wo_a's bf16 program): the CTA's weight scales for its whole K are read once,
    not a step's few bytes in every step of the pipelined loop."""
    from deepinfer.codegen.library import tilelang_gemm as tlg
    from deepinfer.codegen.library import tilelang_prefill_bf16 as tlmp

    import re

    c = dict(tlmp.ROWS_TILES)
    once = tlg.lower(tlmp.rows_bf16_gemm_program(256, 2, 256, 4096, **c, scales_once=1), "sm_90a")["src"]
    each = tlg.lower(tlmp.rows_bf16_gemm_program(256, 2, 256, 4096, **c), "sm_90a")["src"]

    def reads(src):
        return len(re.findall(r"\bSW(\[| \+)", src))

    assert reads(once) == 1
    assert reads(each) > c["stages"] - 1  # the pipeline's prologue, and the loop body
