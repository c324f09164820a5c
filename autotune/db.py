"""The tuning database: JSON lines, one row per (target fingerprint, template, kernel structure,
shape bucket), mergeable by concatenation.

A row:
    {"fingerprint": {"target", "arch", "device", "cores", "driver", "runtime", "toolchain": {..}},
     "template": "triton_hc_pre", "structure": <hash of the call with its row count abstracted>,
     "spec": <the call's spec key, for people>, "bucket": <row count>, "config": {..},
     "timings": {"p20", "p50", "p80", "repeats"} (microseconds) | null, "status": "ok" | "failed",
     "measured": true | false, "provenance": {"host", "date", "source"}}

Lookup (`TuningDB.lookup`) climbs a ladder and says which rung answered. A row is usable where
its arch and toolchain (the compilers' versions and the template's code: what decides the binary)
equal the asking target's, whichever host built or timed it: a kernel built here and measured on a
GPU machine is the kernel this host builds again. The rungs, over usable rows of the call's
template and structure:
    exact     measured on this device (name, cores, driver, runtime) at the call's bucket
    borrowed  measured on another device of the arch at the call's bucket: one with the target's
              core count first (the machine the target describes), then the fastest. A compiling
              host has no device, so every measured row a compile takes is borrowed.
    modelled  the cost model's row at the call's bucket (a measurement beats a model at any rung)
    nearest   the nearest shape bucket of the structure: measured first, this device's first
The caller falls back to the template default. A row whose toolchain differs from the asking
target's is never used (it is counted as stale, so a user can see why nothing matched). No
pickle: rows are plain JSON, and a malformed line is skipped with a one-line warning and kept as
it is when the file is rewritten (it is the user's, to fix or delete).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..atomic import replace_file


def shipped_db(target: str) -> Path:
    """The database shipped for a target: autotune/db/<target>.jsonl."""
    return Path(__file__).resolve().parent / "db" / f"{target}.jsonl"


class TuningDBWarning(UserWarning):
    """A line of a tuning database that was skipped (one line saying which and why)."""


ROW_KEYS = {"fingerprint", "template", "structure", "spec", "bucket", "config", "timings", "status", "measured",
            "provenance"}


def structure_key(spec) -> tuple[str, int]:
    """(hash of the call with its leading row count abstracted, that row count): calls that differ
    only in how many rows they take share a structure, and their row counts are the shape
    buckets a lookup may take the nearest of."""
    text = spec.key()
    rows = _rows(spec)
    # the row count as the first dimension of the first input (and wherever the same number heads
    # another shape: outputs and row-aligned inputs follow the call's rows)
    abstract = re.sub(rf"\[{rows}([,\]])", r"[n\1", text) if rows else text
    return hashlib.sha256(abstract.encode()).hexdigest()[:16], rows


def _rows(spec) -> int:
    t = spec.in_types[0] if spec.in_types else None
    shape = getattr(getattr(t, "data", t), "shape", ()) if t is not None else ()
    return int(shape[0]) if shape and isinstance(shape[0], int) else 0


def toolchain_of(fp: dict) -> dict:
    return dict(fp.get("toolchain", {}))


@dataclass(frozen=True)
class Match:
    row: dict
    rung: str  # "exact" | "borrowed" | "modelled" | "nearest"


class TuningDB:
    def __init__(self, rows: list[dict] | None = None, path: Path | None = None, unread: list[bytes] | None = None):
        self.rows: list[dict] = list(rows or [])
        self.path = path
        # the file's lines that are not rows, byte for byte: a save writes them back, since a
        # tuning run rewriting the file must not delete what the user wrote there
        self.unread: list[bytes] = list(unread or [])

    @classmethod
    def load(cls, path) -> "TuningDB":
        """Rows of a JSON-lines file; a missing file is an empty database, a malformed line is
        skipped with one warning line naming the file, the line and the problem, and kept for
        `save`."""
        path = Path(path)
        rows, unread = [], []
        if not path.exists():
            return cls([], path)
        # bytes, not text: a line that is not UTF-8 goes back into the file as it was
        for i, line in enumerate(path.read_bytes().split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode())
            except UnicodeDecodeError as e:
                why = f"not UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})"
            except ValueError as e:
                why = f"not JSON ({str(e).splitlines()[0]})"
            except RecursionError:
                why = "not JSON (nested too deeply)"
            else:
                why = check_row(row)
            if why:
                warnings.warn(f"{path}:{i}: skipped, {why}; a rewrite of the file keeps the line as it is",
                              TuningDBWarning, 2)
                unread.append(line)
                continue
            rows.append(row)
        return cls(rows, path, unread)

    def merged(self, other: "TuningDB") -> "TuningDB":
        """Both databases' rows; where both hold the same key, the measured row with the lower p50
        wins (a measured row always beats a modelled one)."""
        best: dict[str, dict] = {}
        for row in self.rows + other.rows:
            k = row_key(row)
            if k not in best or _better(row, best[k]):
                best[k] = row
        return TuningDB(list(best.values()), self.path, self.unread)  # self's file, self's unread lines

    def add(self, row: dict) -> None:
        why = check_row(row)
        if why:
            raise ValueError(f"tuning row: {why}")
        k = row_key(row)
        self.rows = [r for r in self.rows if row_key(r) != k or not _better(row, r)]
        if not any(row_key(r) == k for r in self.rows):
            self.rows.append(row)

    def prune_stale(self, current: dict[str, dict], arch: str) -> int:
        """Drop the rows of the templates in `current` (template -> the toolchain a build here
        has, template code included) built for `arch` with another toolchain: rows no lookup
        here can use again (a template edit leaves its old rows behind otherwise). Rows of other
        templates and arches, and the unread lines, stay. Returns how many rows went."""
        keep = [r for r in self.rows if not (r["template"] in current and r["fingerprint"].get("arch") == arch
                                             and toolchain_of(r["fingerprint"]) != current[r["template"]])]
        gone = len(self.rows) - len(keep)
        self.rows = keep
        return gone

    def save(self, path=None) -> Path:
        """Written whole and atomically: a reader sees the old file or the new one. The lines
        `load` could not read follow the rows, as they were."""
        path = Path(path or self.path)
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.rows).encode()
        replace_file(path, data + b"".join(line + b"\n" for line in self.unread))
        return path

    def lookup(self, fp: dict, template: str, spec) -> tuple[Match | None, int]:
        """The best row for a call on a target with fingerprint `fp` by the ladder above, and how
        many rows of this template and structure were passed over because their toolchain
        differs (stale)."""
        structure, bucket = structure_key(spec)
        mine = [r for r in self.rows if r["template"] == template and r["structure"] == structure
                and r["status"] == "ok"]
        current = [r for r in mine if toolchain_of(r["fingerprint"]) == toolchain_of(fp)
                   and r["fingerprint"].get("arch") == fp.get("arch")]
        stale = len(mine) - len(current)
        here = [r for r in current if r["bucket"] == bucket]
        measured = [r for r in here if r["measured"]]
        rungs = (("exact", [r for r in measured if _device(r["fingerprint"]) == _device(fp)],
                  _rank),
                 ("borrowed", measured, lambda r: (r["fingerprint"].get("cores") != fp.get("cores"), _p50(r))),
                 ("modelled", [r for r in here if not r["measured"]], _rank))
        for rung, pool, order in rungs:
            if pool:
                return Match(min(pool, key=order), rung), stale
        if current:  # the nearest shape bucket, on a log scale of rows
            near = min(current, key=lambda r: (_log_gap(r["bucket"], bucket), not r["measured"],
                                               _device(r["fingerprint"]) != _device(fp), _p50(r)))
            return Match(near, "nearest"), stale
        return None, stale

    def held(self, fp: dict, template: str, spec) -> dict | None:
        """The row of any status this device and toolchain already hold for the call's bucket (a
        rerun skips what it holds), or None."""
        structure, bucket = structure_key(spec)
        key = row_key({"fingerprint": fp, "template": template, "structure": structure, "bucket": bucket})
        mine = [r for r in self.rows if row_key(r) == key]
        return min(mine, key=_rank) if mine else None


def provenance(match: Match, db: "TuningDB") -> dict:
    """What a plan records with an instance whose config came from a row: the rung that answered
    and which row it was (its template's structure and bucket, the device, how it was made, and
    the database file it came from)."""
    row = match.row
    return {"rung": match.rung, "measured": row["measured"], "bucket": row["bucket"], "structure": row["structure"],
            "device": row["fingerprint"].get("device"), "date": row["provenance"].get("date"),
            "source": row["provenance"].get("source"), "db": db.path.name if db.path else None}


# What a measured row's tried candidates hold that the tables and --apply read.
_TRIED = {"id": str, "default": bool, "status": str}


def check_row(row) -> str | None:
    """Why `row` is not a row (None where it is). Every field a lookup, a table, --apply or a
    plan's provenance reads later is checked here, so a damaged row is skipped at load like any
    malformed line rather than failing a compile or a tuning run midway."""
    if not isinstance(row, dict):
        return "not a JSON object"
    missing = ROW_KEYS - set(row)
    if missing:
        return f"missing {', '.join(sorted(missing))}"
    for k in ("template", "structure", "spec"):
        if not isinstance(row[k], str):
            return f"{k} must be a string"
    if not all(isinstance(row[k], dict) for k in ("config", "fingerprint", "provenance")):
        return "config, fingerprint and provenance must be objects"
    fp = row["fingerprint"]
    if not isinstance(fp.get("toolchain"), dict):
        return "fingerprint toolchain must be an object"
    for k in ("target", "arch", "device", "driver", "runtime"):  # null: none (a compiling host has no device)
        if fp.get(k) is not None and not isinstance(fp[k], str):
            return f"fingerprint {k} must be a string or null"
    if fp.get("cores") is not None and not _is(fp["cores"], int):
        return "fingerprint cores must be an integer or null"
    knob = next((k for k, v in row["config"].items() if not _is(v, (int, float, str, bool))), None)
    if knob is not None:
        return f"config {knob} must be a number, string or boolean"
    for k in ("date", "source"):
        if row["provenance"].get(k) is not None and not isinstance(row["provenance"][k], str):
            return f"provenance {k} must be a string or null"
    if row["status"] not in ("ok", "failed"):
        return f"status {row['status']!r} is not ok or failed"
    if not _is(row["bucket"], int) or row["bucket"] < 0:
        return f"bucket {row['bucket']!r} is not a row count"
    if row["timings"] is not None and not (isinstance(row["timings"], dict) and
                                           _is(row["timings"].get("p50"), (int, float))):
        return "timings must be null or hold a p50"
    if not isinstance(row["measured"], bool):
        return "measured must be true or false"
    if row.get("instance") is not None and not isinstance(row["instance"], str):
        return "instance must be a string or null"
    tried = row.get("candidates")
    if tried is not None and not (isinstance(tried, list) and all(
            isinstance(t, dict) and all(isinstance(t.get(k), kind) for k, kind in _TRIED.items())
            and "p50" in t and (t["p50"] is None or _is(t["p50"], (int, float))) for t in tried)):
        return "candidates must be a list of objects with an id, default, status and p50"
    return None


def _is(value, kind) -> bool:
    """isinstance, except that a JSON true or false is a number only where a boolean is allowed
    (Python's bool is an int)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and (not isinstance(value, bool) or bool in kinds)


def row_key(row: dict) -> str:
    fp = row["fingerprint"]
    return json.dumps([_device(fp), toolchain_of(fp), fp.get("arch"), row["template"], row["structure"],
                       row["bucket"]], sort_keys=True)


def _device(fp: dict) -> tuple:
    return (fp.get("target"), fp.get("arch"), fp.get("device"), fp.get("cores"), fp.get("driver"), fp.get("runtime"))


def _p50(row) -> float:
    t = row.get("timings")
    return float(t["p50"]) if t else math.inf


def _rank(row) -> tuple:
    return (row["status"] != "ok", not row["measured"], _p50(row))


def _better(a: dict, b: dict) -> bool:
    return _rank(a) < _rank(b)


def _log_gap(a: int, b: int) -> float:
    return abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))
