"""Draft tree selection, chains and tree attention masks, against hand-made trees and brute force."""
from __future__ import annotations

import random

import pytest
import torch

from augury.attention.tree_mask import tree_attention_mask
from augury.speculative.tree import DraftTree, chain_tree, depth_from_parents, graft_chains, select_tree


def _brute_mask(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = parents[j]
    return mask


def _expand(rng: random.Random, topk: int, steps: int) -> tuple[list[int], list[int], list[float]]:
    """An EAGLE-2 style expansion: each step, the best topk frontier nodes get topk children."""
    toks, pars, scores = [], [], []
    frontier = [(-1, 0.0)]
    for _ in range(steps):
        new = []
        for p, s in frontier:
            for lp in sorted((rng.choice([-0.5, -1.0, -2.0, -3.0, rng.uniform(-4, 0)]) for _ in range(topk)), reverse=True):
                toks.append(rng.randrange(1000))
                pars.append(p)
                scores.append(s + lp)
                new.append((len(toks) - 1, s + lp))
        frontier = sorted(new, key=lambda x: -x[1])[:topk]
    return toks, pars, scores


def test_select_tree_hand_made() -> None:
    # topk 2, two steps: c0 c1 under the root; c2 c3 under c0; c4 c5 under c1
    toks = torch.tensor([[10, 11, 12, 13, 14, 15]])
    pars = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    scores = torch.tensor([[-0.1, -1.0, -0.3, -2.0, -1.2, -1.5]])
    tree = select_tree(torch.tensor([7]), toks, pars, scores, num_nodes=5)
    # best four: c0 (-0.1), c2 (-0.3), c1 (-1.0), c4 (-1.2) -> nodes 1..4
    assert tree.tokens.tolist() == [[7, 10, 12, 11, 14]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 3]]
    assert tree.depth.tolist() == [[0, 1, 2, 1, 2]]


def test_select_tree_ties_earlier_wins_and_siblings_sorted() -> None:
    toks = torch.tensor([[1, 2, 3, 4]])
    pars = torch.tensor([[-1, -1, -1, -1]])
    scores = torch.tensor([[-1.0, -0.5, -1.0, -0.5]])
    tree = select_tree(torch.tensor([0]), toks, pars, scores, num_nodes=4)
    # order by score desc, ties by candidate index: c1, c3, c0 (c2 dropped)
    assert tree.tokens.tolist() == [[0, 2, 4, 1]]
    assert tree.parents.tolist() == [[-1, 0, 0, 0]]


def test_select_tree_tie_between_parent_and_child_keeps_parent() -> None:
    # a child with log-prob 0 ties its parent; stable ranking must keep the parent first
    toks = torch.tensor([[5, 6, 8]])
    pars = torch.tensor([[-1, -1, 0]])
    scores = torch.tensor([[-1.0, -2.0, -1.0]])
    tree = select_tree(torch.tensor([0]), toks, pars, scores, num_nodes=3)
    assert tree.tokens.tolist() == [[0, 5, 8]]
    assert tree.parents.tolist() == [[-1, 0, 1]]


def test_select_tree_forces_closure_on_inconsistent_scores() -> None:
    # c2 claims a better score than its parent c1: ranking uses the path minimum instead
    toks = torch.tensor([[1, 2, 3]])
    pars = torch.tensor([[-1, -1, 1]])
    scores = torch.tensor([[-1.0, -3.0, -0.1]])
    tree = select_tree(torch.tensor([0]), toks, pars, scores, num_nodes=3)
    assert tree.tokens.tolist() == [[0, 1, 2]]
    tree = select_tree(torch.tensor([0]), toks, pars, scores, num_nodes=4)
    assert tree.tokens.tolist() == [[0, 1, 2, 3]]
    assert tree.parents.tolist() == [[-1, 0, 0, 2]]


@pytest.mark.parametrize("topk,steps,num_nodes", [(1, 5, 4), (2, 3, 6), (4, 4, 16), (8, 5, 48)])
def test_select_tree_matches_brute_force(topk: int, steps: int, num_nodes: int) -> None:
    rng = random.Random(topk * 100 + steps)
    rows = [_expand(rng, topk, steps) for _ in range(5)]
    m = len(rows[0][0])
    root = torch.arange(5) + 2000
    tree = select_tree(root, torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
                       torch.tensor([r[2] for r in rows], dtype=torch.float64), num_nodes)
    assert tree.tokens.shape == (5, num_nodes)
    for b, (toks, pars, scores) in enumerate(rows):
        ranked = sorted(range(m), key=lambda i: (-scores[i], i))[: num_nodes - 1]
        t, p, d = tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.depth[b].tolist()
        assert t[0] == 2000 + b and p[0] == -1 and d[0] == 0
        assert t[1:] == [toks[i] for i in ranked]
        kept = {c: k + 1 for k, c in enumerate(ranked)}
        for k, c in enumerate(ranked):
            node = k + 1
            assert p[node] < node
            assert p[node] == (0 if pars[c] < 0 else kept[pars[c]])  # ancestor-closed, renumbered
            assert d[node] == d[p[node]] + 1
        for parent in range(num_nodes):  # siblings in descending score order
            sib = [scores[ranked[i - 1]] for i in range(1, num_nodes) if p[i] == parent]
            assert sib == sorted(sib, reverse=True)


