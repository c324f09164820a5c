"""Measuring built tuning candidates on the GPU machine, which has no compiler: the second half of
a measured tuning run (`deepinfer autotune --measure DIR --db OUT.jsonl`; the first is
autotune/candidates.py).

Instances go in order of their modelled share of a step (calls x the default's modelled time),
so a budget that runs out keeps the ones that matter. Candidates run in a worker process
(`python -m deepinfer.autotune.measure --worker`, autotune/bench.py inside it) that goes on from
one instance to the next while it is healthy: a candidate that raises, crashes the process or
outlasts its timeout is recorded as failed and the rest go on in a fresh process (a crashed
kernel can leave the device context unusable, a hung one never returns). A candidate whose outputs fail the op's check is recorded as wrong. Neither
can win; the fastest of the rest (by p50) does, where it beats the default's p20 (a smaller win is
inside the default's own spread: the default stays). After each instance its row goes into the database (autotune/db.py: measured, the best
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
    try:
        return _measure(cand_dir, man, db, todo, runner, budget_s, progress)
    finally:
        runner.close()


def _measure(cand_dir, man: dict, db: TuningDB, todo: list, runner, budget_s, progress) -> TuneRun:
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
        base = ok.get(default["id"]) if default else None
        if base and best != default["id"] and ok[best]["timings"]["p50"] >= base["timings"]["p20"]:
            best = default["id"]  # a win inside the default's own spread (its p20) is noise: no move
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
    """Runs candidates in a worker process that lives from one instance to the next while it is
    healthy (its interpreter, torch and device context are set up once); one that raised,
    crashed or outlasted `timeout_s` is ended, and a fresh one goes on with the rest. `bench`
    names the class that times them ("module:Class", autotune/bench.Bench on the GPU; tests name
    a stand-in); `settings` go to it (sets, repeats, warmup); `env` is added to the worker's
    environment."""

    def __init__(self, bench: str = GPU_BENCH, timeout_s: float = 60.0, setup_timeout_s: float = 300.0,
                 settings: dict | None = None, env: dict | None = None):
        self.bench, self.timeout_s, self.setup_timeout_s = bench, timeout_s, setup_timeout_s
        self.settings, self.env = dict(settings or {}), dict(env or {})
        self._worker: _Worker | None = None

    def device(self) -> dict:
        """The device the workers time on, asked of a worker (this process never opens it)."""
        w = self._live()
        ln = w.next(self.setup_timeout_s) if w.send({"probe": True}) else None
        if isinstance(ln, dict) and "device" in ln:
            return ln["device"]
        why = f"timed out after {self.setup_timeout_s:.0f} s" if ln is _TIMEOUT else self._end()
        self._end(kill=True)
        raise TuneError(f"no GPU to measure on: {why or 'the worker said nothing'}")

    def run(self, cand_dir, inst: str, ids: list[str]) -> dict:
        """candidate id -> {"status": "ok" | "wrong" | "failed", "timings" | "why"}."""
        out: dict = {}
        left = list(ids)
        while left:
            w = self._live()
            ready, why, reported_failure = False, "", False
            if w.send({"dir": str(cand_dir), "instance": inst, "candidates": left}):
                wait = self.setup_timeout_s  # until it is ready: the instance's inputs and reference
                while True:
                    ln = w.next(wait)
                    if ln is _TIMEOUT:
                        pending = next((c for c in left if c not in out), None) if ready else None
                        why = f"timed out after {wait:.0f} s" + (f" (candidate {pending})" if pending else "")
                        self._end(kill=True)
                        break
                    if ln is None:  # the worker is gone
                        why = self._end() or "the worker exited"
                        break
                    if "setup_failed" in ln:
                        why = ln["setup_failed"]
                        break
                    if ln.get("ready"):
                        ready, wait = True, self.timeout_s
                    elif ln.get("id") in left:
                        out[ln["id"]] = {k: v for k, v in ln.items() if k != "id"}
                        if ln["status"] == "failed":  # it ends itself after one (its device context may be damaged)
                            reported_failure = True
                            self._end()
                            break
                    elif ln.get("done"):
                        break
            else:
                why = self._end() or "the worker exited"
            left = [cid for cid in left if cid not in out]
            if not ready:  # every candidate would fail the same way
                out.update({cid: {"status": "failed", "why": f"setup: {why}"} for cid in left})
                break
            if left and not reported_failure and why:  # the first one not reported took the worker down
                out[left.pop(0)] = {"status": "failed", "why": why}
        return out

    def close(self) -> None:
        self._end()

    def _live(self) -> "_Worker":
        if self._worker is None:
            env = dict(os.environ, **self.env)
            env["PYTHONPATH"] = os.pathsep.join([_package_parent()] + [p for p in env.get("PYTHONPATH", "")
                                                                       .split(os.pathsep) if p])
            self._worker = _Worker(env, self.bench, self.settings)
        return self._worker

    def _end(self, kill: bool = False) -> str:
        w, self._worker = self._worker, None
        return w.end(kill) if w else ""


_TIMEOUT = object()


class _Worker:
    """One worker process: JSON job lines in, JSON lines out (read by a thread, so a wait can
    time out), stderr kept for the line that says why it died."""

    def __init__(self, env: dict, bench: str, settings: dict):
        self.bench, self.settings = bench, settings
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "deepinfer.autotune.measure", "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=env, start_new_session=True)  # its own group: a kill takes its children
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=_read_lines, args=(self.proc.stdout, self.lines), daemon=True).start()

    def send(self, job: dict) -> bool:
        try:
            self.proc.stdin.write(json.dumps(dict(job, bench=self.bench, settings=self.settings)) + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, ValueError):
            return False  # it died: end() says why

    def next(self, timeout: float):
        """The next line, None once the worker's output closed, or _TIMEOUT."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return _TIMEOUT

    def end(self, kill: bool = False) -> str:
        """Stop the worker (killed, or asked to by closing its input); why it stopped where that
        was not asked: its exit status or signal and its last stderr line."""
        if kill:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the worker's own process group
            except ProcessLookupError:
                pass
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        self.err.seek(0)
        tail = [x for x in self.err.read().splitlines() if x.strip()]
        self.err.close()
        if rc == 0 or kill:
            return ""
        died = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        return f"worker {died}" + (f": {tail[-1].strip()[:300]}" if tail else "")


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


