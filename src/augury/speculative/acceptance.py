"""What the adaptive policy knows of acceptance, by source: the proposer's own drafts per depth (the
batch's and each request's), the lookup branch grafted onto a head's tree, and suffix drafts verified
alone (against the drafter's own score). Forced tokens are none of these: the policy counts them per
option as they come (adaptive.py), since a grammar drafts them whatever it decides.

Proposer drafts: per depth i, the conditional rate P(accept i | accepted i - 1), as decayed counts
(KEEP per step that observes the depth) over a conservative prior (PRIOR_RATE, or lower where the
head's config measured lower, worth PRIOR_WEIGHT observations). Each request keeps its own decayed
counts (KEEP per own observation), shrunk towards the batch's rates by empirical Bayes: the
pseudo-count p(1-p)/tau^2 with tau^2 the variance of the first level's rate between requests,
learned from the requests planned each step, so requests that accept alike keep the batch's rates
whatever their few draws say and a copy beside free text soon has its own; deeper levels a request
has seen little of are shrunk towards the batch's scaled as its own first level compares.

Lookup branch (a hybrid row: the head's tree with a suffix draft grafted on): the lookup drafts it
got accepted, per row that drafted the whole shape, the batch's and each request's own (shrunk
alike). Suffix drafts verified alone: accepted over the drafter's score (its own estimate of the
tokens a draft yields), decayed, from a prior of 1 (the score taken at its word); and each request's
free chains draft by draft, by the draft's reach (the tokens its text matched before it: the drafter's
match and the drafts before it in the same run), which the drafter's own estimate does not weigh.

Records live in a WeakKeyDictionary keyed by the request and go with it.
"""
from __future__ import annotations

import bisect
import weakref
from collections.abc import Sequence

from augury.core.request import Request
from augury.speculative.policy import TreeShape

# a first draft of an unseen head on unseen text is accepted about half the time or less (the demo's head
# on held-out chats: 0.4-0.6); starting no higher keeps a fresh policy from drafting on hope
PRIOR_RATE = 0.5
PRIOR_WEIGHT = 2.0  # the prior is worth two observations: a request's first few drafts outweigh it
KEEP = 0.95  # weight counts keep per observing step: the last ~20 steps (1 / (1 - KEEP)), a request's phase
SPREAD_PRIOR = 0.04  # prior variance of the first level's rate between requests (sd 0.2: chats differ that much)
SPREAD_MIN_SEEN = 3.0  # a request's own rate counts in that variance once it has this many draws (fewer: noise)
# bounds of the pseudo-count a request's own rate is shrunk with: at least a quarter of an observation (its
# own draws decide soon), at most 200 (requests alike: ten of its own steps' draws barely move it)
SHRINK_MIN, SHRINK_MAX = 0.25, 200.0
# a free chain's suffix draft's reach, in classes by their lower bounds (reaches of 24 and more, the
# drafter's longest match, share one). The first draft after a one-token match of an earlier occurrence
# is a guess, after a long one mostly a copy, and the drafter takes a lone occurrence as certain
# whatever its length: the demo's free chains (code edits and agentic loops, warm, 8 prompts twice, 96
# tokens) had their first draft accepted 0.15-0.32 of the time after a one-token match, 0.42-0.91 after
# two, 0.92-1.0 after 16 or more; pooled by place (the rule before), one-draft chains at T=1 were
# verified at ~6 ms a step against a plain step's ~3.8 and accepted 0.03-0.26 on average.
REACH_FROM = (1, 2, 3, 4, 6, 8, 12, 16, 24)

Expected = tuple[list[float], float]  # (E(d) for d = 0..S, the lookup branch's extra when drafting it whole)


class _Own:
    """One request's own record: decayed per-depth counts, its lookup branch's yield, and when it last
    drafted (the exploration rule's age of its record, adaptive.py)."""

    __slots__ = ("acc", "off", "tail", "tail_n", "last")

    def __init__(self, depths: int) -> None:
        self.acc = [0.0] * depths
        self.off = [0.0] * depths
        self.tail, self.tail_n = 0.0, 0.0
        self.last: int | None = None  # policy step of its last drafting step (None: never drafted)


