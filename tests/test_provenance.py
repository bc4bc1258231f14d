"""Per-token provenance and per-step speculation decisions (SamplingParams.return_token_sources):
each generated token's source (an accepted draft of the EAGLE-3 head, of prompt lookup, a grammar's
forced token, or the target's own) and each decode step's SpecStep, through the engine; nothing kept
for a request that does not ask."""
from __future__ import annotations

import pytest

from augury.outputs import TOKEN_SOURCES, MergedOutputs
from augury.sampling_params import OutputKind, SamplingParams
from augury.speculative.policy import reason
from augury.structured import make_shaper

SCHEMA = {"type": "object", "required": ["description_of_item", "category_name"], "properties": {
    "description_of_item": {"enum": ["a very long fixed value", "another fixed value entirely"]},
    "category_name": {"enum": ["first category", "second category"]}}}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [30, 40], [50, 60, 70, 80, 90]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A 2-layer random target with the server tests' byte-level tokenizer, and a random EAGLE-3 head
    (its drafts all but never accepted: what is accepted came from elsewhere)."""
    from speculative_helpers import tokenized_checkpoints

    return tokenized_checkpoints(tmp_path_factory.mktemp("provenance"))


def _llm(ckpts, **kw):
    from augury import LLM

    opts = dict(dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
                speculative_policy="static", speculative_num_steps=3, speculative_eagle_topk=2,
                speculative_num_draft_tokens=6, speculative_ngram_branch=4, log_stats_interval=0, max_num_seqs=4)
    opts.update(kw)
    return LLM(str(ckpts["target"]), **opts)


def _json(**kw) -> SamplingParams:
    from augury.sampling_params import StructuredOutputsParams as SO

    return SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=SO(json=SCHEMA), **kw)


def _check_agrees_with_stats(o) -> None:
    """token_sources: one per token, and the drafts among them are what spec_stats counted by source;
    spec_steps: one per decode step, their drafts and accepted drafts what spec_stats counted."""
    s, src, steps = o.spec_stats, o.token_sources, o.spec_steps
    assert len(src) == len(o.token_ids) and set(src) <= set(TOKEN_SOURCES)
    assert src.count("head") == s.num_head_accepted_tokens
    assert src.count("lookup") == s.num_lookup_accepted_tokens
    assert src.count("forced") == s.num_forced_accepted_tokens
    # every decode step emits its accepted drafts and one token of the target's own (the prefill the first),
    # but where the output ended at a draft (the last step's own token then never came)
    most = 1 + len(steps) + sum(st.accepted for st in steps)
    assert most - 1 <= len(o.token_ids) <= most
    assert src.count("target") <= 1 + len(steps)
    verifying = [st for st in steps if st.draft_tokens]
    assert len(verifying) == s.num_verify_steps
    assert sum(st.draft_tokens for st in steps) == s.num_draft_tokens
    assert sum(st.accepted for st in steps) == s.num_accepted_draft_tokens
    assert all(st.mode in ("draft", "free") for st in verifying)
    assert all(st.mode == "plain" and st.accepted == 0 for st in steps if not st.draft_tokens)
    assert all(st.reason for st in steps)


def test_each_token_says_how_it_came_and_each_step_what_speculation_did(ckpts):
    """A JSON answer (most of it the grammar's forced tokens) and a free-text one under a static tree:
    the sources agree with spec_stats token for token; forced tokens are marked forced; the head's
    steps say why (the static policy's configured tree)."""
    llm = _llm(ckpts)
    chat = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, return_token_sources=True)
    js, free = llm.generate(PROMPTS[:2], [_json(return_token_sources=True), chat], use_tqdm=False)
    for o in (js, free):
        _check_agrees_with_stats(o)
    assert js.token_sources.count("forced") >= len(js.token_ids) // 2, js.token_sources
    # a token marked forced is one the grammar forces where it was committed: replayed through a fresh
    # shaper of the same schema, the grammar's jump-forward from the tokens before it starts with it
    eng = llm.engine
    shaper = make_shaper(_json(), js.prompt_token_ids, vocab_size=eng.model_cfg.vocab_size, device=eng.device,
                         tokenizer=eng.tokenizer, backend=eng.grammar, eos_token_ids=eng.eos_token_ids)
    for t, src in zip(js.token_ids, js.token_sources):
        if src == "forced":
            assert shaper.forced_tokens(1) == [t]
        shaper.commit(t)
    assert free.token_sources.count("forced") == 0
    assert all(st.mode == "draft" and st.draft_tokens >= 5 for st in free.spec_steps)  # 5 head, lookup's
    assert all(st.reason == "the configured tree (static policy)" for st in free.spec_steps if st.mode == "draft")


def test_without_the_flag_nothing_is_kept_or_returned(ckpts):
    llm = _llm(ckpts)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    rid = llm.engine.add_request(PROMPTS[0], params)
    req = llm.engine.requests[rid]
    assert req.token_sources is None and req.spec_steps is None
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert outs and all(o.token_sources is None and o.spec_steps is None for o in outs)
    with pytest.raises(ValueError, match="return_token_sources"):
        SamplingParams(return_token_sources="yes")


def test_deltas_concatenate_to_the_whole_and_merge(ckpts):
    """Delta outputs carry each step's new sources and steps: concatenated (or merged, as a lagging
    reader gets them) they are the final cumulative output's."""
    eng = _llm(ckpts).engine
    rid = eng.add_request(PROMPTS[2], _json(return_token_sources=True, output_kind=OutputKind.DELTA))
    whole = eng.requests[rid]  # what the request kept, all of it
    deltas = []
    while eng.has_unfinished_requests():
        deltas += eng.step()
    assert len(deltas) > 2 and whole.spec_steps
    assert [s for d in deltas for s in d.token_sources] == whole.token_sources
    assert len(whole.token_sources) == len(whole.output_token_ids) == sum(len(d.token_ids) for d in deltas)
    assert [s for d in deltas for s in d.spec_steps] == whole.spec_steps
    merged = MergedOutputs(deltas[0], delta=True)
    for d in deltas[1:]:
        merged.add(d)
    taken = merged.take()
    assert taken.token_sources == whole.token_sources and taken.spec_steps == whole.spec_steps


def test_plain_engine_and_opted_out_requests_say_why_they_did_not_draft(ckpts):
    from augury import LLM

    plain = LLM(str(ckpts["target"]), dtype="float32", log_stats_interval=0)
    o = plain.generate([PROMPTS[0]], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                     return_token_sources=True)], use_tqdm=False)[0]
    assert o.token_sources == ["target"] * 6
    assert [st.reason for st in o.spec_steps] == ["speculation is off on this server"] * 5
    out = _llm(ckpts).generate([PROMPTS[1]], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                             max_draft_tokens=0, return_token_sources=True)],
                               use_tqdm=False)[0]
    assert out.token_sources == ["target"] * 6
    assert {st.reason for st in out.spec_steps} == {"this request does not draft (max_draft_tokens 0)"}


