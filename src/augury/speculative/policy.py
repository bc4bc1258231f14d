"""How much to speculate this step: a tree shape, or None for plain decoding, and per request
how many of its tree's draft nodes it keeps (a StepPlan).

StaticPolicy always drafts the configured tree, unless more requests are running than
the disable threshold (the seed's rule); each request keeps what its own max_draft_tokens allows.
AdaptivePolicy (speculative/adaptive.py) picks, per step, the shape and the per-request budgets
that maximise tokens per second as measured on this machine, capped by the same threshold.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from augury.core.request import Request


@dataclass(frozen=True)
class TreeShape:
    num_steps: int  # draft forwards (tree depth)
    topk: int  # children expanded per node
    num_draft_tokens: int  # tree nodes verified per request, the root included

    @property
    def num_drafts(self) -> int:
        return self.num_draft_tokens - 1


@dataclass(frozen=True)
class StepPlan:
    """A policy's decision for one decode step of a batch."""

    shape: TreeShape | None  # the tree drafted for the rows that draft; None: decode plainly
    caps: tuple[int | None, ...]  # per request, most draft nodes it keeps: 0 = none (a root-only row),
    #                               None = its whole tree (a proposer's extra nodes included)

    @property
    def drafting(self) -> list[int]:
        """Rows that draft this step."""
        return [] if self.shape is None else [i for i, c in enumerate(self.caps) if c != 0]


def user_caps(reqs: Sequence[Request]) -> tuple[int | None, ...]:
    """Each request's own SamplingParams.max_draft_tokens (None: no cap, 0: never drafts)."""
    return tuple(r.params.max_draft_tokens for r in reqs)


class StaticPolicy:
    def __init__(self, shape: TreeShape, disable_batch_threshold: int | None) -> None:
        self.shape = self.max_shape = shape
        self.threshold = disable_batch_threshold

    def choose(self, batch_size: int) -> TreeShape | None:
        if self.threshold is not None and batch_size > self.threshold:
            return None
        return self.shape

    def plan(self, reqs: Sequence[Request]) -> StepPlan:
        """The configured tree (or none, above the threshold) for every request, cut to its own cap."""
        return StepPlan(self.choose(len(reqs)), user_caps(reqs))

    def observe(self, batch_size: int, shape: TreeShape | None, seconds: float, accepted: list[int],
                timed: bool = True, offered: list[int] | None = None, reqs: Sequence[Request] | None = None,
                sizes: list[int] | None = None, forced: int = 0) -> None:
        """Feedback after a step (used by the adaptive policy; nothing to learn here). timed=False:
        the step's time is not representative (it also caught the head up on a backlog)."""

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        """Feedback after a plain decode step (nothing to learn here)."""

    def costs_changed(self) -> None:
        """Step times measured so far no longer hold (nothing measured here)."""