# ---- the worker ---------------------------------------------------------------------------------

def worker_main() -> int:
    """JSON job lines on stdin, until it closes; JSON lines on stdout: {"device"} for a probe,
    else {"ready"} once the job's instance is set up (or {"setup_failed"}), one line per
    candidate, then {"done"}. A candidate that raises ends the worker (its device context may be
    damaged); the parent starts a fresh one for the rest."""
    cls, bench, manifests = None, None, {}
    for line in sys.stdin:
        job = json.loads(line)
        if cls is None:
            module, _, name = job["bench"].partition(":")
            cls = getattr(importlib.import_module(module), name)
        if job.get("probe"):
            try:
                _emit({"device": cls.device_info()})
            except Exception as e:  # noqa: BLE001  (no device, no driver: the parent says so)
                print(f"{type(e).__name__}: {_line(e)}", file=sys.stderr)
                return 3
            continue
        if job["dir"] not in manifests:
            manifests[job["dir"]] = load_manifest(job["dir"])
        entry = manifests[job["dir"]]["instances"][job["instance"]]
        if bench is None or (bench.root, bench.inst) != (Path(job["dir"]), job["instance"]):
            bench = None  # the last instance's inputs go before this one's are made
            try:
                bench = cls(job["dir"], job["instance"], entry, job["settings"])
            except Exception as e:  # noqa: BLE001  (no input case, no memory: every candidate fails the same way)
                _emit({"setup_failed": f"{type(e).__name__}: {_line(e)}"})
                continue
        _emit({"ready": True})
        cands = {c["id"]: c for c in entry["candidates"]}
        for cid in job["candidates"]:
            try:
                res = bench.run(cands[cid])
            except Exception as e:  # noqa: BLE001  (a candidate's failure, whatever its type)
                _emit({"id": cid, "status": "failed", "why": f"{type(e).__name__}: {_line(e)}"})
                return 3
            _emit(dict(res, id=cid))
        _emit({"done": True})
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
