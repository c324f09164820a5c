"""Kernel instances: rendering (cached, in parallel) and building of every unique
(template, KernelSpec, config) a plan needs.

Rendering a TileLang template means lowering it, which takes seconds; the render cache keeps the
source by a key of everything that determines it (template, spec, config, target, versions, and the
code: the in-package import closure of the template's module), so a second compile of the same
model only builds from the compile cache (codegen/build.py). A render quicker than
RENDER_CACHE_MIN_S is not kept: a Triton render formats launches around the kernels module,
whose 65 KB of text each entry would repeat (a tuner renders thousands of configs)."""
from __future__ import annotations

import ast
import concurrent.futures as cf
import functools
import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, NamedTuple

from ..atomic import replace_file
from .build import cache_root, toolchain_versions
from .targets import Target, get_target
from .template import KernelSource, KernelSpec, templates


def _versions() -> dict:
    from ..version import VERSION

    return {"deepinfer": VERSION, **toolchain_versions("cuda"), **toolchain_versions("triton")}


PACKAGE = __name__.split(".")[0]
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


class ModuleText(NamedTuple):
    text: str
    is_package: bool  # relative imports in a package's __init__ resolve against the package itself


def read_module_source(name: str) -> ModuleText | None:
    """The source of package module `name` from this tree, or None where `name` is no module of
    the package (an attribute imported from one, or a module of another package)."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    path = _PACKAGE_DIR.joinpath(*parts[1:])
    if (path / "__init__.py").is_file():
        return ModuleText((path / "__init__.py").read_text(), True)
    if path.with_suffix(".py").is_file():
        return ModuleText(path.with_suffix(".py").read_text(), False)
    return None


def _imports(module: str, src: ModuleText) -> list[tuple[str, list[str]]]:
    """Every import in `module`'s source (function bodies included: a lazy import runs at render
    time just the same) as (dotted module, names taken from it), relative imports made absolute;
    a plain `import m` takes no names."""
    package = module if src.is_package else module.rpartition(".")[0]
    out: list[tuple[str, list[str]]] = []
    for node in _runtime_nodes(ast.parse(src.text)):
        if isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            out.append((base, [a.name for a in node.names]))
    return out


def _runtime_nodes(tree: ast.AST):
    """ast.walk without the bodies of `if TYPE_CHECKING:` blocks: their imports never run, and
    following them put the build code into every template's key."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _target_tables() -> frozenset[str]:
    """The per-target tables (codegen/targets/<name>.py): data that render keys carry as
    Target.key() and a tuning row's config overrides. Their text is left out of template code, so
    editing one target's defaults re-keys that target's renders alone and leaves every database
    row current (the targets package imports all of them: through it, each table was in every
    template's code, and an sm90 default made the sm100 and ascend950 rows stale)."""
    from .targets import MANIFESTS

    return frozenset(f"{PACKAGE}.codegen.targets.{name}" for name in MANIFESTS)


def import_closure(module: str, read: Callable[[str], ModuleText | None] = read_module_source) -> dict[str, str]:
    """{name: source} of `module` and every package module it imports, transitively, less the
    target tables (`_target_tables`). A package reached only as the parent of an imported module
    is not followed (its `__init__` runs, but what it imports reaches the module only through
    names it imports, and those are explicit): `from pkg import sub` follows `pkg.sub` alone when
    `sub` is a module, and `pkg` too when a name is an attribute of it (or `*`)."""
    out: dict[str, str] = {}
    todo = [module]
    skip = _target_tables()
    while todo:
        name = todo.pop()
        if name in out or name in skip:
            continue
        src = read(name)
        if src is None:
            if name == module:
                raise LookupError(f"{module}: not a module of the {PACKAGE} package")
            continue
        out[name] = src.text
        for base, names in _imports(name, src):
            subs = [f"{base}.{n}" for n in names if n != "*" and read(f"{base}.{n}") is not None]
            todo.extend(subs)
            if len(subs) < len(names) or not names:
                todo.append(base)
    return out


