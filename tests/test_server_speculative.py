"""Speculation per request over HTTP: the draft budget field, usage.speculative (non-streamed and in
the final usage chunk) equal to the offline engine's spec_stats, and the per-request acceptance
histogram on /metrics. A real server with n-gram speculation (static policy, deterministic per
request) on a tiny float32 Llama."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from augury import LLM, SamplingParams
from helpers_server import ServerProcess, serve
from speculative_helpers import make_target

ENGINE = {"dtype": "float32", "speculative_algorithm": "ngram", "speculative_policy": "static"}
STARTS = [[10, 11, 12], [40, 41], [100, 101, 102, 103]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A bigram target (its next token a function of the current one, so its output falls into a
    cycle that prompt lookup predicts) with the tests' word-level tokenizer and chat template."""
    from conftest import build_tokenizer

    folder = make_target(tmp_path_factory.mktemp("spec-server") / "bigram", bigram=True)
    build_tokenizer().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def offline(tiny: Path) -> LLM:
    return LLM(str(tiny), device="cpu", log_stats_interval=0.0, **ENGINE)


@pytest.fixture(scope="module")
def prompts(offline: LLM) -> list[list[int]]:
    """Each start followed by the target's own greedy continuation: a random target falls into a
    loop, so prompt lookup drafts (and is accepted) from the first step on."""
    outs = offline.generate(STARTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [s + o.token_ids for s, o in zip(STARTS, outs)]


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[ServerProcess]:
    with serve(["--model", str(tiny), "--dtype", "float32", "--speculative-algorithm", "ngram",
                "--speculative-policy", "static"]) as sp:
        yield sp


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def _spec(o) -> dict[str, int]:
    s = o.spec_stats
    return {"draft_tokens": s.num_draft_tokens, "accepted_tokens": s.num_accepted_draft_tokens,
            "verify_steps": s.num_verify_steps}


@pytest.mark.parametrize("budget", [None, 2, 0])
def test_usage_speculative_matches_spec_stats(client, offline, tiny, prompts, budget):
    prompt = prompts[0]
    want = offline.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     max_draft_tokens=budget), use_tqdm=False)[0]
    spec = _spec(want)
    if budget == 0:
        assert spec == {"draft_tokens": 0, "accepted_tokens": 0, "verify_steps": 0}
    else:
        assert spec["verify_steps"] > 0 and spec["accepted_tokens"] > 0
        if budget is not None:
            assert spec["draft_tokens"] <= budget * spec["verify_steps"]
    body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
    if budget is not None:
        body["max_draft_tokens"] = budget
    out = client.completions.create(model=str(tiny), prompt=prompt, extra_body=body)
    assert out.usage.completion_tokens == 20
    assert out.usage.model_extra["speculative"] == spec
    chunks = list(client.completions.create(model=str(tiny), prompt=prompt, extra_body=body, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_extra["speculative"] == spec
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_speculative_sums_the_choices_and_chat_streams_it(client, offline, tiny, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = offline.generate(prompts[1:], params, use_tqdm=False)
    out = client.completions.create(model=str(tiny), prompt=prompts[1:], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    total = {k: sum(_spec(o)[k] for o in want) for k in ("draft_tokens", "accepted_tokens", "verify_steps")}
    assert out.usage.model_extra["speculative"] == total and total["verify_steps"] > 0
    msgs = [{"role": "user", "content": "hello world hello world hello world"}]
    chat_want = offline.chat(msgs, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=str(tiny), messages=msgs, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.model_extra["speculative"] == _spec(chat_want)
    chunks = list(client.chat.completions.create(model=str(tiny), messages=msgs, max_tokens=10, temperature=0,
                                                 extra_body={"ignore_eos": True}, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.model_extra["speculative"] == _spec(chat_want)


def _histogram(server: ServerProcess) -> tuple[float, float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    count = re.search(r'^augury:request_spec_accept_length_count\{[^}]*\} (\S+)$', text, re.M)
    total = re.search(r'^augury:request_spec_accept_length_sum\{[^}]*\} (\S+)$', text, re.M)
    if count is None:
        return 0.0, 0.0
    return float(count.group(1)), float(total.group(1))


def test_acceptance_length_histogram_per_request(server, client, offline, tiny, prompts):
    n0, s0 = _histogram(server)
    params = [SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True, max_draft_tokens=b)
              for b in (None, 0, 1)]
    want = [offline.generate([prompts[2]], p, use_tqdm=False)[0] for p in params]
    for p in params:
        body = {"ignore_eos": True}
        if p.max_draft_tokens is not None:
            body["max_draft_tokens"] = p.max_draft_tokens
        client.completions.create(model=str(tiny), prompt=prompts[2], max_tokens=15, temperature=0, extra_body=body)
    n1, s1 = _histogram(server)
    spec = [o.spec_stats for o in want if o.spec_stats.num_verify_steps]  # the budget-0 request is not observed
    assert n1 - n0 == len(spec) == 2
    assert s1 - s0 == pytest.approx(sum(s.accept_length for s in spec))
    assert min(s.accept_length for s in spec) > 1.0  # lookup drafts were accepted


def test_max_draft_tokens_bad_values_are_400(server, tiny):
    for path, body in (("/v1/completions", {"prompt": "hello", "max_draft_tokens": -2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_draft_tokens": "many"})):
        r = httpx.post(server.base_url + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "max_draft_tokens"
