"""How many threads augury's CPU kernels run a step with, chosen by timing the steps themselves.

torch's thread count (one per core by default) is right on an idle machine. On a shared one it can
be very wrong: with a busy process pinned to one of two cores, every barrier of a step's layers
waits for the thread that shares its core (measured on a 2-core VM with a busy process pinned to one
core and another program's tests running: plain decoding of the demo at 12.5 tok/s with 2 threads
for every kernel, about 51 with 1). No start-up test settles it, since the machine's load changes while augury
runs. So the fused stack's calls are timed, per row-count bucket, under each candidate count (the
process's torch thread count n, n / 2 and 1): the count with the lowest median time of its recent
calls runs; the others are tried again now and then, every `interval` calls, the interval doubling
(up to `explore_max`) while they keep losing, and tried again at once after a call that beat the
current count's median (until their median settles the matter; its gaps after that try keep
growing) and when the choice changes, so a change of load is noticed within a few hundred calls
while a losing count costs at most 1 / explore_max of the calls once settled (the gap before a try
also grows by how much that count lost, up to explore_max, or further where a try costs so much
that its share of the time would pass TRY_SHARE: a dear count is tried less often). A new bucket
starts as its nearest measured neighbour stands (see `ThreadChoice._bucket`). A count replaces the
current one only when its median is lower by more than `margin` (hysteresis against noise). Times
age with the process's work, not the clock: one taken more than `max_age` seconds of timed calls ago
no longer counts, so a bucket called rarely (a drafting step's verification rows) measures its
counts again at its next call instead of keeping for good what a passing load taught it; until then
it keeps the count it chose, but untimed calls (below) follow the nearest bucket measured within
max_age first (a server loaded beside busy processes chose one thread for its drafting buckets
during the warm-up, and its prompts, which took the nearest measured bucket's count, ran one thread
ever after: augury-default at 0.85x of augury-off in `augury bench`, where every worker loads at
once; 2026-12-03, AMX Xeon, 2 threads). For the same reason the warm-up request's times are
forgotten once it is done (`forget_times`): its choices stand until the first requests measure the
buckets they call. An idle spell ages nothing (with wall-clock ages, every request after 35 s idle
measured every count of every bucket again, 19-23 tries instead of 0-4 in the JSON bench's 8
answers, and ran 3.65-3.99 s against 3.28-3.69 s after no pause; AVX-512 EPYC, 2 threads); since the
load may have changed meanwhile, each bucket's next call after a pause longer than max_age tries its
other counts once (`idle_tries`), its times still counting. The
kernels give the same bits with any thread count (threads split rows or columns, never one value's
sum), so the choice changes speed only. torch's own thread setting, the process's, is never changed.

`choice()` is the process's instance. A timed call runs its picked count (an exploring one included);
every other call of augury's kernels runs `current()`: inside a `scoped(n)` block n, else the count
chosen (not explored) for the bucket of the last timed call. The output layer's calls are timed by a
choice of their own (`output_choice`, `timed_output`): its cost by thread count is not the stack's.
The layers run one by one (prefill, attention the stack does not take)
are never timed themselves (a long prompt's forward is too rare and too dear to explore on): they
run `settled(rows)`, the choice of the nearest bucket measured (the machine's load shows in every
bucket alike), under `scoped`.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, TypeVar

import torch


T = TypeVar("T")
_torch_outer = threading.local()  # torch's count in this thread outside kernels.torch_threads blocks


def torch_count() -> int:
    """torch's thread count as this thread has it outside a kernels.torch_threads block (inside one,
    torch.get_num_threads reads the block's lower count, which must not look like a change of setting)."""
    n = getattr(_torch_outer, "n", None)
    return n if n else torch.get_num_threads()


@contextmanager
def torch_outer(n: int):
    """Record n as this thread's torch count while a kernels.torch_threads block lowers it."""
    before = getattr(_torch_outer, "n", None)
    _torch_outer.n = before or n
    try:
        yield
    finally:
        _torch_outer.n = before


CLEAR_LOSS = 2.0  # a count whose every time so far is this much slower than another's median loses
TRY_SHARE = 0.02  # once settled, tries of a losing count cost at most this share of the time (see _gap)
MAX_AGE = 30.0  # seconds of timed calls a call's time counts for its bucket (see the module's docstring)


