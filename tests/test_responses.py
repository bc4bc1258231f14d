"""OpenAI's Responses API (/v1/responses) through the official `openai` client, against a real
`python -m augury.server` on a tiny random Llama (float32): text (the chat path's answer), streamed
events that add up to the non-streamed response, JSON schema via text.format (responses.parse), a
forced function call, a tool round trip through previous_response_id (the prompt is exactly the
chat prompt of the whole conversation), the store's bound, and 400/404s naming the field."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from helpers_server import ServerProcess, make_tiny_checkpoint, serve

STORED = 3  # --max-stored-responses of the test server
SCHEMA = {"type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}},
          "additionalProperties": False}
TIME = {"type": "function", "name": "get_time", "description": "the time in a zone", "parameters": SCHEMA,
        "strict": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Room for a prompt that describes tools (the template takes none: they go in a system message)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-responses") / "model", max_positions=2048)


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[ServerProcess]:
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "4", "--served-model-name", "tiny",
                "--max-stored-responses", str(STORED)]) as sp:
        yield sp


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def _create(client: openai.OpenAI, **kw):
    kw.setdefault("max_output_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.responses.create(model="tiny", **kw)


def test_text_is_the_chat_answer(client: openai.OpenAI) -> None:
    r = _create(client, input="hello world", instructions="be brief")
    chat = client.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # 12 tokens of a random model: cut by max_output_tokens (incomplete), or ended by EOS (completed)
    ended = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if ended == "length" else "completed")
    assert (r.incomplete_details is not None) == (ended == "length")
    assert r.instructions == "be brief" and r.temperature == 0 and r.store is True


def test_streamed_events_add_up_to_the_response(client: openai.OpenAI) -> None:
    kw = dict(input=[{"role": "user", "content": "the quick brown fox"}], max_output_tokens=20)
    whole = _create(client, **kw)
    events = list(_create(client, stream=True, **kw))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and events[0].response.status == "in_progress"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    # more deltas, or none: the whole answer came as one delta in some runs on a Zen 5 EPYC
    assert set(kinds[5:-4]) <= {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert text == done.text == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    item = final.output[0]
    assert next(e for e in events if e.type == "response.output_item.done").item.id == item.id
    assert {e.item_id for e in events if e.type == "response.output_text.delta"} == {item.id}


class Zone(pydantic.BaseModel):
    zone: Literal["UTC", "CET"]
    dst: bool


def test_json_schema_through_text_format(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model="tiny", input="which zone?", text_format=Zone, max_output_tokens=60,
                                    temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Zone)
    raw = _create(client, input="which zone?", max_output_tokens=60, text={"format": {
        "type": "json_schema", "name": "zone", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(raw.output_text), SCHEMA)
    assert raw.text.format.type == "json_schema"
    obj = _create(client, input="an object", max_output_tokens=60, text={"format": {"type": "json_object"}})
    if obj.status == "completed":  # a random model may write a long object
        assert isinstance(json.loads(obj.output_text), dict)
    assert obj.output_text.lstrip().startswith("{")


def _call(response) -> tuple[str, dict]:
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    return calls[0], json.loads(calls[0].arguments)


def test_forced_function_call_streams_the_same(client: openai.OpenAI) -> None:
    kw = dict(input="what time is it?", tools=[TIME], tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=120)
    r = _create(client, **kw)
    call, args = _call(r)
    jsonschema.validate(args, SCHEMA)
    assert call.name == "get_time" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert r.status == "completed" and r.tools[0].name == "get_time" and r.tool_choice == "required"
    named = _create(client, **{**kw, "tool_choice": {"type": "function", "name": "get_time"}})
    assert _call(named)[0].name == "get_time"
    events = list(_create(client, stream=True, **kw))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"] and added[0].name == "get_time"
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(streamed) == json.loads(done.arguments) == args
    assert _call(events[-1].response)[1] == args


def test_tool_round_trip_through_previous_response_id(server: ServerProcess, client: openai.OpenAI) -> None:
    first = _create(client, input="what time is it?", tools=[TIME], tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=120)
    call, _ = _call(first)
    second = _create(client, previous_response_id=first.id, tools=[TIME],
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert second.previous_response_id == first.id and second.output_text is not None
    # the prompt is the chat prompt of the whole conversation: the question, the call and its answer
    messages = [{"role": "user", "content": "what time is it?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "get_time", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}]
    chat_tools = [{"type": "function", "function": {k: TIME[k] for k in ("name", "description", "parameters",
                                                                         "strict")}}]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"model": "tiny", "messages": messages,
                                                             "tools": chat_tools}).json()
    assert second.usage.input_tokens == tokens["count"]
    chat = client.chat.completions.create(model="tiny", messages=messages, tools=chat_tools, max_tokens=12,
                                          temperature=0)
    assert second.output_text == (chat.choices[0].message.content or "")
    # the same turn sent as items, without previous_response_id, is the same prompt
    again = _create(client, tools=[TIME], input=[{"role": "user", "content": "what time is it?"},
                                                 call.model_dump(exclude_none=True),
                                                 {"type": "function_call_output", "call_id": call.call_id,
                                                  "output": "12:00"}])
    assert again.usage.input_tokens == second.usage.input_tokens and again.output_text == second.output_text


def test_unknown_previous_response_id_is_a_404_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        _create(client, input="hi", previous_response_id="resp_nonesuch")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    unstored = _create(client, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        _create(client, input="again", previous_response_id=unstored.id)


def test_the_store_keeps_the_last_n_and_get_delete(client: openai.OpenAI) -> None:
    ids = [_create(client, input=f"turn {i}", max_output_tokens=2).id for i in range(STORED + 1)]
    with pytest.raises(openai.NotFoundError):  # the least recently used is gone
        client.responses.retrieve(ids[0])
    kept = [client.responses.retrieve(i) for i in ids[1:]]
    assert [k.id for k in kept] == ids[1:] and all(k.output for k in kept)
    follow = _create(client, input="and then?", previous_response_id=ids[1], max_output_tokens=2)
    assert follow.previous_response_id == ids[1]
    # using ids[1] made it recent: storing `follow` evicted ids[2], the least recently used
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[2])
    assert client.responses.retrieve(ids[1]).id == ids[1]
    client.responses.delete(ids[3])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[3])
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(ids[3])


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "web_search"}]), "tools.0.type"),
    (dict(text={"format": {"type": "grammar"}}), "text.format"),
    (dict(max_output_tokens=10**6), "max_output_tokens"),
    (dict(background=True), "background"),
    (dict(truncation="auto"), "truncation"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input.0.content.0"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input.0.type"),
    (dict(tool_choice="required"), "tool_choice"),  # no tools to call
    (dict(temperature=-1), "temperature"),
])
def test_bad_fields_are_400s_naming_them(client: openai.OpenAI, kw: dict, param: str) -> None:
    kw.setdefault("input", "hi")
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_store_bounds_count_and_bytes() -> None:
    from augury.server.responses_store import ResponseStore

    store = ResponseStore(max_items=10, max_bytes=2000)
    big = {"id": "resp_big", "output": [{"text": "x" * 3000}]}
    assert store.put(big, []) is False and store.get("resp_big") is None  # over the byte bound alone
    for i in range(6):
        assert store.put({"id": f"resp_{i}", "output": [{"text": "y" * 400}]}, [{"role": "user", "content": "hi"}])
    assert store.bytes <= 2000 and len(store) == 4  # bytes bind before the count
    assert store.get("resp_0") is None and store.get("resp_2") is not None
    store.put({"id": "resp_6", "output": [{"text": "z" * 400}]}, [])
    assert store.get("resp_2") is not None and store.get("resp_3") is None  # get made resp_2 recent
    assert ResponseStore(0).put({"id": "resp_x", "output": []}, []) is False


def test_on_the_wire(server: ServerProcess) -> None:
    """The routes by hand: each SSE event is `event: NAME` then `data: {..., "type": NAME}`; GET and
    DELETE a kept response."""
    routes = {"POST /v1/responses": "/v1/responses", "GET /v1/responses/{id}": "/v1/responses/{id}",
              "DELETE /v1/responses/{id}": "/v1/responses/{id}"}
    url = server.base_url
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 4, "temperature": 0}
    with httpx.stream("POST", url + routes["POST /v1/responses"], json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b.strip()]
    pairs = [b.split("\n") for b in blocks]
    assert all(len(p) == 2 and p[0].startswith("event: ") and p[1].startswith("data: ") for p in pairs), blocks
    assert all(json.loads(data[6:])["type"] == name[7:] for name, data in pairs)
    rid = json.loads(pairs[-1][1][6:])["response"]["id"]
    got = httpx.get(url + routes["GET /v1/responses/{id}"].format(id=rid), timeout=10)
    assert got.status_code == 200 and got.json()["id"] == rid and got.json()["status"] in ("completed", "incomplete")
    gone = httpx.request("DELETE", url + routes["DELETE /v1/responses/{id}"].format(id=rid), timeout=10)
    assert gone.json() == {"id": rid, "object": "response.deleted", "deleted": True}
    missing = httpx.get(url + routes["GET /v1/responses/{id}"].format(id=rid), timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


ACCEPTED = {"metadata": {"k": "v"}, "user": "u1", "service_tier": "auto", "include": ["message.output_text.logprobs"],
            "safety_identifier": "s1", "prompt_cache_key": "c1", "prompt_cache_retention": "in_memory",
            "stream_options": {"include_obfuscation": False}}
NEUTRAL = {"background": False, "truncation": "disabled", "conversation": None, "prompt": None,
           "max_tool_calls": None, "top_logprobs": 0, "reasoning": None, "text": {"verbosity": "medium"}}


def test_informational_fields_are_accepted_and_others_refused(server: ServerProcess) -> None:
    def post(status: int, **fields) -> httpx.Response:
        r = httpx.post(f"{server.base_url}/v1/responses", json={
            "model": "tiny", "input": "hello", "max_output_tokens": 6, "temperature": 0, **fields}, timeout=60)
        assert r.status_code == status, r.text
        return r

    plain = post(200).json()
    informed = post(200, **ACCEPTED)
    assert "X-Augury-Ignored-Fields" not in informed.headers
    assert informed.json()["output"][0]["content"][0]["text"] == plain["output"][0]["content"][0]["text"]
    assert informed.json()["metadata"] == {"k": "v"} and informed.json()["user"] == "u1"
    assert post(200, **NEUTRAL).json()["output"][0]["content"] == plain["output"][0]["content"]
    for name, value in [("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"}), ("max_tool_calls", 2),
                        ("top_logprobs", 3), ("reasoning", {"effort": "high"}), ("background", True)]:
        assert post(400, **{name: value}).json()["error"]["param"] == name
    assert post(400, text={"verbosity": "low"}).json()["error"]["param"] == "text.verbosity"
    unknown = post(200, frobnicate=1)
    assert unknown.headers["X-Augury-Ignored-Fields"] == "frobnicate"


def test_output_items_are_the_same_however_the_text_is_cut() -> None:
    """The builder on chat's parser: reasoning, then text, then a call become three items in order; a
    stream cut anywhere builds the items the whole text does, and its events say the same."""
    import random
    from types import SimpleNamespace

    from augury.server.responses import items_of
    from augury.server.responses_items import OutputBuilder
    from augury.server.chat_text import ChatTextStream

    job = SimpleNamespace(reasoning="maybe", parse_tools=True, tool_names={"get_time": SCHEMA}, tool_format="hermes")
    text = ('<think>it is late</think>Let me look. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
            '\n</tool_call>')
    whole = items_of(job, text, "stop")
    assert [i["type"] for i in whole] == ["reasoning", "message", "function_call"]
    assert whole[0]["content"][0]["text"] == "it is late" and whole[1]["content"][0]["text"] == "Let me look."
    assert (whole[2]["name"], json.loads(whole[2]["arguments"])) == ("get_time", {"zone": "UTC"})
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        parser, builder, events = ChatTextStream(job), OutputBuilder(), []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            for delta in parser.feed(text[a:b]):
                events += builder.feed(delta)
        for delta in parser.finish():
            events += builder.feed(delta)
        events += builder.finish("completed")
        strip = [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in builder.items]
        assert strip == [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in whole]  # random ids
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done == builder.items
        assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "it is late"
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Let me look."
