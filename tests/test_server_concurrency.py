"""16 concurrent requests to a real server (greedy, float32, tiny target, different prompts and
lengths, half of them streamed) each get exactly what the offline LLM gives for the same
prompt, with and without n-gram speculation: continuous batching, queueing past
--max-num-seqs, chunked prefill and speculative commits change nothing a client sees."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from augury import LLM, SamplingParams
from conftest import _word_list
from helpers_server import ServerProcess, serve

N = 16


def _prompts() -> list[str]:
    """Different prompts, 2 to 40 words; every third repeats a phrase, so prompt lookup hits."""
    words = _word_list()[5:]
    out = []
    for i in range(N):
        k = 2 + (i * 7) % 20
        phrase = [words[(i * 31 + j * 17) % len(words)] for j in range(k)]
        out.append(" ".join(phrase * 2 if i % 3 == 0 else phrase))
    return out


PROMPTS = _prompts()
MAX_TOKENS = [4 + (i * 5) % 19 for i in range(N)]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", tokenizer=True)


@pytest.fixture(scope="module")
def expected(tiny: Path) -> list[tuple[str, list[int]]]:
    llm = LLM(str(tiny), dtype="float32", device="cpu", speculative_algorithm="none", log_stats_interval=0.0)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len({o.text for o in outs}) > N // 2  # the prompts lead to different answers
    return [(o.text, o.token_ids) for o in outs]


@pytest.fixture(scope="module", params=["none", "ngram"])
def server(request, tiny: Path) -> Iterator[ServerProcess]:
    # fewer sequences than requests (some wait), and a token budget that chunks the longer prompts
    args = ["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "6", "--max-num-batched-tokens", "32",
            "--speculative-algorithm", request.param]
    with serve(args) as sp:
        yield sp


def _one(client: openai.OpenAI, model: str, i: int, start: threading.Barrier) -> tuple[str, int, str | None]:
    kw = dict(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0,
              extra_body={"ignore_eos": True})
    start.wait(30)
    if i % 2:
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, chunks[-1].usage.completion_tokens, reasons[-1] if reasons else None
    out = client.completions.create(**kw)
    return out.choices[0].text, out.usage.completion_tokens, out.choices[0].finish_reason


def test_concurrent_requests_match_offline(server: ServerProcess, tiny: Path, expected) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    start = threading.Barrier(N)
    with ThreadPoolExecutor(N) as pool:
        results = list(pool.map(lambda i: _one(client, str(tiny), i, start), range(N)))
    for i, ((text, tokens, reason), (want_text, want_ids)) in enumerate(zip(results, expected)):
        assert text == want_text, (i, PROMPTS[i])
        assert tokens == len(want_ids) == MAX_TOKENS[i] and reason == "length", i
    assert server.proc.poll() is None and "Traceback" not in server.log