def closure_hash(module: str, read: Callable[[str], ModuleText | None] = read_module_source) -> str:
    return hashlib.sha256(json.dumps(sorted(import_closure(module, read).items())).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _module_code(module: str) -> str:
    """Closure hash per module, once per process (the sources do not change under a compile)."""
    return closure_hash(module, read_module_source)


def _template_code(template: str) -> str:
    """An edit anywhere in the code that renders `template` (its module, a shared helper, the
    kernels module a Triton template ships) never reuses a stale render; an edit to another
    template's module does not touch it."""
    return _module_code(templates()[template].render.__module__)


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


RENDER_CACHE_MIN_S = 0.05
IN_PROCESS_RENDER_S = 2.0  # render_many's misses in its own process for at most this long


def _render(template: str, spec: KernelSpec, config: dict, target_name: str) -> KernelSource:
    target = get_target(target_name)
    t = time.perf_counter()
    src = templates()[template].render(target, spec, config)
    if time.perf_counter() - t >= RENDER_CACHE_MIN_S:
        _store(render_key(template, spec, config, target), src)
    return src


def render_many(items: list[tuple[str, KernelSpec, dict]], target: Target, jobs: int = 1,
                on_done=None, on_error=None) -> list[KernelSource | None]:
    """Every (template, spec, config) rendered, from the cache where possible; misses here for up
    to IN_PROCESS_RENDER_S, the rest in a process pool of `jobs` (lowering holds the GIL). With
    `on_error(i, message)`, an item that does not render is reported there and left None (a
    tuner's candidate); without, its error is raised."""
    out: list[KernelSource | None] = [None] * len(items)
    todo = []
    for i, (t, spec, cfg) in enumerate(items):
        out[i] = _load(render_key(t, spec, cfg, target))
        if out[i] is None:
            todo.append(i)
        elif on_done:
            on_done()

    def done(i, get):
        try:
            out[i] = get()
        except Exception as e:  # noqa: BLE001  (a template's own error, whatever its type)
            if on_error is None:
                raise
            on_error(i, (str(e).strip().splitlines() or [type(e).__name__])[-1])
        if on_done:
            on_done()

    # in this process for IN_PROCESS_RENDER_S: a quick render is never cached, so a compile from the
    # caches misses only those (milliseconds each, once Triton is imported), and a pool's start
    # (seconds a worker) would cost more than they do; once a TileLang lowering or a tuner's
    # thousands of configs have taken that long, the rest go to the pool
    start, here = time.perf_counter(), 0
    while here < len(todo) and (jobs <= 1 or time.perf_counter() - start < IN_PROCESS_RENDER_S):
        i = todo[here]
        done(i, lambda i=i: _render(*items[i], target.name))
        here += 1
    todo = todo[here:]
    if not todo:
        return out
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futs = {pool.submit(_render, *items[i], target.name): i for i in todo}
        for f in cf.as_completed(futs):
            done(futs[f], f.result)
    return out


SOURCE_EXT = {"triton": "py", "cuda": "cu", "ascendc": "cpp"}


def kernel_record(template: str, spec: KernelSpec, config: dict, src: KernelSource, res, stem: str,
                  with_source: bool = True) -> tuple[dict, dict[str, bytes]]:
    """One built instance as a plan records it (a tuning candidate too), and its files by path
    under `stem`: the rendered source (for people), and the binaries the runtime loads, one
    file per artefact (a Triton call has a cubin per launch, a split attention two)."""
    files = {f"{stem}.{SOURCE_EXT.get(src.language, 'txt')}": src.text.encode()} if with_source else {}
    built = {}
    for art, path in res.files.items():
        p = Path(path)
        if p.suffix in (".cubin", ".o", ".bin", ".json") or art in ("cubin", "binary"):
            built[art] = f"{stem}{p.suffix}" if art in ("cubin", "binary") else f"{stem}.{art}{p.suffix}"
            files[built[art]] = p.read_bytes()
    record = {"template": template, "spec": spec.key(), "config": config, "language": src.language,
              "entry": src.entry, "grid": list(src.grid), "block": list(src.block), "smem_bytes": src.smem_bytes,
              "meta": src.meta, "build": {"status": res.status, "reason": res.reason, "files": built,
                                          "resources": res.resources, "cached": res.cached,
                                          "pdl": res.pdl}}
    return record, files
