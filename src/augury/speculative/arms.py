"""What the adaptive policy's options cost, per batch bucket, as measured: step times and realized
tokens per second. The policy (adaptive.py) decides from these.

An arm is an option's step kind: 0 plain decoding, d > 0 the proposer drafting d levels (its rows
head or hybrid, each request's budget decides), FREE a step of the drafts that cost no draft model
(a grammar's forced tokens, suffix drafts verified alone). Per bucket (batch sizes within a factor of
1.5 of each other) and arm: the wall time of the last WINDOW timed steps (a step that also caught the
head up on a backlog is not timed; a drafting step whose rows drafted part of the shape is scaled up
to the whole shape, AdaptivePolicy.observe), whose trimmed mean is the arm's step time once it has
MIN_SEEN of them; and, as the steps ran (unscaled, untimed ones included), tokens emitted over seconds:
the arm's realized goodput, which the policy's guard holds its prediction to. No arm's figure is
derived from another's. A refresh (the exploration rule's) re-measures an arm from scratch: its
window is replaced by the fresh steps once it has MIN_SEEN of them, or by what it has when it ends.
"""
from __future__ import annotations

from collections import deque

WINDOW = 15  # timed steps kept per (bucket, arm): follows a change of regime within 15 steps; enough to trim
TRIM = 0.2  # an estimate drops this share of its slowest and of its fastest steps (a shared machine's spikes)
MIN_SEEN = 5  # timed steps before an estimate counts: the fewest a 20% trim drops a spike from at each end
FREE = -1  # the arm of steps whose drafts cost no draft model
# the guard trips where an arm realized under this share of plain decoding's rate: the tokens a drafting
# step emits vary by ~40% step to step (batch 1, 0.7 a level), so a window of 15 realizes its mean within
# ~10%; at 0.95 the simulator's 1.8x wins at batch 1 tripped it by chance now and then
GUARD_MARGIN = 0.9


def bucket_of(batch: int) -> int:
    """The bucket of a batch size: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ... (the largest in it)."""
    if batch <= 4:
        return max(batch, 1)
    p = 1 << (batch - 1).bit_length()
    return p * 3 // 4 if batch <= p * 3 // 4 else p


def mean(xs: list[float]) -> float:
    """The mean of a non-empty list (statistics.fmean's exact sum, ~5 us a call under cProfile, was the
    policy's largest single cost: it asks for a few dozen means a step, on a batch-1 step of ~4 ms)."""
    return sum(xs) / len(xs)


def trimmed_mean(xs: list[float]) -> float:
    """The mean of xs without its TRIM share of lowest and of highest values: robust to spikes like a
    median, and closer to the mean it estimates when the noise is not (a median wastes most samples)."""
    xs = sorted(xs)
    cut = int(len(xs) * TRIM)
    return mean(xs[cut: len(xs) - cut])


