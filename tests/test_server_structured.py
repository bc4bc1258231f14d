"""Structured output, tool calls and the logit controls through the official `openai` client, against a
real `python -m augury.server` (a tiny random Llama with a byte-level tokenizer, n-gram speculation so
grammars also run through verification)."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from augury.structured.tools import ToolCallStream, parse_tool_calls
from helpers_server import ServerProcess, make_tiny_checkpoint, serve


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server tests' tiny model with room for a prompt that describes tools (~800 tokens here)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-structured") / "model", max_positions=2048)


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[ServerProcess]:
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "4",
                "--speculative-algorithm", "ngram", "--speculative-policy", "static"]) as sp:
        yield sp


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(tiny: Path) -> str:
    return str(tiny)


SCHEMA = {"type": "object", "required": ["city", "days", "units", "alerts"], "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "units": {"enum": ["metric", "imperial"]},
    "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
MESSAGES = [{"role": "user", "content": "hello"}]


def _chat(client, model, **kw):
    kw.setdefault("max_tokens", 150)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=kw.pop("messages", MESSAGES), **kw)


def test_json_schema_chat_validates_and_streams_the_same(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    plain = _chat(client, model, response_format=fmt)
    choice = plain.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = list(_chat(client, model, response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_take_json_object_regex_choice_and_grammar(client, model):
    out = client.completions.create(model=model, prompt="the quick", max_tokens=120, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out.choices[0].text), dict)
    out = client.completions.create(model=model, prompt="the quick", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", out.choices[0].text)
    out = client.completions.create(model=model, prompt="the quick", max_tokens=20, temperature=0.8, seed=3,
                                    extra_body={"guided_choice": ["red fox", "lazy dog"]})
    assert out.choices[0].text in ("red fox", "lazy dog")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="the quick", max_tokens=20, temperature=0, stream=True,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "(" [0-9]+ ")"'}}))
    assert re.fullmatch(r"yes|no|\([0-9]+\)", streamed) or len(streamed) > 0


def test_a_schema_that_cannot_finish_ends_with_length(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}}
    out = _chat(client, model, response_format=fmt, max_tokens=4)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}}, "guided_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"logit_bias": {"100000": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"extra_body": {"bad_words": [""]}}, "bad_words"),
])
def test_bad_constraints_and_controls_are_400_naming_them(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, model, max_tokens=4, **kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed_calls(chunks) -> tuple[str, list[tuple[str, dict]], str | None]:
    """Rebuild calls from OpenAI's deltas: id and name first, then argument fragments."""
    calls: dict[int, dict] = {}
    content = ""
    finish = None
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name and tc.function.arguments == ""  # the header comes first
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = c.choices[0].finish_reason or finish
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_calls_validate_and_stream_the_same(client, model, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    # one call (a random model would go on calling until max_tokens: parallel calls are a model's choice)
    kw = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=200, parallel_tool_calls=False)
    out = _chat(client, model, **kw)
    msg = out.choices[0].message
    calls = _calls(msg)
    assert calls and out.choices[0].finish_reason == "tool_calls"
    schemas = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}
    for name, args in calls:
        jsonschema.validate(args, schemas[name])
    if choice == "named":
        assert [name for name, _ in calls] == ["get_weather"]
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
    content, streamed, finish = _streamed_calls(_chat(client, model, stream=True, **kw))
    assert streamed == calls and finish == "tool_calls" and (content or None) == msg.content


def test_auto_parses_calls_the_model_writes(client, model):
    """tool_choice auto leaves the model free; a regex here makes it write a hermes call after some
    text, which the parser turns into content and a tool call, streamed and not."""
    regex = r'ok <tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    kw = dict(tools=[WEATHER, TIME], tool_choice="auto", extra_body={"structured_outputs": {"regex": regex}})
    out = _chat(client, model, **kw)
    msg = out.choices[0].message
    assert msg.content == "ok" and out.choices[0].finish_reason == "tool_calls"
    assert len(_calls(msg)) == 1 and _calls(msg)[0][0] == "get_time"
    content, streamed, finish = _streamed_calls(_chat(client, model, stream=True, **kw))
    assert (content, streamed, finish) == ("ok", _calls(msg), "tool_calls")
    none = _chat(client, model, tools=[WEATHER], tool_choice="none", extra_body=kw["extra_body"])
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content


