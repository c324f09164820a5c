"""Continuous batching: which sequences run in the next step, with how many tokens each.

Every step gets a budget of `max_num_batched_tokens` rows. Running sequences go first, oldest
first: a decode row each, or the next chunk of a prompt (chunked prefill). Then waiting sequences
are admitted in arrival order while the budget, `max_num_seqs`, a free state slot and pages last.
When a running sequence needs a page and none is free, the newest running sequence is preempted
by recompute: its slot and pages go back to the pool and it returns to the front of the queue
with its generated tokens as part of its prompt (the sampler's positions make its later tokens
the same as if it had never stopped).

Prefix caching (runtime/cache.py): a waiting sequence is admitted from the longest cached prefix
of its tokens and resumes after it (or, with bounded replay, `keep` tokens before its end, in
chunks that stop at its end: the replay must finish before the sequence reads the shared pages). In
exact mode a prefill chunk that crosses a page boundary ends at the last one it crosses (unless
it ends within the rings' rollback slack past it): the slot state is saved with a page only at
the end of a step, so this is what lets a prompt's pages end an exact hit. A lookup leaves a
prompt's last token to compute, so for the chunk that ends the tokens the boundary that counts is
the last one before that token: a prompt of whole pages is cut one page short of its end.

Speculation: a decoding sequence that holds drafts gets the verify chunk [t*, d_0 .. d_{m-1}],
with as many drafts as the token budget and the free pages allow. Drafts never preempt anyone:
they are cut first. A preempted sequence drops its drafts.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .cache import CacheManager, PrefixHit
from .sequence import Sequence, SeqStatus


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # rows this step: token_ids[num_cached:] + the first num_drafts drafts
    num_drafts: int = 0  # the chunk's trailing draft rows (a verify chunk), 0 otherwise

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence's tokens (so the step samples it)."""
        return self.seq.num_cached + self.num_tokens - self.num_drafts == len(self.seq.token_ids)

    @property
    def tokens(self) -> list[int]:
        seq = self.seq
        real = seq.token_ids[seq.num_cached:seq.num_cached + self.num_tokens - self.num_drafts]
        return real + seq.drafts[:self.num_drafts]


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # an executor that runs steps at fixed shapes verifies in buckets of at most this many
        # sequences, every one a decode row with its drafts (None: any step may carry drafts)
        self.verify_seqs: int | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _may_verify(self) -> bool:
        """Whether this step may carry drafts: always, unless the executor verifies in buckets; then
        only a step of decode rows alone that fits one, and not while a waiting request could be
        admitted instead (speculating every step would otherwise keep the queue waiting)."""
        if self.verify_seqs is None:
            return True
        return (len(self.running) <= self.verify_seqs and all(s.num_uncached == 1 for s in self.running)
                and not (self.waiting and len(self.running) < self.max_num_seqs))

    def schedule(self) -> list[Scheduled]:
        budget, batch = self.max_num_batched_tokens, []
        verify = self._may_verify()
        # 1. running sequences, oldest first: the next prompt chunk or one decode row each
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq.num_cached, min(seq.num_uncached, budget), len(seq.token_ids))
            replay_end = self.cache.replay_end(seq.request_id) if self.cache.prefix else None
            if replay_end is not None and seq.num_cached < replay_end:
                n = min(n, replay_end - seq.num_cached)  # a bounded replay's chunks end where the cached prefix does
            drafts = 0
            if verify and seq.drafts and seq.num_uncached == 1:  # a decode row: verify what budget and pages allow
                drafts = min(len(seq.drafts), budget - n)
                while drafts and not self.cache.can_cover(seq.request_id, seq.num_cached + n + drafts):
                    drafts -= 1
            while not self.cache.can_cover(seq.request_id, seq.num_cached + n) and self.running[-1] is not seq:
                self._preempt(self.running[-1])  # the newest, not yet scheduled in this step
            if not self.cache.can_cover(seq.request_id, seq.num_cached + n):
                self._preempt(seq)  # the newest left: nothing younger to take pages from
                break
            self.cache.grow(seq.request_id, seq.num_cached + n + drafts)
            batch.append(Scheduled(seq, n + drafts, drafts))
            budget -= n + drafts
            i += 1
        # 2. waiting sequences in order (preempted ones sit at the front) while room is left; not
        # beside drafts where a bucket must hold the verify step (a preemption may have queued one)
        bucketed = self.verify_seqs is not None and any(s.num_drafts for s in batch)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not bucketed:
            seq = self.waiting[0]
            if not self.cache.free_slots:
                break
            hit = self.cache.lookup(seq.token_ids) if self.cache.prefix else None
            start = hit.start if hit else 0
            n = self._chunk(start, min(len(seq.token_ids) - start, budget), len(seq.token_ids))
            if hit and start and self.cache.prefix.mode == "bounded":
                n = min(n, hit.num_tokens - start)
            if hit and start and not self.cache.can_cover(seq.request_id, start + n, hit):
                # (bounded replay's private copies may need pages a miss does not): admit it as a miss
                hit, start = PrefixHit(query_tokens=len(seq.token_ids)), 0
                n = self._chunk(0, min(len(seq.token_ids), budget), len(seq.token_ids))
            if not self.cache.free_slots or not self.cache.can_cover(seq.request_id, start + n, hit):
                break  # first come first served: nobody overtakes the head of the queue
            self.cache.allocate(seq.request_id, start + n, hit)
            if hit:
                self.cache.count_query(hit)
            seq.num_cached = start
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(Scheduled(seq, n))
            budget -= n
        return batch

    def _chunk(self, start: int, n: int, total: int) -> int:
        """A chunk of n rows from `start` of a sequence of `total` tokens, cut at the last page
        boundary it crosses when exact prefix caching saves slot states; for the chunk that ends
        the tokens, the last boundary before its final token, where a later lookup of the same
        tokens can end its hit (module doc)."""
        prefix = self.cache.prefix
        if prefix is None or prefix.mode != "exact" or n < 2:
            return n
        end = start + n
        reach = end if end < total else total - 1
        boundary = reach // self.cache.page_tokens * self.cache.page_tokens
        return boundary - start if boundary > start and end - boundary > prefix.max_backtrack else n

    def advance(self, batch: list[Scheduled]) -> None:
        """After the step ran: the caches now hold each scheduled chunk (of a verify chunk, its
        t* row; the engine adds the drafts it accepts)."""
        for s in batch:
            if not s.seq.finished:  # (a step submitted before its sequence's last token was known)
                s.seq.num_cached += s.num_tokens - s.num_drafts

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.cache.free(seq.request_id)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def abort(self, request_id: str) -> Sequence | None:
        """End a waiting or running request now, freeing what it holds; None if there is none."""
        seq = next((s for q in (self.running, self.waiting) for s in q if s.request_id == request_id), None)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.request_id)
        seq.num_cached, seq.status = 0, SeqStatus.WAITING
        seq.drafts, seq.draft_rates = [], []  # its recompute ends in a fresh sample and fresh drafts
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
