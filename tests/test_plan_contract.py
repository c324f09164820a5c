"""The plan is the runtime's whole contract: the runtime imports nothing of the compiler (codegen,
passes), reads plan.json and the kernel files it names, and checks the call graph it is given."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serving_machine import generate_script, parse_output

from deepinfer.models.checkpoint import make_checkpoint
from deepinfer.passes.driver import CompileOptions, compile_model
from deepinfer.runtime.plan_file import PlanError
from deepinfer.runtime.plan_runner import PlanGraph

ROOT = Path(__file__).resolve().parents[1]
COMPILER = ("codegen", "passes")


def _imports(path: Path, package: str) -> set[str]:
    """Every deepinfer module a file imports, at any depth (function-level imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("deepinfer")}


def test_runtime_modules_import_no_compiler_code():
    bad = {}
    for f in sorted((ROOT / "runtime").glob("*.py")):
        hits = {m for m in _imports(f, "deepinfer.runtime") if m.split(".")[1:2] and m.split(".")[1] in COMPILER}
        if hits:
            bad[f.name] = sorted(hits)
    assert not bad, bad


@pytest.fixture(scope="module")
def cpu_plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    ckpt = make_checkpoint("v4.1-flash-tiny", root / "ckpt", seed=3)
    plan = compile_model("v4.1-flash-tiny", CompileOptions("cpu", max_model_len=256, max_num_seqs=2), root / "plan")
    return plan.plan_dir, ckpt


def test_a_cpu_plan_generates_where_the_compiler_is_absent(cpu_plan):
    plan, ckpt = cpu_plan
    prompts = [[5, 17, 300, 9000, 12], list(range(100, 130))]
    code = generate_script(plan, ckpt, prompts, 5, max_num_seqs=2, max_model_len=128)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = parse_output(r.stdout)
    assert lines["MODULES"] == "[]"
    from deepinfer import LLM, SamplingParams

    want = LLM("v4.1-flash-tiny", ckpt, max_num_seqs=2, max_model_len=128).generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False)
    assert lines["TOKENS"] == str([o.token_ids for o in want])


def test_the_plan_records_what_the_runtime_needs(cpu_plan):
    plan, _ = cpu_plan
    body = json.loads((Path(plan) / "plan.json").read_text())
    assert body["options"]["page_tokens"] == 128
    for name, g in body["graphs"].items():
        PlanGraph(name, g)  # checks every dependency
        assert g["outputs"] and g["params"] and g["calls"]
        assert all("deps" in c for c in g["calls"])


def test_a_call_graph_with_a_wrong_dependency_is_refused(cpu_plan):
    plan, _ = cpu_plan
    g = json.loads((Path(plan) / "plan.json").read_text())["graphs"]["step"]
    i = next(i for i, c in enumerate(g["calls"]) if c["deps"])
    bad = json.loads(json.dumps(g))
    bad["calls"][i]["deps"] = []
    with pytest.raises(PlanError, match="neither its dependencies"):
        PlanGraph("step", bad)
    bad = json.loads(json.dumps(g))
    bad["calls"][0]["deps"] = [len(bad["calls"]) - 1]
    with pytest.raises(PlanError, match="does not precede"):
        PlanGraph("step", bad)


def test_a_call_writing_memory_in_place_comes_after_its_earlier_readers(cpu_plan):
    """`after` edges: every window-ring write comes after the attention that read the ring before
    it (no value flows between them, so `deps` cannot say it); a runtime running calls
    concurrently (schedule_lanes) orders them by it."""
    plan, _ = cpu_plan
    g = json.loads((Path(plan) / "plan.json").read_text())["graphs"]["step"]
    calls = g["calls"]
    writes = [(i, c) for i, c in enumerate(calls) if c["op"] == "swa_write"]
    checked = 0
    for i, c in writes:
        ring = c["inputs"][0]
        readers = [j for j, r in enumerate(calls[:i]) if ring in r["inputs"] and j not in c["deps"]]
        assert set(readers) <= set(c["after"]), (c["outputs"], readers, c["after"])
        checked += bool(readers)
    assert checked >= len(writes) // 2
    bad = json.loads(json.dumps(g))
    bad["calls"][writes[0][0]]["after"] = [len(calls) - 1]
    with pytest.raises(PlanError, match="ordered after a call that does not precede"):
        PlanGraph("step", bad)


