"""What the adaptive policy knows of acceptance: the batch's and each request's own.

Per depth i, the conditional rate P(accept i | accepted i - 1), as decayed counts (KEEP per step
that observes the depth) over a conservative prior (PRIOR_RATE, or lower where the head's config
measured lower, worth PRIOR_WEIGHT observations); beyond the shape's depth (a grafted prompt-lookup
branch), the mean extra accepted. Each request keeps its own decayed counts (OWN_KEEP per own
observation), shrunk towards the batch's rates by empirical Bayes: the pseudo-count p(1-p)/tau^2
with tau^2 the variance of the first level's rate between requests, learned from the requests
planned each step, so requests that accept alike keep the batch's rates whatever their few draws
say and a copy beside free text soon has its own; deeper levels a request has seen little of are
shrunk towards the batch's scaled as its own first level compares. A request's record also holds
its retry schedule (the adaptive policy's; `_Own.due`). Records live in a WeakKeyDictionary keyed
by the request and go with it.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

from augury.core.request import Request
from augury.speculative.policy import TreeShape

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0  # prior conditional acceptance per depth and its pseudo-count
KEEP = 0.95  # weight the batch-level counts keep at each step that observes them (the last ~20 steps)
SPREAD_PRIOR = 0.04  # prior variance of the first level's acceptance between requests (sd 0.2)
SPREAD_EMA = 0.05  # weight of each step's estimate of that variance
SPREAD_MIN_SEEN = 3.0  # a request's observations before its rate counts in that variance
SHRINK_MIN, SHRINK_MAX = 0.25, 200.0  # bounds of the pseudo-count a request's own rate is shrunk with
OWN_KEEP = 0.95  # weight a request's own counts keep at each of its observations (its last ~20 steps)
OPTIMISTIC_RATE = 0.75  # per level, the guess a request is tried again with
REQ_BACKOFF, REQ_MAX_BACKOFF = 4, 128  # a left-out request's steps before it is tried again (doubling)

Expected = tuple[list[float], float]  # (E(d) for d = 0..S, extra accepted past depth S when drafting it whole)


class _Own:
    """One request's own record: decayed per-depth counts and its retry schedule."""

    __slots__ = ("acc", "off", "tail", "tail_n", "steps", "retry_at", "backoff")

    def __init__(self, depths: int) -> None:
        self.acc = [0.0] * depths
        self.off = [0.0] * depths
        self.tail, self.tail_n = 0.0, 0.0
        self.steps = 0  # decisions it took part in
        self.retry_at: int | None = 0  # step from which it is tried optimistically (0: a new request)
        self.backoff = REQ_BACKOFF

    def due(self) -> bool:
        return self.retry_at is not None and self.steps >= self.retry_at


