"""Nothing lost (issue #17, Build 3): a compile killed mid-way, by SIGINT or SIGKILL, leaves the
previous plan intact and loadable; SIGINT ends it within 5 s with one line and exit 130, and no
temporary beside the plan; what a SIGKILL leaves is removed by the next write of the plan. Each
compile runs in a subprocess (the tiny model, cpu target), killed once it is really working: its
stage dumps appearing (the pass pipeline) or its temporary plan directory appearing (the write)."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import deepinfer
from deepinfer.passes.driver import CompileOptions, compile_model
from deepinfer.runtime.plan_file import load_plan

PKG_PARENT = str(Path(deepinfer.__file__).parent.parent)
TINY = "v4.1-flash-tiny"
SIGINT_LIMIT_S = 5.0


def env(tmp_path) -> dict:
    return os.environ | {"PYTHONPATH": PKG_PARENT, "DEEPINFER_CACHE_DIR": str(tmp_path / "cache")}


def default_sigint() -> None:
    """In the compile's process before it starts: SIGINT back to its default disposition. A test
    run started in the background of a non-interactive shell ignores SIGINT, its subprocesses
    inherit that, and Python then installs no KeyboardInterrupt handler: the signal these tests
    send would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(p: subprocess.Popen, ready, what: str, timeout: float = 120):
    t = time.monotonic()
    while not ready():
        if p.poll() is not None:
            raise AssertionError(f"the compile ended (exit {p.returncode}) before {what}: {p.stderr.read()}")
        if time.monotonic() - t > timeout:
            p.kill()
            raise AssertionError(f"no {what} after {timeout} s")
        time.sleep(0.002)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    plan = tmp_path_factory.mktemp("old") / "plan"
    compile_model(TINY, CompileOptions("cpu", max_model_len=512, max_num_seqs=4), plan)
    return plan


@pytest.fixture
def old_plan(compiled, tmp_path):
    plan = tmp_path / "out" / "plan"
    shutil.copytree(compiled, plan)
    return plan, (plan / "plan.json").read_bytes()


def temporaries(plan: Path) -> list[str]:
    return sorted(p.name for p in plan.parent.iterdir() if p.name != plan.name)


@pytest.mark.parametrize("point", ["pipeline", "write"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_killed_compile_keeps_the_previous_plan(tmp_path, old_plan, sig, point):
    plan, old_json = old_plan
    dump = tmp_path / "ir"
    p = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "compile", "--model", TINY, "--target", "cpu",
                          "-o", str(plan), "--max-model-len", "256", "--max-num-seqs", "2", "--dump-ir", str(dump)],
                         env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=default_sigint)
    if point == "pipeline":  # past the graph build, inside the passes: three stages dumped
        wait_for(p, lambda: dump.is_dir() and len(list(dump.iterdir())) >= 3, "stage dumps")
    else:  # the new plan is being written beside the old one
        wait_for(p, lambda: any(n.startswith(".plan.tmp-") for n in temporaries(plan)), "temporary plan directory")
    t = time.monotonic()
    os.kill(p.pid, sig)
    _, err = p.communicate(timeout=60)
    seconds = time.monotonic() - t
    assert (plan / "plan.json").read_bytes() == old_json
    body = load_plan(plan, target="cpu")
    assert (body["options"]["max_num_seqs"], body["options"]["max_model_len"]) == (4, 512)
    if sig == signal.SIGINT:
        print(f"SIGINT at {point}: exited in {seconds:.2f} s")
        assert (p.returncode, err) == (130, "deepinfer: interrupted\n")
        assert seconds < SIGINT_LIMIT_S
        assert temporaries(plan) == []
        return
    assert p.returncode == -signal.SIGKILL
    left = temporaries(plan)
    if point == "pipeline":  # nothing written yet
        assert left == []
    else:  # SIGKILL runs no cleanup: the half-written plan stays
        assert len(left) == 1 and left[0].startswith(".plan.tmp-"), left
    # the next compile to the same place removes what the killed one left, and replaces the plan
    compile_model(TINY, CompileOptions("cpu", max_model_len=256, max_num_seqs=2), plan)
    assert temporaries(plan) == []
    assert load_plan(plan, target="cpu")["options"]["max_num_seqs"] == 2


# ---- the build pools: Ctrl-C drops the queued builds -------------------------------------------

# 40 builds of 2 s on 4 workers; a build marks its start in MARKS. Patched at the top level, so
# the process pool's spawned workers (which import this file as __mp_main__) build slowly too.
SLOW_BUILDS = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from deepinfer.codegen import build
    from deepinfer.codegen.template import KernelSource

    def slow(src, target):
        (Path(os.environ["MARKS"]) / src.entry).write_text("")
        time.sleep(2)
        return {}, {"source": ("k.txt", src.text.encode())}, {"status": "built"}

    build.BUILDERS["cuda"] = build.BUILDERS["triton"] = slow
    build.toolchain_versions = lambda language, cc=0: {}  # no toolchain on the test machine to ask

    if __name__ == "__main__":
        from deepinfer.codegen.targets import get_manifest

        sources = [KernelSource(sys.argv[1], f"k{i}", f"// {i}", (1,), (128,)) for i in range(40)]
        try:
            build.build_for(get_manifest("sm90"), sources, jobs=4)
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(0)
""")


@pytest.mark.parametrize("language,pool", [("cuda", "threads"), ("triton", "processes")])
def test_ctrl_c_drops_queued_builds(tmp_path, language, pool):
    """Before, the pools' `with` blocks ran every queued build before the KeyboardInterrupt got
    through: 40 builds of 2 s on 4 workers took 20 s to stop."""
    script, marks = tmp_path / "slow_builds.py", tmp_path / "marks"
    script.write_text(SLOW_BUILDS)
    marks.mkdir()
    p = subprocess.Popen([sys.executable, str(script), language], env=env(tmp_path) | {"MARKS": str(marks)},
                         stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    wait_for(p, lambda: len(list(marks.iterdir())) >= 2, "builds started")
    t = time.monotonic()
    os.kill(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    seconds = time.monotonic() - t
    print(f"{pool}: exited {seconds:.2f} s after SIGINT, {len(list(marks.iterdir()))} of 40 builds started")
    assert p.returncode == 130, err
    assert seconds < SIGINT_LIMIT_S
    assert len(list(marks.iterdir())) <= 8  # the builds in flight when it came, none queued after
