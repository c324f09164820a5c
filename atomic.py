"""Durable, atomic file writes: the one place every writer of plans, checkpoints, caches and
data files gets them from. A reader sees the old file or the new one, never a partial one."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


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
