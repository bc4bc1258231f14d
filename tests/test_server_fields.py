"""Every request field and route of docs/api.md's table, sent to a real `python -m augury.server`:
honoured fields change the answer as they say, refused ones are a 400 naming them, unknown ones are
listed in X-Augury-Ignored-Fields (and a 400 with --strict-fields); /tokenize, /detokenize and /ping;
several --served-model-name; X-Request-Id; CORS; --enable-log-requests. The table and the fields
these tests send are checked against each other (test_the_docs_table_is_what_these_tests_send)."""
from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers_server import CHAT_TEMPLATE, ServerProcess, serve, shared_tiny_checkpoint

KEY = "fields-key"
GOOD, EVIL = "http://good.example", "http://evil.example"
# the helpers' template, plus a variable of its own for chat_template_kwargs to set
TEMPLATE = CHAT_TEMPLATE + "{% if greeting is defined %}{{ greeting }}{% endif %}"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server tests' checkpoint, its tokenizer adding a BOS (<|endoftext|>) to plain text (so
    add_special_tokens shows) and its template taking a `greeting` variable."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("fields") / "model"
    shutil.copytree(shared_tiny_checkpoint(tmp_path_factory), folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", tok.bos_token_id)])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tok(tiny: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny))


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[ServerProcess]:
    with serve(["--model", str(tiny), "--dtype", "float32", "--api-key", KEY, "--max-num-seqs", "4",
                "--served-model-name", "tiny", "tiny-alias", "--enable-log-requests",
                "--allowed-origins", GOOD]) as sp:
        yield sp


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def cmpl(http: httpx.Client, status: int = 200, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0, **body}
    r = http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == status, r.text
    return r


def chat(http: httpx.Client, status: int = 200, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 8,
            "temperature": 0, **body}
    r = http.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == status, r.text
    return r


def text(r: httpx.Response) -> str:
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------------------------------ honoured

def test_min_tokens(http: httpx.Client, tok: Any) -> None:
    eos = tok.eos_token_id
    early = cmpl(http, max_tokens=20, logit_bias={str(eos): 50}).json()
    assert early["usage"]["completion_tokens"] == 1 and early["choices"][0]["finish_reason"] == "stop"
    held = cmpl(http, max_tokens=20, logit_bias={str(eos): 50}, min_tokens=5).json()
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"
    chat_held = chat(http, max_tokens=20, logit_bias={str(eos): 50}, min_tokens=3).json()
    assert chat_held["usage"]["completion_tokens"] == 4
    refused(cmpl(http, 400, max_tokens=4, min_tokens=5), "min_tokens")
    refused(cmpl(http, 400, min_tokens=-1), "min_tokens")


def _stop(http: httpx.Client) -> tuple[str, str]:
    full = text(cmpl(http, max_tokens=24, ignore_eos=True))
    stop = next((full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].isalpha()), None)
    if stop is None:
        pytest.skip(f"no letters to stop at in {full!r}")
    return full, stop


