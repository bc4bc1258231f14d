"""`augury serve`: start-up as named stages that each complete or stop the process.

configuration -> target -> draft head -> KV cache -> CUDA graphs -> warm-up -> HTTP.
The first six are engine/builder.py's; this module adds its own work to "configuration"
(flags, environment, the model paths, the port: all before anything heavy is imported; then
the model name resolved to folders, which may fetch the demo or convert a .gguf file once)
and the "HTTP" stage (bind, build the app, start the engine thread, listen). A failing
stage prints one line, `augury: error: start-up failed at stage '<stage>': <cause>`, and
the process exits with status 1 (argparse usage errors: 2); the traceback only with --debug.
Nothing listens before the warm-up has passed: the socket is bound in the HTTP stage and
starts listening when uvicorn starts serving, after which /health is green.
SIGTERM during start-up stops it as Ctrl-C does (each stage's clean-up runs, tensor-parallel
ranks included; status 128 + the signal); once serving, a signal drains the server (drain.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from augury import resolve
from augury.config import one_line
from augury.stages import StartupError, stage
from augury.server.args import build_parser, settings_from_args

log = logging.getLogger("augury.server")
HTTP_STAGE = "HTTP"


class _Stages:
    """Tracks which stage runs (builder stages report in through `entered`) and how long each took."""

    def __init__(self) -> None:
        self.current = "configuration"
        self.seconds: dict[str, float] = {}
        self._t = time.monotonic()

    def entered(self, name: str) -> None:
        now = time.monotonic()
        if name != self.current:
            self.seconds[self.current] = round(self.seconds.get(self.current, 0.0) + now - self._t, 3)
            self.current, self._t = name, now

    def finish(self) -> None:
        self.entered("serving")

    def stage(self, name: str, announce: bool = True):
        return stage(name, self.entered, announce)


def _report(stage: str, cause: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exception(cause)
    print(f"augury: error: start-up failed at stage '{stage}': {one_line(cause)}", file=sys.stderr, flush=True)
    return 1


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound, not yet listening, TCP socket (SO_REUSEADDR, as uvicorn does)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind {host}:{port} ({e.strerror or e}); is another server using the port?") from None
    return sock


class _Stopped(KeyboardInterrupt):
    """A stop signal during start-up, raised where the main thread is, like Ctrl-C's KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupted(stage: str, signum: int) -> int:
    """Start-up stopped by a signal at `stage`: one line, and the shell's status for that signal."""
    print(f"augury: error: start-up interrupted at stage '{stage}' ({signal.Signals(signum).name})",
          file=sys.stderr, flush=True)
    return 128 + signum


def _setup_logging(debug: bool) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("augury")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    return handler


def serve_main(argv: list[str] | None = None) -> int:
    """Parse the `augury serve` flags, start up stage by stage, serve until stopped; the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed on one line
        return e.code if isinstance(e.code, int) else 2
    handler = _setup_logging(args.debug)
    main = threading.current_thread() is threading.main_thread()  # only there may signal handlers be set
    stopped: list[int] = []  # the stop signal start-up received, if one came

    def stop(signum: int, frame) -> None:
        stopped.append(signum)
        raise _Stopped(signum)

    before = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        return _start_and_serve(args, stopped)
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)
        logging.getLogger("augury").removeHandler(handler)


def _start_and_serve(args, stopped: list[int]) -> int:
    stages = _Stages()
    debug = bool(args.debug)
    try:
        with stages.stage("configuration", announce=False):  # builder.py announces it
            settings = settings_from_args(args)
            resolve.check(settings.engine)  # paths exist, a head is there for eagle3: before anything slow
            bind_socket(settings.host, settings.port).close()  # the port is free now: fail before loading
            # the demo may be downloaded, a .gguf file converted (once): failures name this stage
            settings = dataclasses.replace(settings, resolved=resolve.resolve(settings.engine))
        from augury.builder import build_engine
        from augury.distributed import launch

        launch.exit_on_failure()  # a tensor-parallel rank that dies or hangs ends the server, one line naming it
        try:
            engine = build_engine(settings.engine, settings.resolved, notify=stages.entered)
        except StartupError:
            raise
        except Exception as e:  # outside any builder stage (there is none today; belt and braces)
            raise StartupError(stages.current, e) from e
        with stages.stage(HTTP_STAGE):
            from augury.server.httpserver import build_server

            server = build_server(settings, engine, stages.seconds)
            sock = bind_socket(settings.host, settings.port)
    except StartupError as e:
        if stopped:  # the stop signal's exception, raised inside a library's call, came out as another: torch
            #          building a tensor turned it into "could not determine the shape of object type
            #          'torch.storage.UntypedStorage'" (a two-rank start-up stopped while loading its target)
            return _interrupted(stages.current, stopped[-1])
        return _report(e.stage, e.cause, debug)
    except KeyboardInterrupt as e:
        return _interrupted(stages.current, e.signum if isinstance(e, _Stopped) else signal.SIGINT)
    stages.finish()
    try:
        status = asyncio.run(server.serve_on(sock))
    except KeyboardInterrupt:
        return 0
    if server.drain.signal is not None and threading.current_thread() is threading.main_thread():
        # a drained server ends now: the interpreter's teardown (joining a grammar or tokenizer thread still
        # at work, freeing gigabytes object by object) ended the 10-minute soak 0.35 s past its 30 s timeout
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
