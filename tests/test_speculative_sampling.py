"""Speculative sampling through the whole engine reproduces the target's distribution."""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from augury import LLM, SamplingParams
from speculative_helpers import make_target, random_head

V = 8
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    target = make_target(root / "target", vocab=V, seed=3)
    head = random_head(root / "head", vocab=V, draft_vocab=V, seed=4)
    return target, head


def _exact(target, prompt: list[int], temperature: float = TEMPERATURE) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) [V, V, V] at `temperature`, from transformers' own forward."""
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    seqs = [prompt + list(s) for k in range(3) for s in itertools.product(range(V), repeat=k)]
    probs = {}
    with torch.no_grad():
        for s in seqs:
            logits = model(torch.tensor([s])).logits[0, -1]
            probs[tuple(s[len(prompt):])] = torch.softmax(logits.double() / temperature, -1)
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for a, b, c in itertools.product(range(V), repeat=3):
        joint[a, b, c] = probs[()][a] * probs[(a,)][b] * probs[(a, b)][c]
    return joint


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts, probs = counts.flatten().double(), probs.flatten()
    keep = probs * counts.sum() >= 5  # pool the sparse cells so the chi-square stays valid
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([probs[keep], probs[~keep].sum().view(1)]) * counts.sum()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("shape", [(2, 1, 3, 0), (2, 2, 4, 0), (2, 2, 4, 3)], ids=["chain", "tree", "tree+ngram"])
def test_speculative_sampling_matches_target(small, shape):
    target, head = small
    prompt = [3, 5, 1, 6]
    n = 4000
    llm = LLM(str(target), dtype="float32", draft_model=str(head), speculative_algorithm="eagle3",
              speculative_policy="static", speculative_num_steps=shape[0], speculative_eagle_topk=shape[1],
              speculative_num_draft_tokens=shape[2], speculative_ngram_branch=shape[3], max_num_seqs=256,
              log_stats_interval=0)
    params = [SamplingParams(max_tokens=3, temperature=TEMPERATURE, seed=i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    stats = llm.engine.stats
    assert stats.num_verify_steps > n // 2 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if shape[3]:  # the lookup branch was there to accept or reject
        assert stats.num_draft_tokens > stats.num_verify_steps * (shape[2] - 1)
    counts = torch.zeros(V, V, V)
    for o in outs:
        counts[tuple(o.token_ids)] += 1
    exact = _exact(target, prompt)
    # the tokens that came out of verification: t2 and t3 (t1 is the prefill's sample)
    assert _chi2(counts.sum(0), exact.sum(0)) > 1e-3
    assert _chi2(counts.sum((0, 2)), exact.sum((0, 2))) > 1e-3
    assert _chi2(counts.sum((0, 1)), exact.sum((0, 1))) > 1e-3
    # and the test has power: a distribution at temperature 1.0 instead of 0.8 is rejected
    hot = _exact(target, prompt, temperature=1.0)
    assert _chi2(counts.sum(0), hot.sum(0)) < 1e-6

