import pytest
import torch

from deepinfer.ir import (Graph, InterpretError, Node, ParseError, VerifyError, interpret, parse_graph,
                          print_graph, shapes as sh, tensor, verify)
from deepinfer.ir.ops import core  # noqa: F401
from deepinfer.ir.registry import op

from ir_graphs import norm_matmul_softmax


# An in-place cache write, as the model's cache ops are: output 0 aliases input 0.
def _write_rule(ins, a):
    return [ins[0]]


@op("test_cache_write", infer=_write_rule, inplace={0: 0}, n_inputs=2)
def _test_cache_write(cache, rows):
    out = cache.clone()
    out[: rows.shape[0]] = rows
    return out


def _cache_graph(writes=1, stale_read=False) -> Graph:
    g = Graph("cache_graph")
    x = g.add_input("x", tensor("f32", 4, 8))
    c = g.add_state("cache", tensor("f32", 16, 8))
    v = c
    for _ in range(writes):
        v = g.add1("test_cache_write", v, x)
    outs = [v]
    if stale_read:
        outs.append(g.add1("add", c, c))
    g.set_outputs(*outs)
    return g


# ---- structure ----------------------------------------------------------------------------------

def test_structural_equality_and_hash():
    a, b = norm_matmul_softmax(), norm_matmul_softmax()
    assert a == b and hash(a) == hash(b)
    c = norm_matmul_softmax(out=32)
    assert a != c


def test_networkx_view_topo_order_and_liveness():
    g = norm_matmul_softmax()
    nxg = g.to_networkx()
    assert set(nxg.predecessors(1)) == {0, "proj.weight"}
    assert g.topo_order() == [0, 1, 2]
    live = g.liveness()
    assert live["h"] == (0, 1) and live["logits"] == (1, 2) and live["probs"] == (2, 3)
    assert g.match_chains(["rms_norm", "linear", "softmax"]) == [(0, 1, 2)]
    assert g.match_chains(["linear", "rms_norm"]) == []


def test_state_updates_follow_inplace_aliases():
    g = _cache_graph()
    verify(g)
    assert g.state_writes() == {"cache": [0]}
    assert g.state_updates() == {"cache": g.nodes[0].outputs[0]}


# ---- verifier: each class of error --------------------------------------------------------------

def test_verifier_accepts_good_graph():
    assert verify(norm_matmul_softmax()) is not None


def test_verifier_use_before_definition():
    g = norm_matmul_softmax()
    g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]
    with pytest.raises(VerifyError, match=r"node %logits = linear\(...\): input %h is used before"):
        verify(g)


def test_verifier_undefined_value():
    g = norm_matmul_softmax()
    g.nodes[2] = Node.make("softmax", ["nowhere"], ["probs"], {"axis": -1})
    with pytest.raises(VerifyError, match="%nowhere is used before it is defined"):
        verify(g)


def test_verifier_cycle():
    g = Graph("cyclic")
    x = g.add_input("x", tensor("f32", 4))
    g.types["a"] = g.types["b"] = tensor("f32", 4)
    g.nodes = [Node.make("add", [x, "b"], ["a"]), Node.make("add", [x, "a"], ["b"])]
    g.set_outputs("b")
    with pytest.raises(VerifyError, match="dataflow cycle"):
        verify(g)


def test_verifier_shape_mismatch_names_node():
    g = norm_matmul_softmax()
    g.types["logits"] = tensor("f32", sh.num_tokens, 47)
    with pytest.raises(VerifyError, match=r"%logits = linear.*typed f32\[num_tokens,47\] but linear gives"):
        verify(g)


def test_verifier_dtype_mismatch():
    g = norm_matmul_softmax()
    g.types["h"] = tensor("f32", sh.num_tokens, 64)
    with pytest.raises(VerifyError, match=r"%h = rms_norm.*typed f32"):
        verify(g)


def test_verifier_op_rule_rejects_inputs():
    g = norm_matmul_softmax()
    g.types["proj.weight"] = tensor("bf16", 48, 32)
    with pytest.raises(VerifyError, match=r"%logits = linear.*input features"):
        verify(g)


