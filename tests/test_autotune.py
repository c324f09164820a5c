"""The autotuner on the CPU (issue 12): the tuning database's semantics (the lookup ladder,
toolchain invalidation, merge, malformed lines, atomic saves), legality pruning of a search space,
the cost model's ranking, and a tuning run over a compiled tiny sm90 plan with a fake timer
standing in for the GPU, whose rows the next compile takes."""
import json
import warnings

import pytest

from deepinfer.autotune import cost
from deepinfer.autotune.db import TuningDB, TuningDBWarning, structure_key
from deepinfer.autotune.space import candidates
from deepinfer.autotune.tuner import fingerprint, parse_spec, table, tune
from deepinfer.codegen.library import triton_ops
from deepinfer.codegen.targets import TARGETS, get_manifest
from deepinfer.codegen.template import KernelSource, Template
from deepinfer.ir.types import quantized, tensor

from test_codegen_backends import spec

SM90 = TARGETS["sm90"]
NORM = spec("rms_norm", [tensor("bf16", 8, 256), tensor("bf16", 256)], {"eps": 1e-6})


def _fp(device="H200", triton="3.9.0"):
    return {"target": "sm90", "arch": "sm_90a", "device": device, "cores": 132, "driver": "580", "runtime": "13.0",
            "toolchain": {"triton": triton, "template_code": "abc"}}


def _row(fp, bucket, p50, config, measured=True, template="triton_rms_norm", structure=None, status="ok"):
    return {"fingerprint": fp, "template": template, "structure": structure or structure_key(NORM)[0],
            "spec": NORM.key(), "bucket": bucket, "config": config, "status": status, "measured": measured,
            "timings": {"p20": p50 * 0.9, "p50": p50, "p80": p50 * 1.1, "repeats": 20},
            "provenance": {"host": "h", "date": "2026-12-01", "source": "test"}}


def test_lookup_ladder_exact_borrowed_nearest_and_stale():
    db = TuningDB([_row(_fp(), 8, 5.0, {"BLOCK_H": 256}), _row(_fp("H100"), 8, 4.0, {"BLOCK_H": 512}),
                   _row(_fp(), 64, 3.0, {"BLOCK_H": 1024}), _row(_fp(triton="3.6.0"), 8, 1.0, {"BLOCK_H": 2048})])
    m, stale = db.lookup(_fp(), "triton_rms_norm", NORM)
    assert (m.rung, m.row["config"], stale) == ("exact", {"BLOCK_H": 256}, 1)  # this device wins over a faster one
    m, _ = db.lookup(_fp("B200-like"), "triton_rms_norm", NORM)
    assert m.rung == "borrowed" and m.row["config"] == {"BLOCK_H": 512}  # the faster of the other devices' rows
    other_rows = spec("rms_norm", [tensor("bf16", 48, 256), tensor("bf16", 256)], {"eps": 1e-6})
    assert structure_key(other_rows)[0] == structure_key(NORM)[0] and structure_key(other_rows)[1] == 48
    m, _ = db.lookup(_fp(), "triton_rms_norm", other_rows)
    assert m.rung == "nearest" and m.row["bucket"] == 64  # log2 distance: 48 is nearer 64 than 8
    # a row of another toolchain is never used, only counted
    m, stale = db.lookup(_fp(triton="3.6.0"), "triton_rms_norm", NORM)
    assert m.rung == "exact" and stale == 3
    assert db.lookup(_fp(triton="4.0"), "triton_rms_norm", NORM) == (None, 4)
    wider = spec("rms_norm", [tensor("bf16", 8, 512), tensor("bf16", 512)], {"eps": 1e-6})
    assert db.lookup(_fp(), "triton_rms_norm", wider) == (None, 0)  # another structure


