"""`--speculative-algorithm suffix`: suffix decoding alone as a speculative.interface.Proposer.

Each request's draft is its suffix draft (speculative/suffix.py: its own prompt and output, or recent
requests' outputs, whichever scores higher), a tree best-first by estimated probability, so that
cap_trees, which keeps a row's first nodes, cuts the least likely. A request with no match drafts
nothing (its row is its root: a plain decode row). No draft model: nothing to catch up.
"""
from __future__ import annotations

from augury.core.request import Request
from augury.speculative.interface import TargetHost
from augury.speculative.policy import TreeShape
from augury.speculative.sources import Source
from augury.speculative.suffix import SuffixDrafter
from augury.speculative.tree import DraftTree, trees_of

# draft nodes a request may add beyond the policy's shape (AUTO_SHAPE["suffix"]: 7): a long match is a
# copy, and a copy is worth drafting far (the policy's "whole tree" gets them, a budget cuts them first)
SUFFIX_EXTRA = 8


class SuffixProposer:
    needs_aux = False
    aux_layers: tuple[int, ...] = ()

    def __init__(self, drafter: SuffixDrafter, extra_nodes: int = SUFFIX_EXTRA) -> None:
        self.drafter = drafter
        self.extra_nodes = extra_nodes

    def propose(self, host: TargetHost, reqs: list[Request], shape: TreeShape) -> DraftTree:
        limit = shape.num_drafts + self.extra_nodes
        drafts = []
        for r in reqs:
            d = self.drafter.draft_for(r, limit)
            drafts.append((d.tokens, d.parents))
        return trees_of([r.last_token_id for r in reqs], drafts, Source.LOOKUP)
