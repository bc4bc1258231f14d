"""Tool-call formats beside hermes (llama3_json, mistral, qwen3_coder, pythonic): answers written by hand
in each model family's format (several calls, text before them, malformed ones) parse into the calls
the family meant; for every answer and every way of cutting it, the streamed deltas join into the
whole parse; well-formed calls round-trip; the required / named grammars in each format accept what
the format's rule reads, and what a random walk through them writes parses into calls whose
arguments validate against the tools' schemas."""
from __future__ import annotations

import json
import keyword
import random
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from augury.structured.tool_parsers import FORMATS, ToolCallStream, parse_tool_calls
from augury.structured.tools import tool_format

WEATHER = {"type": "object", "required": ["city", "days"], "properties": {
    "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "alerts": {"type": "boolean"}, "extra": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}}}}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME, "noop": None}
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "parameters": s or {"type": "object"}}}
                for n, s in TOOLS.items()]


def stream(fmt: str, pieces: list[str], names: Any = TOOLS) -> tuple[str | None, list[tuple[str, str]]]:
    """Feed the pieces, then rebuild what a client sees: (content, [(name, arguments)])."""
    parser = ToolCallStream(names, fmt)
    deltas: list[dict[str, Any]] = []
    for p in pieces:
        deltas += parser.feed(p)
    deltas += parser.finish()
    content, calls = "", []
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):  # a new call: id, type and name first, arguments ""
                assert tc["type"] == "function" and tc["function"]["arguments"] == "" and tc["id"].startswith("call_")
                calls.append([tc["function"]["name"], ""])
            else:
                assert tc["index"] == len(calls) - 1 and set(tc) == {"index", "function"}, tc
                calls[-1][1] += tc["function"]["arguments"]
    assert [(c.name, c.arguments) for c in parser.calls] == [tuple(c) for c in calls]
    return content or None, [tuple(c) for c in calls]


def whole(fmt: str, text: str, names: Any = TOOLS) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, names, fmt)
    return content, [(c.name, c.arguments) for c in calls]


def every_cut(fmt: str, text: str, names: Any = TOOLS) -> tuple[str | None, list[tuple[str, Any]]]:
    """The whole parse, checked against the stream cut at every point and one character at a time;
    the calls with their arguments decoded."""
    expected = whole(fmt, text, names)
    for i in range(len(text) + 1):
        assert stream(fmt, [text[:i], text[i:]], names) == expected, i
    assert stream(fmt, list(text), names) == expected
    return expected[0], [(n, json.loads(a)) for n, a in expected[1]]


# ------------------------------------------------------------------------------------ captured answers
# written by hand the way each family answers (special tokens as the text shows them when the request
# keeps them; without them where a tokenizer leaves them out)

PARIS = ("get_weather", {"city": "Paris", "days": 3})
TOKYO = ("get_weather", {"city": "Tokyo", "days": 1, "alerts": True})
CET = ("get_time", {"zone": "CET"})

CAPTURED = [
    # Llama 3.1 8B Instruct, built-in JSON tool calling after <|python_tag|>
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
     None, [PARIS]),
    # Llama 3.2 3B Instruct, the tag left out of the text, two calls
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [PARIS, CET]),
    ("llama3_json", '\n\n{"type": "function", "name": "get_time", "parameters": {"zone": "CET"}}', None, [CET]),
    ("llama3_json", 'I will look that up.<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}',
     "I will look that up.", [CET]),
    # an answer that is JSON but no call, and a call in the middle of prose: content
    ("llama3_json", '{"city": "Paris", "days": 3}', '{"city": "Paris", "days": 3}', []),
    ("llama3_json", 'The call would be {"name": "get_time", "parameters": {}}.',
     'The call would be {"name": "get_time", "parameters": {}}.', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}} and then some',
     '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}} and then some', []),
    # Mistral 7B Instruct v0.3 (tokenizer v3): a JSON array after [TOOL_CALLS]
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [PARIS, CET]),
    # Mistral Small 3.1 / Magistral (tokenizer v11+): name[ARGS]{...} per call
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     None, [PARIS, CET]),
    ("mistral", 'Let me check.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "days": 3}',
     "Let me check.", [PARIS]),
    ("mistral", '[TOOL_CALLS] [{"name": "rm_rf", "arguments": {}}]',
     '[TOOL_CALLS] [{"name": "rm_rf", "arguments": {}}]', []),  # not one of the request's tools
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"', '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"', []),
    # Qwen3-Coder 30B-A3B Instruct: XML, values typed by the schema
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", None, [PARIS]),
    ("qwen3_coder", "I'll check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n"
                    "<parameter=days>\n1\n</parameter>\n<parameter=alerts>\ntrue\n</parameter>\n</function>\n</tool_call>\n"
                    "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
     "I'll check both.", [TOKYO, CET]),
    # a string parameter keeps its text (a number-looking city stays a string), JSON for objects
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n2\n"
                    "</parameter>\n<parameter=extra>\n{\"unit\": \"C\"}\n</parameter>\n</function>\n</tool_call>",
     None, [("get_weather", {"city": "42", "days": 2, "extra": {"unit": "C"}})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nstray\n</function>\n"
                    "</tool_call>", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                                    "stray\n</function>\n</tool_call>", []),
    # Llama 3.2 (pythonic system prompt) and Llama 4 (<|python_start|> ... <|python_end|>)
    ("pythonic", "[get_weather(city='Paris', days=3), get_time(zone='CET')]", None, [PARIS, CET]),
    ("pythonic", '<|python_start|>[get_weather(city="Tokyo", days=1, alerts=True)]<|python_end|>', None, [TOKYO]),
    ("pythonic", "[noop()]", None, [("noop", {})]),
    ("pythonic", "[get_weather('Paris', 3)]", "[get_weather('Paris', 3)]", []),  # positional: not a call
    ("pythonic", "[get_weather(city=open('x'))]", "[get_weather(city=open('x'))]", []),  # not a literal
    ("pythonic", "Sure: [get_time(zone='CET')]", "Sure: [get_time(zone='CET')]", []),  # prose first
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CAPTURED)
def test_captured_answers(fmt: str, text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    assert every_cut(fmt, text) == (content, calls)


def test_calls_of_unknown_functions_or_any_function() -> None:
    text = '{"name": "other", "parameters": {}}'
    assert every_cut("llama3_json", text) == (text, [])
    assert every_cut("llama3_json", text, None) == (None, [("other", {})])
    # without schemas (a tool list of names), qwen3_coder values stay text
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    assert every_cut("qwen3_coder", text, ["get_weather"]) == (None, [("get_weather", {"days": "3"})])


# ------------------------------------------------------------------------------------ properties

NAMES = st.sampled_from(sorted(TOOLS))
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False),
                   st.text(max_size=8))