def _chain(*deps, after=()):
    return [{"deps": list(d), "after": list(a)} for d, a in zip(deps, after or [()] * len(deps))]


def test_schedule_lanes_branches_and_joins():
    """A call continues its latest dependency's stream; a second consumer of the same call starts
    a branch on another stream; a join waits on the other stream's latest call it needs, once."""
    from deepinfer.runtime.plan_runner import schedule_lanes

    # 0 -> 1 -> 2 ; 0 -> 3 -> 4 (branch) ; 5 needs 2 and 4 ; 6 needs 5 and 3 (already implied)
    calls = _chain([], [0], [1], [0], [3], [2, 4], [5, 3])
    lanes, waits = schedule_lanes(calls, 2)
    assert lanes[:3] == [0, 0, 0] and lanes[3:5] == [1, 1]
    assert waits[3] == [0] and waits[4] == []
    assert lanes[5] == 1 and waits[5] == [2]  # continues its latest dependency (4), waits for 2
    assert lanes[6] == 1 and waits[6] == []  # 3 is on its own stream
    # one stream: everything in order, no waits
    assert schedule_lanes(calls, 1) == ([0] * 7, [[]] * 7)
    # an in-place write after a reader on another stream waits for it
    calls = _chain([], [0], [0], [1], [3], after=[(), (), (), (), (2,)])
    lanes, waits = schedule_lanes(calls, 2)
    assert lanes[2] != lanes[4] and waits[4] == [2]


def test_the_stream_count_comes_from_the_environment(monkeypatch):
    """DEEPINFER_LANES: 2 streams unless set; a value that is not a whole number >= 1 is refused
    with one line naming the variable."""
    from deepinfer.runtime.cuda_executor import lanes_from_env

    monkeypatch.delenv("DEEPINFER_LANES", raising=False)
    assert lanes_from_env() == 2
    monkeypatch.setenv("DEEPINFER_LANES", "3")
    assert lanes_from_env() == 3
    for bad in ("0", "two", "-1", ""):
        monkeypatch.setenv("DEEPINFER_LANES", bad)
        with pytest.raises(ValueError, match="DEEPINFER_LANES"):
            lanes_from_env()


def test_a_value_read_on_another_stream_is_freed_once_its_stream_waited_for_the_reader():
    """cross_stream_frees: `v` made on stream 0 and read on stream 1 may go back to stream 0's pool
    only after stream 0 waited for that reader (call 4, the join), not at its last reader (call 2);
    a value no later call of its stream waits past is kept to the step's end, and so is one a view
    shares."""
    from deepinfer.runtime.plan_runner import cross_stream_frees, schedule_lanes

    def call(ins, outs, deps, kernel="k"):
        return {"inputs": ins, "outputs": outs, "deps": deps, "after": [], "kernel": kernel}

    calls = [call([], ["v"], []), call(["v"], ["a"], [0]), call(["v"], ["b"], [0]), call(["a"], ["c"], [1]),
             call(["c", "b"], ["d"], [3, 2]), call(["b"], ["e"], [2]), call(["e"], ["w"], [5], kernel="view"),
             call(["w"], ["x"], [6]), call(["w", "d"], ["out"], [6, 4])]
    lanes, waits = schedule_lanes(calls, 2)
    assert lanes[:5] == [0, 0, 1, 0, 0] and waits[4] == [2]
    free_at, kept = cross_stream_frees(calls, lanes, waits, keep={"out", "x"})
    assert free_at["v"] == 4
    assert lanes[8] == 0 and "w" in kept  # a view's output read across: its memory is b's too
    assert "out" not in free_at and "out" not in kept
