"""The HTTP stage's product: app + engine thread + uvicorn, fully built before anything listens.

`build_server` constructs every part (state, metrics, tokenizer copy, app, uvicorn server)
or raises; `serve_on(sock)` starts the engine thread, lets uvicorn listen on the bound
socket, logs the ready line once it does, and returns the process exit status. SIGTERM and
SIGINT drain the server (drain.py) instead of uvicorn's own stop.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvicorn

from augury.generation_config import describe as describe_defaults, load_defaults

from augury.server.app import create_app
from augury.server.args import ServeSettings
from augury.server.drain import Drain
from augury.server.engine_loop import EngineLoop
from augury.server.info import ServerInfo
from augury.server.metrics import ServerMetrics
from augury.server.fields import FieldPolicy
from augury.server.responses_store import ResponseStore
from augury.server.serving import ServerState
from augury.server.templates import TemplateInfo, describe, inspect_template

log = logging.getLogger("augury.server")


class FailureLatch:
    """Set once, from the engine thread, when the engine loop stops for good."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def set(self, exc: BaseException) -> None:
        self.error = exc


class AuguryServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, settings: ServeSettings,
                 engine_failure: FailureLatch) -> None:
        super().__init__(config)
        self.state = state
        self.settings = settings
        self.engine_failure = engine_failure
        self.listen_failure: BaseException | None = None
        self.drain = Drain(state, settings.shutdown_timeout)

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets=sockets)
        except OSError as e:  # listen() failed
            self.listen_failure = e
            self.should_exit = True
            return
        if self.started:
            self.state.ready = True
            host, port = sockets[0].getsockname()[:2] if sockets else (self.settings.host, self.settings.port)
            shown = f"[{host}]" if ":" in host else host
            self.state.info.listening = f"http://{shown}:{port}"
            log.info("ready: serving %r on %s", self.state.model_name, self.state.info.listening)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, less raising the caught signal again once stopped: a drained server exits 0."""
        if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
            yield
            return
        before = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.drain.on_signal(sig)

    async def on_tick(self, counter: int) -> bool:
        if self.engine_failure.error is not None:  # the engine is gone: stop serving, exit non-zero
            self.state.ready = False
            return True
        if await super().on_tick(counter):
            return True
        if self.drain.tick():
            self.force_exit = self.drain.forced is not None  # uvicorn then waits for no connection
            # closing connections and joining the engine fit in what is left of --shutdown-timeout
            # (less 0.2 s for joining the engine thread after)
            self.config.timeout_graceful_shutdown = max(0.1, self.drain.remaining() - 0.2)
            self.drain.arm_backstop()
            return True
        return False

    async def serve_on(self, sock) -> int:
        self.state.loop.start(asyncio.get_running_loop())
        try:
            await self.serve(sockets=[sock])
        finally:
            self.state.ready = False
            self.state.loop.stop(1.0 if self.drain.forced is not None
                                 else self.drain.remaining() if self.drain.signal is not None else 10.0)
            self.state.executor.shutdown(wait=False, cancel_futures=True)
            sock.close()
        if self.listen_failure is not None:
            print(f"augury: error: start-up failed at stage 'HTTP': cannot listen: {self.listen_failure}",
                  file=sys.stderr, flush=True)
            return 1
        if not self.started:
            print("augury: error: start-up failed at stage 'HTTP': the HTTP server did not start",
                  file=sys.stderr, flush=True)
            return 1
        if self.engine_failure.error is not None:
            exc = self.engine_failure.error
            print(f"augury: error: the engine failed while serving: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
            return 1
        return self.drain.exit_status


def _folders(settings: ServeSettings) -> dict[str, str | None]:
    """The folders the engine was built from (resolve.py named them at start-up)."""
    r = settings.resolved
    if r is None:  # built from folders directly
        model, draft = Path(settings.engine.model), settings.engine.draft_model and Path(settings.engine.draft_model)
    else:
        model, draft = r.target_dir, r.draft_dir
    return {"model_folder": str(model.expanduser().resolve()),
            "draft_model_folder": str(draft.expanduser().resolve()) if draft else None}


def _chat_template(settings: ServeSettings, tokenizer) -> tuple[TemplateInfo, str | None]:
    """--chat-template in place of the tokenizer's (on the server's copy, the one that renders chats),
    what the template does with tools (templates.py), and the tool-call format: --tool-call-parser's,
    or with auto the one the template renders calls in (hermes when it renders none)."""
    if settings.chat_template is not None:
        if tokenizer is None:
            raise ValueError("--chat-template needs a tokenizer, and this model folder has none")
        tokenizer.chat_template = settings.chat_template
    info = inspect_template(tokenizer)
    parser = settings.tool_call_parser
    if parser == "auto":
        parser = info.tool_format or "hermes"
        if tokenizer is not None:
            log.info("tool calls: the %s format (%s)", parser, "as the chat template renders them"
                     if info.tool_format else "the chat template renders none")
    return info, parser


def _sampling_defaults(settings: ServeSettings) -> dict[str, Any]:
    """--generation-config's sampling defaults (generation_config.py), said at start-up when there are any."""
    defaults, source = load_defaults(settings.generation_config, Path(_folders(settings)["model_folder"]))
    if defaults:
        log.info("sampling defaults from the model's generation config: %s; a request's own values win "
                 "(--generation-config vllm ignores them)", describe_defaults(defaults, source))
    return defaults


def build_server(settings: ServeSettings, engine, stage_seconds: dict[str, float]) -> AuguryServer:
    tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
    template, tool_parser = _chat_template(settings, tokenizer)
    failure = FailureLatch()
    loop = EngineLoop(engine, settings.max_queue_size, on_fatal=failure.set)
    metrics = ServerMetrics(lambda: loop.snapshot, settings.served_model_name)
    described = {**settings.describe(), **_folders(settings), "tool_call_parser": tool_parser,
                 "chat_template": describe(template)}
    defaults = _sampling_defaults(settings)
    described["sampling_defaults"] = defaults
    # every augury module that will serve is imported by now (this module imports the app)
    info = ServerInfo.capture(described, engine, stage_seconds)
    state = ServerState(loop=loop, metrics=metrics, model_name=settings.served_model_name,
                        max_model_len=engine.max_model_len, vocab_size=engine.model_cfg.vocab_size,
                        tokenizer=tokenizer, executor=ThreadPoolExecutor(1, thread_name_prefix="augury-tokenizer"),
                        info=info, api_key=settings.api_key,
                        grammar=engine.grammar if engine.tokenizer is not None else None,
                        tool_call_parser=tool_parser, limits=settings.limits,
                        template=template, reasoning_parser=settings.reasoning_parser,
                        stream_timeout=settings.stream_timeout or None,  # 0: never
                        model_names=settings.served_model_names or (settings.served_model_name,),
                        fields=FieldPolicy(strict=settings.strict_fields), sampling_defaults=defaults,
                        responses=ResponseStore(settings.max_stored_responses,
                                                int(settings.max_stored_responses_mb * 2**20)))
    app = create_app(state, settings.enable_docs, settings.log_requests, settings.allowed_origins)
    config = uvicorn.Config(app, log_level="debug" if settings.debug else "warning",
                            access_log=settings.debug, lifespan="off", timeout_graceful_shutdown=5,
                            server_header=False)
    return AuguryServer(config, state, settings, failure)
