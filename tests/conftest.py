"""Shared test set-up. Every Graph of at most ROUND_TRIP_NODES nodes the suite builds is printed
and parsed back at the end of the session; a graph whose text form does not round-trip to an equal
graph fails the run (each distinct text once). (Graphs that define a value twice have no text form;
the verifier tests build some on purpose. Graphs of the real and medium models, about 2000 nodes
at each of many pipeline stages and targets, repeat the tiny graphs' ops and attributes at more
layers, and parsing them all took more than a minute of a two-core run: test_ir_graph round-trips
the real model's graphs before and after the sm90 pipeline directly.)"""
import pytest

from deepinfer.ir import graph as graph_mod
from deepinfer.ir.text import parse_graph, print_graph

_BUILT: list = []
ROUND_TRIP_NODES = 1200
_orig_init = graph_mod.Graph.__init__


def _tracking_init(self, *args, **kwargs):
    _orig_init(self, *args, **kwargs)
    _BUILT.append(self)


graph_mod.Graph.__init__ = _tracking_init


@pytest.fixture(scope="session", autouse=True)
def every_graph_round_trips():
    yield
    graphs, _BUILT[:] = list(_BUILT), []
    bad, parsed = [], {}
    for g in graphs:
        if len(g.nodes) > ROUND_TRIP_NODES:
            continue
        defined = [o for n in g.nodes for o in n.outputs] + g.inputs + g.params + g.state
        if len(defined) != len(set(defined)):
            continue
        text = print_graph(g)
        if text in parsed:  # the suite builds the same pipelines many times: each text is checked once
            continue
        parsed[text] = True
        if parse_graph(text) != g:
            bad.append(g.name)
    assert not bad, f"graphs whose text form does not round-trip: {bad[:10]}"


@pytest.fixture(scope="session", autouse=True)
def nvcc_reports_kept():
    """tilelang_gemm.nvcc_report (nvcc -Xptxas -v: registers, spills) is a function of the source,
    the arch and the toolchain, and the build tests ask it for the same sources run after run:
    each report is kept in the compile cache's folder under a hash of those, so a rerun builds only
    sources it has not built before. (The tests import nvcc_report where they use it, after this
    has wrapped it.)"""
    import hashlib
    import json

    from deepinfer.atomic import replace_file
    from deepinfer.codegen.build import cache_root, toolchain_versions
    from deepinfer.codegen.library import tilelang_gemm as tlg

    build = tlg.nvcc_report
    tools = toolchain_versions("cuda")

    def kept(src: str, arch: str, timeout: int = 600) -> dict:
        key = hashlib.sha256(json.dumps([src, arch, tools], sort_keys=True).encode()).hexdigest()
        path = cache_root() / "nvcc_reports" / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            rep = build(src, arch, timeout)
            replace_file(path, json.dumps(rep).encode())
            return rep

    tlg.nvcc_report = kept
    yield
    tlg.nvcc_report = build


@pytest.fixture(scope="session")
def tiny_plan_and_weights(tmp_path_factory):
    """(plan directory, checkpoint) of the tiny model: a cpu plan for 512 tokens and 4 sequences,
    compiled once per session for every test file that runs a plan."""
    from deepinfer.models.checkpoint import make_checkpoint
    from deepinfer.passes.driver import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("tiny_plan")
    ckpt = make_checkpoint("v4.1-flash-tiny", root / "ckpt", seed=1)
    plan = compile_model("v4.1-flash-tiny", CompileOptions("cpu", max_model_len=512, max_num_seqs=4), root / "plan")
    return plan.plan_dir, ckpt


@pytest.fixture(scope="session")
def tok_with_system(tmp_path_factory):
    """The bundled vocabulary with one unused placeholder respelled as <｜System｜> (the bundled V4
    vocabulary lacks it; V4.1's tokenizer.json has it)."""
    import json

    from deepinfer.models import tokenizer as tokenizer_module

    data = json.loads(tokenizer_module.BUNDLED_TOKENIZER_JSON.read_text(encoding="utf-8"))
    (entry,) = [a for a in data["added_tokens"] if a["id"] == 128798]
    assert entry["content"] == "<｜place▁holder▁no▁798｜>"
    entry["content"] = "<｜System｜>"
    entry["special"] = False
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return tokenizer_module.Tokenizer(path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's ops are too small to gain from intra-op threads, and on a shared 2-core
    machine two spinning torch threads per process made its steps ~10x slower (measured)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
