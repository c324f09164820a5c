"""The V4.1 graphs: built from presets with no weights (every size), and on the tiny checkpoint
the graph interpreter matches the independent reference (tests/reference) step for step."""
import time

import pytest
import torch

from deepinfer.ir import interpret, parse_graph, print_graph
from deepinfer.models.checkpoint import load_checkpoint, make_checkpoint
from deepinfer.models.config import load_config
from deepinfer.models.deepseek_v41 import build_model, load_params, max_backtrack, ring_len
from deepinfer.runtime.batch import DraftSeq, SeqChunk, draft_inputs, step_inputs
from deepinfer.runtime.state import allocate_state

from reference import ReferenceModel

REL_TOL = 1e-3


@pytest.mark.parametrize("preset", ["v4.1-flash", "v4.1-flash-medium"])
def test_real_sized_graphs_build_from_config_alone(preset):
    t = time.perf_counter()
    prog = build_model(preset)
    assert time.perf_counter() - t < 30
    ops = prog.step.op_counts()
    cfg = prog.cfg
    assert ops["moe_experts"] == cfg.num_hidden_layers
    assert ops["sparse_attn"] == sum(r.ratio > 0 for r in cfg.backbone)
    assert ops["window_attn"] == sum(r.ratio == 0 for r in cfg.backbone)
    assert ops["indexer_scores"] == len(cfg.index_source_layer_ids)
    assert ops["candidate_blocks"] == 1 and ops["candidate_mask"] == 4
    assert ops["engram_gate"] == 2 and ops["hc_sinkhorn"] == 2 * cfg.num_hidden_layers
    assert ops["compressed_write"] == 2 * len(cfg.kv_source_layer_ids)
    # every layer's ring and the DSpark stages' rings, the 4 owners' caches, 3 compressor states
    assert len(prog.state) == 43 + 4 * 2 + 3 + 1
    assert prog.draft.op_counts()["dspark_block_attn"] == 3
    assert prog.state["swa.0"].shape[1] == ring_len(cfg) == 128 + max_backtrack(cfg) == 134


def test_real_graph_text_round_trip():
    g = build_model("v4.1-flash").step
    assert parse_graph(print_graph(g)) == g


# ---- interpreter vs reference on the tiny checkpoint ----------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ckpt = make_checkpoint("v4.1-flash-tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)
    cfg = load_config("v4.1-flash-tiny")
    prog = build_model(cfg)
    params = load_params(prog, load_checkpoint(ckpt, cfg))
    return prog, params, ReferenceModel.from_checkpoint(ckpt)


def _close(mine: torch.Tensor, ref: torch.Tensor, what: str):
    err = ((mine - ref).abs().max() / ref.abs().max()).item()
    assert err < REL_TOL, f"{what}: max relative error {err:.2e}"
    return err


class _Seq:
    def __init__(self, slot, prompt, pages, ref):
        self.slot, self.tokens, self.pages, self.pos = slot, list(prompt), pages, 0
        self.ref_seq = ref.new_sequence()

    def chunk(self, n):
        c = SeqChunk(self.slot, self.pos, self.tokens[self.pos:self.pos + n], self.pages,
                     sample=self.pos + n == len(self.tokens))
        return c


def _step(prog, params, state, seqs_and_sizes, ref):
    """One batched interpreter step; the reference runs each sequence's chunk on its own."""
    chunks = [s.chunk(n) for s, n in seqs_and_sizes]
    outs, state, _ = interpret(prog.step, step_inputs(chunks), params, state)
    logits = iter(outs["logits"])
    for (s, n), c in zip(seqs_and_sizes, chunks):
        ref_logits = ref.prefill(s.ref_seq, c.tokens)
        s.pos += n
        if c.sample:
            mine = next(logits)
            _close(mine, ref_logits, f"slot {s.slot} at position {s.pos - 1}")
            nxt = int(torch.argmax(mine))
            assert nxt == int(torch.argmax(ref_logits)), f"greedy token differs at position {s.pos}"
            s.tokens.append(nxt)
    return state


def test_interpreter_matches_reference_prefill_decode_and_drafts(tiny):
    prog, params, ref = tiny
    cfg = prog.cfg
    gen = torch.Generator().manual_seed(1)
    a = _Seq(0, torch.randint(3, cfg.vocab_size, (101,), generator=gen).tolist(), [0, 1], ref)
    b = _Seq(1, torch.randint(3, cfg.vocab_size, (77,), generator=gen).tolist(), [2, 3], ref)  # odd length
    state = allocate_state(prog.state, num_slots=2, num_pages=4)
    # A's whole prompt with B's first chunk, then B's second chunk (it straddles a ratio-2 group)
    # beside nothing, then both decode together for 40 steps (ring wrap, odd/even compressor states)
    state = _step(prog, params, state, [(a, 101), (b, 41)], ref)
    state = _step(prog, params, state, [(b, 36)], ref)
    for _ in range(40):
        state = _step(prog, params, state, [(a, 1), (b, 1)], ref)
    # DSpark: draft blocks for both sequences from their newest sampled tokens
    seqs = [DraftSeq(s.slot, s.tokens[-1], s.pos) for s in (a, b)]
    outs, _, _ = interpret(prog.draft, draft_inputs(seqs, cfg.dspark_block_size, cfg.dspark_noise_token_id),
                           params, state)
    for i, s in enumerate((a, b)):
        drafts, conf = ref.draft(s.ref_seq, s.tokens[-1])
        assert outs["drafts"][i].tolist() == drafts
        _close(outs["confidence"][i], conf, "draft confidence")
