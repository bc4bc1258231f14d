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


# A policy's account of its last plan (SpeculationPolicy.why): (what decided it, a depth or a count,
# drafting's predicted tokens/s, plain decoding's measured tokens/s). A tuple is all a step pays; `reason`
# words it only for the requests that asked (SamplingParams.return_token_sources).
Why = tuple[str, int, float, float]


def reason(why: Why) -> str:
    """A policy's Why in words (outputs.SpecStep.reason)."""
    code, n, g, plain = why
    rates = f"predicted {g:.1f} tok/s drafting depth {n} vs {plain:.1f} tok/s plain"
    return {
        "static": "the configured tree (static policy)",
        "threshold": f"more requests running than the disable threshold ({n})",
        "none": "no request in the batch may draft",
        "measure-plain": "measuring plain decoding first (nothing is assumed about this machine)",
        "probe": f"probing drafting depth {n}: measuring its step time and the requests' acceptance afresh here",
        "guard": f"off by the guard: drafting's realized tok/s lost to plain decoding's; probed again in {n} steps "
                 "at the soonest",
        "explore": f"a plain step to keep measuring plain decoding while drafting pays ({rates})",
        "try": f"a request left out tried again, its figures measured afresh ({rates})",
        "on": f"on: {rates}",
        "off": f"off: {rates}" if n else f"off: no request's acceptance pays for drafting ({plain:.1f} tok/s plain)",
    }.get(code, code)


def user_caps(reqs: Sequence[Request]) -> tuple[int | None, ...]:
    """Each request's own SamplingParams.max_draft_tokens (None: no cap, 0: never drafts)."""
    return tuple(r.params.max_draft_tokens for r in reqs)


class StaticPolicy:
    def __init__(self, shape: TreeShape, disable_batch_threshold: int | None) -> None:
        self.shape = self.max_shape = shape
        self.threshold = disable_batch_threshold
        self.why: Why = ("static", 0, 0.0, 0.0)

    def choose(self, batch_size: int) -> TreeShape | None:
        if self.threshold is not None and batch_size > self.threshold:
            self.why = ("threshold", self.threshold, 0.0, 0.0)
            return None
        self.why = ("static", 0, 0.0, 0.0)
        return self.shape

    def plan(self, reqs: Sequence[Request]) -> StepPlan:
        """The configured tree (or none, above the threshold) for every request, cut to its own cap."""
        return StepPlan(self.choose(len(reqs)), user_caps(reqs))

    def observe(self, batch_size: int, shape: TreeShape | None, seconds: float, accepted: list[int],
                timed: bool = True, offered: list[int] | None = None, reqs: Sequence[Request] | None = None,
                sizes: list[int] | None = None, forced: int = 0, lookup: list[int] | None = None,
                wall: float | None = None) -> None:
        """Feedback after a step (used by the adaptive policy; nothing to learn here). timed=False:
        the step's time is not representative (it also caught the head up on a backlog)."""

    def observe_catch_up(self, rows: int, seconds: float) -> None:
        """The head caught up `rows` positions it had not seen in `seconds` (nothing to learn here)."""

    def free_first(self, reqs: Sequence[Request], scores: Sequence[float]) -> bool:
        """The configured tree is always drafted: suffix drafts are never verified in its place."""
        return False

    def free_allowed(self, batch_size: int) -> bool:
        """Where the tree is not drafted (above the threshold, no request may draft), the drafts that
        cost no draft model are verified: nothing is measured here to say they lose."""
        return True

    def free_cut(self, batch_size: int, probs: Sequence[float], reaches: Sequence[int] | None = None) -> int:
        """Every draft that costs no draft model is verified (nothing is measured here to cut them by)."""
        return len(probs)

    def observe_free(self, batch_size: int, tokens: int, seconds: float, timed: bool = True, lookup: int = 0,
                     scores: Sequence[float] | None = None, rows: int | None = None,
                     chains: Sequence[tuple[Sequence[int], Sequence[int], int]] = ()) -> None:
        """Feedback after a step of drafts that cost no draft model (nothing to learn here)."""

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        """Feedback after a plain decode step (nothing to learn here)."""

    def costs_changed(self) -> None:
        """Step times measured so far no longer hold (nothing measured here)."""
