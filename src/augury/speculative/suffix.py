"""Suffix decoding: drafts from what the text has done before, within a request and across requests.

Suffix decoding (Arctic Inference, arXiv 2411.04975) drafts without a model: find the longest suffix of
a request's tokens that occurred before, and continue it the way its earlier occurrences went on,
as a tree grown greedily by how often each continuation followed. Two indices are searched: the
request's own prompt and output (`SuffixDrafter.context`, one numpy array per request that grows as
tokens commit) and the outputs of recent finished requests (`SuffixCache`, bounded in tokens, least
recently used request evicted first), and the draft with the higher score is taken.

Scoring, as the paper's: among the occurrences of the longest matched suffix (length m, at most
MAX_DEPTH tokens; the most recent MAX_OCCURRENCES of them), a continuation's probability is the share
of occurrences that went on that way, a node's the product along its path (so each node's is what a
verifier following those occurrences would accept it with); nodes are added best first while one
reaches MIN_PROB, at most SPEC_FACTOR x m of them (a long match is a copy and drafts far, a one-token
match a guess and drafts little). The draft's score, the sum of its nodes' probabilities, is its
expected accepted tokens.

A request's own draft is request_draft's scan of one array (the last token's earlier occurrences,
extended back together), or the same draft from TokenIndex, an index of the request's tokens kept as
they grow (the speculator's: no scan per step). The cross-request cache keys
every position of its buffer by the two tokens ending there: a dict from the pair to its latest
position, and per position the previous one with the same pair (a chain, newest first), written once
per request when the speculator sees the batch without it (worker.py: off the drafting path; numpy
and one dict update per request, ~0.3 us a token); an evicted request's tokens are overwritten with
SEPARATOR in place (its positions then match nothing) and the buffer is compacted, index rebuilt,
once the dead tokens reach the live ones.
"""
from __future__ import annotations

import heapq
import math
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from augury.core.request import Request, Status
from augury.speculative.ngram import TokenArray

SEPARATOR = -1  # between requests in the cache, and where an evicted request's tokens were
MAX_DEPTH = 24  # the longest suffix matched (Arctic's default tree depth)
SPEC_FACTOR = 1.0  # draft nodes per matched token (vLLM's suffix_decoding_max_spec_factor default)
MIN_PROB = 0.1  # a node is drafted while its estimated probability reaches this (vLLM's min_token_prob)
MAX_OCCURRENCES = 64  # the most recent occurrences of the match whose continuations are counted
CANDIDATES = 128  # the most recent cache positions of the last two tokens that are matched at all
DEFAULT_CACHE_TOKENS = 1 << 18  # the cross-request cache's bound (1 MiB of int32 tokens, ~2x with its index)


