"""Building rendered kernels: nvcc for TileLang-rendered CUDA, Triton's ahead-of-time compiler
for Triton kernels, CANN's `bisheng` for AscendC; a content-addressed compile cache; parallel
builds.

Nothing here needs a GPU or an NPU. A result says what happened (`built`, `unbuilt` when the
toolchain is absent and only the checked source is kept, `failed`, `invalid` when a capacity
check rejected it); a built kernel is only built: it is never called verified or fast here.

Cache: one directory per key under `$DEEPINFER_CACHE_DIR` (default ~/.cache/deepinfer)
`/kernels/<key>/`, holding `meta.json` and the artefacts (source, cubin, ptx, ...). The key is
the sha256 of the source, the entry and launch description, the target's key and the toolchain
versions, so a changed compiler or target never reuses a stale binary. Entries are written into a
temporary directory, fsynced, and swapped into place (atomic.replace_dir: a concurrent writer of
the same key swaps in identical content, and a damaged entry is replaced). No pickle anywhere.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..atomic import replace_dir, replace_file, write_new_file
from .caches import cache_root
from .targets import Target, get_target
from .template import KernelSource


class BuildError(RuntimeError):
    """A toolchain rejected a kernel; the message is one line naming the kernel and the cause."""


@dataclass(frozen=True)
class BuildResult:
    status: str  # "built" | "unbuilt" | "failed" | "invalid"
    target: str
    language: str
    entry: str
    key: str
    files: dict = field(default_factory=dict)  # artefact name -> path in the cache
    resources: dict = field(default_factory=dict)  # entry -> registers / smem / stack / spills
    reason: str = ""
    cached: bool = False
    seconds: float = 0.0
    pdl: bool = False  # its kernels wait on the grid before them: launch them with PDL (grid_dependency)

    def to_json(self) -> dict:
        return asdict(self)


# ---- cache ------------------------------------------------------------------------------------

class CompileCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root or cache_root()) / "kernels"

    def path(self, key: str) -> Path:
        return self.root / key

    def get(self, key: str) -> dict | None:
        meta = self.path(key) / "meta.json"
        try:
            m = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        if not all((self.path(key) / Path(p).name).is_file() for p in m.get("files", {}).values()):
            return None  # a damaged entry is rebuilt, never trusted
        m["files"] = {k: str(self.path(key) / Path(p).name) for k, p in m.get("files", {}).items()}
        return m

    def put(self, key: str, meta: dict, files: dict[str, tuple[str, bytes]]) -> dict:
        """files: artefact name -> (file name, bytes). Returns meta with absolute file paths."""
        def write(tmp: Path) -> None:
            names = {}
            for art, (fname, data) in files.items():
                write_new_file(tmp / fname, data)
                names[art] = fname
            write_new_file(tmp / "meta.json", json.dumps(dict(meta, files=names), indent=1, sort_keys=True).encode())

        for _ in range(3):  # another process may be swapping in its copy of the same entry
            replace_dir(self.path(key), write)
            stored = self.get(key)
            if stored is not None:
                return stored
        raise OSError(f"compile cache entry {self.path(key)} kept changing while it was written")


# ---- toolchains -------------------------------------------------------------------------------

def _run_version(cmd) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "absent"
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    return lines[-1] if out.returncode == 0 and lines else "absent"


@functools.lru_cache(maxsize=None)
def nvcc_path() -> str | None:
    return shutil.which("nvcc")


@functools.lru_cache(maxsize=None)
def bisheng_path() -> str | None:
    home = os.environ.get("BISHENG_HOME")
    if home and Path(home, "bin", "bisheng").is_file():
        return str(Path(home, "bin", "bisheng"))
    return shutil.which("bisheng")


@functools.lru_cache(maxsize=None)
def triton_ptxas(cc: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(cc).path


def _pkg_version(name: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=None)
def toolchain_versions(language: str, cc: int = 0) -> dict:
    """The versions that decide a binary: they enter the cache key."""
    if language == "cuda":
        return {"nvcc": _run_version([nvcc_path(), "--version"]) if nvcc_path() else "absent",
                "tilelang": _pkg_version("tilelang")}
    if language == "triton":
        return {"triton": _pkg_version("triton"), "ptxas": _run_version([triton_ptxas(cc), "--version"])}
    if language == "ascendc":
        return {"bisheng": _run_version([bisheng_path(), "--version"]) if bisheng_path() else "absent",
                "tilelang": _pkg_version("tilelang")}
    return {}


def _cc(target: Target) -> int:
    return int(re.sub(r"\D", "", target.arch))  # "sm_90a" -> 90


# bumped when a builder's artefacts change (2: the split attention's combine kernel is built too;
# 3: kernels for sm_90 and later start with the grid-dependency wait)
BUILDER_VERSION = 3


def cache_key(src: KernelSource, target: Target, options: dict | None = None) -> str:
    """What a build's artefacts and its capacity verdict depend on: the rendered source and the
    machine. The target's defaults table is left out: its choices reach a build only through the
    text they render (render keys carry it), so a variant plan that changes one template's
    defaults rebuilds that template's kernels alone, not every kernel of the target."""
    machine = {k: v for k, v in target.key().items() if k != "defaults"}
    body = {
        "language": src.language, "entry": src.entry, "text": src.text, "grid": list(src.grid),
        "block": list(src.block), "smem": src.smem_bytes, "meta": _jsonable(dict(src.meta)),
        "target": _jsonable(machine),
        "toolchain": toolchain_versions(src.language, _cc(target) if target.kind == "cuda" else 0),
        "options": _jsonable(options or {}),
        "builder": BUILDER_VERSION,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


# ---- ptxas reports ----------------------------------------------------------------------------

_FUNC = re.compile(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?"
                   r"(?:, (\d+) bytes cmem\[0\])?")


def parse_ptxas_report(text: str) -> dict:
    """`ptxas -v` output -> {function: {registers, smem_bytes, stack_bytes, spill_stores, spill_loads,
    barriers}}. Lines of one function follow its 'Compiling entry function' line."""
    out: dict = {}
    cur = None
    for line in text.splitlines():
        m = _FUNC.search(line)
        if m:
            cur = m.group(1)
            out.setdefault(cur, {})
            continue
        if cur is None:
            continue
        m = _STACK.search(line)
        if m:
            out[cur].update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = _USED.search(line)
        if m:
            out[cur].update(registers=int(m.group(1)), barriers=int(m.group(2) or 0), smem_bytes=int(m.group(3) or 0))
    return out


# ---- programmatic dependent launch ----------------------------------------------------------------
# A decode step is a chain of a few thousand small kernels, each waiting for the one before. On
# sm_90 and later every kernel built here starts with `griddepcontrol.wait` (block until the grid
# it follows has completed and its writes are visible) and then `griddepcontrol.launch_dependents`
# (the next grid may launch once all of this one's CTAs have passed that point). Launched with
# programmatic stream serialization (runtime/cuda_driver.py), the next kernel's launch and CTA
# placement overlap this one's last wave; since each kernel's first act is the wait, every read and
# write still follows its predecessor's completion, as with a plain launch (where the wait returns
# at once).

PDL_MIN_CC = 90
GRID_DEPENDENCY = ("griddepcontrol.wait;", "griddepcontrol.launch_dependents;")
_PTX_DECL = (".reg", ".local", ".shared", "//", ".loc", ".pragma")


def grid_dependency_ptx(ptx: str) -> str:
    """PTX with the grid-dependency instructions first in every entry's body, after its
    declarations (an .entry's body opens with a line holding only '{')."""
    lines, out, i = ptx.split("\n"), [], 0
    while i < len(lines):
        out.append(lines[i])
        if lines[i].lstrip().startswith((".entry", ".visible .entry")):
            i += 1
            while i < len(lines) and lines[i].strip() != "{":
                out.append(lines[i])
                i += 1
            if i == len(lines):
                raise BuildError("PTX entry without a body")
            out.append(lines[i])
            i += 1
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith(_PTX_DECL)):
                out.append(lines[i])
                i += 1
            out.extend("\t" + ins for ins in GRID_DEPENDENCY)
            continue
        i += 1
    return "\n".join(out)


