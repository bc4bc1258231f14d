"""Continuous batching: who runs this step, with cache blocks for what they will write.

Prefill work (new or preempted requests, chunked to the token budget) goes first; otherwise
every running request decodes. When the cache runs out of blocks during decode, the most
recently admitted request is preempted: its blocks are freed and it is recomputed later
from its prompt plus what it had generated. Nothing is ever dropped.

Prefix caching (engine/kv_cache.py keeps the blocks): a request's full blocks are offered to
the cache as soon as all their tokens' KV is committed, and when it leaves (finished, aborted
or preempted). A waiting request is admitted with the longest run of its leading full blocks
found there, short of its last token: at least one token is always computed (its logits give
the next one). An EAGLE-3 head reads the head KV of those blocks where whoever computed them
offered it (speculative/eagle3_proposer.py). A request asking for prompt log-probabilities computes
its whole prompt.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from augury.core.kv_cache import BlockAllocator
from augury.core.request import Request, Status


@dataclass
class ScheduledBatch:
    prefill: bool
    requests: list[Request]
    ends: list[int]  # feed tokens [num_computed, end) of each request


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens admitted requests had to prefill, before any cache hit
        self.prefix_hits = 0  # of those, tokens whose KV came from the prefix cache

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or aborted) and give its blocks back."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache_blocks(req)
        self.allocator.free(req.block_table)
        req.block_table = []
        req.status = Status.FINISHED

    def schedule(self) -> ScheduledBatch | None:
        if self.allocator.enable_caching:
            for req in self.running:
                self.cache_blocks(req)
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        if not self.running:
            return None
        self._reserve(1)
        return ScheduledBatch(False, list(self.running), [r.num_tokens for r in self.running])

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        reqs: list[Request] = []
        ends: list[int] = []
        width = 0  # padded query width: the batch costs len(reqs) * width tokens

        def fit(req: Request, done: int) -> int:
            left = req.num_tokens - done
            # the padded batch may not exceed the budget; a lone request is chunked to it
            if not reqs:
                return min(left, budget)
            w = max(width, left)
            return left if w * (len(reqs) + 1) <= budget else 0

        for req in self.running:
            if req.is_prefilling:
                n = fit(req, req.num_computed)
                if n == 0:
                    break
                reqs.append(req)
                ends.append(req.num_computed + n)
                width = max(width, n)
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self._match(req)
            n = fit(req, len(hit) * self.allocator.block_size)
            if n == 0:
                break
            for b in hit:
                self.allocator.take(b)
            table = list(hit)
            # blocks for the whole sequence so far plus the first new token
            if not self.allocator.grow(table, req.num_tokens + 1):
                self.allocator.free(hit)
                break
            req.start_from_cache(table, len(hit), self.allocator.block_size)
            self.prefix_queries += req.num_tokens
            self.prefix_hits += req.num_computed
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            if req.num_tokens - req.num_computed == 1:
                continue  # a one-token prompt is just a decode step
            reqs.append(req)
            ends.append(req.num_computed + n)
            width = max(width, n)
        if not reqs:
            return None
        return ScheduledBatch(True, reqs, ends)

    def _reserve(self, lookahead: int) -> None:
        """Give every running request room for `lookahead` new tokens, preempting if needed."""
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self.allocator.grow(req.block_table, req.num_computed + lookahead):
                i += 1
                continue
            victim = max(self.running, key=lambda r: r.arrival)
            self.preempt(victim)
            if victim is req:
                continue  # index i now holds the next request
        if not self.running:
            raise MemoryError("the KV cache cannot hold even one request; raise num_kv_blocks")

    def try_reserve(self, reqs: list[Request], lookahead: int) -> bool:
        """Extra room for speculation; False (nothing preempted) when blocks are short."""
        need = sum(
            max(0, self.allocator.blocks_for(r.num_computed + lookahead) - len(r.block_table)) for r in reqs
        )
        if need > self.allocator.num_free:
            return False
        for r in reqs:
            self.allocator.grow(r.block_table, r.num_computed + lookahead)
        return True

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache_blocks(req)
        self.allocator.free(req.block_table)
        req.reset_for_recompute()
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ prefix cache
    @property
    def prefix_hit_rate(self) -> float:
        """Of the tokens admitted requests had to prefill, the fraction the prefix cache served."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def _match(self, req: Request) -> list[int]:
        """The cached blocks holding req's longest cached prefix (no references taken)."""
        if not self.allocator.enable_caching or req.params.prompt_logprobs is not None:
            return []
        bs = self.allocator.block_size
        n = (req.num_tokens - 1) // bs  # the last token is always computed
        ids = req.all_token_ids
        hit = []
        for i, key in enumerate(req.prefix_keys(n, bs)):
            b = self.allocator.lookup(key, ids[i * bs : (i + 1) * bs])
            if b is None:
                break
            hit.append(b)
        return hit

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix. Blocks running requests hold stay theirs, unregistered: their
        registered counts go back to 0, so cache_blocks offers their committed blocks again (under the
        same keys: the KV is still there), and later requests can hit them as before."""
        self.allocator.reset_cache()
        for req in (*self.running, *self.waiting):
            req.num_registered = 0

    def cache_blocks(self, req: Request) -> None:
        """Offer req's full blocks whose every token's KV is committed to the prefix cache."""
        if not self.allocator.enable_caching:
            return
        bs = self.allocator.block_size
        # positions past num_tokens may hold KV of tokens a stop condition cut off
        full = min(req.num_computed, req.num_tokens, len(req.block_table) * bs) // bs
        if full <= req.num_registered:
            return
        keys, ids = req.prefix_keys(full, bs), req.all_token_ids
        for i in range(req.num_registered, full):
            self.allocator.register(req.block_table[i], keys[i], ids[i * bs : (i + 1) * bs])
        req.num_registered = full
