"""Fusion as a rule list. Each rule matches a chain of primitive ops whose inner values have no
other use and replaces it with the fused op defined as exactly that composition (ir/ops/fused.py),
so the interpreter's output is unchanged bit for bit."""
from __future__ import annotations

import os

from ..ir.graph import Graph, Node
from ..ir.types import TensorType
from .rewrite import Context, Rewrite, apply_rules


def _chain_end(ctx: Context, i: int, root_op: str, inner_op: str):
    """(inner index, inner node) when node i is `root_op` fed by an `inner_op` used only there."""
    n = ctx.g.nodes[i]
    if n.op != root_op:
        return None, None
    j, inner = ctx.producer_op(n.inputs[0], inner_op)
    if inner is None or not ctx.sole_user(n.inputs[0], i):
        return None, None
    return j, inner


def fuse_norm_quant(ctx: Context, i: int):
    """RMSNorm + activation quantisation: the normalised value never goes to memory in bf16."""
    j, norm = _chain_end(ctx, i, "quant_fp8", "rms_norm")
    if norm is None:
        return None
    q = ctx.g.nodes[i]
    return Rewrite([j, i], [Node.make("rms_norm_quant_fp8", norm.inputs, q.outputs,
                                      {"eps": norm.attr["eps"], "block": q.attr.get("block", 32)})])


def fuse_rope_quant(ctx: Context, i: int):
    """RoPE + fp8 / fp4 quantisation of window keys, compressed KV and index q/k."""
    n = ctx.g.nodes[i]
    if n.op not in ("quant_fp8", "quant_fp4"):
        return None
    j, rope = _chain_end(ctx, i, n.op, "rope")
    if rope is None or rope.attr.get("inverse"):
        return None
    attrs = {k: v for k, v in rope.attrs if k != "inverse"}
    if n.op == "quant_fp8":
        return Rewrite([j, i], [Node.make("rope_quant_fp8", rope.inputs, n.outputs,
                                          attrs | {"block": n.attr.get("block", 32)})])
    return Rewrite([j, i], [Node.make("rope_quant_fp4", rope.inputs, n.outputs,
                                      attrs | {"block": n.attr["block"], "scale": n.attr["scale"]})])


def fuse_swiglu_quant(ctx: Context, i: int):
    """The shared expert's SwiGLU-with-limit + quantisation for the w2 GEMM."""
    j, sw = _chain_end(ctx, i, "quant_fp8", "swiglu")
    if sw is None:
        return None
    q = ctx.g.nodes[i]
    return Rewrite([j, i], [Node.make("swiglu_quant_fp8", sw.inputs, q.outputs,
                                      {"limit": sw.attr["limit"], "block": q.attr.get("block", 32)})])


def fuse_hc_pre(ctx: Context, i: int):
    """mHC entry of a sub-layer: mix GEMM + Sinkhorn on the stream, and RMSNorm of the stream
    collapsed with the previous pre, in one pass over the [n, 4, H] stream."""
    norm = ctx.g.nodes[i]
    if norm.op != "rms_norm":
        return None
    j, coll = ctx.producer_op(norm.inputs[0], "hc_collapse")
    if coll is None or not ctx.sole_user(norm.inputs[0], i):
        return None
    stream, pre_in = coll.inputs
    for k in ctx.users.get(stream, []):
        mix = ctx.g.nodes[k]
        if mix.op != "hc_mix_gemm":
            continue
        users = ctx.users.get(mix.outputs[0], [])
        if len(users) != 1 or ctx.g.nodes[users[0]].op != "hc_sinkhorn" or mix.outputs[0] in ctx.outputs:
            continue
        if mix.attr["eps"] != norm.attr["eps"]:  # hc_pre has one eps for its mix GEMM and its norm
            continue
        s = users[0]
        sk = ctx.g.nodes[s]
        fused = Node.make("hc_pre", [stream, mix.inputs[1], sk.inputs[1], sk.inputs[2], pre_in, norm.inputs[1]],
                          [norm.outputs[0], *sk.outputs],
                          {"eps": mix.attr["eps"], "copies": sk.attr["copies"], "iters": sk.attr["iters"],
                           "hc_eps": sk.attr["eps"], "post_mult": sk.attr.get("post_mult", 2.0)})
        return Rewrite([k, s, j, i], [fused])
    return None


