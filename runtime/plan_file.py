"""The plan file format: what a plan directory holds and how it is read and checked.

The compiler writes plans (codegen/plan.py); the runtime reads them here, and nothing else: a
serving machine needs this module, torch and the CUDA driver, not the compiler.

    plan.json     model id + config hash + config, target, versions, per graph its inputs, params,
                  state, outputs and kernel calls (buffers, dependencies: `deps` the calls whose
                  outputs a call reads, `after` the earlier readers of memory it writes in place;
                  launch shapes and host recipes per bucket), memory plan per bucket, params and their checkpoint sources,
                  the load-time program, kernel instances (configs, parameter lists, launches),
                  sha256 of every other file, and its own hash
    kernels/      rendered sources and built binaries
    ir/           stage dumps (for people; the runtime does not read them)

Loading checks the format, the versions and every hash, and refuses a damaged or foreign plan
with one line.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

PLAN_FORMAT = "deepinfer-plan"
PLAN_VERSION = 2


class PlanError(ValueError):
    """A plan that cannot be used: the message is one line with the reason."""


def versions() -> dict[str, str]:
    """Versions that must match between compile and load (the kernels were built with them)."""
    from importlib.metadata import PackageNotFoundError, version

    from ..version import VERSION

    out = {"deepinfer-compiler": VERSION}
    for pkg in ("torch", "triton", "tilelang"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def load_plan(plan_dir: str | os.PathLike, target: str | None = None) -> dict:
    root = Path(plan_dir)
    if not root.is_dir():
        raise PlanError(f"plan {root}: no such directory")
    try:
        body = json.loads((root / "plan.json").read_text())
    except FileNotFoundError:
        raise PlanError(f"plan {root}: plan.json is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"plan {root}: plan.json is damaged ({e.__class__.__name__})") from None
    if not isinstance(body, dict) or body.get("format") != PLAN_FORMAT:
        raise PlanError(f"plan {root}: not a DeepInfer plan")
    if body.get("format_version") != PLAN_VERSION:
        raise PlanError(f"plan {root}: format version {body.get('format_version')}, this DeepInfer reads "
                        f"{PLAN_VERSION}; compile it again")
    claimed = body.pop("self_sha256", None)
    if claimed != sha256(canonical(body)):
        raise PlanError(f"plan {root}: plan.json does not match its own hash (edited or damaged)")
    # the plan's calls name ops and templates of the DeepInfer that wrote it; the kernels inside are
    # binaries, so the torch that runs them need not be the one that compiled them
    mine = versions()["deepinfer-compiler"]
    theirs = _field(root, body, "versions", dict).get("deepinfer-compiler")
    if theirs != mine:
        raise PlanError(f"plan {root}: written by DeepInfer {theirs}, this is {mine}; compile it again")
    for rel, digest in _field(root, body, "files", dict).items():
        # a file outside the plan directory is no part of the plan (hashes only cover what is inside)
        p = root / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise PlanError(f"plan {root}: {rel} is outside the plan directory")
        if not isinstance(digest, str) or not p.is_file():
            raise PlanError(f"plan {root}: {rel} is missing")
        if sha256(p.read_bytes()) != digest:
            raise PlanError(f"plan {root}: {rel} does not match its hash (damaged)")
    name = _field(root, body, "target", dict).get("name")
    if not isinstance(name, str):
        raise PlanError(f"plan {root}: plan.json names no target")
    if target is not None and name != target:
        raise PlanError(f"plan {root}: compiled for {name}, not {target}")
    return body


def _field(root: Path, body: dict, key: str, kind: type):
    """A field the format requires, of its type: a hash-consistent plan.json can still be malformed
    (written by hand, or by a broken writer), and that is a PlanError, not a TypeError later."""
    value = body.get(key)
    if not isinstance(value, kind):
        raise PlanError(f"plan {root}: plan.json field {key!r} is missing or malformed")
    return value