_KERNEL_OPEN = re.compile(r"__global__\s+void\s[^;{]*\{")


def grid_dependency_cuda(text: str) -> str:
    """CUDA source with the grid-dependency instructions first in every __global__ function."""
    asm = 'asm volatile("' + "\\n\\t".join(GRID_DEPENDENCY) + '" ::: "memory");'
    out, n = _KERNEL_OPEN.subn(lambda m: m.group(0) + "\n  " + asm, text)
    if not n:
        raise BuildError("CUDA source without a __global__ function")
    return out


# ---- builders ---------------------------------------------------------------------------------

def _tilelang_includes() -> list[str]:
    spec = importlib.util.find_spec("tilelang")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("tilelang is not installed: its CUDA headers are needed to build TileLang kernels")
    pkg = Path(list(spec.submodule_search_locations)[0])
    tl_src = os.environ.get("TL_TEMPLATE_PATH") or str(pkg / "src")
    cutlass = os.environ.get("TL_CUTLASS_PATH") or str(pkg / "3rdparty" / "cutlass" / "include")
    return [f"-I{tl_src}", f"-I{cutlass}"]


def nvcc_command(target: Target, src_file: str, out_file: str) -> list[str]:
    arch = target.arch  # sm_90a / sm_100a: the "a" features (wgmma, tcgen05) need the arch-specific target
    comp = "compute_" + arch[3:]
    return [nvcc_path() or "nvcc", "-cubin", f"-gencode=arch={comp},code={arch}", "-std=c++20", "-O3", "-w",
            *_tilelang_includes(), "-Xptxas", "-v", "-o", out_file, src_file]