def test_include_stop_str_in_output(http: httpx.Client) -> None:
    full, stop = _stop(http)
    cut = text(cmpl(http, max_tokens=24, ignore_eos=True, stop=[stop]))
    assert cut == full[:full.index(stop)]
    kept = cmpl(http, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert text(kept) == cut + stop and kept.json()["choices"][0]["finish_reason"] == "stop"
    streamed = cmpl(http, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True, stream=True)
    assert "".join(c["choices"][0]["text"] for c in events(streamed) if c["choices"]) == cut + stop
    # stop strings wait for min_tokens: with min_tokens = max_tokens none ends the text
    assert text(cmpl(http, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=24)) == full


def test_skip_and_spaces_between_special_tokens(http: httpx.Client, tok: Any) -> None:
    start = tok.convert_tokens_to_ids("<|im_start|>")
    forced = dict(max_tokens=3, ignore_eos=True, logit_bias={str(start): 100})
    assert text(cmpl(http, **forced)) == ""  # skipped by default
    assert text(cmpl(http, **forced, skip_special_tokens=False)) == tok.decode([start] * 3)
    # this byte-level tokenizer puts no spaces between tokens: both spellings agree (the engine test
    # tests/test_output_fields.py shows the difference on a tokenizer that does)
    assert text(cmpl(http, **forced, skip_special_tokens=False, spaces_between_special_tokens=False)) == \
        "<|im_start|>" * 3
    refused(cmpl(http, 400, skip_special_tokens="maybe"), "skip_special_tokens")


def test_truncate_prompt_tokens(http: httpx.Client, tok: Any) -> None:
    ids = tok.encode("the quick brown fox jumps over the lazy dog")
    cut = cmpl(http, prompt="the quick brown fox jumps over the lazy dog", truncate_prompt_tokens=4).json()
    assert cut["usage"]["prompt_tokens"] == 4
    assert cut["choices"][0]["text"] == text(cmpl(http, prompt=ids[-4:]))
    long_chat = chat(http, truncate_prompt_tokens=3).json()
    assert long_chat["usage"]["prompt_tokens"] == 3
    refused(cmpl(http, 400, truncate_prompt_tokens=0), "truncate_prompt_tokens")
    refused(cmpl(http, 400, truncate_prompt_tokens=10**6), "truncate_prompt_tokens")


def test_add_special_tokens(http: httpx.Client, tok: Any) -> None:
    with_bos = cmpl(http, prompt="hello world").json()["usage"]["prompt_tokens"]
    without = cmpl(http, prompt="hello world", add_special_tokens=False).json()["usage"]["prompt_tokens"]
    assert with_bos == len(tok.encode("hello world")) == without + 1
    plain_chat = chat(http).json()["usage"]["prompt_tokens"]
    assert chat(http, add_special_tokens=True).json()["usage"]["prompt_tokens"] == plain_chat + 1


def test_top_k_on_chat(http: httpx.Client) -> None:
    greedy = text(chat(http, max_tokens=12, ignore_eos=True))
    for seed in (1, 2):  # hot sampling, but only the top token left: the greedy answer
        assert text(chat(http, max_tokens=12, ignore_eos=True, temperature=5.0, seed=seed, top_k=1)) == greedy


def test_chat_template_fields(http: httpx.Client, tok: Any) -> None:
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Once upon"}]

    def tokens(**kw: Any) -> list[int]:
        r = http.post("/tokenize", json={"model": "tiny", "messages": msgs, **kw})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def rendered(**kw: Any) -> list[int]:
        return tok.encode(tok.apply_chat_template(msgs, tokenize=False, **kw), add_special_tokens=False)

    assert tokens() == rendered(add_generation_prompt=True)
    assert tokens(add_generation_prompt=False) == rendered(add_generation_prompt=False)
    assert tokens(add_generation_prompt=False, continue_final_message=True) == \
        rendered(add_generation_prompt=False, continue_final_message=True)
    assert tokens(chat_template_kwargs={"greeting": "hello"}) == rendered(add_generation_prompt=True, greeting="hello")
    assert tokens(chat_template_kwargs={"greeting": "hello"}) != tokens()
    # chat completions render the same prompt
    for kw in ({}, {"add_generation_prompt": False, "continue_final_message": True},
               {"chat_template_kwargs": {"greeting": "hello"}}):
        got = chat(http, messages=msgs, **kw).json()["usage"]["prompt_tokens"]
        assert got == len(tokens(**kw)), kw
    refused(chat(http, 400, messages=msgs, continue_final_message=True), "continue_final_message")
    refused(chat(http, 400, chat_template_kwargs={"tokenize": True}), "chat_template_kwargs")


def test_continuous_usage_stats(http: httpx.Client) -> None:
    for call in (cmpl, chat):
        r = call(http, max_tokens=6, ignore_eos=True, stream=True,
                 stream_options={"include_usage": True, "continuous_usage_stats": True})
        chunks = events(r)
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert all(c["usage"] is not None for c in chunks)
        assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1]["usage"]["total_tokens"] == \
            chunks[-1]["usage"]["prompt_tokens"] + 6
        plain = events(call(http, max_tokens=6, ignore_eos=True, stream=True, stream_options={"include_usage": True}))
        assert all(c["usage"] is None for c in plain[:-1])


