"""Kernel instances: rendering (cached, in parallel) and building of every unique
(template, KernelSpec, config) a plan needs.

Rendering a TileLang template means lowering it, which takes seconds; the render cache keeps the
source by a key of everything that determines it (template, spec, config, target, versions), so a
second compile of the same model only builds from the compile cache (codegen/build.py)."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import inspect
import json
import sys
from dataclasses import asdict
from pathlib import Path

from ..atomic import replace_file
from .build import cache_root, toolchain_versions
from .targets import Target, get_target
from .template import KernelSource, KernelSpec, templates


def _versions() -> dict:
    from ..version import VERSION

    return {"deepinfer": VERSION, **toolchain_versions("cuda"), **toolchain_versions("triton")}


@functools.lru_cache(maxsize=None)
def _template_code(template: str) -> str:
    """Hash of the module that renders `template`: an edited template never reuses a stale render."""
    mod = sys.modules[templates()[template].render.__module__]
    text = inspect.getsource(mod)
    if callable(getattr(mod, "kernels_source", None)):  # Triton templates render their kernels module's text
        text += mod.kernels_source()
    return hashlib.sha256(text.encode()).hexdigest()


def render_key(template: str, spec: KernelSpec, config: dict, target: Target) -> str:
    blob = json.dumps([template, spec.key(), config, target.key(), _versions(), _template_code(template)],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _cache_path(key: str) -> Path:
    return cache_root() / "renders" / f"{key}.json"


def _store(key: str, src: KernelSource) -> None:
    replace_file(_cache_path(key), json.dumps(asdict(src), sort_keys=True).encode())


def _load(key: str) -> KernelSource | None:
    try:
        d = json.loads(_cache_path(key).read_text())
        return KernelSource(**{k: (tuple(v) if k in ("grid", "block") else v) for k, v in d.items()})
    except (OSError, ValueError, TypeError):
        return None  # absent or damaged: render again


def _render(template: str, spec: KernelSpec, config: dict, target_name: str) -> KernelSource:
    target = get_target(target_name)
    src = templates()[template].render(target, spec, config)
    _store(render_key(template, spec, config, target), src)
    return src


def render_many(items: list[tuple[str, KernelSpec, dict]], target: Target, jobs: int = 1,
                on_done=None) -> list[KernelSource]:
    """Every (template, spec, config) rendered, from the cache where possible; misses in a
    process pool (lowering holds the GIL)."""
    out: list[KernelSource | None] = [None] * len(items)
    todo = []
    for i, (t, spec, cfg) in enumerate(items):
        out[i] = _load(render_key(t, spec, cfg, target))
        if out[i] is None:
            todo.append(i)
        elif on_done:
            on_done()
    if jobs <= 1 or len(todo) <= 1:
        for i in todo:
            out[i] = _render(*items[i], target.name)
            if on_done:
                on_done()
        return out
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futs = {pool.submit(_render, *items[i], target.name): i for i in todo}
        for f in cf.as_completed(futs):
            out[futs[f]] = f.result()
            if on_done:
                on_done()
    return out
