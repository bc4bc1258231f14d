"""Verification: greedy against brute force and plain greedy decoding; sampling against the exact
target distribution (chi-square), with deliberately biased verifiers proving the test has power."""
from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from augury import sampling
from augury.cpu import kernels as cpu_kernels
from augury.sampling import apply_sampling_filters
from augury.speculative import verifier
from augury.speculative.tree import DraftTree, chain_tree, depth_from_parents
from augury.speculative.verifier import verify
from speculative_helpers import fresh_uniforms, verify_greedy, verify_sampling


def _tree(tokens: list[list[int]], parents: list[list[int]]) -> DraftTree:
    p = torch.tensor(parents)
    return DraftTree(tokens=torch.tensor(tokens), parents=p, depth=depth_from_parents(p))


# ------------------------------------------------------------------------------------------ greedy

def test_argmax_ids_is_torchs_argmax() -> None:
    """The greedy token plain decoding and verification both take (sampling.argmax_ids, numpy's argmax
    on the CPU): torch.argmax's answer on random rows, on ties (the first maximal index), on masked rows
    (-inf but for a few tokens), on a strided view, and for bfloat16 (torch's own); NO_TOKEN where the
    row is all -inf (no valid token: tests/test_isolation.py)."""
    from augury.sampling import NO_TOKEN, argmax_ids

    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 49152, generator=g)
    x[1, [10, 30000, 49151]] = 50.0  # a tie: the first
    x[2] = float("-inf")
    x[2, [4000, 123]] = torch.tensor([1.5, 1.5])
    x[3] = float("-inf")
    x[4, -1] = 99.0
    for t in (x, x[:, ::2], x[5], x.to(torch.bfloat16)):
        want = t.argmax(dim=-1).tolist()
        if t.dim() == 2:
            want[3] = NO_TOKEN
        assert argmax_ids(t) == want
    assert argmax_ids(x)[1] == 10 and argmax_ids(x)[2] == 123 and argmax_ids(x)[4] == 49151



def test_greedy_hand_made() -> None:
    #  root(0) -> 3 (1), 4 (2);  3 -> 1 (3), 2 (4);  4 -> 0 (5)
    tree = _tree([[9, 3, 4, 1, 2, 0]] * 3, [[-1, 0, 0, 1, 1, 2]] * 3)
    argmax = [
        [4, 0, 0, 0, 0, 5],  # root wants 4 (node 2), node 2 wants 0 (node 5), node 5 wants 5 -> bonus 5
        [3, 2, 0, 0, 1, 0],  # root wants 3 (node 1), node 1 wants 2 (node 4), leaf node 4 -> bonus 1
        [2, 0, 0, 0, 0, 0],  # root wants 2: no child -> bonus 2
    ]
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 6).float()
    res = verify_greedy(tree, logits)
    assert res.accepted_nodes == [[0, 2, 5], [0, 1, 4], [0]]
    assert res.bonus_tokens == [5, 1, 2]
    assert res.num_accepted == [2, 2, 0]
    assert res.committed_tokens(tree) == [[4, 0, 5], [3, 2, 1], [2]]


def _context_logits(prefix: tuple[int, ...], v: int) -> np.ndarray:
    """A target whose logits depend on the whole context (a fixed pseudo-random function)."""
    return np.random.default_rng(abs(hash(prefix)) % (2**32)).normal(size=v)


def test_greedy_equals_plain_greedy_decoding_on_random_trees() -> None:
    rng, v, n, bsz = random.Random(0), 5, 12, 40
    tokens, parents, logits, greedy_seqs = [], [], [], []
    for b in range(bsz):
        root = rng.randrange(v)
        seq, prefix = [], (root,)
        for _ in range(n):  # plain greedy decoding, the reference
            seq.append(int(np.argmax(_context_logits(prefix, v))))
            prefix += (seq[-1],)
        toks, pars, paths = [root], [-1], [(root,)]
        while len(toks) < n:
            i = len(toks)
            par = rng.randrange(i)
            depth = len(paths[par])
            # half the drafts follow the greedy sequence so that long acceptances happen
            tok = seq[depth - 1] if rng.random() < 0.5 and depth <= len(seq) else rng.randrange(v)
            siblings = {toks[j] for j in range(1, i) if pars[j] == par}
            if tok in siblings:  # drafts from top-k never repeat a token among siblings
                continue
            toks.append(tok)
            pars.append(par)
            paths.append(paths[par] + (tok,))
        tokens.append(toks)
        parents.append(pars)
        logits.append([_context_logits(p, v) for p in paths])
        greedy_seqs.append((seq, paths))
    tree = _tree(tokens, parents)
    res = verify_greedy(tree, torch.tensor(np.array(logits), dtype=torch.float32))
    for b, (seq, paths) in enumerate(greedy_seqs):
        out = res.committed_tokens(tree)[b]
        assert out == seq[: len(out)]
        # brute force: the longest tree path that spells a prefix of the greedy sequence
        best = max(len(p) - 1 for p in paths if list(p[1:]) == seq[: len(p) - 1])
        assert res.num_accepted[b] == best
        path = res.accepted_nodes[b]
        assert all(tree.parents[b, path[i]].item() == path[i - 1] for i in range(1, len(path)))
    # verify() with temperature 0 is the same greedy walk
    mixed = verify(tree, torch.tensor(np.array(logits), dtype=torch.float32), [0.0] * bsz, [None] * bsz, [1.0] * bsz, None)
    assert mixed == res