def _claimed_by_hc_pre(ctx: Context, mix_index: int) -> bool:
    """Whether fuse_hc_pre takes this mix GEMM into the hc_pre of a collapse of its stream."""
    stream = ctx.g.nodes[mix_index].inputs[0]
    for c in ctx.users.get(stream, []):
        if ctx.g.nodes[c].op != "hc_collapse":
            continue
        for n in ctx.users.get(ctx.g.nodes[c].outputs[0], []):
            m = fuse_hc_pre(ctx, n)
            if m is not None and mix_index in m.remove:
                return True
    return False


def fuse_hc_mix(ctx: Context, i: int):
    """mHC mixes of a sub-layer entry that has no collapse to fuse (layer 0's attention: its
    input is the embedding, copy 0 of the repeated stream): mix GEMM + Sinkhorn in one pass.
    Entries that fuse_hc_pre covers are left to it, whichever node the sweep reaches first."""
    sk = ctx.g.nodes[i]
    if sk.op != "hc_sinkhorn":
        return None
    k, mix = ctx.producer_op(sk.inputs[0], "hc_mix_gemm")
    if mix is None or not ctx.sole_user(sk.inputs[0], i) or _claimed_by_hc_pre(ctx, k):
        return None
    fused = Node.make("hc_mix", [mix.inputs[0], mix.inputs[1], sk.inputs[1], sk.inputs[2]], sk.outputs,
                      {"eps": mix.attr["eps"], "copies": sk.attr["copies"], "iters": sk.attr["iters"],
                       "hc_eps": sk.attr["eps"], "post_mult": sk.attr.get("post_mult", 2.0)})
    return Rewrite([k, i], [fused])


def fold_cast_into_linear(ctx: Context, i: int):
    """A widening cast to f32 read only by fp32-compute linears (the compressor's wkv and wgate):
    the linear widens its input itself, to the same values (every bf16 / f16 value is an f32
    value), so the linears read the narrow input, declared f32 out, and the f32 copy is never
    made. Exact in the reference; a kernel then multiplies bf16-valued operands."""
    cast = ctx.g.nodes[i]
    if cast.op != "cast" or cast.attr["dtype"] != "f32":
        return None
    x, v = cast.inputs[0], cast.outputs[0]
    t = ctx.g.types.get(x)
    if not isinstance(t, TensorType) or t.dtype.name not in ("bf16", "f16") or v in ctx.outputs:
        return None
    users = sorted(set(ctx.users.get(v, [])))
    new = []
    for u in users:
        n = ctx.g.nodes[u]
        if n.op != "linear" or n.inputs[0] != v or n.inputs[1] == v or n.attr.get("compute", "f32") != "f32":
            return None
        new.append(Node.make("linear", [x, n.inputs[1]], n.outputs, n.attr | {"out_dtype": n.attr.get("out_dtype") or "f32"}))
    if not new:
        return None
    return Rewrite([i, *users], new)


def fuse_router(ctx: Context, i: int):
    """Router: sqrt-softplus + bias + top-k + renormalise + scale."""
    rw = ctx.g.nodes[i]
    if rw.op != "route_weights":
        return None
    s_val, sel_val = rw.inputs
    t, topk = ctx.producer_op(sel_val, "topk_ids")
    a, add = ctx.producer_op(topk.inputs[0], "add") if topk else (None, None)
    q, sqrt = ctx.producer_op(s_val, "sqrt")
    p, sp = ctx.producer_op(sqrt.inputs[0], "softplus") if sqrt else (None, None)
    if None in (topk, add, sqrt, sp) or add.inputs[0] != s_val:
        return None
    if sorted(ctx.users.get(s_val, [])) != sorted([a, i]) or s_val in ctx.outputs \
            or not ctx.sole_user(add.outputs[0], t) or not ctx.sole_user(sp.outputs[0], q):
        return None
    fused = Node.make("moe_router", [sp.inputs[0], add.inputs[1]], [sel_val, rw.outputs[0]],
                      {"k": topk.attr["k"], "scale": rw.attr["scale"], "renorm": rw.attr.get("renorm", True)})
    return Rewrite([p, q, a, t, i], [fused])


