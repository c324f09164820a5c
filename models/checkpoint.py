"""The V4.1 checkpoint: its schema (§8.2), a validating loader and a random-checkpoint writer.

Format (§8.1): `model-000NN-of-000MM.safetensors` shards plus `model.safetensors.index.json`.
Names carry no `model.` prefix. Dense weights are F8_E4M3 with a 32x32-block F8_E8M0 sibling
`X.scale`; routed experts are packed E2M1 held as I8 [out, in/2] with a per-32 `X.scale` [out, in/32];
Engram tables are F8_E4M3 rows with a per-row, per-32-column scale. Vision tensors are not part of
the text graph and are skipped.

Loaded tensors keep their storage form: F8_E4M3 -> torch.float8_e4m3fn, packed FP4 -> int8, and
F8_E8M0 scales -> uint8 exponent bytes (safetensors >= 0.6 hands them out as
torch.float8_e8m0fnu; a byte view of that is what `ir.dtypes.e8m0_decode` and `ir.quant` take).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import replace_dir, write_new_file
from ..ir import quant
from .config import ModelConfig, load_config

INDEX_NAME = "model.safetensors.index.json"
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}
TORCH_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.uint8, "I8": torch.int8,
                "BF16": torch.bfloat16, "F32": torch.float32}
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DEFAULT_MAX_BYTES = 8 * 2**30


class CheckpointError(ValueError):
    """A checkpoint that does not match its schema. The first line of the message counts and names
    the problems; `problems` holds one line per problem."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # as stored (packed FP4 has in/2 columns)
    dtype: str  # safetensors dtype name
    part: str  # "global" | "backbone" | "engram" | "dspark"
    group: str  # "embed_head" | "attention" | "router_shared" | "routed_experts" | "engram_tables" | "engram_proj" | "dspark_heads"
    quant: str | None = None  # "fp8" (32x32 blocks) | "fp4" (per 32) | "fp8_rows" (per row, per 32) | "scale"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def params(self) -> int:
        """Logical parameters: 0 for scales, two per byte for packed FP4."""
        if self.quant == "scale":
            return 0
        return self.numel * (2 if self.quant == "fp4" else 1)


# ---------------------------------------------------------------------------------------------
# schema
# ---------------------------------------------------------------------------------------------

def checkpoint_schema(cfg: ModelConfig) -> list[TensorSpec]:
    """Every text, Engram and DSpark tensor of §8.2, in shard order (vision skipped)."""
    out: list[TensorSpec] = [TensorSpec("embed.weight", (cfg.vocab_size, cfg.hidden_size), "BF16", "global", "embed_head")]
    for role in cfg.layers:
        out += _layer_specs(cfg, role)
    out.append(TensorSpec("norm.weight", (cfg.hidden_size,), "BF16", "global", "attention"))
    out.append(TensorSpec("head.weight", (cfg.vocab_size, cfg.hidden_size), "BF16", "global", "embed_head"))
    return out


