"""Golden before/after IR of every fusion rule and lowering, one rule or pass at a time.

Each case cuts from the tiny model's sm90 graph, at the pipeline stage where the rule runs, the
smallest graph the rule matches: the nodes its first match covers (or, for a whole-graph pass,
the nodes it rewrites), with every value they read from outside as a leaf of the same kind
(state stays state, so in-place writes keep their buffer). The cut graph and the rule's output
are compared as text with tests/golden/ir/<case>.before.ir / .after.ir; both sides run in the
interpreter on the same random inputs and must agree bit for bit. Every rule also has a case in
which it must not fire. Regenerate the goldens after an intended change with

    DEEPINFER_UPDATE_GOLDEN=1 pytest tests/test_golden_ir.py

and read the diff: the after text must show the fused or lowered op with the right inputs and
attributes."""
from __future__ import annotations

import dataclasses
import os
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import pytest
import torch

from deepinfer.ir import interpret
from deepinfer.ir import shapes as sh
from deepinfer.ir.graph import Graph
from deepinfer.ir.quant import QTensor
from deepinfer.ir.text import parse_graph, print_graph
from deepinfer.ir.types import QuantType
from deepinfer.ir.verify import VerifyError
from deepinfer.models.config import load_config
from deepinfer.models.deepseek_v41 import build_model
from deepinfer.passes import fuse as fz
from deepinfer.passes.attention import lower_sparse_attention
from deepinfer.passes.moe import lower_moe_dispatch
from deepinfer.passes.pipelines import pipeline
from deepinfer.codegen.targets import get_manifest
from deepinfer.passes.quant import legalize_quant, row_weight_scales
from deepinfer.passes.rewrite import Context, apply_rules
from deepinfer.runtime.batch import SeqChunk, step_inputs

GOLDEN = Path(__file__).parent / "golden" / "ir"
UPDATE = os.environ.get("DEEPINFER_UPDATE_GOLDEN") == "1"


# ---- graphs at a pipeline stage, and cutting a matched region out of them -----------------------

@lru_cache(maxsize=None)
def _tiny(vision: bool = False):
    """The tiny model; `vision`: with a vision tower, whose image tokens route with bias_vl."""
    if vision:
        return build_model(dataclasses.replace(load_config("v4.1-flash-tiny"), vision=True))
    return build_model("v4.1-flash-tiny")


@lru_cache(maxsize=None)
def _stage(before: str, variant: str = "prefill", target: str = "sm90", vision: bool = False) -> Graph:
    """The tiny model's step graph after every pass of the target's pipeline that precedes `before`."""
    g = _tiny(vision).step
    for name, fn in pipeline(target, variant=variant):
        if name == before:
            return g
        g = fn(g)
    raise AssertionError(f"no pass {before!r} in the {target} {variant} pipeline")


def cut(g: Graph, idxs, name: str) -> Graph:
    """Nodes `idxs` of `g` as a graph of their own: values read from outside become leaves of
    their kind (intermediates become inputs); values used outside or returned become outputs."""
    idxs = sorted(set(idxs))
    made = {o for i in idxs for o in g.nodes[i].outputs}
    sub = Graph(name)
    for i in idxs:
        for v in g.nodes[i].inputs:
            if v in made or v in sub.types:
                continue
            kind = sub.add_state if v in g.state else sub.add_param if v in g.params else sub.add_input
            kind(v, g.types[v])
    users, outs = g.users(), set(g.outputs)
    for i in idxs:
        n = g.nodes[i]
        sub.nodes.append(n)
        for o in n.outputs:
            sub.types[o] = g.types[o]
            if o in outs or any(u not in idxs for u in users.get(o, [])):
                sub.outputs.append(o)
    return sub


def first_match(g: Graph, rule, covering: str | None = None) -> list[int]:
    """Nodes of the rule's first match (the first that covers a `covering` node, if given)."""
    ctx = Context(g)
    for i in range(len(g.nodes)):
        m = rule(ctx, i)
        if m is not None and (covering is None or any(g.nodes[k].op == covering for k in m.remove)):
            return m.remove
    raise AssertionError(f"{rule.__name__} matches nothing in the tiny model")


def inner_values(sub: Graph) -> list[str]:
    """Values made and used only inside the cut: what a fusion makes vanish."""
    return [o for n in sub.nodes for o in n.outputs if o not in sub.outputs]


# ---- random inputs ------------------------------------------------------------------------------

