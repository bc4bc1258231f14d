"""Request-body limit: a body over the server's limit is refused with an OpenAI-style 413,
whether its size is announced (Content-Length) or not (chunked transfer encoding), and the
server goes on answering ordinary requests."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from augury.server.app import MAX_BODY_BYTES
from helpers_server import ServerProcess, serve, shared_tiny_checkpoint

CHUNK = 1 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[ServerProcess]:
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "2"]) as sp:
        yield sp


def _big_body(model: str, size: int) -> bytes:
    """A well-formed completion request of exactly `size` bytes (a long prompt)."""
    head, tail = json.dumps({"model": model, "max_tokens": 2, "prompt": ""})[:-2].encode(), b'"}'
    body = head + b"a" * (size - len(head) - len(tail)) + tail
    assert len(body) == size and json.loads(body)["prompt"]
    return body


def _chunks(body: bytes) -> Iterator[bytes]:
    for i in range(0, len(body), CHUNK):
        yield body[i : i + CHUNK]


def _ordinary(server: ServerProcess, model: str, chunked: bool = False) -> None:
    body = json.dumps({"model": model, "prompt": "the quick brown fox", "max_tokens": 3, "temperature": 0}).encode()
    r = httpx.post(f"{server.base_url}/v1/completions", content=_chunks(body) if chunked else body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def _assert_413(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text[:500]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "body_too_large"
    assert str(MAX_BODY_BYTES) in err["message"]


def test_limit_is_sane() -> None:
    assert 1 << 20 <= MAX_BODY_BYTES <= 64 << 20


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_over_large_body_is_413(server: ServerProcess, tiny: Path, chunked: bool) -> None:
    body = _big_body(str(tiny), MAX_BODY_BYTES + 1)
    with httpx.Client(timeout=120) as client:
        request = client.build_request("POST", f"{server.base_url}/v1/completions",
                                       content=_chunks(body) if chunked else body,
                                       headers={"Content-Type": "application/json"})
        assert ("content-length" in request.headers) is not chunked
        assert (request.headers.get("transfer-encoding") == "chunked") is chunked
        _assert_413(client.send(request))
    # the server is still well, and the next ordinary requests (both encodings) succeed
    _ordinary(server, str(tiny))
    _ordinary(server, str(tiny), chunked=True)
    assert server.proc.poll() is None
    assert "Traceback" not in server.log