def test_verifier_unknown_op_and_bad_attrs():
    g = norm_matmul_softmax()
    g.nodes[2] = Node.make("softmaxx", ["logits"], ["probs"])
    with pytest.raises(VerifyError, match="unknown op 'softmaxx'"):
        verify(g)
    g = norm_matmul_softmax()
    g.nodes[0] = Node.make("rms_norm", ["x", "norm.weight"], ["h"], {})
    with pytest.raises(VerifyError, match="missing attribute 'eps'"):
        verify(g)
    g.nodes[0] = Node.make("rms_norm", ["x", "norm.weight"], ["h"], {"eps": 1e-6, "bogus": 1})
    with pytest.raises(VerifyError, match="unknown attribute"):
        verify(g)


def test_verifier_double_definition():
    g = norm_matmul_softmax()
    g.nodes.append(Node.make("softmax", ["logits"], ["probs"], {"axis": -1}))
    with pytest.raises(VerifyError, match="%probs is defined twice"):
        verify(g)


def test_verifier_undefined_output():
    g = norm_matmul_softmax()
    g.set_outputs("ghost")
    with pytest.raises(VerifyError, match="output %ghost is not defined"):
        verify(g)


def test_verifier_state_written_twice():
    with pytest.raises(VerifyError, match="state %cache is written a second time"):
        verify(_cache_graph(writes=2))


def test_verifier_stale_state_read_after_inplace_write():
    with pytest.raises(VerifyError, match=r"reads %cache after .* overwrote state %cache"):
        verify(_cache_graph(stale_read=True))


# ---- text form ----------------------------------------------------------------------------------

def test_print_parse_round_trip():
    g = norm_matmul_softmax()
    text = print_graph(g)
    assert "%h = rms_norm(%x, %norm.weight) {eps=1e-06} : bf16[num_tokens,64]" in text
    assert parse_graph(text) == g


def test_round_trip_with_quantised_types_lists_and_strings():
    from deepinfer.ir.types import quantized
    g = Graph("quant")
    x = g.add_input("x", tensor("bf16", 2 * sh.num_tokens + 1, 64))
    g.add_param("w", quantized("fp8e4m3", (96, 64), "e8m0", (32, 32)))
    z = g.add_input("z", tensor("f32", 4, 8))
    g.add1("reshape", z, shape=[2, 16])
    r = g.add1("clamp", x, min=-10.0, max=None)
    g.add1("cast", r, dtype="f32")
    g.set_outputs(r)
    text = print_graph(g)
    assert "fp8e4m3[96,64]{e8m0[3,2],32x32}" in text and "{shape=[2,16]}" in text
    assert "{max=null, min=-10.0}" in text and '{dtype="f32"}' in text
    assert parse_graph(text) == g


@pytest.mark.parametrize("text, where", [
    ("grph x\nend\n", "line 1, column 1"),
    ("graph g\n  input %x : bf17[4]\nend\n", "line 2, column 14"),
    ("graph g\n  input %x : f32[4\nend\n", "line 2, column 14"),
    ("graph g\n  input %x : f32[4]\n  %y = add(%x, %x) {a=} : f32[4]\nend\n", "line 3, column 23"),
    ("graph g\n  input %x : f32[4]\n  %y = add(%x %x) : f32[4]\nend\n", "line 3, column 15"),
    ("graph g\n  input %x : f32[4]\n", "line 3, column 1"),
    ("graph g\n  input %x : f32[4]\n  input %x : f32[4]\nend\n", "line 3, column 8"),
    ("graph g\n  input %x : f32[4], f32[4]\nend\n", "line 2, column 8: one type"),
    # a type list parsed before (the parser keeps them by text) is still checked against the outputs
    ("graph g\n  input %x : f32[4]\n  %y = add(%x, %x) : f32[4], f32[4]\nend\n", "line 3, column 3.*1 outputs"),
])
def test_parse_errors_name_line_and_column(text, where):
    with pytest.raises(ParseError, match=where):
        parse_graph(text)


# ---- interpreter --------------------------------------------------------------------------------

