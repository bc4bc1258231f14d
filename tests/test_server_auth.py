"""Authentication comes first: with --api-key set, a request without the key is answered 401 from its
headers alone (no byte of its body read), and the API's own documentation (/docs, /redoc,
/openapi.json) exists only with --enable-docs, behind the key when there is one.

The app is driven through raw ASGI calls (so the test sees whether `receive` was ever called) and
through a real `python -m augury.server` process (a client that announces 16 MiB, or starts a chunked
upload it never finishes, still gets its 401 at once).
"""
from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from augury.server.app import MAX_BODY_BYTES, create_app
from augury.server.serving import ServerState
from helpers_server import ServerProcess, serve, shared_tiny_checkpoint

KEY = "sesame-0123"


def _state(api_key: str | None) -> ServerState:
    """Only what create_app reads while building and what these paths touch: no engine behind it."""
    return ServerState(loop=None, metrics=None, model_name="tiny", max_model_len=64, vocab_size=8, tokenizer=None,
                       executor=None, info=None, api_key=api_key)


class _Receive:
    """An ASGI receive() that counts its calls. uploading: the client is still sending its body
    (nothing ever arrives); else an empty body, as for a GET."""

    def __init__(self, uploading: bool) -> None:
        self.calls, self.uploading = 0, uploading

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.uploading:
            await asyncio.sleep(3600)
        return {"type": "http.request", "body": b"", "more_body": False}


def _call(app, method: str, path: str, headers: dict[str, str],
          uploading: bool = False) -> tuple[int, dict[str, str], bytes, int]:
    """One raw ASGI request: (status, response headers, body, times receive() was called)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    receive, sent = _Receive(uploading), []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        await asyncio.wait_for(app(scope, receive, send), timeout=5)

    asyncio.run(run())
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body, receive.calls


@pytest.mark.parametrize("headers", [
    {"content-type": "application/json", "content-length": str(MAX_BODY_BYTES)},
    {"content-type": "application/json", "transfer-encoding": "chunked"},
    {"content-type": "application/json", "transfer-encoding": "chunked", "authorization": "Bearer wrong"},
    {"content-type": "application/json", "content-length": "10", "authorization": f"Basic {KEY}"},
], ids=["announced-16MiB", "chunked", "wrong-key", "basic-scheme"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_key_is_401_before_any_body_byte_is_read(headers: dict[str, str], path: str) -> None:
    status, out, body, reads = _call(create_app(_state(KEY)), "POST", path, headers, uploading=True)
    assert status == 401 and reads == 0
    assert out["www-authenticate"] == "Bearer" and out["connection"] == "close"
    err = json.loads(body)["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/server_info", "/v1/models", "/v1/models/tiny", "/no/such/route"])
def test_every_other_route_needs_the_key_too(path: str) -> None:
    status, _, _, reads = _call(create_app(_state(KEY)), "GET", path, {})
    assert status == 401 and reads == 0


def test_probes_need_no_key_and_a_good_key_passes() -> None:
    app = create_app(_state(KEY))
    assert _call(app, "GET", "/version", {})[0] == 200
    # the right key reaches the routes (this one 404s: no such route, but past the key check)
    assert _call(app, "GET", "/no/such/route", {"authorization": f"Bearer {KEY}"})[0] == 404
    assert _call(app, "GET", "/no/such/route", {"authorization": f"bearer  {KEY}"})[0] == 404


@pytest.mark.parametrize("key", [None, KEY])
@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_docs_are_off_by_default(key: str | None, path: str) -> None:
    auth = {"authorization": f"Bearer {KEY}"} if key else {}
    assert _call(create_app(_state(key)), "GET", path, auth)[0] == 404


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_docs_with_the_flag_are_served_and_behind_the_key(path: str) -> None:
    assert _call(create_app(_state(None), enable_docs=True), "GET", path, {})[0] == 200
    guarded = create_app(_state(KEY), enable_docs=True)
    assert _call(guarded, "GET", path, {})[0] == 401
    status, _, body, _ = _call(guarded, "GET", path, {"authorization": f"Bearer {KEY}"})
    assert status == 200
    if path == "/openapi.json":  # the Bearer scheme is documented for /docs' "Authorize"
        schemes = json.loads(body)["components"]["securitySchemes"]
        assert any(s.get("scheme") == "bearer" for s in schemes.values())


def test_the_key_comes_from_the_flag_else_from_augury_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from augury.server.args import build_parser, settings_from_args

    def key(*args: str) -> str | None:  # the flags validated as `augury serve` does first; nothing loads
        return settings_from_args(build_parser().parse_args(list(args))).api_key

    monkeypatch.delenv("AUGURY_API_KEY", raising=False)
    assert key() is None
    monkeypatch.setenv("AUGURY_API_KEY", "from-env")
    assert key() == "from-env" and key("--api-key", "from-flag") == "from-flag"
    monkeypatch.setenv("AUGURY_API_KEY", "from-env\n")  # as `$(cat secret)` would leave it: never matchable
    with pytest.raises(ValueError, match="AUGURY_API_KEY must not begin or end with whitespace"):
        key()
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        key("--api-key", " ")


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tiny: Path = shared_tiny_checkpoint(tmp_path_factory)
    with serve(["--model", str(tiny), "--dtype", "float32", "--api-key", KEY, "--enable-docs",
                "--speculative-algorithm", "none"]) as sp:
        yield sp


def _raw_exchange(port: int, head: bytes, body_start: bytes) -> bytes:
    """Send the request's head and the first bytes of a body it never finishes; what the server says."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body_start)
        data = b""
        while True:  # the server answers and closes, though the body is still unfinished
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_real_server_answers_an_unfinished_upload_401_at_once(server: ServerProcess, framing: str) -> None:
    if framing == "chunked":
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        start = b"100000\r\n" + b"a" * 4096  # a 1 MiB chunk begun, never ended
    else:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % MAX_BODY_BYTES)
        start = b'{"prompt": "' + b"a" * 4096
    reply = _raw_exchange(server.port, head, start)
    head_out, _, body = reply.partition(b"\r\n\r\n")
    assert head_out.startswith(b"HTTP/1.1 401"), reply[:300]
    assert b"\r\nwww-authenticate: bearer" in head_out.lower()
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert server.proc.poll() is None


def test_a_real_server_serves_docs_behind_the_key_with_the_flag(server: ServerProcess) -> None:
    url = server.base_url
    assert httpx.get(f"{url}/openapi.json").status_code == 401
    assert httpx.get(f"{url}/docs").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert "/v1/chat/completions" in httpx.get(f"{url}/openapi.json", headers=auth).json()["paths"]
    assert httpx.get(f"{url}/docs", headers=auth).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    info = httpx.get(f"{url}/server_info", headers=auth).json()
    assert info["server"]["enable_docs"] is True and info["server"]["api_key_set"] is True
