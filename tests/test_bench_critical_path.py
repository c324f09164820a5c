"""bench/critical_path.py: a step's longest chain of calls from a plan's edges and measured times."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import critical_path as cp  # noqa: E402


def _plan():
    """x -> (a: two launches | b: one launch, beside it) -> c; c also ordered after b (in place)."""
    def call(op, deps, after, kernel):
        return {"op": op, "deps": deps, "after": after, "inputs": [f"layers.0.{op}"], "outputs": [op],
                "launch": {"decode_b1": {"kernel": kernel, "recipe": "r" + kernel, "template": f"triton_{op}"}}}

    kernels = {"k0": {"meta": {"kernels": [{"entry": "x_kernel"}]}},
               "k1": {"meta": {"kernels": [{"entry": "a_kernel"}, {"entry": "sum_kernel"}]}},
               "k2": {"entry": "b_kernel", "meta": {}},
               "k3": {"meta": {"kernels": [{"entry": "c_kernel"}]}}}
    recipes = {"rk0": {"steps": [{"launch": 0, "grid": [1]}]},
               "rk1": {"steps": [{"op": "aten.empty"}, {"launch": 0, "grid": [4, 2]}, {"launch": 1, "grid": [2]}]},
               "rk2": {"steps": [{"launch": 0, "grid": [8, 1, 1]}]},
               "rk3": {"steps": [{"launch": 0, "grid": [1]}]}}
    calls = [call("x", [], [], "k0"), call("a", [0], [], "k1"), call("b", [0], [], "k2"), call("c", [1], [2], "k3")]
    return {"kernels": kernels, "recipes": recipes, "graphs": {"step_decode": {"calls": calls}}}


def _profile(b_us):
    rows = [("x_kernel grid=[1, 1, 1]", 2.0), ("a_kernel grid=[4, 2, 1]", 5.0), ("sum_kernel grid=[9, 1, 1]", 1.0),
            ("b_kernel grid=[8, 1, 1]", b_us)]
    return {"medium_profile": {"decode_b1": {"by_launch": [{"name": n, "us_per_call": t} for n, t in rows]}}}


def test_the_path_follows_the_slower_branch_and_prices_each_launch():
    plan = _plan()
    calls, cost, path, finish, guessed = cp.model(plan, _profile(3.0), "decode_b1", gap_us=1.0, unknown_us=0.5)
    # a: its two launches (sum_kernel at another grid takes that kernel's mean) and two gaps
    assert cost == [3.0, 8.0, 4.0, 1.5]
    assert path == [0, 1, 3] and finish[3] == 3.0 + 8.0 + 1.5
    assert guessed == {"sum_kernel (other grids' mean)": 1, "c_kernel": 1}
    # b slower than a: the path goes through b, reached by c's `after` edge
    _, _, path, finish, _ = cp.model(plan, _profile(20.0), "decode_b1", gap_us=1.0, unknown_us=0.5)
    assert path == [0, 2, 3] and finish[3] == 3.0 + 21.0 + 1.5
