"""Goodput-optimal speculation, by measurement: each step, the option expected to emit the most tokens
per second on the machine it runs on, as its own steps measured it.

The rule. For a batch of B requests in its bucket (arms.py) the options are plain decoding, the
proposer drafting d levels (each request's rows the head's tree, or the head's tree with the suffix
draft grafted on: a hybrid row; or nothing), and a step of the drafts that cost no draft model (a
grammar's forced tokens and suffix drafts, verified alone: `free_first`, `free_allowed`). Each
option's tokens per second is its expected tokens over its measured step time:

    plain:    B / t_0
    draft d:  (B + sum_r E_r(n_r) + F_d) / (t_0 + (t_d - t_0) * share(n))
    free:     (B + sum_r suffix_yield(score_r) + F) / t_free

t_0, t_d, t_free are the trimmed means of that option's recent timed steps in the bucket (arms.py);
E_r(n) the request's expected accepted drafts for n draft nodes, from the acceptance of its own source
(acceptance.py: the proposer's drafts per depth, the grafted lookup branch apart); F the forced tokens
the option's steps accepted on average (free for the policy: a grammar drafts them whatever it does);
share(n) the part of drafting's extra that the drafting rows take (FIXED_ROWS, ROW_SHARE); each request's
n_r (0, a chain's depth, a tree whole, whole with its lookup branch) by Dinkelbach's iteration. The
rule takes the best option.

One guard: where a drafting arm's last WINDOW steps as they ran (tokens emitted over seconds) realized
under GUARD_MARGIN of plain decoding's measured rate, that realized rate stands for the arm, whatever its prediction
(arms.Arm.held): a prediction that does not come true (acceptance counted that was not emitted, a cost
the share model misses) falls back to plain decoding as soon as what it delivers does.

One exploration rule: every option the rule did not take, and every request it left out, is re-measured
once its figures are as many steps old as the observations they rest on (an arm's window of timed
steps, a request's decayed draws at its first level), the oldest per observation first (a request
judged on two draws soon, one judged on twenty after twenty steps), when the bucket's exploration credit covers
its expected loss against the rule's choice (its predicted time less the time the chosen option takes
for its predicted tokens, a step's, and the head's catch-up over what its requests' rows have not
shown it, at the measured price of a row: `_catch_up_cost`): an arm is re-measured for MIN_SEEN steps,
a request tried for one. Every step adds EXPLORE_SHARE of its seconds to the credit, and an exploring
step takes what it actually lost (a new request's first step, which also feeds the head its prompt,
at its price): exploration costs at most that share of the time, whatever the workload. An arm no
bucket has measured has no prediction and is measured as soon as the credit covers its catch-up (at
once before any catch-up was measured); a bucket's arm it has not measured borrows its neighbour's extra, scaled by
batch size, until it does. A re-measurement stops early once its own steps show the arm cannot win even
with every draft accepted.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from augury.core.request import Request
from augury.speculative.acceptance import KEEP, Acceptance, Expected, PRIOR_RATE, _expected  # noqa: F401
from augury.speculative.arms import FREE, GUARD_MARGIN, MIN_SEEN, WINDOW, Bucket, bucket_of
from augury.speculative.policy import StepPlan, TreeShape, Why, user_caps

log = logging.getLogger("augury.speculative")

# exploration's share of the time: "never slower" allows 2% against the better of plain and static
# decoding; exploring takes a quarter of it, the rest is left to the rule's misjudgements of close calls,
# its Python per step and a shared machine's noise (at 1% the simulator re-measured plain decoding every
# ~20 steps where drafting won by 2x, for no better decisions)
EXPLORE_SHARE = 0.005
# drafting's extra over a plain step, in rows: the head's forwards run once for however many rows draft
# (one row's worth that does not shrink with fewer rows), and of a row's own part half is per row (its
# head rows) and half per draft node it verifies (a chain cut to one node still runs the head's levels)
FIXED_ROWS, ROW_SHARE = 1.0, 0.5
# a step that drafted under this share of the whole shape's extra is not timed: scaled up to the whole
# shape by over 4x, a 30% spike of a shared machine would read as 120%
MIN_SHARE = 0.25
# a bucket takes a neighbour's row costs (free_cut) within this factor of its batch size: further off
# a row's cost changes regime (a lone row reads the weights, 16 rows compute: a verified row of the
# demo cost ~0.3 ms at batch 1, ~1 ms at batch 16 over ~1,000-token contexts, Zen 5)
NEAR_ROWS = 2
PROBE_STEPS = 2 * MIN_SEEN  # most steps a re-measurement runs: room for untimed catch-up steps among them


class AdaptivePolicy(Acceptance):
    def __init__(self, shape: TreeShape, disable_batch_threshold: int | None,
                 prior: list[float] | None = None) -> None:
        """prior: P(accepted length >= i), i = 1.., as measured for this head (its config's
        augury_acceptance); it can only lower the conservative PRIOR_RATE (acceptance.py)."""
        super().__init__(shape, prior)
        self.threshold = disable_batch_threshold
        self.buckets: dict[int, Bucket] = {}
        self.steps = 0
        self.choices: dict[int, int] = {}
        self.rows_planned = 0  # rows of speculative steps the rule decided ...
        self.rows_drafted = 0  # ... and those it let draft
        self.why: Why = ("measure-plain", 0, 0.0, 0.0)  # what decided the last plan (policy.reason)
        # the head's catch-up over backlogs (observe_catch_up): decayed seconds and rows, their ratio the
        # price of a row; and the rows the head has not seen of each request of the step being planned
        self.caught = (0.0, 0.0)
        self._backlogs: list[int] = []

    # ------------------------------------------------------------------ shapes
    def shape_for(self, depth: int) -> TreeShape:
        """The configured tree cut to `depth` levels. A chain keeps one node per level; a tree
        keeps its full node budget as far as that depth has candidates (topk + (depth-1) topk^2)."""
        m = self.max_shape
        if depth >= m.num_steps:
            return m
        if m.topk == 1:
            return TreeShape(depth, 1, depth + 1)
        candidates = m.topk + (depth - 1) * m.topk * m.topk
        return TreeShape(depth, m.topk, min(m.num_draft_tokens, 1 + candidates))

    def depths(self) -> list[int]:
        """Drafting arms: a chain every depth; a tree its full depth only (drafting or not is a clear
        call; depths of a tree differ by less than a shared CPU's noise)."""
        s = self.max_shape.num_steps
        return list(range(1, s + 1)) if self.max_shape.topk == 1 else [s]

    # ------------------------------------------------------------------ the rule
    def plan(self, reqs: Sequence[Request]) -> StepPlan:
        """This step's tree and each request's draft budget (0: a root-only row), by the rule."""
        b = len(reqs)
        caps = user_caps(reqs)
        plain = StepPlan(None, (0,) * b)
        if (self.threshold is not None and b > self.threshold) or not any(c != 0 for c in caps):
            self.why = ("none", 0, 0.0, 0.0) if self.threshold is None or b <= self.threshold \
                else ("threshold", self.threshold, 0.0, 0.0)
            return plain
        bk = self._bucket(b)
        if self._quiet(bk, reqs):
            return plain
        owns = [self._own(r) if c != 0 else None for r, c in zip(reqs, caps)]
        self._backlogs = [max(r.num_computed - r.draft_len, 0) for r in reqs]
        self._learn_spread(owns)  # over every request that may draft, those left out included
        depth, pick, kind = self._decide(bk, b, caps, [self._request(r) for r in reqs], owns)
        for row in pick:
            owns[row].last = self.steps
        if not depth or not pick:
            if kind == "rule" and bk.probe is None:
                bk.quiet = (tuple(r.request_id for r in reqs), self._wake(bk), self._spread_estimate(owns))
            return plain
        self.rows_planned += b
        self.rows_drafted += len(pick)
        nodes = self.shape_for(depth).num_drafts
        out = tuple(0 if row not in pick else (cap if pick[row][0] >= nodes else pick[row][0])
                    for row, cap in enumerate(caps))
        return StepPlan(self.shape_for(depth), out)

    def choose(self, batch_size: int) -> TreeShape | None:
        """The rule for a batch whose requests all have the batch-level acceptance and no caps: the
        tree every request drafts, or None."""
        if self.threshold is not None and batch_size > self.threshold:
            return None
        e = _expected(self.rates(), self.tail_mean())
        self._backlogs = []
        depth, pick, _ = self._decide(self._bucket(batch_size), batch_size, (None,) * batch_size,
                                      [e] * batch_size, None)
        return self.shape_for(depth) if depth and pick else None

    def _decide(self, bk: Bucket, b: int, caps: Sequence[int | None], expected: list[Expected],
                owns: list | None) -> tuple[int, dict[int, tuple[int, float]], str]:
        """(depth, {row: (draft nodes, expected accepted)}, kind): kind "rule" (the rule's choice),
        "measure" (plain decoding measured first), "explore" (plain decoding re-measured), "probe" (a
        drafting arm re-measured) or "try" (a request left out, tried)."""
        self.steps += 1
        bk.steps += 1
        bk.exploring = False
        times = self._times(bk, b)
        if bk.probe is not None:
            d = bk.probe
            whole = self._whole(d, caps, expected)
            going = bk.arm(d).fresh is not None and bool(whole)
            lost = going and self._cannot_win(bk, b, d, whole)
            if bk.probe_left > 0 and going and not lost:
                bk.probe_left -= 1
                bk.exploring = True
                return self._count(d, whole, "probe", ("probe", d, 0.0, 0.0))
            bk.arm(d).settle(judged=lost)
            bk.probe = None
            times = self._times(bk, b)
        if times[0] is None:  # plain decoding first: what every option is measured against
            return self._count(0, {}, "measure", ("measure-plain", 0, 0.0, 0.0))
        plain = b / times[0]
        d, g, pick = self._best(bk, b, times, caps, expected)
        guarded = d > 0 and g <= plain < self._rate(bk, b, d, times, pick, held=False)
        considered = d  # (the depth the rule weighed, for its reason)
        if g <= plain:
            d, pick = 0, {}
        bk.best = max(g, plain)
        explored = self._explore(bk, b, times, caps, expected, owns, d, pick)
        if explored is not None:
            return explored
        if d:
            return self._count(d, pick, "rule", ("on", d, g, plain))
        if guarded:
            a = bk.arm(considered)
            due = max(1 + len(a.recent) - (bk.steps - (a.last or 0)), 0)
            return self._count(0, {}, "rule", ("guard", due, g, plain))
        if not considered:  # no allocation pays: the reason names what the whole shape would
            considered = max((x for x in self.depths() if times[x] is not None), default=0)
            whole = self._whole(considered, caps, expected) if considered else {}
            g = self._rate(bk, b, considered, times, whole) if whole else 0.0
        return self._count(0, {}, "rule", ("off", considered if g else 0, g, plain))

    def _best(self, bk: Bucket, b: int, times: list[float | None], caps, expected: list[Expected]
              ) -> tuple[int, float, dict[int, tuple[int, float]]]:
        """The best drafting allocation over the depths with a time estimate, held to what each arm
        realized (the guard): (depth, tokens/s, pick)."""
        best_d, best_g, best = 0, 0.0, {}
        chain = self.max_shape.topk == 1
        for d in self.depths():
            if times[d] is None:
                continue
            for whole in ((True, False) if chain else (True,)):
                pick = self._allocate(b, d, times[0], times[d], self._options(d, caps, expected, whole),
                                      bk.arm(d).forced())
                if not pick:
                    continue
                deff = max(n for n, _ in pick.values()) if chain else d
                g = self._rate(bk, b, deff, times, pick)
                if g > best_g:
                    best_d, best_g, best = deff, g, pick
        return best_d, best_g, best

    def _rate(self, bk: Bucket, b: int, d: int, times: list[float | None], pick: dict, held: bool = True) -> float:
        """The tokens/s the rule expects of a drafting step at depth d with these rows: predicted, and
        held to what the arm realized (the guard) unless held=False."""
        tokens, seconds = self._predict(bk, b, d, times, pick)
        return bk.arm(d).held(tokens / seconds, b / times[0]) if held else tokens / seconds

    def _predict(self, bk: Bucket, b: int, d: int, times: list[float | None], pick: dict) -> tuple[float, float]:
        """(tokens, seconds) the rule expects of a drafting step at depth d with these rows."""
        t0 = times[0]
        share = self.drafting_share(b, d, [n for n, _ in pick.values()])
        seconds = t0 + max(times[d] - t0, 0.0) * share
        return b + sum(e for _, e in pick.values()) + bk.arm(d).forced(), max(seconds, 1e-12)

    # ------------------------------------------------------------------ exploration
    def _explore(self, bk: Bucket, b: int, times: list[float | None], caps, expected: list[Expected],
                 owns: list | None, chosen: int, pick: dict) -> tuple[int, dict, str] | None:
        """The exploration rule (module doc): of the options and left-out requests whose figures are as
        many steps old as the observations they rest on, the oldest per observation, explored if the
        credit covers its expected loss; else None."""
        due = []  # (age per observation, arm or -1 - row, expected loss in seconds)
        best = max(bk.best, 1e-12)
        bk.soon = math.inf
        for key in [0] + self.depths():
            a = bk.arms.get(key)
            age = math.inf if a is None or a.last is None else bk.steps - a.last
            rests = 1 + (len(a.recent) if a is not None else 0)  # the observations its figures rest on, and one
            if key == chosen:
                continue
            if age < rests:
                bk.soon = min(bk.soon, rests - age)
                continue
            if key == 0:
                loss = times[0] - b / best
            else:
                whole = self._whole(key, caps, expected)
                if not whole:
                    continue
                loss = self._catch_up_cost(list(whole), key)
                if times[key] is not None:  # (never measured anywhere: nothing to predict it from)
                    seconds = self._predict(bk, b, key, times, whole)[1]
                    loss += seconds * (1.0 - self._rate(bk, b, key, times, whole) / best)  # its first step
            due.append((age / rests, key, loss))
        deepest = max((d for d in self.depths() if times[d] is not None), default=0)
        if owns is not None and deepest:
            d = chosen or deepest
            for row, own in enumerate(owns):
                if own is None or row in pick:
                    continue
                age = math.inf if own.last is None else self.steps - own.last
                one = self._options(d, [caps[row]], [expected[row]], True)[0]
                if not one:
                    continue
                rests = 1 + own.off[0]
                if age < rests:
                    bk.soon = min(bk.soon, math.ceil(rests - age))
                    continue
                tried = {**pick, row: one[0]}
                seconds = self._predict(bk, b, d, times, tried)[1]
                due.append((age / rests, -1 - row, seconds * (1.0 - self._rate(bk, b, d, times, tried) / best)
                            + self._catch_up_cost([row], d)))
        if not due:
            bk.need = math.inf
            return None
        age, key, loss = max(due, key=lambda x: (x[0], x[1]))
        bk.need = loss
        if loss > bk.credit:
            return None
        if key == 0:
            bk.exploring = True
            return self._count(0, {}, "explore", ("explore", chosen, bk.best, b / times[0]))
        if key > 0:
            bk.probe, bk.probe_left = key, PROBE_STEPS - 1
            bk.arm(key).refresh()
            bk.arm(key).last = bk.steps  # (re-measured now, if its steps all go untimed: not due again at once)
            bk.exploring = True
            log.debug("re-measuring depth %d at batch bucket %d", key, bucket_of(b))
            return self._count(key, self._whole(key, caps, expected), "probe", ("probe", key, 0.0, 0.0))
        row = -1 - key
        d = chosen or deepest
        tried = {**pick, row: self._options(d, [caps[row]], [expected[row]], True)[0][0]}
        bk.exploring = True
        return self._count(d, tried, "try", ("try", d, bk.best, b / times[0]))

    def _catch_up_cost(self, rows: Sequence[int], depth: int) -> float:
        """What drafting now costs `rows` (of the step being planned) beyond its steps' measured time: the
        head's catch-up over the positions it has not seen, past the depth and two a request that a
        drafting step catches up anyway (the worker also counts the proposer's extra nodes there), at
        the price of a row its catch-ups have measured (0 before any). The worker takes it out of a
        drafting step's timed seconds (the arm's cost is its steady state), but a re-measurement pays
        all of it, and the credit should cover it before, not after: JSON answers at batch 48 (demo,
        AVX2 EPYC, 2 threads, in one process), a probe's first step caught the head up over the 48
        prompts in 0.16 s of its 1.26 s; before this charge a bucket's probe was due as soon as the
        credit covered the predicted loss of its steps alone."""
        seconds, caught = self.caught
        if not caught or not self._backlogs:
            return 0.0
        rows_behind = sum(max(self._backlogs[r] - depth - 2, 0) for r in rows)
        return rows_behind * seconds / caught

    def observe_catch_up(self, rows: int, seconds: float) -> None:
        """The head caught up `rows` positions it had not seen in `seconds` (the worker's, after a drafting
        step whose backlog was more than such a step's usual rows: all of it, and its whole time): the
        price of a row in `_catch_up_cost`, their decayed sums' ratio over the last ~20 (KEEP)."""
        s, n = self.caught
        self.caught = (KEEP * s + seconds, KEEP * n + rows)

    def _cannot_win(self, bk: Bucket, b: int, d: int, whole: dict) -> bool:
        """A re-measurement whose fastest timed step so far, every draft accepted, loses to the rule's
        choice: the arm cannot win here now (a dear arm costs little to learn)."""
        fresh = bk.arm(d).fresh
        if not fresh:
            return False
        most = b + sum(n if self.max_shape.topk == 1 else d for n, _ in whole.values()) + bk.arm(d).forced()
        return most / min(s for s, _ in fresh) < bk.best

    def _wake(self, bk: Bucket) -> int:
        """The policy step from which a batch the rule just sent to plain decoding must be decided again
        (`_quiet`): when the credit may cover the exploration due (at the plain steps' slowest recent
        rate of accrual: never later), or WINDOW steps on (an option or request coming due)."""
        steps = min(WINDOW, bk.soon)
        plain = bk.arm(0)
        if math.isinf(bk.need):
            pass
        elif bk.need > bk.credit and plain.recent:
            rate = EXPLORE_SHARE * min(s for s, _ in plain.recent)
            steps = min(steps, int((bk.need - bk.credit) / max(rate, 1e-12)))
        elif bk.need <= bk.credit:
            steps = 0
        return self.steps + max(int(steps) - 1, 0)  # (_quiet checks before counting the step)

    def _quiet(self, bk: Bucket, reqs: Sequence[Request]) -> bool:
        """A step the rule need not run for: the rule sent this very batch to plain decoding by itself
        and nothing it decided from can have changed (no drafting since, so no acceptance learned; no
        exploration due: `_wake`). Running the rule costs ~0.2 ms in Python (2% of a plain step of the
        demo at batch 1 on an AVX2 EPYC); this check a few microseconds."""
        if bk.quiet is None:
            return False
        ids, until, est = bk.quiet
        if self.steps >= until or bk.probe is not None or ids != tuple(r.request_id for r in reqs):
            bk.quiet = None
            return False
        if est is not None:  # _learn_spread's step, its estimate as the rule left it (no request here drafted since)
            self.spread = KEEP * self.spread + (1 - KEEP) * est
        self.steps += 1
        bk.steps += 1
        bk.exploring = False
        self._count(0, {}, "rule", self.why)
        return True

    # ------------------------------------------------------------------ estimates
    def _bucket(self, batch: int) -> Bucket:
        key = bucket_of(batch)
        bk = self.buckets.get(key)
        if bk is None:
            bk = self.buckets[key] = Bucket()
        return bk

    def _times(self, bk: Bucket, b: int) -> list[float | None]:
        """Seconds per step by depth in this bucket (Bucket.times); a depth it has not measured takes the
        nearest bucket's measured extra over its plain step, scaled by batch size (drafting's extra
        grows with the rows that draft), until it measures its own."""
        s = self.max_shape.num_steps
        depths = self.depths()
        times = bk.times(depths, s)
        if times[0] is None or all(times[d] is not None for d in depths):
            return times
        key = bucket_of(b)
        for k in sorted(self.buckets, key=lambda k: abs(math.log(k / key))):
            other = self.buckets[k]
            if other is bk:
                continue
            there = other.times(depths, s)
            if there[0] is None:
                continue
            for d in depths:
                if times[d] is None and there[d] is not None:
                    times[d] = times[0] + max(there[d] - there[0], 0.0) * key / k
        for d in range(1, s + 1):  # more drafting is never cheaper
            if times[d] is not None and times[d - 1] is not None:
                times[d] = max(times[d], times[d - 1])
        return times

    def _count(self, depth: int, pick: dict, kind: str, why: Why) -> tuple[int, dict, str]:
        """The decision (depth, pick, kind), counted, and why it was taken (self.why)."""
        self.why = why
        depth = depth if pick else 0
        self.choices[depth] = self.choices.get(depth, 0) + 1
        return depth, pick, kind

    def _whole(self, depth: int, caps, expected: list[Expected]) -> dict[int, tuple[int, float]]:
        opts = self._options(depth, caps, expected, whole=True)
        return {row: o[0] for row, o in enumerate(opts) if o}

    def _row_cost(self, depth: int, n: int) -> float:
        """A row drafting n nodes at `depth`, in whole rows of drafting's extra cost."""
        return ROW_SHARE + (1.0 - ROW_SHARE) * min(n / max(self.shape_for(depth).num_drafts, 1), 1.0)

    def drafting_share(self, batch: int, depth: int, nodes: Sequence[int]) -> float:
        """The share of drafting's whole extra (all `batch` rows drafting the whole shape) that rows
        drafting `nodes` nodes each (0: not drafting) take."""
        drafting = [n for n in nodes if n > 0]
        if not drafting:
            return 0.0
        return (FIXED_ROWS + sum(self._row_cost(depth, n) for n in drafting)) / (FIXED_ROWS + batch)

    def _allocate(self, batch: int, depth: int, t0: float, td: float, options: list[list[tuple[int, float]]],
                  forced: float = 0.0) -> dict[int, tuple[int, float]]:
        """Dinkelbach's iteration on G = (B + F + sum E) / (t_0 + s (F_rows + sum c)), s the measured
        seconds per row of drafting's extra: for the current goodput L each row takes the option with
        the largest E - L s c (if positive), the drafting rows together paying FIXED_ROWS; that
        allocation's goodput exceeds L unless L is the best. Starts from plain's goodput; each round
        strictly raises it over finitely many allocations, so it ends."""
        s = max(td - t0, 0.0) / (FIXED_ROWS + batch)
        best_g, best = batch / max(t0, 1e-12), {}
        while True:
            mu = best_g * s
            pick, value = {}, 0.0
            for row, opts in enumerate(options):
                top, choice = 0.0, None
                for n, e in opts:
                    v = e - mu * self._row_cost(depth, n)
                    if v > top:
                        top, choice = v, (n, e)
                if choice is not None:
                    pick[row] = choice
                    value += top
            if not pick or value + forced <= mu * FIXED_ROWS:
                return best
            cost = FIXED_ROWS + sum(self._row_cost(depth, n) for n, _ in pick.values())
            g = (batch + forced + sum(e for _, e in pick.values())) / max(t0 + s * cost, 1e-12)
            if g <= best_g * (1 + 1e-12):
                return best
            best_g, best = g, pick

    def _options(self, depth: int, caps: Sequence[int | None], expected: list[Expected],
                 whole: bool) -> list[list[tuple[int, float]]]:
        """Per row, what it may draft at `depth`, as (draft nodes, expected accepted): a chain any
        length up to the shape's, a tree all of it (its acceptance taken at the depth its node count
        reaches); uncapped at full depth, the whole shape with its lookup branch (a hybrid row); never
        more nodes than the row's own cap. whole: the longest only."""
        nodes = self.shape_for(depth).num_drafts
        full = depth == self.max_shape.num_steps
        chain = self.max_shape.topk == 1
        out = []
        for cap, (e, branch) in zip(caps, expected):
            most = nodes if cap is None else min(cap, nodes)
            bonus = branch if (full and cap is None) else 0.0
            if most <= 0:
                out.append([])
            elif chain and not whole:
                out.append([(n, e[min(n, depth)] + (bonus if n == nodes else 0.0)) for n in range(1, most + 1)])
            else:
                out.append([(most, e[min(most, depth)] + (bonus if most == nodes else 0.0))])
        return out

    # ------------------------------------------------------------------ feedback
    def observe(self, batch_size: int, shape: TreeShape | None, seconds: float, accepted: list[int],
                timed: bool = True, offered: list[int] | None = None, reqs: Sequence[Request] | None = None,
                sizes: list[int] | None = None, forced: int = 0, lookup: list[int] | None = None,
                wall: float | None = None) -> None:
        """After a step: acceptance by source (accepted: the proposer's own drafts per row that drafted;
        lookup: the lookup branch's grafted onto them; forced: a grammar's, in no row's acceptance),
        then its time for its (bucket, depth) arm and what it emitted, against what the rule predicted.
        wall: the step's whole time where `seconds` leaves out the head's catch-up over a backlog (the
        worker's): what an exploring step is charged, all of it."""
        depth = shape.num_steps if shape else 0
        if shape is not None:
            self._learn(shape, accepted, offered, reqs, lookup)
        bk = self._bucket(batch_size)
        self._ran(bk, depth, batch_size + sum(accepted) + sum(lookup or ()) + forced, seconds, wall)
        if not timed:
            return
        if shape is None:
            bk.arm(0).add(seconds, 0.0, bk.steps)
            return
        share = 1.0 if sizes is None else self.drafting_share(batch_size, depth, [n - 1 for n in sizes])
        if share < 1.0:
            # rows cut short or left out: scale the drafting part up to the whole shape's
            t0 = bk.arm(0).seconds()
            if share < MIN_SHARE or t0 is None:
                return
            seconds = max(seconds, t0 + (seconds - t0) / share)
        bk.arm(depth).add(seconds, forced, bk.steps)

    def _ran(self, bk: Bucket, key: int, tokens: float, seconds: float, wall: float | None = None,
             trimmed: bool = True) -> None:
        """A step as it ran: the credit grows by EXPLORE_SHARE of it, and an exploring step pays what it
        lost against the rule's choice (the time that choice needs for the same tokens), its whole wall
        time counted (a head's catch-up over the prompts of a batch of new requests is most of a probe's
        first step: 6-9 ms of 20 at batch 4 on the demo's chats, Zen 5)."""
        spent = seconds if wall is None else max(wall, seconds)
        bk.credit += EXPLORE_SHARE * spent
        if bk.exploring:
            bk.credit -= spent - tokens / max(bk.best, 1e-12)
        bk.arm(key).ran(tokens, seconds, trimmed)
        bk.exploring = False

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        self.observe(batch_size, None, seconds, [])

    def costs_changed(self) -> None:
        """The kernels' thread count changed: every bucket measures its step times afresh
        (arms.Bucket.remeasure); acceptance stands."""
        for bk in self.buckets.values():
            bk.remeasure()

    # ------------------------------------------------------------------ drafts that cost no draft model
    def free_first(self, reqs: Sequence[Request], scores: Sequence[float]) -> bool:
        """Verify the requests' suffix drafts alone (scores: the drafter's, per request) this step,
        instead of asking the rule: their expected tokens per second (calibrated yield over the free
        arm's step time; a plain step's until it has one) beat the rule's last choice here."""
        b = len(reqs)
        if self.threshold is not None and b > self.threshold:
            return False
        bk = self._bucket(b)
        t0 = bk.arm(0).seconds()
        if t0 is None:
            return False
        free = bk.arm(FREE)
        tokens = b + sum(self.suffix_yield(s) for s in scores) + free.forced()
        return tokens / (free.seconds() or t0) > max(bk.best, b / t0)

    def free_allowed(self, batch_size: int) -> bool:
        """The rule chose plain decoding: verify the drafts that cost no draft model instead (a
        grammar's forced tokens, suffix drafts)? Where plain decoding has been measured, while their
        steps' realized tokens per second holds up to plain decoding's, or falls short of it by less
        than a short window's noise (GUARD_MARGIN) until they fill a window (a verdict on MIN_SEEN
        steps moves by 10-20% from one window to the next: JSON answers at batch 16, AVX2, 0.86-0.89 of
        plain decoding's rate on 5 steps, 0.67-0.87 on later windows, in one process);
        where it did not, when the exploration rule re-measures them. After a thread-count change
        (Bucket.remeasure) their last verdict stands where it was a clear loss (under GUARD_MARGIN)
        until they are re-measured; otherwise they run until MIN_SEEN of them are measured. Without
        that each change gave every bucket MIN_SEEN free steps unmeasured (JSON answers at batch 48,
        AVX2: free steps of batches 33-48 lost 15-45% a token against plain steps there, were refused
        once measured, and ran again after each change). A neighbouring bucket's verdict is not
        taken: at batch 16 the free steps of batches 13-16 realized 0.67-0.89 of plain decoding's rate
        where those of batches 9-12 realized 1.1-1.4x, and one bucket's verdict refused the other's."""
        bk = self._bucket(batch_size)
        t0 = bk.arm(0).seconds()
        if t0 is None:
            return False
        free = bk.arm(FREE)
        got = free.realized()
        if got is not None:
            gain = bk.free_gain = got * t0 / batch_size
            if GUARD_MARGIN <= gain < 1.0 and len(free.real) < WINDOW:
                return True  # within a short window's noise: measured on to a whole window first
        elif free.fresh is not None and free.last is not None:
            return True  # a re-measurement the exploration rule granted, under way
        elif bk.free_gain is not None and bk.free_gain < GUARD_MARGIN:
            gain = bk.free_gain  # a clear loss before a re-measurement stands
        else:
            return True
        if gain >= 1.0:
            return True
        if free.last is not None and bk.steps - free.last < WINDOW:
            return False
        loss = MIN_SEEN * (free.seconds() or t0) * (1.0 - gain)
        if loss > bk.credit:
            return False
        bk.credit -= loss  # charged at once, as expected: its steps follow the rule's plain decisions
        free.refresh()
        free.last = bk.steps
        return True

    def free_cut(self, batch_size: int, probs: Sequence[float], reaches: Sequence[int] | None = None) -> int:
        """How many of a lone request's drafts that cost no draft model to verify (probs: per draft, the
        chance that it and every draft before it are accepted, as the drafter estimates it; reaches: per
        draft, a suffix draft's reach (acceptance.py), 0 for a grammar's forced token): the prefix with
        the most expected tokens per second, (B + its chances' sum) / (t_0 + f + c k) for k drafts
        against plain decoding's B / t_0 (k = 0: decode plainly), at this bucket's measured step costs
        (Bucket.row_cost). A draft's chance is the lower of the drafter's and the measured one
        (chain_chances at the suffix drafts' reaches): the drafter counts one earlier occurrence of any
        match as certain, and at T=1 a code edit's answer leaves the file it copies early (the
        default's free steps there cost it 8.7% of the time, in one process against no speculation).
        Until the step costs are measured (here or in a neighbouring bucket): every draft at batch 1,
        one above it (a request's whole copy costs what its rows cost: 16 requests of agentic loops
        with ~1,000 tokens of context each verified 180-224 rows in 145-230 ms against a 17 ms plain
        step, for 28-96 drafts accepted, Zen 5; one draft each costs at most a batch's worth of rows,
        about a plain step, and measures the line)."""
        if reaches is not None:
            measured = self.chain_chances([r for r in reaches if r])
            have, place, out = 1.0, 0, []
            for p, reach in zip(probs, reaches):
                if reach:
                    have = measured[place]
                    place += 1
                out.append(min(p, have))
            probs = out
        bk = self._bucket(batch_size)
        t0 = bk.arm(0).seconds()
        fit = (bk.row_cost(t0) or self._near_row_cost(batch_size)) if t0 is not None else None
        if fit is None:
            return len(probs) if batch_size == 1 else min(len(probs), 1)
        f, c = fit
        best_k, best, e = 0, batch_size / t0, 0.0
        for k, p in enumerate(probs, 1):
            e += p
            rate = (batch_size + e) / (t0 + f + c * k)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def _near_row_cost(self, batch_size: int) -> tuple[float, float] | None:
        """The nearest bucket's measured row costs (Bucket.row_cost), within a factor of NEAR_ROWS of this
        batch size, for a bucket that has too few steps of drafts that cost no draft model to fit its
        own: a verified row's compute differs little between neighbouring batch sizes (a 16-draft
        copy from an earlier chat's answer, rejected at its first token, cost a batch of 4 a 10 ms
        step against 3.3 ms plain, Zen 5). None where no such bucket has them."""
        key = bucket_of(batch_size)
        for k in sorted(self.buckets, key=lambda k: abs(math.log(k / key))):
            if max(k, key) > NEAR_ROWS * min(k, key):
                break
            other = self.buckets[k]
            t0 = other.arm(0).seconds()
            fit = other.row_cost(t0) if k != key and t0 is not None else None
            if fit is not None:
                return fit
        return None

    def observe_free(self, batch_size: int, tokens: int, seconds: float, timed: bool = True, lookup: int = 0,
                     scores: Sequence[float] | None = None, rows: int | None = None,
                     chains: Sequence[tuple[Sequence[int], Sequence[int], int]] = ()) -> None:
        """A step of drafts that cost no draft model: tokens emitted (the batch's, the forced and lookup
        drafts accepted); lookup: those that were suffix drafts, scores: their drafts' scores (a step
        `free_first` chose); rows: the drafts it verified (for free_cut's step costs); chains: per
        request with suffix drafts (places of its suffix drafts in its chain, their reaches, its drafts
        accepted in a row), learn_chain's."""
        if scores is not None:
            self._learn_suffix(sum(scores), lookup)
        for chain in chains:
            self.learn_chain(*chain)
        bk = self._bucket(batch_size)
        bk.exploring = False  # (charged when decided)
        # an untimed free step tried another thread count (cpu/threads.py) for its row count, which only
        # such steps call: its whole time counts in what they realize, never trimmed as noise (agentic
        # loops at batch 4, AVX2: a third of the free steps were such tries, at 131 tok/s against the
        # timed ones' 281 and plain decoding's 230-280; trimmed, the arm read 259-290 and kept verifying)
        self._ran(bk, FREE, tokens, seconds, trimmed=timed)
        if timed:
            bk.arm(FREE).add(seconds, tokens - batch_size - lookup, bk.steps)
            if rows is not None:
                bk.free_rows.append((rows, seconds))
