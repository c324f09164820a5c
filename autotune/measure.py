"""Measuring built tuning candidates on the GPU machine, which has no compiler: the second half of
a measured tuning run (`deepinfer autotune --measure DIR --db OUT.jsonl`; the first is
autotune/candidates.py).

Instances go in order of their modelled share of a step (calls x the default's modelled time),
so a budget that runs out keeps the ones that matter. Each instance's candidates run in a worker
process (`python -m deepinfer.autotune.measure --worker`, autotune/bench.py inside it): a
candidate that raises, crashes the process or outlasts its timeout is recorded as failed and the
rest go on in a fresh process (a crashed kernel can leave the device context unusable, a hung
one never returns). A candidate whose outputs fail the op's check is recorded as wrong. Neither
can win. After each instance its row goes into the database (autotune/db.py: measured, the best
candidate's timings, every candidate's outcome, the fingerprint of this GPU with the building
host's toolchain from the manifest) and the file is saved, so an interrupted run keeps what it
measured and a rerun skips what the database holds for this device.
"""
from __future__ import annotations

import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .candidates import damaged_files, load_manifest
from .db import TuningDB
from .tuner import Result, TuneError, TuneRun, make_row, on_device, only_names, parse_spec

GPU_BENCH = "deepinfer.autotune.bench:Bench"


def measure(cand_dir, db: TuningDB, *, runner=None, budget_s: float | None = None, only=None,
            progress=None) -> TuneRun:
    """Measure every instance of the candidates directory `cand_dir` not yet in `db` for this
    device; rows are added to `db` (and saved where it has a path) after each instance."""
    man = load_manifest(cand_dir)
    runner = runner or IsolatedRunner()
    wanted = only_names(only, {e["template"] for e in man["instances"].values()}, man["instances"])
    todo = sorted(((inst, e) for inst, e in man["instances"].items()
                   if wanted is None or e["template"] in wanted or inst in wanted),
                  key=lambda ie: (-_weight(ie[1]), ie[0]))
    device = runner.device()
    arch = "sm_" + device.get("capability", "").replace(".", "")
    if device.get("capability") and not man["target"]["arch"].startswith(arch):
        raise TuneError(f"{cand_dir}: holds {man['target']['arch']} kernels, and this GPU ({device['name']}) is {arch}")
    run, t0 = TuneRun(), time.perf_counter()
    for n, (inst, e) in enumerate(todo):
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            run.left = len(todo) - n
            break
        if progress:
            progress(n, len(todo), f"{inst} {e['template']}")
        spec = parse_spec(e["spec"])
        fp = on_device(e["fingerprint"], device)
        held = db.held(fp, e["template"], spec)
        if held and held["measured"]:
            run.results.append(_result(inst, e, held, skipped=True))
            continue
        runnable = [c for c in e["candidates"] if c["status"] == "built" and not damaged_files(cand_dir, c)]
        outcome = {c["id"]: {"status": "failed", "why": c["reason"] or "files missing or damaged"}
                   for c in e["candidates"] if c not in runnable}
        outcome.update(runner.run(cand_dir, inst, [c["id"] for c in runnable]))
        row = _row(fp, inst, e, spec, outcome, man)
        db.add(row)
        if db.path:
            db.save()  # after each instance: an interrupted run keeps what it measured
        run.results.append(_result(inst, e, row))
    run.seconds = time.perf_counter() - t0
    return run


def _weight(e: dict) -> float:
    default = [c.get("modelled_us") or 0.0 for c in e["candidates"] if c["default"]]
    return e["calls"] * (default[0] if default else 0.0)


def _row(fp: dict, inst: str, e: dict, spec, outcome: dict, man: dict) -> dict:
    cands = {c["id"]: c for c in e["candidates"]}
    ok = {cid: r for cid, r in outcome.items() if r["status"] == "ok"}
    tried = [{"id": cid, "config": cands[cid]["config"], "default": cands[cid]["default"], "status": r["status"],
              "p50": r["timings"]["p50"] if r["status"] == "ok" else None, "why": r.get("why", r.get("check", ""))}
             for cid, r in sorted(outcome.items())]
    default = next((c for c in e["candidates"] if c["default"]), None)
    if ok:
        best = min(ok, key=lambda cid: ok[cid]["timings"]["p50"])
        config, timings, status = cands[best]["config"], ok[best]["timings"], "ok"
    else:  # recorded, so a rerun does not wait out the same hangs again; a lookup never takes it
        config, timings, status = (default or {}).get("config", {}), None, "failed"
    return make_row(fp, e["template"], spec, e["spec"], config, timings, measured=True, status=status,
                    instance=inst, candidates=tried,
                    built={"host": man["build"].get("host"), "date": man["build"].get("date")})


def _result(inst: str, e: dict, row: dict, skipped: bool = False) -> Result:
    tried = row.get("candidates") or []
    default = next((t["p50"] for t in tried if t["default"] and t["p50"] is not None), float("nan"))
    best = row["timings"]["p50"] if row.get("timings") else float("nan")
    config = row["config"] if row["status"] == "ok" else {}
    return Result(inst, e["template"], e["spec"], e["calls"], default, best, config, True,
                  failed=sum(t["status"] != "ok" for t in tried), skipped=skipped)


# ---- isolation ---------------------------------------------------------------------------------

