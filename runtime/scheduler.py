"""The scheduler: which requests the next step feeds and how many tokens each.

Running decodes come first, then prefill chunks, up to the step's token budget. A request is
admitted when a place and pool rows for its whole sequence are free (sharing the rows of a
cached prefix); when decoding runs out of rows, the most recently admitted request is
preempted: its rows are freed and it recomputes its sequence later. With the prefix cache a
step ends at the next 256-token block boundary, whose state the cache keeps.
"""

from __future__ import annotations

import contextlib
import itertools

from dsv4c.runtime.drafter import Draft, Drafter
from dsv4c.runtime.kv_pool import KVPool, PoolExhausted
from dsv4c.runtime.prefix_cache import BLOCK_TOKENS, PrefixCache
from dsv4c.runtime.request import Request


class Scheduler:
    def __init__(self, pool: KVPool, requests: dict[int, Request], prefix_cache: PrefixCache | None,
                 max_step_tokens: int, prefill_chunk: int | None, max_requests: int, drafter: Drafter | None):
        """``requests``: the engine's, by id (the scheduler reads them, the engine adds and removes
        them). ``drafter``, when speculating: a step feeds the positions at a prompt's end it reads
        even when they are cached, and it is told of every request that leaves the pool."""
        self.pool, self.requests, self.prefix_cache = pool, requests, prefix_cache
        self.max_step_tokens, self.prefill_chunk, self.max_requests = max_step_tokens, prefill_chunk, max_requests
        self.drafter = drafter
        self.preemptions = 0
        self._admitted: dict[int, int] = {}  # request in the pool -> admission number (preempt the newest first)
        self._admissions = itertools.count()
        self._preempted_now: set[int] = set()

    def plan(self) -> list[tuple[Request, int]]:
        """(request, number of tokens to feed) for the next step: decodes first, then prefill."""
        budget, plan = self.max_step_tokens, []
        live = [r for r in self.requests.values() if not r.finished]
        live.sort(key=lambda r: (r.fed < len(r.prompt), r.rid))  # running decodes before prefills
        for r in live:
            if len(r.sequence) == r.fed or budget == 0 or r.rid in self._preempted_now:
                continue
            if r.rid not in self.pool.requests and (len(self.pool.requests) >= self.max_requests
                                                    or not self.admit(r)):
                continue  # it waits for a place, or for rows
            # With the prefix cache, a step ends at the next block boundary, whose state it keeps.
            room = (r.fed // BLOCK_TOKENS + 1) * BLOCK_TOKENS - r.fed if self.prefix_cache else budget
            if r.decoding:  # its last token, and the drafts the budget leaves room for
                r.draft.truncate(min(budget, room) - 1)
                n = 1 + len(r.draft.tokens)
            else:
                pending = len(r.sequence) - r.fed
                n = min(pending, budget, self.prefill_chunk or pending, room)
            if not self._grow(r, r.fed + n, plan):
                continue
            plan.append((r, n))
            budget = self.max_step_tokens - sum(k for _, k in plan)
        self._preempted_now.clear()
        return plan

    def admit(self, r: Request) -> bool:
        """Take pool rows for ``r``'s whole sequence, its cached prefix shared; False when they are
        not free (it waits)."""
        hit = []
        looked_up = self.prefix_cache is not None and not r.wants_every_row
        if looked_up:
            # At least one token is fed (its logits are sampled), and the prompt's end that the
            # drafter reads from the step (a cached slot does not hold the step's output for it).
            keep = 1 + (self.drafter.prompt_tail if self.drafter is not None else 0)
            hit = self.prefix_cache.lookup(r.sequence, max(len(r.sequence) - keep, 0) // BLOCK_TOKENS, r.images)
        shared = [b.envelope for b in hit if b.envelope is not None]
        try:
            with self.prefix_cache.pinned(hit) if hit else contextlib.nullcontext():
                rows = self.pool.admit(r.rid, reserve_tokens=len(r.sequence), shared=shared)
        except PoolExhausted:
            return False
        if hit:
            self.pool.copy_slot(hit[-1].slot, rows.slot, at_block_boundary=True)
            r.fed = len(hit) * BLOCK_TOKENS
        if looked_up:
            self.prefix_cache.count(len(r.sequence), len(hit) * BLOCK_TOKENS)
        if r.cached_tokens is None:  # a preempted request's later admissions recompute what it generated
            r.cached_tokens = min(len(hit) * BLOCK_TOKENS, len(r.prompt))
        self._admitted[r.rid] = next(self._admissions)
        return True

    def _grow(self, r: Request, tokens: int, plan: list[tuple[Request, int]]) -> bool:
        """Envelopes for ``r``'s positions below ``tokens``; when the pool has none left, the most
        recently admitted request is preempted (taken out of ``plan`` if it was in it). False when
        that is ``r`` itself."""
        while True:
            try:
                self.pool.ensure(r.rid, tokens)
                return True
            except PoolExhausted:
                victim = self.requests[max(self._admitted, key=self._admitted.get)]
                if victim is r and len(self._admitted) == 1:
                    raise  # cannot happen: the pool holds one request of max_context (runtime.loading.pool_rows)
                self._preempt(victim)
                plan[:] = [(q, n) for q, n in plan if q is not victim]
                if victim is r:
                    return False

    def _preempt(self, r: Request) -> None:
        """Give back ``r``'s rows; it is admitted again later and recomputes its sequence (what of
        it the prefix cache still holds, it shares)."""
        self.leave(r.rid)
        self._preempted_now.add(r.rid)  # not admitted again in the step that preempted it
        self.preemptions += 1
        r.fed, r.draft = 0, Draft()
        r.logits.clear()  # every row is computed again
        del r.prompt_logprobs[1:]

    def cache_blocks(self, plan: list[tuple[Request, int]]) -> None:
        """Cache the block each request of the step has just fed to its end (steps end at block
        boundaries): its envelope, and its slot as it is now."""
        for r, _ in plan:
            if r.rid in self.pool.requests and r.fed and r.fed % BLOCK_TOKENS == 0 and not r.draft.tokens:
                rows = self.pool.requests[r.rid]
                index = r.fed // BLOCK_TOKENS - 1
                envelope = rows.blocks[index] if rows.blocks else None
                self.prefix_cache.insert(r.sequence, index, envelope, rows.slot, r.images)

    def leave(self, rid: int) -> None:
        """Free request ``rid``'s pool rows, if it holds any (finished, cancelled, preempted)."""
        if rid in self.pool.requests:
            self.pool.free(rid)
            del self._admitted[rid]
            if self.drafter is not None:
                self.drafter.release(rid)
