"""The FastAPI application: OpenAI routes, /tokenize and /detokenize (vLLM's), /health, /ping,
/metrics, /server_info.

Handlers run on the HTTP event loop and never call the Engine; they go through the
EngineLoop (engine_loop.py). When an API key is set, every route but /health, /ping, /metrics and
/version (probes and scrapers carry no keys) needs it, checked from the headers before any byte
of the body is read (KeyCheck). /docs, /redoc and /openapi.json exist only with --enable-docs.
Around them (ops.py): CORS outermost (a preflight needs no key), then the request id, its headers
and the request log (RequestContext).
"""
from __future__ import annotations

import hmac
import time
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

import augury
from augury import distributed
from augury.server.errors import error_response, install_error_handlers
from augury.server.logprobs import chat_logprobs, completion_logprobs
from augury.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, ErrorResponse, ModelCard, ModelList)
from augury.server.ops import RequestContext, add_cors, request_id
from augury.server.provenance import asked, whole
from augury.server.serving import ServerState, admit, chat_job, check_model, completion_job
from augury.server.tokenize import add_token_routes
from augury.server.responses import add_response_routes
from augury.server.streams import GroupStreamingResponse, chat_events, collect, completion_events, usage
from augury.server.chat_text import chat_message

MAX_BODY_BYTES = 16 * 2**20
DISCARD_AT_MOST = 4 * MAX_BODY_BYTES  # of a body over the limit, read and dropped before the 413 (BodyLimit)
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)
}
# served without the key: probes, and the playground page (it holds no data; its API calls carry the key)
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/"})
# checks nothing (KeyCheck has, before the body): it puts the Bearer scheme in /openapi.json for /docs
_bearer = HTTPBearer(auto_error=False)


class KeyCheck:
    """Pure ASGI middleware: with a key set, a request to any path but OPEN_PATHS without
    `Authorization: Bearer KEY` is answered 401 from its headers alone. It runs outermost, before
    BodyLimit and FastAPI, so an unauthenticated client cannot make the server read (or buffer) up
    to MAX_BODY_BYTES of body first; the connection closes after the 401, unread body and all."""

    def __init__(self, app, key: str | None) -> None:
        self.app, self.key = app, None if key is None else key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.key is None or scope["path"] in OPEN_PATHS or self._allowed(scope):
            return await self.app(scope, receive, send)
        response = error_response(401, "a valid API key is required (Authorization: Bearer KEY)", "invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
        await response(scope, receive, send)

    def _allowed(self, scope) -> bool:
        value = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, given = value.partition(b" ")
        # compare_digest: the time taken says nothing about how much of the key matched
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key)


class BodyLimit:
    """Pure ASGI middleware: refuse request bodies over `limit` bytes with a 413 (no unbounded memory).

    A body with a Content-Length is judged by it (the HTTP server never delivers more than
    announced). One without (chunked transfer encoding) is read here first, at most `limit`
    bytes, and replayed to the app: a limit hit while the app reads its body would reach
    FastAPI as a body-parsing failure, a 400.
    """

    def __init__(self, app, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit():
            if int(length) > self.limit:
                await self._discard(receive, int(length))
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        parts: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app sees that next
                break
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.limit:
                if message.get("more_body", False):
                    await self._discard(receive, DISCARD_AT_MOST - seen)
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(parts), "more_body": False}
                break
        replay = [message]

        async def replayed_receive():
            return replay.pop() if replay else await receive()

        return await self.app(scope, replayed_receive, send)

    @staticmethod
    async def _discard(receive, expected: int) -> None:
        """Read and drop the rest of a refused body (nothing kept), up to DISCARD_AT_MOST bytes: a
        client still uploading when the 413 and the close come gets a reset instead of the answer
        (seen with httpx's async client). Beyond DISCARD_AT_MOST it is not worth the bandwidth."""
        if expected > DISCARD_AT_MOST:
            return
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    async def _refuse(self, scope, receive, send) -> None:
        response = JSONResponse({"error": {"message": f"the request body is over {self.limit} bytes",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "body_too_large"}},
                                status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)


def playground_page() -> str:
    """The playground's one file (static/playground.html, shipped as package data)."""
    return resources.files("augury.server").joinpath("static/playground.html").read_text(encoding="utf-8")