def fuse_router_image_bias(ctx: Context, i: int):
    """The router picks each row's bias by its token id (route_bias: bias_vl for image tokens),
    so the [n, E] per-row bias is never written out."""
    r = ctx.g.nodes[i]
    if r.op != "moe_router" or len(r.inputs) != 2:
        return None
    j, rb = ctx.producer_op(r.inputs[1], "route_bias")
    if rb is None or not ctx.sole_user(r.inputs[1], i):
        return None
    ids, bias, bias_vl = rb.inputs
    return Rewrite([j, i], [Node.make("moe_router", [r.inputs[0], bias, bias_vl, ids], r.outputs,
                                      r.attr | {"image_token_id": rb.attr["image_token_id"]})])


def fuse_compress_pool_norm(ctx: Context, i: int):
    """Compressor pooling + the compressor RMSNorm."""
    norm = ctx.g.nodes[i]
    if norm.op != "rms_norm":
        return None
    c, cast = ctx.producer_op(norm.inputs[0], "cast")
    if cast is None or cast.attr["dtype"] != "bf16" or not ctx.sole_user(norm.inputs[0], i):
        return None
    p, pool = ctx.producer_op(cast.inputs[0], "compress_pool")
    if pool is None or not ctx.sole_user(cast.inputs[0], c):
        return None
    return Rewrite([p, c, i], [Node.make("compress_pool_norm", [*pool.inputs, norm.inputs[1]], norm.outputs,
                                         {"ratio": pool.attr["ratio"], "eps": norm.attr["eps"]})])


def fuse_indexer(ctx: Context, i: int):
    """Indexer scoring + candidate masking + top-k (and the pool at the candidate source), so
    the [rows, entries] score matrix never goes to memory."""
    top = ctx.g.nodes[i]
    if top.op != "topk_select":
        return None
    score_val = top.inputs[0]
    remove, cand = [i], None
    m, mask = ctx.producer_op(score_val, "candidate_mask")
    if mask is not None:
        if not ctx.sole_user(score_val, i):
            return None
        remove.append(m)
        score_val, cand = mask.inputs
    s, scores = ctx.producer_op(score_val, "indexer_scores")
    if scores is None:
        return None
    users = ctx.users.get(score_val, [])
    attrs = {"ratio": top.attr["ratio"], "k": top.attr["k"]}
    outputs = list(top.outputs)
    if len(users) == 2 and mask is None and score_val not in ctx.outputs:
        b = next(u for u in users if u != i)
        blocks = ctx.g.nodes[b]
        if blocks.op != "candidate_blocks":
            return None
        remove.append(b)
        outputs.append(blocks.outputs[0])
        attrs |= {"emit_candidates": True, "block_size": blocks.attr["block_size"],
                  "topk_blocks": blocks.attr["topk_blocks"]}
    elif users != [remove[-1]] or score_val in ctx.outputs:
        return None
    if cand is not None:
        attrs["block_size"] = mask.attr["block_size"]
    remove.append(s)
    inputs = list(scores.inputs) + ([cand] if cand is not None else [])
    return Rewrite(remove, [Node.make("indexer_topk", inputs, outputs, attrs)])


def fuse_indexer_weight_scale(ctx: Context, i: int):
    """The head weights' constant factor (spec §4.4d) into the fused indexer, so its kernel reads
    the projection's output directly and no call runs for the scale alone."""
    n = ctx.g.nodes[i]
    if n.op != "indexer_topk" or n.attr.get("w_scale") is not None:
        return None
    s, sc = ctx.producer_op(n.inputs[1], "scale")
    if sc is None or not ctx.sole_user(n.inputs[1], i):
        return None
    inputs = [n.inputs[0], sc.inputs[0], *n.inputs[2:]]
    return Rewrite([s, i], [Node.make("indexer_topk", inputs, n.outputs, n.attr | {"w_scale": sc.attr["factor"]})])


FUSION_RULES = [
    fuse_hc_pre,
    fuse_hc_mix,
    fuse_norm_quant,
    fuse_rope_quant,
    fuse_swiglu_quant,
    fuse_router,
    fuse_router_image_bias,  # on the router fuse_router made
    fuse_compress_pool_norm,
    fuse_indexer,
    fuse_indexer_weight_scale,
    fold_cast_into_linear,
]


def fuse(g: Graph) -> Graph:
    return apply_rules(g, FUSION_RULES)


# ---- after the MoE-dispatch lowering --------------------------------------------------------------

