"""Goodput-optimal speculation, by measurement: per step, draft what maximises tokens per second
on the machine it runs on, as its own steps measured it, down to nothing.

One decision rule (`_decide`; `plan` feeds it each request's own acceptance, `choose` the batch's).
For a batch of B requests in its bucket (arms.py), with t_0 and t_D the measured step times of plain
decoding and of drafting depth D there (arms.py: trimmed means of recent timed steps per bucket and
depth; nothing shared across depths or derived from a model), and each request r with its own
expected accepted drafts E_r(n) for n draft nodes, the step's goodput when rows drafting n_r nodes
draft is

    G(D, n) = (B + sum_r E_r(n_r)) / (t_0 + (t_D - t_0) * (F + sum_{r: n_r > 0} c(n_r)) / (F + B))

(the measured extra of drafting the whole shape, at least LEAST_DRAFT_COST - 1 plain steps, in the
share the drafting rows take of it: F = FIXED_ROWS rows' worth for the draft forwards, a row
c(n) = ROW_SHARE + (1 - ROW_SHARE) n / N_D of a whole row; all rows whole gives t_D, none t_0),
maximised over each request's n_r (0; a chain any depth up to D, a tree all of it; never above its
max_draft_tokens) by Dinkelbach's iteration: for the current goodput L each request takes the n_r
maximising E_r(n_r) - L dT/dn_r on its own, which raises G until nothing changes; a request whose
acceptance cannot pay for its nodes gets 0 (a root-only row) while others draft. The best G over
the measured depths is compared with plain decoding's B / t_0, with hysteresis: speculation goes
on above ON_MARGIN x, stays on above STAY_MARGIN x.

Both arms are measured while either runs: while speculating, every EXPLORE_EVERY-th step of a bucket
decodes plainly (timed by the engine), and a chain re-measures its stalest depth every
DEPTH_EXPLORE_EVERY steps; while not, drafting is probed (arms.Bucket: MIN_SEEN fresh timed steps
replace its window; only rows that could pay draft; the probe stops once it clearly loses) after a
back-off that doubles each time it loses and is stretched by what the last probe cost. A bucket
starts plain (nothing is assumed about this machine), measures that, then probes drafting (at once,
or, above a bucket where drafting lost, after that bucket's back-off: `_bucket`). The
guard (arms.Bucket.guard) compares realized goodput, speculative steps as they ran against plain
steps, and turns a losing bucket off until its next probe whatever the prediction says.

Acceptance (acceptance.py, which this policy extends): the batch's per-depth rates and each
request's own, shrunk towards the batch's by empirical Bayes. A request left out is tried again
with an optimistic guess (OPTIMISTIC_RATE per level) after its own back-off (REQ_BACKOFF, doubling
while it keeps failing, reset once it drafts on its own merit); a new request starts with such a
try, so a request that copies its prompt drafts even after others taught the batch's rates that
drafting fails. While its bucket decodes plainly such tries spend the bucket's credit for them
(arms.py: TRY_BUDGET of the time), so a stream of new requests where drafting loses costs a bounded
share; without credit no guess counts and the requests stay due.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from augury.core.request import Request
from augury.speculative.acceptance import (  # noqa: F401  (constants re-exported for tests and tuning)
    OPTIMISTIC_RATE, PRIOR_RATE, REQ_BACKOFF, REQ_MAX_BACKOFF, Acceptance, Expected, _expected)
from augury.speculative.arms import TRY_BUDGET, Bucket, bucket_of
from augury.speculative.policy import StepPlan, TreeShape, Why, user_caps

log = logging.getLogger("augury.speculative")

ON_MARGIN, STAY_MARGIN = 1.05, 1.0  # predicted goodput over plain's to turn speculation on / keep it on
EXPLORE_EVERY = 40  # while speculating: every so many bucket steps one plain step
DEPTH_EXPLORE_EVERY = 128  # ... and a chain's stalest depth, re-measured afresh (a probe)
FIXED_ROWS, ROW_SHARE = 1.0, 0.5  # drafting's extra: a fixed part worth this many rows; a row's part not per node
LEAST_DRAFT_COST = 1.1  # a drafting step costs at least this many plain steps (the draft forwards)
PROBE_CLEAR = 1.25  # a probe stops once drafting, as predicted from its own steps, loses by this factor
HOPELESS = 0.5  # ... and after one timed step where even full acceptance would pay under this share of plain's
MIN_SHARE = 0.25  # a step that drafted under this share of the whole shape's extra is not timed
QUIET_STEPS = 8  # steps of one batch that may skip the rule after it chose plain decoding by itself (_quiet)
DINKELBACH_ROUNDS = 20  # the iteration converges in a handful; a bound all the same


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
        """This step's tree and each request's draft budget (0: a root-only row), by the one rule."""
        b = len(reqs)
        bk = self.buckets.get(bucket_of(b))
        if bk is not None and bk.quiet is not None and self._quiet(bk, reqs):
            return bk.quiet[3]
        caps = user_caps(reqs)
        if (self.threshold is not None and b > self.threshold) or not any(c != 0 for c in caps):
            self.why = ("none", 0, 0.0, 0.0) if self.threshold is None or b <= self.threshold \
                else ("threshold", self.threshold, 0.0, 0.0)
            return StepPlan(None, tuple(0 for _ in reqs))
        owns = [self._own(r) if c != 0 else None for r, c in zip(reqs, caps)]
        bk = self._bucket(bucket_of(b))
        bk.quiet = None
        self._learn_spread(owns)  # over every request that may draft, those left out included
        due = [o is not None and o.due() for o in owns]
        was_due, credit = due, bk.credit > 0.0  # what a quiet stretch after this step holds to
        if not bk.on and bk.credit <= 0.0 and any(due):
            # a plain bucket's tries wait for credit (arms.py): no optimistic guess counts meanwhile (it
            # would make the rule draft the others), and the requests stay due
            due = [False] * b
        regular = [self._request(r) for r in reqs]
        expected = [self._optimistic(r) if d else e for r, d, e in zip(reqs, due, regular)]
        depth, pick, kind = self._decide(b, caps, expected, due, regular)
        for row, own in enumerate(owns):
            if own is None:
                continue
            own.steps += 1
            if kind != "rule":  # probes and exploration say nothing about a request's worth
                continue
            if row in pick:
                if not due[row]:
                    own.backoff = REQ_BACKOFF  # drafts on its own merit
                own.retry_at = None
            elif own.retry_at is None:  # left out: tried again after its back-off
                own.retry_at = own.steps + own.backoff
                own.backoff = min(2 * own.backoff, REQ_MAX_BACKOFF)
        if not depth or not pick:
            plain = StepPlan(None, tuple(0 for _ in reqs))
            if kind == "rule" and not bk.on and bk.probe is None:
                # plain by the rule itself with the bucket off: the next steps of this same batch may skip
                # the rule (see _quiet)
                bk.quiet = (tuple(r.request_id for r in reqs), self._quiet_until(bk, owns, was_due, credit), owns, plain)
            return plain
        self.rows_planned += b
        self.rows_drafted += len(pick)
        nodes = self.shape_for(depth).num_drafts
        out = tuple(0 if row not in pick else (cap if pick[row][0] >= nodes else pick[row][0])
                    for row, cap in enumerate(caps))
        return StepPlan(self.shape_for(depth), out)

    def _quiet(self, bk: Bucket, reqs: Sequence[Request]) -> bool:
        """A step the rule need not be run for: under QUIET_STEPS steps ago the rule decided plain
        decoding by itself, with the bucket off, for this very batch (the same requests, so the same
        caps), and none of what it decided from has changed since (`_quiet_until`: no request come due
        for a try, the tries' credit not turned positive, no probe come due). The rule's inputs then
        barely move (acceptance is learned from drafting steps only, drafting's time from probes; plain
        decoding's time drifts) and running it costs ~0.2 ms a step in Python (2% of a plain step of the
        demo at batch 1 on an AVX2 EPYC); this check, with its bookkeeping (steps counted, tries' credit
        accrued, the spread learned), a few microseconds."""
        ids, until, owns, _ = bk.quiet
        if self.steps >= until or bk.on or bk.probe is not None or ids != tuple(r.request_id for r in reqs):
            return False
        self._tick(bk)
        self._count(0, {}, "rule", self.why)  # (the plain decision it repeats is still the last why)
        self._learn_spread(owns)
        for own in owns:
            if own is not None:
                own.steps += 1
        return True

    def _quiet_until(self, bk: Bucket, owns: list, due: list[bool], credit: bool) -> int:
        """The policy step from which a batch the rule just sent to plain decoding (at policy step
        self.steps; due and credit: which requests were due for a try, and whether the tries' credit
        was positive, as the rule found them) must be decided again: after QUIET_STEPS steps, or once a
        probe comes due, a request not due then comes due, or the credit turns positive (one step early
        at worst), whichever is first. Every one of them moves by one a step meanwhile."""
        until = self.steps + min(QUIET_STEPS, bk.probe_at - bk.steps - 1)
        for own, d in zip(owns, due):
            if own is not None and not d and own.retry_at is not None:
                until = min(until, self.steps + own.retry_at - own.steps)
        if not credit:
            until = min(until, self.steps + max(int(-bk.credit / TRY_BUDGET), 0))
        return until

    def _tick(self, bk: Bucket) -> None:
        """A decision taken for bucket bk: the policy's and the bucket's steps, the tries' credit."""
        self.steps += 1
        bk.steps += 1
        bk.accrue()

    def choose(self, batch_size: int) -> TreeShape | None:
        """The rule for a batch whose requests all have the batch-level acceptance and no caps: the
        tree every request drafts, or None."""
        if self.threshold is not None and batch_size > self.threshold:
            return None
        e = _expected(self.rates(), self.tail_mean())
        depth, pick, _ = self._decide(batch_size, (None,) * batch_size, [e] * batch_size, [False] * batch_size,
                                      [e] * batch_size)
        return self.shape_for(depth) if depth and pick else None

    def _decide(self, b: int, caps: Sequence[int | None], expected: list[Expected], due: list[bool],
                regular: list[Expected]) -> tuple[int, dict[int, tuple[int, float]], str]:
        """(depth, {row: (draft nodes, expected accepted)}, kind): the one decision rule. expected: each
        row's expected acceptance, an optimistic guess where due; regular: without the guess. kind is
        "probe" or "explore" (a step run to measure an arm) or "rule" (the rule's own choice)."""
        key = bucket_of(b)
        bk = self._bucket(key)
        self._tick(bk)
        probed = False
        depths = self.depths()
        times = bk.times(depths, self.max_shape.num_steps)
        if bk.probe is not None:
            if not bk.probe_done() and not self._hopeless(bk, b, times, caps, expected):
                bk.probe_left -= 1
                pick = self._whole(bk.probe, caps, expected)
                rows = self._best(b, times, caps, expected)[2] if bk.on else self._probe_rows(caps, regular)
                pick = {row: pick[row] for row in rows if row in pick}  # (a chain's depth re-measured
                #                                                         while speculating: the rule's rows)
                if pick:
                    return self._count(bk.probe, pick, "probe", ("probe", bk.probe, 0.0, 0.0))
            bk.end_probe()
            probed = True
            times = bk.times(depths, self.max_shape.num_steps)
        if times[0] is None:  # plain decoding first: what speculation must beat
            return self._count(0, {}, "explore", ("measure-plain", 0, 0.0, 0.0))
        probe_rows = self._probe_rows(caps, regular)
        if bk.blocked:
            if bk.steps >= bk.probe_at and probe_rows:
                return self._probe(bk, caps, expected, probe_rows)
            return self._count(0, {}, "rule", ("guard", max(bk.probe_at - bk.steps, 0), 0.0, 0.0))
        d, g, pick = self._best(b, times, caps, expected)
        plain = b / max(times[0], 1e-12)
        on = d > 0 and g > plain * (STAY_MARGIN if bk.on else ON_MARGIN)
        if on and not bk.on and all(due[row] for row in pick):
            # only requests tried again on an optimistic guess draft: this step, not a change of mode;
            # it spends the bucket's credit for tries (arms.py; plan offers no guess while there is none)
            # (predicted here; observe charges what the step took)
            share = self.drafting_share(b, d, [n for n, _ in pick.values()])
            bk.trying = (max(times[d] / max(times[0], 1e-12), LEAST_DRAFT_COST) - 1.0) * share
            bk.credit -= bk.trying
            return self._count(d, pick, "rule", ("try", d, g, plain))
        if not on and bk.on:
            bk.switch(False)
            self._log(bk, key, on, d, g, plain, times)
        elif not on and (probed or (not bk.decided and any(times[x] for x in depths))):
            bk.lost()  # drafting, measured, loses here: measured again after the back-off
        if not on and bk.steps >= bk.probe_at and probe_rows:
            return self._probe(bk, caps, expected, probe_rows)
        if on != bk.on or not bk.decided:
            self._log(bk, key, on, d, g, plain, times)
        bk.switch(on)
        if not on:
            return self._count(0, {}, "rule", ("off", d, g, plain))
        if bk.steps % EXPLORE_EVERY == 0:  # plain decoding, measured while speculating
            return self._count(0, {}, "explore", ("explore", d, g, plain))
        if len(depths) > 1 and bk.steps % DEPTH_EXPLORE_EVERY == EXPLORE_EVERY // 2:
            # a chain: the depth measured longest ago, re-measured afresh
            stale = min((x for x in depths if x != d), key=lambda x: bk.arm(x).last)
            bk.start_probe(stale)
            bk.probe_left -= 1
            whole = self._whole(stale, caps, expected)
            return self._count(stale, {row: whole[row] for row in pick if row in whole}, "probe",
                               ("probe", stale, 0.0, 0.0))
        return self._count(d, pick, "rule", ("on", d, g, plain))

    def _bucket(self, key: int) -> Bucket:
        """The bucket for batch bucket `key`, made on first use. A new bucket next to one where drafting
        was measured and lost starts as that one stands: plain, its first probe after that bucket's
        back-off, not at once (a batch draining through bucket after bucket would otherwise probe in
        each of them). Above it always (drafting's extra grows with the batch faster than plain
        decoding's); below it only where drafting could not pay even so: its extra there scaled down
        to this batch (at least in proportion: a fixed part and a part per row), against what every
        row could gain at the optimistic guess requests are tried with, over plain decoding's time
        there (no more than this bucket's). On an AVX2 EPYC a tree at batch 4 costs ~12 plain steps:
        batch 3 cannot gain. (With every draft accepted as the gain, a batch of 16 draining on an AMX
        Xeon, a drafting step ~13 plain steps at 16, probed afresh at 12, 8, 6 and 4: augury-default
        at 0.87x of plain decoding in `augury bench` b16, 7% of its steps drafting.)"""
        bk = self.buckets.get(key)
        if bk is None:
            bk = self.buckets[key] = Bucket()
            lost = [k for k, b in self.buckets.items() if k != key and b.decided and not b.on and b.probes]
            below = [k for k in lost if k < key]
            above = [k for k in lost if k > key and self._cannot_pay(key, k)]
            if below or above:
                near = self.buckets[max(below) if below else min(above)]
                bk.backoff = near.backoff
                bk.probe_at = max(near.probe_at - near.steps, near.backoff)
        return bk

    def _cannot_pay(self, key: int, above: int) -> bool:
        """Drafting measured at bucket `above` could not pay at bucket `key` < above even at the
        optimistic guess a request is tried again with (OPTIMISTIC_RATE per level, or the batch's rates
        where higher; see _bucket)."""
        ratio = self.buckets[above].cost_ratio()  # the cheapest drafting step over a plain step there
        e, extra = _expected([max(r, OPTIMISTIC_RATE) for r in self.rates()], self.tail_mean())
        return (ratio - 1.0) * key / above > e[-1] + extra  # the scaled extra against what a row adds

    def _probe_rows(self, caps, regular: list[Expected]) -> list[int]:
        """The rows whose drafting could pay were it as cheap as it gets (LEAST_DRAFT_COST x a plain
        step) at their own acceptance (not the guess they are tried again with): those a probe of
        drafting's time drafts (none: no probe)."""
        whole = self._whole(self.max_shape.num_steps, caps, regular)
        return [row for row, (_, e) in whole.items() if e > ON_MARGIN * LEAST_DRAFT_COST - 1.0]

    def _hopeless(self, bk: Bucket, b: int, times: list[float | None], caps, expected: list[Expected]) -> bool:
        """A probe that already shows drafting losing stops there (a dear arm costs little to learn):
        after one timed step, if even were every draft accepted it would pay under half of plain
        decoding's tokens per second (a spike of a shared machine rarely doubles one whole step, and a
        wrong call costs one back-off; on an AVX2 EPYC a tree at batch 16 costs ~9 plain steps, so each
        probe step is ~8 plain steps lost); after two, if it could not pay at all; after three, if at the
        requests' expected acceptance it loses to plain decoding by a clear margin."""
        fresh, t0 = bk.arm(bk.probe).fresh, times[0]
        if t0 is None or not fresh:
            return False
        secs = sorted(x for _, x in fresh)
        best = b + sum(max(e[-1] + extra, bk.probe) for e, extra in expected)
        if best / secs[0] < HOPELESS * b / t0:
            return True
        if len(fresh) < 2:
            return False
        if best / secs[0] < b / t0:
            return True
        if len(fresh) < 3:
            return False
        probed = list(times)
        probed[bk.probe] = secs[len(secs) // 2]
        whole = self._whole(bk.probe, caps, expected)
        return self.goodput_of(b, bk.probe, probed, whole) * PROBE_CLEAR < b / t0

    def _count(self, depth: int, pick: dict, kind: str, why: Why) -> tuple[int, dict, str]:
        """The decision (depth, pick, kind), counted, and why it was taken (self.why)."""
        self.why = why
        depth = depth if pick else 0
        self.choices[depth] = self.choices.get(depth, 0) + 1
        return depth, pick, kind

    def _probe(self, bk: Bucket, caps, expected, rows: list[int]) -> tuple[int, dict, str]:
        """Start measuring a drafting arm afresh: the deepest never measured, else the one predicted to
        do best (if even it loses now, the others most likely do too); the rows given draft the whole
        shape."""
        depths = self.depths()
        unseen = [x for x in depths if bk.arm(x).seconds() is None]
        if unseen:
            depth = max(unseen)
        else:
            times = bk.times(depths, self.max_shape.num_steps)
            b = len(caps)

            def predicted(d: int) -> float:
                whole = self._whole(d, caps, expected)
                return self.goodput_of(b, d, times, {row: whole[row] for row in rows if row in whole})

            depth = max(depths, key=predicted)
        bk.start_probe(depth)
        bk.probe_left -= 1
        log.debug("probing depth %d at batch bucket %d (back-off %d)", depth, bucket_of(len(caps)), bk.backoff)
        whole = self._whole(depth, caps, expected)
        return self._count(depth, {row: whole[row] for row in rows if row in whole}, "probe",
                           ("probe", depth, 0.0, 0.0))

    def _whole(self, depth: int, caps, expected: list[Expected]) -> dict[int, tuple[int, float]]:
        opts = self._options(depth, caps, expected, whole=True)
        return {row: o[0] for row, o in enumerate(opts) if o}

    def _best(self, b: int, times: list[float | None], caps, expected: list[Expected]
              ) -> tuple[int, float, dict[int, tuple[int, float]]]:
        """The best allocation over the drafting depths with a time estimate: (depth, goodput, pick)."""
        best_d, best_g, best = 0, 0.0, {}
        chain = self.max_shape.topk == 1
        for d in self.depths():
            if times[d] is None:
                continue
            for whole in ((True, False) if chain else (True,)):
                pick = self._allocate(b, d, times[0], times[d], self._options(d, caps, expected, whole))
                if not pick:
                    continue
                deff = max(n for n, _ in pick.values()) if chain else d
                g = self.goodput_of(b, deff, times, pick)
                if g > best_g:
                    best_d, best_g, best = deff, g, pick
        return best_d, best_g, best

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

    def goodput_of(self, batch: int, depth: int, times: list[float | None], pick: dict[int, tuple[int, float]]
                   ) -> float:
        """G(D, n) of an allocation {row: (draft nodes, expected accepted)} at `depth`."""
        t0 = times[0]
        if not pick or not depth:
            return batch / max(t0, 1e-12)
        share = self.drafting_share(batch, depth, [n for n, _ in pick.values()])
        t = t0 + _extra(t0, times[depth]) * share
        return (batch + sum(e for _, e in pick.values())) / max(t, 1e-12)

    def _allocate(self, batch: int, depth: int, t0: float, td: float, options: list[list[tuple[int, float]]]
                  ) -> dict[int, tuple[int, float]]:
        """Dinkelbach's iteration on G = (B + sum E) / (t_0 + s (F + sum c)), s the measured seconds
        per row of drafting's extra: for the current goodput L each row takes the option with the
        largest E - L s c (if positive), the drafting rows together paying F; that allocation's
        goodput exceeds L unless L is already the best. Starts from L = plain's goodput."""
        s = _extra(t0, td) / (FIXED_ROWS + batch)
        best_g, best = batch / max(t0, 1e-12), {}
        for _ in range(DINKELBACH_ROUNDS):
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
            if not pick or value <= mu * FIXED_ROWS:
                break
            cost = FIXED_ROWS + sum(self._row_cost(depth, n) for n, _ in pick.values())
            g = (batch + sum(e for _, e in pick.values())) / max(t0 + s * cost, 1e-12)
            if g <= best_g * (1 + 1e-12):
                break
            best_g, best = g, pick
        return best

    def _options(self, depth: int, caps: Sequence[int | None], expected: list[Expected],
                 whole: bool) -> list[list[tuple[int, float]]]:
        """Per row, what it may draft at `depth`, as (draft nodes, expected accepted): a chain any
        length up to the shape's, a tree all of it (its acceptance taken at the depth its node count
        reaches; a whole uncapped shape at full depth adds the extra past it); never more nodes than
        the row's own cap. whole: the longest only."""
        nodes = self.shape_for(depth).num_drafts
        full = depth == self.max_shape.num_steps
        chain = self.max_shape.topk == 1
        out = []
        for cap, (e, extra) in zip(caps, expected):
            most = nodes if cap is None else min(cap, nodes)
            bonus = extra if (full and cap is None) else 0.0
            if most <= 0:
                out.append([])
            elif chain and not whole:
                out.append([(n, e[min(n, depth)] + (bonus if n == nodes else 0.0)) for n in range(1, most + 1)])
            else:
                out.append([(most, e[min(most, depth)] + (bonus if most == nodes else 0.0))])
        return out

    def _log(self, bk: Bucket, key: int, on: bool, d: int, g: float, plain: float, times) -> None:
        first = not bk.decided
        bk.decided = True
        t = ", ".join(f"{i}: {x * 1e3:.1f}" for i, x in enumerate(times) if x is not None)
        (log.info if first else log.debug)(
            "speculation %s at batch bucket %d: predicted %.1f tok/s drafting depth %d vs %.1f plain "
            "(measured ms per step by depth {%s}; acceptance per depth [%s])", "on" if on else "off", key,
            g, d, plain, t, ", ".join(f"{r:.2f}" for r in self.rates()))

    # ------------------------------------------------------------------ feedback
    def observe(self, batch_size: int, shape: TreeShape | None, seconds: float, accepted: list[int],
                timed: bool = True, offered: list[int] | None = None, reqs: Sequence[Request] | None = None,
                sizes: list[int] | None = None, forced: int = 0) -> None:
        """After a step: acceptance (the rows whose proposer drafted: its drafts alone, see the
        interface), then its time for its (bucket, depth) arm, with every token the step emitted
        (forced: the grammar-forced drafts it accepted, in no row's acceptance)."""
        depth = shape.num_steps if shape else 0
        if shape is not None:
            self._learn(shape, accepted, offered, reqs)
        bk = self._bucket(bucket_of(batch_size))
        trying, bk.trying = bk.trying, None  # (a try that ended up decoding plainly keeps its charge)
        if shape is None:
            if timed:
                bk.arm(0).add(batch_size, seconds, bk.steps)
            return
        t0 = bk.arm(0).seconds()
        if trying is not None and t0:  # a try: its cost as it ran (its catch-up included) replaces the prediction
            bk.credit += trying - max(seconds / t0 - 1.0, 0.0)
        if bk.probe == depth and t0:
            # what probing costs beyond plain decoding, its catch-up included: the next one waits accordingly
            bk.probe_spent += max(seconds / t0 - 1.0, 0.0)
        if not timed:
            return
        tokens = batch_size + sum(accepted) + forced
        if bk.on and bk.probe is None:
            bk.real.append((tokens, seconds))
            lost = bk.guard()
            if lost is not None:
                log.info("speculation off at batch bucket %d: realized %.1f tok/s drafting vs %.1f plain; "
                         "tried again in %d steps", bucket_of(batch_size), lost[0], lost[1], bk.probe_at - bk.steps)
        share = 1.0 if sizes is None else self.drafting_share(batch_size, depth, [n - 1 for n in sizes])
        if share < 1.0:
            # rows cut short or left out: scale the drafting part up to the whole shape's
            if share < MIN_SHARE or t0 is None:
                return
            seconds = max(seconds, t0 + (seconds - t0) / share)
        bk.arm(depth).add(tokens, seconds, bk.steps)

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        self.observe(batch_size, None, seconds, [])

    def costs_changed(self) -> None:
        """The kernels' thread count changed: every bucket measures its step times afresh
        (arms.Bucket.remeasure); acceptance, back-offs and probes due stand."""
        for bk in self.buckets.values():
            bk.remeasure()


def _extra(t0: float, td: float) -> float:
    """Drafting's measured extra over a plain step, at least (LEAST_DRAFT_COST - 1) x a plain step: two
    noisy figures a little apart must not make drafting look free (every row would then draft)."""
    return max(td - t0, (LEAST_DRAFT_COST - 1.0) * t0)
