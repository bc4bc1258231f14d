"""Tool calls read out of a chat answer, in any of the formats of tool_formats.py (`FORMATS`, by the
names vLLM's --tool-call-parser uses), whole (`parse_tool_calls`) or as it streams (`ToolCallStream`).

An answer is text and blocks. A block opens at the format's opening marker (`open`, anywhere), or at
the answer's start when the answer, past leading whitespace, begins with one of the format's `lead`
prefixes (which belong to the block's body: llama3_json's '{', pythonic's '['); it runs to the first
closing marker after it (`close`), or to the end of the answer when there is none or the format has
no closing marker. A block is calls when its format's rule (`read`) says so, and content otherwise,
markers and all. Content is the text outside calls, stripped, None when empty. Both paths split by
these rules and read each block with the rule alone, and the stream holds a block back until it is
whole, so for every answer and every way of cutting it the stream's deltas join into the whole
answer's content and calls. Torch-free.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from augury.structured import tool_formats as tf


@dataclass(frozen=True)
class ToolFormat:
    name: str
    read: Callable[[str, tf.Tools], tf.Calls]  # the one rule for a block's body
    write: Callable[[str, str], str]  # (name, arguments JSON) -> the call as the model writes it
    grammar: Callable[[list[dict[str, Any]], tf.ArgsFormat, bool], tf.Format]  # required / named calls
    open: str | None = None
    close: str | None = None
    lead: tuple[str, ...] = ()
    # markers the model writes as special tokens of their own (a tokenizer's special tokens are left
    # out of the text unless the request keeps them: the server keeps these for the request)
    markers: tuple[str, ...] = ()


_QWEN3_CODER = ToolFormat("qwen3_coder", tf.read_qwen3_coder, tf.write_qwen3_coder, tf.grammar_qwen3_coder,
                          open=tf.HERMES_OPEN, close=tf.HERMES_CLOSE)
FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", tf.read_hermes, tf.write_hermes, tf.grammar_hermes,
                         open=tf.HERMES_OPEN, close=tf.HERMES_CLOSE),
    "llama3_json": ToolFormat("llama3_json", tf.read_llama3_json, tf.write_llama3_json, tf.grammar_llama3_json,
                              open=tf.PYTHON_TAG, lead=("{",), markers=(tf.PYTHON_TAG,)),
    "mistral": ToolFormat("mistral", tf.read_mistral, tf.write_mistral, tf.grammar_mistral,
                          open=tf.TOOL_CALLS, markers=(tf.TOOL_CALLS, "[ARGS]", "[CALL_ID]")),
    "qwen3_coder": _QWEN3_CODER,
    "qwen3_xml": _QWEN3_CODER,  # vLLM's second name for the same format
    "pythonic": ToolFormat("pythonic", tf.read_pythonic, tf.write_pythonic, tf.grammar_pythonic,
                           lead=("[", tf.PYTHON_START), markers=(tf.PYTHON_START, tf.PYTHON_END)),
}


def get_format(fmt: str | ToolFormat) -> ToolFormat:
    if isinstance(fmt, ToolFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown tool-call format {fmt!r}; one of {', '.join(FORMATS)}") from None


def tool_table(names: Collection[str] | Mapping[str, Any] | None) -> tf.Tools:
    """The functions a call may name: a mapping name -> parameters schema, or names alone (no schema)."""
    if names is None:
        return None
    if isinstance(names, Mapping):
        return dict(names)
    return {n: None for n in names}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _read(fmt: ToolFormat, body: str, tools: tf.Tools) -> list[ToolCall] | None:
    found = fmt.read(body, tools)
    return None if not found else [ToolCall(name, args) for name, args in found]


def _lead_at(fmt: ToolFormat, text: str) -> int:
    """Where a block opened by a lead prefix starts (past leading whitespace), or -1."""
    start = len(text) - len(text.lstrip())
    return start if any(text.startswith(p, start) for p in fmt.lead) else -1


def parse_tool_calls(text: str, names: Collection[str] | Mapping[str, Any] | None = None,
                     fmt: str | ToolFormat = "hermes") -> tuple[str | None, list[ToolCall]]:
    """A whole answer -> (content, calls). names: the request's functions (a mapping to their
    parameters schemas where the format reads values by type); a call of another one is content
    (None: any name)."""
    f, tools = get_format(fmt), tool_table(names)
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    lead = _lead_at(f, text)
    while True:
        if lead >= 0:
            i = start = lead
            lead = -1
        else:
            i = text.find(f.open, pos) if f.open else -1
            if i < 0:
                break
            start = i + len(f.open)  # type: ignore[arg-type]
        pieces.append(text[pos:i])
        j = text.find(f.close, start) if f.close else -1
        stop, pos = (len(text), len(text)) if j < 0 else (j, j + len(f.close))  # type: ignore[arg-type]
        found = _read(f, text[start:stop], tools)
        if found is None:
            pieces.append(text[i:pos])
        else:
            calls += found
    pieces.append(text[pos:])
    return "".join(pieces).strip() or None, calls


class Trimmed:
    """A channel of streamed text whose whole is stripped: leading whitespace is dropped, trailing
    whitespace held until more text follows (and dropped at the end). __call__(text) -> the piece to
    send now ("" when none)."""

    def __init__(self) -> None:
        self.started = False  # whether text was released
        self.held = ""  # whitespace after the last released text

    def __call__(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            if self.started:
                self.held += text
            return ""
        body = self.held + body if self.started else body.lstrip()
        self.started, self.held = True, text[len(text.rstrip()):]
        return body


class ToolCallStream:
    """Parses an answer as it arrives, into what `parse_tool_calls` makes of the whole of it, however
    the answer is cut into pieces. feed(text) and finish() return OpenAI chat deltas: {"content": ...}
    for text outside calls, released as soon as it cannot be the start of a block (stripped as
    Trimmed does); and per call, once its block is whole and the format's rule takes it,
    {"tool_calls": [...]} with its index, id, type and name (arguments "") and then one with its
    arguments. A block is held until its closing marker (or the end) because until then nothing tells
    whether it is calls or content."""

    def __init__(self, names: Collection[str] | Mapping[str, Any] | None = None,
                 fmt: str | ToolFormat = "hermes") -> None:
        self.fmt, self.tools = get_format(fmt), tool_table(names)
        self.calls: list[ToolCall] = []
        self._buf = ""  # before a block: a tail that may start one; in a block: its body so far
        # "start": the answer's start may still turn out a lead; "text": outside blocks; "block": in one
        self._phase = "start" if self.fmt.lead else "text"
        self._opened = ""  # the marker that opened the block ("" for a lead: the body holds it)
        self._scan = 0  # in a block: the first place in _buf where a closing marker may still start
        self._content = Trimmed()

    def _text(self, text: str, out: list[dict[str, Any]]) -> None:
        piece = self._content(text)
        if piece:
            out.append({"content": piece})

    def _block(self, body: str, closed: bool, out: list[dict[str, Any]]) -> None:
        found = _read(self.fmt, body, self.tools)
        if found is None:
            self._text(self._opened + body + ((self.fmt.close or "") if closed else ""), out)
            return
        for call in found:
            self.calls.append(call)
            index = len(self.calls) - 1
            out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._buf += text
        f = self.fmt
        while True:
            if self._phase == "start":
                s = self._buf.lstrip()
                if any(s.startswith(p) for p in f.lead):
                    self._text(self._buf[:len(self._buf) - len(s)], out)
                    self._buf, self._phase, self._opened, self._scan = s, "block", "", 0
                    continue
                if not s or any(p.startswith(s) for p in f.lead):  # may still become a lead
                    return out
                self._phase = "text"
            if self._phase == "text":
                i = self._buf.find(f.open) if f.open else -1
                if i < 0:
                    cut = len(self._buf) - (partial_suffix(self._buf, f.open) if f.open else 0)
                    self._text(self._buf[:cut], out)
                    self._buf = self._buf[cut:]
                    return out
                self._text(self._buf[:i], out)
                self._buf, self._phase, self._opened, self._scan = self._buf[i + len(f.open):], "block", f.open, 0
            if f.close is None:  # the block runs to the answer's end
                return out
            j = self._buf.find(f.close, self._scan)
            if j < 0:  # a closing marker may still start in the last len(close) - 1 characters
                self._scan = max(0, len(self._buf) - len(f.close) + 1)
                return out
            body, self._buf, self._phase = self._buf[:j], self._buf[j + len(f.close):], "text"
            self._block(body, True, out)

    def finish(self) -> list[dict[str, Any]]:
        """The answer ended: a block left open ends here; held text is released."""
        out: list[dict[str, Any]] = []
        if self._phase == "start":  # never became a lead: plain text
            self._phase = "text"
            out += self.feed("")
        if self._phase == "block":
            self._block(self._buf, False, out)
        else:
            self._text(self._buf, out)
        self._buf, self._phase = "", "text"
        return out


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