def test_select_tree_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="parent"):
        select_tree(torch.tensor([0]), torch.tensor([[1, 2]]), torch.tensor([[-1, 1]]), torch.zeros(1, 2), 2)
    with pytest.raises(ValueError, match="num_nodes"):
        select_tree(torch.tensor([0]), torch.tensor([[1, 2]]), torch.tensor([[-1, 0]]), torch.zeros(1, 2), 4)
    with pytest.raises(ValueError):
        DraftTree(tokens=torch.zeros(2, 3, dtype=torch.long), parents=torch.zeros(2, 2, dtype=torch.long),
                  depth=torch.zeros(2, 3, dtype=torch.long))


def test_select_tree_root_only() -> None:
    tree = select_tree(torch.tensor([3, 4]), torch.ones(2, 3, dtype=torch.long), torch.full((2, 3), -1),
                       torch.zeros(2, 3), num_nodes=1)
    assert tree.tokens.tolist() == [[3], [4]] and tree.parents.tolist() == [[-1], [-1]]
    assert tree_attention_mask(tree.parents).tolist() == [[[True]], [[True]]]


def test_chain_tree() -> None:
    tree = chain_tree(torch.tensor([9, 8]), torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert tree.tokens.tolist() == [[9, 1, 2, 3], [8, 4, 5, 6]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 2
    assert tree.depth.tolist() == [[0, 1, 2, 3]] * 2
    mask = tree_attention_mask(tree.parents)
    assert torch.equal(mask[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    # a chain from select_tree (topk 1) is the same tree
    same = select_tree(torch.tensor([9]), torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 0, 1]]),
                       torch.tensor([[-0.1, -0.2, -0.3]]), num_nodes=4)
    assert torch.equal(same.parents, tree.parents[:1]) and torch.equal(same.tokens, tree.tokens[:1])


def test_tree_attention_mask_hand_made() -> None:
    #        0
    #      / | \
    #     1  2  3
    #    / \     \
    #   4   5     6
    #   |
    #   7
    parents = [-1, 0, 0, 0, 1, 1, 3, 4]
    mask = tree_attention_mask(torch.tensor([parents]))
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for i, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 3], [0, 1, 4], [0, 1, 5], [0, 3, 6], [0, 1, 4, 7]]):
        expected[i, ancestors] = True
    assert torch.equal(mask[0], expected)
    assert depth_from_parents(torch.tensor([parents])).tolist() == [[0, 1, 1, 1, 2, 2, 2, 3]]


@pytest.mark.parametrize("n", [2, 3, 17, 64])
def test_tree_attention_mask_random_trees(n: int) -> None:
    rng = random.Random(n)
    rows = [[-1] + [rng.randrange(i) if rng.random() < 0.7 else i - 1 for i in range(1, n)] for _ in range(6)]
    mask = tree_attention_mask(torch.tensor(rows))
    depth = depth_from_parents(torch.tensor(rows))
    for b, row in enumerate(rows):
        brute = _brute_mask(row)
        assert mask[b].tolist() == brute
        assert depth[b].tolist() == [sum(r) - 1 for r in brute]


def _tree(tokens: list[list[int]], parents: list[list[int]]) -> DraftTree:
    p = torch.tensor(parents)
    return DraftTree(tokens=torch.tensor(tokens), parents=p, depth=depth_from_parents(p))


def test_graft_chains_follows_the_tree_then_branches_and_pads() -> None:
    # root 10 -> (11 -> 13), 12
    tree = _tree([[10, 11, 12, 13], [20, 21, 22, 23]], [[-1, 0, 0, 1], [-1, 0, 0, 1]])
    out = graft_chains(tree, [[11, 13, 7, 8], [30]])
    # row 0: 11 and 13 are already there; 7 -> 8 hang off node 3 (13) as nodes 4, 5
    assert out.tokens[0].tolist() == [10, 11, 12, 13, 7, 8]
    assert out.parents[0].tolist() == [-1, 0, 0, 1, 3, 4]
    assert out.depth[0].tolist() == [0, 1, 1, 2, 3, 4]
    # row 1: 30 is a new child of the root; padded with a copy of it (same parent and token)
    assert out.tokens[1].tolist() == [20, 21, 22, 23, 30, 30]
    assert out.parents[1].tolist() == [-1, 0, 0, 1, 0, 0]
    # every node's path spells its chain prefix, so verification can accept the whole chain
    mask = tree_attention_mask(out.parents)
    assert [int(t) for t, m in zip(out.tokens[0], mask[0, 5]) if m] == [10, 11, 13, 7, 8]