class Acceptance:
    """The batch-level and per-request acceptance estimates (AdaptivePolicy is one)."""

    def __init__(self, shape: TreeShape, prior: list[float] | None = None) -> None:
        """prior: P(accepted length >= i), i = 1.., as measured for this head (its config's
        augury_acceptance); it can only lower the conservative PRIOR_RATE."""
        self.max_shape = shape
        rates = [PRIOR_RATE] * shape.num_steps
        for i, p in enumerate((prior or [])[: shape.num_steps]):
            prev = prior[i - 1] if i else 1.0
            rates[i] = min(max(p / prev if prev > 0 else 0.0, 0.02), PRIOR_RATE)
        self.acc = [r * PRIOR_WEIGHT for r in rates]
        self.off = [PRIOR_WEIGHT] * shape.num_steps
        self.tail, self.tail_n = 0.0, PRIOR_WEIGHT  # extra accepted past depth S, decayed sum and count
        self.spread = SPREAD_PRIOR  # variance of the first level's rate between requests
        self.own: weakref.WeakKeyDictionary[Request, _Own] = weakref.WeakKeyDictionary()

    def rates(self) -> list[float]:
        """The batch-level conditional acceptance per depth."""
        return [a / o for a, o in zip(self.acc, self.off)]

    def tail_mean(self) -> float:
        return self.tail / self.tail_n

    def expected_accepted(self, depth: int) -> float:
        """E(depth) at the batch-level rates (past the shape's depth not included)."""
        return _expected(self.rates(), 0.0)[0][depth]

    def shrink(self) -> float:
        """The pseudo-count at the batch's rates a request's own counts are shrunk with: p(1-p) / tau^2,
        p the first level's rate and tau^2 the variance of it between requests (measured at the first
        level, where every drafting request is observed; deeper ones see a selection). Requests that
        all accept alike (tau^2 ~ 0) keep the batch's rates, whatever their own few draws say;
        requests that differ (a copy beside free text) soon have their own."""
        p = self.rates()[0]
        return min(max(p * (1 - p) / max(self.spread, 1e-6), SHRINK_MIN), SHRINK_MAX)

    def request_rates(self, req: Request) -> list[float]:
        """req's conditional acceptance per depth: its own counts shrunk towards the batch-level
        rates (exactly those before it has drafted); deeper than its first level, towards the batch's
        rate scaled as its own first level compares with the batch's (a request that rejects its first
        drafts more than the batch likely rejects its later ones more too)."""
        rates = self.rates()
        own = self.own.get(req)
        if own is None:
            return rates
        k, out = self.shrink(), []
        for i, (a, o, g) in enumerate(zip(own.acc, own.off, rates)):
            if i:
                g = min(g * out[0] / max(rates[0], 1e-6), 0.98)
            out.append((a + k * g) / (o + k))
        return out

    def _learn_spread(self, owns: list[_Own | None]) -> None:
        """Method of moments over this batch's requests at the first level: tau^2 ~ mean of
        (r_j - p)^2 - p(1-p)/n_j (the spread of their own rates less what sampling alone spreads them by)."""
        p = self.rates()[0]
        got = [(o.acc[0] / o.off[0], o.off[0]) for o in owns if o is not None and o.off[0] >= SPREAD_MIN_SEEN]
        if len(got) >= 2:
            est = sum((r - p) ** 2 - p * (1 - p) / n for r, n in got) / len(got)
            self.spread = (1 - SPREAD_EMA) * self.spread + SPREAD_EMA * max(est, 0.0)

    def request_expected(self, req: Request) -> list[float]:
        """E_r(d), d = 0..S: req's expected accepted drafts when offered d levels."""
        return _expected(self.request_rates(req), 0.0)[0]

    def _request(self, req: Request) -> Expected:
        """req's expected accepted drafts per depth, and past the shape's depth when drafting it whole."""
        own = self.own.get(req)
        k = self.shrink()
        tail = self.tail_mean() if own is None else (own.tail + k * self.tail_mean()) / (own.tail_n + k)
        return _expected(self.request_rates(req), tail)

    def _optimistic(self, req: Request) -> Expected:
        """The guess a request is tried again with: OPTIMISTIC_RATE per level where the batch's rate is lower."""
        _, tail = self._request(req)
        return _expected([max(r, OPTIMISTIC_RATE) for r in self.rates()], max(tail, self.tail_mean()))

    def _own(self, req: Request) -> _Own:
        own = self.own.get(req)
        if own is None:
            own = self.own[req] = _Own(self.max_shape.num_steps)
        return own

    def _learn(self, shape: TreeShape, accepted: list[int], offered: list[int] | None,
               reqs: Sequence[Request] | None) -> None:
        """Conditional per-depth acceptance: offered at depth i when depth i-1 was accepted (and the
        request's tree reached depth i: its budget may have cut it shorter); past the shape's full
        depth, the extra accepted (a prompt-lookup branch)."""
        s = self.max_shape.num_steps
        off, acc, tail = [0.0] * s, [0.0] * s, []
        for j, a in enumerate(accepted):
            reach = shape.num_steps if offered is None else min(offered[j], shape.num_steps)
            own = self._own(reqs[j]) if reqs is not None else None
            for i in range(min(a + 1, reach)):
                hit = 1.0 if i < a else 0.0
                off[i] += 1.0
                acc[i] += hit
                if own is not None:
                    own.off[i] = OWN_KEEP * own.off[i] + 1.0
                    own.acc[i] = OWN_KEEP * own.acc[i] + hit
            if shape.num_steps == s and reach == s and a >= s:
                tail.append(a - s)
                if own is not None:
                    own.tail = OWN_KEEP * own.tail + (a - s)
                    own.tail_n = OWN_KEEP * own.tail_n + 1.0
        # the batch-level counts forget per step (a depth only where it was offered), so a large batch
        # does not forget within a step what a small one remembers for twenty
        for i in range(s):
            if off[i]:
                self.off[i] = KEEP * self.off[i] + off[i]
                self.acc[i] = KEEP * self.acc[i] + acc[i]
        if tail:
            self.tail = KEEP * self.tail + sum(tail)
            self.tail_n = KEEP * self.tail_n + len(tail)


def _expected(rates: list[float], tail: float) -> Expected:
    """E(d) = sum_{i<=d} prod_{j<=i} rates[j] for d = 0..S, and the extra past S (P(accept S) x tail)."""
    out, e, p = [0.0], 0.0, 1.0
    for r in rates:
        p *= r
        e += p
        out.append(e)
    return out, p * tail
