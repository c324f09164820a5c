"""bench/speculative_sm90.py on a tiny cpu plan (its smoke test; the numbers come from the H200):
every batch and mode runs, speculation off verifies nothing, 'all' verifies every draft, the
confidence-scheduled mode stays within the verify buckets, and the JSON holds the curve."""
import json
import sys
from pathlib import Path

import pytest

from deepinfer.passes.driver import CompileOptions, compile_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_speculative_bench_smoke(tmp_path):
    import speculative_sm90

    opts = CompileOptions("cpu", max_model_len=256, max_num_seqs=2, decode_batches=(1, 2), prefill_tokens=(64,),
                          verify_batches=(1, 2, (2, 6)))
    plan = compile_model("v4.1-flash-tiny", opts, tmp_path / "plan").plan_dir
    out = tmp_path / "bench.json"
    assert speculative_sm90.main(["--plan", str(plan), "--device", "cpu", "--batches", "1,2", "--steps", "1",
                                  "--warmup", "0", "--prompt-len", "16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {(c["bucket"], c["seqs"], c["rows"]) for c in res["curve"]} == {
        ("decode_b1", 1, 1), ("decode_b2", 2, 2), ("verify_b1", 1, 6), ("verify_b2", 2, 12), ("verify_b2r6", 2, 6)}
    rows = {(r["batch"], r["mode"]): r for r in res["rows"]}
    assert set(rows) == {(b, m) for b in (1, 2) for m in ("off", "all", "confidence")}
    for b in (1, 2):
        assert rows[b, "off"]["verify_rows_per_step"] == 0 and rows[b, "off"]["tokens"] == b
        assert rows[b, "all"]["verify_rows_per_step"] == b * 6
        assert 0 <= rows[b, "confidence"]["verify_rows_per_step"] <= b * 6
        assert all(r["tok_per_s"] > 0 for r in rows.values())
    with pytest.raises(SystemExit, match="batch 4 exceeds the plan's largest verify bucket"):
        speculative_sm90.main(["--plan", str(plan), "--device", "cpu", "--batches", "4", "--out", str(out)])
