"""Model configuration: HF-style config.json -> a validated, frozen `ModelConfig` with its topology.

`load_config(model)` takes a preset name (`v4.1-flash`, `v4.1-flash-medium`, `v4.1-flash-tiny`, and
`v4.1-flash-smooth`: the tiny model with every expert active and top-k wider than any test context, so
that no discrete choice can flip between kernels and the reference) or a
directory holding a config.json, either the HF root layout (`text_config` + `vision_config`) or a
flat text config. Every text key of spec §1.1 becomes a typed field; the optional DeepInfer keys of
§1.2 take their defaults. The per-layer schedule of §2 is resolved into `LayerRole`s and checked
against the invariants of §1.3; any violation is a `ConfigError` whose message is one line naming
the key and the problem.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
import types
import warnings
from typing import Any, get_args, get_type_hints

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
PRESETS = ("v4.1-flash", "v4.1-flash-medium", "v4.1-flash-tiny", "v4.1-flash-smooth")

MODES = ("W", "FULL", "REINDEX", "REUSE")

# The only checkpoint format the schema, the loader and the kernels know (§1.1, checked as DI does).
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}


class ConfigError(ValueError):
    """A config that cannot describe a V4.1 model; the message is one line naming the key."""


class ConfigWarning(UserWarning):
    """A config DeepInfer reads in part: keys it ignores (a misspelt key would silently take its default)."""


# model_type of the HF root config and of its text_config (a flat text config may carry either).
MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
# Root keys of the HF layout besides the ones read; and keys every HF config carries that say nothing
# about the model.
_LAYOUT_KEYS = ("model_type", "architectures", "quantization_config", "text_config", "vision_config", "torch_dtype")
_HF_KEYS = ("transformers_version", "_name_or_path", "auto_map", "use_cache", "initializer_range")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str
    factor: float
    original_max_position_embeddings: int  # > 0 switches YaRN on for ratio>0 layers
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class LayerRole:
    """What one layer (backbone 0..n_layers-1, DSpark stage n_layers+s) does; spec §2."""

    index: int
    is_draft: bool
    ratio: int
    mode: str  # "W" | "FULL" | "REINDEX" | "REUSE"
    kv_owner: int | None  # the layer whose compressed KV cache this layer reads
    index_k_owner: int | None  # the layer whose index-K cache the top-k scoring reads
    topk_from: int | None  # the layer whose top-k list this layer attends with
    is_candidate_source: bool
    uses_candidates: bool  # scores only inside the candidate pool of the candidate source
    has_compressor: bool
    compressor_gate: bool  # ratio-2 compressors pool with a softmax gate; ratio 1 has none
    has_indexer: bool  # runs its own index query (indexer.wq_b, weights_proj)
    owns_index_k: bool  # owns indexer.wk / k_norm and writes the index-K cache
    engram: bool
    is_dspark_target: bool  # its attention-input stream is tapped for DSpark
    rope_theta: float
    yarn: bool
    n_experts: int
    top_k: int
    draft_stage: int | None  # s for DSpark stage `mtp.s`, else None

    @property
    def prefix(self) -> str:
        """Checkpoint name prefix: `layers.{i}` or `mtp.{s}`."""
        return f"mtp.{self.draft_stage}" if self.is_draft else f"layers.{self.index}"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    # ---- text keys of spec §1.1 (HF `text_config` names) ----
    model_type: str = "deepseek_v41_text"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int
    hidden_act: str = "silu"
    attention_bias: bool = False
    attention_dropout: float = 0.0
    rms_norm_eps: float
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int | None  # null or -1 disables candidates
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: RopeScaling | None
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool
    routed_scaling_factor: float
    gate_temp: float = 1.0  # inference/config.json field; no text_config key carries it (§1.1)
    first_k_dense_replace: int = 0
    swiglu_limit: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...] = ()  # derived from the primes when absent (§4.3)
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    # ---- optional DeepInfer keys (§1.2) ----
    index_k_source_layer_ids: tuple[int, ...] | None = None  # None: the KV sources (HF-REF rule)
    hc_shifted: bool = True
    use_fp4_sparse_kv: bool = True
    dspark_target_attn_input: bool = True
    use_qnorm: bool = False
    hc_post_mult_value: float = 2.0
    rope_interleaved: bool = True
    kv_lora_norm_out_scale: float = 1.0
    v_scaling_factor: float = 1.0
    # ---- root keys ----
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    dtype: str = "bfloat16"
    vision: bool = False  # a vision tower exists: routers carry `bias_vl`
    # ---- resolved (not read from the file) ----
    layers: tuple[LayerRole, ...] = field(default=(), compare=False)
    n_prefill_layer: int = field(default=0, compare=False)
    config_hash: str = field(default="", compare=False)
    model_id: str = field(default="", compare=False)
    source: str = field(default="", compare=False, repr=False)  # path of the config.json read

    # ---- derived sizes ----
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def n_mtp(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def dspark_stages(self) -> tuple[LayerRole, ...]:
        return self.layers[self.n_layers:]

    @property
    def backbone(self) -> tuple[LayerRole, ...]:
        return self.layers[: self.n_layers]

    @property
    def index_k_sources(self) -> tuple[int, ...]:
        return self.kv_source_layer_ids if self.index_k_source_layer_ids is None else self.index_k_source_layer_ids

    @property
    def candidates_enabled(self) -> bool:
        return self.candidate_source_layer_id is not None

    @property
    def engram_columns(self) -> int:
        """Hash columns per Engram layer: n-gram sizes 2..max times heads (24 for the real model)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def yarn_enabled(self) -> bool:
        return self.rope_scaling is not None and self.rope_scaling.original_max_position_embeddings > 0

    def layer_role(self, i: int) -> LayerRole:
        if not 0 <= i < len(self.layers):
            raise IndexError(f"layer {i} out of range 0..{len(self.layers) - 1}")
        return self.layers[i]

    def canonical_dict(self) -> dict[str, Any]:
        """Every read key as a JSON-ready dict: the form that `config_hash` covers."""
        return _canonical(self)


