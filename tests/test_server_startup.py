"""Start-up cannot half-succeed: every stage either completes or the process exits non-zero
with one line naming the stage (no traceback), and nothing ever listens on the port first.

Faults are injected with AUGURY_FAULT_INJECT=<stage>: configuration failures and two model
stages in real `python -m augury.server` subprocesses (exit status and stderr as a user sees
them), the other model stages through serve_main in-process, which costs far less CPU.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers_server import run_serve, server_env, shared_tiny_checkpoint

HEAVY_STAGES = ("target", "draft head", "KV cache", "CUDA graphs", "warm-up", "HTTP")
ERROR_PREFIX = "augury: error: start-up failed at stage "


@dataclass
class Outcome:
    rc: int
    output: str
    listened: bool
    became_ready: bool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], env: dict[str, str], port: int, result: dict, key: str, timeout: float) -> None:
    """Run a server until it exits (or becomes ready, then stop it), watching the port all along."""
    proc = subprocess.Popen([sys.executable, "-m", "augury.server", "--port", str(port), *args],
                            env=server_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    state = {"listened": False, "ready": False}

    def poll_port() -> None:
        while proc.poll() is None:
            with socket.socket() as s:
                s.settimeout(0.05)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    state["listened"] = True
            time.sleep(0.02)

    poller = threading.Thread(target=poll_port, daemon=True)
    poller.start()
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "ready: serving" in line:
            state["ready"] = True
            proc.terminate()
    rc = proc.wait()
    killer.cancel()
    poller.join()
    result[key] = Outcome(rc, "".join(lines), state["listened"] and not state["ready"], state["ready"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def bad_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bad_head")
    (folder / "config.json").write_text(json.dumps({"architectures": ["NotAnEagle"], "hidden_size": 7}))
    return folder


def _base(tiny: Path) -> list[str]:
    return ["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "2"]


@pytest.fixture(scope="module")
def subprocess_outcomes(tiny: Path) -> dict[str, Outcome]:
    """Real processes for two stages, at once: the exit status and stderr as a user sees them.
    ('CUDA graphs' runs here so that, once it degrades instead of failing, the server is stopped.)"""
    result: dict[str, Outcome] = {}
    threads = [threading.Thread(target=_launch, args=(_base(tiny), {"AUGURY_FAULT_INJECT": stage}, _free_port(),
                                                      result, stage, 240.0))
               for stage in ("warm-up", "CUDA graphs")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result


def _in_process(args: list[str], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
                **env: str) -> Outcome:
    """serve_main in this process (the model loads in a fraction of a subprocess's time)."""
    from augury.server import serve_main

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    port = _free_port()
    stop, listened = threading.Event(), threading.Event()

    def poll_port() -> None:
        while not stop.is_set():
            with socket.socket() as s:
                s.settimeout(0.05)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    listened.set()
            time.sleep(0.02)

    poller = threading.Thread(target=poll_port, daemon=True)
    poller.start()
    try:
        rc = serve_main(["--port", str(port), *args])
    finally:
        stop.set()
        poller.join()
    captured = capfd.readouterr()
    return Outcome(rc, captured.out + captured.err, listened.is_set(), False)


def _assert_one_line_failure(out: Outcome, stage: str) -> None:
    assert out.rc == 1, out.output
    errors = [line for line in out.output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, out.output
    assert errors[0].startswith(f"{ERROR_PREFIX}'{stage}': "), out.output
    assert "Traceback" not in out.output, out.output
    assert not out.listened and not out.became_ready, "something listened before start-up finished"


def _assert_stopped_there(out: Outcome, stage: str) -> None:
    _assert_one_line_failure(out, stage)
    assert "fault injected by AUGURY_FAULT_INJECT" in out.output
    later = HEAVY_STAGES[HEAVY_STAGES.index(stage) + 1:]
    assert not any(f"start-up stage: {s}\n" in out.output for s in later), out.output


@pytest.mark.parametrize("stage", ["target", "draft head", "KV cache", "HTTP"])
def test_injected_fault_stops_at_that_stage(stage: str, tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    _assert_stopped_there(_in_process(_base(tiny), monkeypatch, capfd, AUGURY_FAULT_INJECT=stage), stage)


def test_a_stop_signal_that_a_library_turns_into_another_error_still_reads_as_a_stop(
        tiny: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """SIGTERM while the target loads, its exception caught inside a library call that raises its own
    instead (torch building a tensor: "could not determine the shape of object type ..."): start-up
    says it was interrupted there and exits 128 + 15, not a one-line failure of the stage."""
    import os
    import signal

    import augury.builder

    def load_target(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        except KeyboardInterrupt:
            pass  # swallowed, as torch's C++ did
        raise TypeError("could not determine the shape of object type 'torch.storage.UntypedStorage'")

    monkeypatch.setattr(augury.builder, "load_target", load_target)
    out = _in_process(_base(tiny), monkeypatch, capfd)
    assert out.rc == 128 + signal.SIGTERM, out.output
    assert "augury: error: start-up interrupted at stage 'target' (SIGTERM)" in out.output
    assert "could not determine" not in out.output and "Traceback" not in out.output
    assert not out.listened


def test_injected_fault_in_a_real_process(subprocess_outcomes: dict[str, Outcome]) -> None:
    _assert_stopped_there(subprocess_outcomes["warm-up"], "warm-up")


def test_cuda_graphs_fault_degrades_with_a_warning(subprocess_outcomes: dict[str, Outcome]) -> None:
    out = subprocess_outcomes["CUDA graphs"]
    assert out.became_ready, out.output
    assert any("WARNING" in line and "CUDA graphs" in line for line in out.output.splitlines()), out.output


def test_cuda_graphs_fault_never_half_starts(subprocess_outcomes: dict[str, Outcome]) -> None:
    """Whichever way the optional stage is handled, there is no third outcome."""
    out = subprocess_outcomes["CUDA graphs"]
    if out.became_ready:
        assert "Traceback" not in out.output
    else:
        _assert_one_line_failure(out, "CUDA graphs")


def test_bad_draft_head_is_one_line(tiny: Path, bad_head: Path, monkeypatch: pytest.MonkeyPatch,
                                    capfd: pytest.CaptureFixture[str]) -> None:
    args = _base(tiny) + ["--speculative-algorithm", "eagle3", "--speculative-draft-model-path", str(bad_head)]
    _assert_one_line_failure(_in_process(args, monkeypatch, capfd), "draft head")


@pytest.mark.parametrize("args, env, needle", [
    (["--speculative-disable-batch-threshold", "-3"], {}, "--speculative-disable-batch-threshold must be"),
    ([], {"AUGURY_SPEC_DISABLE_BATCH_THRESHOLD": "abc"}, "AUGURY_SPEC_DISABLE_BATCH_THRESHOLD='abc'"),
    (["--dtype", "float64"], {}, "--dtype must be one of"),
    (["--max-queue-size", "-1"], {}, "--max-queue-size"),
    (["--model", "/no/such/model"], {}, "/no/such/model does not exist"),
    (["--speculative-draft-model-path", "/no/such/head", "--speculative-algorithm", "eagle3"], {},
     "/no/such/head does not exist"),
    (["--port", "70000"], {}, "--port must be in [0, 65535]"),
    ([], {"AUGURY_FAULT_INJECT": "configuration"}, "fault injected"),
])
def test_bad_configuration_is_one_line(args: list[str], env: dict[str, str], needle: str) -> None:
    proc = run_serve(args, timeout=60, **env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert proc.stderr.startswith(f"{ERROR_PREFIX}'configuration': ") and needle in proc.stderr, out
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in out, out


@pytest.mark.parametrize("args", [["--port", "abc"], ["--max-num-seqs", "x"], ["--no-such-flag"]])
def test_unparseable_flag_is_one_usage_line(args: list[str]) -> None:
    proc = run_serve(args, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("augury serve: error: "), proc.stderr


def test_port_in_use_fails_before_loading_the_model(tiny: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_serve(["--model", str(tiny), "--port", str(port)], timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith(f"{ERROR_PREFIX}'configuration': cannot bind 127.0.0.1:{port}"), proc.stderr
    assert "start-up stage: target" not in proc.stdout + proc.stderr  # the model was never loaded


def test_debug_shows_the_traceback() -> None:
    proc = run_serve(["--debug"], timeout=60, AUGURY_FAULT_INJECT="configuration")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and f"{ERROR_PREFIX}'configuration'" in proc.stderr


def test_augury_serve_is_this_server() -> None:
    """`augury serve ...` (cli.py) hands its flags to serve_main: same checks, same one line."""
    proc = subprocess.run([sys.executable, "-m", "augury.cli", "serve", "--speculative-disable-batch-threshold", "-3"],
                          env=server_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"{ERROR_PREFIX}'configuration': --speculative-disable-batch-threshold must be "
                                   "a positive integer, got -3")