class IsolatedRunner:
    """Runs an instance's candidates in worker processes. `bench` names the class that times
    them ("module:Class", autotune/bench.Bench on the GPU; tests name a stand-in); `settings` go
    to it (sets, repeats, warmup); `env` is added to the workers' environment."""

    def __init__(self, bench: str = GPU_BENCH, timeout_s: float = 60.0, setup_timeout_s: float = 300.0,
                 settings: dict | None = None, env: dict | None = None):
        self.bench, self.timeout_s, self.setup_timeout_s = bench, timeout_s, setup_timeout_s
        self.settings, self.env = dict(settings or {}), dict(env or {})

    def device(self) -> dict:
        """The device the workers time on, asked of a worker (this process never opens it)."""
        lines, why = self._session({"probe": True}, [], self.setup_timeout_s)
        info = next((ln["device"] for ln in lines if "device" in ln), None)
        if info is None:
            raise TuneError(f"no GPU to measure on: {why}")
        return info

    def run(self, cand_dir, inst: str, ids: list[str]) -> dict:
        """candidate id -> {"status": "ok" | "wrong" | "failed", "timings" | "why"}."""
        out: dict = {}
        left = list(ids)
        while left:
            job = {"dir": str(cand_dir), "instance": inst, "candidates": left}
            lines, why = self._session(job, left, self.timeout_s)
            setup = next((ln for ln in lines if "setup_failed" in ln), None)
            if setup is not None or not any(ln.get("ready") for ln in lines):
                reason = setup["setup_failed"] if setup else why
                out.update({cid: {"status": "failed", "why": f"setup: {reason}"} for cid in left})
                break
            for ln in lines:
                if ln.get("id") in left:
                    out[ln["id"]] = {k: v for k, v in ln.items() if k != "id"}
            reported_end = lines[-1].get("id") is not None and lines[-1].get("status") == "failed"
            left = [cid for cid in left if cid not in out]
            if left and not reported_end:  # the first one not reported took the worker down with it
                out[left.pop(0)] = {"status": "failed", "why": why}
        return out

    def _session(self, job: dict, ids: list[str], timeout_s: float) -> tuple[list[dict], str]:
        """One worker on `job`: the JSON lines it printed, and why it stopped early (its exit, its
        last stderr line, or the timeout it outlasted) where it did."""
        env = dict(os.environ, **self.env)
        env["PYTHONPATH"] = os.pathsep.join([_package_parent()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                                   if p])
        with tempfile.TemporaryFile(mode="w+") as err:
            proc = subprocess.Popen([sys.executable, "-m", "deepinfer.autotune.measure", "--worker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                    start_new_session=True)  # its own group: a kill takes its children too
            lines: queue.Queue = queue.Queue()
            reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
            reader.start()
            try:
                proc.stdin.write(json.dumps(dict(job, bench=self.bench, settings=self.settings)) + "\n")
                proc.stdin.close()
            except BrokenPipeError:
                pass  # it died at start: its exit status and stderr say why
            got, why = [], ""
            wait = self.setup_timeout_s  # until it is ready: imports, the device, inputs, the reference
            while True:
                try:
                    ln = lines.get(timeout=wait)
                except queue.Empty:
                    pending = next((cid for cid in ids if cid not in {g.get("id") for g in got}), None)
                    why = f"timed out after {wait:.0f} s" + (f" (candidate {pending})" if pending else "")
                    _kill(proc)
                    break
                if ln is None:  # the worker's stdout closed
                    break
                got.append(ln)
                wait = timeout_s
            rc = proc.wait()
            if not why and rc != 0:
                err.seek(0)
                tail = [x for x in err.read().splitlines() if x.strip()]
                died = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
                why = f"worker {died}" + (f": {tail[-1].strip()[:300]}" if tail else "")
        return got, why


def _package_parent() -> str:
    """The directory the deepinfer package is imported from (a worker imports the same one)."""
    import deepinfer

    return str(Path(deepinfer.__file__).parent.parent)


def _read_lines(stream, out: queue.Queue) -> None:
    for line in stream:
        if line.startswith("{"):
            try:
                out.put(json.loads(line))
            except ValueError:
                pass  # a stray line a library printed: not the worker's
    out.put(None)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own process group (start_new_session)
    except ProcessLookupError:
        pass


# ---- the worker ---------------------------------------------------------------------------------

def worker_main() -> int:
    """One JSON job on stdin; JSON lines on stdout: {"device"} for a probe, else {"ready"} once
    the instance is set up, then one line per candidate. A candidate that raises ends the worker
    (its device context may be damaged); the parent starts a fresh one for the rest."""
    job = json.loads(sys.stdin.readline())
    module, _, name = job["bench"].partition(":")
    cls = getattr(importlib.import_module(module), name)
    if job.get("probe"):
        try:
            _emit({"device": cls.device_info()})
        except Exception as e:  # noqa: BLE001  (no device, no driver: the parent says so)
            print(f"{type(e).__name__}: {_line(e)}", file=sys.stderr)
            return 3
        return 0
    entry = load_manifest(job["dir"])["instances"][job["instance"]]
    try:
        bench = cls(job["dir"], job["instance"], entry, job["settings"])
    except Exception as e:  # noqa: BLE001  (no input case, no memory: every candidate fails the same way)
        _emit({"setup_failed": f"{type(e).__name__}: {_line(e)}"})
        return 3
    _emit({"ready": True})
    cands = {c["id"]: c for c in entry["candidates"]}
    for cid in job["candidates"]:
        try:
            res = bench.run(cands[cid])
        except Exception as e:  # noqa: BLE001  (a candidate's failure, whatever its type)
            _emit({"id": cid, "status": "failed", "why": f"{type(e).__name__}: {_line(e)}"})
            return 3
        _emit(dict(res, id=cid))
    return 0


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        sys.exit(worker_main())
    sys.exit("usage: python -m deepinfer.autotune.measure --worker (started by deepinfer autotune --measure)")