STEP = [SeqChunk(0, 0, list(range(3, 40)), [0]), SeqChunk(1, 0, list(range(5, 16)), [1])]
DECODE = [SeqChunk(0, 37, [7], [0]), SeqChunk(1, 11, [9, 4, 2], [1])]  # within decode_rows_max
SHORT = [SeqChunk(0, 0, list(range(3, 9)), [0]), SeqChunk(1, 0, [5, 6], [1])]  # for the slow MoE reference
IMAGE = _tiny(True).cfg.image_token_id
VISION = [SeqChunk(0, 0, [3, IMAGE, IMAGE, IMAGE, 7, 8], [0]), SeqChunk(1, 0, [IMAGE, 6], [1])]  # image rows too
POOL = {"num_slots": 2, "num_pages": 4}


def _random(t, env, gen, name):
    if isinstance(t, QuantType):
        return QTensor(_random(t.data, env, gen, name), _random(t.scale, env, gen, name + ".scale"))
    shape = sh.evaluate(t.storage_shape(), env)
    d = t.dtype.name
    if d == "fp8e4m3":
        return torch.randn(shape, generator=gen).to(torch.float8_e4m3fn)
    if d == "e8m0":  # scales 2^-4 .. 2^3
        return torch.randint(123, 131, shape, generator=gen, dtype=torch.uint8)
    if d == "fp4e2m1":  # two random codes per byte
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if t.dtype.storage.is_floating_point:
        return torch.randn(shape, generator=gen).to(t.dtype.storage)
    raise AssertionError(f"%{name}: no random rule for an index value of type {t}; give the case one")


def random_leaves(sub: Graph, chunks, seed: int, special: dict | None = None):
    """(inputs, params, state) for `sub`: step inputs laid out from `chunks`, the rest random
    (`special` makes index values that must be valid, e.g. distinct expert ids per row)."""
    step = step_inputs(chunks)
    env = dict(POOL)
    full = _tiny().step
    for k, v in step.items():
        sh.bind(full.types[k].storage_shape(), tuple(v.shape), env, k)
    gen = torch.Generator().manual_seed(seed)
    special = special or {}
    vals = {}
    for v in (*sub.inputs, *sub.params, *sub.state):
        if v in step:
            vals[v] = step[v]
        elif v in special:
            vals[v] = special[v](sub.types[v], env, gen)
        else:
            vals[v] = _random(sub.types[v], env, gen, v)
    return ({v: vals[v] for v in sub.inputs}, {v: vals[v] for v in sub.params}, {v: vals[v] for v in sub.state})


def _same(a, b) -> bool:
    if isinstance(a, QTensor):
        return isinstance(b, QTensor) and _same(a.data, b.data) and _same(a.scale, b.scale)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.itemsize == 1:  # fp8 has no torch.equal; compare its bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


# ---- cases --------------------------------------------------------------------------------------

def expert_ids(t, env, gen):
    """Distinct expert ids per row, as the router makes them."""
    rows, k = sh.evaluate(t.shape, env)
    n_exp = _tiny().cfg.n_routed_experts
    return torch.rand(rows, n_exp, generator=gen).argsort(dim=1)[:, :k].to(t.dtype.storage)


@dataclass
class Case:
    name: str
    stage: str  # the pass the case's rule belongs to (the cut is taken just before it)
    select: Callable[[Graph], list[int]]  # node indices of the cut
    apply: Callable[[Graph], Graph]
    variant: str = "prefill"
    target: str = "sm90"  # cpu where the rule joins only the cpu pipeline today
    chunks: tuple = tuple(STEP)
    vision: bool = False  # cut from the tiny model with a vision tower
    prep: Callable[[Graph], Graph] | None = None  # earlier rules of the stage the case's rule builds on

    def before(self) -> Graph:
        g = _stage(self.stage, self.variant, self.target, self.vision)
        if self.prep is not None:
            g = self.prep(g)
        return cut(g, self.select(g), self.name)


def _rule_case(rule, covering: str | None = None, **kw) -> Case:
    name = rule.__name__ + (f".{covering}" if covering else "")
    return Case(name, "fuse", lambda g: first_match(g, rule, covering), lambda g: apply_rules(g, [rule]), **kw)


def _first(op):
    return lambda g: [next(i for i, n in enumerate(g.nodes) if n.op == op)]


def _with_act_producer(op):
    def select(g):
        (i,) = _first(op)(g)
        return [g.producers()[g.nodes[i].inputs[0]], i]
    return select


