"""Reasoning parsers (qwen3, deepseek_r1): answers written by hand the way Qwen3 and DeepSeek-R1 answer
split into reasoning and the answer after it; where an answer starts is read from the prompt's end
as each family's template writes it; for every answer and every way of cutting it the stream's
pieces join into the whole split; and a constraint placed after the reasoning leaves the reasoning
free and shapes the answer alone."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from augury.sampling_params import StructuredOutputsParams
from augury.structured.reasoning import ReasoningStream, after_reasoning, split_reasoning, start_state


def stream(pieces: list[str], start: str) -> tuple[str | None, str]:
    parser = ReasoningStream(start)
    reasoning, answer = "", ""
    for p in pieces:
        r, a = parser.feed(p)
        reasoning, answer = reasoning + r, answer + a
    r, a = parser.finish()
    return (reasoning + r) or None, answer + a


def every_cut(text: str, start: str) -> tuple[str | None, str]:
    expected = split_reasoning(text, start)
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]], start) == expected, i
    assert stream(list(text), start) == expected
    return expected


# ------------------------------------------------------------------------------------ prompts

QWEN3_PROMPT = "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINK = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # the template with enable_thinking false
QWEN3_THINKING_2507 = QWEN3_PROMPT + "<think>\n"  # Qwen3-*-Thinking-2507 and Qwen3.5 open it in the prompt
R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 17 * 23?<｜Assistant｜><think>\n"
R1_OLD_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 17 * 23?<｜Assistant｜>"  # before the template opened it


@pytest.mark.parametrize("parser,prompt,state", [
    ("qwen3", QWEN3_PROMPT, "maybe"), ("qwen3", QWEN3_NO_THINK, "done"), ("qwen3", QWEN3_THINKING_2507, "inside"),
    ("deepseek_r1", R1_PROMPT, "inside"), ("deepseek_r1", R1_OLD_PROMPT, "inside"),
    ("deepseek_r1", R1_OLD_PROMPT + "<think>\n\n</think>\n\n", "done"),
    # an earlier turn's reasoning in the history does not count: only where the prompt ends
    ("qwen3", "<|im_start|>assistant\n<think>\nold\n</think>\n\nold answer<|im_end|>\n" + QWEN3_PROMPT, "maybe"),
])
def test_where_the_answer_starts(parser: str, prompt: str, state: str) -> None:
    assert start_state(parser, prompt) == state


def test_unknown_parser_and_state_are_refused() -> None:
    with pytest.raises(ValueError, match="granite"):
        start_state("granite", "x")
    with pytest.raises(ValueError, match="start"):
        ReasoningStream("sometimes")


# ------------------------------------------------------------------------------------ captured answers

QWEN3_THINKS = ("<think>\nOkay, the user asks for 17 * 23. 17 * 20 = 340 and 17 * 3 = 51, so 391.\n</think>\n\n"
                "17 × 23 = **391**.")
R1_THINKS = ("Okay, so I need to multiply 17 by 23. Let me break it down: 17 * 20 = 340, 17 * 3 = 51.\n"
             "Adding them gives 391.\n</think>\n\nThe product of 17 and 23 is **391**.")
QWEN3_CALLS = ('<think>\nThe user wants the weather in Paris; I should call get_weather.\n</think>\n\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
CUT_SHORT = "<think>\nLet me think about this carefully. First,"


@pytest.mark.parametrize("text,start,reasoning,answer", [
    (QWEN3_THINKS, "maybe", "Okay, the user asks for 17 * 23. 17 * 20 = 340 and 17 * 3 = 51, so 391.",
     "\n\n17 × 23 = **391**."),
    ("17 × 23 = 391.", "maybe", None, "17 × 23 = 391."),  # Qwen3 chose not to think
    ("17 × 23 = 391.", "done", None, "17 × 23 = 391."),  # enable_thinking false
    ("<think>\n\n</think>\n\n391", "maybe", None, "\n\n391"),  # an empty block the model wrote itself
    (R1_THINKS, "inside", "Okay, so I need to multiply 17 by 23. Let me break it down: 17 * 20 = 340, "
                          "17 * 3 = 51.\nAdding them gives 391.", "\n\nThe product of 17 and 23 is **391**."),
    ("<think>\n" + R1_THINKS, "inside", split_reasoning(R1_THINKS, "inside")[0],  # R1-0528 writes the tag
     "\n\nThe product of 17 and 23 is **391**."),
    (CUT_SHORT, "maybe", "Let me think about this carefully. First,", ""),  # max_tokens before </think>
    (CUT_SHORT[7:], "inside", "Let me think about this carefully. First,", ""),
    ("I think <think> is a tag.", "maybe", None, "I think <think> is a tag."),  # not at the start: text
    (QWEN3_CALLS, "maybe", "The user wants the weather in Paris; I should call get_weather.",
     '\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
])
def test_captured_answers(text: str, start: str, reasoning: str | None, answer: str) -> None:
    assert every_cut(text, start) == (reasoning, answer)


# ------------------------------------------------------------------------------------ properties

FRAGMENT = st.sampled_from(["<think>", "</think>", "<think", "</thi", "<", ">", "/", "\n", " ", "\n\n", "é", "x y"])
ANSWER = st.lists(st.one_of(FRAGMENT, st.text(max_size=6)), max_size=10).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=ANSWER, points=st.lists(st.integers(min_value=0), max_size=10),
       start=st.sampled_from(["inside", "maybe", "done"]))
def test_any_cutting_of_any_answer_streams_the_whole_split(text: str, points: list[int], start: str) -> None:
    bounds = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert stream(pieces, start) == split_reasoning(text, start) == stream(list(text), start)


# ------------------------------------------------------------------------------------ constraints after it

SCHEMA = {"type": "object", "required": ["answer"], "properties": {"answer": {"type": "integer"}}}


@pytest.fixture(scope="module")
def compiler():
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "</s>"]
    return xgr, xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])), vocab


def _grammar(compiler, spec: StructuredOutputsParams, start: str):
    from augury.structured.backend import constraint_format

    xgr, comp, _ = compiler
    fmt = after_reasoning(constraint_format(spec), start)
    return comp.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))


def _accepts(compiler, grammar, text: str) -> bool:
    xgr, _, vocab = compiler
    m = xgr.GrammarMatcher(grammar)
    return m.accept_string(text) and m.accept_token(len(vocab) - 1)


@pytest.mark.parametrize("start,reasoning", [("inside", "17 * 23 is {not json} 391\n"),
                                             ("maybe", "<think>\nplain {[ text\n"), ("maybe", ""), ("done", "")])
def test_a_schema_shapes_the_answer_not_the_reasoning(compiler, start: str, reasoning: str) -> None:
    grammar = _grammar(compiler, StructuredOutputsParams(json=SCHEMA), start)
    head = reasoning + "</think>\n\n" if reasoning else ""
    assert _accepts(compiler, grammar, head + '{"answer": 391}')
    assert not _accepts(compiler, grammar, head + "391")  # the answer is held to the schema
    if start == "inside":  # the reasoning is never: the answer must come after </think>
        assert not _accepts(compiler, grammar, '{"answer": 391}')
    # what a random walk writes after the reasoning splits into that reasoning and a valid answer
    xgr, _, vocab = compiler
    rng = random.Random(start)
    ended = 0
    for _ in range(5):
        m = xgr.GrammarMatcher(grammar)
        assert m.accept_string(head)
        out, mask = [], xgr.allocate_token_bitmask(1, len(vocab))
        for _ in range(500):
            m.fill_next_token_bitmask(mask)
            words = mask[0].tolist()
            allowed = [t for t in range(len(vocab)) if (words[t // 32] >> (t % 32)) & 1]
            if len(vocab) - 1 in allowed:
                break
            t = rng.choice(allowed)
            assert m.accept_token(t)
            out.append(vocab[t])
        else:
            continue
        ended += 1
        reasoning_text, answer = split_reasoning(head + "".join(out), start)
        assert reasoning_text == (reasoning.replace("<think>", "").strip() or None)
        jsonschema.validate(json.loads(answer), SCHEMA)
    assert ended >= 2


@pytest.mark.parametrize("spec,answer", [
    (StructuredOutputsParams(regex="[a-z]{3}-[0-9]{2}"), "abc-12"),
    (StructuredOutputsParams(choice=["red fox", "lazy dog"]), "lazy dog"),
    (StructuredOutputsParams(grammar='root ::= "yes" | "no"'), "no"),
    (StructuredOutputsParams(json_object=True), '{"a": [1]}'),
])
def test_every_constraint_kind_goes_after_the_reasoning(compiler, spec, answer: str) -> None:
    grammar = _grammar(compiler, spec, "inside")
    assert _accepts(compiler, grammar, "some thought </think>\n" + answer)
    assert not _accepts(compiler, grammar, "some thought </think>\n" + answer + "!")


def test_a_bad_constraint_names_itself() -> None:
    from augury.structured.backend import constraint_format

    with pytest.raises(ValueError, match="structured_outputs.regex"):
        constraint_format(StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="structured_outputs.grammar"):
        constraint_format(StructuredOutputsParams(grammar="root ::= nowhere"))