# ----------------------------------------------------------------------------------------- filters

def _ref_filter(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float) -> np.ndarray:
    """Reference top-k / top-p for one row, float64."""
    z = logits.astype(np.float64) / temperature
    if top_k:
        z = np.where(z < np.sort(z)[::-1][top_k - 1], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        srt = np.sort(p)[::-1]
        kept = srt[(np.cumsum(srt) - srt) < top_p]
        p = np.where(p < kept[-1], 0.0, p)
        p /= p.sum()
    return p


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (0.5, 3, 1.0), (1.7, None, 0.6), (1.0, 5, 0.8), (0.9, 2, 0.3)])
def test_apply_sampling_filters_matches_reference(temperature: float, top_k: int | None, top_p: float) -> None:
    logits = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(1))
    probs = apply_sampling_filters(logits, temperature, top_k, top_p)
    ref = np.array([[_ref_filter(row, temperature, top_k, top_p) for row in r] for r in logits.numpy()])
    np.testing.assert_allclose(probs.numpy(), ref, atol=1e-6)
    assert ((probs == 0) == (torch.from_numpy(ref) == 0)).all()


def test_apply_sampling_filters_per_row_no_ops_and_greedy() -> None:
    logits = torch.randn(4, 3, 50, generator=torch.Generator().manual_seed(2))
    probs = apply_sampling_filters(logits, [0.8, 0.0, 1.0, 1.2], [None, 7, 4, -1], [1.0, 0.5, 0.9, 1.0])
    # top_k None / -1 and top_p 1 are exact no-ops
    assert torch.equal(probs[0], torch.softmax(logits[0] / 0.8, dim=-1))
    assert torch.equal(probs[3], torch.softmax(logits[3] / 1.2, dim=-1))
    # temperature 0: one-hot argmax, whatever top-k / top-p say
    assert torch.equal(probs[1], torch.nn.functional.one_hot(logits[1].argmax(-1), 50).float())
    ref = np.array([_ref_filter(r, 1.0, 4, 0.9) for r in logits[2].numpy()])
    np.testing.assert_allclose(probs[2].numpy(), ref, atol=1e-6)
    # a single [V] row, as the plain sampler passes it, gets the same answer
    assert torch.equal(apply_sampling_filters(logits[2, 0], 1.0, 4, 0.9), probs[2, 0])


# ---------------------------------------------------------------------------- sampling, statistics

V, ROOT = 6, 1
ROOT_KIDS = [2, 0, 5]  # a 2-level tree: 3 children of the root, 2 children under each


def _stat_tree(roots: torch.Tensor, root_kids: list[int] = ROOT_KIDS) -> DraftTree:
    """[B] roots -> nodes 0 | 1 2 3 | 4 5 (under 1), 6 7 (under 2), 8 9 (under 3)."""
    b = roots.shape[0]
    toks = list(root_kids)
    for t in root_kids:
        toks += [(t + 1) % V, (t + 4) % V]
    tokens = torch.cat([roots.view(b, 1), torch.tensor(toks).expand(b, 9)], dim=1)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]).expand(b, 10)
    return DraftTree(tokens=tokens, parents=parents, depth=depth_from_parents(parents))


# A Markov target: the next-token logits depend on the last token.
TARGET = torch.randn(V, V, generator=torch.Generator().manual_seed(7)) * 1.2


