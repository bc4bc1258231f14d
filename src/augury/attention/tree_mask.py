"""Ancestor masks of draft trees (pointer doubling): which nodes each tree node may attend to.

Lives below the speculative layer, which builds trees, because the attention backend needs it
for its masked fallback; speculative/tree.py re-exports it.
"""
from __future__ import annotations

import torch


def self_rooted(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] parents with -1 replaced by the node's own index, so gathers never go out of range
    and pointer jumping saturates at the root."""
    idx = torch.arange(parents.shape[1], device=parents.device).expand_as(parents)
    return torch.where(parents < 0, idx, parents)


def num_doublings(n: int) -> int:
    """Rounds of pointer doubling that cover any path of n nodes (distance up to n - 1)."""
    rounds, reach = 0, 1
    while reach < n - 1:
        reach *= 2
        rounds += 1
    return rounds


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] -> mask [B, N, N] bool, [b, i, j] True when j is i or an ancestor of i.

    Pointer doubling: after round s, row i holds i's ancestors up to distance 2^s; OR-ing in the
    row of i's 2^s-th ancestor doubles the reach.
    """
    b, n = parents.shape
    anc = self_rooted(parents)
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    mask = eye | torch.nn.functional.one_hot(anc, n).bool()
    for _ in range(num_doublings(n)):
        mask = mask | mask.gather(1, anc.unsqueeze(-1).expand(b, n, n))
        anc = anc.gather(1, anc)
    return mask