@pytest.mark.parametrize("call", [r'\{"name": "get_time", "arguments": \[1, 2\]\}',  # arguments not an object
                                  r'\{"name": "rm", "arguments": \{\}\}'])  # not one of the request's tools
def test_auto_leaves_a_malformed_call_in_the_content(client, model, call):
    """A block that is not a call of one of the request's tools is content, streamed or not, and the
    choice finishes with "stop"."""
    kw = dict(tools=[WEATHER, TIME], tool_choice="auto",
              extra_body={"structured_outputs": {"regex": rf"ok <tool_call>\n{call}\n</tool_call>"}})
    out = _chat(client, model, **kw)
    msg = out.choices[0].message
    assert msg.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert msg.content == "ok <tool_call>\n" + call.replace("\\", "") + "\n</tool_call>"
    assert _streamed_calls(_chat(client, model, stream=True, **kw)) == (msg.content, [], "stop")


def test_tool_results_go_back_through_the_chat_template(client, model):
    first = _chat(client, model, tools=[TIME], tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    out = _chat(client, model, messages=messages, tools=[TIME], max_tokens=8, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens > first.usage.prompt_tokens and out.usage.completion_tokens == 8


def test_logit_controls_act(client, model, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    the = tok.encode(" the", add_special_tokens=False)
    assert len(the) == 1
    forced = client.completions.create(model=model, prompt="the quick", max_tokens=6, temperature=0,
                                       logit_bias={str(the[0]): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " the" * 6
    banned = client.completions.create(model=model, prompt="the quick", max_tokens=6, temperature=0,
                                       logit_bias={str(the[0]): 100},
                                       extra_body={"ignore_eos": True, "bad_words": ["the"]})
    assert the[0] not in tok.encode(banned.choices[0].text, add_special_tokens=False)
    # a two-token word: its second token is banned right after its first
    dog = tok.encode(" dog", add_special_tokens=False)
    text = client.completions.create(model=model, prompt="the quick", max_tokens=6, temperature=0,
                                     logit_bias={str(dog[0]): 50, str(dog[1]): 50},
                                     extra_body={"ignore_eos": True, "bad_words": ["dog"]}).choices[0].text
    assert "dog" not in text
    kw = dict(model=model, prompt="the quick", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    base = client.completions.create(**kw).choices[0].text
    penalised = client.completions.create(**{**kw, "frequency_penalty": 2.0, "presence_penalty": 1.0,
                                             "extra_body": {"ignore_eos": True, "repetition_penalty": 1.5,
                                                            "min_p": 0.1}}).choices[0].text
    assert penalised != base  # greedy text changes under the penalties (the tiny model repeats itself)


def test_metrics_count_constrained_requests(server, client, model):
    text = httpx.get(f"{server.base_url}/metrics").text
    n = float(re.search(r'^augury:constrained_requests_total\{[^}]*\} (\S+)$', text, re.M).group(1))
    assert n >= 1
    masked = float(re.search(r'^augury:grammar_masked_tokens_total\{[^}]*\} (\S+)$', text, re.M).group(1))
    assert masked >= 1


def test_tool_call_stream_splits_equal_the_whole_answer():
    text = ('Sure. <tool_call>\n{"name": "a", "arguments": {"x": {"y": [1, {"z": "}"}]}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": {"y": [1, {"z": "}"}]}}), ("b", {})]
    for size in (1, 2, 3, 5, 8, 13):
        stream, deltas = ToolCallStream(), []
        for i in range(0, len(text), size):
            deltas += stream.feed(text[i:i + size])
        deltas += stream.finish()
        assert "".join(d.get("content", "") for d in deltas) == content
        args: dict[int, str] = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
        assert list(args.values()) == [c.arguments for c in calls]
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])
