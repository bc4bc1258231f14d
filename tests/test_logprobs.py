"""Log-probabilities in the Python API: raw log-softmax of the target's logits, the same with and
without speculation (tokens accepted from drafts take the verification's logits), equal to
transformers' own, for generated tokens and the prompt (chunked prefill and preemption too)."""
from __future__ import annotations

import pytest
import torch

from augury import LLM, SamplingParams
from augury.sampling_params import MAX_LOGPROBS
from conftest import hf_logits, random_prompts
from speculative_helpers import checkpoints

K = 5


def _check_same(got, want, atol: float = 1e-5) -> None:
    """Two lists of TokenLogprobs: the same ids, ranks and log-probabilities to allclose(atol, rtol 1e-5)
    (a verification computes the output layer over [B, N] rows, a decode step over [B]: the GEMM
    may round differently in the last bits)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None
            continue
        assert list(g) == list(w), f"position {i}: ids {list(g)} != {list(w)}"
        assert [x.rank for x in g.values()] == [x.rank for x in w.values()], i
        torch.testing.assert_close(torch.tensor([x.logprob for x in g.values()]),
                                   torch.tensor([x.logprob for x in w.values()]), rtol=1e-5, atol=atol)


def test_sampling_params_validates_logprobs():
    assert SamplingParams(logprobs=0, prompt_logprobs=MAX_LOGPROBS).logprobs == 0
    for name in ("logprobs", "prompt_logprobs"):
        for bad in (-1, MAX_LOGPROBS + 1, True, 2.0):
            with pytest.raises(ValueError, match=f"^{name} "):
                SamplingParams(**{name: bad})


def test_logprobs_match_transformers(tiny_checkpoint, hf_model, make_llm):
    folder = tiny_checkpoint("qwen2")
    llm = make_llm(folder, speculative_algorithm="none", max_num_batched_tokens=16)  # chunked prompts
    prompts = random_prompts([7, 23], seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=K,
                                                prompt_logprobs=3), use_tqdm=False)
    model = hf_model(folder)
    for prompt, o in zip(prompts, outs):
        ids = prompt + o.token_ids
        ref = torch.log_softmax(hf_logits(model, ids[:-1]), dim=-1)  # row p: the token at p + 1
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(prompt)
        assert len(o.logprobs) == len(o.token_ids)
        entries = o.prompt_logprobs[1:] + o.logprobs
        for p, (tok, d) in enumerate(zip(ids[1:], entries)):
            want_k = 3 if p + 1 < len(prompt) else K
            top = ref[p].topk(want_k)
            assert next(iter(d)) == tok
            assert abs(d[tok].logprob - ref[p, tok].item()) < 1e-4
            assert d[tok].rank == int((ref[p] > ref[p, tok]).sum()) + 1
            assert set(d) == {tok} | set(top.indices.tolist())
            for j, t in enumerate(top.indices.tolist()):
                assert abs(d[t].logprob - top.values[j].item()) < 1e-4
        assert all(next(iter(d.values())).rank == 1 for d in o.logprobs)  # greedy: always the top token


def test_sampled_tokens_report_the_raw_distribution(tiny_checkpoint, hf_model, make_llm):
    """At temperature 2 the chosen token's logprob is still the raw log-softmax (not the tempered one)."""
    folder = tiny_checkpoint("llama")
    llm = make_llm(folder, speculative_algorithm="none")
    prompt = random_prompts([6], seed=2)[0]
    o = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=2.0, seed=3, ignore_eos=True, logprobs=0),
                     use_tqdm=False)[0]
    ids = prompt + o.token_ids
    ref = torch.log_softmax(hf_logits(hf_model(folder), ids[:-1]), dim=-1)[len(prompt) - 1:]
    assert [list(d) for d in o.logprobs] == [[t] for t in o.token_ids]
    got = torch.tensor([d[t].logprob for d, t in zip(o.logprobs, o.token_ids)])
    want = ref[torch.arange(len(o.token_ids)), torch.tensor(o.token_ids)]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("lp"))


def _spec_llm(target, head=None, **kw) -> LLM:
    if head is None:
        return LLM(str(target), dtype="float32", speculative_algorithm="ngram", speculative_policy="static",
                   log_stats_interval=0, **kw)
    return LLM(str(target), dtype="float32", draft_model=str(head), speculative_algorithm="eagle3",
               speculative_policy="static", speculative_num_steps=3, speculative_eagle_topk=2,
               speculative_num_draft_tokens=6, log_stats_interval=0, **kw)


@pytest.mark.parametrize("which", ["eagle3-random", "eagle3-bigram", "eagle3-bigram-rows", "ngram-bigram"])
def test_logprobs_identical_with_and_without_speculation(ckpts, which, monkeypatch):
    if which.endswith("-rows"):  # verification computes logits only at the nodes it visits
        from augury.speculative import worker

        monkeypatch.setattr(worker, "LOGITS_AT_ONCE", 0)
    target = ckpts["target"] if which == "eagle3-random" else ckpts["bigram"]
    head = {"eagle3-random": ckpts["head"], "ngram-bigram": None}.get(which, ckpts["bigram_head"])
    prompts = random_prompts([5, 17, 30, 9], seed=8)
    lens = [14, 25, 8, 20]
    budgets = [None, 2, None, 0]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=K, prompt_logprobs=2,
                             max_draft_tokens=c) for m, c in zip(lens, budgets)]
    plain = LLM(str(target), dtype="float32", speculative_algorithm="none", log_stats_interval=0,
                max_num_batched_tokens=16)  # prompts chunked the same way
    want = plain.generate(prompts, params, use_tqdm=False)
    # a small cache forces preemption (recompute must not add prompt logprobs twice), small chunks split prompts
    llm = _spec_llm(target, head, num_kv_blocks=20, block_size=8, max_num_batched_tokens=16)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in got) > 0 or which == "eagle3-random"
    assert any(o.spec_stats.num_verify_steps for o in got)
    for g, w in zip(got, want):
        _check_same(g.logprobs, w.logprobs)
        _check_same(g.prompt_logprobs, w.prompt_logprobs, atol=1e-4)  # a recompute chunks differently
        assert len(g.prompt_logprobs) == len(g.prompt_token_ids)


def test_logprobs_stop_where_a_stop_token_cuts_a_verified_path(ckpts):
    target = ckpts["bigram"]
    prompts = random_prompts([6], seed=4)
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1)
    full = LLM(str(target), dtype="float32", speculative_algorithm="none",
               log_stats_interval=0).generate(prompts, base, use_tqdm=False)[0]
    stop = full.token_ids[12]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1, stop_token_ids=[stop])
    o = _spec_llm(target, ckpts["bigram_head"]).generate(prompts, params, use_tqdm=False)[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == stop
    assert o.spec_stats.num_accepted_draft_tokens > 0
    assert len(o.logprobs) == len(o.token_ids)
    _check_same(o.logprobs, full.logprobs[: len(o.token_ids)])
