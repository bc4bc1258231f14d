"""Ancestor masks of draft trees (pointer doubling): which nodes each tree node may attend to.

Lives below the speculative layer, which builds trees, because the attention backend needs it: for
each verified node's slot list on augury's attention kernel (paged.PagedBackend._tree_rows) and for
torch's masked fallback; speculative/tree.py re-exports it.
"""
from __future__ import annotations

import numpy as np
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


def ancestor_masks(parents: np.ndarray) -> np.ndarray:
    """parents [B, N] (a parent before its children, -1 for a root) -> mask [B, N, N] bool, [b, i, j]
    True when j is i or an ancestor of i.

    Pointer doubling: after round s, row i holds i's ancestors up to distance 2^s; OR-ing in the
    row of i's 2^s-th ancestor doubles the reach. In numpy: a few microseconds a call, where each
    torch operator costs several (the exact rows of a verification step are built from it every step).
    """
    b, n = parents.shape
    idx, rows = np.arange(n), np.arange(b)[:, None]
    up = np.where(parents < 0, idx, parents)  # a root its own parent: jumps saturate there
    mask = np.zeros((b, n, n), dtype=bool)
    mask[:, idx, idx] = True
    mask[rows, idx, up] = True
    for _ in range(num_doublings(n)):
        mask |= mask[rows, up]
        up = up[rows, up]
    return mask


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """ancestor_masks as a torch tensor on parents' device."""
    return torch.from_numpy(ancestor_masks(parents.cpu().numpy())).to(parents.device)