_RESOLVED = {"layers", "n_prefill_layer", "config_hash", "model_id", "source"}
_ROOT_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "dtype")
_TYPES = get_type_hints(ModelConfig)
# Keys whose value in the V4.1 graph is fixed: any other value would describe a different model.
_FIXED = {
    "num_key_value_heads": 1,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 0,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "hc_shifted": True,
    "dspark_target_attn_input": True,
    "use_qnorm": False,
    "hc_post_mult_value": 2.0,
    "rope_interleaved": True,
    "kv_lora_norm_out_scale": 1.0,
    "v_scaling_factor": 1.0,
}


def _canonical(cfg: ModelConfig) -> dict[str, Any]:
    out = {}
    for f in fields(cfg):
        if f.name in _RESOLVED:
            continue
        v = getattr(cfg, f.name)
        if isinstance(v, RopeScaling):
            v = asdict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------

def load_config(model: str | os.PathLike) -> ModelConfig:
    """A preset name or a directory (or config.json path) -> validated ModelConfig."""
    name = os.fspath(model)
    if name in PRESETS:
        path, model_id = PRESETS_DIR / name / "config.json", name
    else:
        p = Path(name)
        if p.is_dir():
            path, model_id = p / "config.json", p.resolve().name
        elif p.is_file() and p.suffix == ".json":
            path, model_id = p, p.resolve().parent.name
        else:
            raise ConfigError(f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}) "
                              f"and not a directory holding config.json")
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json there")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{path}: malformed JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a JSON object, got {type(data).__name__}")
    try:
        cfg = config_from_dict(data, model_id=model_id, source=str(path))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    unknown = unknown_keys(data)
    if unknown:
        warnings.warn(ConfigWarning(f"{path}: unknown keys ignored: {', '.join(unknown)}"), stacklevel=2)
    return cfg


def unknown_keys(data: dict) -> list[str]:
    """Keys of a config.json that no field reads (text_config's prefixed with `text_config.`)."""
    read = {f.name for f in fields(ModelConfig) if f.name not in _RESOLVED and f.name != "vision"}
    if isinstance(data.get("text_config"), dict):
        root = [k for k in data if k not in _ROOT_KEYS and k not in _LAYOUT_KEYS and k not in _HF_KEYS]
        return root + [f"text_config.{k}" for k in data["text_config"] if k not in read and k not in _HF_KEYS]
    return [k for k in data if k not in read and k not in _LAYOUT_KEYS and k not in _HF_KEYS]


