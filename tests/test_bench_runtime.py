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
    # the idle inside the step: [17, 30], opened by b's end, closed by d
    assert r["gap_us"] == 13 and r["gaps"] == [{"pair": "b -> d", "gap_us": 13, "count": 1}]
    # a gap after the logits' copy is the host's, between steps
    host = runtime_sm90.exposed_time([ev("a", 0, 10), ev("Memcpy DtoH (Device -> Pinned)", 10, 5), ev("a", 50, 10)],
                                     steps=2, top=10)
    assert host["gap_us"] == 0 and host["gaps"] == [] and host["busy_us"] == 12.5
    # a short event inside a long one that started first, listed first: the union is the long one
    nested = runtime_sm90.exposed_time([ev("short", 2, 1), ev("long", 0, 10)], steps=1, top=10)
    assert nested["busy_us"] == 10 and {t["name"]: t["exposed_us"] for t in nested["top"]} == {"long": 10, "short": 0}
    # per step, and two calls of one kernel and grid are one row
    r2 = runtime_sm90.exposed_time(events + [ev("a", 40, 10, [1, 1, 1])], steps=2, top=1)
    assert r2["top"] == [{"name": "a grid=[1, 1, 1]", "exposed_us": 10.0, "sum_us": 10.0, "calls": 1.0}]


e2e_medium = pytest.importorskip("e2e_medium")
plot_performance = pytest.importorskip("plot_performance")


def test_e2e_decode_floor_is_issue_19s_byte_floor():
    # issue #19's floors at the 4.24 TB/s copy ceiling: 2.97 / 8.79 / 18.7 ms at b1 / b8 / b64
    # (attention + router and shared experts + LM head, routed experts by the share a batch hits)
    from deepinfer.models.config import load_config

    cfg = load_config("v4.1-flash-medium")
    ms = {b: e2e_medium.decode_floor_bytes(cfg, b) / 4.24e12 * 1e3 for b in (1, 8, 64, 128)}
    assert ms[1] == pytest.approx(2.97, abs=0.01) and ms[8] == pytest.approx(8.78, abs=0.02)
    assert ms[64] == pytest.approx(18.66, abs=0.02) and ms[64] < ms[128] < ms[64] * 1.02


def test_e2e_reads_the_plans_buckets_and_tabulates_them():
    plan = {"buckets": {"step": {"prefill_t16384": {}, "prefill_t4096": {}},
                        "step_decode": {"decode_b64": {}, "decode_b8": {}, "decode_b1": {}}, "draft": {"draft_b1": {}}}}
    assert e2e_medium.plan_buckets(plan) == ([4096, 16384], [1, 8, 64])
    m = {"prefill_4096": {"wall_s": 0.8, "mfu_fp8": 0.14, "tok_per_s": 5120.0},
         "decode_b1": {"graph": {"wall_ms": 8.0}, "floor_ms": 2.97, "x_floor": 2.69, "mbu": 0.37, "mfu_fp8": 0.001,
                       "tok_per_s": 125.0},
         "decode_b64": {"graph": {"wall_ms": 37.7, "greedy_wall_ms": 37.1}, "floor_ms": 18.7, "x_floor": 2.02,
                        "x_floor_greedy": 1.98, "mbu": 0.5, "mfu_fp8": 0.04, "tok_per_s": 1700.0}, "graphs": {}}
    lines = e2e_medium.table(m).splitlines()
    assert len(lines) == 4 and "800.0 ms" in lines[1] and "2.69" in lines[2] and "ms" not in lines[2][60:]
    assert lines[3].split()[-3:] == ["37.10", "ms", "1.98"]  # a greedy batch's step: ids back, not logits
    eng = {"ms_per_step": 9.1, "tok_per_s": 110.0, "idle_share": 0.3}
    lines = e2e_medium.table({"engine_b1": eng, "engine_early_b1": {**eng, "idle_share": 0.1, "tokens_equal": False}}).splitlines()
    assert lines[1].endswith("idle 30.0%") and lines[2].endswith("idle 10.0%, tokens equal: False")


def test_plot_points_come_from_the_results():
    res = {"medium": {"decode_b8": {"graph": {"wall_ms": 17.0}, "floor_ms": 8.8},
                      "decode_b1": {"graph": {"wall_ms": 8.0}, "floor_ms": 2.97}, "prefill_4096": {"wall_s": 1.0}}}
    assert plot_performance.decode_points(res) == [(1, 8.0, 2.97), (8, 17.0, 8.8)]
    rows = {"rows": [{"name": "gemm", "time_us": 2.0, "bytes": 100, "flops": 1000},
                     {"name": "untimed", "bytes": 1, "flops": 1}, {"op": "copy", "case": "b1", "time_us": 1.0, "bytes": 8}]}
    assert plot_performance.roofline_points(rows) == [("gemm", 10.0, 5e8)]
