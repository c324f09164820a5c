"""Sizes derived from the schema against the spec's figures (§6.2, §6.4, §12.1-12.3)."""
import json

import pytest

from deepinfer.models.config import PRESETS_DIR, config_from_dict, load_config
from deepinfer.models.sizes import kv_entry_bytes, model_sizes

B, GB = 1e9, 1e9


def near(value: float, stated: float, digits: int) -> bool:
    """`value` rounds to the spec's figure, which is given to `digits` decimals."""
    return abs(value - stated) <= 0.5 * 10**-digits + 1e-12


@pytest.fixture(scope="module")
def real():
    return model_sizes(load_config("v4.1-flash"))


def test_real_parameters(real):
    assert near(real["params_total"] / B, 762.7, 1)
    assert near(real["params_backbone"] / B, 551.6, 1)
    assert near(real["params_engram"] / B, 196.9, 1)
    assert near(real["params_engram_tables"] / B, 196.6, 1)
    assert near(real["params_engram_proj"] / B, 0.31, 2)
    assert near(real["params_dspark"] / B, 14.2, 1)
    assert near(real["params_routed_experts"] / B, 543.6, 1)
    assert near(real["params_attention"] / B, 5.17, 2)
    assert near(real["params_router_shared"] / B, 1.49, 2)
    assert near(real["params_embed_head"] / B, 1.32, 2)
    assert real["params_total"] == real["params_backbone"] + real["params_engram"] + real["params_dspark"]
    assert real["params_engram_tables"] == (384006168 + 384016682) * 256


def test_real_activated(real):
    assert near(real["params_activated"] / B, 16.1, 1)
    assert near(real["params_activated_no_head"] / B, 15.5, 1)
    routed = 40 * 6 * 3 * 2304 * 5120
    assert near(routed / B, 8.49, 2)


def test_real_bytes(real):
    assert near(real["bytes_total"] / GB, 509.3, 1)
    assert near(real["bytes_total"] / 2**30, 474.3, 1)
    assert near(real["bytes_routed_experts"] / GB, 288.8, 1)
    assert near(real["bytes_engram_tables"] / GB, 202.8, 1)
    assert near(real["bytes_dspark"] / GB, 7.9, 1)
    assert near(real["bytes_attention"] / GB, 5.3, 1)
    assert near(real["bytes_router_shared"] / GB, 1.6, 1)
    assert near(real["bytes_embed_head"] / GB, 2.6, 1)
    assert real["n_tensors"] == 95_819


def test_real_caches(real):
    assert real["global_kv_bytes_per_token"] == 890
    assert real["window_ring_bytes_per_sequence"] == 43 * 128 * 528 == 2_906_112
    di = model_sizes(load_config("v4.1-flash"), ring_slots=134)
    assert di["window_ring_bytes_per_sequence"] == 3_042_336


def test_mxfp8_kv_layout():
    text = json.loads((PRESETS_DIR / "v4.1-flash" / "config.json").read_text())["text_config"]
    text["use_fp4_sparse_kv"] = False
    cfg = config_from_dict(text)
    assert kv_entry_bytes(cfg) == (528, 68)
    assert model_sizes(cfg)["global_kv_bytes_per_token"] == 3 * (528 + 68) / 2 + (528 + 68)


def test_tiny():
    s = model_sizes(load_config("v4.1-flash-tiny"))
    assert near(s["params_total"] / 1e6, 99.4, 1)
    assert near(s["bytes_total"] / GB, 0.17, 2)
    assert s["global_kv_bytes_per_token"] == 212
    assert s["window_ring_bytes_per_sequence"] == 27_456


def test_medium():
    s = model_sizes(load_config("v4.1-flash-medium"))
    assert near(s["params_total"] / B, 170.7, 1)
    assert near(s["bytes_total"] / GB, 102.5, 1)
    assert near(s["bytes_routed_experts"] / GB, 72.2, 1)
    assert near(s["bytes_engram"] / GB, 13.0, 1)
    assert near(s["bytes_dspark"] / GB, 7.9, 1)
    assert s["global_kv_bytes_per_token"] == 890
