"""Prompt-lookup (n-gram) drafting: no draft model, continue an earlier occurrence of the suffix."""
from __future__ import annotations

import torch

from augury.core.request import Request
from augury.speculative.interface import TargetHost
from augury.speculative.policy import TreeShape
from augury.speculative.tree import DraftTree, chain_tree


def lookup(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):  # most recent occurrence first
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer:
    """Prompt lookup as a speculative.interface.Proposer."""

    needs_aux = False
    aux_layers: tuple[int, ...] = ()
    extra_nodes = 0

    def propose(self, host: TargetHost, reqs: list[Request], shape: TreeShape) -> DraftTree:
        k = shape.num_drafts
        drafts = []
        for r in reqs:
            toks = r.all_token_ids
            d = lookup(toks, k)
            # every row of a batch needs k drafts; pad with the last token (cheaply rejected)
            drafts.append(d + [d[-1] if d else toks[-1]] * (k - len(d)))
        roots = torch.tensor([r.last_token_id for r in reqs])
        return chain_tree(roots, torch.tensor(drafts, dtype=torch.long).view(len(reqs), k))