def _build_cuda(src: KernelSource, target: Target) -> tuple[dict, dict, dict]:
    if not nvcc_path():
        return {}, {"source": ("kernel.cu", src.text.encode())}, {"status": "unbuilt", "reason": "nvcc not on PATH"}
    # a template may render a second kernel the host side launches beside the first (the split
    # attention's combine after it, the bf16 prefill GEMM's row dequantisation before it): it is
    # built into its own cubin next to the main one
    parts = [("", src.entry, src.text)]
    if "combine" in src.meta:
        parts.append(("_combine", src.meta["combine"]["entry"], src.meta["combine"]["text"]))
    report, files = {}, {"source": ("kernel.cu", src.text.encode())}
    log = ""
    pdl = _cc(target) >= PDL_MIN_CC
    with tempfile.TemporaryDirectory(prefix="deepinfer-nvcc-") as d:
        for suffix, entry, text in parts:
            cu, cubin = os.path.join(d, f"kernel{suffix}.cu"), os.path.join(d, f"kernel{suffix}.cubin")
            Path(cu).write_text(grid_dependency_cuda(text) if pdl else text)
            r = subprocess.run(nvcc_command(target, cu, cubin), capture_output=True, text=True)
            if r.returncode != 0:
                err = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[-300:])
                raise BuildError(f"nvcc failed on {entry} for {target.arch}: {err.strip()}")
            report.update(parse_ptxas_report(r.stderr))
            files["cubin" + suffix] = (f"kernel{suffix}.cubin", Path(cubin).read_bytes())
            log += r.stderr
    files["ptxas_log"] = ("ptxas.log", log.encode())
    return report, files, {"status": "built", "pdl": pdl}


def _load_text_module(text: str):
    """Execute kernel source text as a module from a real file (Triton reads its functions'
    source back through `inspect`)."""
    h = hashlib.sha256(text.encode()).hexdigest()[:16]
    name = f"_deepinfer_triton_src_{h}"
    if name in sys.modules:
        return sys.modules[name]
    d = cache_root() / "triton-src"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.py"
    if not path.is_file():
        replace_file(path, text.encode())
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_META_FIELDS = ("name", "shared", "num_warps", "num_stages", "num_ctas", "hash", "tmem_size", "global_scratch_size",
                "profile_scratch_size", "launch_pdl", "launch_cooperative_grid", "triton_version", "arch")


