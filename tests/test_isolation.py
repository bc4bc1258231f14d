"""A fault of one request ends that request alone: a row its logit shaping leaves without any valid
token (bad words covering every token its grammar allows, logit bias), or non-finite logits, gives
NO_TOKEN, the request finishes with finish_reason "error" and a reason, and every other request in
the batch gets exactly the output it gets alone. Plain decoding, speculative verification (EAGLE-3),
greedy and seeded sampling. Tiny float32 targets with a byte-level BPE tokenizer."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from augury import LLM, SamplingParams
from augury.sampling import NO_TOKEN, apply_sampling_filters, argmax_ids, draw_rows
from augury.sampling_params import StructuredOutputsParams as SO
from speculative_helpers import plain_llm, static_eagle3_llm, tokenized_checkpoints


def test_rows_without_a_valid_token_give_no_token():
    ninf = float("-inf")
    rows = torch.tensor([[0.0, 2.0, 1.0], [ninf, ninf, ninf], [0.0, float("nan"), 1.0], [0.0, float("inf"), 1.0]])
    assert argmax_ids(rows) == [1, NO_TOKEN, NO_TOKEN, NO_TOKEN]
    assert argmax_ids(rows.to(torch.float64)) == [1, NO_TOKEN, NO_TOKEN, NO_TOKEN]  # the torch path
    probs = apply_sampling_filters(rows, 1.0)
    assert draw_rows(probs, [0.5] * 4)[1:] == [NO_TOKEN] * 3
    assert draw_rows(probs[:1], [0.5])[0] in (0, 1, 2)
    greedy = apply_sampling_filters(rows, 0.0)  # greedy rows through the filters: no mass where no token
    assert greedy[0].tolist() == [0.0, 1.0, 0.0] and float(greedy[1].sum()) == 0.0
    assert draw_rows(greedy[1:2], [0.3]) == [NO_TOKEN]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    return tokenized_checkpoints(tmp_path_factory.mktemp("isolation"))


def _llm(ckpts, spec: bool) -> LLM:
    return static_eagle3_llm(ckpts) if spec else plain_llm(ckpts)


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [30, 40, 41], [50, 60, 70, 80, 90]]


def _good(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12, temperature=temperature, seed=7 + i, ignore_eos=True,
                           structured_outputs=SO(choice=["yes", "no"]) if i == 1 else None,
                           bad_words=["the"] if i == 2 else None) for i in range(3)]


def _hostile(llm: LLM, kind: str, temperature: float) -> SamplingParams:
    if kind == "choice-banned":  # the grammar allows "a" alone (as one token), and "a" is a bad word
        return SamplingParams(max_tokens=8, temperature=temperature, seed=3,
                              structured_outputs=SO(choice=["a"]), bad_words=["a"])
    # every token biased away, and the few left banned: a row of -inf only after a few tokens of a grammar
    eos = sorted(llm.engine.eos_token_ids)
    words = [llm.engine.tokenizer.decode([t]) for t in eos]
    return SamplingParams(max_tokens=8, temperature=temperature, seed=3, bad_words=words,
                          structured_outputs=SO(regex="(yes|no)"))


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["choice-banned", "eos-banned"])
def test_a_request_without_a_valid_token_fails_alone(ckpts, spec, temperature, kind):
    llm = _llm(ckpts, spec)
    good = _good(temperature)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(PROMPTS, good)]
    bad = _hostile(llm, kind, temperature)
    if kind == "eos-banned":
        assert all(len(llm.engine.tokenizer.encode(w, add_special_tokens=False)) == 1 for w in bad.bad_words)
    outs = llm.generate(PROMPTS[:2] + [PROMPTS[3]] + [PROMPTS[2]], good[:2] + [bad] + [good[2]])
    failed = outs[2]
    assert failed.finish_reason == "error" and "no valid next token" in failed.error
    if kind == "eos-banned":  # the grammar's answer came first; only its end was impossible
        assert failed.text in ("yes", "no")
    for got, want in zip(outs[:2] + outs[3:], alone):
        assert got.finish_reason == want.finish_reason and got.error is None
        assert got.token_ids == want.token_ids
    a = llm.engine.allocator
    assert a.num_free == a.num_usable and not llm.engine.has_unfinished_requests()


def test_a_grammar_refusing_a_committed_token_fails_that_request_alone(ckpts):
    """A fault inside one request's commit (its grammar refuses the token: an engine bug for that
    request) ends that request alone."""
    llm = _llm(ckpts, False)
    good = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], [good])[0]
    engine = llm.engine
    victim = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=10, temperature=0.0,
                                                           structured_outputs=SO(choice=["yes", "no"])))
    other = engine.add_request(PROMPTS[0], good)
    shaper = engine.requests[victim].shaper

    def refuse(token: int) -> bool:
        raise RuntimeError(f"the grammar refused committed token {token}")

    shaper.commit = refuse
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[victim].finish_reason == "error" and "refused committed token" in done[victim].error
    assert done[other].token_ids == alone.token_ids
    assert engine.allocator.num_free == engine.allocator.num_usable


def test_non_finite_logits_fail_that_request_alone(ckpts):
    """The model's row for one request holds a NaN (a numeric fault of its own): that request ends
    with the reason, the others decode as they would alone."""
    llm = _llm(ckpts, False)
    good = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], [good])[0]
    engine = llm.engine
    other = engine.add_request(PROMPTS[0], good)
    victim = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    logits = engine.model.logits

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        out = logits(hidden)
        if len(engine.requests) == 2 and out.shape[0] == 2:  # both decoding: the victim's row is the second
            out[1, 3] = math.nan
        return out

    engine.model.logits = poisoned
    try:
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        del engine.model.logits
    assert done[victim].finish_reason == "error" and "not finite" in done[victim].error
    assert done[other].token_ids == alone.token_ids
    assert len(done[victim].token_ids) < 10  # it ended at the poisoned row
