"""Presets, load_config and the resolved topology (spec §1, §2, §12.2, §12.3)."""
import copy
import json
import re
import warnings
from pathlib import Path

import pytest

from deepinfer.models.config import (PRESETS, PRESETS_DIR, ConfigError, ConfigWarning, config_from_dict, engram_primes,
                                     load_config)

SPEC = Path("/work/shared/reference/deepseek-v41-flash.md")


def preset_json(name: str) -> dict:
    return json.loads((PRESETS_DIR / name / "config.json").read_text())


def write_config(tmp_path: Path, data, raw: str | None = None) -> Path:
    (tmp_path / "config.json").write_text(raw if raw is not None else json.dumps(data))
    return tmp_path


# ---- presets ---------------------------------------------------------------------------------

def test_tiny_preset_is_the_spec_text():
    text = (PRESETS_DIR / "v4.1-flash-tiny" / "config.json").read_text()
    if SPEC.is_file():
        block = re.search(r"### 12\.2.*?```json\n(.*?)```", SPEC.read_text(), re.S).group(1)
        assert text == block
    tiny = json.loads(text)
    assert "text_config" not in tiny and "vision_config" not in tiny
    assert tiny["compress_ratios"] == [0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0]
    assert tiny["engram_num_embeddings"] == [6126, 6332]


def test_smooth_preset_has_no_discrete_choice():
    """v4.1-flash-smooth is the tiny model where no selection can flip between kernels and the
    reference on contexts of up to 256 tokens (tests/gpu/test_smooth_preset.py): every expert
    active, in DSpark too; index top-k and the candidate blocks cover every compressed entry."""
    tiny, smooth = preset_json("v4.1-flash-tiny"), preset_json("v4.1-flash-smooth")
    changed = {k for k in tiny if tiny[k] != smooth[k]}
    assert changed == {"num_experts_per_tok", "dspark_num_experts_per_tok", "index_topk", "candidate_topk_blocks"}
    cfg = load_config("v4.1-flash-smooth")
    assert cfg.num_experts_per_tok == cfg.n_routed_experts
    assert cfg.dspark_num_experts_per_tok == cfg.dspark_n_routed_experts
    assert cfg.index_topk >= 256 and cfg.candidate_topk_blocks * cfg.candidate_block_size >= 256


