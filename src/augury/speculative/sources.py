"""Where a verified draft node came from, and what one verified row yields by source.

Three sources draft tokens for the same verification: the EAGLE-3 head (HEAD), prompt lookup
(LOOKUP: the n-gram proposer, the branch grafted onto EAGLE-3 trees, the chains of steps without
head drafts) and a request's grammar (FORCED: the tokens it forces, grafted under kept nodes). Each
DraftTree carries a source per node (tree.py), and `tally` counts a verified row by source.

The adaptive policy learns only from what its budget buys: the proposer's drafts (the head's and the
lookup branch it grafts, which cap_trees cuts with the rest of a row; the n-gram proposer's), never
forced tokens, which a grammar drafts whatever the policy decides (a row the policy left at its root
still verifies them) and which are all but always accepted: counted as the head's acceptance they made
the policy draft on the strength of tokens the head did not draft.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from augury.core.sources import SOURCE_NAMES, Source

__all__ = ["SOURCE_NAMES", "Source", "Tally", "tally"]


@dataclass
class Tally:
    """One verified row by source (lists indexed by Source)."""

    drafted: list[int]  # real draft nodes (padding excluded)
    accepted: list[int]  # drafts on the accepted path (the verifier's verdict)
    emitted: list[int]  # of those, emitted (a stop condition may cut the path short)
    depth: int  # the proposer's drafts: the deepest offered, in levels of its own nodes (0: it drafted none)
    hits: int  # ... and its nodes on the accepted path


def tally(parents: Sequence[int], sources: Sequence[int], size: int, path: Sequence[int], emitted: int) -> Tally:
    """Count one row: its first `size` nodes (root included; parents[i] < i), the accepted path (node
    indices, the root first) and how many of the path's drafts were emitted. A node's level is the
    number of the proposer's (not forced) nodes on its path from the root, itself included: a forced
    chain under a head node adds no level."""
    drafted, accepted, out = [0] * len(Source), [0] * len(Source), [0] * len(Source)
    level = [0] * size
    for i in range(1, size):
        s = sources[i]
        drafted[s] += 1
        level[i] = level[parents[i]] + (s != Source.FORCED)
    hits = 0
    for j, node in enumerate(path[1:]):
        s = sources[node]
        accepted[s] += 1
        hits += s != Source.FORCED
        if j < emitted:
            out[s] += 1
    return Tally(drafted, accepted, out, max(level), hits)
