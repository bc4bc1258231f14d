"""`augury bench --workload stress`: load and faults against a real `augury serve`, over HTTP.

The harness starts the server as a subprocess (`--model`, demo by default; `--server-args` pass more
flags) or drives one at `--url`, and runs `--clients` concurrent clients for `--duration` seconds, each
drawing requests from a seeded mix (bench/stress_bodies.py): chat, streamed chat, a JSON schema,
tools, long prompts, n > 1 and completions; 10% streams the client drops mid-answer, 5% slow
readers, 5% hostile bodies (a fuzz corpus and mutated bodies). Then:

- the server must settle: nothing running, 0 KV blocks in use (/metrics);
- every deterministic answer (greedy, or seeded for n > 1) is replayed one request at a time and
  must equal every answer the same body got under load;
- RSS of the server (psutil, else /proc) after the load is compared with RSS at the first minute;
- with --sigterm, a last burst of load is cut by SIGTERM: exit status, seconds to exit, and what
  became of the requests in flight.

Printed as a table (status codes per kind, p50/p99 latency, every 5xx with its body, mismatches, KV
blocks, RSS) and saved to --out/stress.json. Exit status 1 when a criterion fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx

from augury.bench.stress_bodies import CORPUS, MIX, Call, Workload, corpus_call
from augury.bench.stress_client import BODY_KEPT, Result, ServerProcess, rss_bytes, send
from augury.bench.stress_report import REFUSED, by_kind, criteria, failures, format_report, hostile_cases
from augury.config import one_line
from augury.server.loadtest import is_clean, read_metrics

PROG = "augury bench --workload stress"


@dataclass(frozen=True)
class StressSettings:
    model: str = "demo"
    server_args: tuple[str, ...] = ()  # more `augury serve` flags
    url: str | None = None  # drive this running server instead of starting one (no RSS, no SIGTERM)
    clients: int = 80  # above the default --max-num-seqs (64): the batch stays full
    duration: float = 600.0
    max_tokens: int = 48
    seed: int = 0
    # the RSS and KV reference: this many seconds into the full load (from the first sample with the batch full,
    # or from the start if it never fills), and no later than half the load
    first_sample: float = 60.0
    sample_every: float = 10.0
    request_timeout: float = 300.0
    replay_max: int = 400  # distinct deterministic bodies replayed one at a time
    replay_twice: bool = False  # send each twice alone: are answers alone even stable? (numerics vs batching)
    sigterm: bool = False
    sigterm_after: float = 3.0  # seconds of load in the SIGTERM phase before the signal
    drain_timeout: float = 60.0  # how long the server may take to exit after SIGTERM
    ready_timeout: float = 900.0  # the demo may be fetched and converted on first use
    out: str = "bench_out/stress"
    mix: tuple[tuple[str, float], ...] = tuple(MIX.items())  # share of each request kind (stress_bodies.MIX)


@dataclass
class Sample:
    t: float  # seconds since the load began
    rss_bytes: int | None
    kv_blocks_in_use: float
    running: float
    waiting: float
    kv_written_blocks: float = 0.0  # the cache's memory taken so far, in blocks (it grows as traffic writes it)


def _reference_sample(samples: list[Sample], s: StressSettings, max_num_seqs: int | None) -> Sample | None:
    """The RSS and KV reference: s.first_sample seconds into the load that keeps the batch full (memory that
    follows the largest step, as activations of the fullest batch do, is then taken), no later than half the load."""
    full = next((x.t for x in samples if max_num_seqs and x.running >= max_num_seqs), 0.0)
    at = min(full + s.first_sample, s.duration / 2)
    return next((x for x in samples if x.t >= at), samples[-1] if samples else None)


def _kv_block_bytes(info: dict[str, Any]) -> int | None:
    """Bytes of one KV block (every layer, K and V), from /server_info: what a newly written block adds to RSS."""
    kv = info.get("engine", {}).get("kv_cache") or {}
    return kv["bytes_per_token"] * kv["block_size"] if kv.get("bytes_per_token") and kv.get("block_size") else None


def _kv_in_use(m: dict[str, float]) -> float:
    return m.get("augury:kv_cache_usable_blocks", 0.0) - m.get("augury:kv_cache_free_blocks", 0.0)


def _draw(s: StressSettings, workload: Workload, rng: random.Random) -> Call:
    kind = rng.choices([k for k, _ in s.mix], weights=[w for _, w in s.mix])[0]
    return workload.hostile(rng) if kind == "hostile" else workload.call(kind, rng)


def _client(clients: int, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout))


async def _sample(base_url: str, pid: int | None, t0: float) -> Sample:
    m = await asyncio.to_thread(read_metrics, base_url)
    return Sample(round(time.monotonic() - t0, 1), rss_bytes(pid) if pid else None, _kv_in_use(m),
                  m.get("augury:num_requests_running", 0.0), m.get("augury:num_requests_waiting", 0.0),
                  m.get("augury:kv_cache_written_blocks", 0.0))


async def _load(s: StressSettings, base_url: str, workload: Workload, pid: int | None, seconds: float,
                phase: str, samples: list[Sample] | None = None, stop: asyncio.Event | None = None,
                sweep: bool = False) -> list[Result]:
    """`s.clients` clients, each sending its seeded draws one after another until `seconds` pass or `stop`;
    with `sweep`, one more client sends every corpus entry once, spread over the first 60% of the time (the
    random draws alone would leave some untried in a short run)."""
    results: list[Result] = []
    t0 = time.monotonic()
    deadline = t0 + seconds
    stop = stop or asyncio.Event()

    async def client(i: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(f"{s.seed}:{phase}:{i}")
        while time.monotonic() < deadline and not stop.is_set():
            results.append(await send(http, base_url, _draw(s, workload, rng), s.request_timeout, phase))
            if results[-1].error == "ConnectError" and phase == "sigterm":
                break  # the server is gone: one refused connection per client says so

    async def sweeper(http: httpx.AsyncClient) -> None:
        entries = list(CORPUS)
        random.Random(f"{s.seed}:sweep").shuffle(entries)
        for entry in entries:
            if time.monotonic() >= deadline or stop.is_set():
                break
            results.append(await send(http, base_url, corpus_call(entry, workload.model), s.request_timeout, phase))
            await asyncio.sleep(0.6 * seconds / len(entries))

    async def sampler() -> None:
        while samples is not None:
            samples.append(await _sample(base_url, pid, t0))
            await asyncio.sleep(s.sample_every)

    async with _client(s.clients, s.request_timeout) as http:
        watch = asyncio.ensure_future(sampler())
        try:
            await asyncio.gather(*(client(i, http) for i in range(s.clients)), *([sweeper(http)] if sweep else []))
        finally:
            watch.cancel()
    return results


async def _settle(base_url: str, timeout: float = 120.0) -> tuple[dict[str, float], float]:
    """Metrics once nothing runs, waits or holds KV blocks (or at the timeout), and the seconds it took."""
    t0 = time.monotonic()
    m = await asyncio.to_thread(read_metrics, base_url)
    while not is_clean(m) and time.monotonic() - t0 < timeout:
        await asyncio.sleep(0.5)
        m = await asyncio.to_thread(read_metrics, base_url)
    return m, time.monotonic() - t0


async def _replay(s: StressSettings, base_url: str, results: list[Result]) -> dict[str, Any]:
    """Each distinct deterministic body answered under load, sent again alone; every load answer must equal it."""
    answered: dict[str, list[Result]] = {}
    for r in results:
        if r.key is not None and r.status == 200 and r.error is None and not r.dropped and r.answer is not None:
            answered.setdefault(r.key, []).append(r)
    keys = sorted(answered)
    random.Random(s.seed).shuffle(keys)
    keys = keys[: s.replay_max]
    mismatches: dict[str, list[dict[str, Any]]] = {"greedy": [], "seeded": []}
    compared = Counter()
    replays: list[Result] = []
    unstable = 0  # bodies whose two answers alone differed (replay_twice)
    async with _client(1, s.request_timeout) as http:
        for key in keys:
            first = answered[key][0]
            alone = await send(http, base_url, Call(first.kind, first.path, json.loads(key), deterministic=True),
                               s.request_timeout, "replay")
            replays.append(alone)
            if s.replay_twice:
                again = await send(http, base_url, Call(first.kind, first.path, json.loads(key), deterministic=True),
                                   s.request_timeout, "replay")
                unstable += again.answer != alone.answer
            family = "seeded" if first.case == "seeded" else "greedy"
            same = sum(alone.answer == r.answer for r in answered[key])
            compared[family] += len(answered[key])
            for r in answered[key]:
                if alone.answer != r.answer:
                    mismatches[family].append({
                        "kind": r.kind, "request": key[:BODY_KEPT], "under_load": r.answer, "alone": alone.answer,
                        "tokens_under_load": r.tokens, "tokens_alone": alone.tokens, "alone_status": alone.status,
                        "alone_error": alone.error, "load_answers_equal_alone": f"{same} of {len(answered[key])}",
                        **_neighbours(r, results)})
    return {"distinct_bodies": len(answered), "replayed": len(keys), "compared": dict(compared),
            "alone_twice_unequal": unstable if s.replay_twice else None,
            "mismatches": mismatches, "replay_failures": [asdict(r) for r in replays if r.status != 200 or r.error]}


def _neighbours(r: Result, results: list[Result]) -> dict[str, Any]:
    """What ran beside a mismatched answer: the kinds of the requests whose time overlapped its own, and
    the bodies of the hostile ones that got a 200 (one of them may have reached into its row)."""
    end = r.started + r.seconds
    beside = [x for x in results if x is not r and x.started < end and x.started + x.seconds > r.started]
    return {"beside_kinds": dict(Counter(x.kind for x in beside)),
            "beside_hostile_answered": [x.request for x in beside if x.kind == "hostile" and x.status == 200][:10]}


async def _sigterm_phase(s: StressSettings, server: ServerProcess, workload: Workload) -> dict[str, Any]:
    """Load for s.sigterm_after seconds, then SIGTERM while it goes on: the fate of each request."""
    stop = asyncio.Event()
    load = asyncio.ensure_future(_load(s, server.base_url, workload, None, s.drain_timeout + s.request_timeout,
                                       "sigterm", stop=stop))
    await asyncio.sleep(s.sigterm_after)
    signalled = time.monotonic()
    status, seconds = await asyncio.to_thread(server.sigterm, s.drain_timeout)
    stop.set()
    results = await load

    def fate(r: Result) -> str:
        if r.server_error:
            return "5xx"
        if r.status in REFUSED:
            return f"refused {r.status}"
        if r.status is not None and r.status != 200:
            return f"status {r.status}"
        if r.status == 200 and (r.error is None or r.dropped):
            return "dropped by client" if r.dropped else "finished"
        return f"cut ({r.error})"

    before = [r for r in results if r.started < signalled]
    after = [r for r in results if r.started >= signalled]
    return {"exit_status": status, "seconds_to_exit": round(seconds, 2),
            "in_flight_at_sigterm": dict(Counter(fate(r) for r in before if r.started + r.seconds > signalled)),
            "finished_before_sigterm": sum(r.started + r.seconds <= signalled for r in before),
            "sent_after_sigterm": dict(Counter(fate(r) for r in after)),
            "server_errors": [asdict(r) for r in results if r.server_error]}


def _long_chars(info: dict[str, Any]) -> int:
    """Characters of the long prompt: about a third of the context (at most 3000 tokens), measured with the
    model's tokenizer.json when it has one (else one character a token: never too long)."""
    tokens = min(info["engine"]["max_model_len"] // 3, 3000)
    folder = Path(info["server"].get("model_folder") or ".")
    try:
        from tokenizers import Tokenizer

        from augury.bench.stress_bodies import long_document

        sample = long_document(20000)
        per_token = len(sample) / len(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(sample).ids)
    except Exception:  # no tokenizer.json (or no tokenizers): the safe bound
        per_token = 1.0
    return int(tokens * per_token * 0.9)


async def run_stress(s: StressSettings, log=print) -> dict[str, Any]:
    """The whole run (load, settle, replay, optional SIGTERM); the report as a JSON-able dict."""
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    server = None
    if s.url is None:
        server = ServerProcess(["--model", s.model, *s.server_args], out / "server.log")
        log(f"starting: augury serve --model {s.model} {' '.join(s.server_args)} (log: {server.log_path})")
        await asyncio.to_thread(server.start, s.ready_timeout)
    base_url = s.url or server.base_url  # type: ignore[union-attr]
    pid = server.pid if server else None
    report: dict[str, Any] = {"settings": asdict(s), "url": base_url, "server_pid": pid}
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            model = (await http.get(f"{base_url}/v1/models")).json()["data"][0]["id"]
            info = (await http.get(f"{base_url}/server_info")).json()
        workload = Workload.build(model, _long_chars(info), s.max_tokens)
        report.update(model=model, max_model_len=info["engine"]["max_model_len"],
                      shutdown_timeout=info.get("server", {}).get("shutdown_timeout"),
                      max_num_seqs=info["engine"]["engine_config"].get("max_num_seqs"),
                      long_prompt_chars=len(workload.long_text))
        before = await asyncio.to_thread(read_metrics, base_url)
        samples: list[Sample] = []
        log(f"load: {s.clients} clients for {s.duration:.0f} s against {base_url}")
        t0 = time.monotonic()
        results = await _load(s, base_url, workload, pid, s.duration, "load", samples, sweep=dict(s.mix)["hostile"] > 0)
        report["load_seconds"] = round(time.monotonic() - t0, 1)
        settled, settle_seconds = await _settle(base_url)
        rss_end = rss_bytes(pid) if pid else None
        kv_written_end = settled.get("augury:kv_cache_written_blocks", 0.0)
        log(f"replay: distinct deterministic bodies one at a time (at most {s.replay_max})")
        replay = await _replay(s, base_url, results)
        after_replay, _ = await _settle(base_url)
        first = _reference_sample(samples, s, report["max_num_seqs"])
        report.update(
            requests=len(results), by_kind=by_kind(results), failures=failures(results),
            hostile_cases=hostile_cases(results),
            known_bugs_hit=dict(Counter(r.case for r in results if r.known_bug and (r.server_error or r.status is None))),
            replay=replay, settle_seconds=round(settle_seconds, 1),
            kv_blocks_in_use={"first_sample": first.kv_blocks_in_use if first else None,
                              "after_load": _kv_in_use(settled), "after_replay": _kv_in_use(after_replay),
                              "usable": settled.get("augury:kv_cache_usable_blocks")},
            clean_after_load=is_clean(settled), clean_after_replay=is_clean(after_replay),
            rss={"first_sample_t": first.t if first else None, "first_sample_bytes": first.rss_bytes if first else None,
                 "after_load_bytes": rss_end, "kv_block_bytes": _kv_block_bytes(info),
                 "first_sample_kv_written_blocks": first.kv_written_blocks if first else None,
                 "after_load_kv_written_blocks": kv_written_end},
            engine_step_errors=settled.get("augury:engine_step_errors_total", 0.0)
            - before.get("augury:engine_step_errors_total", 0.0),
            aborted=settled.get("augury:requests_aborted_total", 0.0) - before.get("augury:requests_aborted_total", 0.0),
            batch_full_share=round(sum(x.running >= (report["max_num_seqs"] or 0) for x in samples)
                                   / max(1, len(samples)), 3),
            samples=[asdict(x) for x in samples])
        if server is not None and s.sigterm:
            log(f"SIGTERM after {s.sigterm_after:.0f} s of load")
            report["sigterm"] = await _sigterm_phase(s, server, workload)
    finally:
        if server is not None:
            status, seconds = await asyncio.to_thread(server.sigterm, s.drain_timeout)
            report.setdefault("sigterm", {"exit_status": status, "seconds_to_exit": round(seconds, 2), "idle": True})
            report["server_log_problems"] = server.problems()[:200]
    report["criteria"] = criteria(report)
    return report


def _mix(text: str) -> tuple[tuple[str, float], ...]:
    shares = dict(MIX)
    for item in filter(None, text.split(",")):
        kind, _, share = item.partition("=")
        if kind not in MIX:
            raise argparse.ArgumentTypeError(f"unknown request kind {kind!r}; kinds: {', '.join(MIX)}")
        try:
            shares[kind] = float(share)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected KIND=SHARE, got {item!r}") from None
        if not shares[kind] >= 0:
            raise argparse.ArgumentTypeError(f"a share must be a number >= 0, got {item!r}")
    if not any(shares[k] > 0 for k in MIX if k not in ("drop", "hostile")):
        raise argparse.ArgumentTypeError("some well-formed kind needs a share above 0")
    return tuple(shares.items())


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2, as the other commands' are."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{PROG}: error: {message} (see --help)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    d = StressSettings()
    p = _OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model, help="what `augury serve --model` gets (default: demo)")
    p.add_argument("--server-args", default="", help="more `augury serve` flags, one string, e.g. "
                   "'--max-num-seqs 16 --dtype float32'")
    p.add_argument("--url", default=None, help="drive this running server instead of starting one (RSS, SIGTERM off)")
    p.add_argument("--clients", type=int, default=d.clients, help=f"concurrent clients (default: {d.clients})")
    p.add_argument("--duration", type=float, default=d.duration, help=f"seconds of load (default: {d.duration:.0f})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens of well-formed requests")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--mix", type=_mix, default=d.mix, help="shares of request kinds, the rest as by default, e.g. "
                   f"hostile=0,drop=0 (no faults; no corpus sweep either); kinds: {', '.join(MIX)}")
    p.add_argument("--first-sample", type=float, default=d.first_sample,
                   help="seconds into the full load (from the batch's first filling) of the RSS/KV reference "
                   "sample (at most half of --duration)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout)
    p.add_argument("--replay-max", type=int, default=d.replay_max, help="distinct bodies replayed one at a time")
    p.add_argument("--replay-twice", action="store_true", help="replay each body twice alone and count the bodies "
                   "whose two answers differ (answers alone that vary point at numerics, not at batching)")
    p.add_argument("--sigterm", action="store_true", help="end with SIGTERM under load and report the drain")
    p.add_argument("--sigterm-after", type=float, default=d.sigterm_after)
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout)
    p.add_argument("--ready-timeout", type=float, default=d.ready_timeout)
    p.add_argument("--out", default=d.out, help="folder for stress.json and server.log")
    p.add_argument("--debug", action="store_true", help="tracebacks with errors")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when every criterion held (or could not be told), 1 when one failed, 2 on bad flags."""
    args = build_parser().parse_args(argv)
    for name in ("clients", "duration", "max_tokens", "request_timeout", "replay_max"):
        if getattr(args, name) <= 0:
            sys.stderr.write(f"{PROG}: error: --{name.replace('_', '-')} must be positive\n")
            return 2
    settings = StressSettings(
        model=args.model, server_args=tuple(shlex.split(args.server_args)), url=args.url, clients=args.clients,
        duration=args.duration, max_tokens=args.max_tokens, seed=args.seed, first_sample=args.first_sample,
        request_timeout=args.request_timeout, replay_max=args.replay_max, replay_twice=args.replay_twice,
        sigterm=args.sigterm,
        sigterm_after=args.sigterm_after, drain_timeout=args.drain_timeout, ready_timeout=args.ready_timeout,
        out=args.out, mix=args.mix)
    try:
        report = asyncio.run(run_stress(settings))
    except Exception as exc:  # the server did not start, the URL does not answer, ...: one line
        if args.debug:
            raise
        sys.stderr.write(f"{PROG}: error: {one_line(exc)}\n")
        return 2
    path = Path(settings.out) / "stress.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(format_report(report))
    print(f"wrote {path}")
    return 1 if any(v is False for v in report["criteria"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