def _fp8(name: str, o: int, i: int, part: str, group: str) -> list[TensorSpec]:
    return [TensorSpec(f"{name}.weight", (o, i), "F8_E4M3", part, group, "fp8"),
            TensorSpec(f"{name}.scale", (-(-o // 32), -(-i // 32)), "F8_E8M0", part, group, "scale")]


def _fp4(name: str, o: int, i: int, part: str, group: str) -> list[TensorSpec]:
    return [TensorSpec(f"{name}.weight", (o, i // 2), "I8", part, group, "fp4"),
            TensorSpec(f"{name}.scale", (o, i // 32), "F8_E8M0", part, group, "scale")]


def _layer_specs(cfg: ModelConfig, role) -> list[TensorSpec]:
    H, hc, D = cfg.hidden_size, cfg.hc_mult, cfg.head_dim
    p = role.prefix + "."
    part = "dspark" if role.is_draft else "backbone"
    s: list[TensorSpec] = []

    def t(name, shape, dtype, group="attention"):
        s.append(TensorSpec(p + name, tuple(shape), dtype, part, group))

    if role.engram:
        rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(role.index)]
        dim = cfg.engram_head_dim
        s.append(TensorSpec(p + "engram.embed.weight", (rows, dim), "F8_E4M3", "engram", "engram_tables", "fp8_rows"))
        s.append(TensorSpec(p + "engram.embed.scale", (rows, dim // 32), "F8_E8M0", "engram", "engram_tables", "scale"))
        s += _fp8(p + "engram.wkv", (hc + 1) * H, cfg.engram_columns * dim, "engram", "engram_proj")
        s.append(TensorSpec(p + "engram.q_weight", (hc, H), "BF16", "engram", "engram_proj"))
        s.append(TensorSpec(p + "engram.k_weight", (hc, H), "BF16", "engram", "engram_proj"))

    mixes = (2 + hc) * hc
    t("attn_norm.weight", [H], "BF16")
    t("ffn_norm.weight", [H], "BF16")
    for sub in ("attn", "ffn"):
        t(f"hc_{sub}_fn", [mixes, hc * H], "F32")
        t(f"hc_{sub}_base", [mixes], "F32")
        t(f"hc_{sub}_scale", [3], "F32")
    nh, ql = cfg.num_attention_heads, cfg.q_lora_rank
    t("attn.attn_sink", [nh], "F32")
    t("attn.q_norm.weight", [ql], "BF16")
    t("attn.kv_norm.weight", [D], "BF16")
    s += _fp8(p + "attn.wq_a", ql, H, part, "attention")
    s += _fp8(p + "attn.wq_b", nh * D, ql, part, "attention")
    s += _fp8(p + "attn.wkv", D, H, part, "attention")
    s += _fp8(p + "attn.wo_a", cfg.o_groups * cfg.o_lora_rank, nh * D // cfg.o_groups, part, "attention")
    s += _fp8(p + "attn.wo_b", H, cfg.o_groups * cfg.o_lora_rank, part, "attention")
    if role.has_compressor:
        t("attn.compressor.wkv.weight", [D, H], "BF16")
        if role.compressor_gate:
            t("attn.compressor.wgate.weight", [D, H], "BF16")
        t("attn.compressor.norm.weight", [D], "BF16")
    if role.owns_index_k:
        t("attn.indexer.wk.weight", [cfg.index_head_dim, D], "BF16")
        t("attn.indexer.k_norm.weight", [cfg.index_head_dim], "BF16")
    if role.has_indexer:
        s += _fp8(p + "attn.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, ql, part, "attention")
        t("attn.indexer.weights_proj.weight", [cfg.index_n_heads, H], "BF16")

    E, F = role.n_experts, cfg.moe_intermediate_size
    t("ffn.gate.weight", [E, H], "BF16", "router_shared")
    t("ffn.gate.bias", [E], "F32", "router_shared")
    if cfg.vision:
        t("ffn.gate.bias_vl", [E], "F32", "router_shared")
    for e in range(E):
        s += _fp4(p + f"ffn.experts.{e}.w1", F, H, part, "routed_experts")
        s += _fp4(p + f"ffn.experts.{e}.w3", F, H, part, "routed_experts")
        s += _fp4(p + f"ffn.experts.{e}.w2", H, F, part, "routed_experts")
    s += _fp8(p + "ffn.shared_experts.w1", F, H, part, "router_shared")
    s += _fp8(p + "ffn.shared_experts.w3", F, H, part, "router_shared")
    s += _fp8(p + "ffn.shared_experts.w2", H, F, part, "router_shared")

    if role.is_draft and role.draft_stage == 0:
        s += _fp8(p + "main_proj", H, len(cfg.dspark_target_layer_ids) * H, part, "dspark_heads")
        t("main_norm.weight", [H], "BF16", "dspark_heads")
    if role.is_draft and role.draft_stage == cfg.n_mtp - 1:
        R = cfg.dspark_markov_rank
        t("norm.weight", [H], "BF16", "dspark_heads")
        t("markov_head.embed.weight", [cfg.vocab_size, R], "BF16", "dspark_heads")
        t("markov_head.head.weight", [cfg.vocab_size, R], "BF16", "dspark_heads")
        t("confidence_head.proj.weight", [1, H + R], "BF16", "dspark_heads")
    return s


# ---------------------------------------------------------------------------------------------
# safetensors headers (read without loading data, so a 475 GiB checkpoint is checked in seconds)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _HeaderEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(path: Path) -> dict[str, _HeaderEntry]:
    """Parse a shard's header; ValueError (one line) if the file is truncated or malformed."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"truncated: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"truncated: header says {n} header bytes, file has {size - 8} after the length")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"malformed header JSON: {e.__class__.__name__}") from None
    if not isinstance(header, dict):
        raise ValueError("malformed header: not a JSON object")
    out: dict[str, _HeaderEntry] = {}
    data_len = size - 8 - n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            b, e = meta["data_offsets"]
            entry = _HeaderEntry(str(meta["dtype"]), tuple(int(x) for x in meta["shape"]), int(b), int(e))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"malformed header entry for {name!r}") from None
        if entry.end > data_len:
            raise ValueError(f"truncated: tensor {name} ends at byte {entry.end} of the data, "
                             f"the file holds {data_len}")
        out[name] = entry
    # safetensors reads a shard only if its tensors tile the data section exactly, in some order
    at = 0
    for name, entry in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != at or entry.end < entry.begin:
            what = "overlaps the tensor before it" if entry.begin < at else "leaves a gap before it"
            raise ValueError(f"malformed header: tensor {name} at bytes {entry.begin}..{entry.end} {what}")
        at = entry.end
    if at != data_len:
        raise ValueError(f"{data_len - at} bytes after the last tensor's data (the file was appended to or damaged)")
    return out


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------

class Checkpoint(Mapping):
    """A validated checkpoint: a lazy name -> tensor mapping over the schema's tensors.

    Tensors are read on access (shards are memory-mapped by safetensors); `load_all()` reads them all.
    """

    def __init__(self, path: Path, specs: list[TensorSpec], weight_map: dict[str, str], device: str):
        self.path = path
        self.specs = {s.name: s for s in specs}
        self._weight_map = weight_map
        self._device = device
        self._handles: dict[str, object] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.specs:
            raise KeyError(name)
        t = self._handle(name).get_tensor(name)
        # ir.dtypes keeps ue8m0 scales as raw exponent bytes; torch's e8m0 type has almost no ops.
        return t.view(torch.uint8) if t.dtype == getattr(torch, "float8_e8m0fnu", None) else t

    def _handle(self, name: str):
        shard = self._weight_map[name]
        if shard not in self._handles:
            from safetensors import safe_open
            try:
                self._handles[shard] = safe_open(str(self.path / shard), framework="pt", device=str(self._device))
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001 - safetensors' own error type: the shard changed since the check
                raise CheckpointError(f"checkpoint {self.path}: {shard}: {str(e).splitlines()[0]}") from None
        return self._handles[shard]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor, read as a safetensors slice: the rest is never loaded."""
        if name not in self.specs:
            raise KeyError(name)
        t = self._handle(name).get_slice(name)[start:stop]
        return t.view(torch.uint8) if t.dtype == getattr(torch, "float8_e8m0fnu", None) else t

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def load_all(self) -> dict[str, torch.Tensor]:
        return {name: self[name] for name in self.specs}

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _summarise(path: Path, problems: list[tuple[str, str, str]]) -> CheckpointError:
    """problems: (kind, subject, detail). First line: count plus a compact list per kind."""
    by_kind: dict[str, list[tuple[str, str]]] = {}
    for kind, subject, detail in problems:
        by_kind.setdefault(kind, []).append((subject, detail))
    parts = []
    for kind, items in by_kind.items():
        shown = ", ".join(f"{s}{' ' + d if d else ''}" for s, d in items[:3])
        more = f", +{len(items) - 3} more" if len(items) > 3 else ""
        parts.append(f"{len(items)} {kind} ({shown}{more})")
    n = len(problems)
    first = f"checkpoint {path}: {n} problem{'s' if n != 1 else ''}: " + "; ".join(parts)
    lines = [f"{kind}: {subject}{' ' + detail if detail else ''}" for kind, subject, detail in problems]
    return CheckpointError("\n".join([first] + ["  " + ln for ln in lines]), lines)


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root}: not a directory")
    return root


def checkpoint_config(path: str | os.PathLike) -> ModelConfig:
    """The config of the model the checkpoint at `path` holds (its config.json)."""
    root = _checkpoint_dir(path)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"checkpoint {root}: config.json is missing")
    return load_config(root)


def load_checkpoint(path: str | os.PathLike, cfg: ModelConfig, device: str = "cpu") -> Checkpoint:
    """Check every file and tensor of the checkpoint at `path` against `checkpoint_schema(cfg)`.

    All problems are gathered into one CheckpointError. On success, a lazy mapping of tensors.
    """
    root = _checkpoint_dir(path)
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        raise CheckpointError(f"checkpoint {root}: {INDEX_NAME} is missing")
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {root}: {INDEX_NAME} is malformed JSON ({e.__class__.__name__})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"checkpoint {root}: {INDEX_NAME} has no weight_map object of name -> shard file")

    problems: list[tuple[str, str, str]] = []
    headers: dict[str, dict[str, _HeaderEntry] | None] = {}
    for shard in sorted(set(weight_map.values())):
        f = root / shard
        if os.sep in shard or shard.startswith(".") or not f.is_file():
            problems.append(("missing shards", shard, ""))
            headers[shard] = None
            continue
        try:
            headers[shard] = _read_header(f)
        except ValueError as e:
            problems.append(("broken shards", shard, str(e)))
            headers[shard] = None
    for shard, header in headers.items():
        for name in header or {}:
            if weight_map.get(name) != shard:
                problems.append(("tensors not in the index", name, f"(in {shard})"))

    specs = checkpoint_schema(cfg)
    names = {s.name for s in specs}
    for spec in specs:
        shard = weight_map.get(spec.name)
        if shard is None:
            problems.append(("missing tensors", spec.name, ""))
            continue
        header = headers[shard]
        if header is None:
            continue  # the shard itself is reported
        entry = header.get(spec.name)
        if entry is None:
            problems.append(("index entries whose shard lacks the tensor", spec.name, f"(index says {shard})"))
            continue
        if entry.dtype != spec.dtype:
            problems.append(("wrong dtypes", spec.name, f"is {entry.dtype}, expected {spec.dtype}"))
        if entry.shape != spec.shape:
            problems.append(("wrong shapes", spec.name, f"is {list(entry.shape)}, expected {list(spec.shape)}"))
        elif entry.dtype == spec.dtype and entry.end - entry.begin != spec.nbytes:
            problems.append(("broken shards", spec.name, f"holds {entry.end - entry.begin} bytes, "
                                                         f"expected {spec.nbytes}"))
    for name in weight_map:
        if name not in names and not name.startswith(VISION_PREFIXES):
            problems.append(("unexpected tensors", name, ""))
    if problems:
        raise _summarise(root, problems)
    return Checkpoint(root, specs, {n: weight_map[n] for n in names}, device)


# ---------------------------------------------------------------------------------------------
# random checkpoints in the real format
# ---------------------------------------------------------------------------------------------

def _generator(seed: int, name: str, device="cpu") -> torch.Generator:
    """Each tensor has its own stream, so its values do not depend on shard layout or order (a
    device generator gives other values than the cpu one for the same seed)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _init_values(cfg: ModelConfig, spec: TensorSpec, g: torch.Generator, rows: slice | None = None) -> torch.Tensor:
    """fp32 values chosen so that activations stay near unit scale through every layer.

    Linear weights ~ N(0, 1/in) keep variance through each projection (attention scores come out
    ~N(0, 1) after the 512^-0.5 scale); norms ~ 1. The mHC projections give raw mixes of unit size,
    scaled down by hc_*_scale, around a base that makes `pre` ~ 1/hc (a plain average), `post` ~ 1,
    and the 4x4 residual mix diagonal-heavy (softmax of 2*I): doubly stochastic after Sinkhorn,
    mixing copies without collapsing them.
    """
    name, shape = spec.name, spec.shape
    if spec.quant == "fp4":
        shape = (shape[0], shape[1] * 2)
    if rows is not None:
        shape = (rows.stop - rows.start,) + tuple(shape[1:])
    hc = cfg.hc_mult

    dev = g.device

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=dev) * std + mean

    leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name[: -len(".weight")].rsplit(".", 1)[-1]
    if leaf.endswith("norm"):
        return normal(0.02, 1.0)
    if leaf in ("hc_attn_fn", "hc_ffn_fn"):
        return normal((hc * cfg.hidden_size) ** -0.5)
    if leaf in ("hc_attn_base", "hc_ffn_base"):
        base = torch.randn(shape, generator=g, device=dev) * 0.1
        base[:hc] += -math.log(hc - 1) if hc > 1 else 0.0
        base[2 * hc:] += (2.0 * torch.eye(hc, device=dev)).flatten()
        return base
    if leaf in ("hc_attn_scale", "hc_ffn_scale"):
        return torch.rand(shape, generator=g, device=dev) * 0.2 + 0.1
    if leaf == "attn_sink":
        return normal(0.1)
    if leaf in ("bias", "bias_vl"):
        return normal(0.01)
    if leaf in ("q_weight", "k_weight"):
        return normal(0.1, 1.0)
    if name == "embed.weight" or name.endswith("markov_head.embed.weight") or spec.quant == "fp8_rows":
        return normal(1.0)
    return normal(shape[1] ** -0.5)  # [out, in] projections, the LM and Markov heads included


# the projections whose outputs the attention and MoE sub-layers add to the residual streams
# (attention's wo_b, the routed and shared experts' w2; Engram's update is not scaled)
BRANCH_OUTPUTS = ("attn.wo_b.weight", ".w2.weight")
# The smooth preset's checkpoint for comparing two implementations end to end (its GPU test): with
# branches x 1/8 the reference's own noise floor (one bf16 ulp on 0.1% of the embedding, 40
# teacher-forced steps) is cosine 0.99989, against 0.9956 at unit scale (docs/performance.md,
# fourteenth session). A power of two: the fp8 / fp4 codes stay, the scales move by 3.
SMOOTH_BRANCH_SCALE = 0.125


def _encode(cfg: ModelConfig, spec: TensorSpec, seed: int, chunk_rows: int,
            device="cpu", branch_scale: float = 1.0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (tensor name, storage chunk) pieces in row order; a quantised weight yields its scale too.
    `branch_scale` multiplies the BRANCH_OUTPUTS weights' values before they are quantised."""
    g = _generator(seed, spec.name, device)
    if spec.quant == "fp8_rows":
        # Engram tables can be 98 GB: quantise in row chunks, emitting data then scales.
        scale_chunks = []
        for start in range(0, spec.shape[0], chunk_rows):
            rows = slice(start, min(start + chunk_rows, spec.shape[0]))
            q = quant.quant_fp8_32(_init_values(cfg, spec, g, rows))
            yield spec.name, q.data
            scale_chunks.append(q.scale)
        yield spec.name[: -len(".weight")] + ".scale", torch.cat(scale_chunks)
        return
    w = _init_values(cfg, spec, g)
    if branch_scale != 1.0 and spec.name.endswith(BRANCH_OUTPUTS):
        w = w * branch_scale
    if spec.quant == "fp8":
        q = quant.quant_fp8_weight(w)
        yield spec.name, q.data
        yield spec.name[: -len(".weight")] + ".scale", q.scale
    elif spec.quant == "fp4":
        q = quant.quant_fp4_ue8m0(w)
        yield spec.name, q.data.view(torch.int8)
        yield spec.name[: -len(".weight")] + ".scale", q.scale
    else:
        yield spec.name, w.to(TORCH_DTYPES[spec.dtype])


def _plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy in schema order; a weight and its scale always share a shard."""
    units: list[list[TensorSpec]] = []
    for s in specs:
        if s.quant == "scale":
            units[-1].append(s)
        else:
            units.append([s])
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for unit in units:
        b = sum(s.nbytes for s in unit)
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += b
    return shards


def _write_shard(path: Path, cfg: ModelConfig, specs: list[TensorSpec], seed: int, chunk_rows: int) -> None:
    # Widest dtypes first keeps every tensor aligned to its element size (as safetensors does).
    order = sorted(specs, key=lambda s: -DTYPE_BYTES[s.dtype])
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for s in order:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    pending: dict[str, torch.Tensor] = {}  # scales come out with their weight, go to their own offset
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for s in order:
            if s.quant == "scale":
                pieces = [pending.pop(s.name)]  # its weight precedes it: same 1-byte width, schema order
                _write_bytes(f, pieces[0])
            else:
                pieces = []
                for name, t in _encode(cfg, s, seed, chunk_rows):
                    if name == s.name:
                        _write_bytes(f, t)
                        pieces.append(t)
                    else:
                        pending[name] = t
            written = sum(t.numel() * t.element_size() for t in pieces)
            if written != s.nbytes:
                raise AssertionError(f"{s.name}: wrote {written} bytes, the schema says {s.nbytes}")
        f.flush()
        os.fsync(f.fileno())


def _write_bytes(f, t: torch.Tensor) -> None:
    f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def checkpoint_bytes(cfg: ModelConfig) -> int:
    return sum(s.nbytes for s in checkpoint_schema(cfg))


def make_checkpoint(model: str | os.PathLike | ModelConfig, out_dir: str | os.PathLike, seed: int = 0,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                    max_bytes: int = DEFAULT_MAX_BYTES, force: bool = False) -> Path:
    """Write a deterministic random checkpoint of `model` (preset, directory or config) to `out_dir`.

    The directory is built next to `out_dir` and swapped into place (atomic.replace_dir), so readers
    never see a partial checkpoint. Refuses a non-empty `out_dir` unless `overwrite`, and a
    checkpoint larger than `max_bytes` unless `force`.
    """
    cfg = model if isinstance(model, ModelConfig) else load_config(model)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    for parent in out.absolute().parents:  # (was: "File exists: PARENT" from mkdir)
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"{out}: {parent} is a file, not a directory")
            break
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise CheckpointError(f"{out}: directory exists and is not empty (overwrite it with --overwrite)")
        # --overwrite replaces a checkpoint, not whatever else a directory holds
        own = {INDEX_NAME, "config.json"}
        foreign = sorted(e.name for e in out.iterdir() if e.name not in own and not e.name.endswith(".safetensors"))
        if not (out / INDEX_NAME).is_file() or foreign:
            shown = ", ".join(foreign[:3]) or "no checkpoint index"
            raise CheckpointError(f"{out}: holds {shown}, not only a checkpoint; --overwrite replaces a checkpoint "
                                  "directory whole, so give a new or empty directory")
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes: must be > 0, got {max_shard_bytes}")
    specs = checkpoint_schema(cfg)
    total = sum(s.nbytes for s in specs)
    if total > max_bytes and not force:
        raise CheckpointError(f"{cfg.model_id or 'model'}: checkpoint would be {total / 1e9:.1f} GB "
                              f"(> max_bytes {max_bytes / 1e9:.1f} GB); pass --force to write it anyway")
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if total > free:
        raise CheckpointError(f"{parent}: {free / 1e9:.1f} GB free, the checkpoint needs {total / 1e9:.1f} GB")

    if cfg.source:
        config_bytes = Path(cfg.source).read_bytes()
    elif cfg.vision:
        raise CheckpointError("config has no source file and a vision tower whose config it does not keep; "
                              "pass a preset name or a directory")
    else:
        text = {k: v for k, v in cfg.canonical_dict().items() if k != "vision"}
        config_bytes = (json.dumps(text, indent=1) + "\n").encode()
    shards = _plan_shards(specs, max_shard_bytes)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]

    def write(tmp: Path) -> None:
        weight_map = {}
        for fname, shard in zip(names, shards):
            _write_shard(tmp / fname, cfg, shard, seed, chunk_rows=1 << 20)
            weight_map.update({s.name: fname for s in shard})
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
        write_new_file(tmp / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
        write_new_file(tmp / "config.json", config_bytes)

    replace_dir(out, write)
    return out




class GeneratedCheckpoint(Mapping):
    """A random checkpoint in the real format generated where it is used (e.g. straight into GPU
    memory, for models whose checkpoint would not fit the machine's disk): the same schema, value
    rules and per-tensor seeding as `make_checkpoint`, each tensor made when first read. Values
    depend on the device's generator, so a GPU-made checkpoint differs from the cpu one.
    `branch_scale` < 1 makes the attention and MoE sub-layers add smaller updates to the residual
    streams (BRANCH_OUTPUTS): with unit-scale branches the random model is chaotic (one bf16 ulp
    on 0.1% of the embedding moves the smooth preset's logits to cosine 0.996), so rounding-level
    differences between two correct implementations compound past any fixed bar."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, device="cpu", chunk_rows: int = 1 << 16,
                 branch_scale: float = 1.0):
        self.cfg, self.seed, self.device, self.chunk_rows = cfg, seed, device, chunk_rows
        self.branch_scale = branch_scale
        schema = checkpoint_schema(cfg)
        self.specs = {s.name: s for s in schema}
        self._owner = {}
        last = None
        for s in schema:
            if s.quant == "scale":
                self._owner[s.name] = last
            else:
                last = s.name
        self._pending: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._pending:
            return self._pending.pop(name)
        if name not in self.specs:
            raise KeyError(name)
        owner = self.specs[self._owner.get(name, name)]
        pieces: dict[str, list[torch.Tensor]] = {}
        for n, t in _encode(self.cfg, owner, self.seed, self.chunk_rows, self.device, self.branch_scale):
            pieces.setdefault(n, []).append(t)
        out = {n: (ts[0] if len(ts) == 1 else torch.cat(ts)) for n, ts in pieces.items()}
        for n, t in out.items():
            if t.dtype != TORCH_DTYPES[self.specs[n].dtype]:
                raise AssertionError(f"{n}: generated {t.dtype}, the schema says {self.specs[n].dtype}")
        want = out.pop(name)
        self._pending.update(out)
        return want

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)
