"""What speculation's two arms measured, per batch bucket: step times, realized goodput, and
the guard with its back-off. The adaptive policy (adaptive.py) decides from these.

An arm is a draft depth: 0 is plain decoding, d > 0 drafting d levels. Per bucket (batch sizes
within a factor of 1.5 of each other) and arm, the wall time of the last WINDOW steps that did
nothing else (a step that also caught the head up on a backlog is not timed; a step whose rows
drafted only part of the shape is scaled up to the whole shape, see AdaptivePolicy.observe); an
arm's estimate is their trimmed mean (robust to a shared machine's spikes like a median, and less
noisy), once it has MIN_SEEN of them, and no arm's figure is derived from another's. A probe
re-measures one arm from scratch: its old window is replaced by MIN_SEEN fresh steps (or by the
two or more it timed, when it was cut short), so no estimate stays frozen at what an arm cost long
ago.

The guard: while a bucket speculates, the realized goodput of its last speculative steps as they
ran (mean tokens emitted over the trimmed mean step time) is compared with plain decoding's in the same bucket
(its last plain steps, explored while speculating); below GUARD_MARGIN of it, speculation goes off
for the bucket whatever the prediction says, and is tried again (a probe) after a back-off that
doubles each time it loses again (BASE_BACKOFF .. MAX_BACKOFF bucket steps) and falls back to the
base once speculation has held for RESET_AFTER steps; where drafting steps are dear, probes are
spaced so that they cost at most EXPLORE_BUDGET of the time (what the last probe cost beyond plain
decoding, its catch-up included, over the steps until the next).

Tries: while a bucket decodes plainly, a request tried again on an optimistic guess (a new one, or
one whose own back-off ran out; adaptive.py) makes a plain step a drafting one. Each costs what
its step took beyond a plain step (as it ran: a new request's first try also feeds the head its
prompt, ~4x a plain step of the demo, which drafting's timed steps leave out), so tries spend a
credit that grows by TRY_BUDGET plain steps per bucket step (at most TRY_CAP): a steady stream of
new requests where drafting loses costs at most that share of the time, however many arrive; a try
that finds no credit waits (the request stays due).
"""
from __future__ import annotations

import math
import statistics
from collections import deque

WINDOW = 15  # timed steps kept per (bucket, arm)
TRIM = 0.2  # an arm's estimate drops this share of its slowest and of its fastest steps (a shared machine's spikes)
MIN_SEEN = 5  # timed steps of an arm before its estimate counts (and a probe's length, timed)
PROBE_STEPS = MIN_SEEN + 3  # most steps a probe runs (its first step may catch up a backlog, untimed)
GUARD_WINDOW = 32  # speculative steps, as run, whose realized goodput the guard judges
GUARD_MIN = 16  # ... at least this many before it judges (and again every GUARD_MIN // 2 steps)
GUARD_MARGIN = 0.95  # realized speculative goodput under this share of plain's: speculation off
BASE_BACKOFF, MAX_BACKOFF = 32, 256  # bucket steps before a losing arm is tried again (doubling)
EXPLORE_BUDGET = 0.0025  # ... and at least so many that probing costs at most this share of the time
TRY_BUDGET = 0.004  # plain steps of credit each bucket step adds for optimistic tries while plain ...
TRY_CAP = 3.0  # ... up to this many (a fresh bucket starts full)
PROBE_COST = 3  # steps a probe of a losing arm takes at least (it stops once two timed steps show it cannot pay)
STRETCH = 4  # ... but after the first probe at most this many back-offs (it may have run cold)
COLD_BUDGET = 0.01  # ... or more, so that even a first probe costs at most this share of the steps until the next
MAX_SPACING = 8192  # and never more steps than this between probes
RESET_AFTER = 64  # steps speculation must hold before the back-off returns to its base
FORCED_WINDOW = 12  # forced steps whose goodput ForcedGate weighs against plain decoding's (with six, JSON
# at batch 1 here backed off 1-3 times in 8 answers, with twelve none)
FORCED_SEEN = 6  # plain steps timed in a bucket before forced-only steps run there


def bucket_of(batch: int) -> int:
    """The bucket of a batch size: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ... (the largest in it)."""
    if batch <= 4:
        return max(batch, 1)
    p = 1 << (batch - 1).bit_length()
    return p * 3 // 4 if batch <= p * 3 // 4 else p


