"""The streamed tool-call parser (`ToolCallStream`) against the whole-answer one (`parse_tool_calls`):
for every answer, well-formed calls or not, and every way of cutting it into pieces, the stream's
deltas join into the whole answer's content and calls, and it finds calls (so finishes with
"tool_calls") exactly when the whole parse does."""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from augury.structured.tools import CLOSE, OPEN, ToolCallStream, parse_tool_calls

TOOLS = ("get_weather", "get_time", "a.b-c_1")


def stream(pieces: list[str], names: tuple[str, ...] | None = TOOLS) -> tuple[str | None, list[tuple[str, str]], bool]:
    """Feed the pieces, then rebuild what a client sees: (content, [(name, arguments)], called)."""
    parser = ToolCallStream(names)
    deltas: list[dict[str, Any]] = []
    for p in pieces:
        deltas += parser.feed(p)
    deltas += parser.finish()
    content, calls, ids = "", [], []
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):  # a new call: index, id, type and name first, arguments ""
                assert tc["type"] == "function" and tc["function"]["arguments"] == "", tc
                calls.append([tc["function"]["name"], ""])
                ids.append(tc["id"])
            else:  # then its arguments, under the index of the latest call
                assert tc["index"] == len(calls) - 1 and set(tc) == {"index", "function"}, tc
                calls[-1][1] += tc["function"]["arguments"]
    assert ids == [c.id for c in parser.calls] and len(set(ids)) == len(ids)
    assert [(c.name, c.arguments) for c in parser.calls] == [tuple(c) for c in calls]
    # streams.py says "tool_calls" when parser.calls is not empty, as app.py does for the whole calls
    return content or None, [tuple(c) for c in calls], bool(parser.calls)


def whole(text: str, names: tuple[str, ...] | None = TOOLS) -> tuple[str | None, list[tuple[str, str]], bool]:
    content, calls = parse_tool_calls(text, names)
    return content, [(c.name, c.arguments) for c in calls], bool(calls)


def cut(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# ------------------------------------------------------------------------------------ answers

# strings that look like the tags, or parts of them, inside text and inside JSON strings
TAGGY = st.sampled_from([OPEN, CLOSE, "<tool", "</tool_", "_call>", "<", ">", "{", "}", '"', "\\", "\n", " ", "é",
                         "😀", "\u00a0"])
TEXT = st.lists(st.one_of(TAGGY, st.text(max_size=6)), max_size=6).map("".join)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False),
                    TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)
ARGS = st.dictionaries(TEXT, JSON, max_size=4)
WS = st.sampled_from(["", " ", "\n", "\n\n", " \t\n"])


@st.composite
def body(draw: st.DrawFn, name: str, arguments: str) -> str:
    """A call's body as a model may lay it out: whitespace around the parts, either key name."""
    key = draw(st.sampled_from(["arguments", "parameters"]))
    w = [draw(WS) for _ in range(6)]
    return f'{w[0]}{{{w[1]}"name"{w[2]}:{w[3]}{json.dumps(name)},{w[4]}"{key}":{w[5]}{arguments}{draw(WS)}}}{draw(WS)}'


def dumps(draw: st.DrawFn, value: Any) -> str:
    indent = draw(st.sampled_from([None, 0, 2]))
    return json.dumps(value, indent=indent, ensure_ascii=draw(st.booleans()))


@st.composite
def good_call(draw: st.DrawFn) -> str:
    text = draw(body(draw(st.sampled_from(TOOLS)), dumps(draw, draw(ARGS))))
    return OPEN + text + CLOSE


