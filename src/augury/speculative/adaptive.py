"""Goodput-optimal speculation: per step, draft the amount that maximises tokens per second.

For a batch of B requests the policy compares plain decoding (B tokens per target step)
with drafting depth s = 1..S (B * (1 + E[accepted | s]) tokens per draft + verify step):

    goodput(s) = B * (1 + E_s) / (T_draft(B, s) + T_verify(B, N_s)),   goodput(0) = B / T_target(B, 1)

E_s = sum_{i<=s} P(accepted length >= i), from running per-depth acceptance statistics
(a head's measured acceptance as prior, when its config records one). Step times come
from a cost model T(B, n) = a + b*B + c*B*n fitted to target forwards profiled at start-up
and a draft model fitted the same way, scaled online by how far off they have been, and
replaced by the median of the last few measured steps once a (batch size, depth) has been
seen a few times; steps that also caught the head up on a backlog are not timed. Every few
steps the depth measured longest ago is drafted instead of the best one, so no depth is
judged for good on an old, noisy measurement. A chain may be cut to any depth; a tree is
drafted whole or not at all (see depths).
The disable threshold, when set, caps it: above it the answer is always 0.

Per request (`plan`): requests in one batch accept differently (a copy of the prompt accepts long
drafts, free text at temperature 1 few), so each request r keeps its own per-depth acceptance,
decayed counts over a prior of OWN_PRIOR observations at the batch-level rates (a new request
starts from the batch's estimate and moves to its own within a few steps), giving E_r(n) for n
draft nodes. The step's time is the plain step's plus the measured extra of drafting the shape of
depth D, in the share the cost model gives the rows that draft:

    T(D, n) = t_0 + (t_D - t_0) * (F_D + sum_{r: n_r > 0} (R_D + c * n_r)) / (F_D + B * (R_D + c * N_D))

(F_D: the draft forwards' fixed cost, R_D: a drafting row's draft and catch-up cost, c: the
target's cost per verified token, N_D: the shape's draft nodes; all-B-full gives t_D, none t_0),
and the step's goodput is

    G(D, n) = (B + sum_r E_r(n_r)) / T(D, n),

maximised over each request's n_r (0; for a chain any depth up to D, for a tree all of it; never
above its max_draft_tokens) by Dinkelbach's iteration: for the current goodput L, each request
takes the n_r maximising E_r(n_r) - L * dT/dn_r on its own (verification is linear in the total
node count, so the problem splits per request), which raises G until no request's choice
changes it. A request whose acceptance cannot pay for its nodes gets 0 (a root-only row, a plain
decode step) while the others draft. With one acceptance for all it reduces to the batch-level
rule: G is then monotonic in the number of drafting rows, so all draft or none. A request that
does not draft drifts back to the batch's rates (IDLE_KEEP per step while others draft, PLAIN_KEEP
per step while nobody does: at batch 1 a request whose last few drafts failed would otherwise
never draft again) and is tried again now and then. A mixed step's time, scaled up to the whole
shape by the same share, feeds the measurements.
"""
from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence

import torch

from augury.core.request import Request
from augury.core.timing import time_call
from augury.speculative.interface import CostSample, Proposer, TargetHost
from augury.speculative.policy import StepPlan, TreeShape, user_caps

log = logging.getLogger("augury.speculative")

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 4.0  # prior per-depth acceptance and its pseudo-count
EMA = 0.05  # weight of each new observation in the running statistics
MARGIN = 1.08  # speculation must promise this much more goodput than plain decoding (noise guard)
EXPLORE_EVERY = 16  # while speculating, every so many steps draft the depth measured longest ago
TIME_EMA = 0.2  # weight of a new measurement in the model's correction factor
RECENT = 9  # step times kept per (batch bucket, depth); their median is the estimate
MIN_SEEN = 5  # measured steps of one (batch bucket, depth) before their median replaces the model
REVISIT_EVERY = 256  # while off, every so many steps draft the cheapest draft (it may pay again)
OWN_PRIOR = 1.0  # a request's own acceptance starts as this many observations at the batch-level rates
OWN_KEEP = 0.9  # weight a request's own counts keep at each of its observations (its last ~10 steps)
IDLE_KEEP = 0.99  # ... at each step it does not draft while others do: it drifts back to the batch's rates
PLAIN_KEEP = 0.9  # ... at each step where nobody drafts (half-life ~7 steps)
MIN_SHARE = 0.25  # a step that drafted for less than this share of the shape's cost is not timed (too noisy to scale up)
DINKELBACH_ROUNDS = 20  # the iteration converges in a handful; a bound all the same