def test_real_preset_root_keys():
    root = preset_json("v4.1-flash")
    assert root["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                           "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                           "expert_dtype": "fp4"}
    assert (root["bos_token_id"], root["eos_token_id"], root["pad_token_id"], root["image_token_id"]) == (0, 1, 2, 129264)
    assert root["dtype"] == "bfloat16"
    v = root["vision_config"]
    assert (v["num_hidden_layers"], v["hidden_size"], v["num_attention_heads"], v["intermediate_size"],
            v["patch_size"], v["min_pixels"]) == (32, 1024, 16, 2816, 14, 295936)
    t = root["text_config"]
    assert t["compress_ratios"] == [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    assert t["rope_scaling"]["original_max_position_embeddings"] == 65536
    assert t["engram_num_embeddings"] == [384006168, 384016682]


def test_medium_preset_differs_from_real_in_three_keys():
    real, med = preset_json("v4.1-flash"), preset_json("v4.1-flash-medium")
    diff = {k for k in real["text_config"] if real["text_config"][k] != med["text_config"][k]}
    assert diff == {"n_routed_experts", "engram_vocab_size", "engram_num_embeddings"}
    assert med["text_config"]["n_routed_experts"] == 96
    assert med["text_config"]["engram_num_embeddings"] == [24003916, 24010950]
    assert {k: v for k, v in real.items() if k != "text_config"} == {k: v for k, v in med.items() if k != "text_config"}


# ---- the real topology (§2) ------------------------------------------------------------------

def expected_real_role(i: int) -> dict:
    if i in (0, 1) or i >= 40:
        return dict(mode="W", ratio=0, kv_owner=None, topk_from=None, rope_theta=1e4, yarn=False)
    owner = max(s for s in (2, 8, 14, 20) if s <= i)
    mode = "FULL" if i in (2, 8, 14, 20) else "REINDEX" if i in (24, 28, 32, 36) else "REUSE"
    topk = max(s for s in (2, 8, 14, 20, 24, 28, 32, 36) if s <= i)
    return dict(mode=mode, ratio=2 if i < 20 else 1, kv_owner=owner, topk_from=topk, rope_theta=1.6e5, yarn=True)


def test_real_role_table():
    cfg = load_config("v4.1-flash")
    assert len(cfg.layers) == 43 and cfg.n_prefill_layer == 20 and cfg.vision
    assert [r.index for r in cfg.dspark_stages] == [40, 41, 42]
    for r in cfg.layers:
        want = expected_real_role(r.index)
        got = {k: getattr(r, k) for k in want}
        assert got == want, r.index
        assert r.index_k_owner == r.kv_owner
        assert r.has_compressor == r.owns_index_k == (r.index in (2, 8, 14, 20))
        assert r.compressor_gate == (r.index in (2, 8, 14))
        assert r.has_indexer == (r.index in (2, 8, 14, 20, 24, 28, 32, 36))
        assert r.is_candidate_source == (r.index == 20)
        assert r.uses_candidates == (r.index in (24, 28, 32, 36))
        assert r.engram == (r.index in (1, 14))
        assert r.is_dspark_target == (r.index in (37, 38, 39))
        assert r.is_draft == (r.index >= 40)
        assert (r.n_experts, r.top_k) == ((128, 3) if r.is_draft else (384, 6))
        assert r.prefix == (f"mtp.{r.index - 40}" if r.is_draft else f"layers.{r.index}")
    assert cfg.layer_role(20).mode == "FULL"
    with pytest.raises(IndexError):
        cfg.layer_role(43)


def test_medium_keeps_the_real_topology():
    real, med = load_config("v4.1-flash"), load_config("v4.1-flash-medium")
    for a, b in zip(real.layers, med.layers):
        assert (a.mode, a.kv_owner, a.topk_from, a.uses_candidates, a.engram) == \
               (b.mode, b.kv_owner, b.topk_from, b.uses_candidates, b.engram)
        assert b.n_experts == (128 if b.is_draft else 96)
    assert real.config_hash != med.config_hash
    assert engram_primes(med)[0][0][0] == 1000003 and engram_primes(med)[-1][-1][-1] == 1000619


def test_tiny_role_table():
    cfg = load_config("v4.1-flash-tiny")
    table = {0: ("W", 0, None, None), 1: ("W", 0, None, None), 2: ("FULL", 2, 2, 2), 3: ("REUSE", 2, 2, 2),
             4: ("FULL", 2, 4, 4), 5: ("FULL", 1, 5, 5), 6: ("REUSE", 1, 5, 5), 7: ("REINDEX", 1, 5, 7),
             8: ("REUSE", 1, 5, 7), 9: ("REUSE", 1, 5, 7)}
    for i, (mode, ratio, owner, topk) in table.items():
        r = cfg.layer_role(i)
        assert (r.mode, r.ratio, r.kv_owner, r.topk_from) == (mode, ratio, owner, topk), i
    assert cfg.n_prefill_layer == 5 and not cfg.vision and cfg.model_id == "v4.1-flash-tiny"
    assert [r.index for r in cfg.layers if r.engram] == [1, 4]
    assert [r.index for r in cfg.layers if r.is_candidate_source] == [5]
    assert [r.index for r in cfg.layers if r.uses_candidates] == [7]
    assert [r.index for r in cfg.layers if r.compressor_gate] == [2, 4]
    assert [(r.prefix, r.n_experts, r.top_k, r.mode) for r in cfg.dspark_stages] == \
           [(f"mtp.{s}", 8, 2, "W") for s in range(3)]
    assert engram_primes(cfg) == [[[1009, 1013], [1019, 1021], [1031, 1033]],
                                  [[1039, 1049], [1051, 1061], [1063, 1069]]]


def test_real_engram_primes():
    primes = engram_primes(load_config("v4.1-flash"))
    assert primes[0][0] == [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183]
    assert primes[1][2] == [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889]


# ---- directories, defaults, hash -------------------------------------------------------------

def test_directory_forms_match_presets(tmp_path):
    real = load_config("v4.1-flash")
    (tmp_path / "hf").mkdir()
    from_dir = load_config(write_config(tmp_path / "hf", preset_json("v4.1-flash")))
    assert from_dir == real and from_dir.config_hash == real.config_hash and from_dir.model_id == "hf"
    assert from_dir.layers == real.layers
    flat = tmp_path / "flat"
    flat.mkdir()
    text_only = load_config(write_config(flat, preset_json("v4.1-flash")["text_config"]))
    assert not text_only.vision and text_only.config_hash != real.config_hash
    assert text_only.layers == real.layers


def test_defaults_and_optional_keys():
    tiny = load_config("v4.1-flash-tiny")
    assert (tiny.hc_shifted, tiny.use_fp4_sparse_kv, tiny.dspark_target_attn_input, tiny.use_qnorm) == (True, True, True, False)
    assert tiny.index_k_sources == (2, 4, 5) and tiny.gate_temp == 1.0 and tiny.topk_method == "noaux_tc"
    assert (tiny.bos_token_id, tiny.eos_token_id, tiny.pad_token_id) == (0, 1, 2)
    data = preset_json("v4.1-flash-tiny")
    data.pop("engram_num_embeddings")
    assert config_from_dict(data).engram_num_embeddings == (6126, 6332)
    data["candidate_source_layer_id"] = -1
    off = config_from_dict(data)
    assert off.candidate_source_layer_id is None and not any(r.uses_candidates or r.is_candidate_source for r in off.layers)
    assert off.layer_role(7).mode == "REINDEX"


def test_hash_covers_values():
    data = preset_json("v4.1-flash-tiny")
    a = config_from_dict(data).config_hash
    assert config_from_dict(copy.deepcopy(data)).config_hash == a
    data["index_topk"] = 8
    assert config_from_dict(data).config_hash != a
    assert re.fullmatch(r"[0-9a-f]{64}", a)


# ---- errors ----------------------------------------------------------------------------------

BAD = [
    ("compress_ratios", {"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0]}, "compress_ratios: has 12 entries"),
    ("ratio 3", {"compress_ratios": [0, 0, 3, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0]}, "compress_ratios: entry 2 is 3"),
    ("draft ratio", {"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0, 1, 0]}, "compress_ratios: DSpark stage 1"),
    ("kv not index", {"index_source_layer_ids": [2, 5, 7]}, "index_source_layer_ids: KV source layer 4"),
    ("owner ratio", {"kv_source_layer_ids": [2, 4]},
     "kv_source_layer_ids: layer 5 has ratio 1 but its KV owner 4 has ratio 2"),
    ("no owner", {"kv_source_layer_ids": [4, 5], "index_source_layer_ids": [4, 5, 7]},
     "kv_source_layer_ids: layer 2 has ratio 2 but no KV source"),
    ("pool too small", {"candidate_topk_blocks": 1}, "candidate_topk_blocks: 1 * candidate_block_size 8 < index_topk 16"),
    ("late engram", {"engram_layer_ids": [1, 6]}, "engram_layer_ids: layers [6] are not before n_prefill_layer 5"),
    ("straddling taps", {"dspark_target_layer_ids": [3, 8, 9]}, "dspark_target_layer_ids: [3, 8, 9] straddle"),
    ("source after candidates", {"kv_source_layer_ids": [2, 4, 5, 7]}, "index_source_layer_ids: layer 7 is after candidate source 5"),
    ("candidate not indexer", {"candidate_source_layer_id": 6}, "candidate_source_layer_id: layer 6 is not an index source"),
    ("hidden /32", {"hidden_size": 240}, "hidden_size: 240 is not a multiple of 32"),
    ("head_dim /32", {"head_dim": 144}, "head_dim: 144 is not a multiple of 32"),
    ("o_groups", {"num_attention_heads": 3}, "o_groups: num_attention_heads 3 is not divisible by 2"),
    ("odd rope", {"qk_rope_head_dim": 31}, "qk_rope_head_dim: 31 must be even"),
    ("rope > index", {"qk_rope_head_dim": 96}, "qk_rope_head_dim: 96 > index_head_dim 64"),
    ("string int", {"hidden_size": "256"}, 'hidden_size: must be an integer, got "256"'),
    ("int bool", {"norm_topk_prob": 1}, "norm_topk_prob: must be true or false"),
    ("zero window", {"sliding_window": 0}, "sliding_window: must be > 0"),
    ("layer range", {"kv_source_layer_ids": [2, 4, 50]}, "kv_source_layer_ids: layer 50 is not a backbone layer"),
    ("unsorted", {"index_source_layer_ids": [4, 2, 5, 7]}, "index_source_layer_ids: must be strictly increasing"),
    ("ratio-0 source", {"index_source_layer_ids": [1, 2, 4, 5, 7]}, "index_source_layer_ids: layer 1 has compress ratio 0"),
    ("engram rows", {"engram_num_embeddings": [6126, 6333]}, "engram_num_embeddings: [6126, 6333] does not match"),
    ("engram count", {"engram_num_embeddings": [6126]}, "engram_num_embeddings: 1 entries for 2"),
    ("scoring", {"scoring_func": "softmax"}, 'scoring_func: must be "sqrtsoftplus"'),
    ("hc_shifted", {"hc_shifted": False}, "hc_shifted: must be true"),
    ("index k owner", {"index_k_source_layer_ids": [2, 4, 7]}, "index_k_source_layer_ids: layers [7] are not KV sources"),
    ("experts", {"num_experts_per_tok": 17}, "num_experts_per_tok: 17 > n_routed_experts 16"),
    ("rope scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 16}}, "rope_scaling.original_max_position_embeddings: missing"),
    ("null", {"hidden_size": None}, "hidden_size: must not be null"),
    ("noise id", {"dspark_noise_token_id": 129280}, "dspark_noise_token_id: 129280 is outside the vocabulary"),
    ("model_type", {"model_type": "llama"}, 'model_type: "llama" is not a DeepSeek-V4.1 model'),
]


@pytest.mark.parametrize("label,change,message", BAD, ids=[b[0] for b in BAD])
def test_bad_tiny_configs(tmp_path, label, change, message):
    data = preset_json("v4.1-flash-tiny")
    data.update(change)
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path, data))
    text = str(e.value)
    assert "\n" not in text and message in text, text
    assert text.startswith(str(tmp_path / "config.json") + ": ")


def test_missing_key(tmp_path):
    data = preset_json("v4.1-flash-tiny")
    del data["index_topk"]
    with pytest.raises(ConfigError, match=r"index_topk: missing required key$"):
        load_config(write_config(tmp_path, data))


@pytest.mark.parametrize("change,message", [
    ({"fmt": "e4m3"}, "quantization_config.fmt: unexpected key"),
    ({"weight_block_size": [128, 128]}, "quantization_config.weight_block_size: must be [32, 32], got [128, 128]"),
    ({"expert_dtype": None}, 'quantization_config.expert_dtype: must be "fp4", got null'),
])
def test_bad_quantization_config(tmp_path, change, message):
    root = preset_json("v4.1-flash")
    root["quantization_config"].update(change)
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path, root))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_root_model_type(tmp_path):
    root = preset_json("v4.1-flash")
    root["model_type"] = "llama"
    with pytest.raises(ConfigError, match='model_type: "llama" is not a DeepSeek-V4.1 model'):
        load_config(write_config(tmp_path, root))
    root["model_type"], root["text_config"]["model_type"] = "deepseek_v41", "qwen2"
    with pytest.raises(ConfigError, match='text_config.model_type: "qwen2" is not'):
        load_config(write_config(tmp_path, root))


def test_unknown_keys_are_warned_about(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the presets and the HF bookkeeping keys: no warning
        for name in PRESETS:
            load_config(name)
        load_config(write_config(tmp_path, preset_json("v4.1-flash") | {"transformers_version": "4.57.0"}))
    root = preset_json("v4.1-flash")
    root["text_config"]["hiden_size"] = 5120
    root["rope_theta"] = 1e4  # a text key at the root is not read either
    with pytest.warns(ConfigWarning, match=r"config.json: unknown keys ignored: rope_theta, text_config.hiden_size$"):
        load_config(write_config(tmp_path, root))
    with pytest.warns(ConfigWarning, match=r"unknown keys ignored: foo$"):
        load_config(write_config(tmp_path, preset_json("v4.1-flash-tiny") | {"foo": 1}))


def test_vision_flag(tmp_path):
    root = preset_json("v4.1-flash")
    root["vision_config"]["num_hidden_layers"] = 0
    assert not load_config(write_config(tmp_path, root)).vision
    root["vision_config"] = {"hidden_size": 1024}
    with pytest.raises(ConfigError, match="vision_config.num_hidden_layers: missing"):
        load_config(write_config(tmp_path, root))


@pytest.mark.parametrize("kind", ["unknown", "no file", "malformed", "list", "inference names"])
def test_file_errors(tmp_path, kind):
    if kind == "unknown":
        target, message = "v4.1-flash-huge", "unknown model 'v4.1-flash-huge': not a preset"
    elif kind == "no file":
        target, message = tmp_path, "no config.json there"
    elif kind == "malformed":
        target, message = write_config(tmp_path, None, raw='{"hidden_size": 256,'), "malformed JSON at line 1"
    elif kind == "list":
        target, message = write_config(tmp_path, [1, 2]), "top level must be a JSON object"
    else:
        target, message = write_config(tmp_path, {"dim": 5120, "n_layers": 40}), "looks like inference/config.json"
    with pytest.raises(ConfigError) as e:
        load_config(target)
    assert message in str(e.value) and "\n" not in str(e.value)