def _build_triton(src: KernelSource, target: Target) -> tuple[dict, dict, dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cc = _cc(target)
    pdl = cc >= PDL_MIN_CC
    mod = _load_text_module(src.text)
    files = {"source": ("kernels.py", src.text.encode())}
    report, launches = {}, []
    for i, k in enumerate(src.meta["kernels"]):
        fn = getattr(mod, k["entry"], None)
        if fn is None:
            raise BuildError(f"triton source has no kernel {k['entry']!r}")
        aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in k.get("aligned", ())}
        ast = ASTSource(fn=fn, signature=dict(k["signature"]), constexprs=dict(k["constexprs"]), attrs=aligned)
        try:
            ck = triton.compile(ast, target=GPUTarget("cuda", cc, 32),
                                # fusion pinned: Triton 3.10 flips its default, and the cache key must decide the binary
                                options={"num_warps": k["num_warps"], "num_stages": k["num_stages"],
                                         "enable_fp_fusion": True})
        except Exception as e:  # noqa: BLE001  (Triton raises many types; report one line)
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise BuildError(f"triton compile of {k['entry']} for sm_{cc} failed: {msg}") from None
        md = {f: _jsonable(getattr(ck.metadata, f, None)) for f in _META_FIELDS}
        md["launch_pdl"] = pdl
        ptx_text = grid_dependency_ptx(ck.asm["ptx"]) if pdl else ck.asm["ptx"]
        # the cubin: Triton's PTX through Triton's ptxas with the options Triton passes it (its
        # fp fusion on), -v for the resources (Triton drops its log)
        with tempfile.TemporaryDirectory(prefix="deepinfer-ptxas-") as d:
            ptx, obj = os.path.join(d, "k.ptx"), os.path.join(d, "k.o")
            Path(ptx).write_text(ptx_text)
            arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
            r = subprocess.run([triton_ptxas(cc), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}",
                                ptx, "-o", obj], capture_output=True, text=True)
            if r.returncode != 0:
                raise BuildError(f"ptxas failed on {k['entry']} for {arch}: {r.stderr.strip()[-300:]}")
            cubin = Path(obj).read_bytes()
        res = parse_ptxas_report(r.stderr).get(md["name"], {})
        res.update(shared_bytes=md["shared"], n_regs=res.get("registers"),
                   n_spills=res.get("spill_stores", 0) + res.get("spill_loads", 0))
        report[f"{i}:{k['entry']}"] = res
        launches.append(dict(k, metadata=md))
        files[f"cubin{i}"] = (f"{i}-{k['entry']}.cubin", cubin)
        files[f"ptx{i}"] = (f"{i}-{k['entry']}.ptx", ptx_text.encode())
    files["launches"] = ("launches.json", json.dumps(launches, indent=1, sort_keys=True).encode())
    return report, files, {"status": "built", "pdl": pdl}


def _build_ascend(src: KernelSource, target: Target) -> tuple[dict, dict, dict]:
    files = {"source": ("kernel.cce", src.text.encode())}
    if not bisheng_path():
        return {}, files, {"status": "unbuilt", "reason": "CANN bisheng not on PATH: AscendC source kept, not compiled"}
    from tilelang.contrib import bisheng

    try:
        binary = bisheng.compile_ascend(src.text, target_format="o", npu_arch=target.arch, options=[])
    except Exception as e:  # noqa: BLE001
        raise BuildError(f"bisheng failed on {src.entry}: {str(e).strip().splitlines()[-1]}") from None
    files["binary"] = ("kernel.o", bytes(binary))
    return {}, files, {"status": "built"}


BUILDERS = {"cuda": _build_cuda, "triton": _build_triton, "ascendc": _build_ascend}


def build_one(src: KernelSource, target: Target | str, cache: CompileCache | None = None,
              check=None) -> BuildResult:
    """Build one kernel (or take it from the cache). `check(src, resources)` -> reason or None is
    the backend's capacity check, run before (resources None) and after the build."""
    target = get_target(target) if isinstance(target, str) else target
    cache = cache or CompileCache()
    t0 = time.perf_counter()
    key = cache_key(src, target)
    base = dict(target=target.name, language=src.language, entry=src.entry, key=key)
    if check:
        reason = check(src, None)
        if reason:
            return BuildResult("invalid", reason=reason, **base)
    hit = cache.get(key)
    if hit is not None:
        return BuildResult(hit["status"], files=hit["files"], resources=hit.get("resources", {}),
                           reason=hit.get("reason", ""), cached=True, seconds=time.perf_counter() - t0,
                           pdl=bool(hit.get("pdl")), **base)
    builder = BUILDERS.get(src.language)
    if builder is None:
        return BuildResult("failed", reason=f"no builder for {src.language!r} sources", **base)
    try:
        resources, files, status = builder(src, target)
    except BuildError as e:
        return BuildResult("failed", reason=str(e), seconds=time.perf_counter() - t0, **base)
    if check and status["status"] == "built":
        reason = check(src, resources)
        if reason:
            return BuildResult("invalid", resources=resources, reason=reason, seconds=time.perf_counter() - t0, **base)
    meta = dict(status=status["status"], reason=status.get("reason", ""), resources=resources,
                pdl=bool(status.get("pdl")), **base)
    stored = cache.put(key, meta, files)
    return BuildResult(status["status"], files=stored["files"], resources=resources, reason=meta["reason"],
                       pdl=meta["pdl"],
                       seconds=time.perf_counter() - t0, **base)


def _build_in_worker(src_json: dict, target_name: str, cache_dir: str, backend_name: str) -> dict:
    """Process-pool entry: plain JSON data in and out."""
    from .targets import get_manifest

    src = KernelSource(**{k: (tuple(v) if k in ("grid", "block") else v) for k, v in src_json.items()})
    return build_one(src, target_name, CompileCache(Path(cache_dir).parent), get_manifest(backend_name).check).to_json()


