"""Structured output and logit shaping through the engine: every answer parses and validates against
its schema, speculative greedy output equals plain greedy output under the same constraint (EAGLE-3
and n-gram drafts, the grammar pruning drafts and drafting forced tokens itself), seeded sampling
under a constraint is plain seeded sampling token for token, and sampled tokens under a mask follow
the masked distribution (chi-square). Tiny float32 targets with a byte-level BPE tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from augury import LLM, SamplingParams
from augury.sampling_params import StructuredOutputsParams as SO
from speculative_helpers import plain_llm, static_eagle3_llm, tokenized_checkpoints


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """A 2-layer random target with the server tests' byte-level tokenizer, and a random EAGLE-3 head."""
    return tokenized_checkpoints(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def plain(ckpts) -> LLM:
    return plain_llm(ckpts)


@pytest.fixture(scope="module")
def spec(ckpts) -> LLM:
    return static_eagle3_llm(ckpts)


def _no_leak(llm: LLM) -> None:
    a = llm.engine.allocator
    assert a.num_free == a.num_usable and not llm.engine.has_unfinished_requests()


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [30, 40], [50, 60, 70, 80, 90]]
NAME = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "ok": {"type": "boolean"}}, "required": ["name", "ok"]},
    "nested": {"type": "object", "required": ["user", "score"], "properties": {
        "user": {"type": "object", "required": ["id", "tags"], "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}}},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}},
    "enums-and-bools": {"type": "object", "required": ["kind", "flags", "level"], "properties": {
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
        "level": {"type": "integer", "minimum": -5, "maximum": 5}}},
    "array-of-objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "required": ["k", "v"], "properties": {"k": NAME, "v": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 9}}}},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_answers_validate_and_speculation_equals_plain(plain, spec, name):
    schema = SCHEMAS[name]
    params = SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=SO(json=schema))
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert w.finish_reason == "stop", w.text
        jsonschema.validate(json.loads(w.text), schema)
        assert g.token_ids == w.token_ids
    assert sum(g.spec_stats.num_accepted_draft_tokens for g in got) > 0
    _no_leak(spec)


@pytest.mark.parametrize("so, check", [
    (SO(regex=r"[a-z]{2,5}-[0-9]{1,3}"), lambda t: __import__("re").fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", t)),
    (SO(choice=["yes", "no", "maybe later"]), lambda t: t in ("yes", "no", "maybe later")),
    (SO(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'),
     lambda t: t.startswith("(") and t.endswith(")")),
    (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
], ids=["regex", "choice", "ebnf", "json_object"])
def test_other_constraints_hold_and_speculation_equals_plain(plain, spec, so, check):
    params = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=so)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got):
        if w.finish_reason == "stop":
            assert check(w.text), w.text
        assert g.token_ids == w.token_ids
    assert any(w.finish_reason == "stop" for w in want)


def test_ngram_drafts_under_a_grammar_equal_plain(ckpts, plain):
    llm = LLM(str(ckpts["target"]), dtype="float32", speculative_algorithm="ngram", speculative_policy="static",
              log_stats_interval=0)
    params = SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=SO(json=SCHEMAS["nested"]))
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    _no_leak(llm)


def test_seeded_sampling_under_a_grammar_is_plain_seeded_sampling(plain, spec):
    params = [SamplingParams(max_tokens=150, temperature=0.9, top_p=0.95, min_p=0.05, seed=s,
                             structured_outputs=SO(json=SCHEMAS["enums-and-bools"])) for s in range(4)]
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for w in want:
        if w.finish_reason == "stop":
            jsonschema.validate(json.loads(w.text), SCHEMAS["enums-and-bools"])


def test_a_grammar_that_cannot_finish_ends_with_length(plain, spec):
    params = SamplingParams(max_tokens=5, temperature=0.0, structured_outputs=SO(json=SCHEMAS["nested"]))
    for llm in (plain, spec):
        out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_forced_tokens_are_drafted_and_accepted(spec):
    """A schema that is mostly fixed text: the grammar drafts its forced tokens, and they are accepted
    whatever the (random) head proposes."""
    schema = {"type": "object", "required": ["description_of_item", "category_name"], "properties": {
        "description_of_item": {"enum": ["a very long fixed value", "another fixed value entirely"]},
        "category_name": {"enum": ["first category", "second category"]}}}
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=SO(json=schema))
    out = spec.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    jsonschema.validate(json.loads(out.text), schema)
    s = out.spec_stats
    assert s.num_accepted_draft_tokens >= len(out.token_ids) // 2, s  # most tokens came from forced drafts


def test_invalid_constraints_are_value_errors_naming_them(plain):
    with pytest.raises(ValueError, match="structured_outputs.json"):
        plain.generate([PROMPTS[0]], SamplingParams(structured_outputs=SO(json={"type": "objectx"})), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        plain.generate([PROMPTS[0]], SamplingParams(structured_outputs=SO(regex="(a")), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.grammar"):
        plain.generate([PROMPTS[0]], SamplingParams(structured_outputs=SO(grammar="root ::= b")), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        SO(json={}, regex="a")
    with pytest.raises(ValueError, match="logit_bias"):
        plain.generate([PROMPTS[0]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    _no_leak(plain)


def test_compiled_grammars_are_cached_and_bounded(plain):
    backend = plain.engine.grammar()
    so = SO(json=SCHEMAS["flat"])
    first = backend.compile(so)
    assert backend.compile(SO(json=json.loads(json.dumps(SCHEMAS["flat"])))) is not None
    assert backend.cache_bytes > 0 and first is not None
    assert backend.compiler.cache_limit_bytes > 0  # xgrammar's LRU cache is bounded



@pytest.mark.filterwarnings("ignore:The bitmask covers only")  # xgrammar says so for 97 and 160
@pytest.mark.parametrize("width", [64, 90, 97, 160])
def test_the_mask_sets_exactly_what_xgrammars_own_kernel_sets(plain, width):
    """backend.apply_bitmask (torch on the CPU) against xgrammar's apply_token_bitmask_inplace on random
    masks, several rows, every bit position (the sign bit too), logits narrower and wider than the
    mask covers (tokens past its 32 x words stay as they were): the same values, bit for bit."""
    import xgrammar as xgr

    backend = plain.engine.grammar()
    g = torch.Generator().manual_seed(width)
    words = 3  # covers 96 tokens
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # everything allowed
    bitmask[1] = 0  # nothing
    bitmask[2, 1] = -2**31  # only the sign bit of a word
    logits = torch.randn(4, width, generator=g)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    got = logits.clone()
    backend.apply_bitmask(got, bitmask)
    assert torch.equal(got, want)
    assert torch.isinf(got[1, : min(width, 96)]).all() and torch.equal(got[0], logits[0])

# --------------------------------------------------------------------------- sampling under a mask

def test_sampled_tokens_under_a_mask_follow_the_masked_distribution(ckpts, spec):
    """Chi-square: the token at a verified position (after two forced tokens: the requests share their
    prompt, so a prefix-cache hit leaves the first decode step plain) under a regex that allows four
    letters there is distributed as the target's softmax restricted to them."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpts["target"]))
    letters = [tok.convert_tokens_to_ids(c) for c in "abcd"]
    forced = [tok.convert_tokens_to_ids(c) for c in "xy"]
    prompt = PROMPTS[2]
    model = AutoModelForCausalLM.from_pretrained(str(ckpts["target"]), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + forced])).logits[0, -1]
    expected = torch.softmax(logits[letters], dim=0).double()
    n = 400
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=1000 + i, structured_outputs=SO(regex="xy[a-d]"))
              for i in range(n)]
    outs = spec.generate([prompt] * n, params, use_tqdm=False)
    assert all(o.token_ids[:2] == forced and o.spec_stats.num_verify_steps == 1 for o in outs)
    counts = torch.zeros(4, dtype=torch.float64)
    for o in outs:
        counts[letters.index(o.token_ids[2])] += 1
    p = chisquare(counts.numpy(), (expected / expected.sum() * n).numpy()).pvalue
    assert p > 1e-3, (counts, expected * n)


# --------------------------------------------------------------------------- the other logit controls

CONTROLS = {
    "repetition": dict(repetition_penalty=1.4),
    "frequency": dict(frequency_penalty=1.2),
    "presence": dict(presence_penalty=1.5),
    "bias": dict(logit_bias={20: 4.0, 21: 3.0, 30: -50.0}),
    "bad-words": dict(bad_words=None),  # words the unshaped output writes (see the test)
    "all-and-a-grammar": dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5,
                              logit_bias={20: 2.0}, structured_outputs=SO(regex="[a-z ]{5,60}")),
}


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_each_logit_control_keeps_greedy_speculation_exact(plain, spec, name):
    kw = dict(CONTROLS[name])
    free = plain.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
    if "bad_words" in kw:
        texts = [plain.tokenizer.decode([t]).strip() for t in free[0].token_ids[:8] + free[1].token_ids[:8]]
        kw["bad_words"] = [t for t in texts if t.isalpha()][:3]
        assert kw["bad_words"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, **kw)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert any(g.spec_stats.num_verify_steps for g in got)
    assert [f.token_ids for f in free] != [w.token_ids for w in want]  # the control did act
    if "bad_words" in kw:
        from augury.structured.shaper import bad_word_ids

        words = bad_word_ids(plain.tokenizer, kw["bad_words"])
        for w in want:
            for word in words:
                ids = w.token_ids
                assert not any(ids[i:i + len(word)] == word for i in range(len(ids))), (word, ids)
    _no_leak(spec)


def test_seeded_sampling_with_every_control_is_plain_seeded_sampling(plain, spec):
    params = [SamplingParams(max_tokens=40, temperature=1.0, top_k=50, min_p=0.05, seed=s, ignore_eos=True,
                             repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.3,
                             logit_bias={20: 3.0}, bad_words=["the"]) for s in range(4)]
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_min_p_drops_the_unlikely_tail():
    from augury.sampling import apply_sampling_filters

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = apply_sampling_filters(logits, 1.0, None, 1.0, 0.2)  # keeps p >= 0.2 * 0.5
    assert probs[0, 3] == 0 and probs[0, 2] > 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    assert torch.equal(apply_sampling_filters(logits, 1.0, None, 1.0, 0.0), torch.softmax(logits, dim=-1))


def test_a_shaper_pops_back_to_its_committed_state(plain):
    """Pushing a path (a verification walk) then popping it leaves penalties, bad words and the grammar
    exactly where the committed output left them."""
    from augury.structured import make_shaper

    eng = plain.engine
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
                            logit_bias={7: 2.0}, bad_words=["the quick"],
                            structured_outputs=SO(regex="[a-z]{1,3}(-[a-z]{1,3}){0,4}"))
    sh = make_shaper(params, PROMPTS[0], vocab_size=eng.model_cfg.vocab_size, device=eng.device,
                     tokenizer=eng.tokenizer, backend=eng.grammar)
    tok = eng.tokenizer
    for t in tok.encode("ab-c", add_special_tokens=False):
        sh.commit(t)
    logits = torch.randn(eng.model_cfg.vocab_size)
    before = sh.apply(logits.clone())
    for t in tok.encode("d-ef", add_special_tokens=False):
        sh.push(t)
    assert not torch.equal(sh.apply(logits.clone()), before)
    sh.pop_all()
    assert torch.equal(sh.apply(logits.clone()), before)
    assert torch.isinf(before).sum() > 0  # the grammar masks


def test_a_shapers_greedy_token_is_the_argmax_of_its_shaped_row(plain):
    """RequestShaper.greedy (the sampler's and the verifier's greedy rows) against argmax_ids of apply:
    the same token where the grammar allows the unmasked argmax (no mask applied) and where it does
    not, on ties (the first index), a NaN row, past the grammar's end, with penalties and a bias."""
    from augury.sampling import argmax_ids
    from augury.structured import make_shaper

    eng = plain.engine
    tok, v = eng.tokenizer, eng.model_cfg.vocab_size
    params = SamplingParams(repetition_penalty=1.3, logit_bias={7: 2.0},
                            structured_outputs=SO(regex="[a-z]{1,3}(-[a-z]{1,3}){0,2}"))
    sh = make_shaper(params, PROMPTS[0], vocab_size=v, device=eng.device, tokenizer=tok, backend=eng.grammar)
    g = torch.Generator().manual_seed(5)
    allowed = sh.apply(torch.zeros(v)).isfinite().nonzero().flatten()
    refused = sh.apply(torch.zeros(v)).isinf().nonzero().flatten()
    cases = []
    for _ in range(20):
        cases.append(torch.randn(v, generator=g))
    top_ok = torch.randn(v, generator=g)
    top_ok[allowed[3]] = 50.0  # the unmasked argmax is allowed: no mask applied
    top_no = torch.randn(v, generator=g)
    top_no[refused[5]] = 50.0  # ... refused: masked, then the argmax
    tie = torch.zeros(v)
    tie[allowed[2]] = tie[allowed[1]] = 9.0  # two allowed maxima: the first index
    tie[refused[0]] = 9.0 if refused[0] < allowed[1] else 0.0  # a refused one before them
    nan = torch.randn(v, generator=g)
    nan[allowed[4]] = float("nan")
    cases += [top_ok, top_no, tie, nan]
    applied = sh.stats.masked_tokens
    for text in ("", "ab", "ab-c", "ab-cd-efg"):  # the last one ends the grammar
        for t in tok.encode(text, add_special_tokens=False) if text else []:
            sh.push(t)
        for row in cases:
            want = argmax_ids(sh.apply(row.clone()).view(1, -1))[0]
            assert sh.greedy(row.clone()) == want, text
        sh.pop_all()
    assert sh.stats.masked_tokens > applied


def test_a_shapers_allowed_ids_are_the_tokens_its_mask_leaves(plain):
    """RequestShaper.allowed_ids: the tokens apply() leaves finite (sorted), at the committed state and
    along a pushed path, the same after a forced-token lookup filled the bitmask elsewhere; None where
    more are allowed than the limit, where no grammar shapes the row and past the grammar's end."""
    from augury.structured import make_shaper

    eng = plain.engine
    tok, v = eng.tokenizer, eng.model_cfg.vocab_size
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={7: 2.0},
                            structured_outputs=SO(regex="(ab|cd)-[0-9]{1,2}"))
    sh = make_shaper(params, PROMPTS[0], vocab_size=v, device=eng.device, tokenizer=tok, backend=eng.grammar)
    seen = 0
    for text in ("", "ab", "ab-", "ab-1"):
        for t in tok.encode(text, add_special_tokens=False) if text else []:
            sh.push(t)
        want = sh.apply(torch.zeros(v)).isfinite().nonzero().flatten()
        sh.forced_tokens(8)  # fills the bitmask at other states, and rolls back
        ids = sh.allowed_ids(v)
        assert ids is not None and ids.tolist() == want.tolist(), text
        assert 0 < len(ids) < v
        assert sh.allowed_ids(len(ids) - 1) is None
        row = torch.full((v,), float("-inf"))
        row[torch.as_tensor(ids)] = torch.randn(len(ids))
        whole = torch.randn(v)
        whole[torch.as_tensor(ids)] = row[torch.as_tensor(ids)]
        assert torch.equal(sh.apply(row.clone()), sh.apply(whole.clone()))  # a row at those tokens alone shapes alike
        seen += len(ids)
        sh.pop_all()
    assert seen
    for t in tok.encode("cd-42", add_special_tokens=False):
        sh.commit(t)
    ended = sh.allowed_ids(v)  # only the stop token is left
    assert ended is not None and set(ended.tolist()) <= set(eng.eos_token_ids)
    sh.commit(int(ended[0]))
    assert sh.allowed_ids(v) is None
    bare = make_shaper(SamplingParams(presence_penalty=0.5), PROMPTS[0], vocab_size=v, device=eng.device,
                       tokenizer=tok, backend=eng.grammar)
    assert bare.allowed_ids(v) is None


def test_a_shapers_greedy_at_is_its_greedy_over_the_masked_row(plain):
    """RequestShaper.greedy_at: from a node's logits at its allowed tokens alone, the token greedy()
    takes from the whole row that is -inf elsewhere, ties (the first), a NaN and a row of -inf included,
    at the committed state and along a pushed path; shapes_beyond_mask says when anything else shapes
    the row (then greedy_at is not asked): a bias, penalties, bad words, min_tokens while it holds."""
    from augury.sampling import NO_TOKEN
    from augury.structured import make_shaper

    eng = plain.engine
    tok, v = eng.tokenizer, eng.model_cfg.vocab_size
    sh = make_shaper(SamplingParams(structured_outputs=SO(regex="(ab|cd)-[0-9]{1,2}")), PROMPTS[0], vocab_size=v,
                     device=eng.device, tokenizer=tok, backend=eng.grammar)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for text in ("", "ab", "ab-", "ab-1"):
        for t in tok.encode(text, add_special_tokens=False) if text else []:
            sh.push(t)
        assert not sh.shapes_beyond_mask()
        ids = sh.allowed_ids(v)
        assert ids is not None and len(ids)
        cases = [torch.randn(len(ids), generator=gen), torch.zeros(len(ids)), torch.full((len(ids),), float("-inf"))]
        if len(ids) > 2:
            tie = torch.randn(len(ids), generator=gen)
            tie[[1, 2]] = tie.max() + 1  # the first of two largest
            nan = torch.randn(len(ids), generator=gen)
            nan[1] = float("nan")
            cases += [tie, nan]
        for values in cases:
            row = torch.full((v,), float("-inf"))
            row[torch.as_tensor(ids)] = values
            want = sh.greedy(row.clone())
            assert sh.greedy_at(ids, values.numpy()) == want, (text, values)
            checked += want == NO_TOKEN
        sh.pop_all()
    assert checked >= 2  # the -inf rows and the NaN
    shaped = {"logit_bias": {7: 2.0}, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    for name, value in shaped.items():
        other = make_shaper(SamplingParams(structured_outputs=SO(regex="ab"), **{name: value}), PROMPTS[0],
                            vocab_size=v, device=eng.device, tokenizer=tok, backend=eng.grammar)
        assert other.shapes_beyond_mask(), name
    bad = make_shaper(SamplingParams(structured_outputs=SO(regex="ab"), bad_words=["cd"]), PROMPTS[0], vocab_size=v,
                      device=eng.device, tokenizer=tok, backend=eng.grammar)
    assert bad.shapes_beyond_mask()
    short = make_shaper(SamplingParams(structured_outputs=SO(regex="ab"), min_tokens=1), PROMPTS[0], vocab_size=v,
                        device=eng.device, tokenizer=tok, backend=eng.grammar, eos_token_ids=eng.eos_token_ids)
    assert short.shapes_beyond_mask()  # the stop tokens are masked until one token is out
    short.commit(tok.encode("a", add_special_tokens=False)[0])
    assert not short.shapes_beyond_mask()


def test_logits_at_the_allowed_tokens_alone_keep_decoding_and_speculation_exact(ckpts):
    """A quantised bfloat16 target (augury's w8a8 output layer): decode steps and verified nodes whose
    grammar allows few tokens get logits at those tokens alone (TargetModel.allowed_logits: masked
    rows, or a verified node's greedy token from those logits alone). Plain greedy output equals plain
    greedy output from whole rows, and greedy speculative output equals both, under each schema, the
    forced-token steps included."""
    from augury.cpu import kernels as cpu_kernels

    if cpu_kernels.w8a8() is None:
        pytest.skip("augury's w8a8 kernel is not built here")
    common = dict(dtype="bfloat16", quantization="int4", log_stats_interval=0)
    plain_q = LLM(str(ckpts["target"]), speculative_algorithm="none", **common)
    spec_q = LLM(str(ckpts["target"]), draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
                 speculative_policy="static", speculative_num_steps=3, speculative_eagle_topk=2,
                 speculative_num_draft_tokens=6, max_num_seqs=8, **common)
    calls = {"plain": [], "spec": []}
    for name, llm in (("plain", plain_q), ("spec", spec_q)):
        def counted(hidden, allowed, inner=llm.engine.model.allowed_logits, seen=calls[name]):
            out = inner(hidden, allowed)
            seen.append(out is not None)
            return out

        llm.engine.model.allowed_logits = counted  # decode steps' and (through the engine) verification's
    for name in sorted(SCHEMAS):
        params = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=SO(json=SCHEMAS[name]))
        plain_q.engine._masked_logits = False  # whole rows
        whole = plain_q.generate(PROMPTS, params, use_tqdm=False)
        plain_q.engine._masked_logits = True
        want = plain_q.generate(PROMPTS, params, use_tqdm=False)
        got = spec_q.generate(PROMPTS, params, use_tqdm=False)
        for v, w, g in zip(whole, want, got):
            assert w.token_ids == v.token_ids, name
            assert g.token_ids == w.token_ids, name
    assert calls["plain"] and all(calls["plain"])
    assert calls["spec"] and all(calls["spec"])
    _no_leak(spec_q)


def test_the_grammar_prunes_drafts_and_drafts_forced_tokens(plain):
    from augury.speculative.tree import DraftTree, depth_from_parents, rebuild_rows
    from augury.structured import make_shaper

    eng, tok = plain.engine, plain.tokenizer
    sh = make_shaper(SamplingParams(structured_outputs=SO(regex="abc(d|e)fgh")), PROMPTS[0],
                     vocab_size=eng.model_cfg.vocab_size, device=eng.device, tokenizer=tok, backend=eng.grammar)
    ids = {c: tok.convert_tokens_to_ids(c) for c in "abcdefghz"}
    sh.commit(ids["a"])  # the root: the last committed token
    # root -> b -> c -> z (refused) ; root -> z (refused) -> c ; root -> b -> d (refused)
    tokens = [ids["a"], ids["b"], ids["z"], ids["c"], ids["c"], ids["z"], ids["d"]]
    parents = [-1, 0, 0, 1, 2, 3, 1]
    keep, chains = sh.plan_tree(tokens, parents, len(tokens), capacity=8)
    assert keep == [0, 1, 3]
    assert chains == []  # after "abc" the grammar allows d or e: nothing is forced
    sh2 = make_shaper(SamplingParams(structured_outputs=SO(regex="abcdefgh")), PROMPTS[0],
                      vocab_size=eng.model_cfg.vocab_size, device=eng.device, tokenizer=tok, backend=eng.grammar)
    sh2.commit(ids["a"])
    keep, chains = sh2.plan_tree(tokens, parents, len(tokens), capacity=6)
    assert keep == [0, 1, 3]
    assert len(chains) == 1 and chains[0][0] == 3 and tok.decode(chains[0][1]) == "def"  # 3 kept + 3 forced
    par = torch.tensor([parents])
    tree = DraftTree(torch.tensor([tokens]), par, depth_from_parents(par))
    new = rebuild_rows(tree, [(keep, chains)])
    assert new.sizes == [6] and new.parents[0].tolist() == [-1, 0, 1, 2, 3, 4]
    assert tok.decode(new.tokens[0].tolist()) == "abcdef" and new.depth[0].tolist() == [0, 1, 2, 3, 4, 5]


def _shaper(llm: LLM, so: SO):
    from augury.structured import make_shaper

    eng = llm.engine
    return make_shaper(SamplingParams(structured_outputs=so), PROMPTS[0], vocab_size=eng.model_cfg.vocab_size,
                       device=eng.device, tokenizer=eng.tokenizer, backend=eng.grammar)


def test_forced_tokens_end_with_the_one_token_the_grammar_allows(plain):
    """Jump-forward leaves out the stop token (and a last token that could merge with more text); where
    the grammar allows one token alone there, it is drafted too, within the limit."""
    tok = plain.tokenizer
    ids = {c: tok.convert_tokens_to_ids(c) for c in "abc"}
    eos = min(plain.engine.eos_token_ids)
    sh = _shaper(plain, SO(regex="abc"))
    assert sh.forced_tokens() == [ids["a"], ids["b"], ids["c"], eos]
    assert sh.forced_tokens(2) == [ids["a"], ids["b"]]
    for c in "abc":
        sh.commit(ids[c])
    assert sh.forced_tokens() == [eos]  # complete: the stop token alone
    sh2 = _shaper(plain, SO(regex="a+"))
    sh2.commit(ids["a"])
    assert sh2.forced_tokens() == []  # complete, but more "a" allowed: nothing forced
    sh3 = _shaper(plain, SO(json={"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}))
    for t in tok.encode('{"ok": false', add_special_tokens=False):
        sh3.commit(t)
    assert tok.decode(sh3.forced_tokens()) == "}<|im_end|>"  # the object's close, then the stop token
    assert not sh3.terminated and sh3.forced_tokens() == sh3.forced_tokens()  # the matcher left where it was


def test_forced_text_is_spelled_as_the_output_spelled_it(plain):
    """Forced text the output already wrote is drafted in the output's own spelling (the target may
    spell a key its own way each time), not the tokenizer's; a fresh request gets the tokenizer's."""
    tok = plain.tokenizer
    vocab = tok.get_vocab()
    word = next(w for w in sorted(vocab) if w.isascii() and w.isalpha() and len(w) >= 4 and all(c in vocab for c in w))
    assert tok.encode(word, add_special_tokens=False) == [vocab[word]]
    letters = [vocab[c] for c in word]
    eos = min(plain.engine.eos_token_ids)
    semi = tok.encode(";", add_special_tokens=False)
    fresh = _shaper(plain, SO(regex=f"{word};{word}"))
    for t in [vocab[word]] + semi:
        fresh.commit(t)
    assert fresh.forced_tokens() == [vocab[word], eos]
    own = _shaper(plain, SO(regex=f"{word};{word}"))
    for t in letters + semi:
        own.commit(t)
    assert own.forced_tokens() == letters + [eos]
    for t in letters:  # the output's spelling is looked up in committed tokens, not in pushed ones
        own.push(t)
    own.pop_all()
    assert own.forced_tokens() == letters + [eos]


def test_forced_drafts_keep_a_requests_own_draft_cap(plain, spec):
    params = SamplingParams(max_tokens=120, temperature=0.0, max_draft_tokens=2,
                            structured_outputs=SO(json=SCHEMAS["enums-and-bools"]))
    want = plain.generate(PROMPTS[:2], params, use_tqdm=False)
    got = spec.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g in got:
        assert g.spec_stats.num_verify_steps and g.spec_stats.num_draft_tokens <= 2 * g.spec_stats.num_verify_steps


def test_forced_tokens_are_verified_when_the_policy_drafts_nothing(ckpts, plain):
    """Above the disable threshold the head drafts nothing and prompt lookup neither, yet the grammar's
    forced tokens are still verified (as chains under the roots) instead of decoding them one step
    each; output unchanged."""
    llm = LLM(str(ckpts["target"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
              speculative_policy="static", speculative_disable_batch_threshold=1, log_stats_interval=0)
    schema = SCHEMAS["enums-and-bools"]
    params = [SamplingParams(max_tokens=150, temperature=0.0, structured_outputs=SO(json=schema)),
              SamplingParams(max_tokens=150, temperature=0.0, structured_outputs=SO(json=schema), max_draft_tokens=0),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]
    prompts = PROMPTS[:3]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert got[0].spec_stats.num_accepted_draft_tokens > 0  # forced tokens, no head drafts
    assert got[1].spec_stats.num_verify_steps == 0 and got[2].spec_stats.num_verify_steps == 0
    _no_leak(llm)


def test_a_tree_past_the_grammars_end_asks_nothing_of_the_ended_matcher(plain, capfd):
    """Drafts under a node that took the stop token are dropped without asking the terminated matcher
    (xgrammar logs a warning for every token offered to it after the end)."""
    from augury.structured import make_shaper

    eng, tok = plain.engine, plain.tokenizer
    sh = make_shaper(SamplingParams(structured_outputs=SO(regex="abc")), PROMPTS[0],
                     vocab_size=eng.model_cfg.vocab_size, device=eng.device, tokenizer=tok, backend=eng.grammar)
    ids = {c: tok.convert_tokens_to_ids(c) for c in "abcz"}
    eos = min(eng.eos_token_ids)
    sh.commit(ids["a"])
    # root a -> b -> c -> EOS -> z -> z ; the grammar ends at EOS
    tokens = [ids["a"], ids["b"], ids["c"], eos, ids["z"], ids["z"]]
    parents = [-1, 0, 1, 2, 3, 4]
    capfd.readouterr()
    keep, chains = sh.plan_tree(tokens, parents, len(tokens), capacity=8)
    assert keep == [0, 1, 2, 3] and chains == []
    for t in tokens[1:]:
        sh.push(t)
    sh.pop_all()
    assert "terminated" not in capfd.readouterr().err
    assert not sh.terminated


@pytest.mark.parametrize("prompt, want", [("xacebdey", "ebdeq!"), ("xacebzey", "eb")])
def test_free_drafts_chain_forced_tokens_and_prompt_lookup_the_grammar_allows(plain, prompt, want):
    """A forced-only step's chain (worker.free_drafts): the forced "e", then what followed "ace" in the
    prompt (three tokens for a three-token match), as far as the grammar allows it, then the tokens
    forced after that (the rest of the answer and its stop token); a lookup the grammar refuses
    partway ends the chain there. The shaper is left at its committed state; without lookup the
    chain is the forced "e" alone."""
    from augury.speculative.worker import free_drafts
    from augury.structured import make_shaper

    eng, tok = plain.engine, plain.tokenizer
    ids = [tok.convert_tokens_to_ids(c) for c in prompt]
    sh = make_shaper(SamplingParams(structured_outputs=SO(regex="(a|b)(c|d)e(a|b)(c|d)eq!")), ids,
                     vocab_size=eng.model_cfg.vocab_size, device=eng.device, tokenizer=tok, backend=eng.grammar)
    out = [tok.convert_tokens_to_ids(c) for c in "ac"]
    for t in out:
        sh.commit(t)
    before = sh.forced_tokens()
    chain = free_drafts(sh, ids + out, 16)
    eos = min(eng.eos_token_ids)
    if want.endswith("!"):
        assert chain[-1] == eos and tok.decode(chain[:-1]) == want
    else:
        assert tok.decode(chain) == want
    assert free_drafts(sh, ids + out, 2) == chain[:2]  # the limit holds
    assert tok.decode(free_drafts(sh, ids + out, 16, lookup=False)) == "e"
    assert sh.output == out and sh.forced_tokens() == before  # left where it was
    if want.endswith("!"):  # each draft's chance that it and all before it are accepted: a lookup's own
        from augury.speculative.worker import free_chain  # estimates times the chance before them

        def guess(tokens, most):
            t = [tok.convert_tokens_to_ids(c) for c in "bd"][:most]
            return t, [0.5, 0.25][: len(t)], 3

        toks, srcs, chance, reach = free_chain(sh, ids + out, 16, chain=guess)
        assert tok.decode(toks[:-1]) == "ebdeq!" and chance == [1.0, 0.5, 0.25, 0.25, 0.25, 0.25, 0.25]
        assert reach == [0, 3, 4, 0, 0, 0, 0]  # the lookup's match and its run; forced tokens none
        assert sh.output == out
