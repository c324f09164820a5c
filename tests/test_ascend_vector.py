"""ascend950's vector-core templates (codegen/library/ascend_vector*.py) on rendered AscendC: each is
the template selected for its op, renders, reads its GM inputs and writes its outputs (the kernel
signature and its DMA copies), carries the constants its op's semantics need, and its buffer plan
passes the capacity check; shapes that cannot fit or align are declined. TileLang's Ascend backend
cannot execute on the CPU, so these tests check rendered source only, never numerics."""
import functools
import re

import pytest

from deepinfer.codegen.library import ascend_vector as av
from deepinfer.codegen.targets import TARGETS, get_manifest
from deepinfer.codegen.template import KernelSpec, select, templates
from deepinfer.ir.ops.attention import yarn_freqs
from deepinfer.ir.registry import get_op
from deepinfer.ir.types import tensor

ASCEND = TARGETS["ascend950"]
CHECK = get_manifest("ascend950").check
YARN = (16.0, 65536, 32.0, 1.0)
HC = {"copies": 4, "eps": 1e-20, "hc_eps": 1e-6, "iters": 20, "post_mult": 2.0}


def spec(op, ins, attrs=None):
    a = get_op(op).check_attrs(attrs or {})
    return KernelSpec(op, tuple(sorted(a.items())), tuple(ins), tuple(get_op(op).infer_types(list(ins), a)))


@functools.lru_cache(maxsize=None)
def rendered(s: KernelSpec):
    t = select(ASCEND, s)
    return t.name, t.render(ASCEND, s, t.default_config(ASCEND, s))


def signature(text: str) -> dict:
    """The global kernel's GM parameters: name -> C element type."""
    (params,) = re.findall(r'extern "C" __global__ __vector__ void \w+\((.*?)\)', text)
    return {m.group(2): m.group(1) for m in re.finditer(r"__gm__ ([\w:]+)\* (\w+)", params)}


def dma(text: str, direction: str) -> set:
    """GM tensors a DMA direction ('gm2ub' reads, 'ub2gm' writes) touches."""
    return set(re.findall(rf"asc_copy_{direction}_align\(.*?__gm__ uint8_t\*\)\(\(&\((\w+)\[", text))


def simt_reads(text: str) -> set:
    """GM tensors the SIMT regions read directly."""
    return {m for sig in re.findall(r"__simt_vf__[^\n]*\((.*?)\) \{", text) for m in re.findall(r"__gm__ [\w:]+\* (\w+)", sig)}


def _hex(v: float) -> str:
    m, e = float.hex(v).split("p")
    return m.rstrip("0").rstrip(".") + "p" + e + "f"


def f32_hex(v: float) -> str:
    """An fp32 constant as TileLang prints it (hex float, trailing zeros dropped)."""
    import struct

    return _hex(struct.unpack("f", struct.pack("f", v))[0])


def has_const(text: str, v: float) -> bool:
    """Whether the source carries the constant v: TileLang prints fp32 values as their hex, and
    Python floats it was given as their double's hex (the C compiler rounds them to fp32)."""
    return f32_hex(v) in text or _hex(v) in text


def checked(s: KernelSpec, template: str, entry: str):
    name, src = rendered(s)
    assert name == template
    assert src.language == "ascendc" and f" {entry}_kernel(" in src.text and src.entry == f"{entry}_kernel"
    assert CHECK(src, None) is None
    assert 1 <= src.grid[0] <= ASCEND.cores and all(b % 32 == 0 for b in src.meta["gm_row_bytes"])
    return src