def candidates(n: int) -> tuple[int, ...]:
    """The thread counts tried for a process whose torch thread count is n, largest first."""
    return tuple(sorted({max(n, 1), max(n // 2, 1), 1}, reverse=True))


def bucket(rows: int) -> int:
    """Row counts timed together: 1, 2, 3-4, 5-8, ... (the smallest power of two >= rows)."""
    return 1 << max(rows - 1, 0).bit_length()


class _Bucket:
    def __init__(self, arms: tuple[int, ...], window: int, explore_min: int) -> None:
        self.times = {a: deque(maxlen=window) for a in arms}
        self.stamps = {a: deque(maxlen=window) for a in arms}  # the work clock when each was taken
        self.chosen = False  # every count was measured once: `best` is a choice, not the default
        self.best = arms[0]
        self.calls = 0
        self.interval = explore_min
        self.next_explore = explore_min
        self.turn = 0  # which losing count the next exploration tries
        self.idle_tries = 0  # losing counts to try at the next calls, the gap aside (after an idle spell)
        self.assumed: set[int] = set()  # counts taken as losing from a neighbour bucket (see ThreadChoice._bucket)

    def median(self, arm: int) -> float:
        return statistics.median(self.times[arm]) if self.times[arm] else float("inf")

    def expire(self, before: float) -> None:
        """Forget the times taken before `before` (`best` stays until the counts are measured again)."""
        for a, stamps in self.stamps.items():
            while stamps and stamps[0] < before:
                stamps.popleft()
                self.times[a].popleft()


class ThreadChoice:
    """Thread counts for the fused stack, by measurement (see the module's docstring)."""

    def __init__(self, max_threads: Callable[[], int] = torch_count, window: int = 7,
                 min_samples: int = 3, margin: float = 0.05, explore_min: int = 16, explore_max: int = 256,
                 max_age: float = MAX_AGE, now: Callable[[], float] = time.monotonic) -> None:
        self.max_threads, self.window, self.min_samples = max_threads, window, min_samples
        self.max_age, self.now = max_age, now  # now: the wall clock, for idle spells only
        self._work = 0.0  # seconds of timed calls recorded: the clock times age by
        self._next_expiry = 0.0  # times are aged at most once every max_age / 30 of work (see _sync_arms)
        self._last_pick: float | None = None  # now() at the last pick
        self.margin, self.explore_min, self.explore_max = margin, explore_min, explore_max
        self._arms: tuple[int, ...] = ()
        self._buckets: dict[int, _Bucket] = {}
        self._last_key = 0  # the bucket of the last timed call
        self.trials = 0  # timed calls that ran a count other than their bucket's chosen one (see trials())
        self.changes = 0  # times a bucket's chosen count changed (see changes())
        self._lock = threading.Lock()

    def _sync_arms(self) -> None:
        """The candidates as torch's count stands now (changed: start over), and no time older than
        max_age seconds of work."""
        arms = candidates(self.max_threads())
        if arms != self._arms:  # torch's thread count changed: start over
            self._arms, self._buckets = arms, {}
        work = self._work
        if work >= self._next_expiry:
            self._next_expiry = work + self.max_age / 30
            for b in self._buckets.values():
                b.expire(work - self.max_age)

    def _after_idle(self) -> None:
        """After a pause (no call for more than max_age seconds) each bucket tries its other counts once
        at its next calls: the machine's load may have changed while nothing ran, and the times taken
        before still count (they age with work only)."""
        now = self.now()
        if self._last_pick is not None and now - self._last_pick > self.max_age:
            for b in self._buckets.values():
                b.idle_tries = len(b.times) - 1
        self._last_pick = now

    def _bucket(self, rows: int) -> _Bucket:
        """The bucket of `rows`, made on first use. A new bucket next to one whose counts are all
        measured starts as that one stands: its chosen count, and the counts that lose there by more
        than CLEAR_LOSS taken as losing here too (not measured first, only explored on the usual
        growing gaps; a call of theirs that runs fast is tried again at once). The machine's load
        shows in every bucket alike: on a core shared with a busy process two threads ran the demo's
        stack at 25-35 ms a call in every bucket against 2.6-10 ms for one, and measuring them first
        in the buckets drafting's verification alone uses cost ~100 ms a drafting step."""
        self._sync_arms()
        key = bucket(rows)
        if key not in self._buckets:
            b = self._buckets[key] = _Bucket(self._arms, self.window, self.explore_min)
            near = self._nearest_settled(key)
            if near is not None:
                b.best = near.best
                b.assumed = {a for a in near.times if a != near.best and self._measured(near, a)
                             and near.median(a) > CLEAR_LOSS * near.median(near.best)}
        return self._buckets[key]

    def _nearest_settled(self, key: int) -> _Bucket | None:
        """The bucket nearest `key` (the one below on a tie) whose every count has its own times."""
        done = [k for k, b in self._buckets.items() if k != key and all(b.times[a] for a in b.times)
                and all(self._measured(b, a) for a in b.times)]
        if not done:
            return None
        return self._buckets[min(done, key=lambda k: (abs(k.bit_length() - key.bit_length()), k))]

    def _measured(self, b: _Bucket, arm: int) -> bool:
        """arm has min_samples times, or fewer that all lose by more than CLEAR_LOSS to a count that has
        them (no noise makes that up: a count 7x slower need not be timed three times to know)."""
        t = b.times[arm]
        if len(t) >= self.min_samples or (arm in b.assumed and not t):
            return True
        done = [b.median(a) for a in b.times if a != arm and len(b.times[a]) >= self.min_samples]
        return bool(t) and bool(done) and min(t) > CLEAR_LOSS * min(done)

    def pick(self, rows: int) -> int:
        """The thread count for a call over `rows` rows (time it and `record` it)."""
        with self._lock:
            self._after_idle()
            b = self._bucket(rows)
            b.calls += 1
            short = [a for a in b.times if not self._measured(b, a)] if len(b.times) > 1 else []
            if len(b.times) == 1:
                arm = b.best
            elif short:  # every count measured a few times first: each once, then the fastest so far
                #          (a count that loses by CLEAR_LOSS then needs no second call: on a shared
                #          core each call of two threads cost ~30 ms against 2.5 for one)
                unseen = [a for a in short if not b.times[a]]
                arm = unseen[0] if unseen else min(short, key=b.median)
            elif b.idle_tries > 0:  # after an idle spell: each other count once (see _after_idle)
                b.idle_tries -= 1
                others = [a for a in b.times if a != b.best]
                arm = others[b.turn % len(others)]
                b.turn += 1
            elif b.calls >= b.next_explore:
                others = [a for a in b.times if a != b.best]
                arm = others[b.turn % len(others)]
                b.turn += 1
                b.next_explore = b.calls + self._gap(b, arm)
                b.interval = min(2 * b.interval, self.explore_max)
            else:
                arm = b.best
            if arm != b.best:
                self.trials += 1
            self._last_key = bucket(rows)
            return arm

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """A call over `rows` rows ran with `threads` threads in `seconds`."""
        with self._lock:
            self._work += seconds
            b = self._bucket(rows)
            if threads not in b.times:
                return
            b.times[threads].append(seconds)
            b.stamps[threads].append(self._work)
            if not all(self._measured(b, a) for a in b.times):
                return
            b.chosen = True
            if threads != b.best and seconds < (1.0 - self.margin) * b.median(b.best):
                # a losing count ran faster: try it again at once (its gap after that try still grows: on
                # a shared core a count can be fast now and then and ~10x slow otherwise)
                b.next_explore = b.calls + 1
            best = min(b.times, key=b.median)
            if best != b.best and b.median(best) < (1.0 - self.margin) * b.median(b.best):
                old, b.best = b.best, best
                self.changes += 1
                b.interval = self.explore_min  # a change of load: look again soon (a count that lost
                b.next_explore = b.calls + self._gap(b, old)  # by far, a little later: see _gap)

    def _gap(self, b: _Bucket, arm: int) -> int:
        """Calls before `arm`, which loses in bucket b, is tried again: a count that loses by r costs
        r - 1 calls' time each try, so the gap grows by r (a busy process on a shared core made 2
        threads ~12x slower than 1), up to explore_max, or as far as keeps its tries under TRY_SHARE
        of the time."""
        loss = min(max(b.median(arm) / max(b.median(b.best), 1e-12), 1.0), 64.0)
        most = max(self.explore_max, int((loss - 1.0) / TRY_SHARE))
        return min(int(b.interval * min(loss, 16.0)), most)

    def best(self, rows: int) -> int:
        """The count chosen now for `rows` rows (no exploration)."""
        with self._lock:
            return self._bucket(rows).best

    def current(self) -> int:
        """The count chosen for the bucket of the last timed call, not an exploring pick (torch's thread
        count before any call; never above it)."""
        n = max(self.max_threads(), 1)
        with self._lock:
            b = self._buckets.get(self._last_key) if self._last_key else None
            return min(b.best, n) if b is not None else n

    def settled(self, rows: int) -> int:
        """For a call over `rows` rows that is not timed: the count chosen for the nearest bucket whose
        every count has been measured within max_age (the one below it on a tie); where none has, the
        nearest that was once so measured (its choice stands until measured again); torch's count where
        none ever was."""
        n = max(self.max_threads(), 1)
        with self._lock:
            self._sync_arms()  # the candidates as torch's count stands now, old times aged out
            done = [k for k, b in self._buckets.items()
                    if all(self._measured(b, a) for a in b.times)] \
                or [k for k, b in self._buckets.items() if b.chosen]
            if not done:
                return n
            key = bucket(rows)
            near = min(done, key=lambda k: (abs(k.bit_length() - key.bit_length()), k))
            return min(self._buckets[near].best, n)

    def forget_times(self) -> None:
        """Every time so far stops counting; each bucket keeps its choice until its counts are measured
        again (the warm-up request's calls: cold, and timed while the machine may still be busy with
        what started beside it)."""
        with self._lock:
            for b in self._buckets.values():
                b.expire(float("inf"))

    def timed(self, rows: int, run: Callable[[int], T], clock: Callable[[], float] = time.perf_counter) -> T:
        """run(threads) under the picked count, timed and recorded; returns run's result."""
        threads = self.pick(rows)
        t0 = clock()
        with scoped(threads):
            rc = run(threads)
        self.record(rows, threads, clock() - t0)
        return rc


_choice = ThreadChoice()
# The output layer's own: its cost by thread count is not the stack's (a 1B model's Q6_K output layer,
# 128256 x 2048, at one row: 6.5 ms on 2 threads, 10.8 on 1; the layer stack, bound by memory, lost
# little on 1), so a decode bucket whose stack settled on 1 thread ran its output layer on 1 too, and
# `augury bench --workload scale` saw 31-44 tok/s between processes of the same 1B file (2026-12-05,
# AVX-512 EPYC, 2 threads)
_output = ThreadChoice()


def choice() -> ThreadChoice:
    """The process's thread choice for the fused stack (and the kernels that follow it untimed)."""
    return _choice


def output_choice() -> ThreadChoice:
    """The process's thread choice for the output layer's calls (models/quant.py, models/native_embed.py)."""
    return _output


def timed_output(rows: int, call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """call() (an output layer's kernel, which runs current() threads) under the output layer's own
    measured choice for `rows` rows."""
    return _output.timed(rows, lambda threads: call())


_scope = threading.local()


@contextmanager
def scoped(threads: int):
    """Inside the block, on this thread, augury's kernels run `threads` threads (`current()`)."""
    before = getattr(_scope, "threads", None)
    _scope.threads = threads
    try:
        yield
    finally:
        _scope.threads = before


def forget_times() -> None:
    """The process's choices forget their times (ThreadChoice.forget_times): builder.run_warmup's end."""
    _choice.forget_times()
    _output.forget_times()


def trials() -> int:
    """How many timed calls so far ran a thread count other than their bucket's chosen one (measuring
    or exploring it). A step timed for another purpose (the adaptive speculation policy's) during
    which this grew also timed that try, which on a shared core can cost several times the step.
    (Calls of the chosen count while the others are still measured are not counted: a drafting probe
    whose steps were all such calls, in the new 1024-row bucket of a batch of 48, could not be timed,
    so it ran its whole length at ~14 plain steps a step; a chosen count found to lose is a change,
    see changes().)"""
    return _choice.trials + _output.trials


def changes() -> int:
    """How many times a bucket's chosen count has changed: every step timed before a change ran at
    another speed (the adaptive speculation policy measures its arms afresh)."""
    return _choice.changes + _output.changes


def current() -> int:
    """The thread count an augury kernel call runs with now (see the module's docstring)."""
    n = getattr(_scope, "threads", None)
    return n if n else _choice.current()


def settled(rows: int) -> int:
    return _choice.settled(rows)