def build_for(manifest, sources: list[KernelSource], *, jobs: int = 1,
              cache: CompileCache | None = None, on_done=None) -> list[BuildResult]:
    """Build (or fetch from the compile cache) every source for a target manifest, each checked
    against the target's capacities before and after. (Here, not a Manifest method: templates
    import the manifests, and their render keys must not hash the build code.)"""
    return build_many(list(sources), manifest.target, jobs=jobs, cache=cache, check=manifest.check,
                      backend_name=manifest.name, on_done=on_done)


def build_many(sources: list[KernelSource], target: Target | str, *, jobs: int = 1,
               cache: CompileCache | None = None, check=None, backend_name: str | None = None,
               on_done=None) -> list[BuildResult]:
    """Build every source; cache hits are served at once, misses in parallel: a thread pool for
    the subprocess toolchains (nvcc, bisheng), a process pool for Triton (its compiler holds the
    GIL for much of a compile). `on_done(i, result)` is called for each source index as its
    result is in (a tuner writes an instance's candidates as soon as they are all built)."""
    target = get_target(target) if isinstance(target, str) else target
    cache = cache or CompileCache()
    results: list[BuildResult | None] = [None] * len(sources)
    keys = [cache_key(s, target) for s in sources]
    same: dict[str, list[int]] = {}  # sources with one cache key are built once: two workers must not write one entry
    for i, key in enumerate(keys):
        same.setdefault(key, []).append(i)

    def finished(first: int) -> None:
        for i in same[keys[first]]:
            results[i] = results[first]
            if on_done:
                on_done(i, results[i])

    todo = []
    for key, (first, *_) in same.items():
        hit = cache.get(key)
        if hit is not None and not (check and check(sources[first], None)):
            results[first] = build_one(sources[first], target, cache, check)
            finished(first)
        else:
            todo.append(first)
    _build_todo(sources, target, todo, results, jobs, cache, check, backend_name, finished)
    return results


def _build_todo(sources, target, todo, results, jobs, cache, check, backend_name, done=lambda i: None) -> None:
    if jobs <= 1 or len(todo) <= 1:
        for i in todo:
            results[i] = build_one(sources[i], target, cache, check)
            done(i)
        return
    triton_idx = [i for i in todo if sources[i].language == "triton"]
    other_idx = [i for i in todo if sources[i].language != "triton"]
    tp = cf.ThreadPoolExecutor(max_workers=jobs)
    pp = None
    try:
        futs = {tp.submit(build_one, sources[i], target, cache, check): i for i in other_idx}
        remote = {}  # Triton builds in worker processes, their results as JSON
        if triton_idx and backend_name:
            import multiprocessing as mp

            pp = cf.ProcessPoolExecutor(max_workers=min(jobs, len(triton_idx)), mp_context=mp.get_context("spawn"))
            remote = {pp.submit(_build_in_worker, _source_json(sources[i]), target.name, str(cache.root),
                                backend_name): i for i in triton_idx}
        else:
            for i in triton_idx:
                results[i] = build_one(sources[i], target, cache, check)
                done(i)
        for f in cf.as_completed([*futs, *remote]):  # both pools at once: results come as they finish
            i = futs[f] if f in futs else remote[f]
            results[i] = f.result() if f in futs else BuildResult(**f.result())
            done(i)
    except BaseException:
        # Ctrl-C or a failed build: a `with` block would run every queued build before letting
        # the error through (minutes on a device compile). Queued builds are dropped, the worker
        # processes end now; a thread's build in flight runs out (threads cannot be stopped).
        tp.shutdown(wait=False, cancel_futures=True)
        if pp is not None:
            _end_process_pool(pp)
        raise
    tp.shutdown()
    if pp is not None:
        pp.shutdown()


def _end_process_pool(pp: cf.ProcessPoolExecutor) -> None:
    workers = list((pp._processes or {}).values())  # no public handle before Python 3.14's terminate_workers
    pp.shutdown(wait=False, cancel_futures=True)
    for w in workers:
        if w.is_alive():
            w.terminate()
    for w in workers:
        w.join(timeout=1)


def _source_json(s: KernelSource) -> dict:
    return {"language": s.language, "entry": s.entry, "text": s.text, "grid": list(s.grid), "block": list(s.block),
            "smem_bytes": s.smem_bytes, "meta": json.loads(json.dumps(_jsonable(dict(s.meta))))}