def config_from_dict(data: dict, model_id: str = "", source: str = "") -> ModelConfig:
    """Build a ModelConfig from a parsed HF root config or a flat text config."""
    if "text_config" in data:
        text, root = data["text_config"], data
        if not isinstance(text, dict):
            raise ConfigError("text_config: must be an object")
    else:
        text, root = data, data
    for where, d in (("", root), ("text_config.", text)) if text is not root else (("", root),):
        if "model_type" in d and d["model_type"] not in MODEL_TYPES:
            raise ConfigError(f"{where}model_type: {json.dumps(d['model_type'])} is not a DeepSeek-V4.1 model "
                              f"(expected {' or '.join(MODEL_TYPES)})")
    if "dim" in text and "hidden_size" not in text:
        raise ConfigError("hidden_size: missing; this looks like inference/config.json (dim, n_layers, ...), "
                          "give the HF config.json instead")

    values: dict[str, Any] = {}
    for f in fields(ModelConfig):
        if f.name in _RESOLVED or f.name == "vision":
            continue
        src = root if f.name in _ROOT_KEYS else text
        key = f.name
        if f.name == "dtype" and "dtype" not in src and "torch_dtype" in src:
            key = "torch_dtype"
        if key in src:
            values[f.name] = _convert(f.name, src[key], _TYPES[f.name])
        elif f.name in _ROOT_KEYS and f.name in text:
            values[f.name] = _convert(f.name, text[f.name], _TYPES[f.name])
        elif f.default is MISSING:
            raise ConfigError(f"{f.name}: missing required key")
    values["vision"] = _vision_enabled(root)
    if "quantization_config" in root:
        _check_quantization(root["quantization_config"])

    cfg = ModelConfig(**values)
    _check_values(cfg)
    if not cfg.engram_num_embeddings:
        cfg = replace(cfg, engram_num_embeddings=tuple(engram_table_rows(cfg)))
    layers, n_prefill = _resolve_topology(cfg)
    canonical = json.dumps(_canonical(cfg), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return replace(cfg, layers=layers, n_prefill_layer=n_prefill,
                    config_hash=hashlib.sha256(canonical.encode()).hexdigest(),
                    model_id=model_id, source=source)


def _convert(key: str, value: Any, typ) -> Any:
    """JSON value -> the field's type, or ConfigError naming the key."""
    args = get_args(typ) if isinstance(typ, types.UnionType) else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), typ) if args else typ
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: must not be null")
    if base is RopeScaling:
        return _rope_scaling(value)
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: must be true or false, got {json.dumps(value)}")
        return value
    if base is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{key}: must be an integer, got {json.dumps(value)}")
        if key == "candidate_source_layer_id" and value == -1:
            return None
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {json.dumps(value)}")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: must be a string, got {json.dumps(value)}")
        return value
    if getattr(base, "__origin__", None) is tuple:
        if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise ConfigError(f"{key}: must be a list of integers, got {json.dumps(value)}")
        return tuple(value)
    raise TypeError(f"ModelConfig.{key}: no JSON conversion for type {typ}")


def _rope_scaling(value: Any) -> RopeScaling:
    if not isinstance(value, dict):
        raise ConfigError(f"rope_scaling: must be an object or null, got {json.dumps(value)}")
    rope_type = value.get("rope_type", value.get("type", "yarn"))
    if rope_type != "yarn":
        raise ConfigError(f"rope_scaling.rope_type: must be 'yarn', got {rope_type!r}")
    out = {}
    for k, kind in (("factor", float), ("original_max_position_embeddings", int),
                    ("beta_fast", float), ("beta_slow", float)):
        if k not in value:
            raise ConfigError(f"rope_scaling.{k}: missing required key")
        v = value[k]
        ok = isinstance(v, int) if kind is int else isinstance(v, (int, float)) and math.isfinite(v)
        if not ok or isinstance(v, bool):
            raise ConfigError(f"rope_scaling.{k}: must be {'an integer' if kind is int else 'a number'}, "
                              f"got {json.dumps(v)}")
        out[k] = kind(v)
    if out["factor"] <= 0:
        raise ConfigError(f"rope_scaling.factor: must be > 0, got {out['factor']}")
    if out["original_max_position_embeddings"] < 0:
        raise ConfigError("rope_scaling.original_max_position_embeddings: must be >= 0")
    return RopeScaling(rope_type="yarn", **out)


