"""vLLM's output fields through the engine: min_tokens (end tokens masked through the request's shaper,
stop strings not looked for before it; greedy speculative output still equals plain output token for
token), include_stop_str_in_output, skip_special_tokens and spaces_between_special_tokens (on a
tokenizer whose decoder puts spaces between tokens), and their validation in SamplingParams."""
from __future__ import annotations

from pathlib import Path

import pytest

from augury import LLM, SamplingParams
from speculative_helpers import plain_llm, static_eagle3_llm, tokenized_checkpoints


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """A 2-layer random target with the server tests' byte-level tokenizer, and a random EAGLE-3 head."""
    return tokenized_checkpoints(tmp_path_factory.mktemp("output-fields"))


@pytest.fixture(scope="module")
def plain(ckpts) -> LLM:
    return plain_llm(ckpts)


@pytest.fixture(scope="module")
def spec(ckpts) -> LLM:
    return static_eagle3_llm(ckpts)


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [30, 40], [50, 60, 70, 80, 90]]


def _eos(llm: LLM) -> int:
    return min(llm.engine.eos_token_ids)


def test_min_tokens_holds_off_eos_and_speculation_equals_plain(plain, spec):
    """EOS pushed up by a bias ends each answer at once; min_tokens=9 holds it off for 9 tokens (the
    10th is then EOS), and the speculative engine, whose verification shapes each node as a decode
    step at its position would, gives the same tokens."""
    eos = _eos(plain)
    early = plain.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0.0, logit_bias={eos: 30.0}),
                           use_tqdm=False)
    assert all(o.token_ids == [eos] and o.finish_reason == "stop" for o in early)
    params = SamplingParams(max_tokens=30, temperature=0.0, logit_bias={eos: 30.0}, min_tokens=9)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(w.token_ids) == 10 and w.token_ids[-1] == eos and eos not in w.token_ids[:9] for w in want)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert any(g.spec_stats.num_verify_steps for g in got)
    # a milder bias: EOS is the greedy choice at some positions only; equal token for token all the same
    params = SamplingParams(max_tokens=40, temperature=0.0, logit_bias={eos: 3.0}, min_tokens=12)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    assert all(eos not in w.token_ids[:12] for w in want)
    assert [g.token_ids for g in spec.generate(PROMPTS, params, use_tqdm=False)] == [w.token_ids for w in want]


def test_min_tokens_holds_off_stop_token_ids(plain, spec):
    free = plain.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)[0]
    stop = free.token_ids[2]  # the third token ends the plain answer
    cut = plain.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[stop]), use_tqdm=False)[0]
    assert cut.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
    held = plain.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert stop not in held.token_ids[:6] and len(held.token_ids) >= 6
    assert spec.generate(PROMPTS[:1], params, use_tqdm=False)[0].token_ids == held.token_ids


def test_stop_strings_wait_for_min_tokens_and_can_stay_in_the_text(plain):
    base = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = plain.generate(PROMPTS[:1], SamplingParams(**base), use_tqdm=False)[0]
    text = full.text
    stop = next(text[i:i + 2] for i in range(len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2])
    cut = plain.generate(PROMPTS[:1], SamplingParams(**base, stop=[stop]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    kept = plain.generate(PROMPTS[:1], SamplingParams(**base, stop=[stop], include_stop_str_in_output=True),
                          use_tqdm=False)[0]
    assert kept.text == cut.text + stop and kept.token_ids == cut.token_ids
    # no stop string before the min_tokens-th token: with min_tokens = max_tokens it never ends the text
    late = plain.generate(PROMPTS[:1], SamplingParams(**base, stop=[stop], min_tokens=24), use_tqdm=False)[0]
    assert late.text == text and late.finish_reason == "length"


def test_skip_special_tokens_and_spaces_between_them(tiny_checkpoint, make_llm):
    """conftest's WordLevel tokenizer decodes with spaces between all tokens, special ones included:
    spaces_between_special_tokens=False joins the special tokens' text to its neighbours."""
    llm = make_llm(tiny_checkpoint("llama", tokenizer=True))
    tok = llm.tokenizer
    start = tok.convert_tokens_to_ids("<|im_start|>")
    base = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    free = llm.generate([[7, 8, 9]], SamplingParams(**base), use_tqdm=False)[0]
    # a special token at every position (a logit bias): skipped by default
    forced = llm.generate([[7, 8, 9]], SamplingParams(**base, logit_bias={start: 100.0}), use_tqdm=False)[0]
    assert forced.token_ids == [start] * 6 and forced.text == ""  # skipped by default
    shown = llm.generate([[7, 8, 9]], SamplingParams(**base, logit_bias={start: 100.0}, skip_special_tokens=False),
                         use_tqdm=False)[0]
    assert shown.text == tok.decode([start] * 6, skip_special_tokens=False) == " ".join(["<|im_start|>"] * 6)
    joined = llm.generate([[7, 8, 9]], SamplingParams(**base, logit_bias={start: 100.0}, skip_special_tokens=False,
                                                      spaces_between_special_tokens=False), use_tqdm=False)[0]
    assert joined.text == "<|im_start|>" * 6
    assert free.text == tok.decode(free.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_tokens=-1), "min_tokens must be a non-negative integer"),
    (dict(min_tokens=2.5), "min_tokens must be a non-negative integer"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens (5) must not exceed max_tokens (4)"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be true or false"),
    (dict(skip_special_tokens=None), "skip_special_tokens must be true or false"),
    (dict(spaces_between_special_tokens="no"), "spaces_between_special_tokens must be true or false"),
])
def test_the_fields_are_validated_where_they_are_made(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)
