"""Lossless verification of draft trees: greedy, sampling, and mixed batches.

The walk goes one tree level at a time for the whole batch: each level is one batched torch
call on just the rows being visited (argmax, or filters + softmax), at most depth + 1 levels;
the per-request decisions run on small Python lists. Touching only visited rows matters on
CPUs, where even an argmax over all B*N*V logits costs more than the walk itself. Each
sampling request draws exactly as many uniforms per step as its tree has real nodes, from its
own generator, whatever it accepts, so its randomness never depends on what else shares the
batch. Padding nodes (past a row's DraftTree.sizes) are never offered as children.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

import torch

from augury.sampling import apply_sampling_filters
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


def _walk(tree: DraftTree, rows: list[int], at: Callable[[list[int], list[int]], torch.Tensor],
          step: _Step) -> dict[int, tuple[list[int], int]]:
    """Walk the trees of `rows` from their roots one level at a time, fetching target rows only
    for the nodes being visited; returns {row: (accepted node path, bonus token)}."""
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
            else:
                out[b] = (path[b], bonus[a])
        active = nxt
    return out


def _result(res: dict[int, tuple[list[int], int]], batch: int) -> VerifyResult:
    return VerifyResult(accepted_nodes=[res[b][0] for b in range(batch)], bonus_tokens=[res[b][1] for b in range(batch)])


# ----------------------------------------------------------------------------------------- greedy

def _greedy_step(active: list[int], kid_toks: list[list[int]], logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Accept the first child whose token is the target's argmax; else the argmax is the bonus."""
    want = logits.argmax(dim=-1).tolist()  # [A]
    return [kt.index(w) if w in kt else -1 for kt, w in zip(kid_toks, want)], want


def verify_greedy(tree: DraftTree, target_logits: NodeValues) -> VerifyResult:
    """target_logits [B, N, V] (or a row function, see NodeValues). Emits the same tokens as plain
    greedy decoding with torch.argmax (first index on ties): use torch.argmax there too."""
    return _result(_walk(tree, list(range(tree.batch_size)), _rows_at(target_logits), _greedy_step), tree.batch_size)


# --------------------------------------------------------------------------------------- sampling

def _try_children(child_p: list[float], child_tokens: list[int], uniforms: list[float], total: float) -> tuple[int, list[int]]:
    """One node of the sampling walk. child_p[j] = p(x_j), the target probability of child j's token
    at this node; total = sum of p over the vocabulary (1 up to rounding); uniforms[j] ~ U[0, 1).

    Drafts are deterministic (one-hot q(x_j) = 1), so the speculative-sampling rule
    accept with min(1, p(x)/q(x)) becomes: accept x_1 with probability p(x_1). On rejection the
    residual is norm(max(p - q, 0)) = p with x_1 zeroed, renormalised; the next sibling is tried
    against that residual, i.e. accepted with p(x_j) / (mass left). Accepting at u * left < p(x_j)
    is exactly probability p(x_j) / left. Summing over outcomes, token x is emitted with
    probability p(x): every path either accepts x (when it is a child) or samples it from the
    final residual, which is p restricted to the non-children, renormalised.
    A token repeated among siblings was already zeroed, so its second try always rejects.
    Returns (accepted child position or -1, rejected tokens in order).
    """
    left = total
    rejected: list[int] = []
    for j, (p, tok) in enumerate(zip(child_p, child_tokens)):
        if tok in rejected:
            continue
        if p > 0.0 and uniforms[j] * left < p:  # P(accept) = p / left
            return j, rejected
        left -= p
        rejected.append(tok)
    return -1, rejected


def _sample_residual(rows: torch.Tensor, rejected: list[list[int]], uniforms: list[float]) -> list[int]:
    """rows [F, V] target probabilities; for each row, zero its rejected tokens, renormalise, and
    draw one token by inverse CDF with its uniform. Float64 CDF, so a 128k vocabulary loses
    nothing to rounding. A row whose residual mass rounds to zero falls back to the full row."""
    f, v = rows.shape
    res = rows.to(torch.float64, copy=True)
    r_idx = [i for i, toks in enumerate(rejected) for _ in toks]
    if r_idx:
        t_idx = [t for toks in rejected for t in toks]
        res[torch.tensor(r_idx, device=rows.device), torch.tensor(t_idx, device=rows.device)] = 0.0
        empty = res.sum(dim=1) <= 0.0
        if bool(empty.any()):
            res[empty] = rows[empty].to(torch.float64)
    cdf = res.cumsum(dim=1)                                             # [F, V]
    u = torch.tensor(uniforms, dtype=torch.float64, device=rows.device).view(f, 1)
    # first index whose CDF exceeds u * total: never a zero-probability token
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=v - 1)
    return picked.view(f).tolist()