def create_app(state: ServerState, enable_docs: bool = False, log_requests: bool = False,
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The app; /docs, /redoc and /openapi.json only with enable_docs (behind the key like the rest);
    log_requests: one log line per request (ops.RequestContext); allowed_origins: CORS (ops.add_cors)."""
    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="augury", version=augury.__version__,
                  description="OpenAI-compatible LLM server with load-aware EAGLE-3 speculative decoding", **docs)
    app.state.augury = state
    install_error_handlers(app)
    app.add_middleware(BodyLimit)
    app.add_middleware(KeyCheck, key=state.api_key)  # before any body is read
    app.add_middleware(RequestContext, log_requests=log_requests)  # a 401 carries the id and is logged too
    add_cors(app, allowed_origins)  # added last: runs first (a preflight never meets the key)

    guarded = [Depends(_bearer)]

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if state.draining:  # a load balancer takes this replica out while what it holds finishes
            return JSONResponse({"status": "draining"}, status_code=503)
        if state.ready and state.loop.alive:
            return JSONResponse({"status": "ok"})
        status = "starting" if not state.ready else "engine not running"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/ping", operation_id="ping_get", responses={503: {"model": ErrorResponse}})
    @app.post("/ping", operation_id="ping_post", responses={503: {"model": ErrorResponse}})
    async def ping() -> Response:  # vLLM's (SageMaker's) liveness probe: /health's answer
        return await health()

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    page = playground_page()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> Response:  # one static file: chat, speculation at work (static/playground.html)
        return HTMLResponse(page)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": augury.__version__}

    @app.get("/server_info", dependencies=guarded, responses=_ERRORS)
    async def server_info() -> dict[str, Any]:
        return state.info.render()

    def card(name: str) -> ModelCard:
        tp = distributed.status()
        return ModelCard(id=name, created=int(state.info.started_at), root=state.model_name,
                         max_model_len=state.max_model_len, tensor_parallel_size=tp["size"],
                         tensor_parallel_backend=tp["backend"])

    @app.get("/v1/models", dependencies=guarded, responses=_ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=[card(name) for name in state.model_names or (state.model_name,)])

    @app.get("/v1/models/{model_id:path}", dependencies=guarded, responses=_ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        check_model(state, model_id)
        return card(model_id)

    add_token_routes(app, state, guarded, _ERRORS)
    add_response_routes(app, state, guarded, _ERRORS)  # /v1/responses (responses.py)

    async def answer(body, request: Request, job, t0: float, events, obj: str, choice, logprobs) -> Response:
        """The part completions and chat share: admit, then stream or collect one JSON body.
        choice(i, out) -> the choice's own fields; logprobs(tokenizer, i, out) -> its logprobs object
        (run on the tokenizer thread, only when the request asked for logprobs)."""
        group = admit(state, job, stream=bool(body.stream))
        request.state.job = job  # what the request log says of it
        job.continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return GroupStreamingResponse(events(state, job, group, t0, include), group,
                                          state.metrics.observe_aborted, state.stream_timeout)
        outs = await collect(state, group, request, t0)
        if outs is None:
            return Response(status_code=499)
        for o in outs:
            job.note(o)
        lps: list[Any] = [None] * len(outs)
        if job.logprobs is not None:
            tok = state.tokenizer
            lps = await state.on_tokenizer_thread(lambda: [logprobs(tok, i, o) for i, o in enumerate(outs)])
        choices = [{"index": i, "logprobs": lps[i], "finish_reason": o.finish_reason, **choice(i, o)}
                   for i, o in enumerate(outs)]  # choice() may name another finish reason (tool_calls)
        if asked(job.params):  # augury's extension (provenance.py)
            tok, skip = state.tokenizer, job.params[0].skip_special_tokens
            extras = await state.on_tokenizer_thread(lambda: [whole(tok, o, skip) for o in outs])
            for c, extra in zip(choices, extras):
                c["augury"] = extra
        return JSONResponse({"id": job.request_id, "object": obj, "created": int(time.time()),
                             "model": state.model_name, "choices": choices,
                             "usage": usage(job.prompt_tokens, sum(len(o.token_ids) for o in outs), outs)})

    @app.post("/v1/completions", dependencies=guarded, response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        t0 = time.monotonic()
        state.fields.check(body, request.scope.get("state"))
        job = await completion_job(state, body, *request_id(request, body.request_id))

        def prefix(i: int) -> str:  # echo: the choice's prompt text first
            return job.prompt_texts[i // job.n] if job.echo else ""

        def logprobs(tok, i: int, o) -> dict[str, Any]:
            if job.echo:
                return completion_logprobs(tok, o.prompt_token_ids + o.token_ids, o.prompt_logprobs + o.logprobs)
            return completion_logprobs(tok, o.token_ids, o.logprobs)

        return await answer(body, request, job, t0, completion_events, "text_completion",
                            lambda i, o: {"text": prefix(i) + o.text}, logprobs)

    @app.post("/v1/chat/completions", dependencies=guarded, response_model=ChatCompletionResponse,
              responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        t0 = time.monotonic()
        state.fields.check(body, request.scope.get("state"))
        job = await chat_job(state, body, *request_id(request, body.request_id))

        def message(i: int, o) -> dict[str, Any]:  # reasoning, content and tool calls (chat_text.py)
            msg, called = chat_message(job, o.text)
            out: dict[str, Any] = {"message": msg}
            if called and o.finish_reason == "stop":
                out["finish_reason"] = "tool_calls"
            return out

        return await answer(body, request, job, t0, chat_events, "chat.completion", message,
                            lambda tok, i, o: chat_logprobs(tok, o.token_ids, o.logprobs, job.logprobs))

    return app