@st.composite
def bad_call(draw: st.DrawFn) -> str:
    name, args = draw(st.sampled_from(TOOLS)), dumps(draw, draw(ARGS))
    kind = draw(st.sampled_from(["list", "scalar", "unclosed", "unknown", "invalid", "unterminated",
                                 "nested", "extra_close", "no_header", "trailing"]))
    if kind == "list":
        return OPEN + draw(body(name, dumps(draw, draw(st.lists(JSON, max_size=3))))) + CLOSE
    if kind == "scalar":
        return OPEN + draw(body(name, dumps(draw, draw(SCALARS)))) + CLOSE
    if kind == "unclosed":  # the outer object, or the arguments, lack their last brace
        text = draw(body(name, args)).rstrip()
        return OPEN + (text[:-1] if draw(st.booleans()) else text.replace(args, args[:-1])) + CLOSE
    if kind == "unknown":
        return OPEN + draw(body(draw(st.sampled_from(["nope", "get_weathe", "GET_TIME", ""])), args)) + CLOSE
    if kind == "invalid":
        garbage = draw(st.sampled_from(["{", "{]", "not json", '{"a": }', "{'a': 1}", "[" * 3000 + "]" * 3000]))
        return OPEN + draw(st.sampled_from([draw(body(name, garbage)), garbage])) + CLOSE
    if kind == "unterminated":
        return OPEN + draw(body(name, args))
    if kind == "nested":
        return OPEN + OPEN + draw(body(name, args)) + CLOSE + draw(st.sampled_from(["", CLOSE]))
    if kind == "extra_close":
        return OPEN + draw(body(name, args)) + CLOSE + CLOSE
    if kind == "no_header":
        return OPEN + dumps(draw, draw(ARGS)) + CLOSE
    return OPEN + draw(body(name, args)) + draw(st.sampled_from(["x", ", 1", "}"])) + CLOSE


ANSWER = st.lists(st.one_of(TEXT, good_call(), bad_call()), max_size=6).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=ANSWER, points=st.lists(st.integers(min_value=0), max_size=12))
def test_any_cutting_of_any_answer_streams_the_whole_parse(text: str, points: list[int]) -> None:
    assert stream(cut(text, points)) == whole(text)


@settings(max_examples=150, deadline=None)
@given(text=ANSWER)
def test_one_character_at_a_time_and_without_a_tool_list(text: str) -> None:
    assert stream(list(text)) == whole(text)
    assert stream(list(text), None) == whole(text, None) == stream([text], None)


# ------------------------------------------------------------------------------------ findings

def _every_cut(text: str, names: tuple[str, ...] | None = TOOLS) -> None:
    expected = whole(text, names)
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]], names) == expected, i
    assert stream(list(text), names) == expected


@pytest.mark.parametrize("block", [
    '{"name": "get_time", "arguments": [1, 2]}',  # arguments not an object
    '{"name": "get_time", "arguments": {"zone": "UTC"}',  # the outer object left open
    '{"name": "get_time", "arguments": {"zone": }}',  # invalid JSON
    '{"name": "rm_rf", "arguments": {}}',  # not one of the request's tools
])
def test_a_malformed_call_is_content_streamed_or_not(block: str) -> None:
    text = f"Let me check. {OPEN}\n{block}\n{CLOSE}"
    assert whole(text) == (text, [], False)
    _every_cut(text)


def test_an_unterminated_call_is_a_call_only_when_it_parses() -> None:
    good = f'{OPEN}\n{{"name": "get_time", "arguments": {{"zone": "UTC"}}}}\n'
    assert whole(good) == (None, [("get_time", '{"zone": "UTC"}')], True)
    bad = f'{OPEN}\n{{"name": "get_time", "arguments": [1'
    assert whole(bad) == (bad, [], False)
    for text in (good, bad):
        _every_cut(text)


def test_calls_and_content_between_them() -> None:
    weather = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "<tool_call>", "n": [1, {{}}]}}}}\n{CLOSE}'
    time = f'{OPEN}{{"name": "get_time", "parameters": {{}}}}{CLOSE}'
    text = f" Sure. {weather}\n and {time}\n"
    assert whole(text) == ("Sure. \n and", [("get_weather", '{"city": "<tool_call>", "n": [1, {}]}'),
                                            ("get_time", "{}")], True)
    _every_cut(text)
    # a closing tag inside an argument string ends the block there: that block is content
    cut_short = text.replace('"<tool_call>"', f'"{CLOSE}"')
    content, calls, _ = whole(cut_short)
    assert content.startswith(f"Sure. {OPEN}") and content.endswith("and") and calls == [("get_time", "{}")]
    _every_cut(cut_short)


def test_deep_json_is_content_not_an_error() -> None:
    text = f'{OPEN}{{"name": "get_time", "arguments": {"[" * 100_000}{"]" * 100_000}}}{CLOSE}'
    assert whole(text) == (text, [], False) == stream([text[:7], text[7:50_000], text[50_000:]])