def _vision_enabled(root: dict) -> bool:
    vc = root.get("vision_config")
    if vc is None:
        return False
    if not isinstance(vc, dict):
        raise ConfigError("vision_config: must be an object or null")
    for key in ("num_hidden_layers", "vision_n_layers", "depth"):
        if key in vc:
            n = vc[key]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ConfigError(f"vision_config.{key}: must be an integer >= 0, got {json.dumps(n)}")
            return n > 0
    raise ConfigError("vision_config.num_hidden_layers: missing (0 disables vision)")


def _check_quantization(qc: Any) -> None:
    if not isinstance(qc, dict):
        raise ConfigError("quantization_config: must be an object")
    if "fmt" in qc:
        raise ConfigError("quantization_config.fmt: unexpected key (V4.1 uses scale_fmt)")
    for k, want in QUANTIZATION_CONFIG.items():
        if k not in qc:
            raise ConfigError(f"quantization_config.{k}: missing (expected {json.dumps(want)})")
        if qc[k] != want:
            raise ConfigError(f"quantization_config.{k}: must be {json.dumps(want)}, got {json.dumps(qc[k])}")


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------

def _check_values(c: ModelConfig) -> None:
    for k, want in _FIXED.items():
        if getattr(c, k) != want:
            raise ConfigError(f"{k}: must be {json.dumps(want)} for V4.1, got {json.dumps(getattr(c, k))}")
    positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "max_position_embeddings",
                "sliding_window", "candidate_topk_blocks", "candidate_block_size", "index_n_heads",
                "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "engram_n_heads", "engram_head_dim",
                "engram_vocab_size", "engram_compressed_vocab_size", "dspark_markov_rank",
                "dspark_n_routed_experts", "dspark_num_experts_per_tok", "rope_theta",
                "compress_rope_theta", "rms_norm_eps", "hc_eps", "routed_scaling_factor",
                "gate_temp", "swiglu_limit")
    for k in positive:
        if getattr(c, k) <= 0:
            raise ConfigError(f"{k}: must be > 0, got {getattr(c, k)}")
    for k in ("num_nextn_predict_layers", "dspark_block_size", "engram_pad_token_id", "dspark_noise_token_id",
              "bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(c, k) < 0:
            raise ConfigError(f"{k}: must be >= 0, got {getattr(c, k)}")
    if c.engram_max_ngram_size < 2:
        raise ConfigError(f"engram_max_ngram_size: must be >= 2 (n-grams of size 2..max), got {c.engram_max_ngram_size}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError(f"num_experts_per_tok: {c.num_experts_per_tok} > n_routed_experts {c.n_routed_experts}")
    if c.dspark_num_experts_per_tok > c.dspark_n_routed_experts:
        raise ConfigError(f"dspark_num_experts_per_tok: {c.dspark_num_experts_per_tok} > "
                          f"dspark_n_routed_experts {c.dspark_n_routed_experts}")
    if c.dspark_block_size > 32:
        raise ConfigError(f"dspark_block_size: must be <= 32, got {c.dspark_block_size}")
    for k in ("engram_pad_token_id", "dspark_noise_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(c, k) >= c.vocab_size:
            raise ConfigError(f"{k}: {getattr(c, k)} is outside the vocabulary (vocab_size {c.vocab_size})")

    # Block sizes of the formats (§3.3-3.5) and the divisibility rules of §12.2.
    mult32 = {
        "hidden_size": c.hidden_size,
        "q_lora_rank": c.q_lora_rank,
        "moe_intermediate_size": c.moe_intermediate_size,
        "o_groups*o_lora_rank": c.o_groups * c.o_lora_rank,
        "head_dim": c.head_dim,
        "index_head_dim": c.index_head_dim,
        "engram_head_dim": c.engram_head_dim,
        "engram columns*engram_head_dim": c.engram_columns * c.engram_head_dim,
        "len(dspark_target_layer_ids)*hidden_size": len(c.dspark_target_layer_ids) * c.hidden_size,
    }
    for k, v in mult32.items():
        if v % 32:
            raise ConfigError(f"{k}: {v} is not a multiple of 32 (FP8/FP4 block size)")
    if c.head_dim % 16:
        raise ConfigError(f"head_dim: {c.head_dim} is not a multiple of 16 (FP4 KV groups)")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim: {c.qk_rope_head_dim} must be even (interleaved pairs)")
    if c.qk_rope_head_dim > c.index_head_dim:
        raise ConfigError(f"qk_rope_head_dim: {c.qk_rope_head_dim} > index_head_dim {c.index_head_dim}")
    if c.qk_rope_head_dim > c.head_dim:
        raise ConfigError(f"qk_rope_head_dim: {c.qk_rope_head_dim} > head_dim {c.head_dim}")
    if c.num_attention_heads % c.o_groups:
        raise ConfigError(f"o_groups: num_attention_heads {c.num_attention_heads} is not divisible by {c.o_groups}")

    n, total = c.num_hidden_layers, c.num_hidden_layers + c.num_nextn_predict_layers
    if len(c.compress_ratios) != total:
        raise ConfigError(f"compress_ratios: has {len(c.compress_ratios)} entries, expected "
                          f"num_hidden_layers + num_nextn_predict_layers = {total}")
    for i, r in enumerate(c.compress_ratios):
        if r not in (0, 1, 2):
            raise ConfigError(f"compress_ratios: entry {i} is {r}, must be 0, 1 or 2")
        if i >= n and r != 0:
            raise ConfigError(f"compress_ratios: DSpark stage {i - n} (entry {i}) has ratio {r}, must be 0")

    def layer_list(key: str, ids: tuple[int, ...], need_ratio: bool) -> None:
        if list(ids) != sorted(set(ids)):
            raise ConfigError(f"{key}: must be strictly increasing, got {list(ids)}")
        for i in ids:
            if not 0 <= i < n:
                raise ConfigError(f"{key}: layer {i} is not a backbone layer (0..{n - 1})")
            if need_ratio and c.compress_ratios[i] == 0:
                raise ConfigError(f"{key}: layer {i} has compress ratio 0 (no compressed KV)")

    layer_list("kv_source_layer_ids", c.kv_source_layer_ids, True)
    layer_list("index_source_layer_ids", c.index_source_layer_ids, True)
    layer_list("engram_layer_ids", c.engram_layer_ids, False)
    layer_list("dspark_target_layer_ids", c.dspark_target_layer_ids, False)
    if c.index_k_source_layer_ids is not None:
        layer_list("index_k_source_layer_ids", c.index_k_source_layer_ids, True)
        extra = sorted(set(c.index_k_source_layer_ids) - set(c.kv_source_layer_ids))
        if extra:
            raise ConfigError(f"index_k_source_layer_ids: layers {extra} are not KV sources "
                              f"(index K is projected from the compressor's latent)")
    if c.candidate_source_layer_id is not None and not 0 <= c.candidate_source_layer_id < n:
        raise ConfigError(f"candidate_source_layer_id: layer {c.candidate_source_layer_id} is not a backbone layer")
    if c.num_nextn_predict_layers and not c.dspark_target_layer_ids:
        raise ConfigError("dspark_target_layer_ids: empty although num_nextn_predict_layers > 0")

    if c.engram_num_embeddings and len(c.engram_num_embeddings) != len(c.engram_layer_ids):
        raise ConfigError(f"engram_num_embeddings: {len(c.engram_num_embeddings)} entries for "
                          f"{len(c.engram_layer_ids)} engram_layer_ids")
    if c.engram_layer_ids:
        derived = engram_table_rows(c)
        if c.engram_num_embeddings and list(c.engram_num_embeddings) != derived:
            raise ConfigError(f"engram_num_embeddings: {list(c.engram_num_embeddings)} does not match the rows "
                              f"derived from the primes above engram_vocab_size {c.engram_vocab_size}: {derived}")


def _resolve_topology(c: ModelConfig) -> tuple[tuple[LayerRole, ...], int]:
    n = c.num_hidden_layers
    ratios = c.compress_ratios
    kv_src, idx_src = set(c.kv_source_layer_ids), set(c.index_source_layer_ids)
    idx_k_src = set(c.index_k_sources)
    engram, targets = set(c.engram_layer_ids), set(c.dspark_target_layer_ids)
    cand = c.candidate_source_layer_id

    # Invariant 2: a KV source must compute the first top-k list over its own cache.
    for L in c.kv_source_layer_ids:
        if L not in idx_src:
            raise ConfigError(f"index_source_layer_ids: KV source layer {L} is not an index source")

    n_prefill = next((i for i in range(n) if ratios[i] == 1), n)

    if cand is not None:
        if cand not in idx_src:
            raise ConfigError(f"candidate_source_layer_id: layer {cand} is not an index source")
        if c.candidate_topk_blocks * c.candidate_block_size < c.index_topk:  # invariant 4
            raise ConfigError(f"candidate_topk_blocks: {c.candidate_topk_blocks} * candidate_block_size "
                              f"{c.candidate_block_size} < index_topk {c.index_topk}")

    layers: list[LayerRole] = []
    kv_owner: int | None = None
    last_topk: int | None = None
    for i in range(n + c.num_nextn_predict_layers):
        r, draft = ratios[i], i >= n
        if i in kv_src:
            kv_owner = i
        if r == 0:
            mode, owner, ik_owner, topk_from = "W", None, None, None
        else:
            # Invariant 3: the nearest KV source at or before the layer, with the same ratio.
            if kv_owner is None:
                raise ConfigError(f"kv_source_layer_ids: layer {i} has ratio {r} but no KV source at or before it")
            if ratios[kv_owner] != r:
                raise ConfigError(f"kv_source_layer_ids: layer {i} has ratio {r} but its KV owner {kv_owner} "
                                  f"has ratio {ratios[kv_owner]}")
            owner = kv_owner
            ik_owner = owner if owner in idx_k_src else None
            if i in kv_src:
                mode = "FULL"
            elif i in idx_src:
                mode = "REINDEX"
            else:
                mode = "REUSE"
            if i in idx_src:
                if ik_owner is None:
                    raise ConfigError(f"index_k_source_layer_ids: index source {i} reads KV owner {owner}, "
                                      f"which owns no index K")
                last_topk = i
            topk_from = last_topk
        uses_cand = cand is not None and i in idx_src and i > cand
        if uses_cand and owner != layers[cand].kv_owner:
            # Invariant 6: the pool is a set of positions in the candidate source's cache.
            raise ConfigError(f"index_source_layer_ids: layer {i} is after candidate source {cand} but reads "
                              f"KV owner {owner}, not {layers[cand].kv_owner}; it cannot score inside the pool")
        role = LayerRole(
            index=i, is_draft=draft, ratio=r, mode=mode, kv_owner=owner, index_k_owner=ik_owner,
            topk_from=topk_from, is_candidate_source=(i == cand), uses_candidates=uses_cand,
            has_compressor=i in kv_src, compressor_gate=(i in kv_src and r == 2),
            has_indexer=i in idx_src, owns_index_k=i in idx_k_src, engram=i in engram,
            is_dspark_target=i in targets,
            rope_theta=c.compress_rope_theta if r > 0 else c.rope_theta,
            yarn=r > 0 and c.yarn_enabled,
            n_experts=c.dspark_n_routed_experts if draft else c.n_routed_experts,
            top_k=c.dspark_num_experts_per_tok if draft else c.num_experts_per_tok,
            draft_stage=i - n if draft else None,
        )
        layers.append(role)

    # Invariant 5 (DI): the YoCo split at n_prefill_layer.
    late_engram = [L for L in c.engram_layer_ids if L >= n_prefill]
    if late_engram:
        raise ConfigError(f"engram_layer_ids: layers {late_engram} are not before n_prefill_layer {n_prefill} "
                          f"(the first ratio-1 layer)")
    if targets and len({t >= n_prefill for t in targets}) > 1:
        raise ConfigError(f"dspark_target_layer_ids: {sorted(targets)} straddle n_prefill_layer {n_prefill}")
    if n_prefill < n and layers[n_prefill].kv_owner != n_prefill:
        raise ConfigError(f"kv_source_layer_ids: layer {n_prefill} (n_prefill_layer) must be its own KV source "
                          f"so the KV-sharing map does not cross it")
    return tuple(layers), n_prefill


# ---------------------------------------------------------------------------------------------
# Engram table heights (§4.3 (b)): sums of consecutive primes above engram_vocab_size
# ---------------------------------------------------------------------------------------------

def _engram_constants(c: ModelConfig):
    from .engram import engram_constants  # the one place the hash constants are derived

    return engram_constants(c.engram_layer_ids, c.engram_vocab_size, c.engram_n_heads, c.engram_max_ngram_size,
                            c.engram_compressed_vocab_size)


def engram_primes(c: ModelConfig) -> list[list[list[int]]]:
    """primes[layer slot][n-gram size - 2][head], allocated as HF-REF does (§4.3 (b))."""
    h = c.engram_n_heads
    return [[[int(p) for p in k.primes[o * h:(o + 1) * h]] for o in range(c.engram_max_ngram_size - 1)]
            for k in _engram_constants(c).values()]


def engram_table_rows(c: ModelConfig) -> list[int]:
    return [k.rows for k in _engram_constants(c).values()]
