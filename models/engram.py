"""Engram n-gram hashing for DeepSeek-V4.1 (spec §4.3 a-d).

Three pieces, all independent of model weights:

* the compressed vocabulary: a 129,280 -> 99,092 map from raw token ids to
  normalised-text ids, built from the tokenizer and shipped as a constant
  table in ``models/data/engram_token_map_v41.npy``;
* the per-layer hash constants (odd multipliers, distinct primes, table
  offsets and row counts);
* the per-token n-gram hash that turns a compressed-id history into row
  indices of the Engram embedding table.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..atomic import replace_file

ENGRAM_COMPRESSED_VOCAB_SIZE_V41 = 99_092
ENGRAM_DEAD = -1
V41_IMAGE_TOKEN_ID = 129264

DATA_DIR = Path(__file__).resolve().parent / "data"
TOKEN_MAP_PATH = DATA_DIR / "engram_token_map_v41.npy"
TOKEN_MAP_PROVENANCE_PATH = DATA_DIR / "engram_token_map_v41.json"

# Placeholder for a token that is exactly one space: without it the final
# strip would turn " " into "", and the empty-key fallback would then keep the
# raw text, so " " and "\n" would not merge as the reference intends.
_SPACE_SENTINEL = "\ue000"
_WHITESPACE_RUN = re.compile(r"[ \t\r\n]+")
# Unicode White_Space, which is what the reference's Rust `Strip` normaliser
# trims; Python's str.strip() would also trim U+001C..U+001F.
_UNICODE_WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)

TOKEN_MAP_ALGORITHM = (
    "For each raw id t in 0..vocab_size-1: s = raw byte-level decode of [t] with special tokens kept "
    "and no clean-up of tokenisation spaces; if s contains U+FFFD the key is the raw token string, "
    "otherwise key = normalize(s), or s if that is empty. normalize = NFKC, NFD, drop every "
    "combining mark (general category M*), lowercase, collapse [ \\t\\r\\n]+ to one space, a string "
    "that is exactly one space becomes U+E000, strip Unicode White_Space from both ends, U+E000 "
    "back to one space. The compressed id of t is the order of first appearance of its key."
)


def normalize_engram_key(text: str) -> str:
    """The §4.3a normalisation of one decoded token (may return "")."""
    text = unicodedata.normalize("NFKC", text)
    text = unicodedata.normalize("NFD", text)
    text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("M"))
    text = text.lower()
    text = _WHITESPACE_RUN.sub(" ", text)
    if text == " ":
        text = _SPACE_SENTINEL
    text = text.strip(_UNICODE_WHITE_SPACE)
    return text.replace(_SPACE_SENTINEL, " ")


def build_engram_token_map(tokenizer) -> np.ndarray:
    """Build the raw-id -> compressed-id map from a tokenizer (§4.3a).

    ``tokenizer`` needs ``vocab_size``, ``decode(ids, skip_special_tokens=False)``
    returning the raw byte-level decode, and ``id_to_token(id)``; the
    ``deepinfer.models.tokenizer.Tokenizer`` class provides all three.
    Returns int32 [vocab_size].
    """
    vocab_size = int(tokenizer.vocab_size)
    token_map = np.empty(vocab_size, dtype=np.int32)
    compressed_id_of_key: dict[str, int] = {}
    for token_id in range(vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalize_engram_key(text) or text
        token_map[token_id] = compressed_id_of_key.setdefault(key, len(compressed_id_of_key))
    return token_map


def _sha256_of_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_atomically(path: Path, write) -> None:
    replace_file(path, write)


def write_engram_token_map(tokenizer, npy_path: Path = TOKEN_MAP_PATH,
                           provenance_path: Path = TOKEN_MAP_PROVENANCE_PATH) -> np.ndarray:
    """Build the map from ``tokenizer`` and write the .npy and its provenance JSON atomically."""
    token_map = build_engram_token_map(tokenizer)
    size = int(token_map.max()) + 1
    if size != ENGRAM_COMPRESSED_VOCAB_SIZE_V41:
        raise ValueError(f"engram token map has {size} compressed ids, expected "
                         f"{ENGRAM_COMPRESSED_VOCAB_SIZE_V41} (wrong tokenizer?)")
    npy_path = Path(npy_path)
    _write_atomically(npy_path, lambda handle: np.save(handle, token_map, allow_pickle=False))
    provenance = {
        "description": "DeepSeek-V4.1 Engram compressed vocabulary: raw token id -> compressed id (spec §4.3a)",
        "built_from_package": tokenizer.source_package,
        "built_from_package_version": tokenizer.source_package_version,
        "tokenizer_json_sha256": tokenizer.tokenizer_json_sha256,
        "python_unicodedata_version": unicodedata.unidata_version,
        "algorithm": TOKEN_MAP_ALGORITHM,
        "dtype": "int32",
        "shape": list(token_map.shape),
        "compressed_vocab_size": size,
        "npy_sha256": _sha256_of_file(npy_path),
    }
    text = json.dumps(provenance, indent=2, ensure_ascii=False) + "\n"
    _write_atomically(Path(provenance_path), lambda handle: handle.write(text.encode("utf-8")))
    return token_map


def load_engram_token_map(npy_path: Path = TOKEN_MAP_PATH,
                          provenance_path: Path = TOKEN_MAP_PROVENANCE_PATH) -> np.ndarray:
    """Load the shipped int32 [129280] map after checking it against its recorded sha256."""
    npy_path, provenance_path = Path(npy_path), Path(provenance_path)
    try:
        expected_sha = json.loads(provenance_path.read_text(encoding="utf-8"))["npy_sha256"]
    except (OSError, ValueError, KeyError) as error:
        raise RuntimeError(f"engram token map provenance {provenance_path} is unreadable: {error}") from None
    try:
        actual_sha = _sha256_of_file(npy_path)
    except OSError as error:
        raise RuntimeError(f"engram token map {npy_path} is unreadable: {error}") from None
    if actual_sha != expected_sha:
        raise RuntimeError(f"engram token map {npy_path} is damaged: sha256 {actual_sha} != recorded {expected_sha}")
    token_map = np.load(npy_path, allow_pickle=False)
    if token_map.dtype != np.int32 or token_map.ndim != 1:
        raise RuntimeError(f"engram token map {npy_path} has dtype {token_map.dtype} and {token_map.ndim} dims, "
                           f"expected int32 with 1 dim")
    return token_map


def compress_token_ids(token_ids: torch.Tensor, token_map: np.ndarray | torch.Tensor,
                       image_token_id: int | None = V41_IMAGE_TOKEN_ID, dead: int = ENGRAM_DEAD) -> torch.Tensor:
    """Raw token ids -> int64 compressed ids; image tokens and ids outside the map become ``dead``."""
    table = torch.as_tensor(np.asarray(token_map), dtype=torch.int64)
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64)
    inside = (token_ids >= 0) & (token_ids < table.numel())
    compressed = torch.where(inside, table[token_ids.clamp(0, table.numel() - 1)], torch.full_like(token_ids, dead))
    if image_token_id is not None:
        compressed = torch.where(token_ids == image_token_id, torch.full_like(compressed, dead), compressed)
    return compressed


# ---------------------------------------------------------------- hash constants (§4.3b)

@dataclass(frozen=True)
class EngramLayerConstants:
    """Hash constants of one Engram layer.

    ``primes`` and ``offsets`` are flattened size-major, head-minor: column
    ``(o - 2) * n_heads + h`` belongs to n-gram size ``o`` and head ``h``.
    """

    layer_id: int
    multipliers: np.ndarray  # int64 [max_ngram], odd; multiplier r scales the token r steps back
    primes: np.ndarray  # int64 [(max_ngram - 1) * n_heads]
    offsets: np.ndarray  # int64, exclusive cumulative sum of primes: each column's first table row
    rows: int  # table height: sum of primes


def _is_prime(candidate: int) -> bool:
    if candidate < 2:
        return False
    small_primes = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for prime in small_primes:
        if candidate % prime == 0:
            return candidate == prime
    odd_part, twos = candidate - 1, 0
    while odd_part % 2 == 0:
        odd_part //= 2
        twos += 1
    # These witnesses make Miller-Rabin deterministic below 3.3e24, far past any table size.
    for witness in small_primes:
        x = pow(witness, odd_part, candidate)
        if x in (1, candidate - 1):
            continue
        for _ in range(twos - 1):
            x = x * x % candidate
            if x == candidate - 1:
                break
        else:
            return False
    return True


def engram_multipliers(layer_id: int, compressed_vocab: int, max_ngram: int = 4) -> np.ndarray:
    """Odd int64 multipliers of one layer; the bound keeps every id*multiplier below 2**63."""
    bound = max(1, (2**63 - 1) // compressed_vocab // 2)
    rng = np.random.default_rng(10007 * layer_id)
    return rng.integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1


def engram_constants(layer_ids: Sequence[int], engram_vocab_size: int, n_heads: int, max_ngram: int,
                     compressed_vocab: int) -> dict[int, EngramLayerConstants]:
    """Per-layer hash constants, keyed by layer id in ``layer_ids`` order (§4.3b)."""
    if max_ngram < 2 or n_heads < 1 or engram_vocab_size < 1 or compressed_vocab < 1:
        raise ValueError(f"engram constants need max_ngram >= 2, n_heads, engram_vocab_size and compressed_vocab "
                         f">= 1; got {max_ngram}, {n_heads}, {engram_vocab_size}, {compressed_vocab}")
    used_primes: set[int] = set()
    constants: dict[int, EngramLayerConstants] = {}
    for layer_id in layer_ids:
        if layer_id in constants:
            raise ValueError(f"engram layer id {layer_id} appears twice in {list(layer_ids)}")
        layer_primes: list[int] = []
        for _ngram_size in range(2, max_ngram + 1):
            # Restarting at the floor for every size makes later sizes and layers
            # take the lowest primes the earlier ones left free.
            current = engram_vocab_size - 1
            for _head in range(n_heads):
                current += 1
                while current in used_primes or not _is_prime(current):
                    current += 1
                used_primes.add(current)
                layer_primes.append(current)
        primes = np.array(layer_primes, dtype=np.int64)
        offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(primes)[:-1]])
        constants[layer_id] = EngramLayerConstants(
            layer_id=layer_id,
            multipliers=engram_multipliers(layer_id, compressed_vocab, max_ngram),
            primes=primes,
            offsets=offsets,
            rows=int(primes.sum()),
        )
    return constants


# ---------------------------------------------------------------- per-token hash (§4.3c-d)

def engram_hash(compressed_ids_history: torch.Tensor, positions: torch.Tensor,
                consts: Mapping[int, EngramLayerConstants] | Iterable[EngramLayerConstants],
                pad_id: int, dead: int = ENGRAM_DEAD) -> torch.Tensor:
    """Engram table rows for each token: int64 [n, n_layers, (max_ngram - 1) * n_heads].

    ``compressed_ids_history`` is one sequence's compressed ids indexed by
    absolute position (int64 [T], ``dead`` for image tokens); ``positions``
    (int [n]) are the absolute positions to hash, each < T. ``pad_id`` is the
    *compressed* pad id, ``token_map[2]``. Layers come in ``consts`` order.
    """
    layers = list(consts.values()) if isinstance(consts, Mapping) else list(consts)
    if not layers:
        raise ValueError("engram_hash needs constants for at least one layer")
    max_ngram = len(layers[0].multipliers)
    n_cols = len(layers[0].primes)
    if any(len(layer.multipliers) != max_ngram or len(layer.primes) != n_cols for layer in layers):
        raise ValueError("engram_hash needs every layer to have the same n-gram size and head count")
    n_heads = n_cols // (max_ngram - 1)

    history = torch.as_tensor(compressed_ids_history, dtype=torch.int64)
    positions = torch.as_tensor(positions, dtype=torch.int64)
    if history.ndim != 1 or positions.ndim != 1:
        raise ValueError(f"engram_hash needs a 1-D history and 1-D positions, got {tuple(history.shape)} "
                         f"and {tuple(positions.shape)}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= history.numel()):
        raise ValueError(f"engram_hash positions must lie in [0, {history.numel()}), got "
                         f"[{int(positions.min())}, {int(positions.max())}]")

    from ..ir.ops.engram import block_ngrams, hash_columns  # the graph op's own arithmetic

    source_positions = positions[:, None] - torch.arange(max_ngram, dtype=torch.int64)[None, :]  # [n, max_ngram]
    grams = block_ngrams(history[source_positions.clamp(min=0)], source_positions, pad_id, dead)
    return torch.stack([hash_columns(grams, [int(m) for m in layer.multipliers], [int(p) for p in layer.primes],
                                     [int(o) for o in layer.offsets], n_heads) for layer in layers], dim=1)
