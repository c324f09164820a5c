"""Engram hashing (spec §4.3 (b)-(d)): constants, per-token n-gram ids and the hash columns."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEAD = -1  # compressed id of image tokens (never produced by a text-only map)


def _is_prime(v: int) -> bool:
    if v < 2:
        return False
    if v % 2 == 0:
        return v == 2
    f = 3
    while f * f <= v:
        if v % f == 0:
            return False
        f += 2
    return True


@dataclass
class EngramConsts:
    layer: int
    mult: np.ndarray  # [max_ngram] int64, odd
    primes: np.ndarray  # [max_ngram-1, n_heads] int64; row o-1 = the (o+1)-gram heads
    offsets: np.ndarray  # [(max_ngram-1)*n_heads] int64, exclusive cumsum of the flattened primes
    rows: int  # table height = sum of the primes


def engram_constants(layer_ids, compressed_vocab: int, vocab_start: int, max_ngram: int, n_heads: int):
    """Multipliers and primes of every Engram layer, in `layer_ids` order (§4.3 (b))."""
    bound = max(1, (2**63 - 1) // compressed_vocab // 2)
    used: set[int] = set()
    out = {}
    for layer in layer_ids:
        mult = np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
        primes = np.zeros((max_ngram - 1, n_heads), dtype=np.int64)
        for o in range(max_ngram - 1):  # n-gram size o + 2
            cur = vocab_start - 1
            for h in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in used:
                    cur += 1
                used.add(cur)
                primes[o, h] = cur
        flat = primes.reshape(-1)
        offsets = np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.int64)
        out[layer] = EngramConsts(layer, mult.astype(np.int64), primes, offsets, int(flat.sum()))
    return out


def ngram_ids(hist: list[int], n_new: int, start: int, max_ngram: int, pad: int) -> np.ndarray:
    """g[t, r] for the last `n_new` entries of `hist` (compressed ids; hist[i] is position i - the
    list may be only a suffix: hist[-1] is position start + n_new - 1).  §4.3 (c)."""
    g = np.full((n_new, max_ngram), pad, dtype=np.int64)
    base = start + n_new - len(hist)  # absolute position of hist[0]
    for t in range(n_new):
        pos = start + t
        for r in range(max_ngram):
            if pos < r:
                break  # this slot and every larger look-back are blocked
            src = hist[pos - r - base]
            if src == DEAD:
                break
            g[t, r] = src
    return g


def hash_columns(g: np.ndarray, k: EngramConsts) -> np.ndarray:
    """[n, max_ngram] n-gram ids -> [n, (max_ngram-1)*n_heads] table rows (§4.3 (d))."""
    p = g.astype(np.int64) * k.mult[None, :]  # < 2^63 because g < Vc
    n_heads = k.primes.shape[1]
    cols = np.zeros((g.shape[0], (k.primes.shape[0]) * n_heads), dtype=np.int64)
    acc = p[:, 0].copy()
    for o in range(1, g.shape[1]):
        acc = acc ^ p[:, o]
        for h in range(n_heads):
            j = (o - 1) * n_heads + h
            cols[:, j] = acc % k.primes[o - 1, h] + k.offsets[j]
    return cols
