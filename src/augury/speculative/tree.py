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

from augury.attention.tree_mask import num_doublings, self_rooted
from augury.speculative.sources import Source


@dataclass
class DraftTree:
    """A batch of draft trees as [B, N] tensors, one row per request.

    Rows may use fewer than N nodes: `sizes[b]` is row b's node count, the root included (None:
    every row uses all N). Nodes at index >= sizes[b] are padding: they are ordinary tree nodes
    as far as tensors go (a real parent, a depth, a token), so the target forward computes them
    with the rest of the batch, but verification never offers them as children, so they can
    never be accepted and they count as no draft. Since every parent precedes its child, the
    first sizes[b] nodes of a row always form a tree of their own.

    `source[b, i]` is node i's Source (the EAGLE-3 head, prompt lookup, a grammar's forced tokens;
    sources.py), carried through every function here so that verification counts accepted drafts by
    where they came from; None: every node the head's.
    """

    tokens: torch.Tensor   # [B, N] int64; node 0 = root (last committed token)
    parents: torch.Tensor  # [B, N] int64; -1 for the root; parents[b, i] < i for i >= 1
    depth: torch.Tensor    # [B, N] int64; root 0
    sizes: list[int] | None = None  # [B] real nodes per row (root included); None = N each
    source: torch.Tensor | None = None  # [B, N] int8 Source per node; None = Source.HEAD each

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.shape[1] < 1:
            raise ValueError(f"DraftTree.tokens must be [B, N>=1], got {tuple(self.tokens.shape)}")
        if self.parents.shape != self.tokens.shape or self.depth.shape != self.tokens.shape:
            raise ValueError(
                "DraftTree tokens, parents and depth must share one shape, got "
                f"{tuple(self.tokens.shape)}, {tuple(self.parents.shape)}, {tuple(self.depth.shape)}"
            )
        if self.source is not None and self.source.shape != self.tokens.shape:
            raise ValueError(f"DraftTree.source must be shaped like tokens {tuple(self.tokens.shape)}, "
                             f"got {tuple(self.source.shape)}")
        if self.sizes is not None:
            self.sizes = [int(x) for x in self.sizes]
            n = self.tokens.shape[1]
            if len(self.sizes) != self.tokens.shape[0] or any(not 1 <= x <= n for x in self.sizes):
                raise ValueError(f"DraftTree.sizes must give each of the {self.tokens.shape[0]} rows "
                                 f"1..{n} nodes, got {self.sizes}")

    def row_sizes(self) -> list[int]:
        """Real nodes per row, the root included."""
        return list(self.sizes) if self.sizes is not None else [self.num_nodes] * self.batch_size

    def sources(self) -> torch.Tensor:
        """[B, N] int8: each node's Source (the head's where none was given)."""
        if self.source is not None:
            return self.source
        return torch.full(tuple(self.tokens.shape), int(Source.HEAD), dtype=torch.int8)

    def deepest(self) -> list[int]:
        """Per row, the depth of its deepest real node (0: the root alone, no draft). In Python over
        the depths as a list: right after a forward has streamed the weights through every cache
        level, the four torch operators this took cost ~100 us a verification step (12 us in a warm
        loop; the demo at batch 1, Zen 5 EPYC)."""
        depth = self.depth.tolist()
        sizes = self.sizes if self.sizes is not None else [self.num_nodes] * len(depth)
        return [max(d[:n]) for d, n in zip(depth, sizes)]

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])


# nodes up to which _padded finds the depths in Python (~0.1 us a node) rather than by depth_from_parents'
# torch operators (~40 of them for 17 nodes, ~60 us after a forward; a free-drafts step at batch 1 is ~4 ms)
SMALL_TREES = 512


