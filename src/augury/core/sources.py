"""The sources a draft token can come from, as counted in the engine's statistics, a request's
SpecStats, usage.speculative and /metrics (speculative/sources.py counts verified rows by them)."""
from __future__ import annotations

from enum import IntEnum


class Source(IntEnum):
    """A draft node's source (the root's entry is unused)."""

    HEAD = 0  # the EAGLE-3 head
    LOOKUP = 1  # text lookup: suffix drafts (the request's own text, earlier answers) or prompt lookup (n-gram)
    FORCED = 2  # a grammar's forced tokens (jump-forward)


SOURCE_NAMES = tuple(s.name.lower() for s in Source)  # ("head", "lookup", "forced"): usage and /metrics