def test_request_id_field_and_header(http: httpx.Client) -> None:
    r = chat(http, headers={"X-Request-Id": "client-id-7"})
    assert r.headers["x-request-id"] == "client-id-7" and r.json()["id"] == "chatcmpl-client-id-7"
    s = cmpl(http, stream=True, headers={"X-Request-Id": "client-id-8"})
    assert s.headers["x-request-id"] == "client-id-8" and {c["id"] for c in events(s)} == {"cmpl-client-id-8"}
    body = cmpl(http, request_id="body-id-1")
    assert body.headers["x-request-id"] == "body-id-1" and body.json()["id"] == "cmpl-body-id-1"
    both = cmpl(http, request_id="body-id-2", headers={"X-Request-Id": "header-wins"})
    assert both.json()["id"] == "cmpl-header-wins"
    fresh = cmpl(http)
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])
    assert fresh.json()["id"] == f"cmpl-{fresh.headers['x-request-id']}"
    refused(cmpl(http, 400, headers={"X-Request-Id": "has space"}), "X-Request-Id")
    refused(cmpl(http, 400, request_id="x" * 500), "request_id")


def test_informational_fields_are_accepted(http: httpx.Client) -> None:
    r = chat(http, user="u-1", metadata={"k": "v"}, service_tier="auto", store=False)
    assert "x-augury-ignored-fields" not in r.headers
    assert text(r) == text(chat(http))


def test_sampling_fields(http: httpx.Client, tok: Any) -> None:
    long = dict(max_tokens=24, ignore_eos=True)
    greedy = text(cmpl(http, **long))
    two = cmpl(http, n=2, temperature=1.0, seed=3, **long).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    # hot sampling cut down to the top token: the greedy answer
    assert text(cmpl(http, temperature=5.0, seed=1, top_p=1e-6, **long)) == greedy
    assert text(cmpl(http, temperature=5.0, seed=1, min_p=1.0, **long)) == greedy
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert text(cmpl(http, **{name: 2.0}, **long)) != greedy, name
    pieces = cmpl(http, logprobs=0, **long).json()["choices"][0]["logprobs"]["tokens"]  # the greedy answer's
    word = next(p.strip() for p in pieces if p.strip().isalnum())
    assert text(cmpl(http, bad_words=[word], **long)) != greedy
    forced = {"100": 100}  # token 100 every time
    assert cmpl(http, logit_bias=forced, **long).json()["usage"]["completion_tokens"] == 24
    stopped = cmpl(http, logit_bias=forced, stop_token_ids=[100], **long).json()
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    assert text(cmpl(http, echo=True, max_tokens=3)).startswith("the quick brown fox")
    lp = cmpl(http, logprobs=2, max_tokens=3).json()["choices"][0]["logprobs"]
    # (keyed by text: two alternatives that decode alike, e.g. to a partial character, make one key)
    assert len(lp["tokens"]) == 3 and all(1 <= len(t) <= 2 for t in lp["top_logprobs"])
    assert any(len(t) == 2 for t in lp["top_logprobs"])
    clp = chat(http, logprobs=True, top_logprobs=2, max_tokens=3).json()["choices"][0]["logprobs"]["content"]
    assert len(clp) == 3 and all(len(e["top_logprobs"]) == 2 for e in clp)
    assert chat(http, max_completion_tokens=3, ignore_eos=True).json()["usage"]["completion_tokens"] == 3


def test_structured_output_fields(http: httpx.Client) -> None:
    boolean = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}}
    assert text(chat(http, response_format=boolean)) in ("true", "false")
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    assert json.loads(text(chat(http, max_tokens=60, guided_json=schema)))["a"] in (True, False)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text(cmpl(http, guided_regex="[a-z]{3}-[0-9]{2}")))
    assert text(cmpl(http, guided_choice=["red fox", "lazy dog"])) in ("red fox", "lazy dog")
    assert text(cmpl(http, guided_grammar='root ::= "yes" | "no"')) in ("yes", "no")
    assert text(chat(http, structured_outputs={"choice": ["up", "down"]})) in ("up", "down")


def test_tool_fields(http: httpx.Client) -> None:
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
    # (the tools prompt alone is longer than this tiny model's context: keep its end, the grammar forces the call)
    r = chat(http, max_tokens=120, tools=[tool], tool_choice="required", parallel_tool_calls=False,
             truncate_prompt_tokens=100).json()
    calls = r["choices"][0]["message"].get("tool_calls")
    assert calls, r
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_time"
    assert "zone" in json.loads(calls[0]["function"]["arguments"])
    none = chat(http, tools=[tool], tool_choice="none").json()
    assert "tool_calls" not in none["choices"][0]["message"]


