"""Every pass keeps the interpreter's output on the tiny model (prefill and decode, and the draft
graph); the fusion and lowering rules fire where the spec says; the compiled cpu plan matches the
reference; damaged and foreign plans are refused with one line."""
import json
import shutil

import pytest
import torch

from deepinfer.codegen.library.triton_check import clone_value
from deepinfer.codegen.plan import PlanError, load_plan
from deepinfer.ir import interpret
from deepinfer.models.checkpoint import load_checkpoint, make_checkpoint
from deepinfer.models.config import load_config
from deepinfer.models.deepseek_v41 import build_model, load_params
from deepinfer.passes.driver import CompileOptions, compile_model, load_time_nodes
from deepinfer.passes.pipelines import pipeline
from deepinfer.runtime.batch import DraftSeq, SeqChunk, draft_inputs, step_inputs
from deepinfer.runtime.plan_executor import PlanExecutor
from deepinfer.runtime.state import allocate_state

from reference import ReferenceModel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ckpt = make_checkpoint("v4.1-flash-tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)
    cfg = load_config("v4.1-flash-tiny")
    prog = build_model(cfg)
    return ckpt, prog, load_params(prog, load_checkpoint(ckpt, cfg))


def _params_for(g, params):
    """Params of a lowered graph: derived weights (load-time nodes) are evaluated once here."""
    from deepinfer.ir.registry import get_op

    p = dict(params)
    for i in sorted(load_time_nodes(g)):
        n = g.nodes[i]
        p[n.outputs[0]] = get_op(n.op).ref(*(p[v] for v in n.inputs), **get_op(n.op).check_attrs(n.attr))
    return p


def _run_steps(g, params, state_types, steps):
    state = allocate_state(state_types, num_slots=2, num_pages=4)
    outs = []
    for chunks in steps:
        o, state, _ = interpret(g, step_inputs(chunks), params, state)
        outs.append(o["logits"])
    return outs, state


def test_every_pass_keeps_the_interpreter_output(tiny):
    _, prog, params = tiny
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(3, prog.cfg.vocab_size, (45,), generator=gen).tolist()
    b = torch.randint(3, prog.cfg.vocab_size, (20,), generator=gen).tolist()
    steps = [[SeqChunk(0, 0, a, [0]), SeqChunk(1, 0, b[:13], [1], sample=False)],
             [SeqChunk(0, 45, [7], [0]), SeqChunk(1, 13, b[13:], [1])],
             [SeqChunk(0, 46, [9], [0]), SeqChunk(1, 20, [11], [1])]]
    want, want_state = _run_steps(prog.step, params, prog.state, steps)
    seqs = [DraftSeq(0, 5, 47), DraftSeq(1, 6, 21)]
    d_want, _, _ = interpret(prog.draft, draft_inputs(seqs, 5, prog.cfg.dspark_noise_token_id), params, want_state)
    g, d = prog.step, prog.draft
    for name, fn in pipeline("cpu"):
        g, d = fn(g), fn(d)
        got, state = _run_steps(g, _params_for(g, params), prog.state, steps)
        for w, x in zip(want, got):
            assert torch.equal(w, x), f"pass {name} changed the step graph's logits"
        d_got, _, _ = interpret(d, draft_inputs(seqs, 5, prog.cfg.dspark_noise_token_id), _params_for(d, params), state)
        assert torch.equal(d_want["drafts"], d_got["drafts"]) and torch.equal(d_want["confidence"], d_got["confidence"]), \
            f"pass {name} changed the draft graph"


def _cpu_graph_and_rewrite(tiny, rewrite, seed):
    """(the cpu pipeline's step graph, `rewrite` of it), after checking that a prefill and a
    decode step give the same logits bit for bit through both."""
    _, prog, params = tiny
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(3, prog.cfg.vocab_size, (30,), generator=gen).tolist()
    steps = [[SeqChunk(0, 0, a, [0])], [SeqChunk(0, 30, [7], [0])]]
    g = prog.step
    for _, fn in pipeline("cpu"):
        g = fn(g)
    want, _ = _run_steps(g, _params_for(g, params), prog.state, steps)
    f = rewrite(g)
    got, _ = _run_steps(f, _params_for(f, params), prog.state, steps)
    assert all(torch.equal(w, x) for w, x in zip(want, got)), f"{rewrite.__name__} changed the logits"
    return g, f


def test_gate_up_gemms_fuse_without_changing_the_logits(tiny):
    """fuse_gate_up_gemms (sm90 / sm100): the shared expert's w1 and w3 GEMMs become one GEMM over
    their rows stacked at load and a SwiGLU over its halves; the interpreter's logits are unchanged
    bit for bit, and a GEMM per layer goes."""
    from deepinfer.passes.fuse import fuse_gate_up_gemms

    prog = tiny[1]
    g, f = _cpu_graph_and_rewrite(tiny, fuse_gate_up_gemms, seed=5)
    before, after = g.op_counts(), f.op_counts()
    layers = sum(1 for r in prog.cfg.layers if not r.is_draft)
    assert after["swiglu_gu_quant_fp8"] == layers and "swiglu_quant_fp8" not in after
    assert after["gemm_fp8"] == before["gemm_fp8"] - layers and after["concat"] == before["concat"] + layers
    stacked = {n.outputs[0] for n in f.nodes if n.op == "concat" and n.attr["axis"] == 0}
    assert "layers.0.ffn.shared_experts.w13.weight" in stacked
    assert all(i in load_time_nodes(f) for i, n in enumerate(f.nodes) if n.op == "concat" and n.outputs[0] in stacked)


def test_split_hc_pre_keeps_the_logits(tiny):
    """split_hc_pre (sm90 / sm100): each hc_pre becomes hc_collapse_norm then hc_mix, the
    interpreter's logits unchanged bit for bit (both are hc_pre's own composition)."""
    from deepinfer.passes.fuse import split_hc_pre

    g, f = _cpu_graph_and_rewrite(tiny, split_hc_pre, seed=6)
    assert f.op_counts()["hc_collapse_norm"] == g.op_counts()["hc_pre"] and "hc_pre" not in f.op_counts()
    order = [n.op for n in f.nodes if n.op in ("hc_collapse_norm", "hc_mix")]
    assert order[1:3] == ["hc_collapse_norm", "hc_mix"]  # the input first: the main stream goes on with it


def test_collapse_norm_quant_fuses_without_changing_the_logits(tiny):
    """fuse_collapse_norm_quant (sm90 / sm100, after split_hc_pre): every entry whose normalised
    input is quantised for its GEMMs becomes one hc_collapse_norm_quant_fp8 keeping both outputs
    (the router and the compressor read the bf16 one); the interpreter's logits are unchanged bit
    for bit, and a quant call per sub-layer goes."""
    from deepinfer.passes.fuse import fuse_collapse_norm_quant, split_hc_pre

    def both(g):
        return fuse_collapse_norm_quant(split_hc_pre(g))

    g, f = _cpu_graph_and_rewrite(tiny, both, seed=7)
    split, fused = split_hc_pre(g).op_counts(), f.op_counts()
    assert fused["hc_collapse_norm_quant_fp8"] == split["hc_collapse_norm"] and "hc_collapse_norm" not in fused
    assert fused["quant_fp8"] == split["quant_fp8"] - split["hc_collapse_norm"]
    # the FFN entries' bf16 input still feeds the router's linear
    users = f.users()
    assert any(f.nodes[u].op == "linear" for n in f.nodes if n.op == "hc_collapse_norm_quant_fp8"
               for u in users.get(n.outputs[0], []))


def test_attention_rope_fuses_without_changing_the_logits(tiny):
    """fuse_attention_rope (bench/variant_plan.sh +fuse_attention_rope until timed on the H200):
    every attention of the step graph takes its q's RoPE and its output's inverse RoPE as rope_*
    attrs, the logits are unchanged bit for bit, two rope calls a layer go, and the key RoPEs (fused
    with their quantisation) stay. The draft graph's block attentions fuse the same way."""
    from deepinfer.passes.fuse import ATTENTION_POSITIONS, fuse_attention_rope

    prog = tiny[1]
    g, f = _cpu_graph_and_rewrite(tiny, fuse_attention_rope, seed=9)
    attn = [n for n in f.nodes if n.op in ATTENTION_POSITIONS]
    layers = sum(1 for r in prog.cfg.layers if not r.is_draft)
    assert len(attn) == layers and all(n.attr["rope_dim"] == prog.cfg.qk_rope_head_dim for n in attn)
    assert f.op_counts().get("rope", 0) == g.op_counts()["rope"] - 2 * layers
    assert not any(n.op == "rope" and n.attr.get("inverse") for n in f.nodes)
    assert {n.attr["rope_theta"] for n in attn} == {float(r.rope_theta) for r in prog.cfg.layers if not r.is_draft}
    d = fuse_attention_rope(prog.draft)
    blocks = [n for n in d.nodes if n.op == "dspark_block_attn"]
    assert blocks and all(n.attr["rope_dim"] for n in blocks)
    assert not any(n.op == "rope" and n.attr.get("inverse") for n in d.nodes)


def test_attention_rope_fusion_needs_the_same_rotation_at_the_attention_positions(tiny):
    """The rule folds a q rope and an inverse rope only when both rotate by the same constants at the
    attention's own positions with no offset: an attention whose q rope differs in theta or carries
    a pos_offset keeps both rope calls."""
    from deepinfer.ir.graph import Node
    from deepinfer.passes.fuse import ATTENTION_POSITIONS, fuse_attention_rope

    g = tiny[1].step
    for _, fn in pipeline("cpu"):
        g = fn(g)
    prod = g.producers()
    first = next(n for n in g.nodes if n.op in ATTENTION_POSITIONS)
    i = prod[first.inputs[0]]
    assert g.nodes[i].op == "rope"
    for change in ({"theta": g.nodes[i].attr["theta"] * 2}, {"pos_offset": 1}):
        h = g.copy()
        q = h.nodes[i]
        h.nodes[i] = Node.make("rope", q.inputs, q.outputs, q.attr | change)
        f = fuse_attention_rope(h)
        attn = [n for n in f.nodes if n.op in ATTENTION_POSITIONS]
        assert [n.outputs == first.outputs for n in attn if not n.attr.get("rope_dim")] == [True], change
        assert sum(1 for n in attn if n.attr.get("rope_dim")) == len(attn) - 1, change


def test_decode_pipeline_keeps_the_interpreter_output(tiny):
    """The decode graph (ring written before the attention reads it) gives the same logits as the
    builder's graph on decode steps of up to decode_rows_max rows per sequence."""
    _, prog, params = tiny
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(3, prog.cfg.vocab_size, (40,), generator=gen).tolist()
    b = torch.randint(3, prog.cfg.vocab_size, (33,), generator=gen).tolist()
    prefill = [SeqChunk(0, 0, a, [0]), SeqChunk(1, 0, b, [1])]
    decode = [[SeqChunk(0, 40, [7, 8, 9, 10, 11, 12], [0]), SeqChunk(1, 33, [5], [1])],
              [SeqChunk(0, 46, [3], [0]), SeqChunk(1, 34, [1, 2, 3, 4, 5, 6], [1])]]
    want, _ = _run_steps(prog.step, params, prog.state, [prefill] + decode)
    # the prefill runs once (the builder's graph, whatever the pass): each pass's decode steps
    # start from copies of the state it left
    _, prefilled, _ = interpret(prog.step, step_inputs(prefill), params,
                                allocate_state(prog.state, num_slots=2, num_pages=4))
    g = prog.step
    for name, fn in pipeline("cpu", variant="decode"):
        g = fn(g)
        state = {k: clone_value(v) for k, v in prefilled.items()}
        p = _params_for(g, params)
        for k, chunks in enumerate(decode):
            o, state, _ = interpret(g, step_inputs(chunks), p, state)
            assert torch.equal(o["logits"], want[k + 1]), f"pass {name} changed decode step {k}"
    # every window key's RMSNorm went into its ring write too (fuse_decode_norm)
    ops = g.op_counts()
    assert ops["norm_rope_quant_fp8_cache_write"] == 13 and not {"rope_quant_fp8_cache_write", "swa_write"} & set(ops)


def test_fusion_and_lowering_rules_fire_where_the_spec_says():
    cfg = load_config("v4.1-flash")
    g = build_model(cfg).step
    for name, fn in pipeline("sm90")[:-1]:  # everything but kernel selection (templates in progress)
        g = fn(g)
    ops = g.op_counts()
    n = cfg.num_hidden_layers
    # every sub-layer entry but layer 0's attention (its input is the embedding) as its normalised
    # input and its mixes, apart (split_hc_pre: the mixes on the runtime's second stream), the input
    # quantised for the sub-layer's GEMMs in the same call (fuse_collapse_norm_quant)
    assert ops["hc_collapse_norm_quant_fp8"] == 2 * n - 1 and "hc_pre" not in ops and "hc_collapse_norm" not in ops
    assert ops["hc_mix"] == 2 * n and "hc_mix_gemm" not in ops and "hc_sinkhorn" not in ops
    assert ops["moe_router"] == n and "topk_ids" not in ops and "softplus" not in ops
    # the shared expert's w1 and w3 in one GEMM (fuse_gate_up_gemms), its SwiGLU over the halves
    assert ops["swiglu_gu_quant_fp8"] == n and "swiglu_quant_fp8" not in ops and "swiglu" not in ops
    assert ops["indexer_topk"] == len(cfg.index_source_layer_ids) and "indexer_scores" not in ops
    # the head weights' factor (spec §4.4d) folded in: no scale call left
    assert all(x.attr.get("w_scale") for x in g.nodes if x.op == "indexer_topk") and "scale" not in ops
    assert ops["compress_pool_norm"] == 3  # the ratio-2 owners
    # their wkv / wgate read the bf16 input: no f32 copy of it; and the shared experts' casts and
    # add went into the combine (fuse_moe_shared): no cast is left
    assert "cast" not in ops and sum(x.op == "linear" and g.types[x.inputs[0]].dtype.name == "f32"
                                     for x in g.nodes) == 0
    # and the combine into the hc_expand that reads it (fuse_combine_expand)
    assert ops["moe_combine_hc_expand"] == n and not {"moe_combine", "moe_combine_shared"} & set(ops)
    assert ops["rope_quant_fp8"] == n + 3  # window keys of every layer and the DSpark context keys
    assert ops["grouped_gemm_fp4"] == 2 * n and "moe_experts" not in ops
    assert ops["concat"] == 2 * n + 1  # w13 per layer and the shared expert's (load time) + the DSpark taps
    shared = [x for x in g.nodes if x.op == "sparse_attn" and "@shares_topk_of" in x.attr]
    assert len(shared) == ops["sparse_attn"] - len(cfg.index_source_layer_ids)  # REUSE layers share a buffer
    assert all(x.attr["@operands"] == "fp4->fp8 in prologue" for x in g.nodes if x.op == "grouped_gemm_fp4")


def test_expert_parallel_shards_experts_and_inserts_exchanges():
    g = build_model("v4.1-flash-tiny").step
    for name, fn in pipeline("cpu", ep=4):
        g = fn(g)
    ops = g.op_counts()
    assert ops["ep_dispatch"] == ops["ep_combine"] == 10  # one exchange each way per MoE layer
    w1 = g.types["layers.0.ffn.experts.w1"]
    assert w1.data.shape[0] == 16 // 4 and g.types["layers.0.ffn.expert_slots"].shape == (16,)  # 4 slots per rank


@pytest.fixture(scope="module")
def tiny_plan(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "tiny"
    dump = tmp_path_factory.mktemp("dump")
    report = compile_model("v4.1-flash-tiny", CompileOptions("cpu", max_model_len=1024, dump_ir=str(dump)), out)
    return out, report, dump


def test_compile_writes_plan_with_report_and_dumps(tiny_plan):
    out, report, dump = tiny_plan
    plan = load_plan(out, target="cpu")
    assert plan["model"]["id"] == "v4.1-flash-tiny" and plan["target"]["name"] == "cpu"
    assert set(plan["graphs"]) == {"step", "step_decode", "draft"} and plan["files"]
    assert len(plan["load_program"]) == 10 + 3  # w13 of each layer and DSpark stage
    assert report.calls_per_template["torch_ref"] > 300 and report.unique_kernels > 0
    assert report.peak_bytes["decode_b1"] < report.peak_bytes["prefill_t8192"]
    names = sorted(p.name for p in dump.iterdir())
    assert "03-fuse.ir" in names and "05-lower_moe_dispatch.ir" in names and "08-select_kernels.draft.ir" in names


def test_cpu_plan_matches_reference(tiny, tiny_plan):
    ckpt = tiny[0]
    ex = PlanExecutor(tiny_plan[0], ckpt, num_slots=2, num_pages=4)
    ref = ReferenceModel.from_checkpoint(ckpt)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, ex.vocab_size, (n,), generator=gen).tolist() for n in (101, 63)]
    seqs = [ref.new_sequence() for _ in prompts]
    logits = ex.step([SeqChunk(0, 0, prompts[0], [0, 1]), SeqChunk(1, 0, prompts[1], [2, 3])])
    pos = [len(p) for p in prompts]
    for step in range(41):
        toks = []
        for i, (s, p) in enumerate(zip(seqs, prompts)):
            r = ref.prefill(s, p) if step == 0 else ref.decode(s, p[-1])
            err = ((logits[i] - r).abs().max() / r.abs().max()).item()
            assert err < 1e-3, f"step {step} seq {i}: relative error {err:.2e}"
            tok = int(torch.argmax(logits[i]))
            assert tok == int(torch.argmax(r))
            p.append(tok)
            toks.append(tok)
        if step == 40:
            break
        logits = ex.step([SeqChunk(i, pos[i] + step, [toks[i]], [2 * i, 2 * i + 1]) for i in range(2)])
    drafts, conf = ex.draft([DraftSeq(i, prompts[i][-1], len(prompts[i]) - 1) for i in range(2)])
    for i in range(2):
        want_d, want_c = ref.draft(seqs[i], prompts[i][-1])
        assert drafts[i].tolist() == want_d
        assert ((conf[i] - want_c).abs().max() / want_c.abs().max()).item() < 1e-3


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_damaged_and_foreign_plans_are_refused(tiny_plan, tmp_path):
    src = tiny_plan[0]
    p = _copy(src, tmp_path / "edited")
    body = json.loads((p / "plan.json").read_text())
    body["options"]["max_model_len"] = 7
    (p / "plan.json").write_text(json.dumps(body))
    with pytest.raises(PlanError, match="does not match its own hash"):
        load_plan(p)
    p = _copy(src, tmp_path / "ir")
    (p / "ir" / "step.ir").write_text("graph x\nend\n")
    with pytest.raises(PlanError, match="ir/step.ir does not match its hash"):
        load_plan(p)
    p = _copy(src, tmp_path / "missing")
    (p / "ir" / "draft.ir").unlink()
    with pytest.raises(PlanError, match="ir/draft.ir is missing"):
        load_plan(p)
    p = _copy(src, tmp_path / "truncated")
    (p / "plan.json").write_bytes((p / "plan.json").read_bytes()[:100])
    with pytest.raises(PlanError, match="plan.json is damaged"):
        load_plan(p)
    with pytest.raises(PlanError, match="compiled for cpu, not sm90"):
        load_plan(src, target="sm90")
    with pytest.raises(PlanError, match="no such directory"):
        load_plan(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlanError, match="plan.json is missing"):
        load_plan(tmp_path / "empty")


