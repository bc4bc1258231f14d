"""Tool-call formats, reasoning and --chat-template through a real `python -m augury.server` and the
official `openai` client (the tiny random Llama: it writes no format on its own, so the grammars and
regexes here make it write one).

- a Qwen3-Coder-style template given with --chat-template: --tool-call-parser auto finds its XML
  format by rendering it; tool_choice required writes calls in that format, read back the same
  streamed and not; a call the model writes with tool_choice auto is read;
- a Qwen3-style template with --reasoning-parser qwen3 and llama3_json calls: chat_template_kwargs
  {"enable_thinking": false} reaches the template (the prompt gains its closed <think> block), the
  answer is then content under the response_format, reasoning_content null; named calls in the
  llama3_json format."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from helpers_server import ServerProcess, make_tiny_checkpoint, serve
from test_chat_templates import QWEN3, QWEN3_CODER
from test_server_structured import SCHEMA, TIME, WEATHER, _calls, _streamed_calls

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-formats") / "model", max_positions=2048)


def _server(tiny: Path, template: str, *flags: str) -> Iterator[tuple[ServerProcess, openai.OpenAI]]:
    path = tiny.parent / f"template-{abs(hash(template))}.jinja"
    path.write_text(template, encoding="utf-8")
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "4", "--chat-template", str(path),
                *flags]) as sp:
        yield sp, openai.OpenAI(base_url=f"{sp.base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def coder(tiny: Path) -> Iterator[tuple[ServerProcess, openai.OpenAI]]:
    yield from _server(tiny, QWEN3_CODER)


@pytest.fixture(scope="module")
def thinker(tiny: Path) -> Iterator[tuple[ServerProcess, openai.OpenAI]]:
    yield from _server(tiny, QWEN3, "--reasoning-parser", "qwen3", "--tool-call-parser", "llama3_json")


def _chat(client: openai.OpenAI, tiny: Path, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=str(tiny), messages=kw.pop("messages", MESSAGES), **kw)


def test_auto_finds_the_templates_format(coder) -> None:
    sp, _ = coder
    info = httpx.get(f"{sp.base_url}/server_info", timeout=30).json()
    assert info["server"]["tool_call_parser"] == "qwen3_coder", info["server"]
    assert info["server"]["chat_template"] == {"renders_tools": True, "renders_calls": True,
                                               "tool_format": "qwen3_coder"}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_in_the_xml_format(coder, tiny, choice) -> None:
    _, client = coder
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=False)
    out = _chat(client, tiny, **kw)
    calls = _calls(out.choices[0].message)
    assert len(calls) == 1 and out.choices[0].finish_reason == "tool_calls", out
    schemas = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}
    for name, args in calls:
        jsonschema.validate(args, schemas[name])
    content, streamed, finish = _streamed_calls(_chat(client, tiny, stream=True, **kw))
    assert (streamed, finish) == (calls, "tool_calls") and (content or None) == out.choices[0].message.content


def test_auto_reads_an_xml_call_and_sends_it_back(coder, tiny) -> None:
    _, client = coder
    regex = r"ok\n<tool_call>\n<function=get_time>\n<parameter=zone>\n(UTC|CET)\n</parameter>\n</function>\n</tool_call>"
    kw = dict(tools=[WEATHER, TIME], tool_choice="auto", extra_body={"structured_outputs": {"regex": regex}})
    out = _chat(client, tiny, **kw)
    msg = out.choices[0].message
    assert msg.content == "ok" and out.choices[0].finish_reason == "tool_calls"
    assert _calls(msg)[0][0] == "get_time" and _calls(msg)[0][1]["zone"] in ("UTC", "CET")
    assert _streamed_calls(_chat(client, tiny, stream=True, **kw)) == ("ok", _calls(msg), "tool_calls")
    # the call and its answer go back through the template, which renders them itself
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [msg.tool_calls[0].model_dump()]},
                           {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "12:00"}]
    again = _chat(client, tiny, messages=messages, tools=[TIME], max_tokens=4, extra_body={"ignore_eos": True})
    assert again.usage.prompt_tokens > out.usage.prompt_tokens


def test_enable_thinking_reaches_the_template_and_the_schema_shapes_the_answer(thinker, tiny) -> None:
    _, client = thinker
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = _chat(client, tiny, response_format=fmt, extra_body=off)
    plain = _chat(client, tiny, max_tokens=1)
    # the template closed an empty <think> block in the prompt: more prompt tokens, and no reasoning
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens
    msg = out.choices[0].message
    assert msg.model_extra.get("reasoning_content") is None and out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    chunks = list(_chat(client, tiny, response_format=fmt, extra_body=off, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert all((c.choices[0].delta.model_extra or {}).get("reasoning_content") is None for c in chunks if c.choices)


def test_named_calls_in_the_llama_format(thinker, tiny) -> None:
    _, client = thinker
    kw = dict(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    out = _chat(client, tiny, **kw)
    calls = _calls(out.choices[0].message)
    assert [name for name, _ in calls] == ["get_time"] and out.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(calls[0][1], TIME["function"]["parameters"])
    assert _streamed_calls(_chat(client, tiny, stream=True, **kw))[1:] == (calls, "tool_calls")


def test_bad_flags_are_one_line_errors(tmp_path: Path) -> None:
    from augury.server.args import build_parser, settings_from_args

    args = build_parser().parse_args(["--model", "demo", "--chat-template", str(tmp_path / "none.jinja")])
    with pytest.raises(ValueError, match="--chat-template"):
        settings_from_args(args)
