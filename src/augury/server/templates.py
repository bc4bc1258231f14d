"""The chat template: the one --chat-template names (a file or the template itself) or the tokenizer's,
and what it does with tools, found by rendering it (not by reading its source):

- whether it renders a request's `tools` (it describes them to the model), by rendering a probe tool;
- whether it renders an assistant turn's `tool_calls` (and tool turns), and in which tool-call
  format (tool_parsers.FORMATS), by rendering a probe conversation with a probe call and reading
  the text the template wrote for the call: <function=...> is qwen3_coder, [TOOL_CALLS] mistral,
  <tool_call> hermes, <|python_tag|> or a {"name": ...} object llama3_json, name(...) pythonic.

`--tool-call-parser auto` (the default) reads calls in that format, hermes when the template shows
none. A template that renders no tools has them described in the system message, and one that
renders no calls gets them back as text in the format (serving.py).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("augury.server")

_NAME, _ARG, _VALUE = "augury_probe_fn", "augury_probe_arg", "augury_probe_value"
_USER, _RESULT = "augury_probe_user", "augury_probe_result"
_TOOL = {"type": "function", "function": {"name": _NAME, "description": "a probe",
                                          "parameters": {"type": "object", "properties": {_ARG: {"type": "string"}}}}}
_CALL_ID = "a1b2c3d4e"  # nine letters and digits: Mistral's templates refuse other ids


@dataclass(frozen=True)
class TemplateInfo:
    renders_tools: bool = False  # a request's tools reach the template
    renders_calls: bool = False  # an assistant turn's tool_calls (and tool turns) are rendered by it
    tool_format: str | None = None  # the format its calls are written in; None: it shows none


def load_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself (Jinja; it must parse). ValueError."""
    path = Path(value).expanduser()
    text = None
    try:
        if path.is_file():
            text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template: cannot read {value}: {e}") from None
    if text is None:
        if "{{" not in value and "{%" not in value:
            raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
        text = value
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the template does not parse (line {e.lineno}): {e.message}") from None
    if not text.strip():
        raise ValueError("--chat-template: the template is empty")
    return text


def _render(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
    try:
        kw = {"tools": tools} if tools else {}
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    except Exception as e:  # a template may raise on anything; the probe then learns nothing
        log.debug("chat template probe: %s", e)
        return None


def call_format(text: str) -> str | None:
    """The tool-call format of a call's rendering (the text a template wrote for one call)."""
    if f"<function={_NAME}>" in text:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or re.search(r'\{\s*"name"\s*:\s*"' + _NAME, text):
        return "llama3_json"
    if re.search(_NAME + r"\s*\(", text):
        return "pythonic"
    return None


def inspect_template(tok: Any) -> TemplateInfo:
    """What the tokenizer's chat template does with tools (see the module's docstring)."""
    if tok is None or not getattr(tok, "chat_template", None):
        return TemplateInfo()
    user = [{"role": "user", "content": _USER}]
    with_tools = _render(tok, user, [_TOOL])
    renders_tools = with_tools is not None and _NAME in with_tools
    call = {"id": _CALL_ID, "type": "function", "function": {"name": _NAME, "arguments": {_ARG: _VALUE}}}
    conversation = [*user, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": _CALL_ID, "name": _NAME, "content": _RESULT}]
    text = None
    for tools in (None, [_TOOL]):  # some templates render calls only beside their tools
        text = _render(tok, conversation, tools)
        if text is not None and _VALUE in text:
            break
    if text is None or _VALUE not in text:
        return TemplateInfo(renders_tools=renders_tools)
    # the call's own text: after the user's turn, before the tool's answer (or the end)
    begin = text.rfind(_USER) + len(_USER)
    end = text.find(_RESULT, begin)
    region = text[begin:end if end >= 0 else len(text)]
    return TemplateInfo(renders_tools=renders_tools, renders_calls=True, tool_format=call_format(region))


def describe(info: TemplateInfo) -> dict[str, Any]:
    return {"renders_tools": info.renders_tools, "renders_calls": info.renders_calls,
            "tool_format": info.tool_format}