def test_merge_save_and_malformed_lines(tmp_path):
    a = TuningDB([_row(_fp(), 8, 5.0, {"BLOCK_H": 256}), _row(_fp(), 16, 2.0, {"BLOCK_H": 256}, measured=False)])
    b = TuningDB([_row(_fp(), 8, 4.0, {"BLOCK_H": 512}), _row(_fp(), 16, 9.0, {"BLOCK_H": 1024})])
    m = a.merged(b)
    by_bucket = {r["bucket"]: r["config"]["BLOCK_H"] for r in m.rows}
    assert by_bucket == {8: 512, 16: 1024}  # the lower p50; a measured row beats a modelled one
    path = m.save(tmp_path / "db.jsonl")
    assert not list(tmp_path.glob(".*"))  # no temporary left
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{not json", json.dumps({"template": "x"}), lines[1],
                               json.dumps(dict(json.loads(lines[1]), status="maybe"))]) + "\n")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        back = TuningDB.load(path)
    msgs = [str(x.message) for x in w if issubclass(x.category, TuningDBWarning)]
    assert len(back.rows) == 2 and len(msgs) == 3
    assert msgs[0].startswith(f"{path}:2: skipped, not JSON") and msgs[1].startswith(f"{path}:3: skipped, missing")
    assert msgs[2] == f"{path}:5: skipped, status 'maybe' is not ok or failed"
    assert all("\n" not in m for m in msgs)
    assert TuningDB.load(tmp_path / "absent.jsonl").rows == []
    with pytest.raises(ValueError, match="^tuning row: missing"):
        back.add({"template": "x"})


def test_legality_pruning_drops_unrenderable_and_oversized_configs():
    def render(target, s, cfg):
        if cfg["tile"] == 3:
            raise ValueError("tile must be a power of two")
        return KernelSource("cuda", "k", "", grid=(4,), block=(cfg["threads"],), smem_bytes=cfg["tile"] * 64 * 1024)

    t = Template("fake_gemm", ("rms_norm",), ("sm90",), {"tile": (1, 2, 3, 4), "threads": (128, 2048)}, render,
                 lambda target, s: {"tile": 1, "threads": 128})
    cands, pruned = candidates(get_manifest("sm90"), t, NORM)
    kept = sorted((c.config["tile"], c.config["threads"]) for c in cands)
    # tile 3 does not render, 2048 threads exceed a block, 4 x 64 KB exceed the 227 KB of shared memory
    assert kept == [(1, 128), (2, 128)] and pruned == 6
    assert cands[0].config == {"tile": 1, "threads": 128}  # the default first


def test_cost_model_ranks_the_decode_k_split_as_the_h200_measured():
    """wo_a at batch 1 (one 16-row tile): the H200 sweep measured the 8-way K split fastest
    (bench/results/triton_h200_block_linear_split.json); the model must rank it above no split,
    and, at 4K rows, not prefer splitting."""
    t = triton_ops.TEMPLATES_BY_OP["grouped_linear"]
    w = quantized("fp8e4m3", (8 * 1024, 4096), "e8m0", (32, 32))
    for rows, want_split in ((1, True), (4096, False)):
        s = spec("grouped_linear", [tensor("bf16", rows, 8 * 4096), w], {"groups": 8, "weight_dtype": "bf16"})
        base = t.default_config(SM90, s)
        times = {k: cost.estimate(SM90, s, t.render(SM90, s, dict(base, SPLIT=k))) for k in (1, 8)}
        assert (times[8] < times[1]) == want_split, (rows, times)


def test_parse_spec_round_trips_plan_keys():
    w = quantized("fp8e4m3", (1280, 5120), "e8m0", (32, 32))
    s = spec("gemm_fp8", [quantized("fp8e4m3", (1, 5120), "e8m0", (1, 32)), w], {"out_dtype": "bf16"})
    back = parse_spec(s.key())
    assert back == s


SMALL = dict(max_model_len=2048, max_num_seqs=4, decode_batches=(1,), prefill_tokens=(512,), jobs=2)


