"""Row selection for the LM head, and the DSpark draft heads (spec §4.1, §5.4)."""
from __future__ import annotations

import torch

from .. import dtypes as dt
from .. import numerics as nm
from ..registry import REQUIRED, op
from ..types import TensorType
from .attention import want_index
from .core import want_dims, want_float


def _gather_rows_rule(ins, a):
    x = want_float(ins[0], "input")
    rows = want_index(ins[1], "rows")
    return [TensorType(x.dtype, (rows.shape[0],) + x.shape[1:])]


@op("gather_rows", infer=_gather_rows_rule, flops=lambda i, o, a: 0, n_inputs=2)
def gather_rows(x, rows):
    """The rows that are sampled: prefill samples only the last row of a prompt."""
    return x[rows.long()]


def _heads_rule(ins, a):
    hb = want_float(ins[0], "block hidden")
    first = want_index(ins[1], "first tokens")
    norm, head, membed, mhead, conf = (want_float(t, n) for t, n in zip(
        ins[2:], ("norm", "head", "markov embed", "markov head", "confidence proj")))
    b = a["block"]
    want_dims(hb.shape[0], first.shape[0] * b, "block rows vs sequences x block")
    want_dims(head.shape[1], hb.shape[1], "head width vs hidden")
    want_dims(mhead.shape[0], head.shape[0], "markov head vs vocabulary")
    want_dims(membed.shape[1], mhead.shape[1], "markov rank")
    want_dims(conf.shape[1], hb.shape[1] + membed.shape[1], "confidence input width")
    n = first.shape[0]
    return [TensorType(dt.i64, (n, b)), TensorType(dt.f32, (n, b))]


@op("dspark_heads", infer=_heads_rule,
    flops=lambda i, o, a: 2 * i[0].shape[0] * i[3].shape[0] * (i[3].shape[1] + i[5].shape[1]),
    attrs={"block": REQUIRED, "eps": REQUIRED}, n_inputs=7)
def dspark_heads(hb, first, norm, head, markov_embed, markov_head, conf_proj, *, block, eps):
    """Sequential over the block rows s: logits_s = fp32(RMSNorm(hb_s)) @ head^T plus the Markov
    term of the previous token (t* for s = 0, else draft_{s-1}); draft_s = argmax (lowest id on
    ties); confidence logit z_s = [hb_s ; m_s] . proj on the pre-norm hidden (spec §5.4)."""
    n = first.shape[0]
    h = hb.view(n, block, -1)
    hf = h.float()
    normed = nm.rms_norm(h, norm, eps).float()
    # the fp64 operands of mm32 once per call, not once per row s: converting the [V, H] head
    # five times was ~90% of a tiny-model draft on the CPU (bf16 -> fp64 is exact either way)
    head64, mhead64, conf64 = nm.as64(head), nm.as64(markov_head), nm.as64(conf_proj)
    drafts = torch.empty(n, block, dtype=torch.int64)
    conf = torch.empty(n, block, dtype=torch.float32)
    prev = first.long()
    for s in range(block):
        m = markov_embed[prev]  # [n, rank] bf16
        logits = nm.mm32(normed[:, s], head64) + nm.mm32(m.float(), mhead64)
        drafts[:, s] = torch.argmax(logits, dim=-1)  # documented: the first maximal index
        conf[:, s] = nm.mm32(torch.cat([hf[:, s], m.float()], dim=-1), conf64)[:, 0]
        prev = drafts[:, s]
    return drafts, conf