class LinearCost:
    """T(B, n) = a + b*B + c*B*n seconds, least-squares fitted, coefficients kept >= 0."""

    def __init__(self, a: float = 0.0, b: float = 0.0, c: float = 0.0) -> None:
        self.a, self.b, self.c = a, b, c

    def __call__(self, batch: int, n: int) -> float:
        return self.a + self.b * batch + self.c * batch * n

    @staticmethod
    def fit(samples: list[tuple[int, int, float]]) -> "LinearCost":
        """Least squares over (batch, tokens per request, seconds) samples. Samples at a single
        batch size cannot tell a from b (their columns coincide), so b is then left out
        rather than handed to a rank-deficient solve."""
        one_batch = len({b for b, _, _ in samples}) == 1
        rows = [[1.0, b * n] if one_batch else [1.0, b, b * n] for b, n, _ in samples]
        x = torch.tensor(rows, dtype=torch.float64)
        y = torch.tensor([t for _, _, t in samples], dtype=torch.float64)
        coef = torch.linalg.lstsq(x, y[:, None], driver="gelsd").solution[:, 0].clamp(min=0).tolist()
        if one_batch:
            coef.insert(1, 0.0)
        return LinearCost(*coef)


class _Own:
    """One request's own running acceptance: per depth, decayed counts of offered and accepted drafts."""

    __slots__ = ("acc", "off")

    def __init__(self, depths: int) -> None:
        self.acc = [0.0] * depths
        self.off = [0.0] * depths

    def decay(self, keep: float) -> None:
        self.acc = [a * keep for a in self.acc]
        self.off = [o * keep for o in self.off]


