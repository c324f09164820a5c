"""bench/runtime_sm90.py's attribution of a step's wall to its kernels when they overlap."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
runtime_sm90 = pytest.importorskip("runtime_sm90")


def ev(name, ts, dur, grid=None):
    return {"name": name, "ts": ts, "dur": dur, "cat": "kernel", "args": {} if grid is None else {"grid": grid}}


def test_exposed_time_charges_each_kernel_past_the_ends_before_it():
    # a PDL chain: b starts while a runs and waits for it (charged from a's end); c on a second
    # stream, under a and b (charged nothing); a gap, then d
    events = [ev("a", 0, 10, [1, 1, 1]), ev("b", 5, 12), ev("c", 8, 4), ev("d", 30, 2)]
    r = runtime_sm90.exposed_time(events, steps=1, top=10)
    got = {t["name"]: t["exposed_us"] for t in r["top"]}
    assert got == {"a grid=[1, 1, 1]": 10, "b": 7, "c": 0, "d": 2}
    assert r["busy_us"] == 19  # the union: [0, 17] and [30, 32]
    assert r["kernel_sum_us"] == 28
    assert [t["name"] for t in r["top"]] == ["a grid=[1, 1, 1]", "b", "d", "c"]
    # a short event inside a long one that started first, listed first: the union is the long one
    nested = runtime_sm90.exposed_time([ev("short", 2, 1), ev("long", 0, 10)], steps=1, top=10)
    assert nested["busy_us"] == 10 and {t["name"]: t["exposed_us"] for t in nested["top"]} == {"long": 10, "short": 0}
    # per step, and two calls of one kernel and grid are one row
    r2 = runtime_sm90.exposed_time(events + [ev("a", 40, 10, [1, 1, 1])], steps=2, top=1)
    assert r2["top"] == [{"name": "a grid=[1, 1, 1]", "exposed_us": 10.0, "sum_us": 10.0, "calls": 1.0}]
