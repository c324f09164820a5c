"""The plan: a directory of data, never pickles.

    plan.json     model id + config hash + config, target, versions, per graph the final IR and its
                  kernel calls (buffers, launch shapes per bucket), memory plan per bucket, params and
                  their checkpoint sources, the load-time program, kernel instances and their configs,
                  sha256 of every other file, and its own hash
    kernels/      rendered sources and built binaries
    ir/           optional stage dumps

Written into a temporary directory beside the target and renamed into place (with fsync), so a
reader never sees a half-written plan and an existing plan survives a failed compile. Loading checks
the format, the versions and every hash, and refuses a damaged or foreign plan with one line.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..atomic import replace_dir, write_new_file

PLAN_FORMAT = "deepinfer-plan"
PLAN_VERSION = 1


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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_plan(plan: dict, files: dict[str, bytes], out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise PlanError(f"{out}: exists and is not a directory")

    def write(tmp: Path) -> None:
        hashes = {}
        for rel, data in sorted(files.items()):
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            write_new_file(p, data)
            hashes[rel] = _sha256(data)
        body = dict(plan, format=PLAN_FORMAT, format_version=PLAN_VERSION, files=hashes)
        body["self_sha256"] = _sha256(_canonical(body))
        write_new_file(tmp / "plan.json", json.dumps(body, indent=1, sort_keys=True).encode())

    replace_dir(out, write)
    return out


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
    if claimed != _sha256(_canonical(body)):
        raise PlanError(f"plan {root}: plan.json does not match its own hash (edited or damaged)")
    # the plan's calls name ops and templates of the DeepInfer that wrote it; the kernels inside are
    # binaries, so the torch that runs them need not be the one that compiled them
    mine = versions()["deepinfer-compiler"]
    theirs = body.get("versions", {}).get("deepinfer-compiler")
    if theirs != mine:
        raise PlanError(f"plan {root}: written by DeepInfer {theirs}, this is {mine}; compile it again")
    for rel, digest in body.get("files", {}).items():
        p = root / rel
        if not p.is_file():
            raise PlanError(f"plan {root}: {rel} is missing")
        if _sha256(p.read_bytes()) != digest:
            raise PlanError(f"plan {root}: {rel} does not match its hash (damaged)")
    if target is not None and body["target"]["name"] != target:
        raise PlanError(f"plan {root}: compiled for {body['target']['name']}, not {target}")
    return body

