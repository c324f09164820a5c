"""The two rounding points the official model has inside its ops (spec §3.6, ir/numerics.py), in the
op semantics (ir/ops) and in the independent reference (tests/reference): sparse attention's
probabilities are rounded to bf16 before P.V, and index scores are bf16 arithmetic."""
import sys
from pathlib import Path

import torch

from deepinfer.ir.ops.attention import attend_with_sink
from deepinfer.ir.ops.quantized import dequant_value
from deepinfer.ir.quant import QTensor, quant_fp4_ue8m0
from deepinfer.ir.registry import get_op

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference.model import sparse_attn_sink  # noqa: E402


def _bf16(x):
    return x.float().bfloat16().float()


def _attention_inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 64, generator=g).bfloat16()
    keys = torch.randn(3, 40, 64, generator=g).bfloat16()
    valid = torch.rand(3, 40, generator=g) > 0.2
    valid[:, 0] = True
    sink = torch.randn(4, generator=g)
    return q, keys, valid, sink


def _attention_by_hand(q, keys, valid, sink, scale, round_p: bool):
    s = torch.einsum("rhd,rkd->rhk", q.double(), keys.double()) * scale
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m).float()
    denom = p.double().sum(-1, keepdim=True) + torch.exp(sink.double().view(1, -1, 1) - m)
    pv = _bf16(p) if round_p else p
    return (torch.einsum("rhk,rkd->rhd", pv.double(), keys.double()) / denom).float()


def test_attention_rounds_its_probabilities_to_bf16_before_pv_and_not_in_the_denominator():
    q, keys, valid, sink = _attention_inputs()
    scale = 64 ** -0.5
    want = _attention_by_hand(q, keys, valid, sink, scale, round_p=True)
    unrounded = _attention_by_hand(q, keys, valid, sink, scale, round_p=False)
    got = attend_with_sink(q, keys, valid, sink, scale)
    assert (unrounded - want).abs().max() > 1e-4  # the rounding shows at these sizes
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    ref = sparse_attn_sink(q, keys, valid, sink, scale)  # the reference rounds its output to bf16
    assert torch.equal(ref, want.bfloat16())


def _index_inputs():
    g = torch.Generator().manual_seed(5)
    n, heads, dim, cap = 2, 4, 64, 24
    qi = quant_fp4_ue8m0(torch.randn(n, heads, dim, generator=g))
    ik = quant_fp4_ue8m0(torch.randn(cap, dim, generator=g))
    w = torch.randn(n, heads, generator=g).bfloat16()
    ik = QTensor(ik.data.view(3, 8, -1), ik.scale.view(3, 8, -1))  # 3 pages of 8 entries
    positions = torch.tensor([23, 23])
    token_seq = torch.tensor([0, 0], dtype=torch.int32)
    block_table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    return qi, w, ik, positions, token_seq, block_table


def test_index_scores_are_bf16_arithmetic():
    """Each head's dot rounded to bf16, each weighted term rounded to bf16, the head sum rounded to
    bf16; entries past (pos + 1) // ratio are -inf."""
    qi, w, ik, positions, token_seq, block_table = _index_inputs()
    got = get_op("indexer_scores").ref(qi, w, ik, positions, token_seq, block_table, ratio=2)
    q = dequant_value(qi).double()
    keys = dequant_value(QTensor(ik.data[block_table[0].long()].flatten(0, 1),
                                 ik.scale[block_table[0].long()].flatten(0, 1))).double()
    dots = _bf16(torch.einsum("nhd,cd->nhc", q, keys).float())
    terms = _bf16(w.float().unsqueeze(-1) * torch.relu(dots))
    want = _bf16(terms.double().sum(1).float())
    want[:, 12:] = float("-inf")
    assert torch.equal(got, want)
    assert torch.equal(got[:, :12], _bf16(got[:, :12]))  # bf16 values held in fp32
    fp32 = (w.float().unsqueeze(-1) * torch.relu(torch.einsum("nhd,cd->nhc", q, keys).float())).double().sum(1).float()
    assert not torch.equal(fp32[:, :12], want[:, :12])  # the roundings show at these sizes
