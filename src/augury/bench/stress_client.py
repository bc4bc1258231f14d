"""The stress harness's two ends (bench/stress.py): `send`, one HTTP request read as a client would (a
stream event by event, dropped or read slowly when the call says so), and `ServerProcess`, the
`augury serve` subprocess under test (its log, its resident memory, its exit on SIGTERM).

Answers are normalised so a stream and a whole body compare alike: per choice its text, its tool
calls (name, arguments; ids differ per request) and its finish reason. Torch-free.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from augury.bench.stress_bodies import Call

BODY_KEPT = 4000  # characters of an error body (or a request body) the report keeps


@dataclass
class Result:
    kind: str
    case: str
    expect: str
    phase: str = "load"
    status: int | None = None  # None: no HTTP status came back (see error)
    error: str | None = None  # transport error class, "timeout", "stream-incomplete", "stream-error", "bad-json"
    seconds: float = 0.0  # to the last byte (or the drop)
    ttft: float | None = None  # streams: to the first content event
    dropped: bool = False  # the client hung up on purpose (drop calls)
    answer: list[list[Any]] | None = None  # per choice: [text, [[tool name, arguments], ...], finish_reason]
    body: str | None = None  # a non-200 (or a stream's error event) as it came back, cut at BODY_KEPT
    key: str | None = None  # deterministic calls: the request body as sent
    path: str = ""
    request: str | None = None  # other calls (hostile, drops): the body as sent, cut at BODY_KEPT
    tokens: int | None = None  # usage.completion_tokens, when the answer said
    started: float = 0.0  # monotonic seconds at send
    known_bug: str | None = None
    detail: str = ""

    @property
    def server_error(self) -> bool:
        """A 5xx status other than 503 (a clean refusal), or a 200 stream that ended in an internal-error event."""
        return ((self.status or 0) >= 500 and self.status != 503) or (self.error == "stream-error" and '"internal_error"' in (self.body or ""))


class _Choices:
    """Choices assembled from whole bodies or from stream deltas."""

    def __init__(self) -> None:
        self.text: dict[int, str] = {}
        self.calls: dict[int, dict[int, list[str]]] = {}
        self.finish: dict[int, str | None] = {}

    def whole(self, body: dict[str, Any]) -> None:
        for c in body.get("choices") or []:
            i = c["index"]
            msg = c.get("message")
            self.text[i] = (msg.get("content") or "") if msg is not None else (c.get("text") or "")
            for j, call in enumerate((msg or {}).get("tool_calls") or []):
                self.calls.setdefault(i, {})[j] = [call["function"]["name"], call["function"]["arguments"]]
            self.finish[i] = c.get("finish_reason")

    def delta(self, event: dict[str, Any]) -> None:
        for c in event.get("choices") or []:
            i = c["index"]
            delta = c.get("delta")
            piece = (delta.get("content") or "") if delta is not None else (c.get("text") or "")
            self.text[i] = self.text.get(i, "") + piece
            for call in (delta or {}).get("tool_calls") or []:
                slot = self.calls.setdefault(i, {}).setdefault(call.get("index", 0), ["", ""])
                fn = call.get("function") or {}
                slot[0] += fn.get("name") or ""
                slot[1] += fn.get("arguments") or ""
            if c.get("finish_reason") is not None:
                self.finish[i] = c["finish_reason"]

    def answer(self) -> list[list[Any]]:
        return [[self.text.get(i, ""), [self.calls[i][j] for j in sorted(self.calls.get(i, {}))], self.finish.get(i)]
                for i in sorted(set(self.text) | set(self.finish))]


async def send(http: httpx.AsyncClient, base_url: str, call: Call, timeout: float, phase: str = "load") -> Result:
    """Send one call and read its answer as the call says; never raises for the server's behaviour."""
    res = Result(call.kind, call.case, call.expect, phase, known_bug=call.known_bug, detail=call.detail,
                 key=call.key() if call.deterministic else None, path=call.path, started=time.monotonic())
    if not call.deterministic:
        res.request = call.payload()[:BODY_KEPT].decode(errors="replace")
    t0 = time.perf_counter()
    choices = _Choices()
    headers = {"content-type": call.content_type}
    if call.kind == "hostile":  # a connection of its own: what a hostile body does to it is its own result
        headers["connection"] = "close"

    async def exchange() -> None:
        async with http.stream("POST", base_url + call.path, content=call.payload(), headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200 or not call.stream:
                data = await r.aread()
                if r.status_code == 200:
                    whole = json.loads(data)
                    choices.whole(whole)
                    res.answer, res.tokens = choices.answer(), (whole.get("usage") or {}).get("completion_tokens")
                else:
                    res.body = data[:BODY_KEPT].decode(errors="replace")
            else:
                await _read_stream(r, call, res, choices, t0)

    try:
        await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
        res.error = "timeout"
    except httpx.TransportError as e:
        res.error = type(e).__name__
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:  # a 200 that is not an answer
        res.error, res.body = "bad-json", f"{type(e).__name__}: {e}"
    res.seconds = time.perf_counter() - t0
    return res


async def _read_stream(r: httpx.Response, call: Call, res: Result, choices: _Choices, t0: float) -> None:
    events, done = 0, False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            break
        event = json.loads(payload)
        if "error" in event:
            res.error, res.body = "stream-error", payload[:BODY_KEPT]
            continue
        choices.delta(event)
        if event.get("usage"):
            res.tokens = event["usage"].get("completion_tokens")
        if res.ttft is None and any(choices.text.values()):
            res.ttft = time.perf_counter() - t0
        events += 1
        if call.drop_after is not None and events >= call.drop_after:
            res.dropped = True  # leaving the `stream` block closes the connection mid-answer
            return
        if call.read_delay:
            await asyncio.sleep(call.read_delay)
    if not done and res.error is None:
        res.error = "stream-incomplete"
    res.answer = choices.answer()


def rss_bytes(pid: int) -> int | None:
    """Resident memory of the process and its children (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            proc = psutil.Process(pid)
            return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
        except psutil.Error:
            return None
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


@dataclass
class ServerProcess:
    """`python -m augury.server ARGS --port 0`, its output copied to `log_path` and kept in `lines`."""

    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    port: int = 0
    lines: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, ready_timeout: float) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "augury.server", "--port", "0", *self.args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        while not self._ready.wait(0.2):
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"the server was not ready within {ready_timeout:.0f} s (see {self.log_path})")
        if not self.port:
            raise RuntimeError(f"the server exited before it was ready (status {self.proc.wait()}): "
                               f"{''.join(self.lines[-5:]).strip()}")

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                self.lines.append(line)
                log.write(line)
                log.flush()
                m = re.search(r"ready: serving .* on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    self._ready.set()
        self._ready.set()

    def sigterm(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM, then wait: (exit status, seconds to exit); None and a SIGKILL if it outlives timeout."""
        assert self.proc is not None
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            status: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            status = None
        return status, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def problems(self) -> list[str]:
        """Log lines that say something went wrong (tracebacks, errors), in order."""
        return [line.rstrip() for line in self.lines if re.search(r"Traceback|ERROR|Exception|error:", line)]