class Acceptance:
    """The batch-level and per-request acceptance estimates (AdaptivePolicy is one)."""

    def __init__(self, shape: TreeShape, prior: list[float] | None = None) -> None:
        """prior: P(accepted length >= i), i = 1.., as measured for this head (its config's
        augury_acceptance); it can only lower the conservative PRIOR_RATE."""
        self.max_shape = shape
        rates = [PRIOR_RATE] * shape.num_steps
        for i, p in enumerate((prior or [])[: shape.num_steps]):
            prev = prior[i - 1] if i else 1.0
            rates[i] = min(p / prev if prev > 0 else 0.0, PRIOR_RATE)
        self.acc = [r * PRIOR_WEIGHT for r in rates]
        self.off = [PRIOR_WEIGHT] * shape.num_steps
        self.tail, self.tail_n = 0.0, PRIOR_WEIGHT  # lookup branch: accepted per whole row, decayed sum and count
        self.suffix_got, self.suffix_score = PRIOR_WEIGHT, PRIOR_WEIGHT  # suffix alone: accepted / score
        # suffix drafts verified alone, at any batch size, by their reach's class (REACH_FROM): accepted where
        # every draft before was (weighted counts, each starting at one PRIOR_WEIGHT draw of rate 1:
        # until measured, the drafter's estimate stands)
        self.chain_acc = [float(PRIOR_WEIGHT)] * len(REACH_FROM)
        self.chain_off = [float(PRIOR_WEIGHT)] * len(REACH_FROM)
        self.spread = SPREAD_PRIOR  # variance of the first level's rate between requests
        self.own: weakref.WeakKeyDictionary[Request, _Own] = weakref.WeakKeyDictionary()

    def rates(self) -> list[float]:
        """The batch-level conditional acceptance per depth."""
        return [a / o for a, o in zip(self.acc, self.off)]

    def tail_mean(self) -> float:
        return self.tail / self.tail_n

    def suffix_yield(self, score: float) -> float:
        """Expected accepted tokens of a suffix draft verified alone, from its score (calibrated)."""
        return score * self.suffix_got / self.suffix_score

    def expected_accepted(self, depth: int) -> float:
        """E(depth) at the batch-level rates (the lookup branch not included)."""
        return _expected(self.rates(), 0.0)[0][depth]

    def shrink(self) -> float:
        """The pseudo-count at the batch's rates a request's own counts are shrunk with: p(1-p) / tau^2,
        p the first level's rate and tau^2 the variance of it between requests (measured at the first
        level, where every drafting request is observed; deeper ones see a selection)."""
        p = self.rates()[0]
        return min(max(p * (1 - p) / max(self.spread, 1e-6), SHRINK_MIN), SHRINK_MAX)

    def request_rates(self, req: Request) -> list[float]:
        """req's conditional acceptance per depth: its own counts shrunk towards the batch-level
        rates (exactly those before it has drafted); deeper than its first level, towards the batch's
        rate scaled as its own first level compares with the batch's (never to certainty)."""
        rates = self.rates()
        own = self.own.get(req)
        if own is None:
            return rates
        k, out = self.shrink(), []
        for i, (a, o, g) in enumerate(zip(own.acc, own.off, rates)):
            if i:
                g = min(g * out[0] / max(rates[0], 1e-6), 1.0)
            out.append((a + k * g) / (o + k))
        return out

    def _learn_spread(self, owns: list[_Own | None]) -> None:
        """Method of moments over this batch's requests at the first level: tau^2 ~ mean of
        (r_j - p)^2 - p(1-p)/n_j (the spread of their own rates less what sampling alone spreads them by),
        averaged over steps with the counts' memory (KEEP)."""
        est = self._spread_estimate(owns)
        if est is not None:
            self.spread = KEEP * self.spread + (1 - KEEP) * est

    def _spread_estimate(self, owns: list[_Own | None]) -> float | None:
        """This batch's estimate of tau^2 (_learn_spread's), None with fewer than two requests to judge."""
        p = self.rates()[0]
        got = [(o.acc[0] / o.off[0], o.off[0]) for o in owns if o is not None and o.off[0] >= SPREAD_MIN_SEEN]
        if len(got) < 2:
            return None
        return max(sum((r - p) ** 2 - p * (1 - p) / n for r, n in got) / len(got), 0.0)

    def request_expected(self, req: Request) -> list[float]:
        """E_r(d), d = 0..S: req's expected accepted drafts when offered d levels."""
        return _expected(self.request_rates(req), 0.0)[0]

    def _request(self, req: Request) -> Expected:
        """req's expected accepted drafts per depth, and its lookup branch's when drafting the shape whole."""
        own = self.own.get(req)
        k = self.shrink()
        tail = self.tail_mean() if own is None else (own.tail + k * self.tail_mean()) / (own.tail_n + k)
        return _expected(self.request_rates(req), tail)

    def _own(self, req: Request) -> _Own:
        own = self.own.get(req)
        if own is None:
            own = self.own[req] = _Own(self.max_shape.num_steps)
        return own

    def _learn(self, shape: TreeShape, accepted: list[int], offered: list[int] | None,
               reqs: Sequence[Request] | None, lookup: list[int] | None) -> None:
        """Conditional per-depth acceptance of the proposer's drafts: offered at depth i when depth i-1
        was accepted (and the request's tree reached depth i: its budget may have cut it shorter); the
        lookup branch's accepted drafts in rows that drafted the whole shape (a budget cuts it first)."""
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
                    own.off[i] = KEEP * own.off[i] + 1.0
                    own.acc[i] = KEEP * own.acc[i] + hit
            if lookup is not None and shape.num_steps == s and reach == s:
                tail.append(lookup[j])
                if own is not None:
                    own.tail = KEEP * own.tail + lookup[j]
                    own.tail_n = KEEP * own.tail_n + 1.0
        # the batch-level counts forget per step (a depth only where it was offered), so a large batch
        # does not forget within a step what a small one remembers for twenty
        for i in range(s):
            if off[i]:
                self.off[i] = KEEP * self.off[i] + off[i]
                self.acc[i] = KEEP * self.acc[i] + acc[i]
        if tail:
            self.tail = KEEP * self.tail + sum(tail)
            self.tail_n = KEEP * self.tail_n + len(tail)

    def chain_chances(self, reaches: Sequence[int]) -> list[float]:
        """The measured chance that a free chain's first 1 .. n suffix drafts are all accepted (reaches:
        theirs, in chain order): the product of each draft's measured rate at its reach."""
        out, p = [], 1.0
        for r in reaches:
            j = reach_class(r)
            p *= self.chain_acc[j] / self.chain_off[j]
            out.append(p)
        return out

    def learn_chain(self, places: Sequence[int], reaches: Sequence[int], accepted: int) -> None:
        """A free chain verified: places, the chain positions of its suffix drafts (a grammar's forced
        tokens between them are not counted), their reaches, and how many of the chain's drafts were
        accepted in a row: each draft reached counts at its reach, accepted or not; those past the
        first rejection were not tried."""
        for at, r in zip(places, reaches):
            if at > accepted:
                break
            j = reach_class(r)
            self.chain_off[j] = KEEP * self.chain_off[j] + 1.0
            self.chain_acc[j] = KEEP * self.chain_acc[j] + (1.0 if at < accepted else 0.0)

    def _learn_suffix(self, score: float, got: int) -> None:
        """A step of suffix drafts verified alone: their scores' sum and the lookup drafts accepted."""
        self.suffix_score = KEEP * self.suffix_score + score
        self.suffix_got = KEEP * self.suffix_got + got


def reach_class(reach: int) -> int:
    """The class (REACH_FROM's index) of a suffix draft's reach (at least 1)."""
    return max(bisect.bisect_right(REACH_FROM, reach) - 1, 0)


def _expected(rates: list[float], tail: float) -> Expected:
    """E(d) = sum_{i<=d} prod_{j<=i} rates[j] for d = 0..S, and the lookup branch's extra (tail)."""
    out, e, p = [0.0], 0.0, 1.0
    for r in rates:
        p *= r
        e += p
        out.append(e)
    return out, tail
