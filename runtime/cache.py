"""Ownership of the cache memory: per-sequence state slots and pages of the compressed caches.

A sequence holds one state SLOT while it runs (its window rings, compressor rings and Engram
history live there) and the PAGES that cover its cached tokens: each page holds the compressed
entries of PAGE_TOKENS (128) raw tokens, so L cached tokens need ceil(L / 128) pages. Pages are
handed out in the order the sequence's block table lists them and grow as it does; a speculative
step grows them for its draft rows and shrinks them back to the accepted ones.
"""
from __future__ import annotations

import heapq

from ..models.deepseek_v41 import PAGE_TOKENS


class CacheFull(RuntimeError):
    """No slot or not enough pages; the scheduler answers by waiting or preempting."""


class CacheManager:
    def __init__(self, num_slots: int, num_pages: int, page_tokens: int = PAGE_TOKENS):
        if num_slots < 1 or num_pages < 1:
            raise ValueError(f"a cache needs >= 1 slot and >= 1 page, got {num_slots} slots, {num_pages} pages")
        self.num_slots, self.num_pages, self.page_tokens = num_slots, num_pages, page_tokens
        # min-heaps: the lowest free id goes out first, so placement depends only on the request order
        self._free_slots = list(range(num_slots))
        self._free_pages = list(range(num_pages))
        self._slot: dict[object, int] = {}
        self._pages: dict[object, list[int]] = {}

    # ---- queries --------------------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def free_tokens(self) -> int:
        """Tokens the free pages can still hold (whole pages; partly filled pages are not counted)."""
        return len(self._free_pages) * self.page_tokens

    def slot(self, owner) -> int:
        return self._slot[owner]

    def pages(self, owner) -> list[int]:
        return self._pages[owner]

    def holds(self, owner) -> bool:
        return owner in self._slot

    def extra_pages(self, owner, num_tokens: int) -> int:
        """Pages `owner` still needs so that `num_tokens` tokens are covered."""
        have = len(self._pages.get(owner, ()))
        return max(0, self.pages_for(num_tokens) - have)

    def can_cover(self, owner, num_tokens: int) -> bool:
        return self.extra_pages(owner, num_tokens) <= len(self._free_pages)

    # ---- allocation -----------------------------------------------------------------------------

    def allocate(self, owner, num_tokens: int) -> int:
        """A slot for a new sequence and pages for its first `num_tokens` tokens; returns the slot.
        All or nothing: on CacheFull nothing is held."""
        if owner in self._slot:
            raise ValueError(f"sequence {owner!r} already holds slot {self._slot[owner]}")
        if not self._free_slots:
            raise CacheFull(f"no free state slot ({self.num_slots} in use)")
        need = self.pages_for(num_tokens)
        if need > len(self._free_pages):
            raise CacheFull(f"{need} pages needed, {len(self._free_pages)} free")
        self._slot[owner] = heapq.heappop(self._free_slots)
        self._pages[owner] = [heapq.heappop(self._free_pages) for _ in range(need)]
        return self._slot[owner]

    def grow(self, owner, num_tokens: int) -> list[int]:
        """Extend `owner`'s pages to cover `num_tokens` tokens; returns all its pages in order.
        All or nothing: on CacheFull its pages are unchanged."""
        need = self.extra_pages(owner, num_tokens)
        if need > len(self._free_pages):
            raise CacheFull(f"{need} more pages needed, {len(self._free_pages)} free")
        pages = self._pages[owner]
        pages.extend(heapq.heappop(self._free_pages) for _ in range(need))
        return pages

    def shrink(self, owner, num_tokens: int) -> list[int]:
        """Give back `owner`'s pages past the ones covering `num_tokens` tokens (the pages a
        verify step grew for drafts that were rejected); returns its remaining pages."""
        pages = self._pages[owner]
        keep = self.pages_for(num_tokens)
        while len(pages) > keep:
            heapq.heappush(self._free_pages, pages.pop())
        return pages

    def free(self, owner) -> None:
        """Return `owner`'s slot and pages to the pool (a no-op for an owner holding nothing)."""
        if owner not in self._slot:
            return
        heapq.heappush(self._free_slots, self._slot.pop(owner))
        for page in self._pages.pop(owner):
            heapq.heappush(self._free_pages, page)

    def check_no_leak(self) -> None:
        """Raise RuntimeError unless every slot and page is either free or owned exactly once."""
        owned_pages = [p for ps in self._pages.values() for p in ps]
        if sorted(owned_pages + self._free_pages) != list(range(self.num_pages)):
            raise RuntimeError(f"pages leaked or doubled: {len(owned_pages)} owned + "
                               f"{len(self._free_pages)} free of {self.num_pages}")
        if sorted(list(self._slot.values()) + self._free_slots) != list(range(self.num_slots)):
            raise RuntimeError(f"slots leaked or doubled: {len(self._slot)} owned + "
                               f"{len(self._free_slots)} free of {self.num_slots}")
