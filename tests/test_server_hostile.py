"""One request cannot hurt another, over HTTP: every limit is a 400 naming the field before admission,
malformed fields are 400s (never 500s), a constraint its bad words make impossible is refused at
admission, one that turns impossible later ends that request alone with a clear error while the
requests beside it answer exactly as they do alone, and a slow grammar compile is a 400 within its
time limit that holds up neither decoding nor the probes."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers_server import ServerProcess, serve, shared_tiny_checkpoint

LIMITS = ["--limit-n", "4", "--limit-stop", "3", "--limit-stop-length", "20", "--limit-stop-token-ids", "5",
          "--limit-bad-words", "3", "--limit-logit-bias", "4", "--limit-tools", "2", "--limit-tools-bytes", "2000",
          "--limit-schema-bytes", "600", "--limit-schema-depth", "4", "--limit-regex-length", "40",
          "--limit-choices", "3", "--limit-max-tokens", "40", "--limit-compile-seconds", "0.5"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[ServerProcess]:
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "8", *LIMITS]) as sp:
        yield sp


def _post(server: ServerProcess, path: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout)


def _tool(name: str, params: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params or {"type": "object"}}}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CMPL = {"prompt": "the quick brown", "max_tokens": 4}

# (route, body, the param the 400 names, a word its message holds)
HOSTILE = [
    ("cmpl", {**CMPL, "n": 5}, "n", "4"),
    ("cmpl", {**CMPL, "max_tokens": 41}, "max_tokens", "40"),
    ("cmpl", {**CMPL, "stop": ["a", "b", "c", "d"]}, "stop", "3"),
    ("cmpl", {**CMPL, "stop": ["x" * 21]}, "stop", "20"),
    ("cmpl", {**CMPL, "stop_token_ids": list(range(6))}, "stop_token_ids", "5"),
    ("cmpl", {**CMPL, "stop_token_ids": [10**9]}, "stop_token_ids", "["),
    ("cmpl", {**CMPL, "bad_words": ["a", "b", "c", "d"]}, "bad_words", "3"),
    ("cmpl", {**CMPL, "bad_words": ["y" * 21]}, "bad_words", "20"),
    ("cmpl", {**CMPL, "logit_bias": {str(i): 1 for i in range(5)}}, "logit_bias", "4"),
    ("cmpl", {**CMPL, "logit_bias": {"²": 1}}, "logit_bias", "token ids"),
    ("cmpl", {**CMPL, "logit_bias": {"1e3": 1}}, "logit_bias", "token ids"),
    ("cmpl", {**CMPL, "logit_bias": {"99999999": 1}}, "logit_bias", "token ids"),
    ("cmpl", {**CMPL, "guided_regex": "a" * 41}, "guided_regex", "40"),
    ("cmpl", {**CMPL, "guided_choice": ["a", "b", "c", "d"]}, "guided_choice", "3"),
    ("cmpl", {**CMPL, "guided_json": _nested(5)}, "guided_json", "nesting"),
    ("cmpl", {**CMPL, "guided_json": {"type": "object", "description": "z" * 700}}, "guided_json", "600"),
    ("cmpl", {**CMPL, "guided_grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(100))},
     "guided_grammar", "600"),
    ("cmpl", {**CMPL, "guided_choice": ["a"], "bad_words": ["a"]}, "bad_words", "ban every token"),
    ("chat", {**CHAT, "tools": [_tool("a"), _tool("b"), _tool("c")]}, "tools", "2"),
    ("chat", {**CHAT, "tools": [_tool("a", {"type": "object", "description": "d" * 2100})]}, "tools", "2000"),
    ("chat", {**CHAT, "tools": [_tool("a", _nested(5))]}, "tools", "nesting"),
    ("chat", {**CHAT, "tools": [_tool("f")], "tool_choice": {"type": "function", "function": "f"}},
     "tool_choice", "function"),
    ("chat", {**CHAT, "tools": [_tool("f")], "tool_choice": {"function": None}}, "tool_choice", "function"),
    ("chat", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": _nested(5)}}},
     "response_format", "nesting"),
]


@pytest.mark.parametrize("route, body, param, word", HOSTILE, ids=[f"{h[2]}-{i}" for i, h in enumerate(HOSTILE)])
def test_hostile_fields_are_400_naming_the_field(server: ServerProcess, route, body, param, word) -> None:
    r = _post(server, "/v1/completions" if route == "cmpl" else "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err


def _answer(server: ServerProcess, body: dict) -> tuple[int, str]:
    r = _post(server, "/v1/completions", body)
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


async def _stream(client: httpx.AsyncClient, server: ServerProcess, body: dict) -> tuple[str, list[str]]:
    """(text, error messages) of a streamed completion."""
    text, errors = [], []
    async with client.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"]["message"])
            else:
                text.append(event["choices"][0]["text"])
    return "".join(text), errors


def test_a_request_meeting_an_impossible_token_fails_alone(server: ServerProcess) -> None:
    """The grammar allows "x" then only "a", which is a bad word: admission cannot see it (the first
    token is free), the request fails with the reason when it gets there; the greedy requests
    decoding beside it, streamed and not, answer exactly as they do alone."""
    good = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            for p in ("the quick brown fox", "one two three", "a b c d e")]
    alone = [_answer(server, g) for g in good]
    assert all(status == 200 for status, _ in alone)
    doomed = {"prompt": "say it", "max_tokens": 8, "temperature": 0, "guided_regex": "xa", "bad_words": ["a"]}
    status, text = _answer(server, doomed)
    assert status == 400 and "no valid next token" in text

    async def together() -> tuple[list, list]:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [_stream(client, server, g) for g in good] + [_stream(client, server, doomed)] * 3
            streamed = await asyncio.gather(*tasks)
            whole = await asyncio.gather(*[client.post(server.base_url + "/v1/completions", json=b)
                                           for b in good + [doomed]])
            return streamed, whole

    streamed, whole = asyncio.run(together())
    for (text, errors), (_, want) in zip(streamed[:3], alone):
        assert errors == [] and text == want
    for text, errors in streamed[3:]:
        assert len(errors) == 1 and "no valid next token" in errors[0]
    for r, (_, want) in zip(whole[:3], alone):
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert whole[3].status_code == 400 and "no valid next token" in whole[3].json()["error"]["message"]


def test_a_slow_compile_is_a_400_and_holds_nobody_up(server: ServerProcess) -> None:
    """A schema whose grammar takes seconds to compile (a long bounded repetition) is refused once it
    passes --limit-compile-seconds; while it compiles, /health and a plain request answer at once."""
    slow = {**CMPL, "guided_json": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 9000}},
                                    "required": ["s"]}}

    async def run() -> tuple[httpx.Response, float, float, tuple[int, int]]:
        async with httpx.AsyncClient(timeout=120) as client:
            t0 = time.monotonic()
            task = asyncio.ensure_future(client.post(server.base_url + "/v1/completions", json=slow))
            await asyncio.sleep(0.2)
            t1 = time.monotonic()
            health = await client.get(server.base_url + "/health")
            plain = await client.post(server.base_url + "/v1/completions", json={**CMPL, "max_tokens": 2})
            t_plain = time.monotonic() - t1
            r = await task
            return r, time.monotonic() - t0, t_plain, (health.status_code, plain.status_code)

    r, t_slow, t_plain, codes = asyncio.run(run())
    assert codes == (200, 200)
    assert r.status_code == 400 and "did not compile within 0.5 s" in r.json()["error"]["message"], r.text
    assert t_slow < 10
    assert t_plain < 5


def test_the_server_is_whole_after_the_hostile_requests(server: ServerProcess) -> None:
    r = httpx.get(server.base_url + "/metrics", timeout=30).text
    used = [line for line in r.splitlines() if line.startswith("augury:kv_cache_usage_ratio")]
    assert used and float(used[0].split()[-1]) == 0.0, used
    status, _ = _answer(server, {**CMPL, "temperature": 0})
    assert status == 200
    assert "Traceback" not in server.log


def test_the_limits_table_lists_every_limit() -> None:
    from augury.limits import LIMITS, RequestLimits

    doc = (Path(__file__).parent.parent / "docs" / "limits.md").read_text()
    defaults = RequestLimits()
    for lim in LIMITS:
        row = next((line for line in doc.splitlines() if f"`--limit-{lim.name.replace('_', '-')}`" in line), None)
        assert row is not None, lim.name
        assert float(row.split("|")[2].split()[0]) == getattr(defaults, lim.name), row
