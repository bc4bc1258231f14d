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
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque

import torch

from augury.engine.timing import time_call
from augury.speculative.interface import CostSample, Proposer, TargetHost
from augury.speculative.policy import TreeShape

log = logging.getLogger("augury.speculative")

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 4.0  # prior per-depth acceptance and its pseudo-count
EMA = 0.05  # weight of each new observation in the running statistics
MARGIN = 1.08  # speculation must promise this much more goodput than plain decoding (noise guard)
EXPLORE_EVERY = 16  # while speculating, every so many steps draft the depth measured longest ago
TIME_EMA = 0.2  # weight of a new measurement in the model's correction factor
RECENT = 9  # step times kept per (batch bucket, depth); their median is the estimate
MIN_SEEN = 5  # measured steps of one (batch bucket, depth) before their median replaces the model
REVISIT_EVERY = 256  # while off, every so many steps draft the cheapest draft (it may pay again)


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

    # ------------------------------------------------------------------ decisions
    def choose(self, batch_size: int) -> TreeShape | None:
        if self.threshold is not None and batch_size > self.threshold:
            return None
        self.steps += 1
        depth = self.best_depth(batch_size)
        if depth and self.steps % EXPLORE_EVERY == 0:
            # refresh the depth whose time and acceptance were measured longest ago, so an early
            # noisy measurement cannot keep a depth out of use for good
            bucket = _bucket(batch_size)
            depth = min(self.depths(), key=lambda d: self.last_seen.get((bucket, d), -1))
        elif not depth and self.steps % REVISIT_EVERY == 0:
            cheapest = self.depths()[0]
            if self.goodput(batch_size, cheapest) > 0.5 * self.goodput(batch_size, 0):
                depth = cheapest  # a cheap look at whether drafting pays again
        self.choices[depth] = self.choices.get(depth, 0) + 1
        return self.shape_for(depth) if depth else None

    def observe(self, batch_size: int, shape: TreeShape | None, seconds: float, accepted: list[int],
                timed: bool = True, offered: list[int] | None = None) -> None:
        depth = shape.num_steps if shape else 0
        if shape is not None:
            # conditional per-depth acceptance: offered at depth i when depth i-1 was accepted (and
            # the request's tree reached depth i: its own draft budget may have cut it shorter)
            for j, a in enumerate(accepted):
                reach = shape.num_steps if offered is None else min(offered[j], shape.num_steps)
                for i in range(min(a + 1, reach)):
                    self.off[i] = (1 - EMA) * self.off[i] + EMA * PRIOR_WEIGHT
                    self.acc[i] = (1 - EMA) * self.acc[i] + EMA * PRIOR_WEIGHT * (1.0 if i < a else 0.0)
        if not timed:
            return
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
