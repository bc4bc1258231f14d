"""Tool calling in the hermes format (SmolLM2, Qwen 2.5 and their kin): a call is
<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call> in the model's text.

- `check_tools` / `check_tool_choice`: OpenAI's `tools` and `tool_choice`, validated (ValueError
  naming the field).
- `tool_grammar`: for tool_choice "required" or a named function, the structural tag (xgrammar) that
  makes the output exactly one or more such calls, each call's arguments under its function's
  parameter schema.
- `tools_prompt`: the system text that describes the tools to a model whose chat template takes none.
- `parse_tool_calls` (a whole answer) and `ToolCallStream` (an answer arriving in pieces) turn the
  text into content and calls; the stream's argument fragments join into the whole answer's
  arguments, so streamed and non-streamed calls are equal.
Torch-free.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from augury.structured.backend import bounded_strings, clean_error

PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of functions")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools.{i} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"tools.{i}.function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise ValueError(f"tools.{i}.function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools.{i}.function.parameters must be a JSON schema (an object)")
    return tools


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    """'none', 'auto', 'required', or the named function's tool dict. Without tools: 'none'."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or (isinstance(choice, dict) and choice.get("type", "function") != "function"):
        raise ValueError('tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    for t in tools or []:
        if t["function"]["name"] == name:
            return t
    raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")


def tool_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool = True) -> str:
    """xgrammar structural tag (JSON text) for tool_choice 'required' (one call or more, of any tool;
    one only when not parallel) or a named function (exactly one call of it)."""
    import xgrammar as xgr

    chosen = [choice] if isinstance(choice, dict) else tools
    tags = []
    for t in chosen:
        fn = t["function"]
        schema = fn.get("parameters") or {"type": "object"}
        if fn.get("strict") is False:
            schema = {"type": "object"}
        # the arguments as compact JSON (as response_format's default): a structural tag's own JSON
        # schema format lets whitespace in between every token, which small models loop on
        try:
            ebnf = str(xgr.Grammar.from_json_schema(json.dumps(bounded_strings(schema)), any_whitespace=False,
                                                    strict_mode=fn.get("strict") is not False))
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"the parameters of function {fn['name']!r} are not a JSON schema xgrammar takes: "
                             f"{clean_error(e)}") from None
        tags.append({"type": "tag", "begin": f'{OPEN}\n{{"name": {json.dumps(fn["name"])}, "arguments": ',
                     "content": {"type": "grammar", "grammar": ebnf}, "end": f"}}\n{CLOSE}"})
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": isinstance(choice, dict) or not parallel}
    return json.dumps({"type": "structural_tag", "format": fmt})


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """A system message describing the tools in the hermes format (for chat templates without tools)."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{sigs}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}")


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (for assistant turns sent back through a template without tools)."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------------ parsing

def _split_call(body: str) -> tuple[str, str] | None:
    """A whole call's body (between the tags) -> (name, arguments JSON text), or None if it is not one."""
    m = _HEADER.match(body)
    if m is None:
        return None
    rest = body[m.end():].rstrip()
    if not rest.endswith("}"):
        return None
    args = rest[:-1].rstrip()
    try:
        name = json.loads(f'"{m.group(1)}"')
        if not isinstance(json.loads(args), dict):
            return None
    except ValueError:
        return None
    return name, args


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer -> (content: the text outside the calls, stripped, None when empty; calls). A
    block that does not parse as a call stays in the content."""
    stream = ToolCallStream()
    stream.feed(text)
    stream.finish()
    return stream.content_text(), stream.calls


class ToolCallStream:
    """Parses an answer as it arrives. feed(text) and finish() return OpenAI chat deltas: {"content":
    ...} for text outside calls (leading whitespace dropped, trailing whitespace held until more text
    follows, dropped at the end), and {"tool_calls": [...]} per call: first its index, id, type and
    name with arguments "", then argument fragments as they come (a fragment is released once no
    later text can show it belongs to the closing of the call rather than to its arguments)."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet released (outside calls) or the current call's body so far
        self._in_call = False
        self._header: tuple[str, int] | None = None  # the current call's name and where its arguments start
        self._sent_args = 0  # argument characters of the current call already released
        self._content: list[str] = []  # released content pieces
        self._held_ws = ""  # whitespace after the last released content

    def content_text(self) -> str | None:
        text = "".join(self._content)
        return text or None

    # ---------------------------------------------------------------------------- content
    def _release(self, text: str, out: list[dict[str, Any]]) -> None:
        if not text:
            return
        body = text.rstrip()
        ws_tail = text[len(body):]
        if not body:
            if self._content:
                self._held_ws += text
            return
        if not self._content:
            body = body.lstrip()
        else:
            body = self._held_ws + body
        self._held_ws = ws_tail
        self._content.append(body)
        out.append({"content": body})

    # ---------------------------------------------------------------------------- calls
    def _call_progress(self, body: str, out: list[dict[str, Any]]) -> None:
        """Release the current call's header and the argument text that is surely its own (body: the
        call's text so far)."""
        if self._header is None:
            m = _HEADER.match(body)
            if m is None or m.end() == len(body):  # more whitespace may still come before the arguments
                return
            call = ToolCall(json.loads(f'"{m.group(1)}"'), "")
            self.calls.append(call)
            self._header = (call.name, m.end())
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
        args = body[self._header[1]:]
        close = args.rfind("}")
        safe = args[:close].rstrip() if close >= 0 else args.rstrip()
        self._emit_args(safe, out)

    def _emit_args(self, upto: str, out: list[dict[str, Any]]) -> None:
        if len(upto) > self._sent_args:
            piece = upto[self._sent_args:]
            self._sent_args = len(upto)
            self.calls[-1].arguments += piece
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})

    def _end_call(self, body: str, out: list[dict[str, Any]], closed: bool = True) -> None:
        """The current call's whole body is known (closed: its closing tag was seen)."""
        whole = _split_call(body)
        if self._header is None and whole is None:  # not a call: it was text
            self._in_call = False
            self._release(OPEN + body + (CLOSE if closed else ""), out)
            return
        if self._header is None:
            self._call_progress(body, out)
        if whole is not None:
            self._emit_args(whole[1], out)
        self._in_call, self._header, self._sent_args = False, None, 0

    # ---------------------------------------------------------------------------- feeding
    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._buf += text
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    self._release(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._release(self._buf[:i], out)
                self._buf = self._buf[i + len(OPEN):]
                self._in_call = True
            j = self._buf.find(CLOSE)
            if j < 0:
                self._call_progress(self._buf, out)
                return out
            body, self._buf = self._buf[:j], self._buf[j + len(CLOSE):]
            self._end_call(body, out)

    def finish(self) -> list[dict[str, Any]]:
        """The answer ended: a call left open ends here; held text is released."""
        out: list[dict[str, Any]] = []
        if self._in_call:
            self._end_call(self._buf, out, closed=False)
        else:
            self._release(self._buf, out)
        self._buf = ""
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