CASES = {
    "cast": (spec("cast", [tensor("bf16", 8, 256)], {"dtype": "f32"}), "ascend_elementwise", "cast",
             {"X": "bfloat16_t", "Y": "float"}, {"X"}, {"Y"}, set()),
    "add": (spec("add", [tensor("f32", 8, 256), tensor("f32", 8, 256)]), "ascend_elementwise", "add",
            {"A": "float", "B": "float", "Y": "float"}, {"A", "B"}, {"Y"}, set()),
    "hc_repeat": (spec("hc_repeat", [tensor("bf16", 4, 128)], {"copies": 4}), "ascend_hc_stream", "hc_repeat",
                  {"X": "bfloat16_t", "Y": "bfloat16_t"}, {"X"}, {"Y"}, set()),
    "hc_mean": (spec("hc_mean", [tensor("bf16", 4, 4, 128)]), "ascend_hc_stream", "hc_mean",
                {"R": "bfloat16_t", "Y": "bfloat16_t"}, {"R"}, {"Y"}, set()),
    "hc_collapse": (spec("hc_collapse", [tensor("bf16", 4, 4, 128), tensor("f32", 4, 4)]), "ascend_hc_stream",
                    "hc_collapse", {"R": "bfloat16_t", "Mix": "float", "Y": "bfloat16_t"}, {"R"}, {"Y"}, {"Mix"}),
    "hc_expand": (spec("hc_expand", [tensor("bf16", 64, 5120), tensor("bf16", 64, 4, 5120), tensor("f32", 64, 4),
                                     tensor("f32", 64, 4, 4)]), "ascend_hc_stream", "hc_expand",
                  {"Yl": "bfloat16_t", "R": "bfloat16_t", "Post": "float", "M": "float", "Out": "bfloat16_t"},
                  {"Yl", "R"}, {"Out"}, {"Post", "M"}),
    "concat": (spec("concat", [tensor("bf16", 8, 5120)] * 3, {"axis": -1}), "ascend_concat", "concat",
               {"X0": "bfloat16_t", "X1": "bfloat16_t", "X2": "bfloat16_t", "Y": "bfloat16_t"},
               {"X0", "X1", "X2"}, {"Y"}, set()),
    "embedding": (spec("embedding", [tensor("i64", 8), tensor("bf16", 129280, 5120)]), "ascend_gather_rows",
                  "embedding", {"Ids": "int64_t", "Table": "bfloat16_t", "Y": "bfloat16_t"}, {"Table"}, {"Y"}, set()),
    "gather_rows": (spec("gather_rows", [tensor("bf16", 16, 256), tensor("i64", 3)]), "ascend_gather_rows",
                    "gather_rows", {"Src": "bfloat16_t", "Ids": "int64_t", "Y": "bfloat16_t"}, {"Src"}, {"Y"}, set()),
    "lookup": (spec("lookup", [tensor("i32", 129280), tensor("i64", 64)], {"dead_ids": (129264,)}), "ascend_lookup",
               "lookup", {"Table": "int32_t", "Ids": "int64_t", "Out": "int64_t"}, {"Ids"}, {"Out"}, {"Table"}),
    "quant_fp8": (spec("quant_fp8", [tensor("bf16", 5, 256)]), "ascend_quant_fp8", "quant_fp8",
                  {"X": "bfloat16_t", "Q": "fp8_e4_t", "S": "uint8_t"}, {"X"}, {"Q", "S"}, set()),
    "rms_norm_quant_fp8": (spec("rms_norm_quant_fp8", [tensor("bf16", 4, 256), tensor("bf16", 256)], {"eps": 1e-20}),
                           "ascend_quant_fp8", "rms_norm_quant_fp8",
                           {"X": "bfloat16_t", "W": "bfloat16_t", "Q": "fp8_e4_t", "S": "uint8_t"}, {"X", "W"},
                           {"Q", "S"}, set()),
    "swiglu_quant_fp8": (spec("swiglu_quant_fp8", [tensor("bf16", 4, 128), tensor("bf16", 4, 128)], {"limit": 10.0}),
                         "ascend_quant_fp8", "swiglu_quant_fp8",
                         {"G": "bfloat16_t", "U": "bfloat16_t", "Q": "fp8_e4_t", "S": "uint8_t"}, {"G", "U"},
                         {"Q", "S"}, set()),
    "swiglu_weighted_quant_fp8": (
        spec("swiglu_weighted_quant_fp8", [tensor("bf16", 6, 256), tensor("f32", 2, 3), tensor("i32", 6)],
             {"limit": 10.0, "k": 3}), "ascend_quant_fp8", "swiglu_weighted_quant_fp8",
        {"GU": "bfloat16_t", "Wt": "float", "Pairs": "int32_t", "Q": "fp8_e4_t", "S": "uint8_t"}, {"GU"}, {"Q", "S"},
        {"Wt", "Pairs"}),
    "rope": (spec("rope", [tensor("bf16", 2, 4, 128), tensor("i64", 2)],
                  {"rope_dim": 64, "theta": 10000.0, "inverse": True}), "ascend_rope", "rope",
             {"X": "bfloat16_t", "Pos": "int64_t", "Y": "bfloat16_t"}, {"X"}, {"Y"}, {"Pos"}),
    "rope_quant_fp8": (spec("rope_quant_fp8", [tensor("bf16", 3, 128), tensor("i64", 3)],
                            {"rope_dim": 64, "theta": 160000.0, "yarn": YARN}), "ascend_rope", "rope_quant",
                       {"X": "bfloat16_t", "Pos": "int64_t", "Q": "fp8_e4_t", "S": "uint8_t"}, {"X"}, {"Q", "S"},
                       {"Pos"}),
    "rope_quant_fp4_e4m3": (spec("rope_quant_fp4", [tensor("bf16", 2, 128), tensor("i64", 2)],
                                 {"rope_dim": 64, "theta": 160000.0, "yarn": YARN, "block": 16, "scale": "e4m3",
                                  "pos_offset": -1}), "ascend_rope", "rope_quant",
                            {"X": "bfloat16_t", "Pos": "int64_t", "Q": "uint8_t", "S": "fp8_e4_t"}, {"X"}, {"Q", "S"},
                            {"Pos"}),
    "rope_quant_fp4_ue8m0": (spec("rope_quant_fp4", [tensor("bf16", 2, 2, 128), tensor("i64", 2)],
                                  {"rope_dim": 64, "theta": 160000.0, "yarn": YARN, "block": 32, "scale": "ue8m0"}),
                             "ascend_rope", "rope_quant",
                             {"X": "bfloat16_t", "Pos": "int64_t", "Q": "uint8_t", "S": "uint8_t"}, {"X"}, {"Q", "S"},
                             {"Pos"}),
    "hc_mix": (spec("hc_mix", [tensor("bf16", 2, 4, 64), tensor("f32", 24, 256), tensor("f32", 3), tensor("f32", 24)],
                    HC), "ascend_hc_mix", "hc_mix",
               {"R": "bfloat16_t", "FN": "float", "Scale": "float", "Base": "float", "Pre": "float", "Post": "float",
                "M": "float"}, {"R", "FN"}, {"Pre", "Post", "M"}, {"Scale", "Base"}),
    "hc_pre": (spec("hc_pre", [tensor("bf16", 2, 4, 64), tensor("f32", 24, 256), tensor("f32", 3), tensor("f32", 24),
                               tensor("f32", 2, 4), tensor("bf16", 64)], HC), "ascend_hc_mix", "hc_pre",
               {"R": "bfloat16_t", "FN": "float", "Scale": "float", "Base": "float", "PreIn": "float",
                "NormW": "bfloat16_t", "X": "bfloat16_t", "Pre": "float", "Post": "float", "M": "float"},
               {"R", "FN", "NormW"}, {"X", "Pre", "Post", "M"}, {"Scale", "Base", "PreIn"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_template_renders_reads_inputs_writes_outputs_and_fits(case):
    s, template, entry, params, reads, writes, simt = CASES[case]
    src = checked(s, template, entry)
    assert signature(src.text) == params
    assert reads <= dma(src.text, "gm2ub") and dma(src.text, "ub2gm") == writes
    assert simt <= simt_reads(src.text)


def test_quantisers_encode_fp8_with_pow2_scales_from_the_bits():
    for case in ("quant_fp8", "rms_norm_quant_fp8", "swiglu_quant_fp8", "swiglu_weighted_quant_fp8", "rope_quant_fp8"):
        text = rendered(CASES[case][0])[1].text
        assert "__asc_cvt_float2_to_fp8x2" in text or "float_e4m3_t(" in text, case
        assert ">> (uint32_t)23" in text and has_const(text, 448.0) and has_const(text, 1e-4), case
    assert has_const(rendered(CASES["rms_norm_quant_fp8"][0])[1].text, 1e-20)
    assert f32_hex(10.0) in rendered(CASES["swiglu_quant_fp8"][0])[1].text


def test_quant_scale_rows_group_to_whole_granules_and_the_last_tile_is_clipped():
    # 256 / 32 = 8 scale bytes a row: tiles of 4 rows make them one granule; 5 rows -> 2 tiles
    src = rendered(CASES["quant_fp8"][0])[1]
    assert av.granule_rows([512, 256, 8]) == 4 and src.meta["gm_row_bytes"] == [2048, 1024, 32]
    assert src.grid == (2,) and "min(4," in src.text
    assert av.granule_rows([16]) == 2 and av.granule_rows([40, 1280]) == 4 and av.granule_rows([10240]) == 1


def test_rope_uses_the_reference_frequencies_and_direction():
    for case, theta, yarn in (("rope", 10000.0, None), ("rope_quant_fp8", 160000.0, YARN),
                              ("rope_quant_fp4_e4m3", 160000.0, YARN)):
        text = rendered(CASES[case][0])[1].text
        for f in yarn_freqs(64, theta, yarn).tolist():
            assert f32_hex(f) in text, (case, f)
    assert f32_hex(-1.0) in rendered(CASES["rope"][0])[1].text  # inverse: angles negated
    assert "(int64_t)1))" in rendered(CASES["rope_quant_fp4_e4m3"][0])[1].text  # pos_offset -1
    assert "cosf(" in rendered(CASES["rope"][0])[1].text and "sinf(" in rendered(CASES["rope"][0])[1].text


def test_fp4_packs_codes_against_the_grid_midpoints():
    e4m3 = rendered(CASES["rope_quant_fp4_e4m3"][0])[1].text
    ue8m0 = rendered(CASES["rope_quant_fp4_ue8m0"][0])[1].text
    for text in (e4m3, ue8m0):
        for mid in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
            assert f32_hex(mid) in text
        assert "<< 4" in text and f32_hex(6.0) in text
    assert "float_e4m3_t(" in e4m3 and ">> (uint32_t)23" in ue8m0
    # the compressed KV's 16-blocks: 128 values -> 64 packed bytes and 8 fp8 scales a row, so a
    # tile is 4 rows (32 scale bytes); UB: frequencies, x, fp32 row, codes, scales, 1 / scale
    src = rendered(CASES["rope_quant_fp4_e4m3"][0])[1]
    assert src.meta["buffers"]["ub"] == [32 * 4, 4 * 128 * 2, 4 * 128 * 4, 4 * 64, 4 * 8, 4 * 8 * 4]
    assert src.meta["gm_row_bytes"] == [4 * 256, 4 * 64, 4 * 8]


def test_lookup_and_sinkhorn_carry_their_attributes():
    assert "129264" in rendered(CASES["lookup"][0])[1].text and "(int64_t)-1" in rendered(CASES["lookup"][0])[1].text
    mix = rendered(CASES["hc_mix"][0])[1].text
    assert "it < 39" in mix and has_const(mix, 1e-6) and has_const(mix, 2.0)  # 2 * iters - 1 normalisations
    assert "expf(" in mix and "rsqrtf(" in mix


def test_declines_what_cannot_fit_or_align():
    declined = [
        spec("cast", [tensor("f32", 2, 24576)], {"dtype": "bf16"}),  # one row takes more than half the UB
        spec("gather_rows", [tensor("bf16", 16, 40), tensor("i64", 2)]),  # 80-byte rows are no whole granules
        spec("concat", [tensor("bf16", 2, 8)] * 2, {"axis": -1}),  # 16-byte column offsets
        spec("concat", [tensor("bf16", 2, 16)] * 4, {"axis": -1}),
        spec("quant_fp8", [tensor("bf16", 1, 65536)]),
        spec("hc_mix", [tensor("bf16", 2, 4, 10), tensor("f32", 24, 40), tensor("f32", 3), tensor("f32", 24)], HC),
    ]
    names = {t.name for t in templates().values() if t.name.startswith("ascend_")}
    for s in declined:
        assert select(ASCEND, s).name not in names, s.key()
    # a plan inflated past the UB fails the capacity check
    src = rendered(CASES["hc_expand"][0])[1]
    big = type(src)(src.language, src.entry, src.text, src.grid, src.block,
                    meta={**src.meta, "buffers": {"ub": src.meta["buffers"]["ub"] * 3}})
    assert "exceed" in CHECK(big, None)
