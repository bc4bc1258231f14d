"""Tool calling in the hermes format (SmolLM2, Qwen 2.5 and their kin): a call is
<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call> in the model's text.

- `check_tools` / `check_tool_choice`: OpenAI's `tools` and `tool_choice`, validated (ValueError
  naming the field).
- `tool_grammar`: for tool_choice "required" or a named function, the structural tag (xgrammar) that
  makes the output exactly one or more such calls, each call's arguments under its function's
  parameter schema.
- `tools_prompt`: the system text that describes the tools to a model whose chat template takes none.
- `parse_tool_calls` (a whole answer) and `ToolCallStream` (an answer arriving in pieces) turn the
  text into content and calls by one rule per block (`_parse_block`): the stream holds a block back
  until it is whole, so for every answer and every way of cutting it the stream's deltas join into
  the whole answer's content and calls.
Torch-free.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from collections.abc import Collection
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
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
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
# An answer is text and blocks: a block runs from an opening tag to the first closing tag after it, or
# to the end of the answer when none follows. A block is a call when `_parse_block` says so; any other
# block is content, tags and all. Content is the text outside calls, stripped, None when empty. Both
# paths below split by these rules and read each block with `_parse_block` alone.

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
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the decoder goes
        return None
    return name, args


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _parse_block(body: str, names: frozenset[str] | None) -> ToolCall | None:
    """The one rule for a block's body: a call of a function in `names` (any name when None) whose
    arguments are a JSON object, else None (the block is content)."""
    split = _split_call(body)
    if split is None or (names is not None and split[0] not in names):
        return None
    return ToolCall(*split)


def parse_tool_calls(text: str, names: Collection[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """A whole answer -> (content, calls). names: the request's functions; a block calling another
    one is content (None: any name)."""
    known = None if names is None else frozenset(names)
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (i := text.find(OPEN, pos)) >= 0:
        pieces.append(text[pos:i])
        start = i + len(OPEN)
        j = text.find(CLOSE, start)
        stop, pos = (len(text), len(text)) if j < 0 else (j, j + len(CLOSE))
        call = _parse_block(text[start:stop], known)
        if call is None:
            pieces.append(text[i:pos])
        else:
            calls.append(call)
    pieces.append(text[pos:])
    return "".join(pieces).strip() or None, calls


class ToolCallStream:
    """Parses an answer as it arrives, into what `parse_tool_calls` makes of the whole of it, however
    the answer is cut into pieces. feed(text) and finish() return OpenAI chat deltas: {"content": ...}
    for text outside calls, released as soon as it cannot be the start of a block (leading whitespace
    dropped, trailing whitespace held until more content follows, dropped at the end); and per call,
    once its block is whole and `_parse_block` takes it, {"tool_calls": [...]} with its index, id, type
    and name (arguments "") and then one with its arguments. A block is held until its closing tag (or
    the end) because until then nothing tells whether it is a call or content."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = None if names is None else frozenset(names)
        self.calls: list[ToolCall] = []
        # outside a block: a tail that may be the start of an opening tag; in one: its body so far
        self._buf = ""
        self._in_block = False
        self._scan = 0  # in a block: the first place in _buf where a closing tag may still start
        self._started = False  # whether content was released (leading whitespace is dropped until then)
        self._held_ws = ""  # whitespace after the last released content

    def _content(self, text: str, out: list[dict[str, Any]]) -> None:
        body = text.rstrip()
        if not body:
            if self._started:
                self._held_ws += text
            return
        body = self._held_ws + body if self._started else body.lstrip()
        self._started, self._held_ws = True, text[len(text.rstrip()):]
        out.append({"content": body})

    def _block(self, body: str, closed: bool, out: list[dict[str, Any]]) -> None:
        call = _parse_block(body, self.names)
        if call is None:
            self._content(OPEN + body + (CLOSE if closed else ""), out)
            return
        self.calls.append(call)
        index = len(self.calls) - 1
        out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._buf += text
        while True:
            if not self._in_block:
                i = self._buf.find(OPEN)
                if i < 0:
                    cut = len(self._buf) - _partial_suffix(self._buf, OPEN)
                    self._content(self._buf[:cut], out)
                    self._buf = self._buf[cut:]
                    return out
                self._content(self._buf[:i], out)
                self._buf, self._in_block, self._scan = self._buf[i + len(OPEN):], True, 0
            j = self._buf.find(CLOSE, self._scan)
            if j < 0:  # a closing tag may still start in the last len(CLOSE) - 1 characters
                self._scan = max(0, len(self._buf) - len(CLOSE) + 1)
                return out
            body, self._buf, self._in_block = self._buf[:j], self._buf[j + len(CLOSE):], False
            self._block(body, True, out)

    def finish(self) -> list[dict[str, Any]]:
        """The answer ended: a block left open ends here; held text is released."""
        out: list[dict[str, Any]] = []
        if self._in_block:
            self._block(self._buf, False, out)
        else:
            self._content(self._buf, out)
        self._buf, self._in_block = "", False
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
