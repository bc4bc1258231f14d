"""Draft trees: pick the best EAGLE-2 candidates, number them, and build the tree attention mask.

A tree holds, per request, N nodes. Node 0 is the root: the last committed token, which
the target has not seen yet. Nodes 1..N-1 are draft tokens (target-vocabulary ids).
Every node's parent has a smaller index, so any loop over nodes in index order sees a
parent before its children; siblings appear in descending draft-score order, which the
sampling verifier relies on (it tries children in index order).

All maths here is batched torch: the only Python loops run O(log N) times
(pointer doubling), never once per node.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A batch of draft trees, all with the same node count N (rows are padded by the caller's
    choice of num_nodes, never here)."""

    tokens: torch.Tensor   # [B, N] int64; node 0 = root (last committed token)
    parents: torch.Tensor  # [B, N] int64; -1 for the root; parents[b, i] < i for i >= 1
    depth: torch.Tensor    # [B, N] int64; root 0

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.shape[1] < 1:
            raise ValueError(f"DraftTree.tokens must be [B, N>=1], got {tuple(self.tokens.shape)}")
        if self.parents.shape != self.tokens.shape or self.depth.shape != self.tokens.shape:
            raise ValueError(
                "DraftTree tokens, parents and depth must share one shape, got "
                f"{tuple(self.tokens.shape)}, {tuple(self.parents.shape)}, {tuple(self.depth.shape)}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])


def _self_rooted(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] parents with -1 replaced by the node's own index, so gathers never go out of range
    and pointer jumping saturates at the root."""
    idx = torch.arange(parents.shape[1], device=parents.device).expand_as(parents)
    return torch.where(parents < 0, idx, parents)


def _num_doublings(n: int) -> int:
    """Rounds of pointer doubling that cover any path of n nodes (distance up to n - 1)."""
    rounds, reach = 0, 1
    while reach < n - 1:
        reach *= 2
        rounds += 1
    return rounds


def depth_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (-1 for roots) -> depth [B, N], by list ranking (pointer doubling)."""
    anc = _self_rooted(parents)
    dist = (parents >= 0).long()  # distance from node to anc[node]
    for _ in range(_num_doublings(parents.shape[1]) + 1):
        dist = dist + dist.gather(1, anc)
        anc = anc.gather(1, anc)
    return dist


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] -> mask [B, N, N] bool, [b, i, j] True when j is i or an ancestor of i.

    Pointer doubling: after round s, row i holds i's ancestors up to distance 2^s; OR-ing in the
    row of i's 2^s-th ancestor doubles the reach.
    """
    b, n = parents.shape
    anc = _self_rooted(parents)
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    mask = eye | torch.nn.functional.one_hot(anc, n).bool()
    for _ in range(_num_doublings(n)):
        mask = mask | mask.gather(1, anc.unsqueeze(-1).expand(b, n, n))
        anc = anc.gather(1, anc)
    return mask


def chain_tree(root_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> DraftTree:
    """root_tokens [B], draft_tokens [B, K] -> a chain root -> d0 -> d1 ... (topk = 1)."""
    b, k = draft_tokens.shape
    dev = draft_tokens.device
    tokens = torch.cat([root_tokens.to(dev, torch.long).view(b, 1), draft_tokens.long()], dim=1)
    parents = torch.arange(-1, k, device=dev).expand(b, k + 1).clone()
    depth = torch.arange(0, k + 1, device=dev).expand(b, k + 1).clone()
    return DraftTree(tokens=tokens, parents=parents, depth=depth)


def _ancestor_min(scores: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """scores [B, M], parents [B, M] (-1 = root) -> [B, M] min of each candidate's score and all of
    its ancestors' scores. Equal to scores when they are non-increasing along paths (as
    cumulative log-probs are); otherwise it forces a child never to outrank its parent."""
    b, m = scores.shape
    root = torch.full((b, 1), m, dtype=torch.long, device=scores.device)
    anc = torch.cat([torch.where(parents < 0, root, parents), root], dim=1)  # [B, M+1], M = virtual root
    inf = torch.full((b, 1), float("inf"), dtype=scores.dtype, device=scores.device)
    eff = torch.cat([scores, inf], dim=1)
    for _ in range(_num_doublings(m + 1) + 1):
        eff = torch.minimum(eff, eff.gather(1, anc))
        anc = anc.gather(1, anc)
    return eff[:, :m]


def select_tree(
    root_tokens: torch.Tensor,   # [B]
    cand_tokens: torch.Tensor,   # [B, M] target-vocab ids
    cand_parents: torch.Tensor,  # [B, M] index into candidates, -1 = child of the root
    cand_scores: torch.Tensor,   # [B, M] cumulative log-probs
    num_nodes: int,
) -> DraftTree:
    """Keep the best num_nodes - 1 candidates (stable: on ties the earlier candidate wins), root
    them at root_tokens and number them in that rank order.

    Rank order is also a valid tree order: a parent is created before its children (smaller
    index) and scores at least as much, so a stable descending sort puts it first; hence the
    kept set is ancestor-closed and siblings come out in descending score order. Inputs that
    break "non-increasing along a path" are forced into shape by ranking on the minimum score
    along each candidate's path (identical ranking for well-formed inputs).
    """
    if cand_tokens.dim() != 2 or cand_parents.shape != cand_tokens.shape or cand_scores.shape != cand_tokens.shape:
        raise ValueError(
            "select_tree: cand_tokens, cand_parents, cand_scores must be [B, M] of one shape, got "
            f"{tuple(cand_tokens.shape)}, {tuple(cand_parents.shape)}, {tuple(cand_scores.shape)}"
        )
    b, m = cand_tokens.shape
    k = num_nodes - 1
    if not 0 <= k <= m:
        raise ValueError(f"select_tree: num_nodes - 1 must be in [0, {m}] candidates, got num_nodes={num_nodes}")
    dev = cand_tokens.device
    parents = cand_parents.long()
    idx = torch.arange(m, device=dev)
    if bool(((parents < -1) | (parents >= idx)).any()):
        raise ValueError("select_tree: each candidate's parent must be -1 or an earlier candidate")

    eff = _ancestor_min(cand_scores, parents)                      # [B, M]
    order = torch.sort(eff, dim=1, descending=True, stable=True).indices
    keep = order[:, :k]                                            # [B, K] candidate ids, rank order

    # New node id of each candidate (1..K for kept ones); slot M stands for the root (node 0).
    new_id = torch.zeros(b, m + 1, dtype=torch.long, device=dev)
    new_id.scatter_(1, keep, torch.arange(1, k + 1, device=dev).expand(b, k))
    par_old = torch.where(parents < 0, torch.full_like(parents, m), parents)  # [B, M]
    kept_par_old = par_old.gather(1, keep)                                     # [B, K]
    closed = (kept_par_old == m) | (new_id.gather(1, kept_par_old) > 0)
    assert bool(closed.all()), "select_tree: kept set is not ancestor-closed"
    new_par = new_id.gather(1, kept_par_old)                                   # [B, K]

    tokens = torch.cat([root_tokens.to(dev, torch.long).view(b, 1), cand_tokens.long().gather(1, keep)], dim=1)
    tree_parents = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=dev), new_par], dim=1)
    return DraftTree(tokens=tokens, parents=tree_parents, depth=depth_from_parents(tree_parents))


def graft_chains(tree: DraftTree, chains: list[list[int]]) -> DraftTree:
    """Add a chain of draft tokens per request (e.g. from prompt lookup) to a batch of trees.

    The chain follows the tree from the root while its tokens are already there (children with
    the same token), and the rest hangs off the last matched node as new nodes, numbered after
    the tree's. Rows get the same node count: a row with fewer new nodes is padded with copies
    of its last node (same parent, same token), which verification can never pick: greedy takes
    the first child holding the target's choice, and sampling skips a sibling token already
    rejected. Returns the tree unchanged when no chain adds a node.
    """
    if len(chains) != tree.batch_size:
        raise ValueError(f"graft_chains: {len(chains)} chains for {tree.batch_size} trees")
    if tree.num_nodes < 2:
        raise ValueError("graft_chains: a tree needs a draft node besides its root to pad rows with")
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    added: list[tuple[list[int], list[int]]] = []
    for b, chain in enumerate(chains):
        node, i = 0, 0
        kids: dict[tuple[int, int], int] = {(p, t): j for j, (p, t) in enumerate(zip(pars[b], toks[b])) if j > 0}
        while i < len(chain) and (node, chain[i]) in kids:
            node = kids[node, chain[i]]
            i += 1
        new_t, new_p, n = [], [], len(toks[b])
        for tok in chain[i:]:
            new_t.append(tok)
            new_p.append(node)
            node = n + len(new_t) - 1
        added.append((new_t, new_p))
    width = max(len(t) for t, _ in added)
    if width == 0:
        return tree
    for b, (new_t, new_p) in enumerate(added):
        last_t, last_p = (new_t[-1], new_p[-1]) if new_t else (toks[b][-1], pars[b][-1])
        pad = width - len(new_t)
        toks[b] += new_t + [last_t] * pad
        pars[b] += new_p + [last_p] * pad
    dev = tree.tokens.device
    parents = torch.tensor(pars, dtype=torch.long, device=dev)
    return DraftTree(tokens=torch.tensor(toks, dtype=torch.long, device=dev), parents=parents,
                     depth=depth_from_parents(parents))
