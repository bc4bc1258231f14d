"""Graceful drain, in real `python -m augury.server` processes on the tiny model: SIGTERM stops
admission (503 with Retry-After, /health "draining") while the requests in flight finish, then the
process exits 0; what is still running at --shutdown-timeout is cut with a reason naming the
shutdown; a second signal stops at once. With two tensor-parallel ranks the same drain holds when
every process gets the signal, and a start-up stopped by SIGTERM or SIGKILL leaves no process and
nothing in /dev/shm.

Requests are made long (n choices of 240 tokens each, ignore_eos) so that they are still running
when the signal comes; each test checks the server's log that they were.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers_server import ServerProcess, make_tiny_checkpoint, serve, server_env, shared_tiny_checkpoint

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
BASE = ["--dtype", "float32", "--speculative-algorithm", "none"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 4096 positions: answers long enough to outlast a shutdown timeout on a fast
    CPU (16 x 240 tokens of the 256-position one took under a second on a Zen 5 EPYC)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("long-tiny") / "model", max_positions=4096)


class Stream:
    """A streamed completion read on its own thread: every `data:` payload, decoded."""

    def __init__(self, server: ServerProcess, model: str, n: int, max_tokens: int = 240) -> None:
        self.events: list = []
        self.status: int | None = None
        body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "n": n}
        self._thread = threading.Thread(target=self._read, args=(server.base_url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    self.events.append(data if data == "[DONE]" else json.loads(data))

    def wait_started(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.events:
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.01)

    def join(self, timeout: float = 120.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"

    @property
    def finishes(self) -> list[str]:
        return [c["finish_reason"] for e in self.events if isinstance(e, dict) and "choices" in e
                for c in e["choices"] if c["finish_reason"]]

    @property
    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]


def _wait_draining(server: ServerProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{server.base_url}/health", timeout=10)
        if r.status_code == 503 and r.json() == {"status": "draining"}:
            return
        assert r.status_code == 200 and time.monotonic() < deadline, r.text
        time.sleep(0.02)


def _in_flight_at_signal(log: str) -> int:
    m = re.search(r"draining \(SIGTERM\): no new requests; (\d+) in flight", log)
    assert m, log[-2000:]
    return int(m.group(1))


def _log_after_exit(server: ServerProcess) -> str:
    time.sleep(0.3)  # the pump thread's last lines
    return server.log


def test_sigterm_lets_requests_in_flight_finish_refuses_new_ones_and_exits_0(tiny: Path) -> None:
    with serve(["--model", str(tiny), *BASE, "--max-num-seqs", "1", "--shutdown-timeout", "120"]) as server:
        stream = Stream(server, str(tiny), n=8)  # 8 x 240 tokens, one at a time
        stream.wait_started()
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _wait_draining(server)
        late = httpx.post(f"{server.base_url}/v1/completions", json={"model": str(tiny), "prompt": "hi",
                                                                      "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
        assert late.json()["error"]["code"] == "server_shutting_down"
        stream.join()
        assert server.proc.wait(60) == 0 and time.monotonic() - t0 < 60
        log = _log_after_exit(server)
    assert stream.status == 200 and not stream.errors and stream.events[-1] == "[DONE]"
    assert stream.finishes == ["length"] * 8  # every choice ran to its end
    assert _in_flight_at_signal(log) >= 1 and "drained in" in log and "Traceback" not in log


def test_what_runs_past_the_shutdown_timeout_is_cut_naming_the_shutdown(long_tiny: Path) -> None:
    tiny = long_tiny
    with serve(["--model", str(tiny), *BASE, "--shutdown-timeout", "0.5"]) as server:
        plain: list[httpx.Response] = []
        body = {"model": str(tiny), "prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "n": 16}
        waiter = threading.Thread(target=lambda: plain.append(
            httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)), daemon=True)
        waiter.start()
        time.sleep(0.2)  # admitted first (one tokenizer thread, first come first served)
        stream = Stream(server, str(tiny), n=16, max_tokens=4000)
        stream.wait_started()
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        stream.join()
        waiter.join(60)
        assert server.proc.wait(60) == 0 and time.monotonic() - t0 < 30
        log = _log_after_exit(server)
    assert _in_flight_at_signal(log) > 16, "both requests should have been running when the signal came"
    assert "--shutdown-timeout (0.5 s) ran out" in log
    assert stream.events[-1] == "[DONE]" and len(stream.errors) == 1
    assert "--shutdown-timeout of 0.5 s ran out" in stream.errors[0]["message"]
    assert len(stream.finishes) < 16  # cut before every choice finished
    assert plain and plain[0].status_code == 503, plain[0].text if plain else "no answer"
    assert "shutting down" in plain[0].json()["error"]["message"]


def test_a_second_signal_stops_at_once(tiny: Path) -> None:
    with serve(["--model", str(tiny), *BASE, "--max-num-seqs", "1", "--shutdown-timeout", "120"]) as server:
        stream = Stream(server, str(tiny), n=16)
        stream.wait_started()
        server.proc.send_signal(signal.SIGTERM)
        _wait_draining(server)
        server.proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert server.proc.wait(30) == 128 + signal.SIGINT
        assert time.monotonic() - t0 < 10
        stream.join()
        log = _log_after_exit(server)
    assert "stopping now (SIGINT)" in log
    assert stream.events[-1] == "[DONE]" and "second stop signal" in stream.errors[0]["message"]


def test_sigterm_during_start_up_stops_it_naming_the_stage(tiny: Path) -> None:
    proc = _start(["--model", str(tiny), *BASE])
    lines = _read_until(proc, "start-up stage: target")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, lines + rest
    assert "augury: error: start-up interrupted at stage " in rest and "(SIGTERM)" in rest


# ---------------------------------------------------------------- two tensor-parallel ranks


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "augury.server", "--port", "0", *args], env=server_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen, needle: str, timeout: float = 180.0) -> str:
    """The output up to and including the first line with `needle` (the process must get there)."""
    assert proc.stdout is not None
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    seen = ""
    try:
        for line in proc.stdout:
            seen += line
            if needle in line:
                return seen
    finally:
        killer.cancel()
    raise AssertionError(f"the server never logged {needle!r}:\n{seen}")


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _gone(pids: list[int], timeout: float = 15.0) -> bool:
    """Every pid has exited (and been reaped, or is a zombie of a dead parent's reaper) within the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for p in pids:
            try:
                state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(p)
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _shm_of(pid: int) -> list[str]:
    """/dev/shm entries named after `pid` (an exchange file of that rank 0 would be)."""
    try:
        return [n for n in os.listdir("/dev/shm") if str(pid) in n.split("-")]
    except FileNotFoundError:
        return []


@TWO_CORES
def test_a_two_rank_server_drains_when_every_process_gets_sigterm(tiny: Path) -> None:
    args = ["--model", str(tiny), *BASE, "--tensor-parallel-size", "2", "--max-num-seqs", "1"]
    with serve(args) as server:
        workers = _children(server.proc.pid)
        assert len(workers) == 1
        stream = Stream(server, str(tiny), n=4)
        stream.wait_started()
        for pid in [server.proc.pid, *workers]:  # as systemd stops a service: every process of it
            os.kill(pid, signal.SIGTERM)
        stream.join()
        assert server.proc.wait(60) == 0
        log = _log_after_exit(server)
    assert _in_flight_at_signal(log) >= 1 and "drained in" in log
    assert not stream.errors and stream.finishes == ["length"] * 4
    assert _gone(workers) and not _shm_of(server.proc.pid)


@TWO_CORES
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stopping_a_two_rank_start_up_while_ranks_load_leaves_nothing(tiny: Path, sig: int) -> None:
    proc = _start(["--model", str(tiny), *BASE, "--tensor-parallel-size", "2"])
    # the ranks have joined and mapped the shared-memory channel; rank 1 loads its shard now
    lines = _read_until(proc, "tensor parallelism: 2 ranks (gloo + shared memory)")
    workers = _children(proc.pid)
    assert len(workers) == 1, lines
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == (128 + sig if sig == signal.SIGTERM else -sig), lines + rest
    assert _gone(workers), f"rank 1 (pid {workers[0]}) outlived rank 0"
    assert not _shm_of(proc.pid)
    if sig == signal.SIGTERM:
        assert "start-up interrupted at stage " in rest and "Traceback" not in rest


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_shutdown_timeout_that_is_no_duration_is_refused(value: str) -> None:
    from augury.server.args import build_parser, settings_from_args

    with pytest.raises(ValueError, match="--shutdown-timeout must be a non-negative number of seconds"):
        settings_from_args(build_parser().parse_args(["--shutdown-timeout", value]))


_STUCK = """
import signal, sys, threading, time
from types import SimpleNamespace
from augury.server.drain import Drain

class Loop:  # requests that never finish by themselves
    in_flight = 3
    def cut(self, reason):
        print("cut at", round(time.monotonic() - t0, 2), flush=True)
        return 3

state = SimpleNamespace(loop=Loop(), draining=False)
drain = Drain(state, timeout=float(sys.argv[1]))
t0 = time.monotonic()
print("signal at", time.time(), flush=True)
drain.on_signal(signal.SIGTERM)
while not drain.tick():
    time.sleep(0.1)
drain.arm_backstop()
threading.Thread(target=time.sleep, args=(3600,)).start()  # a thread inside a step that does not end: exit waits for it
"""


@pytest.mark.parametrize("timeout", [3.0, 12.0])
def test_the_process_is_gone_within_the_shutdown_timeout_though_a_thread_never_ends(timeout: float) -> None:
    done = subprocess.run([sys.executable, "-c", _STUCK, str(timeout)], capture_output=True, text=True,
                          timeout=timeout + 60, env=server_env())
    took = time.time() - float(done.stdout.split("signal at ")[1].split()[0])
    assert done.returncode == 0, done.stderr
    cut_at = float(done.stdout.split("cut at ")[1])
    # the cut leaves a share of the timeout (2 s at most) for the last events to go out, then the process ends
    expected = timeout - min(2.0, 0.2 * timeout)
    assert expected <= cut_at <= expected + 0.5, done.stdout
    assert took < timeout + 1.0, f"exited {took:.1f} s after the signal, past its --shutdown-timeout of {timeout:g} s"
    assert "--shutdown-timeout" in done.stderr and "exiting now" in done.stderr