def fuse_moe_shared_add(ctx: Context, i: int):
    """The MoE block's end: the routed combine's fp32 sum plus the shared expert's output, rounded
    to bf16, in the combine kernel, so neither fp32 sum nor the casts go to memory."""
    out = ctx.g.nodes[i]
    if out.op != "cast" or out.attr["dtype"] != "bf16":
        return None
    a, add = ctx.producer_op(out.inputs[0], "add")
    if add is None or not ctx.sole_user(out.inputs[0], i):
        return None
    for routed, widened in (add.inputs, add.inputs[::-1]):
        c, comb = ctx.producer_op(routed, "moe_combine")
        w, cast = ctx.producer_op(widened, "cast")
        if comb is None or cast is None or cast.attr["dtype"] != "f32" or routed == widened:
            continue
        if ctx.g.types[cast.inputs[0]].dtype.name != "bf16":
            continue
        if not (ctx.sole_user(routed, a) and ctx.sole_user(widened, a)):
            continue
        return Rewrite([c, w, a, i], [Node.make("moe_combine_shared", [*comb.inputs, cast.inputs[0]], out.outputs,
                                                comb.attr)])
    return None


def fuse_moe_shared(g: Graph) -> Graph:
    return apply_rules(g, [fuse_moe_shared_add])


# ---- parallel GEMMs over one input ----------------------------------------------------------------

def _stacked_name(a: str, b: str) -> str:
    """`x.w1.weight`, `x.w3.weight` -> `x.w13.weight`: the names differ in one dotted part."""
    pa, pb = a.split("."), b.split(".")
    diff = [i for i, (u, v) in enumerate(zip(pa, pb)) if u != v]
    if len(pa) != len(pb) or len(diff) != 1:
        return f"{a}+{b}"
    i = diff[0]
    k = len(os.path.commonprefix([pa[i], pb[i]]))
    return ".".join(pa[:i] + [pa[i] + pb[i][k:]] + pa[i + 1:])


def fuse_gate_up_gemm(ctx: Context, i: int):
    """A SwiGLU whose gate and up are two fp8 GEMMs of the same activation (the shared expert's
    w1 and w3): one GEMM over both weights stacked by rows (stacked once at load: the concat
    reads only params), and the SwiGLU reads the halves of its output. A decode step reads the
    activation once and launches one GEMM, not two."""
    n = ctx.g.nodes[i]
    if n.op != "swiglu_quant_fp8":
        return None
    (jg, gate), (ju, up) = ctx.producer_op(n.inputs[0], "gemm_fp8"), ctx.producer_op(n.inputs[1], "gemm_fp8")
    if gate is None or up is None or jg == ju or gate.inputs[0] != up.inputs[0] or gate.attrs != up.attrs:
        return None
    w1, w3 = gate.inputs[1], up.inputs[1]
    t1, t3 = ctx.g.types[w1], ctx.g.types[w3]
    if w1 not in ctx.g.params or w3 not in ctx.g.params or t1 != t3:
        return None
    if not (ctx.sole_user(n.inputs[0], i) and ctx.sole_user(n.inputs[1], i)):
        return None
    from ..ir.registry import ShapeError, get_op

    w13, gu = _stacked_name(w1, w3), f"{n.outputs[0]}.gu"
    if w13 in ctx.g.types or gu in ctx.g.types:  # the name is taken (the same pair stacked for another SwiGLU)
        return None
    try:  # rows that are not whole scale blocks cannot be stacked: the GEMMs stay apart
        types = {w13: get_op("concat").infer_types([t1, t3], {"axis": 0})[0]}
    except ShapeError:
        return None
    types[gu] = get_op("gemm_fp8").infer_types([ctx.g.types[gate.inputs[0]], types[w13]], gate.attr)[0]
    return Rewrite([jg, ju, i], [Node.make("concat", [w1, w3], [w13], {"axis": 0}),
                                 Node.make("gemm_fp8", [gate.inputs[0], w13], [gu], gate.attr),
                                 Node.make("swiglu_gu_quant_fp8", [gu], n.outputs, n.attr)], types)


def fuse_gate_up_gemms(g: Graph) -> Graph:
    return apply_rules(g, [fuse_gate_up_gemm])


