"""A chat choice's text as the assistant message (server/chat_text.py), whole and streamed, with a
reasoning parser, a tool-call format, both or neither: answers written the way Qwen3 (thinking, then
hermes calls), DeepSeek-R1 (reasoning without an opening tag) and Qwen3-Coder (XML calls) write them,
and random ones; the stream's deltas join into the whole message for every cutting."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from augury.server import args as serve_args
from augury.server.chat_text import ChatTextStream, chat_message
from augury.structured.reasoning import PARSERS
from augury.structured.tool_parsers import FORMATS

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
         "get_time": None}


def job(reasoning: str | None = None, fmt: str | None = None) -> Any:
    return SimpleNamespace(reasoning=reasoning, parse_tools=fmt is not None, tool_names=TOOLS,
                           tool_format=fmt or "hermes")


def streamed(j: Any, pieces: list[str]) -> tuple[dict[str, Any], bool]:
    """The message a client rebuilds from the deltas (as the openai client accumulates them)."""
    parser = ChatTextStream(j)
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    reasoning, content, calls = "", "", []
    for d in deltas:
        assert len(d) == 1, d  # one kind of delta each
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                calls.append({"id": tc["id"], "type": "function", "function": dict(tc["function"])})
            else:
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if j.reasoning or j.parse_tools
                                                                           else content)}
    if j.reasoning is not None:
        message["reasoning_content"] = reasoning or None
    if calls:
        message["tool_calls"] = calls
    return message, parser.called


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if "tool_calls" in out:
        out["tool_calls"] = [{**c, "id": None} for c in out["tool_calls"]]
    return out


def check(j: Any, text: str, pieces: list[str] | None = None) -> dict[str, Any]:
    whole, called = chat_message(j, text)
    for cut in ([pieces] if pieces is not None else [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]):
        got, got_called = streamed(j, cut)
        assert (without_ids(got), got_called) == (without_ids(whole), called), cut
    return without_ids(whole)


QWEN3 = ("<think>\nThe user asks for the weather in Paris and the time; two calls.\n</think>\n\n"
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
R1 = "The user greets me. I should greet back.\n</think>\n\nHello! How can I help you today?"
CODER = ("<think>\nI need the forecast.\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n"
         "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_thinks_then_calls() -> None:
    message = check(job("maybe", "hermes"), QWEN3)
    assert message["reasoning_content"] == "The user asks for the weather in Paris and the time; two calls."
    assert message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]


def test_deepseek_r1_reasons_without_an_opening_tag() -> None:
    message = check(job("inside"), R1)
    assert message == {"role": "assistant", "content": "Hello! How can I help you today?",
                       "reasoning_content": "The user greets me. I should greet back."}


def test_qwen3_coder_with_reasoning() -> None:
    message = check(job("maybe", "qwen3_coder"), CODER)
    assert message["reasoning_content"] == "I need the forecast." and message["content"] == "Let me check."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_thinking_off_and_no_parser() -> None:
    # enable_thinking false: the prompt closed the block; a <think> the model writes is content
    assert check(job("done"), " <think>x</think> hi ") == {"role": "assistant", "content": "<think>x</think> hi",
                                                           "reasoning_content": None}
    # no parser at all: the text as written, whitespace and all
    assert check(job(), " <think>x</think> hi ") == {"role": "assistant", "content": " <think>x</think> hi "}


def test_reasoning_is_never_read_for_calls() -> None:
    text = '<think>maybe <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call></think>done'
    message = check(job("maybe", "hermes"), text)
    assert "tool_calls" not in message and message["content"] == "done"


PIECES = st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "get_time", "arguments": {}}',
                          "\n", " ", "x", "<thi", "</tool", "é"])


@pytest.mark.parametrize("reasoning", [None, "inside", "maybe", "done"])
@pytest.mark.parametrize("fmt", [None, "hermes"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_answer_any_cutting(reasoning: str | None, fmt: str | None, data: st.DataObject) -> None:
    text = data.draw(st.lists(st.one_of(PIECES, st.text(max_size=4)), max_size=12).map("".join))
    points = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=8))))
    bounds = [0, *points, len(text)]
    check(job(reasoning, fmt), text, [text[a:b] for a, b in zip(bounds, bounds[1:])])


def test_the_flag_choices_are_the_parsers() -> None:
    """args.py lists them itself (importing augury.structured would load torch there)."""
    assert serve_args.TOOL_FORMATS == tuple(FORMATS) and serve_args.REASONING_PARSERS == PARSERS
