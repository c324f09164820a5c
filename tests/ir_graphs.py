"""Small hand-built graphs shared by the IR tests."""
from deepinfer.ir import Graph, shapes as sh, tensor


def norm_matmul_softmax(hidden=64, out=48) -> Graph:
    """RMSNorm -> matmul -> softmax over a symbolic number of tokens."""
    g = Graph("norm_matmul_softmax")
    x = g.add_input("x", tensor("bf16", sh.num_tokens, hidden))
    gamma = g.add_param("norm.weight", tensor("bf16", hidden))
    w = g.add_param("proj.weight", tensor("bf16", out, hidden))
    h = g.add1("rms_norm", x, gamma, eps=1e-6, name="h")
    logits = g.add1("linear", h, w, out_dtype="f32", name="logits")
    probs = g.add1("softmax", logits, axis=-1, name="probs")
    g.set_outputs(probs)
    return g