class Arm:
    """One (bucket, option): its last WINDOW timed steps (seconds, forced tokens) and its steps as run."""

    __slots__ = ("recent", "fresh", "real", "last", "least", "_memo")

    def __init__(self) -> None:
        self.recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (seconds, forced tokens accepted)
        self.fresh: list[tuple[float, float]] | None = None  # a refresh's steps, replacing `recent` once enough
        # (tokens, seconds, trimmed) of its steps as run; trimmed False: a step counted whole (realized)
        self.real: deque[tuple[float, float, bool]] = deque(maxlen=WINDOW)
        self.last: int | None = None  # bucket step of its last timed step (None: none)
        self.least = MIN_SEEN  # timed steps before its estimate counts (fewer after a refresh cut short)
        # (what, key, value) per figure: seconds / forced / realized, asked many times a step (a trimmed
        # mean is ~3-10 us of Python), recomputed when the steps they rest on change (the key: the
        # window's length and newest entry, a new tuple on every append, and `least`)
        self._memo: dict[str, tuple] = {}

    def add(self, seconds: float, forced: float, step: int) -> None:
        """A timed step (bucket step `step`): its figures are the arm's newest."""
        self.last = step
        if self.fresh is None:
            self.recent.append((seconds, forced))
            return
        self.fresh.append((seconds, forced))
        if len(self.fresh) >= MIN_SEEN:
            self.recent = deque(self.fresh, maxlen=WINDOW)
            self.fresh, self.least = None, MIN_SEEN

    def ran(self, tokens: float, seconds: float, trimmed: bool = True) -> None:
        self.real.append((tokens, seconds, trimmed))

    def _cached(self, what: str, window: deque, compute) -> float | None:
        key = (len(window), window[-1] if window else None, self.least)
        got = self._memo.get(what)
        if got is not None and got[0][0] == key[0] and got[0][1] is key[1] and got[0][2] == key[2]:
            return got[1]
        value = compute()
        self._memo[what] = (key, value)
        return value

    def seconds(self) -> float | None:
        """Seconds per step (trimmed mean), or None before it has `least` timed steps."""
        if len(self.recent) < self.least:
            return None
        return self._cached("seconds", self.recent, lambda: trimmed_mean([s for s, _ in self.recent]))

    def forced(self) -> float:
        """Forced tokens accepted per step, on average (a grammar's, verified whatever the policy drafts)."""
        if not self.recent:
            return 0.0
        return self._cached("forced", self.recent, lambda: mean([f for _, f in self.recent]))

    def realized(self) -> float | None:
        """Tokens per second as its last steps ran: mean tokens over mean seconds, the seconds of the steps
        that may be trimmed taken as their trimmed mean (one step a busy neighbour stalled must not
        condemn the arm), the others' whole (a cost the arm brings on itself, however rare: a free step's
        thread-count trial, see AdaptivePolicy.observe_free); None before MIN_SEEN steps."""
        if len(self.real) < MIN_SEEN:
            return None
        return self._cached("realized", self.real, self._realized)

    def _realized(self) -> float:
        trim = [s for _, s, t in self.real if t]
        seconds = (len(trim) * trimmed_mean(trim) if trim else 0.0) + sum(s for _, s, t in self.real if not t)
        return mean([k for k, _, _ in self.real]) / max(seconds / len(self.real), 1e-12)

    def held(self, rate: float, plain: float) -> float:
        """The guard: a predicted tokens/s, or what the arm realized where that fell below GUARD_MARGIN
        of plain decoding's."""
        got = self.realized()
        return got if got is not None and got < GUARD_MARGIN * plain else rate

    def refresh(self) -> None:
        """Measure afresh from now: the old figures stand until the new ones replace them."""
        self.fresh = []
        self.real.clear()

    def settle(self, judged: bool = False) -> None:
        """A refresh ended: two or more fresh steps replace the window (an estimate from two beats one
        from another regime), a lone one joins it; judged (its steps showed the arm cannot win,
        adaptive._cannot_win), even a lone one replaces it and is the arm's estimate: an arm first
        probed in a batch of new requests is stopped after one step, and left without an estimate it
        read as never measured, so each new batch bucket probed it again at once (agentic loops at batch
        4, buckets 4, 3 and 2 in turn, AVX2: each such step 118-162 ms against 14-18 ms plain ones, the
        head catching up the requests' ~1,500-token histories)."""
        if self.fresh and (len(self.fresh) >= 2 or judged):
            self.recent, self.least = deque(self.fresh, maxlen=WINDOW), len(self.fresh)
        elif self.fresh:
            self.recent.extend(self.fresh)
        self.fresh = None


def _fit(pts: list[tuple[int, float]]) -> tuple[float, float | None, float]:
    """(a, c, mean k): the least-squares line s = a + c k through (k, s) points, c never below 0; c None
    where every point has the same k (a is then the mean s)."""
    mk = mean([k for k, _ in pts])
    ms = mean([s for _, s in pts])
    var = sum((k - mk) ** 2 for k, _ in pts)
    if var == 0.0:
        return ms, None, mk
    c = max(sum((k - mk) * (s - ms) for k, s in pts) / var, 0.0)
    return ms - c * mk, c, mk


def _at(line: tuple[float, float | None, float], k: int) -> float:
    a, c, _ = line
    return a if c is None else a + c * k


