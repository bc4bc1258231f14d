"""A bounded load test with the official `openai` client: concurrent streams, some of which
disconnect early; reports requests, tokens/s and time to first token, then checks through
/metrics that the server is clean again (nothing running or waiting, no KV block in use).

    python -m augury.server.loadtest --url http://127.0.0.1:8000 --requests 48 --concurrency 48
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx


@dataclass
class LoadReport:
    requests: int
    completed: int
    disconnected: int
    failed: int
    tokens: int
    wall_seconds: float
    tokens_per_second: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    clean_after: bool
    metrics_after: dict[str, float]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def read_metrics(base_url: str) -> dict[str, float]:
    """The augury:* samples of /metrics, labels dropped (one model per server)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(augury:[a-z_:]+)(\{[^}]*\})?\s+(\S+)$", line)
        labels = (m.group(2) or "") if m else ""
        if m and "position=" not in labels and "le=" not in labels and not m.group(1).endswith("_created"):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def is_clean(metrics: dict[str, float]) -> bool:
    return (metrics.get("augury:num_requests_running") == 0 and metrics.get("augury:num_requests_waiting") == 0
            and metrics.get("augury:num_requests_in_flight") == 0 and metrics.get("augury:kv_cache_usage_ratio") == 0)


async def _one(client: Any, model: str, i: int, max_tokens: int, disconnect_after: int | None,
               start: asyncio.Event) -> tuple[str, int, float | None]:
    await start.wait()
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    try:
        stream = await client.completions.create(
            model=model, prompt=f"request {i}: the quick brown fox", max_tokens=max_tokens, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                await stream.close()  # hang up mid-stream
                return "disconnected", chunks, ttft
        return "completed", tokens, ttft
    except Exception:
        return "failed", tokens, ttft


async def run_load(base_url: str, model: str, requests: int = 32, concurrency: int = 32, max_tokens: int = 32,
                   disconnect_fraction: float = 0.25, api_key: str = "none",
                   settle_seconds: float = 30.0) -> LoadReport:
    import openai

    every = round(1 / disconnect_fraction) if disconnect_fraction > 0 else 0
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=300,
                                  http_client=httpx.AsyncClient(limits=limits, timeout=300)) as client:
        gate = asyncio.Semaphore(concurrency)
        start = asyncio.Event()

        async def bounded(i: int) -> tuple[str, int, float | None]:
            async with gate:
                cut = 3 if every and i % every == every - 1 else None
                return await _one(client, model, i, max_tokens, cut, start)

        tasks = [asyncio.ensure_future(bounded(i)) for i in range(requests)]
        t0 = time.perf_counter()
        start.set()
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    deadline = time.monotonic() + settle_seconds
    metrics = read_metrics(base_url)
    while not is_clean(metrics) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        metrics = read_metrics(base_url)
    ttfts = [t * 1000 for _, _, t in results if t is not None]
    tokens = sum(n for status, n, _ in results if status == "completed")
    return LoadReport(
        requests=requests, completed=sum(s == "completed" for s, _, _ in results),
        disconnected=sum(s == "disconnected" for s, _, _ in results), failed=sum(s == "failed" for s, _, _ in results),
        tokens=tokens, wall_seconds=round(wall, 3), tokens_per_second=round(tokens / wall, 1),
        ttft_p50_ms=round(_percentile(ttfts, 50), 1), ttft_p99_ms=round(_percentile(ttfts, 99), 1),
        clean_after=is_clean(metrics), metrics_after=metrics,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m augury.server.loadtest")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    p.add_argument("--api-key", default="none")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--disconnect-fraction", type=float, default=0.25)
    args = p.parse_args(argv)
    model = args.model or httpx.get(f"{args.url}/v1/models", headers={"Authorization": f"Bearer {args.api_key}"},
                                    timeout=10).json()["data"][0]["id"]
    report = asyncio.run(run_load(args.url, model, args.requests, args.concurrency, args.max_tokens,
                                  args.disconnect_fraction, args.api_key))
    print(json.dumps(asdict(report), indent=2))
    return 0 if report.clean_after and report.failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
