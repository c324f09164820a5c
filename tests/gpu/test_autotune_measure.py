"""The measured autotuner on the GPU machine: a candidates directory built on the compile machine
is measured through the runtime's launch path (cubins through the driver, host recipes replayed),
every candidate checked against its op's reference before it is timed; rows are written with this
GPU's fingerprint and the building host's toolchain, a rerun skips them, and measuring needs no
kernel language (Triton and TileLang cannot be imported in the workers of the second test).

DEEPINFER_TUNING_CANDIDATES names the directory, built on the compile machine, e.g. from the
tiny sm90 plan of tests/gpu/test_cuda_executor.py:
    deepinfer autotune PLAN --build-candidates DIR --only triton_rms_norm,triton_hc_pre --top-k 3
Run: DEEPINFER_TUNING_CANDIDATES=DIR python -m pytest -m gpu tests/gpu/test_autotune_measure.py
(scripts/autotune_h200.sh does, given the directory as a tarball).
"""
import os
from pathlib import Path

import pytest
import torch

from deepinfer.autotune.candidates import load_manifest
from deepinfer.autotune.db import TuningDB
from deepinfer.autotune.measure import IsolatedRunner, measure
from deepinfer.cli import main

CANDIDATES = os.environ.get("DEEPINFER_TUNING_CANDIDATES")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
              pytest.mark.skipif(not CANDIDATES, reason="DEEPINFER_TUNING_CANDIDATES names no candidates directory")]


def _check_rows(db_path):
    man = load_manifest(CANDIDATES)
    rows = TuningDB.load(db_path).rows
    assert {r["instance"] for r in rows} == set(man["instances"])
    for r in rows:
        e = man["instances"][r["instance"]]
        assert r["measured"] and r["status"] == "ok", r["candidates"]
        assert r["fingerprint"]["device"] == torch.cuda.get_device_name(0)
        assert r["fingerprint"]["toolchain"] == e["fingerprint"]["toolchain"]  # the building host's
        assert 0 < r["timings"]["p20"] <= r["timings"]["p50"] <= r["timings"]["p80"]
        assert all(c["status"] == "ok" for c in r["candidates"] if c["default"]), r["candidates"]
        # every candidate runs; one may fail its op's check (a config's rounding at a boundary):
        # that is a finding the row records, not a failure of the measuring
        crashed = [c for c in r["candidates"] if c["status"] == "failed"]
        assert not crashed, crashed
        for c in r["candidates"]:
            if c["status"] == "wrong":
                print(f"{r['instance']} {c['id']} {c['config']}: {c['why']}")
    return rows


def test_measure_times_every_candidate_through_the_runtime(tmp_path, capsys):
    db = tmp_path / "tuned.jsonl"
    args = ["autotune", "--measure", CANDIDATES, "--db", str(db), "--sets", "2", "--repeats", "10"]
    assert main(args) == 0
    out = capsys.readouterr().out
    print(out)
    assert "measured; step time saved" in out
    rows = _check_rows(db)
    assert main(args) == 0  # a rerun skips what the database holds for this GPU
    assert TuningDB.load(db).rows == rows


def test_measuring_needs_no_kernel_language(tmp_path):
    runner = IsolatedRunner(bench="no_compiler_bench:NoCompilerBench", settings={"sets": 1, "repeats": 5},
                            env={"PYTHONPATH": str(Path(__file__).parent)})
    measure(CANDIDATES, TuningDB(path=tmp_path / "tuned.jsonl"), runner=runner)
    _check_rows(tmp_path / "tuned.jsonl")