class Arm:
    """One (bucket, depth): its last WINDOW timed steps as (tokens, seconds)."""

    __slots__ = ("recent", "fresh", "last", "least")

    def __init__(self) -> None:
        self.recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self.fresh: list[tuple[float, float]] | None = None  # a probe's steps, replacing `recent` once enough
        self.last = -1  # bucket step of its last timed step
        self.least = MIN_SEEN  # timed steps in the window before its estimate counts (2 after a probe cut short)

    def add(self, tokens: float, seconds: float, step: int) -> None:
        self.last = step
        if self.fresh is None:
            self.recent.append((tokens, seconds))
            return
        self.fresh.append((tokens, seconds))
        if len(self.fresh) >= MIN_SEEN:
            self.recent = deque(self.fresh, maxlen=WINDOW)
            self.fresh, self.least = None, MIN_SEEN

    def seconds(self) -> float | None:
        """Seconds per step (trimmed mean), or None before MIN_SEEN timed steps (see end_probe)."""
        if len(self.recent) < self.least:
            return None
        return trimmed_mean([s for _, s in self.recent])

    def rough(self) -> float | None:
        """Seconds per step from whatever it has (a probe's steps first), None if nothing."""
        got = self.fresh or self.recent
        return trimmed_mean([s for _, s in got]) if got else None

    def goodput(self) -> float | None:
        """Realized tokens per second: mean tokens per step over the trimmed mean step time."""
        t = self.seconds()
        return None if t is None else statistics.fmean(k for k, _ in self.recent) / max(t, 1e-12)


