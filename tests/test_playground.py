"""The playground at / and the answer extension it reads (return_token_sources, server/provenance.py).

The extension's tests run a tiny random checkpoint with an EAGLE-3 head under `python -m augury.server`.
The browser test loads the page in a real headless Chromium (Debian's `chromium`, driven by
Playwright through its executable_path: no browser download) against `augury serve --model demo`
(SmolLM2-135M-Instruct and the shipped EAGLE-3 head), sends a JSON-schema request and waits for the
stream to end: accepted drafts coloured, the policy's strip filled, tok/s shown. Skipped, saying
why, where Chromium or Playwright is missing (.ci/run installs both) or the demo cannot be fetched.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers_server import ServerProcess, serve, shared_tiny_checkpoint
from augury.outputs import TOKEN_SOURCES
from augury.server.app import playground_page

KEY = "playground-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCHEMA = {"type": "object", "required": ["name", "kind"], "properties": {
    "name": {"enum": ["a very long fixed value", "another fixed value entirely"]},
    "kind": {"enum": ["first category", "second category"]}}}
DEMO_SCHEMA = {"type": "object", "required": ["city", "country", "is_capital", "rivers"], "properties": {
    "city": {"enum": ["Paris", "Lyon", "Marseille"]}, "country": {"enum": ["France", "Germany", "Italy"]},
    "is_capital": {"type": "boolean"},
    "rivers": {"type": "array", "items": {"enum": ["Seine", "Loire", "Rhone"]}, "maxItems": 2}}}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    from speculative_helpers import random_head

    tiny = shared_tiny_checkpoint(tmp_path_factory)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny)).vocab_size
    head = random_head(tmp_path_factory.mktemp("pg-head") / "head", vocab=vocab, draft_vocab=vocab, aux=(0, 1, 1))
    with serve(["--model", str(tiny), "--dtype", "float32", "--api-key", KEY, "--max-num-seqs", "4",
                "--speculative-draft-model-path", str(head), "--speculative-algorithm", "eagle3",
                "--speculative-policy", "static"]) as sp:
        yield sp


def _events(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + path, json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_the_page_is_served_at_root_without_the_key_and_fetches_nothing_elsewhere(server):
    r = httpx.get(server.base_url + "/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.text == playground_page() and "return_token_sources" in r.text
    # no CDN, no other origin: every URL the page names is one of this server's routes
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//|@import|url\(\s*[\"']?(https?:)?//", r.text)
    assert set(re.findall(r"fetch\(\"([^\"]+)\"", r.text)) == {"/v1/models", "/v1/chat/completions"}
    assert httpx.get(server.base_url + "/v1/models", timeout=30).status_code == 401  # the API still needs it


def test_streamed_chat_carries_each_tokens_source_and_each_step(server):
    body = {"messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 150, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_sources": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    events = _events(server.base_url, "/v1/chat/completions", body)
    choices = [c for e in events for c in e["choices"]]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    tokens = [t for c in choices if "augury" in c for t in c["augury"]["tokens"]]
    steps = [s for c in choices if "augury" in c for s in c["augury"]["steps"]]
    usage = events[-1]["usage"]
    assert json.loads(content)["kind"] in ("first category", "second category")
    assert len(tokens) == usage["completion_tokens"] and "".join(t["text"] for t in tokens) == content
    assert {t["source"] for t in tokens} <= set(TOKEN_SOURCES)
    spec = usage["speculative"]
    for source in ("head", "lookup", "forced"):
        assert sum(t["source"] == source for t in tokens) == spec[f"{source}_accepted_tokens"]
    assert sum(t["source"] == "forced" for t in tokens) > 0
    assert len([s for s in steps if s["draft_tokens"]]) == spec["verify_steps"]
    assert sum(s["accepted"] for s in steps) == spec["accepted_tokens"]
    assert all(set(s) == {"mode", "draft_tokens", "accepted", "reason"} and s["reason"] for s in steps)
    # not asked for: no extension anywhere
    body["return_token_sources"] = False
    assert all("augury" not in c for e in _events(server.base_url, "/v1/chat/completions", body) for c in e["choices"])


def test_completions_and_whole_answers_carry_it_too(server):
    body = {"prompt": "hello world", "max_tokens": 12, "temperature": 0, "return_token_sources": True,
            "ignore_eos": True}
    whole = httpx.post(server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=120).json()
    ext = whole["choices"][0]["augury"]
    assert len(ext["tokens"]) == 12 and "".join(t["text"] for t in ext["tokens"]) == whole["choices"][0]["text"]
    # a step per decode step after the prefill's token, each verifying the static tree, emitting its accepted
    # drafts and one token of its own (but where the output ended at a draft)
    assert all(s["mode"] == "draft" and s["draft_tokens"] > 0 for s in ext["steps"])
    assert len(ext["steps"]) + sum(s["accepted"] for s in ext["steps"]) in (11, 12)
    streamed = [c for e in _events(server.base_url, "/v1/completions", {**body, "stream": True}) for c in e["choices"]]
    # the same greedy answer, token by token (its sources may differ: drafts from the first answer's text)
    tokens = [t for c in streamed if "augury" in c for t in c["augury"]["tokens"]]
    assert [t["text"] for t in tokens] == [t["text"] for t in ext["tokens"]]
    chat = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
        "return_token_sources": True}).json()
    assert len(chat["choices"][0]["augury"]["tokens"]) == chat["usage"]["completion_tokens"]
    r = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=30,
                   json={**body, "return_token_sources": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_sources"


# ------------------------------------------------------------------------------------- the browser

@pytest.fixture(scope="module")
def chromium() -> str:
    """The system's Chromium (asked for before the demo server starts: a skip costs nothing)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("Playwright is not installed (pip install -e '.[test]' installs it)")
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium on this machine: apt-get install chromium (.ci/run does)")


