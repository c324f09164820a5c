"""atomic.replace_dir: the one directory swap (plans, checkpoints, the compile cache). A reader
never sees the target missing where the OS can exchange two paths, the old content is replaced
whole, and a failed writer leaves the old directory and no temporaries."""
import ctypes
import errno
import json
import os
import threading
from pathlib import Path

import pytest

from deepinfer import atomic
from deepinfer.atomic import replace_dir, write_new_file


def fill(files: dict[str, str]):
    def write(tmp: Path):
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            write_new_file(tmp / rel, text.encode())
        return sorted(files)
    return write


def tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


def test_target_never_absent_across_200_replaces(tmp_path):
    target = tmp_path / "plan"
    replace_dir(target, fill({"plan.json": "0"}))
    probe_a, probe_b = tmp_path / "xa", tmp_path / "xb"
    probe_a.mkdir(), probe_b.mkdir()
    if not atomic.exchange_paths(probe_a, probe_b):
        pytest.skip("this filesystem has no RENAME_EXCHANGE: replace_dir renames aside here")
    missing, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            if not os.path.isdir(target):
                missing.append(1)

    t = threading.Thread(target=poll)
    t.start()
    try:
        for i in range(1, 201):
            replace_dir(target, fill({"plan.json": str(i), f"kernels/k{i}.cubin": "x" * i}))
    finally:
        stop.set()
        t.join()
    assert not missing, f"target absent {len(missing)} times"
    assert tree(target) == {"plan.json": "200", "kernels/k200.cubin": "x" * 200}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan", "xa", "xb"]


@pytest.mark.parametrize("exchange", ["renameat2", "no renameat2", "EINVAL"])
def test_old_content_replaced_whole_and_nothing_left_behind(tmp_path, monkeypatch, exchange):
    if exchange == "no renameat2":
        monkeypatch.setattr(atomic, "_renameat2", lambda: None)
    elif exchange == "EINVAL":  # an old kernel or a filesystem without RENAME_EXCHANGE
        def einval(*args):
            ctypes.set_errno(errno.EINVAL)
            return -1
        monkeypatch.setattr(atomic, "_renameat2", lambda: einval)
    target = tmp_path / "out"
    assert replace_dir(target, fill({"a": "1", "sub/b": "2"})) == ["a", "sub/b"]  # created where absent
    replace_dir(target, fill({"c": "3"}))
    assert tree(target) == {"c": "3"}
    (tmp_path / "empty").mkdir()
    replace_dir(tmp_path / "empty", fill({"d": "4"}))
    assert tree(tmp_path / "empty") == {"d": "4"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]


@pytest.mark.parametrize("exists", [True, False])
def test_failing_writer_leaves_old_directory_and_no_temporaries(tmp_path, exists):
    target = tmp_path / "out"
    if exists:
        replace_dir(target, fill({"old": "kept", "sub/x": "y"}))

    def broken(tmp: Path):
        fill({"new": "half"})(tmp)
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        replace_dir(target, broken)
    assert [p.name for p in tmp_path.iterdir()] == (["out"] if exists else [])
    if exists:
        assert tree(target) == {"old": "kept", "sub/x": "y"}


def test_refuses_a_file_and_survives_concurrent_writers(tmp_path):
    (tmp_path / "f").write_text("file")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        replace_dir(tmp_path / "f", fill({}))
    target = tmp_path / "entry"
    errors = []

    def writer(tag):
        try:
            for i in range(50):
                replace_dir(target, fill({"meta.json": tag, "bin": tag * 10}))
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in "ab"]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    content = tree(target)
    assert content in ({"meta.json": "a", "bin": "a" * 10}, {"meta.json": "b", "bin": "b" * 10})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry", "f"]


@pytest.fixture
def calls(monkeypatch):
    """Every replace_dir call of the three writers, through to the real one unless told."""
    from deepinfer.codegen import build, plan
    from deepinfer.models import checkpoint

    seen = []

    def record(module, through=True):
        def fake(path, write):
            seen.append((module.__name__, Path(path)))
            return atomic.replace_dir(path, write) if through else None
        monkeypatch.setattr(module, "replace_dir", fake)

    record(plan), record(build), record(checkpoint, through=False)  # a checkpoint's shards take seconds
    return seen


def test_plan_checkpoint_and_compile_cache_use_replace_dir(tmp_path, calls):
    from deepinfer.codegen.build import CompileCache
    from deepinfer.codegen.plan import write_plan
    from deepinfer.models.checkpoint import make_checkpoint

    out = write_plan({"model": "m"}, {"kernels/k.cu": b"src"}, tmp_path / "plan")
    assert json.loads((out / "plan.json").read_text())["model"] == "m" and (out / "kernels/k.cu").read_bytes() == b"src"
    cache = CompileCache(tmp_path)
    m = cache.put("k" * 64, {"status": "built"}, {"cubin": ("k.cubin", b"\x7fELF")})
    assert open(m["files"]["cubin"], "rb").read() == b"\x7fELF"
    make_checkpoint("v4.1-flash-tiny", tmp_path / "ck")
    assert calls == [("deepinfer.codegen.plan", tmp_path / "plan"),
                     ("deepinfer.codegen.build", cache.path("k" * 64)),
                     ("deepinfer.models.checkpoint", tmp_path / "ck")]


def test_compile_cache_replaces_a_damaged_entry(tmp_path):
    from deepinfer.codegen.build import CompileCache

    cache = CompileCache(tmp_path)
    key = "d" * 64
    cache.put(key, {"status": "built"}, {"cubin": ("k.cubin", b"one")})
    (cache.path(key) / "k.cubin").unlink()
    assert cache.get(key) is None
    m = cache.put(key, {"status": "built"}, {"cubin": ("k.cubin", b"two")})  # was kept damaged, put returned None
    assert m is not None and open(m["files"]["cubin"], "rb").read() == b"two"
    assert [p.name for p in cache.root.iterdir()] == [key]


def test_temporaries_of_killed_writers_are_removed_and_a_live_writers_kept(tmp_path):
    """SIGKILL runs no cleanup: the next replace removes a killed writer's half-built directory,
    puts back an old directory it had renamed aside while `path` is missing (the only copy), and
    leaves alone the temporaries of a writer still running (this process) and of other hosts."""
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    host = socket.gethostname()
    for name in (f".out.tmp-{host}-{dead}-a", f".out.old-{host}-{dead}-b", f".out.tmp-{host}-{os.getpid()}-c",
                 f".out.tmp-elsewhere-{dead}-d"):
        (tmp_path / name).mkdir()
        write_new_file(tmp_path / name / "f", name.encode())
    atomic.remove_stale_temporaries(tmp_path / "out")
    assert tree(tmp_path / "out") == {"f": f".out.old-{host}-{dead}-b"}
    replace_dir(tmp_path / "out", fill({"g": "new"}))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".out.tmp-{host}-{os.getpid()}-c",
                                                                 f".out.tmp-elsewhere-{dead}-d", "out"])