class Bucket:
    """A batch bucket's measurements and its speculation state."""

    def __init__(self) -> None:
        self.arms: dict[int, Arm] = {}
        self.real: deque[tuple[float, float]] = deque(maxlen=GUARD_WINDOW)  # speculative steps since on
        self.unjudged = 0  # of them, since the guard last judged
        self.steps = 0  # decisions taken for this bucket
        self.on = False  # speculating (the decision rule's state, for its hysteresis)
        self.blocked = False  # the guard turned speculation off: nothing drafts until the next probe
        self.probe: int | None = None  # the arm being probed, if any
        self.probe_left = 0
        self.probe_spent = 0.0  # what the last probe cost beyond plain decoding, in plain steps
        self.probes = 0  # probes started here
        self.probe_at = 0  # bucket step from which a losing speculation is probed again
        self.backoff = BASE_BACKOFF
        self.on_since = 0
        self.decided = False  # a first decision was logged
        self.credit = TRY_CAP  # plain steps' worth of time optimistic tries may still spend (see the module doc)
        self.trying: float | None = None  # a try decided, not yet observed: the credit it was charged
        self.quiet: tuple | None = None  # (request ids, until which policy step, their states, the plan): AdaptivePolicy._quiet

    def arm(self, depth: int) -> Arm:
        a = self.arms.get(depth)
        if a is None:
            a = self.arms[depth] = Arm()
        return a

    def times(self, depths: list[int], deepest: int) -> list[float | None]:
        """Estimated seconds per step at depth 0..deepest: the measured estimate where there is one;
        a depth not measured yet (a chain's) lies on the line between its measured neighbours (an
        optimistic guess: choosing it measures it), None beyond the deepest measured one; never
        less than a shallower depth's (more drafting cannot be cheaper: where two measured drafting
        depths disagree, the more recently measured one's time holds for both)."""
        t: list[float | None] = [self.arm(d).seconds() if d in self.arms else None for d in range(deepest + 1)]
        known = [d for d in range(deepest + 1) if t[d] is not None and (d == 0 or d in depths)]
        for i, d in enumerate(known):  # a deeper drafting depth measured cheaper than a shallower one: the
            for k in known[1:i]:  # one measured more recently holds (a figure from another regime, long
                if t[k] > t[d]:  # ago, must not make a fresh one look dear), the other takes its time
                    if self.arm(d).last >= self.arm(k).last:
                        t[k] = t[d]
                    else:
                        t[d] = t[k]
        out: list[float | None] = []
        for d in range(deepest + 1):
            v = t[d] if d in known else None
            if v is None and d and d in depths:
                lo = max((k for k in known if k < d), default=None)
                hi = min((k for k in known if k > d), default=None)
                if lo is not None and hi is not None:
                    v = t[lo] + (t[hi] - t[lo]) * (d - lo) / (hi - lo)
            if v is not None and out and out[-1] is not None:
                v = max(v, out[-1])
            out.append(v)
        return out

    def remeasure(self) -> None:
        """Every step time here ran at another speed (the kernels' thread count changed; at first
        two threads on a core shared with a busy process, ~3x one thread's step): plain decoding is
        measured again before anything is decided from it (its next MIN_SEEN steps decode plainly,
        a speculating bucket's included: otherwise only every EXPLORE_EVERY-th step would refresh
        it, and a window of plain steps from the slow count makes drafting look good); a drafting
        arm that runs now (speculation on) replaces its window as it runs; the guard starts over."""
        zero = self.arm(0)
        zero.recent.clear()
        zero.fresh, zero.least = None, MIN_SEEN
        for depth, a in self.arms.items():
            if depth and self.on and a.fresh is None:
                a.fresh = []
        self.real.clear()
        self.unjudged = 0
        self.quiet = None

    def start_probe(self, depth: int) -> None:
        self.probe, self.probe_left, self.probe_spent = depth, PROBE_STEPS, 0.0
        self.probes += 1
        self.arm(depth).fresh = []

    def end_probe(self) -> None:
        """A probe that timed fewer than MIN_SEEN steps (its others caught up a backlog, or it stopped
        early) replaces the old window all the same where it timed two or more (an arm measured long
        ago, in another regime, must not outvote its fresh steps; they count as an estimate from two);
        a single step joins the newest of the old window's steps that make MIN_SEEN."""
        a = self.arm(self.probe)
        if a.fresh and len(a.fresh) >= 2:
            a.recent, a.least = deque(a.fresh, maxlen=WINDOW), 2
        elif a.fresh:
            a.recent = deque(list(a.recent)[-(MIN_SEEN - 1):] + a.fresh, maxlen=WINDOW)
        a.fresh = None
        self.probe = None
        self.blocked = False

    def probe_done(self) -> bool:
        return self.probe_left <= 0 or self.arm(self.probe).fresh is None

    def lost(self) -> None:
        """Speculation lost here (a probe, the guard, the prediction): try again after the back-off,
        doubled, or later where a probe costs more than EXPLORE_BUDGET of the steps between (a
        drafting step at several times a plain step's cost is probed that much more rarely; after a
        bucket's first probe, whose steps may have run cold, at most STRETCH back-offs later, or as
        much later as keeps that probe under COLD_BUDGET of the steps between)."""
        spent = max(self.probe_spent, PROBE_COST * (self.cost_ratio() - 1.0))  # in plain steps
        # a first probe may have run cold: tried again sooner than the budget says, but not so soon that
        # a dear one (at batch 48 on an AMX Xeon, ~36 plain steps with its catch-up) costs over COLD_BUDGET
        cap = max(STRETCH * self.backoff, math.ceil(spent / COLD_BUDGET)) if self.probes < 2 else MAX_SPACING
        stretch = min(math.ceil(spent / EXPLORE_BUDGET), cap)
        self.probe_at = self.steps + max(self.backoff, stretch)
        self.backoff = min(2 * self.backoff, MAX_BACKOFF)

    def accrue(self) -> None:
        """A bucket step: the tries' credit grows by TRY_BUDGET, up to TRY_CAP."""
        self.credit = min(self.credit + TRY_BUDGET, TRY_CAP)

    def cost_ratio(self) -> float:
        """The cheapest measured drafting step over a plain step (1 when either is unknown)."""
        t0 = self.arm(0).seconds()
        spec = [t for d, a in self.arms.items() if d and (t := a.rough()) is not None]
        return max(1.0, min(spec) / t0) if t0 and spec else 1.0

    def switch(self, on: bool) -> None:
        if on and not self.on:
            self.on_since = self.steps
            self.real.clear()
        elif not on and self.on:
            self.lost()
        elif on and self.steps - self.on_since >= RESET_AFTER:
            self.backoff = BASE_BACKOFF
        self.on = on

    def realized(self) -> float | None:
        """Realized goodput of the speculative steps since speculation went on (None: too few)."""
        if len(self.real) < GUARD_MIN:
            return None
        return statistics.fmean(k for k, _ in self.real) / max(trimmed_mean([s for _, s in self.real]), 1e-12)

    def guard(self) -> tuple[float, float] | None:
        """(speculative, plain) realized goodput when speculation loses by more than the margin (the
        guard then turns it off and blocks it until the next probe), else None."""
        self.unjudged += 1
        if self.unjudged < GUARD_MIN // 2:  # judged every few steps, not on every overlapping window
            return None
        self.unjudged = 0
        spec, plain = self.realized(), self.arm(0).goodput()
        if spec is None or plain is None or spec >= GUARD_MARGIN * plain:
            return None
        self.on = False
        self.blocked = True
        self.real.clear()
        self.lost()
        return spec, plain