def test_tune_with_a_fake_timer_then_compile_takes_the_rows(tmp_path, capsys):
    from deepinfer.cli import main
    from deepinfer.codegen.plan import load_plan
    from deepinfer.passes.driver import CompileOptions, compile_model

    plan = compile_model("v4.1-flash-tiny", CompileOptions("sm90", **SMALL, tuning_db="none"), tmp_path / "p").plan_dir
    timed = []

    def timer(t, s, cfg, src):  # BLOCK_H 512 with 2 warps is fastest; 4 warps never finish
        timed.append(cfg)
        if cfg["num_warps"] == 4 and cfg["BLOCK_H"] == 256:
            raise TimeoutError("hung")
        us = 3.0 + abs(cfg["BLOCK_H"] - 512) / 256 + cfg["num_warps"] / 8 + cfg["num_stages"]
        return {"p20": us, "p50": us, "p80": us, "repeats": 10}

    db = TuningDB(path=tmp_path / "db.jsonl")
    run = tune(plan, db, timer=timer, device={"name": "FAKE H200", "driver": "x", "runtime": "y"},
               only="triton_rms_norm", top_k=100)
    best = {"BLOCK_H": 512, "num_warps": 2, "num_stages": 1}  # the fake timer's minimum
    assert run.results and all(r.measured and r.config == best for r in run.results)
    assert all(r.failed >= 1 for r in run.results) and timed
    rows = TuningDB.load(tmp_path / "db.jsonl").rows
    assert len(rows) == len(run.results) and all(r["measured"] and r["config"] == best for r in rows)
    print(table(run))
    assert "measured; step time saved" in capsys.readouterr().out
    again = tune(plan, TuningDB.load(tmp_path / "db.jsonl"), timer=timer, device={"name": "FAKE H200", "driver": "x",
                                                                                 "runtime": "y"}, only="triton_rms_norm")
    assert all(r.skipped for r in again.results)  # a rerun resumes: exact rows are kept, not re-timed
    # the compiling machine has no device: the rows are borrowed, recorded with each instance
    plan2 = compile_model("v4.1-flash-tiny", CompileOptions("sm90", **SMALL, tuning_db=str(tmp_path / "db.jsonl")),
                          tmp_path / "p2").plan_dir
    norms = [k for k in load_plan(plan2)["kernels"].values() if k["template"] == "triton_rms_norm"]
    assert norms and all(k["tuning"]["rung"] == "borrowed" and k["tuning"]["device"] == "FAKE H200"
                         and k["config"] == best for k in norms)
    others = [k for k in load_plan(plan2)["kernels"].values() if k["template"] == "triton_rope"]
    assert others and not any("tuning" in k for k in others)
    # the CLI: the cost model ranks where no hardware is; measured tuning says what it lacks
    out_db = tmp_path / "cost.jsonl"
    assert main(["autotune", str(plan), "--db", str(out_db), "--cost-model-only", "--only", "triton_rope"]) == 0
    out = capsys.readouterr().out
    assert "modelled (cost model, no hardware)" in out and f"wrote {out_db}" in out
    assert all(not r["measured"] for r in TuningDB.load(out_db).rows)
    assert main(["autotune", str(plan), "--db", str(out_db)]) == 2
    assert "--cost-model-only" in capsys.readouterr().err
    assert main(["autotune", str(plan), "--cost-model-only", "--only", "nope"]) == 2
    assert "no template 'nope'" in capsys.readouterr().err


def test_fingerprint_names_device_toolchain_and_template_code():
    fp = fingerprint(SM90, "triton_rms_norm", {"name": "NVIDIA H200", "driver": "580", "runtime": "13.0"})
    assert fp["device"] == "NVIDIA H200" and fp["arch"] == "sm_90a" and fp["cores"] == 132
    assert {"triton", "ptxas", "template_code"} <= set(fp["toolchain"])
    assert fingerprint(SM90, "tilelang_gemm_fp8")["toolchain"].keys() >= {"nvcc", "tilelang", "template_code"}
