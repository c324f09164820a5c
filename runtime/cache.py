"""Ownership of the cache memory: per-sequence state slots and pages of the compressed caches.

A sequence holds one state SLOT while it runs (its window rings, compressor rings and Engram
history live there) and the PAGES that cover its cached tokens: each page holds the compressed
entries of PAGE_TOKENS (128) raw tokens, so L cached tokens need ceil(L / 128) pages. Pages are
handed out in the order the sequence's block table lists them and grow as it does; a speculative
step grows them for its draft rows and shrinks them back to the accepted ones.

Prefix caching (`PrefixPolicy`): every full page a sequence has computed is registered under the
hash of its tokens chained with the hashes of the pages before it, so equal hashes mean equal
token prefixes. A new sequence whose prompt starts with registered pages shares them (each page
counts the sequences holding it) and starts computing after them; a page nobody holds stays
registered and is reused as a free page, least recently released first, when the free list runs
out. A shared page is only read: a sequence writes positions >= its cached count, and a page is
registered only once every position in it is computed.

The sliding-window rings are not paged: they live in the slot, so a hit needs them too.
- "exact" (the default): the slot state (rings, compressor state, Engram history) right after a
  page's last token is saved with the page, and a hit restores it into the new sequence's slot.
  The state is exact when the step that computed the page's last token wrote no more than
  `max_backtrack` rows past it (every slot ring keeps that many rows of slack for rollback,
  spec §6.4); a page registered without a state is shared but cannot end an exact hit.
- "bounded" (spec §7, SWA bounded replay): no slot state is kept; a hit of L tokens resumes at
  L - keep (keep >= window + max_backtrack) in a cleared slot, and its first chunks recompute
  tokens L - keep .. L - 1 to rebuild the rings. The graph runs every layer on them, so they also
  write the compressed caches of their positions: they write private copies of the pages they
  overlap, and once the sequence has reached L the copies go back to the pool and it reads the
  shared pages again, so the shared pages never change and the prefix's compressed KV is the
  cached one. The recomputed rows see no window history before L - keep, and the rings are
  built from them: an approximation (docs/serving.md).
Neither mode keeps compressor state across the resume point except through the saved slot: a
ratio-r group must be closed there, which `check_prefix_caching` checks (pages hold whole groups)
and bounded replay keeps (its resume point is a multiple of every ratio).
"""
from __future__ import annotations

import hashlib
import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..models.deepseek_v41 import PAGE_TOKENS
from ..validate import param_error

SWA_REPLAY_MODES = ("exact", "bounded")
DEFAULT_SWA_REPLAY_KEEP = 140  # DeepInfer's README value (spec §7); >= 128 + 6 for the real model
ROOT_HASH = hashlib.sha256(b"deepinfer prefix cache v1").digest()


class CacheFull(RuntimeError):
    """No slot or not enough pages; the scheduler answers by waiting or preempting."""


SLOT_OPS = ("save_slot", "restore_slot", "reset_slot", "copy_page")


class SlotOps(Protocol):
    """What a prefix cache needs from the executor that owns the state buffers (its executors
    implement these in runtime/state.py's terms)."""

    def save_slot(self, slot: int) -> object: ...

    def restore_slot(self, slot: int, saved: object) -> None: ...

    def reset_slot(self, slot: int) -> None: ...

    def copy_page(self, src: int, dst: int) -> None: ...


def page_hash(parent: bytes, tokens) -> bytes:
    """The hash of one full page: its token ids chained to the hash of the pages before it."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


def page_hashes(token_ids, page_tokens: int, num_pages: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    out = []
    for k in range(num_pages):
        parent = page_hash(parent, token_ids[k * page_tokens:(k + 1) * page_tokens])
        out.append(parent)
    return out


@dataclass(frozen=True)
class PrefixPolicy:
    """How hits resume. `window`, `max_backtrack`: the model's sliding window and the rows a step
    may write past the tokens it keeps (slot rings have that much slack); `ratios`: the
    compressors' ratios (a resume point must close their groups)."""
    mode: str = "exact"
    keep: int = DEFAULT_SWA_REPLAY_KEEP
    window: int = 0
    max_backtrack: int = 0
    ratios: tuple[int, ...] = ()

    @property
    def group(self) -> int:
        return math.lcm(*self.ratios) if self.ratios else 1