def _indexer_and_its_attention(g):
    (i,) = _first("indexer_topk")(g)
    top = g.nodes[i].outputs[0]
    return [i] + [k for k, n in enumerate(g.nodes) if n.op == "sparse_attn" and n.inputs[4] == top]


CASES = [
    _rule_case(fz.fuse_hc_pre),
    _rule_case(fz.fuse_hc_mix),  # layer 0's attention entry: no collapse for hc_pre
    _rule_case(fz.fuse_norm_quant),
    _rule_case(fz.fuse_rope_quant),
    _rule_case(fz.fuse_swiglu_quant),
    _rule_case(fz.fuse_router),
    # on the router fuse_router made, the per-row bias of route_bias (bias_vl for image tokens)
    Case("fuse_router_image_bias", "fuse", lambda g: first_match(g, fz.fuse_router_image_bias),
         lambda g: apply_rules(g, [fz.fuse_router_image_bias]), chunks=tuple(VISION), vision=True,
         prep=lambda g: apply_rules(g, [fz.fuse_router])),
    _rule_case(fz.fuse_compress_pool_norm),
    _rule_case(fz.fuse_indexer),
    _rule_case(fz.fuse_indexer, "candidate_blocks"),  # the candidate source also emits the pool
    _rule_case(fz.fuse_indexer, "candidate_mask"),  # a layer scoring only the source's candidates
    _rule_case(fz.fuse_indexer_weight_scale, prep=lambda g: apply_rules(g, [fz.fuse_indexer])),
    _rule_case(fz.fold_cast_into_linear),  # the compressor's f32 copy of its input, read by wkv and wgate
    _rule_case(fz.fuse_attention_rope_node),  # off in the manifests until timed: variant_plan's +fuse_attention_rope
    _rule_case(fz.fuse_attention_rope_node, "sparse_attn"),
    Case("fuse_decode_cache_write", "fuse_decode", lambda g: first_match(g, fz.fuse_decode_cache_write),
         fz.fuse_decode, variant="decode", target="cpu", chunks=tuple(DECODE)),
    Case("fuse_decode_norm_node", "fuse_decode_norm", lambda g: first_match(g, fz.fuse_decode_norm_node),
         fz.fuse_decode_norm, variant="decode", target="cpu", chunks=tuple(DECODE)),
    Case("fuse_decode_router_linear_node", "fuse_decode_router_linear",
         lambda g: first_match(g, fz.fuse_decode_router_linear_node), fz.fuse_decode_router_linear,
         variant="decode", target="cpu", chunks=tuple(DECODE)),
    Case("fuse_decode_linear_quant_node", "fuse_decode_linear_quant",
         lambda g: first_match(g, fz.fuse_decode_linear_quant_node), fz.fuse_decode_linear_quant, variant="decode",
         target="cpu", chunks=tuple(DECODE)),
    Case("legalize_quant", "legalize_quant",
         lambda g: _with_act_producer("gemm_fp8")(g) + _with_act_producer("moe_experts")(g),
         lambda g: legalize_quant(g, get_manifest("sm90").operand_formats), chunks=tuple(SHORT)),
    Case("lower_sparse_attention", "lower_sparse_attention", _indexer_and_its_attention, lower_sparse_attention),
    Case("lower_moe_dispatch", "lower_moe_dispatch", _first("moe_experts"), lower_moe_dispatch,
         chunks=tuple(SHORT)),
    Case("row_weight_scales", "infer_shapes_final", _first("gemm_fp8"), row_weight_scales),
    Case("fuse_moe_shared_add", "fuse_moe_shared", lambda g: first_match(g, fz.fuse_moe_shared_add),
         fz.fuse_moe_shared, chunks=tuple(SHORT)),
    Case("fuse_combine_expand_node", "fuse_combine_expand", lambda g: first_match(g, fz.fuse_combine_expand_node),
         fz.fuse_combine_expand, chunks=tuple(SHORT)),
]
BY_NAME = {c.name: c for c in CASES}