def _emit_two(b: int, temperature: float, top_k: int | None, top_p: float, seed: int,
              root_kids: list[int] = ROOT_KIDS) -> np.ndarray:
    """First two emitted tokens of b independent requests -> [b, 2]; a request that emits only one
    token in the first step runs a second step rooted at it."""
    def step(roots: torch.Tensor) -> list[list[int]]:
        tree = _stat_tree(roots, root_kids)
        n = roots.shape[0]
        fresh = fresh_uniforms(tree, range(n))  # the global generator, seeded below
        res = verify(tree, TARGET[tree.tokens], [temperature] * n, [top_k] * n, [top_p] * n,
                     [fresh[b] for b in range(n)])
        return res.committed_tokens(tree)

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        first = step(torch.full((b,), ROOT))
        again = [i for i, out in enumerate(first) if len(out) == 1]
        second = step(torch.tensor([first[i][0] for i in again])) if again else []
    out = np.array([[t[0], t[1] if len(t) > 1 else -1] for t in first])
    for i, t in zip(again, second):
        out[i, 1] = t[0]
    return out


def _chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; zero-probability cells must be empty, cells expecting fewer than
    5 counts are pooled into one."""
    observed, probs = observed.ravel().astype(np.float64), probs.ravel()
    assert observed[probs == 0].sum() == 0, "a token with zero target probability was emitted"
    expected = probs * observed.sum()
    big, small = expected >= 5, (expected > 0) & (expected < 5)
    obs = np.append(observed[big], observed[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def _pvalues(temperature: float, top_k: int | None, top_p: float, b: int = 12000, seed: int = 0,
             root_kids: list[int] = ROOT_KIDS) -> tuple[float, float]:
    q = np.array([_ref_filter(row, temperature, top_k, top_p) for row in TARGET.numpy()])  # [V, V] exact
    out = _emit_two(b, temperature, top_k, top_p, seed, root_kids)
    first = np.bincount(out[:, 0], minlength=V)
    joint = np.bincount(out[:, 0] * V + out[:, 1], minlength=V * V).reshape(V, V)
    exact_joint = q[ROOT][:, None] * q                                     # p(t1) p(t2 | t1)
    return _chi2_pvalue(first, q[ROOT]), _chi2_pvalue(joint, exact_joint)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, 3, 1.0), (1.5, None, 0.8), (1.0, 4, 0.7)])
def test_sampling_is_lossless(temperature: float, top_k: int | None, top_p: float) -> None:
    p_first, p_joint = _pvalues(temperature, top_k, top_p)
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


def test_sampling_is_lossless_with_repeated_sibling_tokens() -> None:
    # not what top-k drafting produces, but a repeated token must never be accepted twice over
    p_first, p_joint = _pvalues(1.0, None, 1.0, b=6000, root_kids=[2, 2, 5])
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


_exact_draw = sampling.draw_rows
_exact_kernel_draw = cpu_kernels.Elementwise.draw


def _biased_draw_squared(probs, uniforms):  # the uniform squared: low CDF mass drawn too often
    return _exact_draw(probs, [u * u for u in uniforms])


def _biased_kernel_draw_squared(self, logits, temperatures, top_ks, top_ps, min_ps, uniforms):  # the same, the kernel's
    return _exact_kernel_draw(self, logits, temperatures, top_ks, top_ps, min_ps, [u * u for u in uniforms])


def _biased_one_uniform_per_step(uniforms, row, level):  # every position of a step at one uniform
    return uniforms[row][0]


def _biased_accept_first_child(kid_toks, drawn):  # takes the first child whenever the draw is among the children
    return [0 if t in kt else -1 for kt, t in zip(kid_toks, drawn)]


_exact_filters = sampling.apply_sampling_filters


def _biased_no_temperature(logits, temperature, top_k=None, top_p=1.0, min_p=0.0):  # temperature forgotten
    return _exact_filters(logits, 1.0, top_k, top_p, min_p)


def _biased_kernel_no_temperature(self, logits, temperatures, top_ks, top_ps, min_ps, uniforms):
    return _exact_kernel_draw(self, logits, [1.0] * len(temperatures), top_ks, top_ps, min_ps, uniforms)


_KERNEL = pytest.mark.skipif(cpu_kernels.elementwise() is None, reason="augury's CPU kernels do not run here")


# verify draws through sampling.draw_sampled: by augury's kernel where it runs (Elementwise.draw), else
# by draw_rows of apply_sampling_filters (looked up in augury.sampling); the torch path's controls run
# with the kernel off
@pytest.mark.parametrize("where,name,patch,kernel", [
    (sampling, "draw_rows", _biased_draw_squared, False),
    (verifier, "_uniform_at", _biased_one_uniform_per_step, False),
    (verifier, "_match", _biased_accept_first_child, False),
    (sampling, "apply_sampling_filters", _biased_no_temperature, False),
    pytest.param(cpu_kernels.Elementwise, "draw", _biased_kernel_draw_squared, True, marks=_KERNEL),
    pytest.param(cpu_kernels.Elementwise, "draw", _biased_kernel_no_temperature, True, marks=_KERNEL),
])
def test_biased_verifiers_fail_the_test(monkeypatch: pytest.MonkeyPatch, where, name: str, patch: Callable,
                                        kernel: bool) -> None:
    monkeypatch.setattr(where, name, patch)
    if not kernel:
        monkeypatch.setattr(sampling, "_draw_kernel", lambda: None)
    p_first, p_joint = _pvalues(1.5, None, 0.8, b=4000)
    assert min(p_first, p_joint) < 1e-6, (p_first, p_joint)


def test_sampling_is_lossless_through_torchs_filters_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path where augury's kernels do not run (draw_rows of apply_sampling_filters)."""
    monkeypatch.setattr(sampling, "_draw_kernel", lambda: None)
    for args in [(1.0, None, 1.0), (1.0, 4, 0.7)]:
        p_first, p_joint = _pvalues(*args)
        assert p_first > 1e-3 and p_joint > 1e-3, (args, p_first, p_joint)