def check_prefix_caching(policy: PrefixPolicy, page_tokens: int, error: type[Exception], model: bool = True) -> None:
    """One-line errors for settings a prefix cache cannot serve as promised (`model` False: the
    settings alone, before a model's window and ratios are known)."""
    if policy.mode not in SWA_REPLAY_MODES:
        raise param_error(error, "swa_replay", f"must be one of {', '.join(SWA_REPLAY_MODES)}, got {policy.mode!r}")
    if isinstance(policy.keep, bool) or not isinstance(policy.keep, int):
        raise param_error(error, "swa_replay_keep", f"must be an integer, got {policy.keep!r}")
    if not model:
        return
    least = policy.window + policy.max_backtrack
    if policy.keep < least:
        raise param_error(error, "swa_replay_keep", f"{policy.keep} is below the window ({policy.window}) plus the "
                          f"largest rollback ({policy.max_backtrack}): bounded replay needs >= {least} tokens to "
                          "rebuild the rings")
    for r in policy.ratios:
        if page_tokens % r:
            # a group open at a page boundary would need its first half from the compressor state
            raise error(f"prefix caching needs pages of whole compressor groups: a page of {page_tokens} tokens "
                        f"leaves a ratio-{r} group open at its end")


@dataclass
class PrefixHit:
    """What a prompt finds in the prefix cache: `pages` hold its first `num_tokens` tokens
    (hashes: their chain); the sequence resumes at `start` (num_tokens in exact mode, num_tokens
    - keep in bounded mode; 0: a miss) from the slot state `state` (exact mode)."""
    query_tokens: int
    num_tokens: int = 0
    start: int = 0
    pages: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    state: object | None = None


@dataclass
class PrefixStats:
    """Counters of one engine since it started (or of one run: `since`)."""
    queries: int = 0  # admissions that looked their tokens up (a preempted sequence looks again)
    query_tokens: int = 0  # their tokens
    hit_tokens: int = 0  # of those, tokens whose pages came from the cache
    saved_tokens: int = 0  # prefill rows not run thanks to hits (hit tokens less bounded replay's)
    evictions: int = 0  # registered pages reused as free ones

    def since(self, before: "PrefixStats") -> "PrefixStats":
        return PrefixStats(*(getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__))

    def copy(self) -> "PrefixStats":
        return self.since(PrefixStats())

    def summary(self) -> dict:
        return {"hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
                "queries": self.queries, "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens,
                "prefill_tokens_saved": self.saved_tokens, "evictions": self.evictions}