VALUE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                     max_leaves=6)
# argument names Python can take as keywords (pythonic writes them so)
ARGS = st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True).filter(lambda k: not keyword.iskeyword(k)),
                       VALUE, max_size=4)
WS = st.sampled_from(["", " ", "\n", "\n\n", " \t\n"])


@st.composite
def calls_strategy(draw: st.DrawFn, fmt: str) -> tuple[str, list[tuple[str, Any]]]:
    """Well-formed calls as the family writes them (layout varied) -> (text, [(name, arguments)])."""
    calls = [(draw(NAMES), draw(ARGS)) for _ in range(draw(st.integers(1, 3)))]
    indent = draw(st.sampled_from([None, 2]))
    dump = lambda v: json.dumps(v, indent=indent, ensure_ascii=draw(st.booleans()))  # noqa: E731
    if fmt == "llama3_json":
        key = draw(st.sampled_from(["parameters", "arguments"]))
        objs = [dump({"name": n, key: a}) for n, a in calls]
        text = draw(st.sampled_from(["", "<|python_tag|>"])) + draw(st.sampled_from([";", "; ", ";\n"])).join(objs)
    elif fmt == "mistral":
        if draw(st.booleans()):
            text = "[TOOL_CALLS]" + draw(WS) + dump([{"name": n, "arguments": a} for n, a in calls])
        else:
            text = "".join(f"[TOOL_CALLS]{n}[ARGS]{dump(a)}" for n, a in calls)
    elif fmt == "qwen3_coder":  # every value a JSON text under a schema-less parameter: read as text
        calls = [(n, {k: json.dumps(v) for k, v in a.items()}) for n, a in calls]
        text = draw(WS).join(
            "<tool_call>\n<function=%s>\n%s</function>\n</tool_call>" % (n, "".join(
                f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())) for n, a in calls)
    else:  # pythonic: Python's own literals
        text = "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"
    return text, calls


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral", "qwen3_coder", "pythonic"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_well_formed_calls_round_trip(fmt: str, data: st.DataObject) -> None:
    text, calls = data.draw(calls_strategy(fmt))
    lead = data.draw(WS)
    names = {n: None for n in TOOLS}  # no schemas: qwen3_coder values stay the text written
    content, parsed = whole(fmt, lead + text, names)
    assert content is None and [(n, json.loads(a)) for n, a in parsed] == calls
    pieces = data.draw(st.lists(st.integers(0, len(text) + len(lead)), max_size=8))
    assert stream(fmt, cut(lead + text, pieces), names) == (content, parsed)


# the pieces each format's answers are made of, whole and broken, inside text and inside JSON strings
FRAGMENTS = {
    "llama3_json": ["<|python_tag|>", "<|python", "{", "}", ";", '"name"', '"parameters"', ":", "[", "]"],
    "mistral": ["[TOOL_CALLS]", "[TOOL_", "[ARGS]", "[CALL_ID]", "[", "]", "{", "}", '"name"', '"arguments"'],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<tool_", "<function=get_weather>", "<function=", "</function>",
                    "<parameter=city>", "<parameter=", "</parameter>", "</param", "\n"],
    "pythonic": ["[", "]", "(", ")", "=", ",", "get_time(", "noop()", "'", '"', "**", "<|python_start|>",
                 "<|python_end|>", "true", "None"],
}
COMMON = ["\n", " ", "é", "😀", "\\", "x"]