def _draw_uniforms(rows: list[int], generators: Sequence[torch.Generator | None] | None, n: int) -> dict[int, list[float]]:
    """n float64 uniforms per row from its generator; rows without one share one global draw."""
    out: dict[int, list[float]] = {}
    shared = [b for b in rows if generators is None or generators[b] is None]
    if shared:
        for b, u in zip(shared, torch.rand(len(shared), n, dtype=torch.float64).tolist()):
            out[b] = u
    for b in rows:
        if b not in out:
            g = generators[b]  # type: ignore[index]
            out[b] = torch.rand(n, dtype=torch.float64, generator=g, device=g.device).tolist()
    return out


def _sampling_step(tree: DraftTree, rows: list[int], generators: Sequence[torch.Generator | None] | None) -> _Step:
    """Each request draws n uniforms up front, n its tree's real node count: slots 0..n-2 for
    child tries (a path tries at most n-1 children), slot n-1 for the bonus."""
    sizes = tree.row_sizes()
    uni: dict[int, list[float]] = {}
    for n in sorted({sizes[b] for b in rows}):
        uni.update(_draw_uniforms([b for b in rows if sizes[b] == n], generators, n))
    used = {b: 0 for b in rows}

    def step(active: list[int], kid_toks: list[list[int]], probs: torch.Tensor) -> tuple[list[int], list[int]]:
        totals = probs.sum(dim=1).tolist()                              # [A]
        width = max(len(kt) for kt in kid_toks)
        child_p: list[list[float]] = [[] for _ in active]
        if width:
            pad = [kt + [0] * (width - len(kt)) for kt in kid_toks]
            child_p = probs.gather(1, torch.tensor(pad, device=probs.device)).tolist()  # [A, width]
        moves, done, done_rej = [], [], []
        for a, b in enumerate(active):
            kt = kid_toks[a]
            j, rej = _try_children(child_p[a][: len(kt)], kt, uni[b][used[b]:], totals[a])
            used[b] += len(kt) if j < 0 else j + 1
            moves.append(j)
            if j < 0:
                done.append(a)
                done_rej.append(rej)
        bonus = [-1] * len(active)
        if done:
            toks = _sample_residual(probs[torch.tensor(done, device=probs.device)], done_rej,
                                    [uni[active[a]][-1] for a in done])
            for a, tok in zip(done, toks):
                bonus[a] = tok
        return moves, bonus

    return step


def verify_sampling(tree: DraftTree, target_probs: NodeValues,
                    generators: Sequence[torch.Generator | None] | None) -> VerifyResult:
    """target_probs [B, N, V] (or a row function): the target's distributions at every node after
    temperature, top-k, top-p. Lossless: emitted tokens are distributed exactly as sampling the
    target alone. generators: one per request (None = global RNG), or None for all global."""
    rows = list(range(tree.batch_size))
    return _result(_walk(tree, rows, _rows_at(target_probs), _sampling_step(tree, rows, generators)), tree.batch_size)


# ------------------------------------------------------------------------------------------- mixed

def verify(tree: DraftTree, target_logits: NodeValues, temperatures: Sequence[float],
           top_ks: Sequence[int | None], top_ps: Sequence[float],
           generators: Sequence[torch.Generator | None] | None) -> VerifyResult:
    """target_logits [B, N, V] raw logits (or a row function). Rows with temperature 0 verify
    greedily; the others by sampling from the filtered target, computed only at visited nodes."""
    b_all = tree.batch_size
    if not len(temperatures) == len(top_ks) == len(top_ps) == b_all:
        raise ValueError(f"verify: need one temperature, top_k and top_p per request ({b_all})")
    at = _rows_at(target_logits)
    greedy = [b for b in range(b_all) if temperatures[b] == 0]
    sampled = [b for b in range(b_all) if temperatures[b] != 0]
    res = _walk(tree, greedy, at, _greedy_step) if greedy else {}
    if sampled:
        def probs_at(bs: list[int], ns: list[int]) -> torch.Tensor:  # [A, V]
            return apply_sampling_filters(at(bs, ns), [temperatures[b] for b in bs],
                                          [top_ks[b] for b in bs], [top_ps[b] for b in bs])
        res.update(_walk(tree, sampled, probs_at, _sampling_step(tree, sampled, generators)))
    return _result(res, b_all)