def test_plan_from_another_version_is_refused(tiny_plan, tmp_path, monkeypatch):
    import deepinfer.version

    monkeypatch.setattr(deepinfer.version, "VERSION", "9.9.9")
    with pytest.raises(PlanError, match="written by DeepInfer 0.1.0, this is 9.9.9"):
        load_plan(tiny_plan[0])


def test_weights_of_another_model_are_refused(tiny_plan, tmp_path):
    cfg = json.loads(open(load_config("v4.1-flash-tiny").source).read())
    cfg["moe_intermediate_size"] = 64
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PlanError, match="weights .* are for model"):
        PlanExecutor(tiny_plan[0], tmp_path / "other", num_slots=1, num_pages=1)


def test_failed_compile_keeps_existing_plan(tiny_plan, tmp_path):
    out = _copy(tiny_plan[0], tmp_path / "plan")
    before = (out / "plan.json").read_bytes()
    with pytest.raises(Exception, match="unknown target"):
        compile_model("v4.1-flash-tiny", CompileOptions("tpu"), out)
    assert (out / "plan.json").read_bytes() == before


def test_row_weight_scales_keeps_the_interpreter_output(tiny):
    """ascend950's MX GEMMs read per-row weight scales: the load-time repeat of the 32x32 block
    scales changes no logit, and every fp8 GEMM reads the repeated form."""
    from deepinfer.passes.quant import row_weight_scales

    _, prog, params = tiny
    steps = [[SeqChunk(0, 0, list(range(3, 40)), [0])], [SeqChunk(0, 37, [7], [0])]]
    want, _ = _run_steps(prog.step, params, prog.state, steps)
    g = row_weight_scales(prog.step)
    gemms = [n for n in g.nodes if n.op == "gemm_fp8"]
    scales = [n for n in g.nodes if n.op == "row_block_scales"]
    assert gemms and all(n.inputs[1].endswith(".rows") and g.types[n.inputs[1]].block == (1, 32) for n in gemms)
    assert len(scales) == len({n.inputs[1] for n in gemms}) and load_time_nodes(g) >= {g.nodes.index(n) for n in scales}
    got, _ = _run_steps(g, _params_for(g, params), prog.state, steps)
    assert all(torch.equal(w, x) for w, x in zip(want, got))