def test_graft_chains_nothing_new_keeps_the_tree() -> None:
    tree = _tree([[10, 11, 12]], [[-1, 0, 1]])
    assert graft_chains(tree, [[11, 12]]) is tree
    assert graft_chains(tree, [[]]) is tree
    # a row without new nodes next to one with: padded by copying its last node
    two = _tree([[10, 11, 12], [5, 6, 7]], [[-1, 0, 1], [-1, 0, 0]])
    out = graft_chains(two, [[11, 12], [6, 9]])
    assert out.tokens.tolist() == [[10, 11, 12, 12], [5, 6, 7, 9]]
    assert out.parents.tolist() == [[-1, 0, 1, 1], [-1, 0, 0, 1]]
    with pytest.raises(ValueError, match="2 trees"):
        graft_chains(two, [[1]])
    with pytest.raises(ValueError, match="besides its root"):
        graft_chains(_tree([[1]], [[-1]]), [[2]])


def _lookup_by_scan(tokens: list[int], k: int, max_n: int) -> list[int]:
    """Prompt lookup spelled out: for n from max_n down to 1, the latest earlier start whose n tokens
    equal the last n (with a token after them); the k tokens after it."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), 0, -1):
        for start in range(size - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[size - n:]:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 20])
def test_prompt_lookup_continues_the_latest_longest_match(vocab: int) -> None:
    from augury.speculative.ngram import MATCH_MAX, MATCH_REACH, longest_match, lookup, matched_lookup

    rng = random.Random(vocab)
    for _ in range(3000):
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        for max_n in (1, 3, 5):
            assert lookup(toks, 4, max_n) == _lookup_by_scan(toks, 4, max_n), (toks, max_n)
        n, at = longest_match(toks, MATCH_MAX)
        want = _lookup_by_scan(toks, 10**6, MATCH_MAX)
        assert (toks[at:] if at >= 0 else []) == want
        # the reach grows with the match: MATCH_REACH tokens per matched one
        assert matched_lookup(toks, 100) == (want[:MATCH_REACH * n], n if want else 0)
        assert matched_lookup(toks, 3)[0] == want[:min(3, MATCH_REACH * n)]
    assert longest_match([1, 2, 3, 9, 1, 2, 3], 8) == (3, 3)  # "1 2 3" then 9
    assert longest_match([7, 1, 2, 8, 1, 2], 1) == (1, 3)  # capped at one token: the latest "2"
    assert longest_match([1, 2, 3], 8) == (0, -1)


def test_a_token_array_follows_its_growing_list() -> None:
    from augury.speculative.ngram import TokenArray

    arr, toks = TokenArray(), [5, 6, 7]
    assert arr.of(toks).tolist() == [5, 6, 7]
    for t in range(300):  # grows past its first buffer, copying only what is new
        toks.append(t % 11)
        assert arr.of(toks).tolist() == toks
    assert arr.of([1, 2]).tolist() == [1, 2]  # another list: started over
    assert arr.of([1, 7, 3]).tolist() == [1, 7, 3]  # its last known token differs: started over


def test_select_tree_in_python_ranks_as_the_torch_path(monkeypatch) -> None:
    """Small batches are selected in Python (tree._select_small): the same trees as the torch path,
    ties and scores that rise along a path included."""
    from augury.speculative import tree as T

    g = torch.Generator().manual_seed(11)
    cases = []
    for b, m in ((1, 1), (1, 3), (1, 20), (2, 12), (3, 52)):
        for _ in range(20):
            pars = torch.tensor([[-1] + [int(torch.randint(-1, j, (1,), generator=g)) for j in range(1, m)]
                                 for _ in range(b)])
            scores = -torch.randint(0, 6, (b, m), generator=g).float() / 2  # many ties
            if int(torch.randint(0, 2, (1,), generator=g)):  # cumulative: non-increasing along paths
                scores = scores.clone()
                for row in range(b):
                    for j in range(m):
                        if pars[row, j] >= 0:
                            scores[row, j] += scores[row, pars[row, j]]
            toks = torch.randint(0, 1000, (b, m), generator=g)
            roots = torch.randint(0, 1000, (b,), generator=g)
            n = int(torch.randint(1, m + 2, (1,), generator=g))
            cases.append((roots, toks, pars, scores, n))
    small = [T.select_tree(*c) for c in cases]
    monkeypatch.setattr(T, "SMALL_TREES", 0)
    for c, got in zip(cases, small):
        want = T.select_tree(*c)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
        assert torch.equal(got.depth, want.depth)