class AdaptivePolicy:
    def __init__(self, shape: TreeShape, disable_batch_threshold: int | None,
                 target_cost: LinearCost | None = None, draft_cost: LinearCost | None = None,
                 prior: list[float] | None = None) -> None:
        """prior: P(accepted length >= i), i = 1.., as measured for this head (e.g. at training
        time); without one every depth starts at PRIOR_RATE."""
        self.max_shape = shape
        self.threshold = disable_batch_threshold
        rates = [PRIOR_RATE] * shape.num_steps
        for i, p in enumerate((prior or [])[: shape.num_steps]):
            prev = prior[i - 1] if i else 1.0
            rates[i] = min(max(p / prev if prev > 0 else 0.0, 0.02), 0.98)
        # conditional acceptance at depth i given depth i-1 accepted, as (weighted) counts
        self.acc = [r * PRIOR_WEIGHT for r in rates]
        self.off = [PRIOR_WEIGHT] * shape.num_steps
        self.target_cost = target_cost or LinearCost(1.0, 0.0, 0.0)
        self.draft_cost = draft_cost or LinearCost(0.0, 0.0, 0.0)
        # (batch bucket, depth) -> the last RECENT step times: a median shrugs off the spikes of a shared machine
        self.measured: dict[tuple[int, int], deque[float]] = {}
        self.scale: dict[int, float] = {}  # batch bucket -> measured / modelled step time
        self.steps = 0
        self.choices: dict[int, int] = {}
        self.last_seen: dict[tuple[int, int], int] = {}  # (batch bucket, depth) -> step of its last measurement
        # per request, its own acceptance; an entry goes with its request (no pruning to forget)
        self.own: weakref.WeakKeyDictionary[Request, _Own] = weakref.WeakKeyDictionary()
        self.rows_planned = 0  # rows of speculative steps the per-request rule decided ...
        self.rows_drafted = 0  # ... and those it let draft

    # ------------------------------------------------------------------ the model
    def shape_for(self, depth: int) -> TreeShape:
        """The configured tree cut to `depth` levels. A chain keeps one node per level; a tree
        keeps its full node budget as far as that depth has candidates (topk + (depth-1) topk^2),
        so a shallower tree loses only its deepest nodes, the least likely ones, and the
        per-depth acceptance measured under one depth holds for the others."""
        m = self.max_shape
        if depth >= m.num_steps:
            return m
        if m.topk == 1:
            return TreeShape(depth, 1, depth + 1)
        candidates = m.topk + (depth - 1) * m.topk * m.topk
        return TreeShape(depth, m.topk, min(m.num_draft_tokens, 1 + candidates))

    def expected_accepted(self, depth: int) -> float:
        e, p = 0.0, 1.0
        for i in range(depth):
            p *= self.acc[i] / self.off[i]
            e += p
        return e

    def model_time(self, batch: int, depth: int) -> float:
        """Seconds per step from the fitted cost models alone."""
        if depth == 0:
            return self.target_cost(batch, 1)
        shape = self.shape_for(depth)
        catch_up = self.draft_cost(batch, 1 + round(self.expected_accepted(depth)))
        return self.target_cost(batch, shape.num_draft_tokens) + catch_up + (depth - 1) * self.draft_cost(batch, shape.topk)

    def step_times(self, batch: int) -> list[float]:
        """Predicted seconds per step at depth 0..S for this batch size: the measured average
        where enough steps were seen, else the model scaled by how far off it has been here;
        never less than a shallower depth's (more drafting cannot be cheaper)."""
        bucket = _bucket(batch)
        scale = self.scale.get(bucket, 1.0)
        times: list[float] = []
        for d in range(self.max_shape.num_steps + 1):
            seen = self.measured.get((bucket, d))
            t = statistics.median(seen) if seen and len(seen) >= MIN_SEEN else self.model_time(batch, d) * scale
            times.append(max(t, times[-1]) if times else t)
        return times

    def step_time(self, batch: int, depth: int) -> float:
        return self.step_times(batch)[depth]

    def goodput(self, batch: int, depth: int, times: list[float] | None = None) -> float:
        t = (times or self.step_times(batch))[depth]
        return batch * (1.0 + self.expected_accepted(depth)) / max(t, 1e-9)

    def depths(self) -> list[int]:
        """Depths the policy chooses between (besides 0). A chain: every depth. A tree: its full
        depth only; cutting a tree saves a draft forward or two but its node budget stays (see
        shape_for), and on a shared CPU the step times that would tell depths apart are noisier
        than the difference, while drafting or not is a clear call."""
        s = self.max_shape.num_steps
        return list(range(1, s + 1)) if self.max_shape.topk == 1 else [s]

    def best_depth(self, batch: int) -> int:
        times = self.step_times(batch)
        best, best_g = 0, self.goodput(batch, 0, times) * MARGIN
        for d in self.depths():
            g = self.goodput(batch, d, times)
            if g > best_g:
                best, best_g = d, g
        return best

    # ------------------------------------------------------------------ per request
    def request_rates(self, req: Request) -> list[float]:
        """Request req's conditional acceptance per depth: its own counts over a prior of OWN_PRIOR
        observations at the batch-level rates (exactly those before it has drafted)."""
        rates = [a / o for a, o in zip(self.acc, self.off)]
        own = self.own.get(req)
        if own is None:
            return rates
        return [(a + OWN_PRIOR * g) / (o + OWN_PRIOR) for a, o, g in zip(own.acc, own.off, rates)]

    def request_expected(self, req: Request) -> list[float]:
        """E_r(d), d = 0..S: request req's expected accepted drafts when offered d levels."""
        out, e, p = [0.0], 0.0, 1.0
        for r in self.request_rates(req):
            p *= r
            e += p
            out.append(e)
        return out

    def draft_costs(self, depth: int) -> tuple[float, float, float]:
        """The cost model's extra seconds of drafting at `depth` over a plain step, as (fixed, per
        drafting row, per verified draft node): B rows drafting the whole shape cost
        fixed + B * (per_row + per_node * num_drafts), exactly model_time(B, depth) - model_time(B, 0).
        A model that prices drafting at nothing (uncalibrated) counts one unit for the whole step."""
        d, shape = self.draft_cost, self.shape_for(depth)
        fixed = d.a * depth
        per_row = d.b * depth + d.c * (1 + round(self.expected_accepted(depth)) + (depth - 1) * shape.topk)
        per_node = self.target_cost.c
        if fixed + per_row + per_node * shape.num_drafts <= 0:
            return 1.0, 0.0, 0.0
        return fixed, per_row, per_node

    def drafting_share(self, batch: int, depth: int, nodes: Sequence[int]) -> float:
        """The share of drafting the whole shape at `depth` for all `batch` rows that rows drafting
        `nodes` draft nodes each (rows with 0 left out) cost, under the cost model."""
        fixed, per_row, per_node = self.draft_costs(depth)
        full = fixed + batch * (per_row + per_node * self.shape_for(depth).num_drafts)
        drafting = [n for n in nodes if n > 0]
        if not drafting:
            return 0.0
        return (fixed + sum(per_row + per_node * n for n in drafting)) / full

    def _allocate(self, batch: int, depth: int, times: list[float], options: list[list[tuple[int, float]]]
                  ) -> tuple[float, dict[int, tuple[int, float]]]:
        """The goodput-maximising choice at `depth`: per row one of its options (draft nodes, expected
        accepted) or nothing. Dinkelbach's iteration on G = (B + sum E) / (t_0 + s * (F + sum cost)):
        for the current goodput L, each row takes the option with the largest E - L * s * cost (if
        positive), all drafting rows together paying F; that allocation's goodput exceeds L unless L
        is already the best, so a few rounds reach it. Returns (goodput, {row: option})."""
        t0, td = times[0], times[depth]
        fixed, per_row, per_node = self.draft_costs(depth)
        full = fixed + batch * (per_row + per_node * self.shape_for(depth).num_drafts)
        s = max(td - t0, 0.0) / full  # measured seconds per model second
        best_g, best = batch / max(t0, 1e-9), {}
        for _ in range(DINKELBACH_ROUNDS):
            mu = best_g * s
            pick, value = {}, 0.0
            for row, opts in enumerate(options):
                top, choice = 0.0, None
                for n, e in opts:
                    v = e - mu * (per_row + per_node * n)
                    if v > top:
                        top, choice = v, (n, e)
                if choice is not None:
                    pick[row] = choice
                    value += top
            if not pick or value <= mu * fixed:
                break
            cost = fixed + sum(per_row + per_node * n for n, _ in pick.values())
            g = (batch + sum(e for _, e in pick.values())) / max(t0 + s * cost, 1e-9)
            if g <= best_g * (1 + 1e-12):
                break
            best_g, best = g, pick
        return best_g, best

    def goodput_of(self, batch: int, depth: int, times: list[float], pick: dict[int, tuple[int, float]]) -> float:
        """G(D, n) of an allocation {row: (draft nodes, expected accepted)} at `depth`."""
        if not pick or not depth:
            return batch / max(times[0], 1e-9)
        share = self.drafting_share(batch, depth, [n for n, _ in pick.values()])
        t = times[0] + (times[depth] - times[0]) * share
        return (batch + sum(e for _, e in pick.values())) / max(t, 1e-9)

    def _options(self, depth: int, caps: Sequence[int | None], expected: list[list[float]],
                 whole: bool) -> list[list[tuple[int, float]]]:
        """Per row, what it may draft at `depth`, as (draft nodes, expected accepted): a chain any
        length up to the shape's, a tree all of it (its expected acceptance taken at the depth its
        node count can reach); never more nodes than the row's own cap. whole: the longest only."""
        nodes = self.shape_for(depth).num_drafts
        chain = self.max_shape.topk == 1
        out = []
        for cap, e in zip(caps, expected):
            most = nodes if cap is None else min(cap, nodes)
            if most <= 0:
                out.append([])
            elif chain and not whole:
                out.append([(n, e[min(n, depth)]) for n in range(1, most + 1)])
            else:
                out.append([(most, e[min(most, depth)])])
        return out

    def plan(self, reqs: Sequence[Request]) -> StepPlan:
        """This step's shape and each request's draft budget: the allocation with the best goodput
        G(D, n) over the depths D the policy chooses between (for a chain, both with every request at
        the whole depth or nothing and with each at its own depth; a shallower D replaces D when no
        request drafts that deep), if it beats plain decoding by MARGIN; otherwise nothing drafts.
        Exploration as in `choose`, for the requests that draft (all, on a revisit)."""
        b = len(reqs)
        caps = user_caps(reqs)
        if (self.threshold is not None and b > self.threshold) or not any(c != 0 for c in caps):
            return StepPlan(None, tuple(0 for _ in reqs))
        self.steps += 1
        times = self.step_times(b)
        expected = [self.request_expected(r) for r in reqs]
        plain = b / max(times[0], 1e-9)
        best_d, best_g, best = 0, plain * MARGIN, {}
        for d in self.depths():
            for whole in ((True, False) if self.max_shape.topk == 1 else (True,)):
                _, pick = self._allocate(b, d, times, self._options(d, caps, expected, whole))
                if not pick:
                    continue
                deff = d if self.max_shape.topk != 1 else max(n for n, _ in pick.values())
                g = self.goodput_of(b, deff, times, pick)
                if g > best_g:
                    best_d, best_g, best = deff, g, pick
        depth, explored = self._explore(b, best_d, lambda d: self.goodput(b, d, times) > 0.5 * plain)
        if explored:  # with the requests that draft now; on a revisit, every request that may draft
            opts = self._options(depth, caps, expected, whole=True)
            best = {row: opts[row][0] for row in (best if best_d else range(b)) if opts[row]}
            best_d = depth
        self.choices[best_d] = self.choices.get(best_d, 0) + 1
        if not best_d or not best:
            # nobody learns in a plain step; a request's own record fades towards the batch-level
            # rates (PLAIN_KEEP), so a few unlucky steps do not keep it from drafting for the rest of
            # its answer (at batch 1 no other request drafts, and nothing else would bring it back)
            for r in reqs:
                own = self.own.get(r)
                if own is not None:
                    own.decay(PLAIN_KEEP)
            return StepPlan(None, tuple(0 for _ in reqs))
        self._idle(reqs, best)
        self.rows_planned += b
        self.rows_drafted += len(best)
        nodes = self.shape_for(best_d).num_drafts
        out = tuple(0 if row not in best else (cap if best[row][0] >= nodes else best[row][0])
                    for row, cap in enumerate(caps))
        return StepPlan(self.shape_for(best_d), out)

    def _explore(self, batch: int, depth: int, look_pays: Callable[[int], bool]) -> tuple[int, bool]:
        """(depth to run, whether it is an exploration step), the one exploration rule of `plan` and
        `choose`: every EXPLORE_EVERY steps while drafting, the depth measured longest ago (so an early
        noisy measurement cannot keep a depth out of use for good); every REVISIT_EVERY steps while
        not drafting, the cheapest depth, where `look_pays(depth)` says a look is worth it."""
        if depth and self.steps % EXPLORE_EVERY == 0:
            bucket = _bucket(batch)
            return min(self.depths(), key=lambda d: self.last_seen.get((bucket, d), -1)), True
        if not depth and self.steps % REVISIT_EVERY == 0 and look_pays(self.depths()[0]):
            return self.depths()[0], True
        return depth, False

    def _idle(self, reqs: Sequence[Request], drafting: dict[int, tuple[int, float]]) -> None:
        """Requests that do not draft while others do drift back towards the batch-level rates."""
        for row, r in enumerate(reqs):
            own = self.own.get(r) if row not in drafting else None
            if own is not None:
                own.decay(IDLE_KEEP)

    # ------------------------------------------------------------------ decisions
    def choose(self, batch_size: int) -> TreeShape | None:
        if self.threshold is not None and batch_size > self.threshold:
            return None
        self.steps += 1
        plain = self.goodput(batch_size, 0)
        depth, _ = self._explore(batch_size, self.best_depth(batch_size),
                                 lambda d: self.goodput(batch_size, d) > 0.5 * plain)
        self.choices[depth] = self.choices.get(depth, 0) + 1
        return self.shape_for(depth) if depth else None

    def observe(self, batch_size: int, shape: TreeShape | None, seconds: float, accepted: list[int],
                timed: bool = True, offered: list[int] | None = None, reqs: Sequence[Request] | None = None,
                sizes: list[int] | None = None) -> None:
        depth = shape.num_steps if shape else 0
        if shape is not None:
            # conditional per-depth acceptance: offered at depth i when depth i-1 was accepted (and
            # the request's tree reached depth i: its own draft budget may have cut it shorter)
            for j, a in enumerate(accepted):
                reach = shape.num_steps if offered is None else min(offered[j], shape.num_steps)
                own = None
                if reqs is not None:
                    own = self.own.get(reqs[j])
                    if own is None:
                        own = self.own[reqs[j]] = _Own(self.max_shape.num_steps)
                for i in range(min(a + 1, reach)):
                    hit = 1.0 if i < a else 0.0
                    self.off[i] = (1 - EMA) * self.off[i] + EMA * PRIOR_WEIGHT
                    self.acc[i] = (1 - EMA) * self.acc[i] + EMA * PRIOR_WEIGHT * hit
                    if own is not None:
                        own.off[i] = OWN_KEEP * own.off[i] + 1.0
                        own.acc[i] = OWN_KEEP * own.acc[i] + hit
        if not timed:
            return
        if shape is not None and sizes is not None:
            # rows cut short or left out: scale the drafting part of the time up to the whole shape's
            nodes = [min(n - 1, shape.num_drafts) for n in sizes]
            share = self.drafting_share(batch_size, depth, nodes)
            if share < MIN_SHARE:
                return
            if share < 1.0:
                t0 = self.step_times(batch_size)[0]
                seconds = max(seconds, t0 + (seconds - t0) / share)
        bucket = _bucket(batch_size)
        self.last_seen[(bucket, depth)] = self.steps
        self.measured.setdefault((bucket, depth), deque(maxlen=RECENT)).append(seconds)
        ratio = min(max(seconds / max(self.model_time(batch_size, depth), 1e-9), 0.2), 5.0)
        self.scale[bucket] = (1 - TIME_EMA) * self.scale.get(bucket, ratio) + TIME_EMA * ratio

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        self.observe(batch_size, None, seconds, [])

    # ------------------------------------------------------------------ start-up
    def calibrate(self, host: TargetHost, proposer: Proposer, max_num_seqs: int) -> None:
        """Profile target and draft forwards on this device and fit the cost models."""
        t0 = time.perf_counter()
        nodes = self.max_shape.num_draft_tokens
        ctx = max(0, min(64, host.max_model_len - nodes))  # positions stay inside the model's context
        grid = _grid(max_num_seqs)
        self.target_cost = LinearCost.fit(profile_target(host, grid, nodes, ctx))
        draft = proposer.profile(host, grid, self.max_shape.topk, ctx)
        if draft:
            self.draft_cost = LinearCost.fit(draft)
        log.info("adaptive speculation calibrated in %.1fs: target %s, draft %s; depth by batch size %s",
                 time.perf_counter() - t0, vars(self.target_cost), vars(self.draft_cost),
                 {b: self.best_depth(b) for b in grid})


def _bucket(batch: int) -> int:
    return 1 << max(0, batch - 1).bit_length()


def _grid(max_num_seqs: int) -> list[int]:
    # a few batch sizes spanning the range suffice for a three-coefficient fit
    return sorted({b for b in (1, 4, 16, 64, max_num_seqs) if b <= max_num_seqs})


@torch.inference_mode()
def profile_target(host: TargetHost, batch_sizes: list[int], max_nodes: int, ctx: int = 64) -> list[CostSample]:
    """Target forwards of B requests x n new tokens over `ctx` cached ones, as the engine runs a
    verification (exact attention, the nodes as a chain), in free cache blocks."""
    samples = []
    for b in batch_sizes:
        for n in sorted({1, max_nodes}):
            run = host.scratch_forward(b, n, ctx)
            if run is None:  # not enough free blocks for this batch size
                return samples
            log.debug("profiling the target: batch %d x %d tokens", b, n)
            samples.append((b, n, time_call(run, host.device)))
    return samples
