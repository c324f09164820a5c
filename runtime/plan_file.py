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
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
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
    _check_contract(root, body)
    return body


# the options the runtime reads as numbers (limits, layout) and as flags
_INT_OPTIONS = ("max_model_len", "max_num_seqs", "page_tokens", "max_pages", "num_pages", "num_slots", "ep", "dp",
                "decode_rows_max", "verify_drafts")


def _check_contract(root: Path, body: dict) -> None:
    """The fields the runtime reads before it runs anything, of the kinds it reads them as: a plan
    whose hash was recomputed after an edit is still refused here in one line, not by a TypeError or
    KeyError from deep inside the runtime."""
    from ..ir.registry import get_op

    opts = _field(root, body, "options", dict)
    for key in _INT_OPTIONS:
        if key in opts and (not isinstance(opts[key], int) or isinstance(opts[key], bool) or opts[key] < 0):
            raise PlanError(f"plan {root}: option {key} must be a whole number >= 0, got {opts[key]!r}")
    for key in ("max_model_len", "max_num_seqs", "page_tokens"):
        if not opts.get(key):
            raise PlanError(f"plan {root}: option {key} is missing or zero")
    if "batch_invariant" in opts and not isinstance(opts["batch_invariant"], bool):
        raise PlanError(f"plan {root}: option batch_invariant must be true or false")
    graphs = _field(root, body, "graphs", dict)
    if not isinstance(graphs.get("step"), dict) or not isinstance(graphs["step"].get("calls"), list):
        raise PlanError(f"plan {root}: plan.json has no step graph")
    buckets = _field(root, body, "buckets", dict)
    for gname, g in graphs.items():
        if not isinstance(g, dict) or not isinstance(g.get("calls"), list) or not isinstance(buckets.get(gname), dict):
            raise PlanError(f"plan {root}: graph {gname!r} is malformed or has no buckets")
    model = _field(root, body, "model", dict)
    if not isinstance(model.get("config"), dict) or not isinstance(model.get("id"), str):
        raise PlanError(f"plan {root}: plan.json's model record is malformed")
    for i, node in enumerate(_field(root, body, "load_program", list)):
        op = node.get("op") if isinstance(node, dict) else None
        try:
            get_op(op)
        except (KeyError, TypeError):
            raise PlanError(f"plan {root}: load step {i} names no known op ({op!r})") from None


def _field(root: Path, body: dict, key: str, kind: type):
    """A field the format requires, of its type: a hash-consistent plan.json can still be malformed
    (written by hand, or by a broken writer), and that is a PlanError, not a TypeError later."""
    value = body.get(key)
    if not isinstance(value, kind):
        raise PlanError(f"plan {root}: plan.json field {key!r} is missing or malformed")
    return value

