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


SOURCES = ("head", "lookup", "forced")


def _spec(o) -> dict[str, int]:
    s = o.spec_stats
    out = {"draft_tokens": s.num_draft_tokens, "accepted_tokens": s.num_accepted_draft_tokens,
           "verify_steps": s.num_verify_steps}
    for source in SOURCES:
        out[f"{source}_draft_tokens"] = getattr(s, f"num_{source}_draft_tokens")
        out[f"{source}_accepted_tokens"] = getattr(s, f"num_{source}_accepted_tokens")
    return out


@pytest.mark.parametrize("budget", [None, 2, 0])
def test_usage_speculative_matches_spec_stats(client, offline, tiny, prompts, budget):
    prompt = prompts[0]
    want = offline.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     max_draft_tokens=budget), use_tqdm=False)[0]
    spec = _spec(want)
    if budget == 0:
        assert set(spec.values()) == {0}
    else:
        assert spec["verify_steps"] > 0 and spec["accepted_tokens"] > 0
        # the n-gram proposer's drafts are prompt lookup's, all of them
        assert (spec["lookup_draft_tokens"], spec["lookup_accepted_tokens"]) == (spec["draft_tokens"],
                                                                                 spec["accepted_tokens"])
        assert spec["head_draft_tokens"] == spec["forced_draft_tokens"] == 0
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
    total = {k: sum(_spec(o)[k] for o in want) for k in _spec(want[0])}
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


def _by_source(server: ServerProcess) -> dict[tuple[str, str], float]:
    """/metrics' speculative token counters: (drafted or accepted, source) -> count."""
    text = httpx.get(f"{server.base_url}/metrics").text
    found = re.findall(r'^augury:spec_(draft|accepted)_tokens_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$', text, re.M)
    return {(kind, source): float(v) for kind, source, v in found}


def test_metrics_count_draft_tokens_by_source(server, client, tiny, prompts):
    """/metrics' draft and accepted token counters carry a source label (head, lookup, forced); an
    answer's drafts add what its usage.speculative says, under the n-gram proposer all to lookup."""
    before = _by_source(server)
    assert {s for _, s in before} == set(SOURCES)
    out = client.completions.create(model=str(tiny), prompt=prompts[0], max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    spec = out.usage.model_extra["speculative"]
    after = _by_source(server)
    assert spec["lookup_draft_tokens"] > 0
    for source in SOURCES:
        assert after["draft", source] - before["draft", source] == spec[f"{source}_draft_tokens"]
        # the engine counts the verifier's verdict; a request what it emitted (max_tokens may cut a path)
        assert after["accepted", source] - before["accepted", source] >= spec[f"{source}_accepted_tokens"]
    assert after["accepted", "lookup"] > before["accepted", "lookup"]


def test_max_draft_tokens_bad_values_are_400(server, tiny):
    for path, body in (("/v1/completions", {"prompt": "hello", "max_draft_tokens": -2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_draft_tokens": "many"})):
        r = httpx.post(server.base_url + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "max_draft_tokens"


# ------------------------------------------------------------------------------- log-probabilities

def _words(tok, ids: list[int]) -> list[str]:
    return [tok.decode([t]) for t in ids]


def test_completion_logprobs_equal_the_engines(client, offline, tiny, prompts):
    tok = offline.tokenizer
    want = offline.generate([prompts[0]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                         logprobs=3, prompt_logprobs=3), use_tqdm=False)[0]
    assert want.spec_stats.num_accepted_draft_tokens > 0  # some logprobs came from verified drafts
    kw = dict(model=str(tiny), prompt=prompts[0], max_tokens=16, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw).choices[0]
    lp = out.logprobs
    assert lp.tokens == _words(tok, want.token_ids)
    assert lp.token_logprobs == pytest.approx([d[t].logprob for d, t in zip(want.logprobs, want.token_ids)],
                                              abs=1e-6)
    for d, top in zip(want.logprobs, lp.top_logprobs):
        assert top == pytest.approx({tok.decode([i]): x.logprob for i, x in d.items()}, abs=1e-6)
        assert 3 <= len(top) <= 4
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    # streamed: the same tokens and values, spread over the chunks
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs]
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == lp.tokens
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == lp.token_logprobs
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == lp.text_offset
    # echo: the prompt's text and logprobs first, its first token without any
    echo = client.completions.create(**kw, echo=True).choices[0]
    prompt_text = tok.decode(prompts[0])
    assert echo.text == prompt_text + out.text
    n = len(prompts[0])
    assert echo.logprobs.tokens[:n] == _words(tok, prompts[0]) and echo.logprobs.tokens[n:] == lp.tokens
    assert echo.logprobs.token_logprobs[0] is None and echo.logprobs.top_logprobs[0] is None
    assert echo.logprobs.token_logprobs[1:n] == pytest.approx(
        [d[t].logprob for d, t in zip(want.prompt_logprobs[1:], prompts[0][1:])], abs=1e-6)
    streamed = list(client.completions.create(**kw, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echo.text
    assert sum((c.choices[0].logprobs.tokens for c in streamed if c.choices), []) == echo.logprobs.tokens


def test_chat_logprobs_equal_the_engines(client, offline, tiny):
    tok = offline.tokenizer
    msgs = [{"role": "user", "content": "hello world hello world"}]
    want = offline.chat(msgs, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2),
                        use_tqdm=False)[0]
    kw = dict(model=str(tiny), messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert [c.token for c in content] == _words(tok, want.token_ids)
    assert [c.logprob for c in content] == pytest.approx(
        [d[t].logprob for d, t in zip(want.logprobs, want.token_ids)], abs=1e-6)
    for c, d in zip(content, want.logprobs):
        ranked = sorted((x for x in d.items() if x[1].rank <= 2), key=lambda x: x[1].rank)
        assert [t.token for t in c.top_logprobs] == [tok.decode([i]) for i, _ in ranked]
        assert len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode())
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob and c.top_logprobs[0].logprob >= c.logprob
    streamed = [ch for ch in client.chat.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs]
    assert [c.token for ch in streamed for c in ch.choices[0].logprobs.content] == [c.token for c in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hello", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hello", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hello", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
])
def test_bad_logprobs_are_400(server, path, body, param):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(server.base_url + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
