"""Operations around every request: its id (X-Request-Id), the request log, CORS.

RequestContext (pure ASGI middleware) gives each HTTP request an id: the client's X-Request-Id when
it sends one (printable ASCII, at most MAX_ID_CHARS), else a fresh one; the id goes back in the
response's X-Request-Id header, names the answer (chatcmpl-ID, cmpl-ID), prefixes its engine
requests' ids (so the engine's log lines about it carry it) and opens its request-log line. A
handler can replace a generated id by the body's `request_id` (vLLM's field) before it answers.
With --enable-log-requests it logs one line per request once the response has gone out (streams
included): id, method, path, status, seconds, and for generation the tokens and finish reasons.
The handlers' unknown fields (fields.FieldPolicy) go out in the X-Augury-Ignored-Fields header.

CORS is Starlette's CORSMiddleware, outermost: a browser's preflight (OPTIONS) is answered before
the API key is asked for (a browser sends no credentials on a preflight), and every response to an
allowed origin, a 401 included, carries the CORS headers so the page can read it.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from starlette.middleware.cors import CORSMiddleware

from augury.server.errors import bad_request, error_response
from augury.server.fields import IGNORED_HEADER, header_value

log = logging.getLogger("augury.server")
MAX_ID_CHARS = 128
ID_HEADER = "X-Request-Id"


def valid_id(value: str) -> bool:
    return 0 < len(value) <= MAX_ID_CHARS and all(33 <= ord(c) < 127 for c in value)


class RequestContext:
    """Pure ASGI middleware: the request id, the id and ignored-fields headers, the request log."""

    def __init__(self, app, log_requests: bool = False) -> None:
        self.app, self.log_requests = app, log_requests

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = dict(scope.get("headers") or []).get(b"x-request-id")
        state: dict[str, Any] = scope.setdefault("state", {})
        if raw is not None:
            given = raw.decode("latin-1").strip()
            if not valid_id(given):
                response = error_response(400, f"{ID_HEADER} must be 1 to {MAX_ID_CHARS} printable ASCII "
                                          "characters without spaces", "invalid_value", ID_HEADER)
                return await response(scope, receive, send)
            state["request_id"], state["request_id_given"] = given, True
        else:
            state["request_id"], state["request_id_given"] = uuid.uuid4().hex, False
        t0, status = time.monotonic(), [0]

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = list(message.get("headers") or [])
                headers.append((ID_HEADER.lower().encode(), state["request_id"].encode()))
                if state.get("ignored_fields"):
                    headers.append((IGNORED_HEADER.lower().encode(), header_value(state["ignored_fields"]).encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            if self.log_requests:
                log.info("%s", _log_line(scope, state, status[0], time.monotonic() - t0))


def _log_line(scope, state: dict[str, Any], status: int, seconds: float) -> str:
    line = (f"request {state['request_id']}: {scope.get('method', '?')} {scope.get('path', '?')} "
            f"{status or 'no response'} in {seconds:.3f} s")
    job = state.get("job")
    if job is not None:  # a generation request that was admitted (serving.Job)
        finishes = ",".join(sorted(set(job.finish_reasons))) or "unfinished"
        line += (f" (prompt {job.prompt_tokens} tokens, completion {job.completion_tokens} tokens, "
                 f"finish {finishes}, engine id {job.engine_id or job.request_id})")
    return line


def request_id(request, body_id: str | None) -> tuple[str, bool]:
    """(the request's id, whether the client gave it): X-Request-Id first, then the body's request_id
    (vLLM's field; it then replaces the generated id in the response header too), else generated."""
    state = request.scope.setdefault("state", {})
    if state.get("request_id_given"):
        return state["request_id"], True
    if body_id is not None:
        if not valid_id(body_id):
            raise bad_request(f"request_id must be 1 to {MAX_ID_CHARS} printable ASCII characters without spaces",
                              "request_id")
        state["request_id"], state["request_id_given"] = body_id, True
        return body_id, True
    rid = state.get("request_id") or uuid.uuid4().hex
    state["request_id"] = rid
    return rid, False


def add_cors(app, origins: tuple[str, ...]) -> None:
    """CORS for these origins (none: no CORS headers, browsers keep other origins out)."""
    if not origins:
        return
    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["*"], allow_credentials=False, max_age=600,
                       expose_headers=[ID_HEADER, IGNORED_HEADER])
