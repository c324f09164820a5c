"""Config parsing and the per-layer schedule of spec §1 and §2 (independent of deepinfer.models)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# HF text_config key -> inference/config.json key (spec §1.1); either spelling is accepted.
_ALIASES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}


@dataclass
class Config:
    raw: dict
    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_experts: int
    topk_experts: int
    n_shared: int
    moe_inter: int
    route_scale: float
    norm_topk_prob: bool
    swiglu_limit: float
    gate_temp: float
    eps: float
    window: int
    ratios: list
    kv_sources: list
    index_sources: list
    index_k_sources: list
    candidate_source: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    yarn: dict | None
    hc_mult: int
    hc_iters: int
    hc_eps: float
    engram_layers: list
    engram_num_embeddings: list
    engram_max_ngram: int
    engram_vocab_size: int
    engram_heads: int
    engram_head_dim: int
    engram_pad_token: int
    engram_compressed_vocab: int
    n_mtp: int
    dspark_block: int
    dspark_noise_token: int
    dspark_targets: list
    dspark_markov_rank: int
    dspark_experts: int
    dspark_topk: int
    roles: list = field(default_factory=list)

    @staticmethod
    def load(path: str | Path) -> "Config":
        d = json.loads(Path(path).read_text())
        return Config.from_dict(d)

    @staticmethod
    def from_dict(root: dict) -> "Config":
        t = dict(root.get("text_config", root))

        def get(key, default=KeyError):
            if key in t:
                return t[key]
            if key in _ALIASES and _ALIASES[key] in t:
                return t[_ALIASES[key]]
            if default is KeyError:
                raise KeyError(f"config lacks {key!r}")
            return default

        rs = t.get("rope_scaling") or {}
        orig = rs.get("original_max_position_embeddings", t.get("original_seq_len", 0)) or 0
        yarn = None
        if orig > 0:
            yarn = dict(factor=rs.get("factor", t.get("rope_factor")),
                        beta_fast=rs.get("beta_fast", t.get("beta_fast")),
                        beta_slow=rs.get("beta_slow", t.get("beta_slow")), original=orig)
        cand = get("candidate_source_layer_id", None)
        if cand is not None and cand < 0:
            cand = None
        kv_sources = list(get("kv_source_layer_ids"))
        c = Config(
            raw=t, vocab_size=get("vocab_size"), hidden=get("hidden_size"), n_layers=get("num_hidden_layers"),
            n_heads=get("num_attention_heads"), head_dim=get("head_dim"), rope_dim=get("qk_rope_head_dim"),
            q_lora_rank=get("q_lora_rank"), o_groups=get("o_groups"), o_lora_rank=get("o_lora_rank"),
            n_experts=get("n_routed_experts"), topk_experts=get("num_experts_per_tok"),
            n_shared=get("n_shared_experts"), moe_inter=get("moe_intermediate_size"),
            route_scale=float(get("routed_scaling_factor")), norm_topk_prob=bool(get("norm_topk_prob", True)),
            swiglu_limit=float(get("swiglu_limit")), gate_temp=float(get("gate_temp", 1.0)),
            eps=float(get("rms_norm_eps")), window=get("sliding_window"), ratios=list(get("compress_ratios")),
            kv_sources=kv_sources, index_sources=list(get("index_source_layer_ids")),
            index_k_sources=list(get("index_k_source_layer_ids", kv_sources)), candidate_source=cand,
            candidate_topk_blocks=get("candidate_topk_blocks", 0), candidate_block_size=get("candidate_block_size", 1),
            index_heads=get("index_n_heads"), index_head_dim=get("index_head_dim"), index_topk=get("index_topk"),
            rope_theta=float(get("rope_theta")), compress_rope_theta=float(get("compress_rope_theta")), yarn=yarn,
            hc_mult=get("hc_mult"), hc_iters=get("hc_sinkhorn_iters"), hc_eps=float(get("hc_eps")),
            engram_layers=list(get("engram_layer_ids", [])),
            engram_num_embeddings=list(get("engram_num_embeddings", [])),
            engram_max_ngram=get("engram_max_ngram_size", 0), engram_vocab_size=get("engram_vocab_size", 0),
            engram_heads=get("engram_n_heads", 0), engram_head_dim=get("engram_head_dim", 0),
            engram_pad_token=get("engram_pad_token_id", 2),
            engram_compressed_vocab=get("engram_compressed_vocab_size", 0),
            n_mtp=get("num_nextn_predict_layers", 0), dspark_block=get("dspark_block_size", 0),
            dspark_noise_token=get("dspark_noise_token_id", 0), dspark_targets=list(get("dspark_target_layer_ids", [])),
            dspark_markov_rank=get("dspark_markov_rank", 0), dspark_experts=get("dspark_n_routed_experts", 0),
            dspark_topk=get("dspark_num_experts_per_tok", 0),
        )
        assert get("scoring_func") == "sqrtsoftplus", "only sqrt-softplus scoring is specified"
        assert c.n_shared == 1, "HF-REF asserts exactly one shared expert"
        assert len(c.ratios) == c.n_layers + c.n_mtp
        c.roles = [layer_role(c, l) for l in range(c.n_layers)]
        return c


@dataclass(frozen=True)
class Role:
    """What layer l does in attention (spec §2)."""
    layer: int
    ratio: int
    mode: str  # "W", "FULL", "REINDEX" or "REUSE"
    kv_owner: int | None  # whose compressed KV cache the layer reads (None for W)
    index_k_owner: int | None  # whose index-K cache the indexer scores (FULL/REINDEX)
    owns_compressor: bool
    owns_index_k: bool
    runs_indexer: bool
    candidate_source: bool  # builds the candidate pool
    in_pool: bool  # scores only inside the candidate pool (REINDEX after the candidate source)
    engram: bool


def layer_role(c: Config, l: int) -> Role:
    r = c.ratios[l]
    assert r in (0, 1, 2)
    engram = l in c.engram_layers
    if r == 0:
        return Role(l, 0, "W", None, None, False, False, False, False, False, engram)
    owners = [s for s in c.kv_sources if s <= l]
    assert owners, f"layer {l} has ratio {r} but no KV source at or before it"
    owner = max(owners)
    assert c.ratios[owner] == r, f"layer {l}: KV owner {owner} has a different ratio"  # §1.3 invariant 3
    runs_indexer = l in c.index_sources
    cand = c.candidate_source is not None and l == c.candidate_source
    in_pool = runs_indexer and c.candidate_source is not None and l > c.candidate_source
    if l in c.kv_sources:
        mode = "FULL"
    elif runs_indexer:
        mode = "REINDEX"
    else:
        mode = "REUSE"
    k_owner = owner if runs_indexer else None
    if runs_indexer:
        assert owner in c.index_k_sources, f"layer {l}: its KV owner {owner} owns no index K"
    return Role(l, r, mode, owner, k_owner, l == owner, l in c.index_k_sources and l == owner,
                runs_indexer, cand, in_pool, engram)