def depth_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (-1 for roots) -> depth [B, N], by list ranking (pointer doubling)."""
    anc = self_rooted(parents)
    dist = (parents >= 0).long()  # distance from node to anc[node]
    for _ in range(num_doublings(parents.shape[1]) + 1):
        dist = dist + dist.gather(1, anc)
        anc = anc.gather(1, anc)
    return dist


def chain_tree(root_tokens: torch.Tensor, draft_tokens: torch.Tensor, source: Source = Source.HEAD) -> DraftTree:
    """root_tokens [B], draft_tokens [B, K] -> a chain root -> d0 -> d1 ... (topk = 1), every draft
    from `source`."""
    b, k = draft_tokens.shape
    dev = draft_tokens.device
    tokens = torch.cat([root_tokens.to(dev, torch.long).view(b, 1), draft_tokens.long()], dim=1)
    parents = torch.arange(-1, k, device=dev).expand(b, k + 1).clone()
    depth = torch.arange(0, k + 1, device=dev).expand(b, k + 1).clone()
    return DraftTree(tokens=tokens, parents=parents, depth=depth,
                     source=torch.full((b, k + 1), int(source), dtype=torch.int8))


def _ancestor_min(scores: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """scores [B, M], parents [B, M] (-1 = root) -> [B, M] min of each candidate's score and all of
    its ancestors' scores. Equal to scores when they are non-increasing along paths (as
    cumulative log-probs are); otherwise it forces a child never to outrank its parent."""
    b, m = scores.shape
    root = torch.full((b, 1), m, dtype=torch.long, device=scores.device)
    anc = torch.cat([torch.where(parents < 0, root, parents), root], dim=1)  # [B, M+1], M = virtual root
    inf = torch.full((b, 1), float("inf"), dtype=scores.dtype, device=scores.device)
    eff = torch.cat([scores, inf], dim=1)
    for _ in range(num_doublings(m + 1) + 1):
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
    if b * m <= SMALL_TREES and dev.type == "cpu":
        small = _select_small(root_tokens.tolist(), cand_tokens.tolist(), cand_parents.tolist(),
                              cand_scores.tolist(), k)
        if small is not None:
            return small
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


def _select_small(roots: list[int], toks: list[list[int]], pars: list[list[int]], scores: list[list[float]],
                  k: int) -> DraftTree | None:
    """select_tree in Python, for small batches (~30 torch operators on a few dozen candidates took
    ~0.2 ms of a ~1.2 ms proposer call at batch 1): the same ranking (a stable sort on each
    candidate's least score along its path), numbering and checks. None where a score is NaN (the
    sorts may order those apart)."""
    out_t, out_p, out_d = [], [], []
    for root, tok, par, sc in zip(roots, toks, pars, scores):
        m = len(tok)
        eff = [0.0] * m
        for i, (p, x) in enumerate(zip(par, sc)):
            if x != x:
                return None
            if not -1 <= p < i:
                raise ValueError("select_tree: each candidate's parent must be -1 or an earlier candidate")
            eff[i] = x if p < 0 else min(x, eff[p])
        keep = sorted(range(m), key=lambda i: -eff[i])[:k]
        new_id = {c: j + 1 for j, c in enumerate(keep)}
        t, p_new, d = [root], [-1], [0]
        for c in keep:
            p = par[c]
            at = 0 if p < 0 else new_id.get(p)
            assert at is not None, "select_tree: kept set is not ancestor-closed"
            t.append(tok[c])
            p_new.append(at)
            d.append(d[at] + 1)
        out_t.append(t)
        out_p.append(p_new)
        out_d.append(d)
    return DraftTree(tokens=torch.tensor(out_t, dtype=torch.long), parents=torch.tensor(out_p, dtype=torch.long),
                     depth=torch.tensor(out_d, dtype=torch.long))


def graft_chains(tree: DraftTree, chains: list[list[int]]) -> DraftTree:
    """Add a chain of draft tokens per request (e.g. from prompt lookup) to a batch of trees.

    The chain follows the tree from the root while its tokens are already there (children with
    the same token), and the rest hangs off the last matched node as new nodes, numbered after
    the tree's. Rows get the same node count: a row with fewer new nodes is padded with copies
    of its last node (same parent, same token), which verification can never pick: greedy takes
    the first child holding the target's choice, and sampling skips a sibling token already
    rejected. The new nodes (padding copies included) are Source.LOOKUP's; a chain token the tree
    already holds stays its drafter's. Returns the tree unchanged when no chain adds a node.
    """
    if len(chains) != tree.batch_size:
        raise ValueError(f"graft_chains: {len(chains)} chains for {tree.batch_size} trees")
    if tree.num_nodes < 2:
        raise ValueError("graft_chains: a tree needs a draft node besides its root to pad rows with")
    toks, pars, srcs = tree.tokens.tolist(), tree.parents.tolist(), tree.sources().tolist()
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
        srcs[b] += [int(Source.LOOKUP)] * width
    dev = tree.tokens.device
    parents = torch.tensor(pars, dtype=torch.long, device=dev)
    return DraftTree(tokens=torch.tensor(toks, dtype=torch.long, device=dev), parents=parents,
                     depth=depth_from_parents(parents), source=torch.tensor(srcs, dtype=torch.int8))


def graft_trees(tree: DraftTree, grafts: list[tuple[list[int], list[int]]], source: Source = Source.LOOKUP
                ) -> DraftTree:
    """Add a draft tree per request (tokens, parents: -1 for a child of the root, parents before
    children; e.g. a suffix draft) to a batch of trees: each graft node follows the tree while an
    equal node is there (same parent, same token), the rest hang as new nodes, numbered after the
    tree's in the graft's order, from `source`. Rows of unequal growth are padded with copies of their
    root under it, past `sizes` (never offered, verified as no row). Returns the tree unchanged when
    no graft adds a node."""
    if len(grafts) != tree.batch_size:
        raise ValueError(f"graft_trees: {len(grafts)} grafts for {tree.batch_size} trees")
    sizes = tree.row_sizes()
    toks, pars, srcs = tree.tokens.tolist(), tree.parents.tolist(), tree.sources().tolist()
    rows = []
    for b, (g_tok, g_par) in enumerate(grafts):
        t, p, s = toks[b][: sizes[b]], pars[b][: sizes[b]], srcs[b][: sizes[b]]
        kids = {(pp, tt): j for j, (pp, tt) in enumerate(zip(p, t)) if j > 0}
        at: list[int] = []  # graft node -> tree node
        for tok, par in zip(g_tok, g_par):
            parent = 0 if par < 0 else at[par]
            node = kids.get((parent, tok))
            if node is None:
                node = len(t)
                t.append(tok)
                p.append(parent)
                s.append(int(source))
                kids[parent, tok] = node
            at.append(node)
        rows.append((t, p, s))
    if all(len(t) == n for (t, _, _), n in zip(rows, sizes)):
        return tree
    return _padded(rows, tree.tokens.device)


def trees_of(roots: list[int], drafts: list[tuple[list[int], list[int]]], source: Source) -> DraftTree:
    """A batch of trees from each request's root token and its draft (tokens, parents: -1 under the
    root), every draft node from `source`; rows padded as graft_trees pads them."""
    rows = [([r] + [int(x) for x in tok], [-1] + [q + 1 if q >= 0 else 0 for q in par],
             [int(Source.HEAD)] + [int(source)] * len(tok)) for r, (tok, par) in zip(roots, drafts)]
    return _padded(rows, torch.device("cpu"))


def chains_of(roots: list[int], chains: list[tuple[list[int], list[int]]]) -> DraftTree:
    """A batch of chains: under each request's root token its chain's tokens, each from its given
    Source ((tokens, sources) per request; an empty chain leaves the row its root alone)."""
    rows = [([r] + list(tok), list(range(-1, len(tok))), [int(Source.HEAD)] + [int(x) for x in src])
            for r, (tok, src) in zip(roots, chains)]
    return _padded(rows, torch.device("cpu"))


def _padded(rows: list[tuple[list[int], list[int], list[int]]], dev: torch.device) -> DraftTree:
    """Rows (tokens, parents, sources) of one width: shorter ones padded with copies of their root
    hung under it, past their size (see DraftTree.sizes)."""
    n = max(len(t) for t, _, _ in rows)
    out_t, out_p, out_s = [], [], []
    for t, p, sr in rows:
        pad = n - len(t)
        out_t.append(t + [t[0]] * pad)
        out_p.append(p + [0] * pad)
        out_s.append(sr + [int(Source.HEAD)] * pad)
    if len(rows) * n <= SMALL_TREES:  # a parent precedes its children: one pass down each row
        depths = []
        for p in out_p:
            d = [0] * n
            for i in range(1, n):
                d[i] = d[p[i]] + 1
            depths.append(d)
        # tokens, parents and depths in one tensor (torch calls are dear right after a forward)
        tokens, parents, depth = torch.tensor([out_t, out_p, depths], dtype=torch.long, device=dev).unbind(0)
    else:
        parents = torch.tensor(out_p, dtype=torch.long, device=dev)
        tokens, depth = torch.tensor(out_t, dtype=torch.long, device=dev), depth_from_parents(parents)
    return DraftTree(tokens=tokens, parents=parents, depth=depth, sizes=[len(t) for t, _, _ in rows],
                     source=torch.tensor(out_s, dtype=torch.int8))


def cap_trees(tree: DraftTree, caps: list[int | None]) -> DraftTree:
    """Keep at most caps[b] draft nodes in row b (None: no cap): its first caps[b] + 1 nodes,
    which are ancestor-closed (a parent always precedes its child) and, for select_tree's trees,
    the best-scored ones; a grafted prompt-lookup branch comes after them and goes first. Columns
    no row uses any more are cut off; the rest of a shorter row stays as padding (see DraftTree)."""
    if len(caps) != tree.batch_size:
        raise ValueError(f"cap_trees: {len(caps)} caps for {tree.batch_size} trees")
    if any(c is not None and c < 0 for c in caps):
        raise ValueError(f"cap_trees: caps must be >= 0, got {caps}")
    sizes = [s if c is None else min(s, c + 1) for s, c in zip(tree.row_sizes(), caps)]
    n = max(sizes)
    if n == tree.num_nodes and tree.sizes is None and min(sizes) == n:
        return tree
    return DraftTree(tokens=tree.tokens[:, :n], parents=tree.parents[:, :n], depth=tree.depth[:, :n],
                     sizes=sizes, source=None if tree.source is None else tree.source[:, :n])


def with_root_only_rows(tree: DraftTree, rows: list[int], roots: list[int]) -> DraftTree:
    """A batch of len(rows) + len(roots) trees: `tree`'s rows at positions `rows`, and at every
    other position (in order) a tree that is just its root (roots[i]): a verification of it is a
    plain decode step. Its padding nodes are copies of the root hung under it (depth 1), so the
    batch keeps one [B, N] shape and the forward sees valid positions."""
    b = len(rows) + len(roots)
    if tree.batch_size != len(rows) or sorted(set(rows)) != sorted(rows) or any(not 0 <= r < b for r in rows):
        raise ValueError(f"with_root_only_rows: rows {rows} do not place {tree.batch_size} trees in {b}")
    n, dev = tree.num_nodes, tree.tokens.device
    tokens = torch.empty(b, n, dtype=torch.long, device=dev)
    parents = torch.zeros(b, n, dtype=torch.long, device=dev)
    depth = torch.ones(b, n, dtype=torch.long, device=dev)
    others = [i for i in range(b) if i not in set(rows)]
    idx = torch.tensor(rows, device=dev)
    tokens[idx], parents[idx], depth[idx] = tree.tokens, tree.parents, tree.depth
    source = torch.full((b, n), int(Source.HEAD), dtype=torch.int8)  # a root-only row's nodes: never offered
    source[torch.tensor(rows)] = tree.sources()
    if others:
        oth = torch.tensor(others, device=dev)
        tokens[oth] = torch.tensor(roots, dtype=torch.long, device=dev)[:, None].expand(len(others), n)
        parents[oth, 0] = -1
        depth[oth, 0] = 0
    sizes = [1] * b
    for r, s in zip(rows, tree.row_sizes()):
        sizes[r] = s
    return DraftTree(tokens=tokens, parents=parents, depth=depth, sizes=sizes, source=source)


def rebuild_rows(tree: DraftTree, plans: list[tuple[list[int], list[tuple[int, list[int]]]] | None],
                 chain_sources: list[list[list[int]] | None] | None = None) -> DraftTree:
    """Per row, keep only some of its nodes and hang new chains under kept ones (a grammar's pruning
    and its forced continuations: structured.RequestShaper.plan_tree); None leaves a row as it is.

    plans[b] = (kept nodes: ancestor-closed, in index order, the root first; chains: (kept parent
    node, tokens)). Kept nodes keep their order (so parents still precede children and siblings their
    score order) and their sources, chain nodes follow in order, Source.FORCED's unless
    chain_sources[b] gives each chain's per-token sources (a step without head drafts: forced tokens
    and prompt lookup in one chain). Rows get one width again; shorter rows are padded with copies of
    their root hung under it (never offered: see DraftTree.sizes)."""
    if len(plans) != tree.batch_size:
        raise ValueError(f"rebuild_rows: {len(plans)} plans for {tree.batch_size} trees")
    if all(p is None for p in plans):
        return tree
    toks, pars, sizes = tree.tokens.tolist(), tree.parents.tolist(), tree.row_sizes()
    srcs = tree.sources().tolist()
    rows: list[tuple[list[int], list[int], list[int]]] = []
    for b, plan in enumerate(plans):
        if plan is None:
            rows.append((toks[b][: sizes[b]], pars[b][: sizes[b]], srcs[b][: sizes[b]]))
            continue
        keep, chains = plan
        if not keep or keep[0] != 0:
            raise ValueError("rebuild_rows: a row's kept nodes must start with its root")
        given = chain_sources[b] if chain_sources is not None else None
        if given is not None and [len(c) for c in given] != [len(c) for _, c in chains]:
            raise ValueError(f"rebuild_rows: row {b}'s chain sources do not match its chains")
        new_id = {old: i for i, old in enumerate(keep)}
        t = [toks[b][i] for i in keep]
        p = [-1] + [new_id[pars[b][i]] for i in keep[1:]]  # KeyError: a kept node's parent was dropped
        sr = [srcs[b][i] for i in keep]
        for c, (parent, chain) in enumerate(chains):
            at = new_id[parent]
            for k, tok in enumerate(chain):
                t.append(tok)
                p.append(at)
                sr.append(int(Source.FORCED) if given is None else int(given[c][k]))
                at = len(t) - 1
        rows.append((t, p, sr))
    return _padded(rows, tree.tokens.device)