class Bucket:
    """A batch bucket's arms and its exploration state (adaptive.py)."""

    def __init__(self) -> None:
        self.arms: dict[int, Arm] = {}
        self.steps = 0  # decisions taken for this bucket
        self.credit = 0.0  # seconds exploration may still lose here (adaptive.EXPLORE_SHARE of the time)
        self.probe: int | None = None  # the arm being refreshed, if any
        self.probe_left = 0
        self.best = 0.0  # predicted tokens/s of the rule's choice when it last decided
        self.exploring = False  # the last decision explored: its step is charged to the credit
        self.need = float("inf")  # the expected loss of the exploration due next (inf: none due)
        self.soon = float("inf")  # bucket steps until the next option or request comes due
        self.quiet: tuple | None = None  # (request ids, until which policy step, their spread estimate): _quiet
        # timed steps of drafts that cost no draft model: (draft rows verified, seconds), for row_cost
        self.free_rows: deque[tuple[int, float]] = deque(maxlen=2 * WINDOW)
        # the free arm's last verdict: its realized tokens/s over plain decoding's B / t_0 (adaptive.free_allowed);
        # kept through a re-measurement, until its new steps give another
        self.free_gain: float | None = None
        self._line: tuple | None = None  # row_cost's fit: ((steps, the newest step), (a, c, mean k))

    def arm(self, key: int) -> Arm:
        a = self.arms.get(key)
        if a is None:
            a = self.arms[key] = Arm()
        return a

    def times(self, depths: list[int], deepest: int) -> list[float | None]:
        """Estimated seconds per step at depth 0..deepest: the measured estimate where there is one;
        a depth not measured yet (a chain's) lies on the line between its measured neighbours, None
        beyond the deepest measured one; never less than a shallower depth's (more drafting cannot
        be cheaper: where two measured depths disagree, the more recently run one's time holds)."""
        t: list[float | None] = [self.arms[d].seconds() if d in self.arms else None for d in range(deepest + 1)]
        known = [d for d in range(deepest + 1) if t[d] is not None and (d == 0 or d in depths)]
        for i, d in enumerate(known):
            for k in known[1:i]:
                if t[k] > t[d]:
                    if (self.arms[d].last or 0) >= (self.arms[k].last or 0):
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

    def row_cost(self, t0: float) -> tuple[float, float] | None:
        """(f, c): a step verifying k drafts that cost no draft model takes t0 + f + c k (t0 a plain
        step's time; f its fixed extra, the tree's and the verification's Python; c a verified row's
        compute), from the line s = a + c k fitted by least squares to the recent timed such steps,
        refitted once without the TRIM share of them farthest off it (a shared machine's spikes):
        f = a - t0; f and c never below 0. None before MIN_SEEN of them. Where every step verified as
        many rows, f is 0 and c their mean extra a row. The line is fitted once per new step (free_cut
        asks every step at batch 1; a fit is ~30 us of Python)."""
        pts = self.free_rows
        if len(pts) < MIN_SEEN:
            return None
        key = (len(pts), pts[-1])  # the newest step's tuple: a new object on every append
        if self._line is None or self._line[0][0] != key[0] or self._line[0][1] is not key[1]:
            line = _fit(list(pts))
            keep = sorted(pts, key=lambda p: abs(p[1] - _at(line, p[0])))[: len(pts) - int(len(pts) * TRIM)]
            self._line = (key, _fit(keep))
        a, c, mk = self._line[1]
        if c is None:  # one row count: its mean extra a row
            return 0.0, max((a - t0) / max(mk, 1.0), 0.0)
        return max(a - t0, 0.0), c

    def remeasure(self) -> None:
        """Every step time here ran at another speed (the kernels' thread count changed): plain decoding
        is measured again before anything is decided from it, every other arm afresh when it next runs."""
        zero = self.arm(0)
        zero.recent.clear()
        zero.real.clear()
        zero.fresh, zero.least = None, MIN_SEEN
        for key, a in self.arms.items():
            if key:
                a.refresh()
                a.last = None  # due for the exploration rule as if never run
        self.free_rows.clear()
        self.quiet = None
