"""The autotuner on the CPU (issue 12): the tuning database's semantics (the lookup ladder,
toolchain invalidation, merge, malformed lines, atomic saves), legality pruning of a search space,
the cost model's ranking, and a tuning run over a compiled tiny sm90 plan with a fake timer
standing in for the GPU, whose rows the next compile takes."""
import json
import warnings
from pathlib import Path

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
    assert msgs[2] == f"{path}:5: skipped, status 'maybe' is not ok or failed; a rewrite of the file keeps the line as it is"
    assert all("\n" not in m for m in msgs)
    assert TuningDB.load(tmp_path / "absent.jsonl").rows == []
    with pytest.raises(ValueError, match="^tuning row: missing"):
        back.add({"template": "x"})


def test_a_rewrite_keeps_the_lines_it_could_not_read(tmp_path):
    """A tuning run rewrites its database after each instance: the lines it skipped (the user's,
    maybe a row to fix) go back into the file byte for byte, after the rows."""
    path = tmp_path / "db.jsonl"
    unread = [b"my notes", json.dumps({"template": "x"}).encode(), b"\xff\xfe not UTF-8", b'{"cut": ',
              b"windows line\r", b"[" * 100_000]
    path.write_bytes(b"\n".join([json.dumps(_row(_fp(), 8, 5.0, {"BLOCK_H": 256})).encode(), *unread, b""]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        db = TuningDB.load(path)
    msgs = [str(x.message) for x in w if issubclass(x.category, TuningDBWarning)]
    assert len(db.rows) == 1 and len(msgs) == len(unread)
    assert all(m.endswith("; a rewrite of the file keeps the line as it is") for m in msgs)
    assert msgs[2].startswith(f"{path}:4: skipped, not UTF-8 (byte 0xff at column 1)")
    assert msgs[5].startswith(f"{path}:7: skipped, not JSON (nested too deeply)")
    db.add(_row(_fp(), 16, 2.0, {"BLOCK_H": 512}))
    db.save()
    assert path.read_bytes().split(b"\n")[2:] == [*unread, b""]  # the rows first, then the rest
    with pytest.warns(TuningDBWarning):
        assert len(TuningDB.load(path).rows) == 2
    db.merged(TuningDB([_row(_fp(), 32, 1.0, {"BLOCK_H": 1024})])).save()
    assert path.read_bytes().split(b"\n")[3:] == [*unread, b""]
    assert not [p.name for p in tmp_path.iterdir() if p.name != "db.jsonl"]  # no temporary left


def _damaged(**fields):
    row = _row(_fp(), 8, 5.0, {"BLOCK_H": 256})
    for k, v in fields.items():  # "fingerprint.toolchain": a field of a field
        *outer, last = k.split(".")
        (row[outer[0]] if outer else row)[last] = v
    return row


@pytest.mark.parametrize("row, why", [
    (_damaged(**{"fingerprint.toolchain": "cuda13"}), "fingerprint toolchain must be an object"),
    (_damaged(**{"fingerprint.cores": "132"}), "fingerprint cores must be an integer or null"),
    (_damaged(**{"fingerprint.device": ["H200"]}), "fingerprint device must be a string or null"),
    (_damaged(provenance="today"), "config, fingerprint and provenance must be objects"),
    (_damaged(**{"provenance.date": 20261201}), "provenance date must be a string or null"),
    (_damaged(template=["triton_rms_norm"]), "template must be a string"),
    (_damaged(structure=None), "structure must be a string"),
    (_damaged(config={"BLOCK_H": [256]}), "config BLOCK_H must be a number, string or boolean"),
    (_damaged(bucket=True), "bucket True is not a row count"),
    (_damaged(timings={"p50": "fast"}), "timings must be null or hold a p50"),
    (_damaged(instance=["k1"]), "instance must be a string or null"),
    (_damaged(candidates="all"), "candidates must be a list"),
    (_damaged(candidates=[{"id": "c00", "default": True, "status": "ok"}]), "candidates must be a list"),
])
def test_a_row_of_the_wrong_types_is_skipped_like_any_malformed_line(tmp_path, row, why):
    """Whatever a lookup, a table or a plan's provenance reads later is checked at load: such a
    row is reported and skipped, never a crash in the middle of a compile."""
    from deepinfer.autotune.db import check_row, provenance

    assert check_row(row).startswith(why)
    path = tmp_path / "db.jsonl"
    good = _row(_fp(), 8, 5.0, {"BLOCK_H": 512})
    path.write_text(json.dumps(row) + "\n" + json.dumps(good) + "\n")
    with pytest.warns(TuningDBWarning, match=f"^{path}:1: skipped, {why}"):
        db = TuningDB.load(path)
    match, stale = db.lookup(_fp(), "triton_rms_norm", NORM)
    assert db.rows == [good] and match.row == good and stale == 0
    assert provenance(match, db)["date"] == "2026-12-01"
    with pytest.raises(ValueError, match=f"^tuning row: {why}"):
        db.add(row)


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


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """A tiny sm90 plan compiled with template defaults (its kernels come from the compile cache
    after the first run)."""
    from deepinfer.passes.driver import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("sm90") / "p"
    return compile_model("v4.1-flash-tiny", CompileOptions("sm90", **SMALL, tuning_db="none"), out).plan_dir


def test_tune_with_a_fake_timer_then_compile_takes_the_rows(plan, tmp_path, capsys):
    from deepinfer.cli import main
    from deepinfer.codegen.plan import load_plan
    from deepinfer.passes.driver import CompileOptions, compile_model

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
    others = [k for k in load_plan(plan2)["kernels"].values() if k["template"] != "triton_rms_norm"]
    assert others and not any("tuning" in k for k in others)
    # the CLI: the cost model ranks where no hardware is; measured tuning says what it lacks
    out_db = tmp_path / "cost.jsonl"
    out_db.write_text("my notes\n")  # not a row: warned about, and kept through the rewrite
    assert main(["autotune", str(plan), "--db", str(out_db), "--cost-model-only", "--only", "triton_hc_expand"]) == 0
    out, err = capsys.readouterr()
    assert "modelled (cost model, no hardware)" in out and f"wrote {out_db}" in out
    assert f"{out_db}:1: skipped, not JSON" in err and out_db.read_text().endswith("\nmy notes\n")
    with pytest.warns(TuningDBWarning, match="not JSON"):
        assert all(not r["measured"] for r in TuningDB.load(out_db).rows)
    assert main(["autotune", str(plan), "--db", str(out_db)]) == 2
    assert "--cost-model-only" in capsys.readouterr().err
    assert main(["autotune", str(plan), "--cost-model-only", "--only", "nope"]) == 2
    assert "no template or instance 'nope'" in capsys.readouterr().err
    # --prune-stale: the tuned template's rows of another template code go, other templates' stay
    with pytest.warns(TuningDBWarning):
        db = TuningDB.load(out_db)
    current = [r for r in db.rows if r["template"] == "triton_hc_expand"]
    assert current

    def edited(row, template=None):
        fp = dict(row["fingerprint"], toolchain=dict(row["fingerprint"]["toolchain"], template_code="an older edit"))
        return dict(row, fingerprint=fp, template=template or row["template"], bucket=row["bucket"] + 1)

    db.rows += [edited(current[0]), edited(current[0], "triton_rms_norm")]
    db.save()
    assert main(["autotune", str(plan), "--db", str(out_db), "--cost-model-only", "--only", "triton_hc_expand",
                 "--prune-stale"]) == 0
    assert "1 stale rows of the tuned templates dropped" in capsys.readouterr().out
    with pytest.warns(TuningDBWarning):
        left = TuningDB.load(out_db).rows
    assert [r["template"] for r in left if r["fingerprint"]["toolchain"]["template_code"] == "an older edit"] == \
        ["triton_rms_norm"]
    assert len(left) == len(current) + 1 and out_db.read_text().endswith("\nmy notes\n")
    assert main(["autotune", str(plan), "--db", str(out_db), "--prune-stale", "--measure", str(tmp_path)]) == 2
    assert "--prune-stale rewrites the database" in capsys.readouterr().err


def test_fingerprint_names_device_toolchain_and_template_code():
    fp = fingerprint(SM90, "triton_rms_norm", {"name": "NVIDIA H200", "driver": "580", "runtime": "13.0"})
    assert fp["device"] == "NVIDIA H200" and fp["arch"] == "sm_90a" and fp["cores"] == 132
    assert {"triton", "ptxas", "template_code"} <= set(fp["toolchain"])
    assert fingerprint(SM90, "tilelang_gemm_fp8")["toolchain"].keys() >= {"nvcc", "tilelang", "template_code"}


# ---- measured tuning: candidates built here, measured on a GPU machine --------------------------

GPU_HOST = {"name": "FAKE H200", "cores": 132, "driver": "13.0", "runtime": "13.0"}


def test_lookup_takes_rows_measured_on_another_host_with_this_hosts_toolchain():
    """The rule a compile applies to rows a GPU machine measured (autotune/db.py): usable where
    the arch and the toolchain that built the kernels (this host's, recorded in the candidates'
    manifest) match; the GPU machine's own toolchain never enters a row. A compiling host has no
    device, so measured rows are borrowed; a measurement beats the cost model at the bucket; of
    several devices, one with the target's core count first."""
    from deepinfer.autotune.tuner import make_row, on_device

    here = fingerprint(SM90, "triton_rms_norm")  # what a compile on this host asks with
    built = dict(here, device=None)  # what the manifest records, made where the kernels were built
    measured = make_row(on_device(built, GPU_HOST), "triton_rms_norm", NORM, NORM.key(), {"BLOCK_H": 512},
                        {"p20": 4.0, "p50": 4.5, "p80": 5.0, "repeats": 100}, measured=True)
    gpu_toolchain = make_row(on_device(dict(built, toolchain=dict(built["toolchain"], triton="3.6.0")), GPU_HOST),
                             "triton_rms_norm", NORM, NORM.key(), {"BLOCK_H": 2048}, {"p50": 1.0}, measured=True)
    modelled = make_row(here, "triton_rms_norm", NORM, NORM.key(), {"BLOCK_H": 256}, {"p50": 0.5}, measured=False)
    db = TuningDB([modelled, gpu_toolchain, measured])
    m, stale = db.lookup(here, "triton_rms_norm", NORM)
    assert (m.rung, m.row["config"], stale) == ("borrowed", {"BLOCK_H": 512}, 1)
    assert db.lookup(on_device(built, GPU_HOST), "triton_rms_norm", NORM)[0].rung == "exact"  # on the GPU machine
    m, _ = TuningDB([modelled]).lookup(here, "triton_rms_norm", NORM)
    assert m.rung == "modelled"
    small = dict(GPU_HOST, name="SMALL H", cores=78)
    faster_elsewhere = make_row(on_device(built, small), "triton_rms_norm", NORM, NORM.key(), {"BLOCK_H": 1024},
                                {"p50": 2.0}, measured=True)
    m, _ = TuningDB([faster_elsewhere, measured]).lookup(here, "triton_rms_norm", NORM)
    assert m.row["config"] == {"BLOCK_H": 512}  # the device with the target's 132 cores
    # a changed template (its code hash) or compiler makes every row stale
    changed = dict(here, toolchain=dict(here["toolchain"], template_code="edited"))
    assert db.lookup(changed, "triton_rms_norm", NORM) == (None, 3)


@pytest.fixture(scope="module")
def candidates_dir(plan, tmp_path_factory):
    """The tiny plan's rms_norm candidates (top 6 by the cost model and the default), built once."""
    from deepinfer.autotune.candidates import build_candidates

    out = tmp_path_factory.mktemp("cands") / "c"
    build_candidates(plan, out, only="triton_rms_norm", top_k=6, jobs=2)
    return out


def test_build_candidates_writes_a_resumable_manifest(plan, candidates_dir, tmp_path, capsys):
    import shutil

    from deepinfer.autotune.candidates import MANIFEST, damaged_files, load_manifest
    from deepinfer.cli import main
    from deepinfer.codegen.plan import load_plan

    man = load_manifest(candidates_dir)
    norms = {i for i, k in load_plan(plan)["kernels"].items() if k["template"] == "triton_rms_norm"}
    assert set(man["instances"]) == norms and man["target"] == {"name": "sm90", "arch": "sm_90a"}
    for e in man["instances"].values():
        assert e["fingerprint"]["toolchain"] == fingerprint(SM90, "triton_rms_norm")["toolchain"]
        assert e["fingerprint"]["device"] is None  # the GPU machine fills that in
        assert sum(c["default"] for c in e["candidates"]) == 1 and 6 <= len(e["candidates"]) <= 7
        assert e["candidates"][0]["modelled_us"] <= e["candidates"][-1]["modelled_us"] or e["candidates"][-1]["default"]
        for c in e["candidates"]:
            assert c["status"] == "built" and c["recipe"]["steps"] and not damaged_files(candidates_dir, c)
            assert set(c["kernel"]["build"]["files"]) == {"cubin0", "launches"}  # no sources, no PTX
    # a rerun with the same settings skips every instance the manifest holds
    assert main(["autotune", str(plan), "--build-candidates", str(candidates_dir), "--only", "triton_rms_norm",
                 "--top-k", "6", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert f"0 instances built (0 candidates, 0 failed), {len(norms)} kept" in out and "--measure" in out
    # bad directories and manifests: one line each
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["autotune", str(plan), "--build-candidates", str(other)]) == 2
    assert capsys.readouterr().err == f"deepinfer: error: {other}: holds files and no {MANIFEST}; give an empty or new directory\n"
    bad = tmp_path / "bad"
    shutil.copytree(candidates_dir, bad)
    no_plan = {k: v for k, v in man.items() if k != "plan"}
    for text, why in (("{not json", "not JSON"), ("[" * 100_000, "not JSON (nested too deeply)"),
                      (json.dumps({"format": "x"}), "not a DeepInfer tuning-candidates"),
                      (json.dumps(dict(man, instances={"k1": {"template": "t"}})), "instance k1: spec is missing"),
                      (json.dumps(dict(man, plan="x")), "plan must name its model and config_hash"),
                      (json.dumps(no_plan), "plan must name its model and config_hash")):
        (bad / MANIFEST).write_text(text)
        assert main(["autotune", "--measure", str(bad), "--db", str(tmp_path / "db.jsonl")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"deepinfer: error: {bad / MANIFEST}: {why}") and err.count("\n") == 1, err
    # the modes that match the manifest's plan against PLAN_DIR say so too
    (tmp_path / "rows.jsonl").write_text("")
    for text, mode in ((json.dumps(dict(man, plan="x")), ["--build-candidates", str(bad)]),
                       (json.dumps(no_plan), ["--apply", str(bad), "--db", str(tmp_path / "rows.jsonl"), "-o",
                                              str(tmp_path / "tuned")])):
        (bad / MANIFEST).write_text(text)
        assert main(["autotune", str(plan), *mode]) == 2
        assert capsys.readouterr().err == f"deepinfer: error: {bad / MANIFEST}: plan must name its model and config_hash\n"
    assert main(["autotune", "--measure", str(tmp_path / "absent"), "--db", str(tmp_path / "db.jsonl")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["autotune", str(plan), "--measure", str(candidates_dir), "--db", "x"]) == 2
    assert "drop PLAN_DIR" in capsys.readouterr().err
    assert main(["autotune", str(plan), "--cost-model-only", "--build-candidates", str(tmp_path / "n")]) == 2
    assert "not --cost-model-only and --build-candidates" in capsys.readouterr().err


def _decode_instance(candidates_dir):
    """(id, manifest entry) of the candidates' one-row rms_norm instance."""
    from deepinfer.autotune.candidates import load_manifest

    return next((i, e) for i, e in sorted(load_manifest(candidates_dir)["instances"].items())
                if parse_spec(e["spec"]).in_types[0].shape[0] == 1)


def _fake_runner(settings, timeout_s=10.0):
    from pathlib import Path

    from deepinfer.autotune.measure import IsolatedRunner

    return IsolatedRunner(bench="autotune_fakes:InterpretedBench", timeout_s=timeout_s,
                          settings=dict({"sets": 2, "repeats": 4, "warmup": 1}, **settings),
                          env={"TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parent)})


def test_measure_isolates_candidates_checks_them_and_compile_takes_the_row(plan, candidates_dir, tmp_path, capsys):
    """Each candidate runs its real host recipe from the manifest (Triton kernels interpreted in
    place of cubins, tests/autotune_fakes.py), checked against the op's reference: one that
    raises, crashes its process, hangs or computes a wrong result is recorded and never wins,
    even when it would be the fastest; the row is written after the instance, a rerun skips it,
    and the next compile takes its config."""
    from deepinfer.autotune.measure import measure
    from deepinfer.codegen.plan import load_plan
    from deepinfer.passes.driver import CompileOptions, compile_model

    d, (inst, e) = candidates_dir, _decode_instance(candidates_dir)
    default = next(c["id"] for c in e["candidates"] if c["default"])
    others = [c["id"] for c in e["candidates"] if not c["default"]]
    raises, crashes, wrong, best, hangs = others[0], others[1], others[2], others[3], others[-1]
    us = dict({c["id"]: 9.0 for c in e["candidates"]}, **{raises: 0.1, crashes: 0.1, wrong: 0.5, hangs: 0.1,
                                                           default: 5.0, best: 4.0})
    runner = _fake_runner({"act": {raises: "raise", crashes: "crash", wrong: "wrong", hangs: "hang"}, "us": us},
                          timeout_s=8.0)
    db = TuningDB(path=tmp_path / "tuned.jsonl")
    run = measure(d, db, runner=runner, only=inst)
    (row,) = TuningDB.load(tmp_path / "tuned.jsonl").rows
    want_cfg = next(c["config"] for c in e["candidates"] if c["id"] == best)
    assert row["measured"] and row["status"] == "ok" and row["config"] == want_cfg and row["timings"]["p50"] == 4.0
    assert row["fingerprint"]["device"] == "FAKE H200" and row["fingerprint"]["toolchain"] == e["fingerprint"]["toolchain"]
    outcome = {c["id"]: (c["status"], c["why"]) for c in row["candidates"]}
    assert outcome[raises] == ("failed", "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert outcome[crashes][0] == "failed" and "signal 11" in outcome[crashes][1]
    assert outcome[hangs] == ("failed", f"timed out after 8 s (candidate {hangs})")
    assert outcome[wrong][0] == "wrong" and "beyond 1 ulp" in outcome[wrong][1], outcome
    assert outcome[default][0] == "ok" and outcome[default][1].startswith("max rel")
    (r,) = run.results
    assert (r.default_us, r.tuned_us, r.failed) == (5.0, 4.0, 4) and r.speedup == 1.25
    print(table(run, configs=True))
    text = capsys.readouterr().out
    assert inst in text and "1.25x" in text and " ".join(f"{k}={v}" for k, v in sorted(want_cfg.items())) in text
    again = measure(d, TuningDB.load(tmp_path / "tuned.jsonl"), runner=_fake_runner({"act": {default: "raise"}}),
                    only=inst)
    assert [x.skipped for x in again.results] == [True] and again.results[0].tuned_us == 4.0
    plan2 = compile_model("v4.1-flash-tiny", CompileOptions("sm90", **SMALL, tuning_db=str(tmp_path / "tuned.jsonl")),
                          tmp_path / "p2").plan_dir
    k = load_plan(plan2)["kernels"]
    tuned = [v for v in k.values() if v["spec"] == e["spec"]]
    assert tuned and all(v["config"] == want_cfg and v["tuning"]["rung"] == "borrowed" and v["tuning"]["measured"]
                         and v["tuning"]["device"] == "FAKE H200" for v in tuned)
    _apply_writes_what_the_compile_wrote(plan, d, tmp_path / "tuned.jsonl", plan2, inst, tmp_path, capsys)


def _apply_writes_what_the_compile_wrote(plan, cands, db, compiled_dir, inst, tmp_path, capsys):
    """`autotune PLAN --apply CANDS --db DB -o OUT` (no compiler: the GPU machine's last step)
    writes the plan that a compile with --tuning-db DB wrote: the same configs, provenance and
    binaries per instance, and the same host recipe for every launch; the untuned plan is kept.
    An instance whose only row is another bucket's (the nearest rung, which a compile takes) keeps
    its own config, and the report names it: where --apply runs, it can be measured itself."""
    import re

    from deepinfer.cli import main
    from deepinfer.codegen.plan import load_plan

    before = (Path(plan) / "plan.json").read_bytes()
    out = tmp_path / "applied"
    assert main(["autotune", str(plan), "--apply", str(cands), "--db", str(db), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(rf"^{inst} +triton_rms_norm .* borrowed ", text, re.M) and "1 instances retuned" in text, text
    assert (Path(plan) / "plan.json").read_bytes() == before
    applied, compiled, untuned = load_plan(out), load_plan(compiled_dir), load_plan(plan)
    kept = set(re.findall(r"^  (k\d+): kept its config, its only row was measured at \d+ rows", text, re.M))
    nearest = {i for i, k in compiled["kernels"].items() if k.get("tuning", {}).get("rung") == "nearest"}
    assert kept and kept == nearest, (kept, nearest)
    assert applied["kernels"].keys() == compiled["kernels"].keys()
    for i, want in compiled["kernels"].items():
        got = applied["kernels"][i]
        if i in kept:
            assert got["config"] == untuned["kernels"][i]["config"] and "tuning" not in got
            continue
        assert [got.get(f) for f in ("template", "spec", "config", "grid", "block", "meta", "tuning")] == \
               [want.get(f) for f in ("template", "spec", "config", "grid", "block", "meta", "tuning")], i
        for art, rel in want.get("build", {}).get("files", {}).items():
            assert applied["files"][got["build"]["files"][art]] == compiled["files"][rel], (i, art)
    for name, g in compiled["graphs"].items():
        for c, c2 in zip(g["calls"], applied["graphs"][name]["calls"]):
            for b, ln in c["launch"].items():
                ln2 = c2["launch"][b]
                assert ("recipe" in ln) == ("recipe" in ln2)
                if "recipe" in ln and ln["kernel"] not in kept:
                    assert applied["recipes"][ln2["recipe"]] == compiled["recipes"][ln["recipe"]], (c["op"], b)
    # bad requests, one line each; nothing is written over the plan being tuned
    for argv, why in ((["--db", str(db), "-o", str(plan)], "is the plan being tuned"),
                      (["-o", str(out)], "--apply needs --db DB.jsonl"),
                      (["--db", str(tmp_path / "absent.jsonl"), "-o", str(out)], "no such file")):
        assert main(["autotune", str(plan), "--apply", str(cands)] + argv) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err
    assert main(["autotune", str(plan), "--measure", str(cands), "--db", str(db), "-o", str(out)]) == 2
    assert "-o names the tuned plan" in capsys.readouterr().err


def test_an_instance_whose_candidates_all_fail_is_recorded_and_never_taken(candidates_dir, tmp_path):
    from deepinfer.autotune.candidates import load_manifest
    from deepinfer.autotune.measure import measure
    from deepinfer.autotune.tuner import fingerprint as fp_of

    class Broken:  # a runner whose every candidate failed: what a worker reports for a setup failure
        def device(self):
            return GPU_HOST

        def run(self, cand_dir, inst, ids):
            return {cid: {"status": "failed", "why": "setup: LookupError: no input case"} for cid in ids}

        def close(self):
            pass

    inst, e = _decode_instance(candidates_dir)
    db = TuningDB(path=tmp_path / "db.jsonl")
    run = measure(candidates_dir, db, runner=Broken(), only=inst)
    (row,) = db.rows
    assert row["status"] == "failed" and row["timings"] is None and run.results[0].config == {}
    assert "(every candidate failed)" in table(run, configs=True)
    assert measure(candidates_dir, db, runner=Broken(), only=inst).results[0].skipped  # not retried on every rerun
    spec_ = parse_spec(e["spec"])
    assert db.lookup(fp_of(SM90, "triton_rms_norm"), "triton_rms_norm", spec_) == (None, 0)
    # a budget stops before the next instance; the run says how many it left
    spent = measure(candidates_dir, TuningDB(), runner=Broken(), budget_s=1e-9)
    assert spent.results == [] and spent.left == len(load_manifest(candidates_dir)["instances"])


def test_a_win_inside_the_defaults_spread_keeps_the_default(candidates_dir):
    from deepinfer.autotune.measure import measure

    inst, e = _decode_instance(candidates_dir)
    default = next(c for c in e["candidates"] if c["default"])
    challenger = next(c for c in e["candidates"] if not c["default"])

    class Timed:  # the default at 5.0 us (p20 4.5), the challenger at `p50`, the rest slower
        def __init__(self, p50):
            self.p50 = p50

        def device(self):
            return GPU_HOST

        def run(self, cand_dir, inst, ids):
            us = {default["id"]: 5.0, challenger["id"]: self.p50}
            return {cid: {"status": "ok", "timings": {"p20": t * 0.9, "p50": t, "p80": t * 1.1, "repeats": 10}}
                    for cid in ids for t in [us.get(cid, 9.0)]}

        def close(self):
            pass

    for p50, winner in ((4.6, default), (4.4, challenger)):
        db = TuningDB()
        (r,) = measure(candidates_dir, db, runner=Timed(p50), only=inst).results
        assert db.rows[0]["config"] == winner["config"] and r.tuned_us == (5.0 if winner is default else p50)


def test_measure_without_a_gpu_says_so(candidates_dir, capsys, tmp_path):
    """The real device bench, on a machine with no GPU: one line, no rows."""
    from deepinfer.cli import main

    assert main(["autotune", "--measure", str(candidates_dir), "--db", str(tmp_path / "db.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepinfer: error: no GPU to measure on: worker exit status 3") and err.count("\n") == 1
    assert not (tmp_path / "db.jsonl").exists()


def test_cost_model_agreement_is_spearmans_rho_over_each_instances_measured_candidates():
    """docs/performance.md reports how far to trust the cost model (for sm100 and ascend950, where
    nothing is measured): per template, the mean over instances of Spearman's rho between the
    modelled and the measured times of the candidates that ran; failed candidates, rows of another
    spec and unmeasured rows do not count."""
    from deepinfer.autotune.cost import agreement, agreement_lines, spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None
    # ties take their average rank: ranks (0.5, 0.5, 2) against (0, 1, 2)
    assert abs(spearman([5, 5, 7], [1, 2, 3]) - 0.8660254) < 1e-6
    man = {"instances": {
        "k1": {"spec": "s1", "template": "t", "candidates": [{"id": f"c{i}", "modelled_us": m} for i, m in
                                                             enumerate((1.0, 2.0, 3.0, 4.0))]},
        "k2": {"spec": "s2", "template": "t", "candidates": [{"id": f"c{i}", "modelled_us": m} for i, m in
                                                             enumerate((1.0, 2.0, 3.0))]}}}

    def row(inst, spec, p50s, measured=True):
        return {"instance": inst, "spec": spec, "template": "t", "measured": measured,
                "candidates": [{"id": f"c{i}", "p50": p} for i, p in enumerate(p50s)]}

    rows = [row("k1", "s1", (3.0, 1.0, 2.0, None)),  # c3 failed: ranks over c0..c2 only, rho -0.5
            row("k2", "s2", (1.0, 2.0, 3.0)),  # the model's order: rho 1
            row("k2", "other spec", (3.0, 2.0, 1.0)), row("k1", "s1", (1.0, 2.0, 3.0, 4.0), measured=False)]
    a = agreement(man, rows)["t"]
    assert a["instances"] == 2 and a["ranked"] == 2 and sorted(a["rho"]) == [-0.5, 1.0] and a["mean_rho"] == 0.25
    assert "mean rho +0.25 over 2 of 2 instances" in "\n".join(agreement_lines({"t": a}))


def test_the_shipped_sm90_database_holds_measured_h200_rows():
    """autotune/db/sm90.jsonl is what `autotune --measure` wrote on the H200 (the default
    --tuning-db of an sm90 compile): every line parses, and every row is a measured, passing
    config of an sm90 template with its timings in order."""
    from deepinfer.autotune.db import TuningDB, shipped_db

    path = shipped_db("sm90")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    db = TuningDB.load(path)
    assert len(db.rows) == len(lines) > 0
    for r in db.rows:
        fp, t = r["fingerprint"], r["timings"]
        assert fp["target"] == "sm90" and fp["arch"] == "sm_90a" and fp["device"] == "NVIDIA H200", fp
        assert r["measured"] and r["status"] == "ok" and r["config"] and r["template"].split("_")[0] in ("tilelang", "triton")
        assert 0 < t["p20"] <= t["p50"] <= t["p80"] and t["repeats"] > 0, t
        assert any(c["default"] for c in r["candidates"]) and "template_code" in fp["toolchain"]


def test_cost_model_ranks_the_h200s_measured_triton_candidates_in_their_order():
    """The H200's measured candidates (autotune/db/sm90.jsonl keeps each one's p50): over the
    Triton instances (renders are text, no lowering), the model's ranking agrees with the
    measured one on average for every template but hc_pre (Spearman's rho > 0.3). The model
    before session 8 scored -0.73 on the fp4 MoE GEMM at decode (it rewarded occupancy and K
    splits the hardware does not turn into speed). hc_pre is out: its first two rows (320 and
    4096 rows) ranked well, and the eleventh session's seven (1 to 4096 rows) average -0.04, worst
    at the decode buckets, so the model does not rank hc_pre's configs (docs/performance.md;
    bench/cost_model_rank.py prints all templates)."""
    from deepinfer.autotune.db import shipped_db
    from deepinfer.codegen.template import templates

    known = templates()
    rhos: dict[str, list[float]] = {}
    for line in shipped_db("sm90").read_text().splitlines():
        row = json.loads(line)
        if not row["template"].startswith("triton_"):
            continue
        s = parse_spec(row["spec"])
        pairs = [(cost.estimate(SM90, s, known[row["template"]].render(SM90, s, c["config"])), c["p50"])
                 for c in row["candidates"] if c.get("p50") is not None]
        rho = cost.spearman([p[0] for p in pairs], [p[1] for p in pairs])
        if rho is not None:
            rhos.setdefault(row["template"], []).append(rho)
    assert {"triton_grouped_gemm_fp4", "triton_grouped_linear", "triton_hc_pre"} <= set(rhos)
    for name, rs in rhos.items():
        if name != "triton_hc_pre":
            assert sum(rs) / len(rs) > 0.3, (name, rs)


def test_cost_model_only_from_a_model_and_target_needs_no_plan_and_compile_takes_its_rows(tmp_path, capsys):
    """`autotune --model M --target T --cost-model-only` ranks the instances a compile would make
    (nothing built), and a compile with that database records each instance's row and rung."""
    from deepinfer.cli import main
    from deepinfer.passes.driver import CompileOptions, select_instances

    db_path = tmp_path / "sm100.jsonl"
    args = ["autotune", "--model", "v4.1-flash-tiny", "--target", "sm100", "--cost-model-only", "--db", str(db_path),
            "--only", "triton_hc_mix", "--decode-batches", "1,8", "--prefill-tokens", "512"]
    assert main(args) == 0
    assert "modelled (cost model, no hardware)" in capsys.readouterr().out
    rows = TuningDB.load(db_path).rows
    assert rows and all(not r["measured"] and r["template"] == "triton_hc_mix" and r["fingerprint"]["target"] == "sm100"
                        and r["provenance"]["source"] == "cost model" for r in rows)
    opts = dict(max_model_len=2048, decode_batches=(1, 8), prefill_tokens=(512,))
    tuned = select_instances("v4.1-flash-tiny", CompileOptions("sm100", tuning_db=str(db_path), **opts))
    hc = [v for v in tuned.values() if v[1] == "triton_hc_mix"]
    by_bucket = {(r["structure"], r["bucket"]): r for r in rows}
    assert hc and all(v[4] and v[4]["rung"] == "modelled" and v[4]["source"] == "cost model"
                      and v[3] == dict(v[3], **by_bucket[structure_key(v[2])]["config"]) for v in hc)
    assert not any(v[4] for v in tuned.values() if v[1] != "triton_hc_mix")
    # bad combinations are one line each
    for bad, why in ((["autotune", "--model", "v4.1-flash-tiny", "--target", "sm100", "--db", str(db_path)],
                      "--cost-model-only"),
                     (["autotune", str(tmp_path), "--model", "v4.1-flash-tiny", "--target", "sm100",
                       "--cost-model-only"], "not both"),
                     (["autotune", "--model", "v4.1-flash-tiny", "--cost-model-only"], "give PLAN_DIR"),
                     (["autotune", "--model", "v4.1-flash-tiny", "--target", "sm999", "--cost-model-only",
                       "--db", str(tmp_path / "x.jsonl")], "unknown target")):
        assert main(bad) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err


def test_autotune_from_a_model_takes_max_num_seqs(tmp_path, capsys):
    """A decode bucket past compile's 256 sequences is refused in one line, as compile refuses it,
    and --max-num-seqs makes room for it, as compile's does."""
    from deepinfer.cli import main

    db_path = tmp_path / "sm100.jsonl"
    args = ["autotune", "--model", "v4.1-flash-tiny", "--target", "sm100", "--cost-model-only", "--db", str(db_path),
            "--only", "triton_hc_mix", "--decode-batches", "512", "--prefill-tokens", "1024"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--decode-batches 512 exceeds max_num_seqs 256" in err and err.count("\n") == 1, err
    assert main([*args, "--max-num-seqs", "512"]) == 0
    assert {512, 1024} <= {r["bucket"] for r in TuningDB.load(db_path).rows}  # the decode bucket's rows, prefill's


def test_the_step_time_curve_the_tuner_measures_goes_into_the_plan(plan, tmp_path, monkeypatch):
    """`autotune --apply --step-curve`: every decode (and verify) bucket's step timed (a fake clock
    stands in for the GPU: a step costs 100 us plus 1 us a row), the curve written into the plan
    (hashes and all, the plan still loads), and read back for a GPU of the same name only."""
    import shutil
    import types

    from deepinfer.autotune.steps import measure_step_curve, record_step_curve
    from deepinfer.codegen.plan import load_plan
    from deepinfer.models.config import config_from_dict
    from deepinfer.runtime import plan_executor
    from deepinfer.runtime.speculative import budget_from_curve, plan_step_curve

    tuned = tmp_path / "tuned"
    shutil.copytree(plan, tuned)
    p = load_plan(tuned)
    clock = [0.0]
    monkeypatch.setattr(plan_executor, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class FakeGPU:
        def __init__(self):
            self.plan, self.page_tokens = p, p["options"]["page_tokens"]
            self.cfg = config_from_dict(p["model"]["config"], model_id=p["model"]["id"])
            self.num_slots, self.num_pages = p["options"]["num_slots"] - 1, p["options"]["num_pages"] - 1
            self.ran = []

        def run_bucket(self, graph, bucket, inputs):
            self.ran.append(bucket)
            clock[0] += 100e-6 + 1e-6 * p["buckets"][graph][bucket]["num_tokens"]

        def warm_up(self, max_seqs=None, reps=5):
            return plan_executor.time_step_buckets(self, max_seqs, reps, sync=lambda: None)

    gpu = FakeGPU()
    curve = measure_step_curve(tuned, executor=gpu, reps=3)
    shapes = plan_executor.step_shapes(p)
    assert shapes and sorted(b for b, *_ in curve) == sorted(b for _, b, *_ in shapes)
    assert all(abs(t - (100e-6 + 1e-6 * rows)) < 1e-12 for _, _, rows, t in curve), curve
    assert len(gpu.ran) == 4 * len(shapes)  # one warming run and three timed per bucket
    rec = record_step_curve(tuned, curve, "FAKE H200")
    back = load_plan(tuned)
    assert back["step_time_curve"] == rec and rec["device"] == "FAKE H200" and rec["source"] == "autotune"
    assert plan_step_curve(back, "FAKE H200") == [(b, s, r, t) for b, s, r, t in curve]
    assert plan_step_curve(back, "another GPU") == [] and plan_step_curve(p, "FAKE H200") == []
    assert budget_from_curve([[0.9, 0.8]], 0, plan_step_curve(back, "FAKE H200")) is not None
    with pytest.raises(ValueError, match="has no bucket 'b999'"):
        record_step_curve(tuned, [("b999", 1, 1, 1e-3)], "FAKE H200")
    load_plan(tuned)  # a refused curve leaves the plan as it was


@pytest.mark.parametrize("target", ["sm100", "ascend950"])
def test_a_default_compile_takes_the_shipped_cost_model_rows(target):
    """autotune/db/{sm100,ascend950}.jsonl: the cost model's choices for the medium model's decode
    and prefill buckets (`autotune --model v4.1-flash-medium --target T --cost-model-only`), marked
    measured: false. A compile with no --tuning-db reads them: every instance whose row is current
    on this host (same toolchain and template code) gets the row's config at the "modelled" rung,
    and with --tuning-db none no instance is tuned. Rows a template edit has made stale are never
    used (autotune/db.py); at least some must be current, or the shipped file needs regenerating."""
    from deepinfer.autotune.db import TuningDB, shipped_db
    from deepinfer.passes.driver import CompileOptions, select_instances

    path = shipped_db(target)
    db = TuningDB.load(path)
    assert db.rows, f"{path} is missing or empty"
    assert all(r["fingerprint"]["target"] == target and not r["measured"] and r["status"] == "ok"
               and r["provenance"]["source"] == "cost model" and r["timings"]["p50"] > 0 for r in db.rows)
    opts = dict(decode_batches=(1, 8, 64), prefill_tokens=(512, 2048))
    shipped = select_instances("v4.1-flash-medium", CompileOptions(target, **opts))
    fps = {}
    current = 0
    for _, tname, s, cfg, tuned in shipped.values():
        if tname.startswith("torch"):
            continue
        if tname not in fps:
            fps[tname] = fingerprint(TARGETS[target], tname)
        match, _ = db.lookup(fps[tname], tname, s)
        if match is None or match.rung != "modelled":
            continue
        current += 1
        assert tuned and tuned["rung"] == "modelled" and not tuned["measured"] and tuned["db"] == path.name
        assert tuned["structure"] == match.row["structure"] and tuned["bucket"] == match.row["bucket"]
        assert cfg == dict(cfg, **match.row["config"]), (tname, cfg, match.row["config"])
    assert current > 0, f"no row of {path} is current on this host: regenerate it (docs/performance.md)"
    plain = select_instances("v4.1-flash-medium", CompileOptions(target, tuning_db="none", **opts))
    assert not any(v[4] for v in plain.values())


def test_a_compile_looks_each_spec_up_once(monkeypatch):
    """Tuning.config asks the database once a (template, spec): a compile asks for the same spec
    once a layer and bucket, and a `nearest` row renders the call each time it is asked. Each
    answer is the caller's own copy."""
    from deepinfer.autotune.db import shipped_db
    from deepinfer.codegen.template import select
    from deepinfer.passes.driver import Tuning

    looked = []
    real = TuningDB.lookup
    monkeypatch.setattr(TuningDB, "lookup", lambda self, *a, **k: looked.append(a) or real(self, *a, **k))
    target = TARGETS["sm100"]
    tuning = Tuning(str(shipped_db("sm100")), target)
    norm = spec("rms_norm", [tensor("bf16", 64, 5120), tensor("bf16", 5120)], {"eps": 1e-6})
    t = select(target, norm)
    first = tuning.config(t, norm)
    first[0]["mutated"] = 1
    second = tuning.config(t, norm)
    assert len(looked) == 1 and "mutated" not in second[0]
    tuning.config(t, spec("rms_norm", [tensor("bf16", 8, 5120), tensor("bf16", 5120)], {"eps": 1e-6}))
    assert len(looked) == 2
    assert second == tuning._config(t, norm)  # the kept answer is what a fresh lookup gives