def test_interpreter_matches_torch_on_norm_matmul_softmax():
    g = verify(norm_matmul_softmax())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    gamma = (1 + 0.1 * torch.randn(64, generator=gen)).bfloat16()
    w = (0.1 * torch.randn(48, 64, generator=gen)).bfloat16()
    outs, _, env = interpret(g, {"x": x}, {"norm.weight": gamma, "proj.weight": w})
    assert env == {"num_tokens": 5}
    h = torch.nn.functional.rms_norm(x.float(), (64,), gamma.float(), eps=1e-6).bfloat16()
    want = torch.softmax(h.float() @ w.float().t(), dim=-1)
    torch.testing.assert_close(outs["probs"], want, rtol=1e-6, atol=1e-7)


def test_interpreter_updates_state_and_checks_shapes():
    g = verify(_cache_graph())
    cache = torch.zeros(16, 8)
    x = torch.ones(4, 8)
    outs, new_state, _ = interpret(g, {"x": x}, {}, {"cache": cache})
    assert new_state["cache"][:4].eq(1).all() and new_state["cache"][4:].eq(0).all()
    assert cache.eq(0).all()  # the caller's buffer is not touched by the reference semantics
    with pytest.raises(InterpretError, match=r"%x: expected \[4,8\]"):
        interpret(g, {"x": torch.ones(3, 8)}, {}, {"cache": cache})
    with pytest.raises(InterpretError, match="missing state"):
        interpret(g, {"x": x}, {})


def test_the_real_model_graphs_round_trip_before_and_after_the_sm90_pipeline():
    """The real V4.1-Flash widths (the session-wide check in conftest.py skips graphs this large)."""
    from deepinfer.models.config import load_config
    from deepinfer.models.deepseek_v41 import build_model
    from deepinfer.passes.pipelines import pipeline

    prog = build_model(load_config("v4.1-flash"))
    for g in (prog.step, prog.draft):
        assert parse_graph(print_graph(g)) == g
        for _, fn in pipeline("sm90")[:-1]:
            g = fn(g)
        assert parse_graph(print_graph(g)) == g


def _order_edges_by_scan(g):
    """The read-before-overwrite edges as a scan over every value for each buffer computes them
    (what Graph.stale_reads' one pass must agree with)."""
    prod, edges = g.producers(), []
    for root, writers in g.state_writes().items():
        w = writers[0]
        old = {v for v in g.types if g.state_root(v, prod) == root and (v not in prod or prod[v] < w)}
        edges += [(i, w) for i, n in enumerate(g.nodes) if i != w and old.intersection(n.inputs)]
    return edges


def test_state_roots_order_edges_and_topo_order_on_the_model_graphs():
    """On the tiny model's sm90 graphs (every cache written in place, some through chains of
    in-place ops): state_roots gives each value's state_root, the order edges are the per-buffer
    scan's, and topo_order of a reversed node list is a dataflow order that keeps every state read
    before its buffer's overwrite (the verifier passes) and, for an ordered graph, the order itself."""
    import random

    from deepinfer.passes.driver import CompileOptions, _pipeline_graphs

    _, prog, graphs, _ = _pipeline_graphs("v4.1-flash-tiny", CompileOptions("sm90"))
    assert len(graphs["step"].state_order_edges()) > 10 and graphs["step_decode"].state_order_edges()
    for g in (*graphs.values(), prog.step):
        prod, roots = g.producers(), g.state_roots()
        assert roots and all(roots.get(v) == g.state_root(v, prod) for v in g.types)
        assert g.state_order_edges() == _order_edges_by_scan(g)
        assert g.topo_order() == list(range(len(g.nodes)))
        shuffled = g.replace_nodes(list(reversed(g.nodes)))
        verify(shuffled.reordered())
        nodes = list(g.nodes)
        random.Random(0).shuffle(nodes)
        verify(g.replace_nodes(nodes).reordered())


def test_topo_order_of_a_cycle_is_one_line():
    g = Graph("cyclic")
    x = g.add_input("x", tensor("f32", 4))
    g.types["a"] = g.types["b"] = tensor("f32", 4)
    g.nodes = [Node.make("add", [x, "b"], ["a"]), Node.make("add", [x, "a"], ["b"])]
    with pytest.raises(ValueError, match="no order exists"):
        g.topo_order()