@dataclass
class Draft:
    """A draft tree under a request's last token: node i is tokens[i], under node parents[i] (-1: the
    root, i.e. the last committed token; parents precede children, siblings in descending probability)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # each node's estimated probability
    match: int = 0  # the matched suffix's length

    @property
    def score(self) -> float:
        """Expected accepted drafts (each node's probability, summed)."""
        return float(sum(self.probs))

    def __len__(self) -> int:
        return len(self.tokens)

    def chain(self) -> list[int]:
        """The most likely path: from the root, each node's first (most likely) child."""
        return self.chain_probs()[0]

    def chain_probs(self) -> tuple[list[int], list[float]]:
        """`chain` and its nodes' probabilities (each the chance that it and every node above it are
        accepted)."""
        out, probs, at = [], [], -1
        for i, p in enumerate(self.parents):
            if p == at:
                out.append(self.tokens[i])
                probs.append(self.probs[i])
                at = i
        return out, probs


EMPTY = Draft()


def match_lengths(buf: np.ndarray, ends: np.ndarray, query: np.ndarray, most: int) -> np.ndarray:
    """For each e in ends (buf[e] == query[-1]): how many tokens of buf ending at e equal query's last
    ones, at most `most` (and at most e + 1). SEPARATOR never equals a token, so a match stops there.

    The occurrences whose token before e differs (most, in free text) are settled by one comparison;
    the rest are compared at every depth at once, one [K, most] gather: a loop depth by depth cost
    ~4 numpy calls a level (~80 us a step in the server, where the forward has just evicted the
    interpreter's working set from the caches; this is ~6 calls whatever the depth)."""
    n = np.ones(len(ends), dtype=np.int64)
    most = min(most, len(query))
    if most < 2 or not len(ends):
        return n
    two = np.flatnonzero(ends >= 1)
    two = two[buf[ends[two] - 1] == query[-2]]
    if not len(two):
        return n
    back = np.arange(1, most)
    at = ends[two, None] - back[None, :]  # [K, most - 1]: positions e - 1 .. e - most + 1
    same = (buf[np.maximum(at, 0)] == query[len(query) - 1 - back][None, :]) & (at >= 0)
    # leading equal positions: all of them, or up to the first difference
    n[two] = 1 + np.where(same.all(axis=1), most - 1, same.argmin(axis=1))
    return n


def grow(buf: np.ndarray, bound: int, ends: np.ndarray, match: int, limit: int, min_prob: float = MIN_PROB) -> Draft:
    """The draft tree continuing the occurrences ending at `ends` (each a match of `match` tokens) in
    buf[:bound]: best-first by estimated probability (the share of occurrences that went on that way,
    multiplied along the path), while a node reaches min_prob, at most min(limit, SPEC_FACTOR x match)
    nodes."""
    most = min(limit, int(np.ceil(SPEC_FACTOR * match)))
    if most <= 0 or not len(ends):
        return EMPTY
    cols = ends[:, None] + 1 + np.arange(most)[None, :]  # [K, D] positions of the continuations
    inside = cols < bound
    conts = np.where(inside, buf[np.minimum(cols, bound - 1)], SEPARATOR)
    rows = [row[:row.index(SEPARATOR)] if SEPARATOR in row else row for row in conts.tolist()]
    return grow_rows(rows, match, most, min_prob)


def grow_rows(rows: list[list[int]], match: int, most: int, min_prob: float = MIN_PROB) -> Draft:
    """grow's tree from the occurrences' continuations (rows: per occurrence, the tokens after it, at
    most `most`, fewer where its text ended), at most `most` nodes."""
    if len(rows) == 1:  # one occurrence (a copy): its continuation, every node certain
        row = rows[0]
        return Draft(row, list(range(-1, len(row) - 1)), [1.0] * len(row), match)
    draft = Draft(match=match)
    # heap of candidate nodes: (-probability, order, parent node, token, depth, occurrence rows)
    heap: list[tuple[float, int, int, int, int, list[int]]] = []
    order = 0

    def children(parent: int, prob: float, depth: int, members: list[int]) -> None:
        nonlocal order
        if depth >= most:
            return
        groups: dict[int, list[int]] = {}
        for r in members:
            row = rows[r]
            if depth < len(row):
                groups.setdefault(row[depth], []).append(r)
        for t, g in groups.items():
            p = prob * len(g) / len(members)
            if p >= min_prob:
                heapq.heappush(heap, (-p, order, parent, t, depth, g))
                order += 1

    children(-1, 1.0, 0, list(range(len(rows))))
    while heap and len(draft.tokens) < most:
        neg, _, parent, tok, depth, members = heapq.heappop(heap)
        draft.tokens.append(tok)
        draft.parents.append(parent)
        draft.probs.append(-neg)
        children(len(draft.tokens) - 1, -neg, depth + 1, members)
    return draft


def request_draft(tokens: np.ndarray, limit: int, min_prob: float = MIN_PROB) -> Draft:
    """The draft from a request's own tokens (prompt and output, or any array): the longest suffix that
    occurred earlier with a token after it, continued as its most recent occurrences went on."""
    size = len(tokens)
    if size < 2 or limit <= 0:
        return EMPTY
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if not len(ends):
        return EMPTY
    n = match_lengths(tokens, ends, tokens, MAX_DEPTH)
    m = int(n.max())
    best = ends[n >= m][-MAX_OCCURRENCES:]
    return grow(tokens, size, best, m, limit, min_prob)


class TokenIndex:
    """request_draft for one request's growing token list, from an index kept up to date as it grows:
    each token's positions and each adjacent pair's (the pair's second position). The occurrences of
    the last token whose token before differs (most of them, in free text) match one token and need no
    comparison; those of the last pair are compared back in Python where they are few, through
    match_lengths where many. In the server, after a forward has evicted the interpreter's working
    set from the caches, request_draft's half dozen numpy calls over the array took ~90 us a step
    (code edits at ~1,300 tokens: ~25 us its first scan alone); this ~20-30. The same drafts
    (tests/test_suffix.py)."""

    SCAN = 32  # occurrences of the last pair compared back in Python; more go through match_lengths

    def __init__(self) -> None:
        self._n = 0
        self._last = -1
        self._at: dict[int, list[int]] = {}
        self._pairs: dict[tuple[int, int], list[int]] = {}
        self._array = TokenArray()

    def _update(self, tokens: Sequence[int]) -> None:
        m = len(tokens)
        if m < self._n or (self._n and tokens[self._n - 1] != self._last):
            self._n, self._at, self._pairs = 0, {}, {}  # not the list it followed: start over
        at, pairs = self._at, self._pairs
        prev = tokens[self._n - 1] if self._n else -1
        for i in range(self._n, m):
            t = tokens[i]
            at.setdefault(t, []).append(i)
            if i:
                pairs.setdefault((prev, t), []).append(i)
            prev = t
        self._n = m
        self._last = prev

    def draft(self, tokens: Sequence[int], limit: int, min_prob: float = MIN_PROB,
              extra: Sequence[int] = ()) -> Draft:
        """request_draft(np.asarray(tokens + extra), limit, min_prob), tokens the list this index follows
        (only ever appended to; another list starts it over), extra tokens after it that the index holds
        for this call alone (a grammar's forced tokens, in a chain of free drafts)."""
        self._update(tokens)
        if not extra:
            return self._draft(tokens, limit, min_prob)
        seq = list(tokens) + [int(t) for t in extra]
        at, pairs, n = self._at, self._pairs, len(tokens)
        for i in range(n, len(seq)):
            at.setdefault(seq[i], []).append(i)
            if i:
                pairs.setdefault((seq[i - 1], seq[i]), []).append(i)
        try:
            return self._draft(seq, limit, min_prob, np.asarray(seq))
        finally:
            for i in range(len(seq) - 1, n - 1, -1):  # as they were: the positions added last come off first
                for table, key in ((at, seq[i]), (pairs, (seq[i - 1], seq[i]) if i else None)):
                    if key is None:
                        continue
                    held = table[key]
                    held.pop()
                    if not held:
                        del table[key]

    def _draft(self, tokens: Sequence[int], limit: int, min_prob: float, arr: np.ndarray | None = None) -> Draft:
        size = len(tokens)
        if size < 2 or limit <= 0:
            return EMPTY
        last = tokens[-1]
        ends = self._at[last]
        if len(ends) < 2:
            return EMPTY
        two = self._pairs.get((tokens[-2], last), ())
        if len(two) < 2:  # no earlier occurrence of the last pair: every match is one token long
            m, best = 1, ends[-1 - MAX_OCCURRENCES:-1]
        elif len(two) - 1 > self.SCAN:
            arr = self._array.of(tokens) if arr is None else arr
            cand = np.array(two[:-1], dtype=np.int64)
            n = match_lengths(arr, cand, arr, MAX_DEPTH)
            m = int(n.max())
            best = cand[n >= m][-MAX_OCCURRENCES:].tolist()
        else:
            most = min(MAX_DEPTH, size)
            lengths = []
            for e in two[:-1]:
                k = 2
                while k < most and k <= e and tokens[e - k] == tokens[size - 1 - k]:
                    k += 1
                lengths.append(k)
            m = max(lengths)
            best = [e for e, k in zip(two, lengths) if k >= m][-MAX_OCCURRENCES:]
        most = min(limit, math.ceil(SPEC_FACTOR * m))
        if most <= 0:
            return EMPTY
        return grow_rows([tokens[e + 1:e + 1 + most] for e in best], m, most, min_prob)


class SuffixCache:
    """Recent requests' outputs, searchable by suffix: a token buffer (requests apart by SEPARATOR)
    with each position keyed by the two tokens ending there; at most `capacity` live tokens, least
    recently used request (inserted, or drafted from) evicted first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"SuffixCache capacity must be a positive token count, got {capacity}")
        self.capacity = capacity
        self._buf = np.full(1024, SEPARATOR, dtype=np.int32)
        self._seg = np.full(1024, -1, dtype=np.int64)  # the segment each position belongs to
        self._prev = np.zeros(1024, dtype=np.int64)  # the previous position ending in the same pair (0: none)
        self._used = 1  # position 0 stays a separator
        self._live = 0
        self._segments: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (start, end), LRU first
        self._next = 0
        self._head: dict[int, int] = {}  # (a << 32 | b) -> the latest position p with buf[p-1:p+1] == (a, b)

    @property
    def live_tokens(self) -> int:
        return self._live

    @property
    def num_requests(self) -> int:
        return len(self._segments)

    def insert(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Add one request's output (its last `capacity` tokens), evicting the least recently used."""
        seq = np.asarray(tokens, dtype=np.int32)[-self.capacity:]
        if len(seq) < 2:
            return
        while self._segments and self._live + len(seq) > self.capacity:
            _, (s, e) = self._segments.popitem(last=False)
            self._buf[s:e] = SEPARATOR  # its index entries now match nothing
            self._live -= e - s
        need = self._used + len(seq) + 1
        if need > len(self._buf):
            if self._used - 1 - self._live - len(self._segments) >= self._live:
                self._compact()  # as many dead tokens as live ones: rebuild rather than grow
                need = self._used + len(seq) + 1
            if need > len(self._buf):
                size = max(need, 2 * len(self._buf))
                self._buf = np.concatenate((self._buf, np.full(size - len(self._buf), SEPARATOR, np.int32)))
                self._seg = np.concatenate((self._seg, np.full(size - len(self._seg), -1, np.int64)))
                self._prev = np.concatenate((self._prev, np.zeros(size - len(self._prev), np.int64)))
        start = self._used
        self._place(self._next, seq, start)
        self._next += 1
        self._used = start + len(seq) + 1  # and a separator after it

    def _place(self, sid: int, seq: np.ndarray, start: int) -> None:
        end = start + len(seq)
        self._buf[start:end] = seq
        self._buf[end] = SEPARATOR
        self._seg[start:end] = sid
        self._segments[sid] = (start, end)
        self._live += len(seq)
        keys = (seq[:-1].astype(np.int64) << 32) | seq[1:].astype(np.int64)
        pos = np.arange(start + 1, end)
        # each position's predecessor with its pair: the one before it in this request, or the pair's
        # latest position before this request (the dict), for the pair's first position here
        order = np.argsort(keys, kind="stable")
        sk = keys[order]
        first = np.ones(len(sk), dtype=bool)
        first[1:] = sk[1:] != sk[:-1]
        prev = np.empty(len(sk), dtype=np.int64)
        prev[1:] = pos[order[:-1]]
        head = self._head
        prev[first] = [head.get(k, 0) for k in sk[first].tolist()]
        self._prev[pos[order]] = prev
        head.update(zip(keys.tolist(), pos.tolist()))  # positions ascend: the latest of each pair wins

    def _compact(self) -> None:
        """Move the live requests to the front (in LRU order) and index them afresh."""
        segments = [(sid, self._buf[s:e].copy()) for sid, (s, e) in self._segments.items()]
        self._buf[:] = SEPARATOR
        self._seg[:] = -1
        self._prev[:] = 0
        self._segments.clear()
        self._head = {}
        self._live = 0
        at = 1
        for sid, seq in segments:
            self._place(sid, seq, at)
            at += len(seq) + 1
        self._used = at

    def draft(self, query: Sequence[int] | np.ndarray, limit: int, min_prob: float = MIN_PROB) -> Draft:
        """The draft continuing query's longest suffix (at least its last two tokens) as the cached
        outputs went on; the requests it drew on become the most recently used."""
        if len(query) < 2 or limit <= 0 or not self._segments:
            return EMPTY
        a, b = int(query[-2]), int(query[-1])
        if a < 0 or b < 0:
            return EMPTY
        p = self._head.get((a << 32) | b, 0)
        found, prev = [], self._prev
        while p and len(found) < CANDIDATES:
            found.append(p)
            p = int(prev[p])
        if not found:
            return EMPTY
        ends = np.array(found[::-1], dtype=np.int64)  # oldest first, as the request's own index has them
        query = np.asarray(query[-MAX_DEPTH:])  # no match reads further back
        buf = self._buf
        ends = ends[(buf[ends] == b) & (buf[ends - 1] == a) & (buf[ends + 1] != SEPARATOR)]  # live, continued
        if not len(ends):
            return EMPTY
        n = match_lengths(buf, ends, query, MAX_DEPTH)
        m = int(n.max())
        best = ends[n >= m][-MAX_OCCURRENCES:]
        out = grow(buf, self._used, best, m, limit, min_prob)
        if len(out):
            for sid in set(self._seg[best].tolist()):
                self._segments.move_to_end(sid)
        return out


class SuffixDrafter:
    """Suffix drafting for a speculator: each request's tokens as a growing array and an index of them
    (its own), and optionally the cross-request cache, filled with each request's output once it
    finished."""

    def __init__(self, cache_tokens: int = DEFAULT_CACHE_TOKENS) -> None:
        self.cache = SuffixCache(cache_tokens) if cache_tokens > 0 else None
        self._arrays: weakref.WeakKeyDictionary[Request, TokenArray] = weakref.WeakKeyDictionary()
        self._indices: weakref.WeakKeyDictionary[Request, TokenIndex] = weakref.WeakKeyDictionary()
        self._last: list[Request] = []  # the previous decode batch

    def clear(self) -> None:
        """Forget the cross-request cache (the per-request arrays stay: they are the requests' own text)."""
        if self.cache is not None:
            self.cache = SuffixCache(self.cache.capacity)
        self._last = []

    def notice(self, reqs: Sequence[Request]) -> None:
        """A decode batch begins: the previous batch's requests that finished since go into the cache
        (their whole output: the speculator sees every decode batch, and a request leaves it when it
        finishes). A preempted request comes back and is added when it finishes."""
        last = self._last
        if len(last) == len(reqs) and all(a is b for a, b in zip(last, reqs)):
            return  # the same batch as the last step's: nothing left it
        if self.cache is not None and last:
            now = {id(r) for r in reqs}
            for r in last:
                if id(r) not in now and r.status is Status.FINISHED:
                    self.cache.insert(r.output_token_ids)
        self._last = list(reqs)

    def context(self, r: Request) -> np.ndarray:
        """r's prompt and output as an array (a view, valid until r's next call)."""
        arr = self._arrays.get(r)
        if arr is None:
            arr = self._arrays[r] = TokenArray()
        return arr.of(r.all_token_ids)

    def draft_for(self, r: Request, limit: int, min_prob: float = MIN_PROB, extra: Sequence[int] = ()) -> Draft:
        """`draft` of r's prompt and output (and `extra` tokens after them), its own draft from its index
        (TokenIndex)."""
        index = self._indices.get(r)
        if index is None:
            index = self._indices[r] = TokenIndex()
        tokens = r.all_token_ids
        own = index.draft(tokens, limit, min_prob, extra)
        return self._better(own, list(tokens[-MAX_DEPTH:]) + list(extra) if len(extra) else tokens, limit, min_prob)

    def draft(self, tokens: np.ndarray, limit: int, min_prob: float = MIN_PROB) -> Draft:
        """The better-scored of the request's own draft (tokens: its prompt and output, and any drafts
        after them) and the cache's."""
        return self._better(request_draft(tokens, limit, min_prob), tokens, limit, min_prob)

    def _better(self, own: Draft, tokens: Sequence[int] | np.ndarray, limit: int, min_prob: float) -> Draft:
        if self.cache is None or len(own) >= limit and min(own.probs) >= 1.0:
            return own  # a certain copy as long as allowed: nothing scores higher
        other = self.cache.draft(tokens, limit, min_prob)
        return other if other.score > own.score else own