# ------------------------------------------------------------------------------------------ refused

REFUSED = {
    "use_beam_search": True, "length_penalty": 0.5, "allowed_token_ids": [5, 6], "prompt_logprobs": 1,
    "priority": 3, "return_tokens_as_token_ids": True, "return_token_ids": True, "mm_processor_kwargs": {"a": 1},
    "store": True,
}
REFUSED_COMPLETION = {"best_of": 2, "suffix": "end"}
REFUSED_CHAT = {
    "echo": True, "chat_template": "{{ messages }}", "documents": [{"text": "d"}], "functions": [{"name": "f"}],
    "function_call": "auto", "audio": {"voice": "alloy"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
}


@pytest.mark.parametrize("name", sorted(REFUSED) + sorted(REFUSED_COMPLETION))
def test_refused_on_completions(http: httpx.Client, name: str) -> None:
    refused(cmpl(http, 400, **{name: {**REFUSED, **REFUSED_COMPLETION}[name]}), name)


@pytest.mark.parametrize("name", sorted(REFUSED) + sorted(REFUSED_CHAT))
def test_refused_on_chat(http: httpx.Client, name: str) -> None:
    refused(chat(http, 400, **{name: {**REFUSED, **REFUSED_CHAT}[name]}), name)


def test_refused_fields_at_their_neutral_values_pass(http: httpx.Client) -> None:
    neutral = chat(http, use_beam_search=False, length_penalty=1.0, priority=0, echo=False, modalities=["text"],
                   documents=[], best_of=None)
    assert "x-augury-ignored-fields" not in neutral.headers
    cmpl(http, best_of=1, suffix="", return_token_ids=False)


# ------------------------------------------------------------------------------------------ unknown

def test_unknown_fields_are_listed_and_warned_once(server: ServerProcess, http: httpx.Client) -> None:
    msgs = [{"role": "user", "content": "hello", "refusal_note": "x"}]
    for _ in range(2):
        r = chat(http, messages=msgs, frobnicate=3, stream_options={"include_usage": True, "wobble": 1},
                 nothing=None, stream=True)
        assert r.headers["x-augury-ignored-fields"] == "frobnicate, stream_options.wobble, messages.refusal_note"
    assert text(chat(http, frobnicate=3)) == text(chat(http))  # ignored: the same answer
    assert "x-augury-ignored-fields" not in chat(http, nothing=None).headers  # null asks for nothing
    assert _wait_for(server, "'frobnicate' is not known") == 1  # warned once per name
    assert server.log.count("'messages.refusal_note' is not known") == 1


def test_strict_fields_refuse_unknown_ones(tiny: Path) -> None:
    """--strict-fields, in process (the check comes before any engine work): a 400 naming the field,
    nested ones by their path; a null one and the declared ones pass."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from augury.server.app import create_app
    from augury.server.fields import FieldPolicy
    from augury.server.serving import ServerState

    state = ServerState(loop=None, metrics=None, model_name="tiny", max_model_len=64, vocab_size=400,
                        tokenizer=AutoTokenizer.from_pretrained(str(tiny)), executor=None, info=None, api_key=None,
                        fields=FieldPolicy(strict=True))
    from concurrent.futures import ThreadPoolExecutor

    state.executor = ThreadPoolExecutor(1)
    client = TestClient(create_app(state))
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "frob": 1})
    refused(r, "frob")
    assert r.json()["error"]["code"] == "unknown_parameter"
    r = client.post("/v1/completions", json={"prompt": "hi", "stream_options": {"wobble": True}})
    refused(r, "stream_options.wobble")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi", "x": 1}]})
    refused(r, "messages.0.x")
    ok = client.post("/tokenize", json={"prompt": "hello world", "frob": None})
    assert ok.status_code == 200 and ok.json()["tokens"] == state.tokenizer.encode("hello world")
    refused(client.post("/detokenize", json={"tokens": [5], "frob": 1}), "frob")
    state.executor.shutdown()


# ------------------------------------------------------------------------------------------ routes

def test_tokenize_and_detokenize(http: httpx.Client, tok: Any) -> None:
    prompt = "the quick brown fox"
    r = http.post("/tokenize", json={"model": "tiny", "prompt": prompt, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(prompt) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    bare = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(prompt, add_special_tokens=False) == r["tokens"][1:]
    back = http.post("/detokenize", json={"model": "tiny", "tokens": bare["tokens"]}).json()
    assert back == {"prompt": prompt}
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"])
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    c = http.post("/tokenize", json={"model": "tiny-alias", "messages": msgs}).json()
    assert c["tokens"] == tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                                     add_special_tokens=False)
    assert chat(http, messages=msgs).json()["usage"]["prompt_tokens"] == c["count"]
    refused(http.post("/detokenize", json={"tokens": [10**6]}), "tokens")
    refused(http.post("/tokenize", json={"prompt": 5}), "prompt")
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert httpx.post(f"{http.base_url}/tokenize", json={"prompt": "x"}).status_code == 401  # behind the key


def test_ping(server: ServerProcess) -> None:
    for method in ("GET", "POST"):  # a probe: no key
        assert httpx.request(method, f"{server.base_url}/ping").status_code == 200


def test_served_model_names(http: httpx.Client) -> None:
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "tiny-alias"]
    assert http.get("/v1/models/tiny-alias").json()["id"] == "tiny-alias"
    alias = chat(http, model="tiny-alias")
    assert alias.json()["model"] == "tiny" and text(alias) == text(chat(http))  # answers name the first, as vLLM's
    missing = chat(http, 404, model="other").json()
    assert missing["error"]["param"] == "model" and "'tiny-alias'" in missing["error"]["message"]


# ------------------------------------------------------------------------------------------ operations

def test_cors(server: ServerProcess) -> None:
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{server.base_url}/v1/chat/completions", headers={"Origin": GOOD, **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == GOOD  # no key needed
    bad = httpx.options(f"{server.base_url}/v1/chat/completions", headers={"Origin": EVIL, **pre})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    # the answer itself (and a 401) carries the headers a page needs to read it
    r = httpx.post(f"{server.base_url}/v1/models", headers={"Origin": GOOD})
    assert r.status_code in (401, 405) and r.headers["access-control-allow-origin"] == GOOD
    got = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": GOOD, "Authorization": f"Bearer {KEY}"})
    assert got.status_code == 200 and "X-Request-Id" in got.headers["access-control-expose-headers"]
    assert "access-control-allow-origin" not in httpx.get(f"{server.base_url}/v1/models",
                                                          headers={"Origin": EVIL}).headers


def _wait_for(server: ServerProcess, needle: str, seconds: float = 10.0) -> int:
    deadline = time.monotonic() + seconds
    while needle not in server.log and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.log.count(needle)


def test_enable_log_requests_logs_one_line_per_request(server: ServerProcess, http: httpx.Client) -> None:
    cmpl(http, max_tokens=5, ignore_eos=True, headers={"X-Request-Id": "logged-1"})
    cmpl(http, max_tokens=4, ignore_eos=True, stream=True, headers={"X-Request-Id": "logged-2"})
    chat(http, 400, min_tokens=-3, headers={"X-Request-Id": "logged-3"})
    assert _wait_for(server, "request logged-1: POST /v1/completions 200") == 1
    assert _wait_for(server, "request logged-2: POST /v1/completions 200") == 1
    assert _wait_for(server, "request logged-3: POST /v1/chat/completions 400") == 1
    line = next(ln for ln in server.lines if "request logged-1:" in ln)
    assert "completion 5 tokens, finish length" in line and "engine id cmpl-logged-1-" in line
    assert "completion 4 tokens" in next(ln for ln in server.lines if "request logged-2:" in ln)


# ------------------------------------------------------------------------------------------ the table

COVERED = {  # every field and route of docs/api.md's table -> the test above that sends it
    **{f: "test_min_tokens" for f in ["min_tokens", "logit_bias"]},
    "include_stop_str_in_output": "test_include_stop_str_in_output", "stop": "test_include_stop_str_in_output",
    "ignore_eos": "test_include_stop_str_in_output",
    "skip_special_tokens": "test_skip_and_spaces_between_special_tokens",
    "spaces_between_special_tokens": "test_skip_and_spaces_between_special_tokens",
    "truncate_prompt_tokens": "test_truncate_prompt_tokens", "prompt": "test_truncate_prompt_tokens",
    "add_special_tokens": "test_add_special_tokens",
    "top_k": "test_top_k_on_chat", "temperature": "test_top_k_on_chat", "seed": "test_top_k_on_chat",
    "max_tokens": "test_top_k_on_chat", "messages": "test_top_k_on_chat",
    "add_generation_prompt": "test_chat_template_fields", "continue_final_message": "test_chat_template_fields",
    "chat_template_kwargs": "test_chat_template_fields",
    "stream": "test_continuous_usage_stats", "stream_options.include_usage": "test_continuous_usage_stats",
    "stream_options.continuous_usage_stats": "test_continuous_usage_stats",
    "request_id": "test_request_id_field_and_header", "X-Request-Id": "test_request_id_field_and_header",
    "user": "test_informational_fields_are_accepted", "metadata": "test_informational_fields_are_accepted",
    "service_tier": "test_informational_fields_are_accepted",
    **{f: "test_refused_on_chat" for f in [*REFUSED, *REFUSED_CHAT]},
    **{f: "test_refused_on_completions" for f in REFUSED_COMPLETION},
    "model": "test_served_model_names", "(unknown fields)": "test_unknown_fields_are_listed_and_warned_once",
    "POST /tokenize": "test_tokenize_and_detokenize", "POST /detokenize": "test_tokenize_and_detokenize",
    "GET /ping": "test_ping", "GET /v1/models": "test_served_model_names",
    "POST /v1/completions": "test_sampling_fields", "POST /v1/chat/completions": "test_sampling_fields",
    **{f: "test_sampling_fields" for f in ["n", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                           "repetition_penalty", "bad_words", "stop_token_ids", "echo", "logprobs",
                                           "top_logprobs", "max_completion_tokens"]},
    **{f: "test_structured_output_fields" for f in ["response_format", "guided_json", "guided_regex",
                                                    "guided_choice", "guided_grammar", "structured_outputs"]},
    **{f: "test_tool_fields" for f in ["tools", "tool_choice", "parallel_tool_calls"]},
    "X-Augury-Ignored-Fields": "test_unknown_fields_are_listed_and_warned_once",
    "--strict-fields": "test_strict_fields_refuse_unknown_ones",
    "--enable-log-requests": "test_enable_log_requests_logs_one_line_per_request",
    "--allowed-origins ORIGIN...": "test_cors", "--served-model-name NAME...": "test_served_model_names",
}
# fields of the table sent by another test file: where their effect needs a draft model, another
# server (--generation-config) or a route of its own (/v1/responses)
RESPONSES = ["POST /v1/responses", "GET /v1/responses/{id}", "DELETE /v1/responses/{id}", "input", "instructions",
             "max_output_tokens", "text.format", "previous_response_id", "store", "include", "safety_identifier",
             "prompt_cache_key", "prompt_cache_retention", "stream_options", "background", "truncation",
             "conversation", "prompt", "max_tool_calls", "top_logprobs", "reasoning", "text.verbosity"]
ELSEWHERE = {"max_draft_tokens": "test_server_speculative.py", "AUGURY_API_KEY": "test_server_auth.py",
             "return_token_sources": "test_playground.py", "--generation-config": "test_generation_config.py",
             **{name: "test_responses.py" for name in RESPONSES if name not in COVERED}}


def test_the_docs_table_is_what_these_tests_send() -> None:
    rows = re.findall(r"^\| `([^`]+)` \|", DOCS.read_text(), flags=re.M)
    assert rows, f"no table rows in {DOCS}"
    documented = set(rows)
    assert documented - set(COVERED) - set(ELSEWHERE) == set(), "documented, but sent by no test"
    assert set(COVERED) - documented == set(), "sent here, but missing from docs/api.md"
    for name, where in ELSEWHERE.items():
        if name in documented:
            source = (Path(__file__).parent / where).read_text()
            assert re.search(rf"['\"]{re.escape(name)}['\"]|{re.escape(name)}=", source), (name, where)
