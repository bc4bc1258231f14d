"""How much to speculate this step: a tree shape, or None for plain decoding.

StaticPolicy always drafts the configured tree, unless more requests are running than
the disable threshold (the seed's rule). AdaptivePolicy (speculative/adaptive.py) picks, per
step, the shape that maximises expected tokens per second, capped by the same threshold.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TreeShape:
    num_steps: int  # draft forwards (tree depth)
    topk: int  # children expanded per node
    num_draft_tokens: int  # tree nodes verified per request, the root included

    @property
    def num_drafts(self) -> int:
        return self.num_draft_tokens - 1


class StaticPolicy:
    def __init__(self, shape: TreeShape, disable_batch_threshold: int | None) -> None:
        self.shape = shape
        self.threshold = disable_batch_threshold

    def choose(self, batch_size: int) -> TreeShape | None:
        if self.threshold is not None and batch_size > self.threshold:
            return None
        return self.shape

    def observe(self, batch_size: int, shape: TreeShape | None, seconds: float, accepted: list[int],
                timed: bool = True, offered: list[int] | None = None) -> None:
        """Feedback after a step (used by the adaptive policy; nothing to learn here). timed=False:
        the step's time is not representative (it also caught the head up on a backlog)."""

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        """Feedback after a plain decode step (nothing to learn here)."""

    def calibrate(self, host, proposer, max_num_seqs: int) -> None:
        """Start-up profiling (nothing to measure for a fixed tree)."""
