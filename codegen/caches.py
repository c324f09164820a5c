"""Where the compiler's caches live, and the cache of TileLang lowerings that every TileLang render
goes through. Apart from codegen/build.py, so that a TileLang template's code closure (part of its
render key, codegen/instances.py) takes in these lines and not the builder's."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from ..atomic import replace_file


def cache_root() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE_DIR") or Path.home() / ".cache" / "deepinfer")


def lowered(func, context: list, lower: Callable[[], dict]) -> dict:
    """`lower()` of a TileLang program, kept under a key of the program itself: its TVMScript with
    the metadata it carries (the preludes' text), `context` (the lowering's target and pass
    configs) and TileLang's version. Lowering is most of a TileLang render's time, and a render
    key changes with any edit of the code that builds the program (a docstring, another
    template's knob in a shared helper): a program that comes out the same is not lowered again.
    A program that does not print is lowered uncached; a lowering that fails is not kept."""
    import tilelang

    try:
        text = func.script(show_meta=True)
    except Exception:  # noqa: BLE001 - an unprintable program: lower it as it is
        return lower()
    blob = json.dumps([text, context, tilelang.__version__], sort_keys=True, default=str)
    path = cache_root() / "lowered" / f"{hashlib.sha256(blob.encode()).hexdigest()}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    out = lower()
    replace_file(path, json.dumps(out, sort_keys=True).encode())
    return out