@pytest.fixture(scope="module")
def demo_server() -> Iterator[ServerProcess]:
    from augury import demo

    try:
        demo.ensure_demo_target()
    except demo.DemoFetchError as e:
        pytest.skip(f"demo model not downloadable here: {e}")
    with serve(["--model", "demo", "--api-key", KEY], ready_timeout=600) as sp:
        yield sp


def test_the_playground_in_a_real_browser(chromium, demo_server, capsys):
    """Load /, type the key, ask for JSON under a schema, wait for the stream to end: at least one
    accepted draft is coloured, the strip has a bar per step, tok/s is shown, nothing went to another
    origin and the page logged no error."""
    from playwright.sync_api import sync_playwright

    base = demo_server.base_url
    t0 = time.monotonic()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            urls: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: urls.append(r.url))
            page.goto(base + "/")
            # without the key the page asks for it (its /v1/models call was a 401, which the console logs)
            page.wait_for_function("document.getElementById('conn').textContent.includes('API key')", timeout=30_000)
            errors.clear()
            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")
            page.wait_for_function("document.getElementById('model').dataset.id === 'demo'", timeout=30_000)
            page.select_option("#mode", "json")
            page.fill("#schema", json.dumps(DEMO_SCHEMA))  # one the demo's answer ends within max_tokens
            page.fill("#max-tokens", "80")
            page.click("#send")
            page.wait_for_selector("body[data-state=done], body[data-state=error]", timeout=300_000)
            assert page.get_attribute("body", "data-state") == "done", page.inner_text("#log")
            answer = page.locator(".msg.assistant").last
            drafted = answer.locator(".tok-head, .tok-lookup, .tok-forced").count()
            by_source = {s: answer.locator(f".tok-{s}").count() for s in TOKEN_SOURCES}
            bars = page.locator("#strip .step").count()
            tps = page.inner_text("#tps")
            reason = page.inner_text("#reason")
            text = answer.locator(".body").inner_text()
        finally:
            browser.close()
    seconds = time.monotonic() - t0
    with capsys.disabled():
        print(f"\nplayground browser test: {seconds:.1f} s in the browser; tokens by source {by_source}, "
              f"{bars} steps; tok/s {tps}")
    assert drafted >= 1, by_source
    assert json.loads(text)["country"] in ("France", "Germany", "Italy")  # the schema's JSON, token by token
    assert bars >= 1 and reason.startswith("last step:")
    assert float(tps) > 0
    assert not errors, errors
    assert all(u.startswith(base) for u in urls), urls
