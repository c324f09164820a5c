"""Parameter counts, shipped bytes and cache sizes of a config, derived from its checkpoint schema (§12.1, §6)."""
from __future__ import annotations

from collections import defaultdict

from .checkpoint import checkpoint_schema
from .config import ModelConfig


def kv_entry_bytes(cfg: ModelConfig) -> tuple[int, int]:
    """(compressed main KV, index K) bytes per cache entry as deployed (§6.1).

    Main KV: FP4 with an E4M3 scale per 16 (288 B for D=512), or MXFP8 (e4m3 + ue8m0 per 32, 528 B)
    when use_fp4_sparse_kv is false. Index K: FP4 with a UE8M0 scale per 32 (68 B for 128 dims).
    """
    D, d = cfg.head_dim, cfg.index_head_dim
    main = D // 2 + D // 16 if cfg.use_fp4_sparse_kv else D + D // 32
    return main, d // 2 + d // 32


def window_entry_bytes(cfg: ModelConfig) -> int:
    """One window-ring slot: the 512-d latent as e4m3 plus a UE8M0 scale per 32 (528 B)."""
    return cfg.head_dim + cfg.head_dim // 32


def global_kv_bytes_per_token(cfg: ModelConfig) -> float:
    """Shared compressed KV + index K per token of context, summed over the KV owners (§6.2)."""
    main, idx = kv_entry_bytes(cfg)
    total = 0.0
    for owner in cfg.kv_source_layer_ids:
        entry = main + (idx if owner in cfg.index_k_sources else 0)
        total += entry / cfg.compress_ratios[owner]
    return total


def model_sizes(cfg: ModelConfig, ring_slots: int | None = None) -> dict[str, float]:
    """Counts from the schema. `ring_slots` defaults to the window (HF-REF); DI uses window + 6.

    Parts: backbone = everything but Engram (tables + projections) and DSpark, globals included.
    Activated per decode token (§12.1): attention + mHC + norms, router + shared experts, top-k
    routed experts of each layer, Engram projections and the LM head; DSpark excluded.
    """
    specs = checkpoint_schema(cfg)
    params: dict[tuple[str, str], int] = defaultdict(int)
    nbytes: dict[tuple[str, str], int] = defaultdict(int)
    for s in specs:
        params[(s.part, s.group)] += s.params
        nbytes[(s.part, s.group)] += s.nbytes

    def p(part=None, group=None) -> int:
        return sum(v for (pa, g), v in params.items() if part in (None, pa) and group in (None, g))

    def b(part=None, group=None) -> int:
        return sum(v for (pa, g), v in nbytes.items() if part in (None, pa) and group in (None, g))

    one_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size
    routed_active = cfg.n_layers * cfg.num_experts_per_tok * one_expert
    head = cfg.vocab_size * cfg.hidden_size
    attention = p("backbone", "attention") + p("global", "attention")
    activated = attention + p("backbone", "router_shared") + routed_active + p("engram", "engram_proj") + head
    slots = cfg.sliding_window if ring_slots is None else ring_slots
    return {
        "params_total": p(),
        "params_backbone": p("backbone") + p("global"),
        "params_engram": p("engram"),
        "params_engram_tables": p("engram", "engram_tables"),
        "params_engram_proj": p("engram", "engram_proj"),
        "params_dspark": p("dspark"),
        "params_routed_experts": p("backbone", "routed_experts"),
        "params_attention": attention,
        "params_router_shared": p("backbone", "router_shared"),
        "params_embed_head": p("global", "embed_head"),
        "params_activated": activated,
        "params_activated_no_head": activated - head,
        "bytes_total": b(),
        "bytes_backbone": b("backbone") + b("global"),
        "bytes_engram": b("engram"),
        "bytes_engram_tables": b("engram", "engram_tables"),
        "bytes_dspark": b("dspark"),
        "bytes_routed_experts": b("backbone", "routed_experts"),
        "bytes_attention": b("backbone", "attention") + b("global", "attention"),
        "bytes_router_shared": b("backbone", "router_shared"),
        "bytes_embed_head": b("global", "embed_head"),
        "n_tensors": len(specs),
        "global_kv_bytes_per_token": global_kv_bytes_per_token(cfg),
        "window_ring_bytes_per_sequence": len(cfg.layers) * slots * window_entry_bytes(cfg),
    }