def answers(fmt: str) -> st.SearchStrategy[str]:
    """Text, well-formed calls and their fragments, in any order: malformed calls of every kind."""
    text = st.lists(st.one_of(st.sampled_from(FRAGMENTS[fmt] + COMMON), st.text(max_size=5)), max_size=6).map("".join)
    good = calls_strategy(fmt).map(lambda tc: tc[0])
    broken = good.flatmap(lambda t: st.integers(0, len(t)).map(lambda i: t[:i]))  # cut short
    return st.lists(st.one_of(text, good, broken), max_size=5).map("".join)


def cut(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"])
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_cutting_of_any_answer_streams_the_whole_parse(fmt: str, data: st.DataObject) -> None:
    text = data.draw(answers(fmt if fmt != "hermes" else "qwen3_coder"))
    points = data.draw(st.lists(st.integers(min_value=0), max_size=10))
    names = data.draw(st.sampled_from([TOOLS, None, ["get_time"]]))
    assert stream(fmt, cut(text, points), names) == whole(fmt, text, names)
    assert stream(fmt, list(text[:200]), names) == whole(fmt, text[:200], names)


def test_deep_or_huge_answers_are_content_not_errors() -> None:
    for fmt, text in [("llama3_json", '{"name": "noop", "parameters": ' + "[" * 50_000 + "]" * 50_000 + "}"),
                      ("mistral", "[TOOL_CALLS]" + "[" * 50_000 + "]" * 50_000),
                      ("pythonic", "[noop(x=" + "[" * 50_000 + "]" * 50_000 + ")]"),
                      ("pythonic", "[" * 100_000),
                      ("qwen3_coder", "<tool_call>\n<function=get_weather>\n" + "<parameter=city>\n" * 20_000)]:
        assert whole(fmt, text) == (text.strip(), []) == stream(fmt, [text[:7], text[7:40_000], text[40_000:]])


# ------------------------------------------------------------------------------------ grammars

@pytest.fixture(scope="module")
def compiler():
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "é", "</s>"]  # one character a token, and an end token
    return xgr, xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])), vocab


def walk(xgr, compiled, vocab: list[str], rng: random.Random, limit: int = 3000) -> str | None:
    """A random path through the grammar: a text it accepts (ending where it may end), or None."""
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, len(vocab))
    out = []
    for _ in range(limit):
        matcher.fill_next_token_bitmask(mask)
        words = mask[0].tolist()
        allowed = [t for t in range(len(vocab)) if (words[t // 32] >> (t % 32)) & 1]
        stop = len(vocab) - 1
        if stop in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return "".join(out)
        t = rng.choice([a for a in allowed if a != stop])
        assert matcher.accept_token(t)
        out.append(vocab[t])
    return None


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"])
@pytest.mark.parametrize("choice", ["required", "named", "one"])
def test_required_and_named_grammars_write_what_the_rule_reads(compiler, fmt: str, choice: str) -> None:
    xgr, comp, vocab = compiler
    tools = OPENAI_TOOLS[:2]  # with schemas
    tool_choice = OPENAI_TOOLS[0] if choice == "named" else "required"
    grammar = comp.compile_structural_tag(json.dumps(
        {"type": "structural_tag", "format": tool_format(tools, tool_choice, choice == "required", fmt)}))
    rng = random.Random(f"{fmt}-{choice}")
    seen = 0
    for _ in range(12):
        text = walk(xgr, grammar, vocab, rng)
        if text is None:  # a walk that did not end within the limit (a long string): try another
            continue
        seen += 1
        content, calls = every_cut(fmt, text, TOOLS) if len(text) < 400 else whole(fmt, text, TOOLS)
        assert content is None and calls, text
        assert choice == "required" or len(calls) == 1
        for name, args in calls:
            args = json.loads(args) if isinstance(args, str) else args
            assert choice != "named" or name == "get_weather"
            jsonschema.validate(args, TOOLS[name])
    assert seen >= 6
    # and what the family writes for one call is in the grammar
    matcher = xgr.GrammarMatcher(grammar)
    written = FORMATS[fmt].write("get_weather", '{"city": "Paris", "days": 3}')
    assert matcher.accept_string(written) and matcher.accept_token(len(vocab) - 1)


def test_pythonic_grammar_refuses_names_python_cannot_call() -> None:
    tools = [{"type": "function", "function": {"name": "get-time", "parameters": {"type": "object"}}}]
    with pytest.raises(ValueError, match="get-time"):
        tool_format(tools, "required", True, "pythonic")
