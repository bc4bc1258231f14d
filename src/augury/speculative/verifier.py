"""Lossless verification of draft trees: greedy, sampling, and mixed batches.

The walk goes one tree level at a time for the whole batch: each level is one batched torch
call on just the rows being visited (argmax, or filters + softmax), at most depth + 1 levels;
the per-request decisions run on small Python lists. Touching only visited rows matters on
CPUs, where even an argmax over all B*N*V logits costs more than the walk itself. A sampling
request reads one uniform per output position from its own stream (Request.uniforms), so its
tokens depend neither on what shares the batch nor on the tree. Padding nodes (past a row's
DraftTree.sizes) are never offered as children.

A request with a LogitsShaper (penalties, logit bias, bad words, a grammar) has each visited
node's row shaped at that node's state: the walk pushes every accepted draft onto the shaper
(its matcher accepts it, its penalty counts grow) and pops them all at the end, so a node sees
the committed output plus the drafts on its path, exactly as a decode step at that position
would, and the bonus token is drawn under the same shaping.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

import torch

from augury.sampling import LogitsShaper, argmax_ids, draw_rows, draw_sampled, greedy_ids
from augury.speculative.tree import DraftTree


@dataclass
class VerifyResult:
    accepted_nodes: list[list[int]]  # per request: node path from the root, starting with 0
    bonus_tokens: list[int]          # per request: token the target emits after the last accepted node

    @property
    def num_accepted(self) -> list[int]:
        """Accepted draft tokens per request (the root does not count)."""
        return [len(path) - 1 for path in self.accepted_nodes]

    def committed_tokens(self, tree: DraftTree) -> list[list[int]]:
        """Per request, the tokens committed this step: accepted drafts, then the bonus."""
        toks = tree.tokens.tolist()
        return [[toks[b][i] for i in path[1:]] + [self.bonus_tokens[b]] for b, path in enumerate(self.accepted_nodes)]


def _children(parents: list[list[int]], sizes: list[int]) -> list[list[list[int]]]:
    """Per request, per node, its children in index order (= descending draft score); only the
    row's first sizes[b] nodes count (the rest are padding, never offered)."""
    out = []
    for row, size in zip(parents, sizes):
        kids: list[list[int]] = [[] for _ in row]
        for i in range(1, size):
            kids[row[i]].append(i)
        out.append(kids)
    return out


NodeValues = Union[torch.Tensor, Callable[[list[int], list[int]], torch.Tensor]]
"""The target's outputs per node: a [B, N, V] tensor, or a function (requests, nodes) -> [A, V]
returning only the rows asked for (so an engine may run its lm_head on visited nodes only)."""

# One level of the walk: (requests, their children's tokens, target rows [A, V] at their current
# nodes) -> (accepted child position or -1 per request, bonus token where -1).
_Step = Callable[[list[int], list[list[int]], torch.Tensor], tuple[list[int], list[int]]]