def split_hc_pre_node(ctx: Context, i: int):
    """An mHC entry as its normalised input (hc_collapse_norm) and its mixes (hc_mix), two calls:
    the mixes (a 2 MB GEMM and a 20-step Sinkhorn) are read only by the next sub-layer's entry and
    this sub-layer's hc_expand, so on a runtime with several streams they run beside the
    sub-layer's first GEMMs instead of ahead of them. The input comes first: it is the call the
    main stream goes on with."""
    n = ctx.g.nodes[i]
    if n.op != "hc_pre":
        return None
    r, fn, scale, base, pre_in, norm_w = n.inputs
    a = n.attr
    return Rewrite([i], [Node.make("hc_collapse_norm", [r, pre_in, norm_w], [n.outputs[0]], {"eps": a["eps"]}),
                         Node.make("hc_mix", [r, fn, scale, base], list(n.outputs[1:]),
                                   {k: a[k] for k in ("eps", "copies", "iters", "hc_eps", "post_mult")})])


def split_hc_pre(g: Graph) -> Graph:
    return apply_rules(g, [split_hc_pre_node])


def fuse_collapse_norm_quant_node(ctx: Context, i: int):
    """An mHC entry's normalised input and its fp8 quantisation as one call, both outputs kept
    (the router and the compressor read the bf16 input): one launch less on the sub-layer's
    critical path, and no second read of the row."""
    qn = ctx.g.nodes[i]
    if qn.op != "quant_fp8" or qn.attr.get("block", 32) != 32:
        return None
    j, norm = ctx.producer_op(qn.inputs[0], "hc_collapse_norm")
    if norm is None:
        return None
    return Rewrite([j, i], [Node.make("hc_collapse_norm_quant_fp8", norm.inputs, [norm.outputs[0], *qn.outputs],
                                      {"eps": norm.attr["eps"], "block": 32})])


def fuse_collapse_norm_quant(g: Graph) -> Graph:
    return apply_rules(g, [fuse_collapse_norm_quant_node])


# ---- RoPE into the attention ----------------------------------------------------------------------

# where each attention op takes its rows' positions
ATTENTION_POSITIONS = {"sparse_attn": 6, "window_attn": 4, "dspark_block_attn": 4}


def _plain_rope(n, inverse: bool) -> bool:
    return n is not None and bool(n.attr.get("inverse")) == inverse and not n.attr.get("pos_offset", 0)


def fuse_attention_rope_node(ctx: Context, i: int):
    """q's RoPE and the output's inverse RoPE into the attention between them (its rope_* attrs,
    rope_around in ir/ops/attention.py): the kernel rotates q's tail as it loads the row's q and
    de-rotates the output's as it stores it, so neither [rows, heads, D] pass over memory nor its
    launch remains. Both at the attention's own positions, with one rotation's constants."""
    out = ctx.g.nodes[i]
    if out.op != "rope" or not _plain_rope(out, True):
        return None
    a, attn = ctx.node_of(out.inputs[0])
    if attn is None or attn.op not in ATTENTION_POSITIONS or attn.attr.get("rope_dim"):
        return None
    r, qrope = ctx.producer_op(attn.inputs[0], "rope")
    if not _plain_rope(qrope, False) or not (ctx.sole_user(out.inputs[0], i) and ctx.sole_user(attn.inputs[0], a)):
        return None
    rot = {k: out.attr.get(k) for k in ("rope_dim", "theta", "yarn")}
    pos = attn.inputs[ATTENTION_POSITIONS[attn.op]]
    if rot != {k: qrope.attr.get(k) for k in rot} or not qrope.inputs[1] == out.inputs[1] == pos:
        return None
    attrs = attn.attr | {"rope_dim": rot["rope_dim"], "rope_theta": rot["theta"], "rope_yarn": rot["yarn"]}
    return Rewrite([r, a, i], [Node.make(attn.op, [qrope.inputs[0], *attn.inputs[1:]], out.outputs, attrs)])


def fuse_attention_rope(g: Graph) -> Graph:
    return apply_rules(g, [fuse_attention_rope_node])


# ---- decode steps only ----------------------------------------------------------------------------