class CacheManager:
    def __init__(self, num_slots: int, num_pages: int, page_tokens: int = PAGE_TOKENS,
                 prefix: PrefixPolicy | None = None, ops: SlotOps | None = None):
        """`prefix`: prefix caching with this policy (None: off); `ops`: the executor's slot and
        page copies it needs."""
        if num_slots < 1 or num_pages < 1:
            raise ValueError(f"a cache needs >= 1 slot and >= 1 page, got {num_slots} slots, {num_pages} pages")
        if prefix is not None and ops is None:
            raise ValueError("a prefix cache needs the executor's slot operations")
        self.num_slots, self.num_pages, self.page_tokens = num_slots, num_pages, page_tokens
        self.prefix, self.ops = prefix, ops
        # min-heaps: the lowest free id goes out first, so placement depends only on the request order
        self._free_slots = list(range(num_slots))
        self._free_pages = list(range(num_pages))
        self._slot: dict[object, int] = {}
        self._pages: dict[object, list[int]] = {}
        self._refs: dict[int, int] = {}  # page -> sequences holding it
        self._by_hash: dict[bytes, int] = {}  # registered pages
        self._hash_of: dict[int, bytes] = {}
        self._state: dict[int, object] = {}  # exact mode: slot state after the page's last token
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody; oldest first
        self._chain: dict[object, list[bytes]] = {}  # owner -> hashes of its first pages (registered or hit)
        # bounded replay under way: owner -> (hit tokens, index of its first copied page, the shared pages copied)
        self._replay: dict[object, tuple[int, int, list[int]]] = {}
        self.stats = PrefixStats()

    # ---- queries --------------------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_pages(self) -> int:
        """Pages a sequence can be given: free ones and registered ones nobody holds."""
        return len(self._free_pages) + len(self._evictable)

    @property
    def free_tokens(self) -> int:
        """Tokens the free pages can still hold (whole pages; partly filled pages are not counted)."""
        return self.free_pages * self.page_tokens

    @property
    def cached_pages(self) -> int:
        """Registered pages (held or not)."""
        return len(self._by_hash)

    def slot(self, owner) -> int:
        return self._slot[owner]

    def pages(self, owner) -> list[int]:
        return self._pages[owner]

    def holds(self, owner) -> bool:
        return owner in self._slot

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def replay_end(self, owner) -> int | None:
        """Where `owner`'s bounded replay ends (its hit's length), while it is under way."""
        return self._replay[owner][0] if owner in self._replay else None

    def extra_pages(self, owner, num_tokens: int) -> int:
        """Pages `owner` still needs so that `num_tokens` tokens are covered."""
        have = len(self._pages.get(owner, ()))
        return max(0, self.pages_for(num_tokens) - have)

    def can_cover(self, owner, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Whether `owner` can get pages for `num_tokens` tokens (a new sequence: with `hit`)."""
        if hit is not None and hit.start:
            return self._new_pages(hit, num_tokens) <= self.free_pages - self._pinned(hit)
        return self.extra_pages(owner, num_tokens) <= self.free_pages

    # ---- prefix lookup ----------------------------------------------------------------------------

    def lookup(self, token_ids: list[int]) -> PrefixHit:
        """The longest run of registered pages the tokens start with, as the policy may resume
        from it. At least one token is left to compute (its logits give the next sample)."""
        hit = PrefixHit(query_tokens=len(token_ids))
        parent = ROOT_HASH
        for k in range((len(token_ids) - 1) // self.page_tokens):
            parent = page_hash(parent, token_ids[k * self.page_tokens:(k + 1) * self.page_tokens])
            page = self._by_hash.get(parent)
            if page is None:
                break
            hit.pages.append(page)
            hit.hashes.append(parent)
        if self.prefix.mode == "exact":
            while hit.pages and hit.pages[-1] not in self._state:  # an exact hit ends at a saved slot state
                hit.pages.pop()
                hit.hashes.pop()
            if hit.pages:
                hit.state = self._state[hit.pages[-1]]
            hit.num_tokens = hit.start = len(hit.pages) * self.page_tokens
        else:
            hit.num_tokens = len(hit.pages) * self.page_tokens
            group = self.prefix.group
            hit.start = max(0, (hit.num_tokens - self.prefix.keep) // group * group)
            if not hit.start:  # nothing to gain: the replay would recompute the whole prefix
                hit.pages, hit.hashes, hit.num_tokens = [], [], 0
        return hit

    def _shared(self, hit: PrefixHit) -> tuple[list[int], list[int]]:
        """(pages the sequence shares, pages it gets private copies of: those its replay rewrites)."""
        if self.prefix.mode == "exact":
            return hit.pages, []
        first = hit.start // self.page_tokens
        return hit.pages[:first], hit.pages[first:]

    def _new_pages(self, hit: PrefixHit, num_tokens: int) -> int:
        return self.pages_for(num_tokens) - len(self._shared(hit)[0])

    def _pinned(self, hit: PrefixHit) -> int:
        """Of the hit's pages, those now free for reuse: taking them leaves fewer for new pages."""
        return sum(1 for p in hit.pages if p in self._evictable)

    # ---- allocation -----------------------------------------------------------------------------

    def _take_page(self) -> int:
        if self._free_pages:
            return heapq.heappop(self._free_pages)
        page, _ = self._evictable.popitem(last=False)
        self._unregister(page)
        self.stats.evictions += 1
        return page

    def _unregister(self, page: int) -> None:
        del self._by_hash[self._hash_of.pop(page)]
        self._state.pop(page, None)

    def _hold(self, page: int) -> None:
        self._refs[page] = self._refs.get(page, 0) + 1
        self._evictable.pop(page, None)

    def _release(self, page: int) -> None:
        left = self._refs[page] - 1
        if left:
            self._refs[page] = left
            return
        del self._refs[page]
        if page in self._hash_of:
            self._evictable[page] = None  # the newest release is evicted last
        else:
            heapq.heappush(self._free_pages, page)

    def allocate(self, owner, num_tokens: int, hit: PrefixHit | None = None) -> int:
        """A slot for a new sequence and pages for its first `num_tokens` tokens; returns the slot.
        With a `hit` (from `lookup`; the sequence resumes at hit.start) the hit's pages are shared
        or copied and the slot is set up to resume: restored (exact) or cleared (bounded).
        All or nothing: on CacheFull nothing is held."""
        if owner in self._slot:
            raise ValueError(f"sequence {owner!r} already holds slot {self._slot[owner]}")
        if not self._free_slots:
            raise CacheFull(f"no free state slot ({self.num_slots} in use)")
        hit = hit if hit is not None and hit.start else None
        shared, copied = self._shared(hit) if hit else ([], [])
        need = self.pages_for(num_tokens) - len(shared)
        room = self.free_pages - (self._pinned(hit) if hit else 0)
        if need > room:
            raise CacheFull(f"{need} pages needed, {room} free")
        for page in shared + copied:  # held first, so that taking new pages cannot reuse them
            self._hold(page)
        new = [self._take_page() for _ in range(need)]
        for src, dst in zip(copied, new):
            self.ops.copy_page(src, dst)
        for page in new:
            self._hold(page)
        slot = self._slot[owner] = heapq.heappop(self._free_slots)
        self._pages[owner] = shared + new
        if self.prefix is not None:
            self._chain[owner] = list(hit.hashes) if hit else []
        if copied:  # (the shared pages stay held: the sequence reads them once its replay is done)
            self._replay[owner] = (hit.num_tokens, len(shared), copied)
        if hit:
            if hit.state is not None:
                self.ops.restore_slot(slot, hit.state)
            else:
                self.ops.reset_slot(slot)
        return slot

    def count_query(self, hit: PrefixHit) -> None:
        """An admission's lookup, counted once it is admitted."""
        self.stats.queries += 1
        self.stats.query_tokens += hit.query_tokens
        self.stats.hit_tokens += hit.num_tokens
        self.stats.saved_tokens += hit.start

    def grow(self, owner, num_tokens: int) -> list[int]:
        """Extend `owner`'s pages to cover `num_tokens` tokens; returns all its pages in order.
        All or nothing: on CacheFull its pages are unchanged."""
        need = self.extra_pages(owner, num_tokens)
        if need > self.free_pages:
            raise CacheFull(f"{need} more pages needed, {self.free_pages} free")
        pages = self._pages[owner]
        for _ in range(need):
            page = self._take_page()
            self._hold(page)
            pages.append(page)
        return pages

    def shrink(self, owner, num_tokens: int) -> list[int]:
        """Give back `owner`'s pages past the ones covering `num_tokens` tokens (the pages a
        verify step grew for drafts that were rejected); returns its remaining pages."""
        pages = self._pages[owner]
        keep = self.pages_for(num_tokens)
        while len(pages) > keep:
            self._release(pages.pop())
        return pages

    def register(self, owner, token_ids: list[int], num_cached: int, written_end: int) -> None:
        """Register `owner`'s pages that its first `num_cached` tokens fill (a no-op without prefix
        caching). `written_end`: the end of the rows its last step wrote into its slot; the slot
        state is saved with a page (exact mode) when that step wrote no more than max_backtrack
        rows past the page's end. A page whose tokens are registered already (another sequence
        computed them) stays private; it gives the registered page its state if that has none."""
        if self.prefix is None or owner not in self._slot:
            return
        chain, pages = self._chain[owner], self._pages[owner]
        if owner in self._replay and num_cached >= self._replay[owner][0]:  # the replay is done
            _, first, shared = self._replay.pop(owner)
            for i, page in enumerate(shared, first):
                self._release(pages[i])
                pages[i] = page
        for k in range(len(chain), min(num_cached // self.page_tokens, len(pages))):
            h = page_hash(chain[-1] if chain else ROOT_HASH, token_ids[k * self.page_tokens:(k + 1) * self.page_tokens])
            chain.append(h)
            page = self._by_hash.get(h)
            if page is None:
                page = self._by_hash[h] = pages[k]
                self._hash_of[page] = h
            exact_here = written_end - (k + 1) * self.page_tokens <= self.prefix.max_backtrack
            if self.prefix.mode == "exact" and exact_here and page not in self._state:
                self._state[page] = self.ops.save_slot(self._slot[owner])

    def reset_prefix(self) -> None:
        """Forget every registered page and saved state (vLLM's reset_prefix_cache): pages nobody
        holds become free, held ones private to their holders."""
        for page in self._evictable:
            heapq.heappush(self._free_pages, page)
        self._evictable.clear()
        self._by_hash.clear()
        self._hash_of.clear()
        self._state.clear()

    def free(self, owner) -> None:
        """Return `owner`'s slot and pages to the pool (a no-op for an owner holding nothing);
        registered pages stay registered until their page is needed."""
        if owner not in self._slot:
            return
        heapq.heappush(self._free_slots, self._slot.pop(owner))
        for page in reversed(self._pages.pop(owner)):  # the prefix's last page is reused first
            self._release(page)
        for page in self._replay.pop(owner, (0, 0, []))[2]:
            self._release(page)
        self._chain.pop(owner, None)

    def check_no_leak(self) -> None:
        """Raise RuntimeError unless every slot is free or owned once, and every page is free,
        registered and held by nobody, or held by exactly as many sequences as count it."""
        held: dict[int, int] = {}
        for ps in [*self._pages.values(), *(r[2] for r in self._replay.values())]:
            for p in ps:
                held[p] = held.get(p, 0) + 1
        if held != self._refs:
            raise RuntimeError(f"page references out of step: {len(held)} pages held, {len(self._refs)} counted")
        unheld = self._free_pages + list(self._evictable)
        if sorted(list(held) + unheld) != list(range(self.num_pages)):
            raise RuntimeError(f"pages leaked or doubled: {len(held)} held + {len(self._free_pages)} free + "
                               f"{len(self._evictable)} cached of {self.num_pages}")
        if any(p not in self._hash_of for p in self._evictable) or set(self._state) - set(self._hash_of):
            raise RuntimeError("an unregistered page is cached or keeps a slot state")
        if sorted(list(self._slot.values()) + self._free_slots) != list(range(self.num_slots)):
            raise RuntimeError(f"slots leaked or doubled: {len(self._slot)} owned + "
                               f"{len(self._free_slots)} free of {self.num_slots}")
