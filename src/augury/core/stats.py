"""Engine-wide counters: tokens, speculation acceptance per position and by draft source, chosen
draft sizes."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from augury.core.sources import SOURCE_NAMES

log = logging.getLogger("augury.engine")


@dataclass
class EngineStats:
    generation_tokens_total: int = 0
    num_verify_steps: int = 0  # request-steps that were speculated
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # draft tokens verified / accepted by source (sources.Source: head, lookup, forced); they sum to the two above
    drafted_by_source: list[int] = field(default_factory=lambda: [0] * len(SOURCE_NAMES))
    accepted_by_source: list[int] = field(default_factory=lambda: [0] * len(SOURCE_NAMES))
    # the proposer's drafts alone (not a grammar's forced tokens; depth counts its own levels):
    # accepted_at[i]: verifications whose draft token at depth i+1 was accepted;
    # offered_at[i]: verifications that offered a draft at depth i+1
    accepted_at: list[int] = field(default_factory=list)
    offered_at: list[int] = field(default_factory=list)
    last_draft_tokens: int = 0  # draft tokens per request chosen by the policy at the last decode step
    steps_spec: int = 0
    steps_plain: int = 0
    _last_log: float = field(default_factory=time.monotonic)
    _last_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Mean tokens emitted per verification (accepted drafts + 1)."""
        if self.num_verify_steps == 0:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verify_steps

    def acceptance_rates(self) -> list[float]:
        return [a / o if o else 0.0 for a, o in zip(self.accepted_at, self.offered_at)]

    def record_verification(self, depth_offered: int, depth_accepted: int, drafted: Sequence[int],
                            accepted: Sequence[int]) -> None:
        """One verified row: the proposer's deepest draft level offered and its levels accepted (per
        position), and its drafts verified and accepted per source (indexed by sources.Source)."""
        while len(self.offered_at) < depth_offered:
            self.offered_at.append(0)
            self.accepted_at.append(0)
        for i in range(depth_offered):
            self.offered_at[i] += 1
        for i in range(depth_accepted):
            self.accepted_at[i] += 1
        self.num_verify_steps += 1
        for i, (d, a) in enumerate(zip(drafted, accepted)):
            self.drafted_by_source[i] += d
            self.accepted_by_source[i] += a
        self.num_accepted_tokens += sum(accepted)
        self.num_draft_tokens += sum(drafted)

    def maybe_log(self, engine, force: bool = False) -> None:
        now = time.monotonic()
        interval = engine.config.log_stats_interval
        if not force and (interval <= 0 or now - self._last_log < interval):
            return
        rate = (self.generation_tokens_total - self._last_tokens) / max(now - self._last_log, 1e-9)
        self._last_log, self._last_tokens = now, self.generation_tokens_total
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_rates()[:8])
        log.info(
            "running: %d, waiting: %d, gen throughput: %.1f tok/s, kv usage: %.2f, prefix cache hit rate: %.1f%%, "
            "accept len: %.2f, draft tokens/req: %d, accept rate per position: [%s]",
            engine.num_running, engine.num_waiting, rate, engine.allocator.usage,
            100 * engine.scheduler.prefix_hit_rate, self.accept_length,
            self.last_draft_tokens, rates,
        )
