"""Image tokens (vision configs): the router selects with bias_vl and Engram leaves them out."""
import torch

from deepinfer.ir import get_op
from deepinfer.models.deepseek_v41 import build_model


def test_route_bias_picks_bias_vl_for_image_rows():
    ids = torch.tensor([5, 129264, 7])
    bias, bias_vl = torch.zeros(4), torch.arange(4.0)
    out = get_op("route_bias").ref(ids, bias, bias_vl, image_token_id=129264)
    assert out[1].tolist() == [0.0, 1.0, 2.0, 3.0] and out[0].eq(0).all() and out[2].eq(0).all()


def test_engram_gate_leaves_image_rows_and_lookup_marks_them_dead():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(3, 4, 8, generator=g).bfloat16()
    kv = torch.randn(3, 5 * 8, generator=g).bfloat16()
    qw, kw = torch.ones(4, 8).bfloat16(), torch.ones(4, 8).bfloat16()
    ids = torch.tensor([1, 99, 2])
    out = get_op("engram_gate").ref(r, kv, qw, kw, ids, eps=1e-20, image_token_id=99)
    plain = get_op("engram_gate").ref(r, kv, qw, kw, eps=1e-20, image_token_id=None)
    assert torch.equal(out[1], r[1]) and not torch.equal(plain[1], r[1])
    assert torch.equal(out[0], plain[0]) and torch.equal(out[2], plain[2])
    cids = get_op("lookup").ref(torch.arange(10, dtype=torch.int32), torch.tensor([3, 99, 20]), dead_ids=(99,))
    assert cids.tolist() == [3, -1, -1]


def test_real_graph_routes_image_tokens_with_bias_vl():
    step = build_model("v4.1-flash").step
    assert step.op_counts()["route_bias"] == 40
    assert all(len(n.inputs) == 5 for n in step.nodes if n.op == "engram_gate")


def test_sm90_routers_pick_the_image_bias_by_token_id():
    """After fusion no route_bias is left: every router of a vision model reads bias, bias_vl and
    the token ids, and the sm90 Triton router takes them."""
    import dataclasses

    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import select
    from deepinfer.models.config import load_config
    from deepinfer.passes.driver import run_pipeline
    from deepinfer.passes.kernels import kernel_spec

    g = run_pipeline(build_model(dataclasses.replace(load_config("v4.1-flash-tiny"), vision=True)).step, "sm90")
    routers = [n for n in g.nodes if n.op == "moe_router"]
    assert "route_bias" not in g.op_counts() and routers
    assert all(n.inputs[3] == "token_ids" and n.attr["image_token_id"] == 129264 for n in routers)
    env = {"num_tokens": 8, "num_seqs": 2, "num_samples": 2, "max_pages": 8, "num_slots": 4, "num_pages": 16}
    spec = kernel_spec(g, routers[0], {v: g.types[v].subs(env) for v in (*routers[0].inputs, *routers[0].outputs)})
    assert select(get_target("sm90"), spec).name == "triton_moe_router"
