"""Continuous batching: who runs this step, with cache blocks for what they will write.

Prefill work (new or preempted requests, chunked to the token budget) goes first; otherwise
every running request decodes. When the cache runs out of blocks during decode, the most
recently admitted request is preempted: its blocks are freed and it is recomputed later
from its prompt plus what it had generated. Nothing is ever dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from augury.engine.kv_cache import BlockAllocator
from augury.engine.request import Request, Status


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
        self.allocator.free(req.block_table)
        req.block_table = []
        req.status = Status.FINISHED

    def schedule(self) -> ScheduledBatch | None:
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

        def fit(req: Request) -> int:
            left = req.num_tokens - req.num_computed
            # the padded batch may not exceed the budget; a lone request is chunked to it
            if not reqs:
                return min(left, budget)
            w = max(width, left)
            return left if w * (len(reqs) + 1) <= budget else 0

        for req in self.running:
            if req.is_prefilling:
                n = fit(req)
                if n == 0:
                    break
                reqs.append(req)
                ends.append(req.num_computed + n)
                width = max(width, n)
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = fit(req)
            if n == 0:
                break
            # blocks for the whole sequence so far plus the first new token
            if not self.allocator.grow(req.block_table, req.num_tokens + 1):
                break
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
        self.allocator.free(req.block_table)
        req.reset_for_recompute()
        self.waiting.appendleft(req)
        self.num_preemptions += 1