def fuse_decode_cache_write(ctx: Context, i: int):
    """RoPE + fp8 quantisation + window-ring write, before the attention, which then reads the
    written ring. Only valid when every sequence has at most ring_len - window rows in the step
    (decode and draft-verification steps): then no written slot holds a key the step still reads,
    so the attention sees the same keys either way. Prefill graphs keep the write after it."""
    w = ctx.g.nodes[i]
    if w.op != "swa_write":
        return None
    ring, kq = w.inputs[0], w.inputs[1]
    r, rq = ctx.producer_op(kq, "rope_quant_fp8")
    if rq is None:
        return None
    readers = [u for u in ctx.users.get(ring, []) if u != i]
    if any(ctx.g.nodes[u].op not in ("window_attn", "sparse_attn") for u in readers):
        return None
    fused = Node.make("rope_quant_fp8_cache_write", [*rq.inputs, ring, w.inputs[3], w.inputs[4]],
                      [kq, w.outputs[0]], rq.attr)
    new_nodes = [fused]
    for u in sorted(readers):
        n = ctx.g.nodes[u]
        new_nodes.append(Node.make(n.op, [w.outputs[0] if v == ring else v for v in n.inputs], n.outputs, n.attr))
    return Rewrite([r, i, *readers], new_nodes)


def fuse_decode(g: Graph) -> Graph:
    return apply_rules(g, [fuse_decode_cache_write])


def fuse_decode_norm_node(ctx: Context, i: int):
    """The window keys' RMSNorm into the fused ring write that alone reads it
    (norm_rope_quant_fp8_cache_write): at decode the row is short and one program does both, so a
    launch a layer goes and the normalised row never goes to memory."""
    r, norm = _chain_end(ctx, i, "rope_quant_fp8_cache_write", "rms_norm")
    if norm is None:
        return None
    w = ctx.g.nodes[i]
    fused = Node.make("norm_rope_quant_fp8_cache_write", [*norm.inputs, *w.inputs[1:]], w.outputs,
                      w.attr | {"eps": norm.attr["eps"]})
    return Rewrite([r, i], [fused])


def fuse_decode_norm(g: Graph) -> Graph:
    return apply_rules(g, [fuse_decode_norm_node])


def fuse_decode_linear_quant_node(ctx: Context, i: int):
    """A grouped linear's fp8 quantisation into the linear (grouped_linear_quant_fp8) where the
    quantisation alone reads its rows: wo_a's K-split sum quantises as it sums, a launch a layer
    less. Decode graphs only: prefill rows go to the programs the target names for grouped_linear,
    which write bf16."""
    r, lin = _chain_end(ctx, i, "quant_fp8", "grouped_linear")
    qn = ctx.g.nodes[i]
    if lin is None or qn.attr.get("block", 32) != 32:  # the split's sum quantises per 32
        return None
    return Rewrite([r, i], [Node.make("grouped_linear_quant_fp8", lin.inputs, qn.outputs, lin.attr | qn.attr)])


def fuse_decode_linear_quant(g: Graph) -> Graph:
    return apply_rules(g, [fuse_decode_linear_quant_node])


def fuse_combine_expand_node(ctx: Context, i: int):
    """The MoE block's combine into the hc_expand that alone reads its output
    (moe_combine_hc_expand): a launch a layer less, and the block's bf16 rows neither written nor
    read back."""
    c, comb = _chain_end(ctx, i, "hc_expand", "moe_combine_shared")
    if comb is None:
        return None
    e = ctx.g.nodes[i]
    return Rewrite([c, i], [Node.make("moe_combine_hc_expand", [*comb.inputs, *e.inputs[1:]], e.outputs, comb.attr)])


def fuse_combine_expand(g: Graph) -> Graph:
    return apply_rules(g, [fuse_combine_expand_node])


def fuse_decode_router_linear_node(ctx: Context, i: int):
    """The gate's logits GEMM into the router that alone reads its logits (linear_moe_router): at
    decode the router kernel sums the GEMM's K split, a launch a layer less. Decode graphs only:
    a prefill call's GEMM splits no K, and its router reads the logits as before."""
    r, lin = _chain_end(ctx, i, "moe_router", "linear")
    if lin is None or lin.attr.get("out_dtype") != "f32":  # the router sums fp32 partials or reads fp32 logits
        return None
    rt = ctx.g.nodes[i]
    return Rewrite([r, i], [Node.make("linear_moe_router", [*lin.inputs, *rt.inputs[1:]], rt.outputs,
                                      lin.attr | rt.attr)])


def fuse_decode_router_linear(g: Graph) -> Graph:
    return apply_rules(g, [fuse_decode_router_linear_node])