# ------------------------------------------------------------------------ sampling, determinism

def _gens(seeds: list[int], levels: int = 6) -> list[list[float]]:
    """Per request, the uniforms of its next `levels` positions from a seeded stream."""
    return [torch.rand(levels, dtype=torch.float64, generator=torch.Generator().manual_seed(s)).tolist() for s in seeds]


def test_sampling_seeded_and_independent_of_batch() -> None:
    logits = torch.randn(5, 10, V, generator=torch.Generator().manual_seed(3))
    tree = _stat_tree(torch.tensor([1, 2, 3, 4, 5]))
    args = ([1.0, 0.8, 1.0, 0.0, 1.3], [None, 3, None, None, 4], [1.0, 1.0, 0.7, 1.0, 0.9])
    full = verify(tree, logits, *args, _gens([10, 11, 12, 13, 14]))
    assert full == verify(tree, logits, *args, _gens([10, 11, 12, 13, 14]))
    for b in range(5):  # the same request alone, with the same seed, gets the same tokens
        alone = verify(_stat_tree(torch.tensor([b + 1])), logits[b : b + 1], *([a[b]] for a in args), _gens([10 + b]))
        assert alone.accepted_nodes[0] == full.accepted_nodes[b] and alone.bonus_tokens[0] == full.bonus_tokens[b]


