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
pickle: rows are plain JSON, and a malformed line is skipped with a one-line warning.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..atomic import write_new_file


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
    def __init__(self, rows: list[dict] | None = None, path: Path | None = None):
        self.rows: list[dict] = list(rows or [])
        self.path = path

    @classmethod
    def load(cls, path) -> "TuningDB":
        """Rows of a JSON-lines file; a missing file is an empty database, a malformed line is
        skipped with one warning line naming the file, the line and the problem."""
        path = Path(path)
        rows = []
        if not path.exists():
            return cls([], path)
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                warnings.warn(f"{path}:{i}: skipped, not JSON ({str(e).splitlines()[0]})", TuningDBWarning, 2)
                continue
            why = check_row(row)
            if why:
                warnings.warn(f"{path}:{i}: skipped, {why}", TuningDBWarning, 2)
                continue
            rows.append(row)
        return cls(rows, path)

    def merged(self, other: "TuningDB") -> "TuningDB":
        """Both databases' rows; where both hold the same key, the measured row with the lower p50
        wins (a measured row always beats a modelled one)."""
        best: dict[str, dict] = {}
        for row in self.rows + other.rows:
            k = row_key(row)
            if k not in best or _better(row, best[k]):
                best[k] = row
        return TuningDB(list(best.values()), self.path)

    def add(self, row: dict) -> None:
        why = check_row(row)
        if why:
            raise ValueError(f"tuning row: {why}")
        k = row_key(row)
        self.rows = [r for r in self.rows if row_key(r) != k or not _better(row, r)]
        if not any(row_key(r) == k for r in self.rows):
            self.rows.append(row)

    def save(self, path=None) -> Path:
        """Written whole and atomically: a reader sees the old file or the new one."""
        path = Path(path or self.path)
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.unlink(missing_ok=True)
        write_new_file(tmp, text.encode())
        tmp.replace(path)
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


def check_row(row) -> str | None:
    if not isinstance(row, dict):
        return "not a JSON object"
    missing = ROW_KEYS - set(row)
    if missing:
        return f"missing {', '.join(sorted(missing))}"
    if not isinstance(row["config"], dict) or not isinstance(row["fingerprint"], dict):
        return "config and fingerprint must be objects"
    if row["status"] not in ("ok", "failed"):
        return f"status {row['status']!r} is not ok or failed"
    if not isinstance(row["bucket"], int) or isinstance(row["bucket"], bool) or row["bucket"] < 0:
        return f"bucket {row['bucket']!r} is not a row count"
    if row["timings"] is not None and not (isinstance(row["timings"], dict) and
                                           isinstance(row["timings"].get("p50"), (int, float))):
        return "timings must be null or hold a p50"
    if not isinstance(row["measured"], bool):
        return "measured must be true or false"
    return None


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
