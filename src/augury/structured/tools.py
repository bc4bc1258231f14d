"""Tool calling: OpenAI's `tools` and `tool_choice`, checked, and what the server builds from them in the
request's tool-call format (tool_parsers.FORMATS: hermes, llama3_json, mistral, qwen3_coder, pythonic).

- `check_tools` / `check_tool_choice`: OpenAI's `tools` and `tool_choice`, validated (ValueError
  naming the field).
- `tool_grammar`: for tool_choice "required" or a named function, the structural tag (xgrammar) that
  makes the output exactly one or more calls in the format, each call's arguments under its
  function's parameter schema.
- `tools_prompt`: the system text that describes the tools to a model whose chat template takes none;
  `call_text`: a call as the model writes it (assistant turns sent back through such a template).
- `parse_tool_calls` / `ToolCallStream` (tool_parsers.py): the text into content and calls, whole or
  streamed, by one rule per format.
Torch-free.
"""
from __future__ import annotations

import json
import re
from typing import Any

from augury.structured.backend import bounded_strings, clean_error
from augury.structured.tool_formats import HERMES_CLOSE as CLOSE, HERMES_OPEN as OPEN
from augury.structured.tool_parsers import (FORMATS, ToolCall, ToolCallStream, ToolFormat, get_format, new_call_id,
                                            parse_tool_calls)

__all__ = ["CLOSE", "OPEN", "PARSERS", "ToolCall", "ToolCallStream", "call_text", "check_tool_choice", "check_tools",
           "new_call_id", "parse_tool_calls", "tool_grammar", "tools_prompt"]

PARSERS = tuple(FORMATS)


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


def _arguments(fn: dict[str, Any], style: str = "json") -> dict[str, Any]:
    """The structural-tag format of one function's arguments under its parameters schema."""
    import xgrammar as xgr

    schema = fn.get("parameters") or {"type": "object"}
    if fn.get("strict") is False:
        schema = {"type": "object"}
    if style != "json":  # at most one blank character in a row between the parts, as compact JSON
        return {"type": "json_schema", "json_schema": bounded_strings(schema), "style": style, "max_whitespace_cnt": 1}
    # the arguments as compact JSON (as response_format's default): a structural tag's own JSON
    # schema format lets whitespace in between every token, which small models loop on
    try:
        ebnf = str(xgr.Grammar.from_json_schema(json.dumps(bounded_strings(schema)), any_whitespace=False,
                                                strict_mode=fn.get("strict") is not False))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"the parameters of function {fn['name']!r} are not a JSON schema xgrammar takes: "
                         f"{clean_error(e)}") from None
    return {"type": "grammar", "grammar": ebnf}


def tool_format(tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool = True,
                fmt: str | ToolFormat = "hermes") -> dict[str, Any]:
    """The structural-tag format (xgrammar) for tool_choice 'required' (one call or more, of any tool;
    one only when not parallel) or a named function (exactly one call of it), in the format `fmt`."""
    chosen = [choice] if isinstance(choice, dict) else tools
    fns = [t["function"] for t in chosen]
    return get_format(fmt).grammar(fns, _arguments, isinstance(choice, dict) or not parallel)


def tool_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool = True,
                 fmt: str | ToolFormat = "hermes") -> str:
    """tool_format as a structural tag's JSON text (StructuredOutputsParams.structural_tag)."""
    return json.dumps({"type": "structural_tag", "format": tool_format(tools, choice, parallel, fmt)})


def tools_prompt(tools: list[dict[str, Any]], fmt: str | ToolFormat = "hermes") -> str:
    """A system message describing the tools, and how to call them in the format `fmt` (for chat
    templates that take no tools)."""
    f = get_format(fmt)
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    intro = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
             f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{sigs}\n</tools>\n\n")
    if f.name == "hermes":
        return intro + ("For each function call, return a json object with function name and arguments within "
                        f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}")
    example = f.write("function_name", '{"argument_name": "value"}')
    return intro + f"To call a function, answer with the call alone, written like this:\n{example}"


def call_text(name: str, arguments: str, fmt: str | ToolFormat = "hermes") -> str:
    """One call as the model writes it (for assistant turns sent back through a template without tools)."""
    return get_format(fmt).write(name, arguments)
