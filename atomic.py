"""Durable, atomic file and directory writes: the one place every writer of plans, checkpoints,
caches and data files gets them from. A reader sees the old file or directory or the new one,
never a partial one."""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: str | os.PathLike, data: bytes) -> None:
    """Write and fsync a file that no reader can see yet (inside a directory still being built)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: str | os.PathLike, write: Callable | bytes) -> None:
    """Write a temporary file beside `path`, fsync it, rename it over `path`. `write` is the
    bytes or a function writing into the open binary handle."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            if isinstance(write, (bytes, bytearray)):
                handle.write(write)
            else:
                write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.lru_cache(maxsize=1)
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing directory entries in one step (Linux renameat2 RENAME_EXCHANGE). False
    where the system cannot: no renameat2 in libc, or a kernel or filesystem without the flag
    (EINVAL / ENOSYS), or `b` gone meanwhile."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOENT):
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


def _fsync_tree(root: Path) -> None:
    """Every directory under `root`, deepest first (the files are fsynced by their writer)."""
    for d, _, _ in sorted(os.walk(root), key=lambda w: -w[0].count(os.sep)):
        fsync_dir(d)


def _temp_prefix(path: Path, kind: str) -> str:
    """The name every temporary of `path` starts with; it names the writer (host and pid) so that a
    later writer can tell the temporaries of a killed one (SIGKILL runs no cleanup) from those of a
    live one."""
    return f".{path.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def remove_stale_temporaries(path: str | os.PathLike) -> None:
    """Remove the temporaries that killed writers of `path` left beside it: a half-built
    directory is deleted; an old directory renamed aside (only where the system cannot exchange
    paths) is put back when `path` is missing, since it is then the only copy."""
    path = Path(path)
    host = socket.gethostname()
    try:
        entries = list(os.scandir(path.parent))
    except FileNotFoundError:
        return
    for e in entries:
        for kind in ("tmp", "old"):
            head = f".{path.name}.{kind}-{host}-"
            if not e.name.startswith(head):
                continue
            pid = e.name[len(head):].split("-", 1)[0]
            # another host's writer, or a pid that runs again (reused), is left alone: only a
            # temporary whose writer is certainly gone is touched
            if not pid.isdigit() or _pid_alive(int(pid)):
                continue
            if kind == "old" and not path.exists():
                try:
                    os.rename(e.path, path)
                    continue
                except OSError:
                    pass
            shutil.rmtree(e.path, ignore_errors=True)


def _swap_in(new: Path, path: Path) -> Path | None:
    """Put directory `new` at `path`. Returns where the directory it displaced now is (to be
    removed), or None."""
    for _ in range(16):  # a retry only when a concurrent writer of `path` moved it meanwhile
        if path.is_dir() and exchange_paths(new, path):
            return new
        try:
            os.rename(new, path)  # `path` absent, or an empty directory (rename(2) replaces it)
            return None
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        # no exchange here: the old directory is renamed aside, so `path` is briefly absent
        aside = Path(tempfile.mkdtemp(prefix=_temp_prefix(path, "old"), dir=path.parent))
        try:
            os.rename(path, aside)
        except OSError as e:
            aside.rmdir()
            if isinstance(e, FileNotFoundError):
                continue
            raise
        try:
            os.rename(new, path)
            return aside
        except OSError:
            try:
                os.rename(aside, path)  # put the old one back unless another writer's took its place
            except OSError:
                shutil.rmtree(aside, ignore_errors=True)
            continue
    raise OSError(errno.EBUSY, "concurrent writers kept replacing the directory", os.fspath(path))


def replace_dir(path: str | os.PathLike, write: Callable[[Path], T]) -> T:
    """Build a directory with `write(tmp)` (writing its files with `write_new_file`) beside
    `path`, fsync it, and swap it in for `path`; returns what `write` returned. A reader sees the
    old directory or the new one, and where the system can exchange two paths (Linux) `path`
    exists throughout a replace. A failure leaves `path` as it was and no temporary behind; a
    writer killed outright leaves its temporary, which the next replace of `path` removes."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path}: exists and is not a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    # the name is chosen before the directory exists, so an interrupt landing anywhere after the
    # mkdir (even before mkdtemp would have returned) finds the cleanup below armed
    tmp = path.parent / f"{_temp_prefix(path, 'tmp')}{os.urandom(6).hex()}"
    displaced = None
    try:
        os.mkdir(tmp, 0o700)
        result = write(tmp)
        _fsync_tree(tmp)
        displaced = _swap_in(tmp, path)
        fsync_dir(path.parent)
    finally:
        _remove_tree_uninterrupted(displaced or tmp)
    return result


def _remove_tree_uninterrupted(tree: Path) -> None:
    """Remove `tree` even when a KeyboardInterrupt arrives during the removal: the removal is
    finished first, then the interrupt is raised again."""
    interrupted = None
    while True:
        try:
            shutil.rmtree(tree, ignore_errors=True)
            break
        except KeyboardInterrupt as e:
            interrupted = e
    if interrupted is not None:
        raise interrupted