def candidate_ids(score_type, block_size):
    """Ascending distinct candidate blocks per row, -1 padded, as candidate_blocks makes them."""
    def make(t, env, gen):
        rows, k = sh.evaluate(t.shape, env)
        blocks = -(-sh.evaluate(score_type.shape, env)[1] // block_size)
        ids = torch.rand(rows, blocks, generator=gen).argsort(dim=1)[:, :k].sort(dim=1).values
        ids[:, k - 1] = -1  # the padding of a short pool
        return ids.to(t.dtype.storage)
    return make


def routed_pairs(k: int):
    """(pairs, offsets) makers giving moe_permute's outputs of one seeded expert selection, so a
    cut that reads both from outside gets a consistent pair (the pairs are made first: they come
    first among the combine's inputs, and give the row count)."""
    from deepinfer.ir.ops.fused import moe_permute

    n_exp, rows = _tiny().cfg.n_routed_experts, []

    def permuted(part):
        sel = torch.rand(rows[0], n_exp, generator=torch.Generator().manual_seed(rows[0])).argsort(dim=1)[:, :k]
        return moe_permute(sel.to(torch.int32), n_experts=n_exp)[part]

    def pairs(t, env, gen):
        rows[:] = [sh.evaluate(t.shape, env)[0] // k]
        return permuted(0).to(t.dtype.storage)

    def offsets(t, env, gen):
        return permuted(1).to(t.dtype.storage)
    return pairs, offsets


def _valid_index_inputs(sub: Graph) -> dict:
    """Leaf index values that random numbers would make invalid: the experts each row selects,
    the candidate pool a masked indexer scores in."""
    out = {}
    for n in sub.nodes:
        if n.op == "moe_experts" and n.inputs[1] in sub.inputs:
            out[n.inputs[1]] = expert_ids
        if n.op in ("moe_combine", "moe_combine_shared") and n.inputs[1] in sub.inputs:
            out[n.inputs[1]], out[n.inputs[2]] = routed_pairs(n.attr["k"])
            out[n.inputs[3]] = expert_ids  # the combine reads only its row count
        if n.op == "candidate_mask" and n.inputs[1] in sub.inputs:
            out[n.inputs[1]] = candidate_ids(sub.types[n.inputs[0]], n.attr["block_size"])
        if n.op == "sparse_attn" and n.inputs[4] in sub.inputs:
            out[n.inputs[4]] = topk_ids(sub.types[n.inputs[3]], sub.types[n.inputs[9]])
    return out


def topk_ids(cache_type, table_type):
    """A top-k list per row as lower_sparse_attention's attention reads it: entries the block
    table reaches, -1 padded."""
    def make(t, env, gen):
        rows, k = sh.evaluate(t.shape, env)
        reach = sh.evaluate(table_type.shape, env)[1] * sh.evaluate(cache_type.shape, env)[1]
        ids = torch.randint(0, reach, (rows, k), generator=gen).sort(dim=1).values
        ids[:, k - 1] = -1
        return ids.to(t.dtype.storage)
    return make


def _golden(path: Path, text: str):
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path.name} is missing: DEEPINFER_UPDATE_GOLDEN=1 pytest {Path(__file__).name}"
    assert text == path.read_text(), (f"{path.name} differs from the compiler's output; if the change is "
                                      f"intended, regenerate with DEEPINFER_UPDATE_GOLDEN=1 and read the diff")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_golden_before_and_after(case):
    before = case.before()
    after = case.apply(before)
    _golden(GOLDEN / f"{case.name}.before.ir", print_graph(before))
    _golden(GOLDEN / f"{case.name}.after.ir", print_graph(after))
    assert parse_graph(print_graph(after)) == after
    assert print_graph(after) != print_graph(before), f"{case.name} did not fire on its own match"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rule_keeps_the_interpreter_output(case):
    before = case.before()
    after = case.apply(before)
    inputs, params, state = random_leaves(before, list(case.chunks), seed=zlib.crc32(case.name.encode()),
                                          special=_valid_index_inputs(before))
    want, want_state, _ = interpret(before, inputs, params, state)
    got, got_state, _ = interpret(after, inputs, params, state)
    assert set(got) == set(want) and all(_same(want[k], got[k]) for k in want), f"{case.name} changed an output"
    assert all(_same(want_state[k], got_state[k]) for k in want_state), f"{case.name} changed the state it writes"


# ---- where the rules must not fire --------------------------------------------------------------

FUSIONS = [c for c in CASES if c.stage in ("fuse", "fuse_moe_shared", "fuse_decode_norm", "fuse_decode_linear_quant",
                                            "fuse_decode_router_linear", "fuse_combine_expand")]


@pytest.mark.parametrize("case", FUSIONS, ids=lambda c: c.name)
def test_fusion_keeps_a_value_with_another_consumer(case):
    """An inner value of the pattern that is also returned (a second consumer) must survive: the
    rule leaves the chain alone rather than drop the value."""
    before = case.before()
    inner = inner_values(before)
    assert inner, f"{case.name}: the cut has no inner value"
    for v in inner:
        g = before.copy()
        g.outputs = [*g.outputs, v]
        assert print_graph(case.apply(g)) == print_graph(g), f"{case.name} fused away %{v}, which is returned"


def _edit(g: Graph, op: str, **attrs) -> Graph:
    from deepinfer.ir.graph import Node

    return g.replace_nodes([Node.make(n.op, n.inputs, n.outputs, n.attr | attrs) if n.op == op else n for n in g.nodes])


def test_rope_quant_leaves_the_inverse_rope():
    before = BY_NAME["fuse_rope_quant"].before()
    g = _edit(before, "rope", inverse=True)
    assert print_graph(apply_rules(g, [fz.fuse_rope_quant])) == print_graph(g)


def test_hc_pre_needs_one_eps_for_the_mix_and_the_norm():
    """hc_pre has one `eps` for its mix GEMM and its RMSNorm: a norm with another eps is not the
    fused op's composition."""
    before = BY_NAME["fuse_hc_pre"].before()
    g = _edit(before, "rms_norm", eps=1e-6)
    assert print_graph(apply_rules(g, [fz.fuse_hc_pre])) == print_graph(g)


def test_hc_mix_leaves_the_entries_hc_pre_fuses():
    """A sub-layer entry with a collapse of its stream is hc_pre's, wherever the sweep meets it first."""
    before = BY_NAME["fuse_hc_pre"].before()
    assert print_graph(apply_rules(before, [fz.fuse_hc_mix])) == print_graph(before)
    assert [n.op for n in fz.fuse(before).nodes] == ["hc_pre"]


def test_cast_stays_where_another_op_reads_the_f32_copy():
    """The f32 copy also read by an op that is no fp32-compute linear must be made: nothing folds."""
    from deepinfer.ir.graph import Node

    before = BY_NAME["fold_cast_into_linear"].before()
    cast = next(n for n in before.nodes if n.op == "cast")
    g = before.copy()
    g.nodes.append(Node.make("scale", [cast.outputs[0]], ["extra"], {"factor": 2.0}))
    g.types["extra"] = g.types[cast.outputs[0]]
    g.outputs = [*g.outputs, "extra"]
    assert print_graph(apply_rules(g, [fz.fold_cast_into_linear])) == print_graph(g)
    bf16 = _edit(before, "linear", compute="bf16")
    assert print_graph(apply_rules(bf16, [fz.fold_cast_into_linear])) == print_graph(bf16)


def test_decode_cache_write_needs_the_fused_rope_quant():
    """Before fusion the window key comes from a plain quant_fp8: nothing to move before the attention."""
    g = _stage("fuse", "decode", "cpu")
    prod, users = g.producers(), g.users()
    (w,) = [i for i, n in enumerate(g.nodes) if n.op == "swa_write"][:1]
    ring, kq = g.nodes[w].inputs[:2]
    q = prod[kq]
    sub = cut(g, [prod[g.nodes[q].inputs[0]], q, w, *users[ring]], "fuse_decode_cache_write_unfused")
    assert g.nodes[q].op == "quant_fp8" and print_graph(fz.fuse_decode(sub)) == print_graph(sub)


def test_legalize_quant_refuses_an_unquantised_activation():
    g = _stage("legalize_quant")
    sub = cut(g, _first("gemm_fp8")(g), "gemm_alone")
    with pytest.raises(VerifyError, match="comes from a leaf, not a 32-element activation quantisation"):
        legalize_quant(sub, get_manifest("sm90").operand_formats)


def test_sparse_attention_refuses_a_topk_list_not_from_an_indexer():
    g = _stage("lower_sparse_attention")
    sub = cut(g, _first("sparse_attn")(g), "attention_alone")
    with pytest.raises(VerifyError, match="its top-k list does not come from an indexer"):
        lower_sparse_attention(sub)


@pytest.mark.parametrize("name", ["lower_sparse_attention", "lower_moe_dispatch", "row_weight_scales"])
def test_lowering_is_a_fixed_point(name):
    """Run again on its own output, a lowering finds nothing left to lower."""
    after = BY_NAME[name].apply(BY_NAME[name].before())
    assert print_graph(BY_NAME[name].apply(after)) == print_graph(after)


def test_moe_dispatch_refuses_ep_below_one():
    with pytest.raises(ValueError, match="a layout needs ep >= 1, .* got ep=0 dp=1"):
        lower_moe_dispatch(BY_NAME["lower_moe_dispatch"].before(), ep=0)
