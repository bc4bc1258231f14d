"""OpenAI-style errors: every failure a client sees is {"error": {"message", "type", "param", "code"}}.

Handlers installed here turn FastAPI's own failures (malformed JSON, wrong field types: 422
by default) into 400s of that shape, and anything unexpected into a 500 of that shape, so
no request can take the process down or leak a traceback to the client.
"""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("augury.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by request handlers; becomes an OpenAI-style error response."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code, param)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _clean_loc(loc: tuple) -> str | None:
    """body.prompt.list[int].3 -> prompt.3: drop the body prefix and pydantic's union-member tags."""
    parts = [str(p) for p in loc if p != "body"]
    tags = ("function-", "constrained-")
    parts = [p for p in parts if "[" not in p and p not in _UNION_TAGS and not p.startswith(tags)]
    return ".".join(parts) or None


def _common_prefix(locs: list[str]) -> str:
    out = []
    for parts in zip(*(loc.split(".") for loc in locs)):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return ".".join(out)


def _describe_union(errors: list[dict[str, Any]], top: str) -> tuple[str, str | None, str]:
    """A union none of whose forms matched: name the form of the right type if one stands out."""
    locs = [_clean_loc(tuple(e.get("loc", ()))) or top for e in errors]
    fitting = [(e, loc) for e, loc in zip(errors, locs) if not str(e.get("type", "")).endswith("_type")]
    if fitting and len({loc for _, loc in fitting}) == 1:
        e, loc = fitting[0]
        if all(str(f.get("type", "")).endswith("too_short") for f, _ in fitting):
            return f"{loc} must not be empty", top, "invalid_value"
        if len(fitting) == 1:
            return f"{loc}: {e.get('msg', 'invalid value')}", top, "invalid_value"
    where = _common_prefix(locs) or top
    return f"{where}: invalid value; none of the accepted forms matches (see /openapi.json)", top, "invalid_type"


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) for FastAPI's validation errors, first problem first."""
    errors = list(exc.errors())
    if not errors:
        return "the request body is invalid", None, "invalid_request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg', '')}", None, "invalid_json"
    param = _clean_loc(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        return f"missing required parameter: {param}", param, "missing_required_parameter"
    if param is None:
        return f"the request body must be a JSON object ({first.get('msg', 'invalid')})", None, "invalid_type"
    top = param.split(".")[0]
    same = [e for e in errors if (_clean_loc(tuple(e.get("loc", ()))) or "").split(".")[0] == top]
    if len(same) > 1:
        return _describe_union(same, top)
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{param}: {first.get('msg', 'invalid value')}{more}", param, "invalid_type"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _describe_validation(exc)
        return error_response(400, message, code, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return error_response(exc.status_code, message, phrase.lower().replace(" ", "_"),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while handling a request")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
