"""Launching a few ranks of a command on this machine for tests: the environment torchrun gives
its workers (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE) on a free port, gloo, one torch
thread per rank, and a hard timeout so a bug can never hang the suite."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import deepinfer

ROOT = Path(deepinfer.__file__).parent.parent  # the directory the `deepinfer` package is imported from


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, **extra) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               DEEPINFER_DIST_BACKEND="gloo", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start_ranks(argv: list[str], world: int, cwd, logs: Path | None = None, **extra) -> list[subprocess.Popen]:
    """`logs`: each rank's stderr goes to logs/rank{r}.err (readable while it runs), else a pipe."""
    port = free_port()
    procs = []
    for r in range(world):
        err = open(logs / f"rank{r}.err", "w") if logs else subprocess.PIPE
        procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env(r, world, port, **extra), cwd=cwd,
                                      stdout=subprocess.PIPE, stderr=err, text=True))
        if logs:
            err.close()
    return procs


def wait_for(path: Path, text: str, procs: list[subprocess.Popen], timeout: float) -> None:
    """Until `text` shows in the file at `path` (a rank's log); fails if a rank exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    for p in procs:
        p.kill()
    raise AssertionError(f"{text!r} did not show in {path.name}: {path.read_text(errors='replace')[-2000:]}")


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each rank; every rank still running at the deadline is killed
    and the test fails."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, o, e))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"ranks still running after {timeout:.0f} s") from None
    return out


def run_ranks(argv: list[str], world: int, cwd, timeout: float = 300, **extra) -> list[tuple[int, str, str]]:
    return finish(start_ranks(argv, world, cwd, **extra), timeout)
