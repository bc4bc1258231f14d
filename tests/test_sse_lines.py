"""Server-sent events stay one `data:` line each whatever the text holds: JSON leaves U+0085, U+2028
and U+2029 raw with ensure_ascii=False, and a client reading lines with Python's splitlines (httpx's
iter_lines) would cut the event there; the server escapes them (server/streams.py's sse_json)."""
from __future__ import annotations

import json

import httpx

from augury.server.streams import sse_json


def test_an_event_with_unicode_line_breaks_is_one_line_and_decodes_to_the_same_text() -> None:
    text = "a\x85b\u2028c\u2029d, é \u00e8 \u4e2d \U0001f600 \n\r\t\"\\"
    payload = sse_json({"choices": [{"text": text}]})
    assert len(payload.splitlines()) == 1
    assert json.loads(payload) == {"choices": [{"text": text}]}
    assert "é" in payload and "\U0001f600" in payload  # UTF-8 as it is otherwise
    # a client splitting the stream as httpx does sees one event and its text
    body = f"data: {payload}\n\ndata: [DONE]\n\n".encode()
    lines = list(httpx.Response(200, content=body).iter_lines())
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] == text