def test_sampled_tokens_are_plain_sampling_at_the_same_uniforms_whatever_the_tree() -> None:
    """A Markov target: the committed tokens of any tree (the right children, wrong ones, none) are
    the tokens plain sampling draws position by position at the same uniforms."""
    gen = torch.Generator().manual_seed(12)
    probs_of = apply_sampling_filters(TARGET, 1.2, None, 0.95)  # [V, V]: next-token distribution per token
    for trial in range(200):
        u = torch.rand(3, dtype=torch.float64, generator=gen).tolist()
        root = int(torch.randint(V, (), generator=gen))
        plain, last = [], root
        for x in u:
            last = verifier.draw_rows(probs_of[last][None], [x])[0]
            plain.append(last)
        kids = torch.randint(V, (3,), generator=gen).tolist()
        if trial % 3 == 0:
            kids[trial % 9 // 3] = plain[0]  # sometimes the right token is among the root's children
        tree = _stat_tree(torch.tensor([root]), kids)
        res = verify_sampling(tree, probs_of[tree.tokens], [u])
        got = res.committed_tokens(tree)[0]
        assert got == plain[: len(got)]
        deep = plain[0] in kids and plain[1] in ((plain[0] + 1) % V, (plain[0] + 4) % V)  # its children
        assert len(got) == (1 if plain[0] not in kids else 3 if deep else 2)


def test_verify_matches_verify_sampling_on_filtered_probs() -> None:
    b = 64
    logits = torch.randn(b, 10, V, generator=torch.Generator().manual_seed(4)) * 2
    tree = _stat_tree(torch.randint(0, V, (b,), generator=torch.Generator().manual_seed(5)))
    temps, ks, ps = [0.9] * b, [4] * b, [0.85] * b
    lazy = verify(tree, logits, temps, ks, ps, _gens(list(range(b))))
    probs = apply_sampling_filters(logits, 0.9, 4, 0.85)
    eager = verify_sampling(tree, probs, _gens(list(range(b))))
    assert lazy == eager
    # a mixed batch: greedy rows equal verify_greedy, sampled rows equal verify_sampling
    temps = [0.0 if i % 2 else 0.9 for i in range(b)]
    mixed = verify(tree, logits, temps, ks, ps, _gens(list(range(b))))
    greedy = verify_greedy(tree, logits)
    for i in range(b):
        ref = greedy if i % 2 else eager
        assert (mixed.accepted_nodes[i], mixed.bonus_tokens[i]) == (ref.accepted_nodes[i], ref.bonus_tokens[i])


def test_sampling_one_hot_target_is_deterministic_and_chain_works() -> None:
    # top_k=1 makes the target deterministic: sampling verification must then act greedily
    logits = torch.randn(8, 5, 11, generator=torch.Generator().manual_seed(6))
    drafts = logits[:, :4].argmax(-1)
    drafts[4:, 2] = (drafts[4:, 2] + 1) % 11  # half the requests diverge at the third draft
    tree = chain_tree(torch.zeros(8, dtype=torch.long), drafts)
    # the target at node i predicts drafts[i] (node i+1), so rows 0-3 accept all 4 drafts, rows 4-7 two
    res = verify(tree, logits, [1.0] * 8, [1] * 8, [1.0] * 8, _gens(list(range(8))))
    assert res == verify_greedy(tree, logits)
    assert res.num_accepted == [4] * 4 + [2] * 4
    assert res.bonus_tokens == logits[torch.arange(8), torch.tensor(res.num_accepted)].argmax(-1).tolist()


def test_top_p_on_large_vocab_prefix_and_fallback() -> None:
    # row 0 is nearly flat (its nucleus needs more than the 1024-token prefix), row 1 is peaked
    logits = torch.randn(2, 3000, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    logits[0] *= 0.05
    logits[1] *= 6.0
    for top_k in (None, 2000):
        probs = apply_sampling_filters(logits.float(), 1.0, top_k, 0.9)
        ref = np.array([_ref_filter(row, 1.0, top_k, 0.9) for row in logits.float().numpy()])
        np.testing.assert_allclose(probs.numpy(), ref, atol=1e-6)
        assert ((probs > 0).sum(-1) == torch.from_numpy((ref > 0).sum(-1))).all()
    assert (probs[0] > 0).sum() > 1024 and (probs[1] > 0).sum() < 1024


def test_root_only_trees_and_row_function() -> None:
    logits = torch.randn(3, 1, V, generator=torch.Generator().manual_seed(9))
    tree = _stat_tree(torch.tensor([0, 1, 2]))
    tree = DraftTree(tokens=tree.tokens[:, :1], parents=tree.parents[:, :1], depth=tree.depth[:, :1])
    res = verify(tree, logits, [0.0, 1.0, 0.5], [None, None, 2], [1.0, 0.9, 1.0], _gens([1, 2, 3]))
    assert res.accepted_nodes == [[0]] * 3 and res.bonus_tokens[0] == int(logits[0, 0].argmax())
    # the same through a row function (what an engine with a lazy lm_head passes)
    calls: list[int] = []

    def rows(bs: list[int], ns: list[int]) -> torch.Tensor:
        calls.append(len(bs))
        return logits[bs, ns]

    assert verify(tree, rows, [0.0, 1.0, 0.5], [None, None, 2], [1.0, 0.9, 1.0], _gens([1, 2, 3])) == res
    assert sorted(calls) == [1, 2]  # one greedy level, one sampling level


def test_the_package_holds_no_test_only_verifiers() -> None:
    """verify_greedy, verify_sampling and fresh_uniforms served tests only: they live in
    tests/speculative_helpers.py, and the engine's verify() takes every sampled row's uniforms
    (Request.uniforms) instead of drawing global ones."""
    import inspect

    from augury.models import quant

    for name in ("verify_greedy", "verify_sampling", "fresh_uniforms"):
        assert not hasattr(verifier, name), name
    assert not hasattr(quant.Int8Linear, "reference_dequantize")
    tree = _stat_tree(torch.tensor([1, 2]))
    logits = torch.randn(2, 10, V)
    with pytest.raises(ValueError, match="uniforms"):
        verify(tree, logits, [0.0, 1.0], [None, None], [1.0, 1.0], None)
    with pytest.raises(ValueError, match="uniforms"):
        verify(tree, logits, [0.0, 1.0], [None, None], [1.0, 1.0], [None, None])
    greedy = verify(tree, logits, [0.0, 0.0], [None, None], [1.0, 1.0], None)  # greedy rows need none
    assert greedy == verify_greedy(tree, logits)
    assert "torch.rand" not in inspect.getsource(verifier)