def trimmed_mean(xs: list[float]) -> float:
    """The mean of xs without its TRIM share of lowest and of highest values: robust to spikes like a
    median, and closer to the mean it estimates when the noise is not (a median wastes most samples)."""
    xs = sorted(xs)
    cut = int(len(xs) * TRIM)
    return statistics.fmean(xs[cut: len(xs) - cut])


class ForcedGate:
    """Whether the drafts that cost no draft model (a grammar's forced tokens, and at batch 1 prompt
    lookup: worker.free_drafts) are verified alone (a step with no head drafts) or the tokens
    decoded one per plain step, per batch bucket, by measurement (the first FORCED_SEEN steps of a
    bucket decode plainly, timing that). A forced token costs a verification row: where rows are
    memory-bound (batch 1: 16 rows ~3x one) a chain of them is nearly free, where they are
    compute-bound (batch 16 on a 2-core CPU: ~1 ms a row, decode or verification alike) it saves
    nothing and its masks and walk cost more (JSON at batch 16 ran 0.92x of plain decoding with it).
    Once plain decoding has FORCED_SEEN timed steps in a bucket and forced steps FORCED_WINDOW, a
    forced step's goodput (tokens committed over seconds, the window's sums without its TRIM share of
    slowest and of fastest steps) under plain decoding's (the batch over its trimmed mean step) turns
    it off for a back-off (BASE_BACKOFF bucket steps, doubling to MAX_BACKOFF while it keeps losing),
    after which it runs again and is measured afresh."""

    def __init__(self) -> None:
        self.plain: dict[int, deque[float]] = {}  # bucket -> plain step seconds
        self.forced: dict[int, deque[tuple[int, float]]] = {}  # bucket -> (tokens, seconds) of forced steps
        self.steps: dict[int, int] = {}  # bucket -> steps seen (plain or forced)
        self.off_until: dict[int, int] = {}
        self.backoff: dict[int, int] = {}

    def allowed(self, batch: int) -> bool:
        """Forced-only steps may run for this batch now: plain decoding has been timed here (its first
        FORCED_SEEN steps in a bucket decode plainly) and they are not backed off."""
        k = bucket_of(batch)
        if len(self.plain.get(k, ())) < FORCED_SEEN:
            return False
        return self.steps.get(k, 0) >= self.off_until.get(k, 0)

    def costs_changed(self) -> None:
        """Step times measured so far ran at another speed: both kinds are timed afresh (plain first)."""
        self.plain.clear()
        for window in self.forced.values():
            window.clear()

    def observe_plain(self, batch: int, seconds: float) -> None:
        k = bucket_of(batch)
        self.plain.setdefault(k, deque(maxlen=WINDOW)).append(seconds)
        self.steps[k] = self.steps.get(k, 0) + 1

    def observe_forced(self, batch: int, tokens: int, seconds: float) -> None:
        k = bucket_of(batch)
        self.steps[k] = self.steps.get(k, 0) + 1
        window = self.forced.setdefault(k, deque(maxlen=FORCED_WINDOW))
        window.append((tokens, seconds))
        plain = self.plain.get(k)
        if len(window) < FORCED_WINDOW or not plain or len(plain) < FORCED_SEEN:
            return
        # the window's goodput without its TRIM share of slowest and of fastest steps (tokens over
        # seconds of the rest): one step a busy neighbour stalled must not turn forced steps off
        steps = sorted(window, key=lambda ts: ts[0] / max(ts[1], 1e-12))
        cut = int(len(steps) * TRIM)
        steps = steps[cut: len(steps) - cut]
        forced_rate = sum(t for t, _ in steps) / max(sum(s for _, s in steps), 1e-12)
        plain_rate = batch / max(trimmed_mean(list(plain)), 1e-12)
        if forced_rate < plain_rate:
            back = self.backoff.get(k, BASE_BACKOFF)
            self.off_until[k] = self.steps[k] + back
            self.backoff[k] = min(2 * back, MAX_BACKOFF)
            window.clear()  # measured afresh when it runs again
        else:
            self.backoff[k] = BASE_BACKOFF