def _rows_at(values: NodeValues) -> Callable[[list[int], list[int]], torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return lambda bs, ns: values[bs, ns]  # [A, V]
    return values


def _shaped(at: Callable[[list[int], list[int]], torch.Tensor],
            shapers: Sequence[LogitsShaper | None]) -> Callable[[list[int], list[int]], torch.Tensor]:
    """`at`, with each row of a request that has a shaper shaped at the request's current state."""
    def rows(bs: list[int], ns: list[int]) -> torch.Tensor:
        out = at(bs, ns)
        which = [a for a, b in enumerate(bs) if shapers[b] is not None]
        if which:
            out = out.to(torch.float32, copy=True)  # never shape the caller's logits (logprobs read them raw)
            for a in which:
                shapers[bs[a]].apply(out[a])
        return out
    return rows


def _walk(tree: DraftTree, rows: list[int], at: Callable[[list[int], list[int]], torch.Tensor],
          step: _Step, shapers: Sequence[LogitsShaper | None] | None = None) -> dict[int, tuple[list[int], int]]:
    """Walk the trees of `rows` from their roots one level at a time, fetching target rows only
    for the nodes being visited; returns {row: (accepted node path, bonus token)}. Each accepted
    draft is pushed onto its request's shaper, if any (the caller pops them)."""
    tokens, kids = tree.tokens.tolist(), _children(tree.parents.tolist(), tree.row_sizes())
    path = {b: [0] for b in rows}
    out: dict[int, tuple[list[int], int]] = {}
    active = list(rows)
    while active:
        cur = [path[b][-1] for b in active]
        kid_nodes = [kids[b][c] for b, c in zip(active, cur)]
        kid_toks = [[tokens[b][i] for i in kn] for b, kn in zip(active, kid_nodes)]
        moves, bonus = step(active, kid_toks, at(active, cur))
        nxt = []
        for a, b in enumerate(active):
            if moves[a] >= 0:
                path[b].append(kid_nodes[a][moves[a]])
                nxt.append(b)
                if shapers is not None and shapers[b] is not None:
                    shapers[b].push(kid_toks[a][moves[a]])
            else:
                out[b] = (path[b], bonus[a])
        active = nxt
    return out


def _result(res: dict[int, tuple[list[int], int]], batch: int) -> VerifyResult:
    return VerifyResult(accepted_nodes=[res[b][0] for b in range(batch)], bonus_tokens=[res[b][1] for b in range(batch)])


# ----------------------------------------------------------------------------------------- greedy

def _greedy_step(active: list[int], kid_toks: list[list[int]], logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Accept the first child whose token is the target's argmax; else the argmax is the bonus."""
    want = argmax_ids(logits)  # [A]
    return _match(kid_toks, want), want


def _known_step(active: list[int], kid_toks: list[list[int]], want: list[int]) -> tuple[list[int], list[int]]:
    """A greedy level whose tokens are known already (`want`, per visited node): follow them."""
    return _match(kid_toks, want), want


def _greedy_known(at: Callable[[list[int], list[int]], torch.Tensor],
                  greedy_at: Callable[[list[int], list[int]], list[int | None]] | None,
                  shapers: Sequence[LogitsShaper | None]) -> Callable[[list[int], list[int]], list[int]]:
    """(requests, nodes) -> each visited node's greedy token: greedy_at's where it tells it (None: no
    node's), else its shaper's greedy (the raw argmax without one) over the row `at` gives."""
    def wants(bs: list[int], ns: list[int]) -> list[int]:
        out = greedy_at(bs, ns) if greedy_at is not None else [None] * len(bs)
        rest = [a for a, t in enumerate(out) if t is None]
        if rest:
            rows = at([bs[a] for a in rest], [ns[a] for a in rest])
            for a, t in zip(rest, greedy_ids(rows, [shapers[bs[a]] for a in rest])):
                out[a] = t
        return out
    return wants


# --------------------------------------------------------------------------------------- sampling

def _uniform_at(uniforms: Sequence[Sequence[float]], row: int, level: int) -> float:
    """The uniform of request `row`'s output position `level` past the step's first."""
    return uniforms[row][level]


def _match(kid_toks: list[list[int]], drawn: list[int]) -> list[int]:
    """Per visited node, the position of the child carrying the drawn token, or -1."""
    return [kt.index(t) if t in kt else -1 for kt, t in zip(kid_toks, drawn)]


def _sampling_step(uniforms: Sequence[Sequence[float]],
                   draw: Callable[[list[int], torch.Tensor, list[float]], list[int]] | None = None) -> _Step:
    """Sample, then match: at a visited node of depth d, the target's token for that position is
    drawn from the node's distribution at the request's uniform for its d-th new position (by
    `draw(active, rows, uniforms)`, exactly as a plain decode step draws it: verify's draw_sampled of
    the rows' shaped logits; None: the rows are filtered probabilities, draw_rows); the child carrying
    that token is accepted, and where none does, the drawn token is the bonus. Every position's
    committed token is thus the target's own sample given the tokens before it, at a uniform used for
    that position alone: the output is distributed exactly as plain sampling, and with the same
    uniforms it is the same tokens, whatever the tree. (With deterministic drafts this accepts a
    child x with probability p(x), as the speculative-sampling rule min(1, p/q) with one-hot q and
    residual resampling does.)"""
    level = [0]

    def step(active: list[int], kid_toks: list[list[int]], rows: torch.Tensor) -> tuple[list[int], list[int]]:
        us = [_uniform_at(uniforms, b, level[0]) for b in active]
        drawn = draw(active, rows, us) if draw is not None else draw_rows(rows, us)
        level[0] += 1
        return _match(kid_toks, drawn), drawn

    return step


# ------------------------------------------------------------------------------------------- mixed

# nodes up to which a greedy walk over a tensor of every node's logits takes all their argmaxes at once
# (past a few dozen, the rows the walk never visits cost more than the calls saved)
ARGMAX_AT_ONCE = 32


def verify(tree: DraftTree, target_logits: NodeValues, temperatures: Sequence[float],
           top_ks: Sequence[int | None], top_ps: Sequence[float],
           uniforms: Sequence[Sequence[float] | None] | None = None,
           min_ps: Sequence[float] | None = None,
           shapers: Sequence[LogitsShaper | None] | None = None,
           greedy_at: Callable[[list[int], list[int]], list[int | None]] | None = None) -> VerifyResult:
    """target_logits [B, N, V] raw logits (or a row function). Rows with temperature 0 verify
    greedily, emitting the same tokens as plain greedy decoding with torch.argmax (first index on
    ties). The others verify by sampling from the filtered target, computed only at visited nodes:
    uniforms[b][d] is request b's uniform for its d-th new position (Request.uniforms: at least its
    tree's depth + 1 of them), and the emitted tokens are those plain sampling draws with the same
    uniforms. Greedy rows need none (uniforms, or its entry, may be None); a sampled row without
    them is a ValueError. min_ps: per request (None: 0). shapers: per request, a LogitsShaper or None
    (see the module's docstring); every row a shaper shapes is shaped before the argmax or the
    filters, and the shapers are back at their committed state when verify returns. greedy_at: (requests,
    nodes) -> per visited node of a greedy row, its greedy token where the caller tells it without the
    whole row (the token its shaper's greedy would take from it), else None (the row is fetched)."""
    b_all = tree.batch_size
    if not len(temperatures) == len(top_ks) == len(top_ps) == b_all:
        raise ValueError(f"verify: need one temperature, top_k and top_p per request ({b_all})")
    if shapers is not None and len(shapers) != b_all:
        raise ValueError(f"verify: need one shaper (or None) per request ({b_all})")
    if shapers is not None and all(s is None for s in shapers):
        shapers = None
    min_ps = list(min_ps) if min_ps is not None else [0.0] * b_all
    raw = at = _rows_at(target_logits)
    if shapers is not None:
        at = _shaped(at, shapers)
    greedy = [b for b in range(b_all) if temperatures[b] == 0]
    sampled = [b for b in range(b_all) if temperatures[b] != 0]
    try:
        if shapers is None and greedy and isinstance(target_logits, torch.Tensor) and \
                tree.batch_size * tree.num_nodes <= ARGMAX_AT_ONCE:
            # every node's logits are here, and few: every node's argmax in one call (~4 us a row), then
            # the walk in Python, instead of an index and an argmax per level (each torch call right
            # after a forward costs several times its warm time); the same tokens
            best = argmax_ids(target_logits)  # [B][N]
            res = _walk(tree, greedy, lambda bs, ns: [best[b][n] for b, n in zip(bs, ns)], _known_step)
        elif shapers is None:
            res = _walk(tree, greedy, raw, _greedy_step) if greedy else {}
        else:
            res = _walk(tree, greedy, _greedy_known(raw, greedy_at, shapers), _known_step, shapers) if greedy else {}
        if sampled:
            def draw(bs: list[int], rows: torch.Tensor, us: list[float]) -> list[int]:  # rows [A, V] shaped logits
                return draw_sampled(rows, [temperatures[b] for b in bs], [top_ks[b] for b in bs],
                                    [top_ps[b] for b in bs], [min_ps[b] for b in bs], us)
            per_row = list(uniforms) if uniforms is not None else [None] * b_all
            missing = [b for b in sampled if per_row[b] is None]
            if missing:
                raise ValueError(f"verify: sampled rows {missing} need their uniforms (Request.uniforms)")
            res.update(_walk(tree, sampled, at, _sampling_step(per_row, draw), shapers))
    finally:
        for s in shapers or ():
            if s is not None:
                s.pop_all()
    return _result(res, b_all)
