"""The OpenAI-compatible API, through the official `openai` client, against a real
`python -m augury.server` subprocess on loopback serving a tiny random Llama (float32)."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helpers_server import SRC, ServerProcess, serve, shared_tiny_checkpoint

KEY = "test-key-123"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[ServerProcess]:
    with serve(["--model", str(tiny), "--dtype", "float32", "--api-key", KEY, "--max-num-seqs", "4"]) as sp:
        yield sp


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(tiny: Path) -> str:
    return str(tiny)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_models(client: openai.OpenAI, model: str) -> None:
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model


def test_completion_greedy_stream_equals_plain(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="the quick brown fox", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 24 and plain.usage.prompt_tokens > 0
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_greedy_stream_equals_plain(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
              max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].message.role == "assistant" and plain.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def test_seed_top_k_top_p_and_batch(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="hello world", max_tokens=12, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"top_k": 20, "ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    many = client.completions.create(model=model, prompt=["one", "two", "three"], max_tokens=3, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.usage.completion_tokens <= 9
    ids = client.completions.create(model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 5 and len(ids.choices) == 2
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=["one", [5, 6]], max_tokens=2)  # type: ignore[list-item]
    assert info.value.body["param"] == "prompt"
    n2 = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2,
                                        max_tokens=4, seed=1)
    assert [c.index for c in n2.choices] == [0, 1]


def test_stop_sequence(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="the quick brown fox", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    found = re.search(r"[a-z]{2}", full[3:])
    if found is None:
        pytest.skip(f"no ASCII letters to stop at in {full!r}")
    stop = found.group(0)
    cut = client.completions.create(**kw, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == cut.choices[0].text


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"prompt": "x " * 400}, "prompt"),
    ({"prompt": list(range(300))}, "prompt"),
    ({"prompt": [999999]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"extra_body": {"presence_penalty": 3.0}}, "presence_penalty"),
    ({"extra_body": {"max_draft_tokens": -1}}, "max_draft_tokens"),
    ({"extra_body": {"max_draft_tokens": 1.5}}, "max_draft_tokens"),
])
def test_completion_bad_requests_are_400(client: openai.OpenAI, model: str, kwargs: dict, param: str) -> None:
    args = {"model": model, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    err = info.value.body
    assert info.value.status_code == 400 and err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param and "code" in err


def test_raw_body_errors(server: ServerProcess) -> None:
    url = server.base_url
    cases = [
        ("/v1/completions", b"{not json", "invalid_json"),
        ("/v1/completions", b'{"model": "x"}', "missing_required_parameter"),
        ("/v1/chat/completions", b'{"max_tokens": 3}', "missing_required_parameter"),
        ("/v1/chat/completions", b'{"messages": []}', None),
        ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', None),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": "lots"}', "invalid_type"),
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', None),
        ("/v1/completions", b"[1, 2, 3]", None),
    ]
    for path, body, code in cases:
        r = httpx.post(url + path, content=body, headers={**_auth(), "Content-Type": "application/json"})
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["type"] == "invalid_request_error"
        if code is not None:
            assert err["code"] == code, (body, err)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_api_key(server: ServerProcess, model: str) -> None:
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=model, prompt="hi", max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    for headers in ({}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}):
        r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (headers, r.text)
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    assert httpx.get(f"{server.base_url}/server_info").status_code == 401
    # probes and scrapers need no key
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def test_server_info_tells_running_code_apart(server: ServerProcess, model: str) -> None:
    info = httpx.get(f"{server.base_url}/server_info", headers=_auth()).json()
    assert info["engine"]["engine_config"]["model"] == model
    assert info["engine"]["dtype"] == "float32" and info["engine"]["max_model_len"] == 256
    assert info["server"]["api_key_set"] is True and KEY not in json.dumps(info)
    assert info["listening_on"] == server.base_url
    assert set(info["start_up_stage_seconds"]) >= {"configuration", "target", "warm-up", "HTTP"}
    assert info["versions"]["torch"] and info["versions"]["fastapi"]
    paths = {m["module"]: m for m in info["modules"]}
    assert paths["augury.server.app"]["path"] == str(Path(SRC) / "augury" / "server" / "app.py")
    assert paths["augury.engine.engine"]["sha256_at_start"]
    assert info["modules_changed_on_disk"] == []
    from augury.cpu import isa

    cpu_info = info["engine"]["cpu"]  # the server's own process reports the ISA its kernels run
    assert cpu_info["host_isa"] == isa.host_level()
    if isa.host_level() is not None and cpu_info["kernels"].get("w4a8"):
        assert cpu_info["kernels_isa"] in isa.LEVELS


def test_metrics_names(server: ServerProcess, client: openai.OpenAI, model: str) -> None:
    client.completions.create(model=model, prompt="metrics please", max_tokens=3)
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("augury:num_requests_running", "augury:num_requests_waiting", "augury:kv_cache_usage_ratio",
                 "augury:generation_tokens_total", "augury:spec_accept_length", "augury:spec_acceptance_rate",
                 "augury:spec_num_draft_tokens", "augury:time_to_first_token_seconds",
                 "augury:request_success_total"):
        assert name in text, name
    from augury.cpu import isa

    if isa.host_level() is not None:
        assert f'host_isa="{isa.host_level()}"' in text  # augury:cpu_kernels_info


def test_prefix_cache_hits_are_in_usage_and_metrics(server: ServerProcess, client: openai.OpenAI,
                                                     model: str) -> None:
    """A prompt sent twice: the second is served its full blocks from the prefix cache, says so in
    usage.prompt_tokens_details.cached_tokens (streamed too), answers the same, and /metrics counts it."""
    prompt = "the quick brown fox jumps over the lazy dog " * 6 + "and then"
    first = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 16 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert second.choices[0].text == first.choices[0].text
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    text = httpx.get(f"{server.base_url}/metrics").text
    hits = float(re.search(r"^augury:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M).group(1))
    queries = float(re.search(r"^augury:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M).group(1))
    assert hits >= 2 * ((n - 1) // 16 * 16) and queries >= 3 * n
    assert "augury:prefix_cache_hit_rate" in text


def test_health_and_errors_did_not_hurt(server: ServerProcess, client: openai.OpenAI, model: str) -> None:
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    # every route but the probes needs the key (test_server_auth.py), unknown ones too: past it, a 404
    assert httpx.get(f"{server.base_url}/nope", headers=_auth()).json()["error"]["code"] == "not_found"
    out = client.completions.create(model=model, prompt="still alive", max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert server.proc.poll() is None
    assert "Traceback" not in server.log
