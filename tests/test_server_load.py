"""Load: dozens of concurrent streams through the official client, a quarter hanging up
early, non-streamed clients timing out, and a burst past the admission limit; afterwards
/metrics must show nothing running or waiting and every KV block free."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest

from augury.server.loadtest import is_clean, read_metrics, run_load
from helpers_server import ServerProcess, serve, shared_tiny_checkpoint

MAX_NUM_SEQS, MAX_QUEUE = 8, 40


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tiny: Path = shared_tiny_checkpoint(tmp_path_factory)
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", str(MAX_NUM_SEQS),
                "--max-queue-size", str(MAX_QUEUE), "--served-model-name", "tiny"]) as sp:
        yield sp


async def _wait_clean(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    metrics = read_metrics(base_url)
    for _ in range(int(timeout / 0.2)):
        if is_clean(metrics):
            break
        await asyncio.sleep(0.2)
        metrics = read_metrics(base_url)
    return metrics


def test_streams_with_early_disconnects(server: ServerProcess, tmp_path: Path) -> None:
    report = asyncio.run(run_load(server.base_url, "tiny", requests=40, concurrency=40, max_tokens=32,
                                  disconnect_fraction=0.25))
    print("\nload test:", json.dumps({k: v for k, v in asdict(report).items() if k != "metrics_after"}))
    (tmp_path / "load_report.json").write_text(json.dumps(asdict(report), indent=2))
    assert report.failed == 0 and report.disconnected == 10 and report.completed == 30
    assert report.tokens == 30 * 32
    assert report.clean_after, report.metrics_after
    m = report.metrics_after
    assert m["augury:kv_cache_free_blocks"] == m["augury:kv_cache_usable_blocks"]
    assert m["augury:requests_aborted_total"] >= 10
    assert m["augury:engine_step_errors_total"] == 0


def test_non_streamed_clients_that_give_up_are_aborted(server: ServerProcess) -> None:
    async def main() -> dict[str, float]:
        before = (await _wait_clean(server.base_url))["augury:requests_aborted_total"]
        # connecting may take its time; the answer (240 tokens) cannot come within 50 ms
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=0.05)) as http:
            body = {"model": "tiny", "prompt": "a long one", "max_tokens": 240, "ignore_eos": True}
            calls = [http.post(f"{server.base_url}/v1/completions", json=body) for _ in range(4)]
            results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, httpx.ReadTimeout) for r in results), results
        metrics = await _wait_clean(server.base_url)
        assert metrics["augury:requests_aborted_total"] - before == 4, metrics
        return metrics

    metrics = asyncio.run(main())
    assert is_clean(metrics), metrics


def test_burst_past_the_limit_gets_429_not_unbounded_queueing(server: ServerProcess) -> None:
    capacity = MAX_NUM_SEQS + MAX_QUEUE

    async def main() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=capacity + 16)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            body = {"model": "tiny", "prompt": "burst", "max_tokens": 48, "ignore_eos": True}
            calls = [http.post(f"{server.base_url}/v1/completions", json=body) for _ in range(capacity + 12)]
            return await asyncio.gather(*calls)

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= capacity // 2, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    metrics = asyncio.run(_wait_clean(server.base_url))
    assert is_clean(metrics), metrics
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_speculating_server_under_load_stays_clean(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same with speculation on (n-gram: no head needed): aborts mid-verification leak nothing,
    greedy streamed text equals the non-streamed text, and the acceptance metrics appear."""
    import openai

    tiny: Path = shared_tiny_checkpoint(tmp_path_factory)
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "8", "--served-model-name", "tiny",
                "--speculative-algorithm", "ngram"]) as sp:
        client = openai.OpenAI(base_url=f"{sp.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model="tiny", prompt="the quick brown fox the quick brown fox", max_tokens=40, temperature=0,
                  extra_body={"ignore_eos": True})
        plain = client.completions.create(**kw).choices[0].text
        assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == plain
        report = asyncio.run(run_load(sp.base_url, "tiny", requests=24, concurrency=24, max_tokens=32,
                                      disconnect_fraction=0.25))
        assert report.failed == 0 and report.disconnected == 6 and report.tokens == 18 * 32
        assert report.clean_after, report.metrics_after
        text = httpx.get(f"{sp.base_url}/metrics").text
        assert 'augury:spec_acceptance_rate{model_name="tiny",position="1"}' in text
        assert "augury:spec_draft_size_steps_total{" in text
        assert report.metrics_after["augury:spec_steps_total"] > 0
        assert "Traceback" not in sp.log