def test_the_adaptive_policy_gives_its_measured_reason(ckpts):
    """Under the adaptive policy with a fake clock where drafting pays only if the head's drafts are
    accepted: the steps' reasons are the policy's own (measuring, probing, its predicted tokens per
    second drafting against plain), and a plain step says so."""
    from policy_helpers import fake_clock

    llm = _llm(ckpts, speculative_policy="adaptive", speculative_eagle_topk=1, speculative_num_draft_tokens=4,
               speculative_ngram_branch=0)
    fake_clock(llm.engine.speculator.policy, 0.040, 0.002)
    chat = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, return_token_sources=True)
    o = llm.generate([PROMPTS[3]], [chat], use_tqdm=False)[0]
    _check_agrees_with_stats(o)
    reasons = [st.reason for st in o.spec_steps]
    assert reasons[0].startswith("measuring plain decoding first"), reasons[:3]
    assert any(r.startswith("probing drafting depth") for r in reasons), reasons
    assert any("tok/s drafting depth" in r and "tok/s plain" in r for r in reasons), reasons


def test_reason_words_every_decision():
    assert reason(("on", 3, 41.26, 30.0)) == "on: predicted 41.3 tok/s drafting depth 3 vs 30.0 tok/s plain"
    assert reason(("off", 0, 0.0, 30.0)).startswith("off: no request's acceptance pays")
    assert "disable threshold (4)" in reason(("threshold", 4, 0.0, 0.0))
    assert "probed again in 12 steps" in reason(("guard", 12, 0.0, 0.0))
