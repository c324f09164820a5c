"""`deepinfer inspect` prints the spec's sizes for the real config (spec §12.1, §6.2)."""
import json

from deepinfer.cli import main


def test_inspect_real_model_json(capsys):
    assert main(["inspect", "--model", "v4.1-flash", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    p = r["params"]
    for key, want in (("total", 762.7e9), ("backbone", 551.6e9), ("engram", 196.9e9)):
        assert abs(p[key] - want) / want < 1e-3, key
    assert round(p["dspark"] / 1e9, 1) == 14.2  # the spec rounds 14.225B to 14.2B
    assert r["global_kv_bytes_per_token"] == 890
    assert r["graphs"]["step"]["ops"]["sparse_attn"] == 38 and r["graph_build_seconds"] < 30


def test_inspect_text_and_bad_model(capsys, tmp_path):
    assert main(["inspect", "--model", "v4.1-flash-tiny"]) == 0
    out = capsys.readouterr().out
    assert "99.4M" in out and "212 B/token" in out
    (tmp_path / "config.json").write_text('{"text_config": {"hidden_size": 100}}')
    assert main(["inspect", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepinfer: error: ") and err.count("\n") == 1
