"""DeepSeek-V4.1-Flash as IR graphs, built from its config alone (no weights, no device).

`build_model(cfg)` gives a `ModelProgram` of two graphs over one set of state buffers:
- `step`: one engine step of the target model over a ragged batch (prefill chunks and decode
  rows together). Outputs the fp32 logits of the sampled rows; also writes each DSpark stage's
  context keys for every row (the DeepInfer timing, spec §5.2).
- `draft`: the DSpark draft block (spec §5.3-5.4) for sequences whose next token t* was just
  sampled. It is its own graph because t* comes out of the sampler/verifier, which runs between
  the two. Outputs the block's drafts and confidence logits.

Spec notes (where the sources disagree or are silent, and what this graph does):
- Semantics follow HF-REF (§3.6 left column): wo_a dequantised to bf16, fp32 router and LM head,
  fp32 ratio-2 compressor, fake-quantised caches. The caches are held in their deployed formats
  (fp8 window ring, fp4 compressed KV / index K); dequantising them gives exactly the fake-quantised
  values, so the semantics are the same.
- Ties (indexer top-k, candidate blocks, router): lowest position / lowest expert id wins.
- Window rings have sliding_window + max_backtrack slots (134 for the real model, §6.4) so a
  rejected draft never evicts a key that is still needed; ratio-2 compressor state rings have
  ratio + max_backtrack - 1 slots (7) and the Engram history ring max_ngram - 1 + max_backtrack.
- Image tokens (with a vision config): the router selects with `bias_vl` and Engram leaves them
  out (DEAD in the n-grams, gate 0). The vision tower itself and the replacement of image-token
  embeddings by its outputs are not part of these graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Graph, quantized, shapes as sh, tensor, verify
from .config import LayerRole, ModelConfig, load_config
from .engram import engram_constants, load_engram_token_map

PAGE_TOKENS = 128  # raw tokens per page of the compressed caches (a page holds PAGE_TOKENS/r entries)

num_pages = sh.sym("num_pages")  # pages of the compressed caches in the pool
max_pages = sh.sym("max_pages")  # block-table width: pages of the longest sequence in the step
num_samples = sh.sym("num_samples")  # rows whose logits are computed (the sampled rows)


class BuildError(ValueError):
    """The config cannot be built into a graph; one line naming the layer and the reason."""


@dataclass
class ModelProgram:
    cfg: ModelConfig
    step: Graph
    draft: Graph
    state: dict[str, object] = field(default_factory=dict)  # state name -> type (shared)

    @property
    def graphs(self) -> dict[str, Graph]:
        return {"step": self.step, "draft": self.draft}


def max_backtrack(cfg: ModelConfig) -> int:
    """Rows a verification step can roll back: the draft block plus the bonus row (§6.4)."""
    return cfg.dspark_block_size + 1


def ring_len(cfg: ModelConfig) -> int:
    return cfg.sliding_window + max_backtrack(cfg)


def yarn_attr(cfg: ModelConfig, role: LayerRole):
    if not role.yarn:
        return None
    rs = cfg.rope_scaling
    return [float(rs.factor), int(rs.original_max_position_embeddings), float(rs.beta_fast), float(rs.beta_slow)]


def fp8_weight(out: int, inp: int):
    return quantized("fp8e4m3", (out, inp), "e8m0", (32, 32))


def fp4_experts(n: int, out: int, inp: int):
    return quantized("fp4e2m1", (n, out, inp), "e8m0", (1, 1, 32))


class _Builder:
    """Adds one model's nodes to a graph; `g` is the graph being built."""

    def __init__(self, cfg: ModelConfig, g: Graph, state: dict):
        self.cfg, self.g, self.state = cfg, g, state
        self.eps = cfg.rms_norm_eps
        self.written: dict[str, str] = {}

    # ---- leaves ---------------------------------------------------------------------------------
    def param(self, name: str, type_) -> str:
        if name not in self.g.types:
            self.g.add_param(name, type_)
        return name

    def state_buf(self, name: str) -> str:
        """The current version of state buffer `name` (after this step's write, if any)."""
        if name not in self.g.types:
            self.g.add_state(name, self.state[name])
        return self.written.get(name, name)

    def write(self, op: str, name: str, *inputs: str, **attrs) -> str:
        """An in-place write of state buffer `name`; later readers see the new version."""
        self.written[name] = self.g.add1(op, self.state_buf(name), *inputs, **attrs)
        return self.written[name]

    def norm(self, x: str, weight: str, width: int) -> str:
        return self.g.add1("rms_norm", x, self.param(weight, tensor("bf16", width)), eps=self.eps)

    def lin8(self, xq: str, weight: str, out: int, inp: int, out_dtype="bf16") -> str:
        return self.g.add1("gemm_fp8", xq, self.param(weight, fp8_weight(out, inp)), out_dtype=out_dtype)

    def quant8(self, x: str) -> str:
        return self.g.add1("quant_fp8", x, block=32)

    # ---- mHC ------------------------------------------------------------------------------------
    def mixes(self, r: str, prefix: str, sub: str):
        c, h = self.cfg.hc_mult, self.cfg.hidden_size
        n_mix = 2 * c + c * c
        raw = self.g.add1("hc_mix_gemm", r, self.param(f"{prefix}.hc_{sub}_fn", tensor("f32", n_mix, c * h)),
                          eps=self.eps)
        return self.g.add("hc_sinkhorn", [raw, self.param(f"{prefix}.hc_{sub}_scale", tensor("f32", 3)),
                                          self.param(f"{prefix}.hc_{sub}_base", tensor("f32", n_mix))],
                          {"copies": c, "iters": self.cfg.hc_sinkhorn_iters, "eps": self.cfg.hc_eps,
                           "post_mult": self.cfg.hc_post_mult_value})

    def block(self, role: LayerRole, r: str, pre_in: str | None, x0: str | None, attention):
        """One layer (spec §4.2 Block): attention and MoE sub-layers on the residual stream."""
        p = role.prefix
        a_pre, a_post, a_m = self.mixes(r, p, "attn")
        # the first collapse picks copy 0, which is the embedding itself
        collapsed = x0 if pre_in is None else self.g.add1("hc_collapse", r, pre_in)
        x = self.norm(collapsed, f"{p}.attn_norm.weight", self.cfg.hidden_size)
        r = self.g.add1("hc_expand", attention(role, x), r, a_post, a_m)
        f_pre, f_post, f_m = self.mixes(r, p, "ffn")
        x = self.norm(self.g.add1("hc_collapse", r, a_pre), f"{p}.ffn_norm.weight", self.cfg.hidden_size)
        r = self.g.add1("hc_expand", self.moe(role, x), r, f_post, f_m)
        return r, f_pre

    # ---- attention pieces -----------------------------------------------------------------------
    def rope(self, x: str, pos: str, role: LayerRole, rope_dim: int, **kw) -> str:
        return self.g.add1("rope", x, pos, rope_dim=rope_dim, theta=float(role.rope_theta),
                           yarn=yarn_attr(self.cfg, role), **kw)

    def q_and_window_kv(self, role: LayerRole, x: str, pos: str):
        """q [n, heads, D] after RoPE, the query LoRA latent (quantised) and this layer's fp8
        window keys (spec §4.4a)."""
        c, p = self.cfg, role.prefix
        xq = self.quant8(x)
        qr = self.norm(self.lin8(xq, f"{p}.attn.wq_a.weight", c.q_lora_rank, c.hidden_size),
                       f"{p}.attn.q_norm.weight", c.q_lora_rank)
        qrq = self.quant8(qr)
        q = self.lin8(qrq, f"{p}.attn.wq_b.weight", c.num_attention_heads * c.head_dim, c.q_lora_rank)
        q = self.g.add1("reshape", q, shape=[_rows(self.g, q), c.num_attention_heads, c.head_dim])
        q = self.rope(q, pos, role, c.qk_rope_head_dim)
        kv = self.norm(self.lin8(xq, f"{p}.attn.wkv.weight", c.head_dim, c.hidden_size),
                       f"{p}.attn.kv_norm.weight", c.head_dim)
        kvq = self.quant8(self.rope(kv, pos, role, c.qk_rope_head_dim))
        return q, qrq, kvq

    def attn_out(self, role: LayerRole, o: str, pos: str) -> str:
        """De-rotate the value tail, then the grouped low-rank output projection (spec §4.4f-g)."""
        c, p = self.cfg, role.prefix
        o = self.rope(o, pos, role, c.qk_rope_head_dim, inverse=True)
        o = self.g.add1("reshape", o, shape=[_rows(self.g, o), c.num_attention_heads * c.head_dim])
        wo_a = self.param(f"{p}.attn.wo_a.weight", fp8_weight(
            c.o_groups * c.o_lora_rank, c.num_attention_heads * c.head_dim // c.o_groups))
        u = self.g.add1("grouped_linear", o, wo_a, groups=c.o_groups, weight_dtype="bf16")
        return self.lin8(self.quant8(u), f"{p}.attn.wo_b.weight", c.hidden_size, c.o_groups * c.o_lora_rank)

    def sink(self, role: LayerRole) -> str:
        return self.param(f"{role.prefix}.attn.attn_sink", tensor("f32", self.cfg.num_attention_heads))

    # ---- MoE ------------------------------------------------------------------------------------
    def moe(self, role: LayerRole, x: str) -> str:
        """sqrt-softplus routing, noaux_tc selection, routed experts + the shared expert (§4.5)."""
        c, p, g = self.cfg, role.prefix, self.g
        e, k, h, f = role.n_experts, role.top_k, c.hidden_size, c.moe_intermediate_size
        logits = g.add1("linear", x, self.param(f"{p}.ffn.gate.weight", tensor("bf16", e, h)),
                        out_dtype="f32", compute="f32")
        if c.gate_temp != 1.0:
            logits = g.add1("scale", logits, factor=1.0 / c.gate_temp)
        s = g.add1("sqrt", g.add1("softplus", logits))
        bias = self.param(f"{p}.ffn.gate.bias", tensor("f32", e))
        if c.vision and not role.is_draft:  # image tokens select with bias_vl; drafts are text
            bias = g.add1("route_bias", self.ids, bias, self.param(f"{p}.ffn.gate.bias_vl", tensor("f32", e)),
                          image_token_id=c.image_token_id)
        biased = g.add1("add", s, bias)
        sel = g.add1("topk_ids", biased, k=k)
        wt = g.add1("route_weights", s, sel, scale=float(c.routed_scaling_factor), renorm=c.norm_topk_prob)
        xq = self.quant8(x)
        routed = g.add1("moe_experts", xq, sel, wt,
                        self.param(f"{p}.ffn.experts.w1", fp4_experts(e, f, h)),
                        self.param(f"{p}.ffn.experts.w3", fp4_experts(e, f, h)),
                        self.param(f"{p}.ffn.experts.w2", fp4_experts(e, h, f)), limit=float(c.swiglu_limit))
        gate = self.lin8(xq, f"{p}.ffn.shared_experts.w1.weight", f, h)
        up = self.lin8(xq, f"{p}.ffn.shared_experts.w3.weight", f, h)
        act = g.add1("swiglu", gate, up, limit=float(c.swiglu_limit))
        shared = self.lin8(self.quant8(act), f"{p}.ffn.shared_experts.w2.weight", h, f)
        total = g.add1("add", routed, g.add1("cast", shared, dtype="f32"))
        return g.add1("cast", total, dtype="bf16")


def _rows(g: Graph, value: str):
    """The row dim of a value as a reshape attribute (an int, or the symbol's name)."""
    d = g.types[value].shape[0]
    return d if isinstance(d, int) else sh.dim_str(d)


# ---- the step graph -----------------------------------------------------------------------------

class _StepBuilder(_Builder):
    def __init__(self, cfg, g, state):
        super().__init__(cfg, g, state)
        n = sh.num_tokens
        self.ids = g.add_input("token_ids", tensor("i64", n))
        self.pos = g.add_input("positions", tensor("i64", n))
        self.tseq = g.add_input("token_seq", tensor("i32", n))
        self.slots = g.add_input("seq_slots", tensor("i32", sh.num_seqs))
        self.btab = g.add_input("block_table", tensor("i32", sh.num_seqs, max_pages))
        self.rows = g.add_input("sample_rows", tensor("i64", num_samples))
        self.meta = [self.pos, self.tseq]
        self.topk: str | None = None  # the latest top-k list, reused by REUSE layers
        self.cand: str | None = None  # the candidate pool of the candidate source
        self.taps: list[str] = []

    def build(self):
        c, g = self.cfg, self.g
        hashes = self.engram_hashes() if c.engram_layer_ids else {}
        x0 = g.add1("embedding", self.ids, self.param("embed.weight", tensor("bf16", c.vocab_size, c.hidden_size)),
                    name="x0")
        r = g.add1("hc_repeat", x0, copies=c.hc_mult)
        pre = None
        for role in c.backbone:
            if role.engram:
                r = self.engram(role, r, hashes[role.index])
            if role.is_dspark_target:
                self.taps.append(g.add1("hc_mean", r))
            r, pre = self.block(role, r, pre, x0, self.attention)
        h = g.add1("hc_collapse", r, pre)
        hs = self.norm(g.add1("gather_rows", h, self.rows), "norm.weight", c.hidden_size)
        head = self.param("head.weight", tensor("bf16", c.vocab_size, c.hidden_size))
        logits = g.add1("linear", hs, head, out_dtype="f32", compute="f32", name="logits")
        if c.n_mtp:
            self.dspark_context_keys()
        g.set_outputs(logits)

    # ---- Engram ---------------------------------------------------------------------------------
    def engram_hashes(self) -> dict[int, str]:
        c, g = self.cfg, self.g
        tmap = load_engram_token_map()
        if len(tmap) != c.vocab_size:
            raise BuildError(f"engram: the token map has {len(tmap)} ids but vocab_size is {c.vocab_size}")
        cids = g.add1("lookup", self.param("engram.token_map", tensor("i32", c.vocab_size)), self.ids,
                      dead_ids=[c.image_token_id] if c.vision else [])
        hist = self.state_buf("engram.history")
        pad = int(tmap[c.engram_pad_token_id])
        grams = g.add1("engram_ngram_ids", cids, hist, self.pos, self.tseq, self.slots,
                       max_ngram=c.engram_max_ngram_size, pad=pad)
        self.write("engram_hist_write", "engram.history", cids, self.pos, self.tseq, self.slots)
        consts = engram_constants(c.engram_layer_ids, c.engram_vocab_size, c.engram_n_heads,
                                  c.engram_max_ngram_size, c.engram_compressed_vocab_size)
        return {lid: g.add1("engram_hash", grams, multipliers=[int(v) for v in k.multipliers],
                            primes=[int(v) for v in k.primes], offsets=[int(v) for v in k.offsets],
                            heads=c.engram_n_heads) for lid, k in consts.items()}

    def engram(self, role: LayerRole, r: str, cols: str) -> str:
        c, g, p = self.cfg, self.g, role.prefix
        rows = dict(zip(c.engram_layer_ids, c.engram_num_embeddings))[role.index]
        width = c.engram_columns * c.engram_head_dim
        table = self.param(f"{p}.engram.embed.weight", quantized("fp8e4m3", (rows, c.engram_head_dim), "e8m0", (1, 32)))
        e = g.add1("engram_gather", cols, table)
        kv = self.lin8(e, f"{p}.engram.wkv.weight", (c.hc_mult + 1) * c.hidden_size, width)
        qw = self.param(f"{p}.engram.q_weight", tensor("bf16", c.hc_mult, c.hidden_size))
        kw = self.param(f"{p}.engram.k_weight", tensor("bf16", c.hc_mult, c.hidden_size))
        if c.vision:
            return g.add1("engram_gate", r, kv, qw, kw, self.ids, eps=self.eps, image_token_id=c.image_token_id)
        return g.add1("engram_gate", r, kv, qw, kw, eps=self.eps)

    # ---- attention ------------------------------------------------------------------------------
    def attention(self, role: LayerRole, x: str) -> str:
        c, g = self.cfg, self.g
        q, qrq, kvq = self.q_and_window_kv(role, x, self.pos)
        ring = self.state_buf(f"swa.{role.index}")
        if role.ratio == 0:
            o = g.add1("window_attn", q, kvq, ring, self.sink(role), *self.meta, self.slots, window=c.sliding_window)
        else:
            if role.has_compressor:
                self.compress(role, x)
            if role.has_indexer:
                self.index(role, x, qrq)
            if self.topk is None or role.topk_from is None:
                raise BuildError(f"layer {role.index}: mode {role.mode} has no top-k list to attend with")
            ckv = self.state_buf(f"ckv.{role.kv_owner}")
            o = g.add1("sparse_attn", q, kvq, ring, ckv, self.topk, self.sink(role), *self.meta, self.slots,
                       self.btab, window=c.sliding_window, ratio=role.ratio, topk=c.index_topk)
        # the ring is written after the attention read it: a long chunk overwrites keys it still needs
        self.write("swa_write", f"swa.{role.index}", kvq, *self.meta, self.slots)
        return self.attn_out(role, o, self.pos)

    def compress(self, role: LayerRole, x: str) -> None:
        """The KV source's compressor (spec §4.4c) and the index keys of its new entries (§4.4d);
        both caches are written before this step's attention reads them."""
        c, g, p, rr = self.cfg, self.g, role.prefix, role.ratio
        d = c.head_dim
        wkv = self.param(f"{p}.attn.compressor.wkv.weight", tensor("bf16", d, c.hidden_size))
        if rr == 1:
            z = g.add1("linear", x, wkv, compute="bf16")
        else:
            wgate = self.param(f"{p}.attn.compressor.wgate.weight", tensor("bf16", d, c.hidden_size))
            xf = g.add1("cast", x, dtype="f32")
            lat = g.add1("linear", xf, wkv, compute="f32")
            score = g.add1("linear", xf, wgate, compute="f32")
            cstate = self.state_buf(f"cstate.{role.index}")
            pooled = g.add1("compress_pool", lat, score, cstate, *self.meta, self.slots, ratio=rr)
            self.write("compress_state_write", f"cstate.{role.index}", lat, score, *self.meta, self.slots)
            z = g.add1("cast", pooled, dtype="bf16")
        z = self.norm(z, f"{p}.attn.compressor.norm.weight", d)
        if role.owns_index_k:
            wk = self.param(f"{p}.attn.indexer.wk.weight", tensor("bf16", c.index_head_dim, d))
            ki = self.norm(g.add1("linear", z, wk, compute="bf16"), f"{p}.attn.indexer.k_norm.weight", c.index_head_dim)
            ki = self.rope(ki, self.pos, role, c.qk_rope_head_dim, pos_offset=1 - rr)
            kiq = g.add1("quant_fp4", ki, block=32, scale="ue8m0")
            self.write("compressed_write", f"ik.{role.index}", kiq, *self.meta, self.btab, ratio=rr)
        ckv = self.rope(z, self.pos, role, c.qk_rope_head_dim, pos_offset=1 - rr)
        ckvq = g.add1("quant_fp4", ckv, block=16, scale="e4m3")
        self.write("compressed_write", f"ckv.{role.index}", ckvq, *self.meta, self.btab, ratio=rr)

    def index(self, role: LayerRole, x: str, qrq: str) -> None:
        """The indexer (spec §4.4d-e): scores over the owner's index keys, the candidate pool at the
        candidate source, the pool restriction on later index sources, top-k."""
        c, g, p = self.cfg, self.g, role.prefix
        ih, idim = c.index_n_heads, c.index_head_dim
        qi = self.lin8(qrq, f"{p}.attn.indexer.wq_b.weight", ih * idim, c.q_lora_rank)
        qi = g.add1("reshape", qi, shape=[_rows(g, qi), ih, idim])
        qi = g.add1("quant_fp4", self.rope(qi, self.pos, role, c.qk_rope_head_dim), block=32, scale="ue8m0")
        wproj = self.param(f"{p}.attn.indexer.weights_proj.weight", tensor("bf16", ih, c.hidden_size))
        w = g.add1("scale", g.add1("linear", x, wproj, compute="bf16"), factor=(idim ** -0.5) * (ih ** -0.5))
        ik = self.state_buf(f"ik.{role.index_k_owner}")
        score = g.add1("indexer_scores", qi, w, ik, *self.meta, self.btab, ratio=role.ratio)
        if role.is_candidate_source:
            self.cand = g.add1("candidate_blocks", score, *self.meta, ratio=role.ratio,
                               block_size=c.candidate_block_size, topk_blocks=c.candidate_topk_blocks)
        elif role.uses_candidates:
            if self.cand is None:
                raise BuildError(f"layer {role.index}: scores inside the candidate pool but no pool exists yet")
            score = g.add1("candidate_mask", score, self.cand, block_size=c.candidate_block_size)
        self.topk = g.add1("topk_select", score, *self.meta, ratio=role.ratio, k=c.index_topk)

    # ---- DSpark context keys --------------------------------------------------------------------
    def dspark_context_keys(self) -> None:
        """main_x from the taps, then each stage's fp8 context key into its own ring (spec §5.2)."""
        c, g = self.cfg, self.g
        h = c.hidden_size
        if len(self.taps) * h != 3 * h:
            raise BuildError(f"dspark_target_layer_ids: expected 3 taps, got {len(self.taps)}")
        main = g.add1("concat", *self.taps, axis=-1)
        main_x = self.norm(self.lin8(self.quant8(main), "mtp.0.main_proj.weight", h, 3 * h),
                           "mtp.0.main_norm.weight", h)
        mq = self.quant8(main_x)
        for role in c.dspark_stages:
            p = role.prefix
            k = self.norm(self.lin8(mq, f"{p}.attn.wkv.weight", c.head_dim, h), f"{p}.attn.kv_norm.weight", c.head_dim)
            kq = self.quant8(self.rope(k, self.pos, role, c.qk_rope_head_dim))
            self.write("swa_write", f"swa.{role.index}", kq, *self.meta, self.slots)


# ---- the draft graph ----------------------------------------------------------------------------

class _DraftBuilder(_Builder):
    def __init__(self, cfg, g, state):
        super().__init__(cfg, g, state)
        b = cfg.dspark_block_size
        rows = b * sh.num_seqs
        self.first = g.add_input("draft_first", tensor("i64", sh.num_seqs))  # t*, sampled at P+1
        self.ids = g.add_input("block_ids", tensor("i64", rows))  # [t*, noise, noise, ...] per sequence
        self.pos = g.add_input("block_positions", tensor("i64", rows))  # P+1 .. P+block
        self.tseq = g.add_input("block_seq", tensor("i32", rows))
        self.slots = g.add_input("seq_slots", tensor("i32", sh.num_seqs))

    def build(self):
        c, g = self.cfg, self.g
        x0 = g.add1("embedding", self.ids, self.param("embed.weight", tensor("bf16", c.vocab_size, c.hidden_size)))
        r = g.add1("hc_repeat", x0, copies=c.hc_mult)
        pre = None
        for role in c.dspark_stages:
            r, pre = self.block(role, r, pre, x0, self.attention)
        hb = g.add1("hc_collapse", r, pre)
        last = c.dspark_stages[-1].prefix
        v, rank = c.vocab_size, c.dspark_markov_rank
        drafts, conf = g.add(
            "dspark_heads",
            [hb, self.first, self.param(f"{last}.norm.weight", tensor("bf16", c.hidden_size)),
             self.param("head.weight", tensor("bf16", v, c.hidden_size)),
             self.param(f"{last}.markov_head.embed.weight", tensor("bf16", v, rank)),
             self.param(f"{last}.markov_head.head.weight", tensor("bf16", v, rank)),
             self.param(f"{last}.confidence_head.proj.weight", tensor("bf16", 1, c.hidden_size + rank))],
            {"block": c.dspark_block_size, "eps": self.eps}, names=["drafts", "confidence"])
        g.set_outputs(drafts, conf)

    def attention(self, role: LayerRole, x: str) -> str:
        q, _, kvq = self.q_and_window_kv(role, x, self.pos)
        o = self.g.add1("dspark_block_attn", q, kvq, self.state_buf(f"swa.{role.index}"), self.sink(role),
                        self.pos, self.tseq, self.slots, window=self.cfg.sliding_window)
        return self.attn_out(role, o, self.pos)


# ---- entry points -------------------------------------------------------------------------------

def state_types(cfg: ModelConfig) -> dict:
    """Every cache the step and draft graphs share, in its deployed format (spec §6.1)."""
    d, slots = cfg.head_dim, sh.num_slots
    out = {}
    if cfg.engram_layer_ids:
        out["engram.history"] = tensor("i64", slots, cfg.engram_max_ngram_size - 1 + max_backtrack(cfg))
    for role in cfg.layers:
        out[f"swa.{role.index}"] = quantized("fp8e4m3", (slots, ring_len(cfg), d), "e8m0", (1, 1, 32))
        if role.has_compressor:
            entries = PAGE_TOKENS // role.ratio
            out[f"ckv.{role.index}"] = quantized("fp4e2m1", (num_pages, entries, d), "fp8e4m3", (1, 1, 16))
            if role.compressor_gate:
                out[f"cstate.{role.index}"] = tensor("f32", slots, role.ratio + max_backtrack(cfg) - 1, 2, d)
        if role.owns_index_k:
            entries = PAGE_TOKENS // role.ratio
            out[f"ik.{role.index}"] = quantized("fp4e2m1", (num_pages, entries, cfg.index_head_dim), "e8m0",
                                                (1, 1, 32))
    return out


def build_model(cfg: ModelConfig | str) -> ModelProgram:
    """Both graphs of the model from its config (a preset name, a directory or a ModelConfig)."""
    if isinstance(cfg, str):
        cfg = load_config(cfg)
    state = state_types(cfg)
    step = Graph(f"{_name(cfg)}_step")
    _StepBuilder(cfg, step, state).build()
    draft = Graph(f"{_name(cfg)}_draft")
    if cfg.n_mtp:
        _DraftBuilder(cfg, draft, state).build()
    return ModelProgram(cfg, verify(step), verify(draft) if cfg.n_mtp else draft, state)


def _name(cfg: ModelConfig) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in (cfg.model_id or "model"))


# ---- weights ------------------------------------------------------------------------------------

TOKEN_MAP_SOURCE = "data:engram_token_map_v41"


def param_sources(program: ModelProgram) -> dict[str, list[str]]:
    """Graph param -> the checkpoint tensors it is made of, in order: a quantised param is
    [weight, scale]; stacked routed experts are [e0.weight, e0.scale, e1.weight, ...]; the Engram
    token map is the shipped data file (`data:` source), not a checkpoint tensor."""
    out: dict[str, list[str]] = {}
    for g in program.graphs.values():
        for name in g.params:
            t = g.types[name]
            if name == "engram.token_map":
                out[name] = [TOKEN_MAP_SOURCE]
            elif ".ffn.experts." in name:
                prefix, w = name.rsplit(".experts.", 1)
                out[name] = [f"{prefix}.experts.{e}.{w}.{k}" for e in range(t.shape[0]) for k in ("weight", "scale")]
            elif hasattr(t, "scale"):
                out[name] = [name, name[: -len(".weight")] + ".scale"]
            else:
                out[name] = [name]
    return out


def materialize_params(sources: dict[str, list[str]], checkpoint) -> dict:
    """Graph params from their sources (see param_sources) and a checkpoint mapping
    (name -> tensor, models.checkpoint): one tensor as is, [weight, scale] as a quantised value,
    a longer list as the stack of its [weight, scale] pairs."""
    import torch

    from ..ir.quant import QTensor

    params = {}
    for name, src in sources.items():
        if src == [TOKEN_MAP_SOURCE]:
            params[name] = torch.from_numpy(load_engram_token_map().astype("int32"))
        elif len(src) == 1:
            params[name] = checkpoint[src[0]]
        elif len(src) == 2:
            params[name] = QTensor(checkpoint[src[0]], checkpoint[src[1]])
        else:
            params[name] = QTensor(torch.stack([checkpoint[s] for s in src[0::2]]),
                                   torch.stack([checkpoint[s] for s in src[1::2]]))
    return params


def load_params(program: ModelProgram, checkpoint) -> dict:
    """Every param of the program's graphs from a checkpoint mapping."""
    return materialize_params(param_sources(program), checkpoint)
