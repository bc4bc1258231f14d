"""How each model family writes tool calls in its text: per format, the one rule that reads a block's
body (`read_*`), how a call is written (`write_*`, for assistant turns sent back through a template
that does not render calls), and the structural tag (xgrammar) that makes the output one or more
calls in that format (`grammar_*`, for tool_choice "required" or a named function).

- hermes (SmolLM2, Qwen 2.5, Qwen3, Hermes): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
- llama3_json (Llama 3.1 / 3.2 / 3.3): an optional <|python_tag|>, then {"name": ..., "parameters": {...}}
  objects separated by ';', as the whole answer
- mistral: [TOOL_CALLS] then a JSON array of {"name", "arguments"} (tokenizers before v11), or
  [TOOL_CALLS]name[ARGS]{...} per call (v11 and later)
- qwen3_coder (Qwen3-Coder, Qwen3.5): <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>; a value is text, read as JSON where its parameter's schema says it is not
  a string
- pythonic (Llama 3.2 / 4): [f(a=1, b="x"), g()] as the whole answer, read with Python's ast (literals only)

A rule returns [(name, arguments as JSON text)], or None when the body is not a well-formed call of
the request's tools (the block is then content). `tools` maps each function the request offers to
its parameters schema (None: any name, no schema). Torch-free.
"""
from __future__ import annotations

import ast
import json
import keyword
import math
import re
import warnings
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

Tools = Mapping[str, Any] | None  # function name -> its parameters schema (or None); None: any name
Calls = list[tuple[str, str]] | None
Format = dict[str, Any]  # an xgrammar structural tag format (JSON-able)
# (a function's dict, style="json") -> the format of its arguments: "json" (compact JSON under its parameters
# schema) or "qwen_xml" (xgrammar's <parameter=key>value</parameter> style)
ArgsFormat = Callable[..., Format]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


def _no_constant(name: str) -> Any:  # NaN and Infinity are Python's, not JSON's
    raise ValueError(f"{name} is not JSON")


# numbers as Decimal: arguments written again (dumps) keep the value the model wrote, however large
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=Decimal)


def loads(text: str) -> Any:
    """JSON text -> value (NaN / Infinity refused). ValueError or RecursionError when it is not JSON."""
    value, end = _DECODER.raw_decode(text, _skip_ws(text, 0))
    if _skip_ws(text, end) != len(text):
        raise ValueError("extra data after the JSON value")
    return value


def dumps(value: Any) -> str:
    """A decoded value as JSON text (a Decimal as its digits). ValueError for what JSON cannot hold."""
    try:
        return _dump(value)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _dump(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_dump(v) for v in value) + "]"
    if isinstance(value, Decimal):
        return str(value)
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _known(name: Any, tools: Tools) -> bool:
    return isinstance(name, str) and bool(name) and (tools is None or name in tools)


def _object_call(obj: Any, keys: tuple[str, ...], tools: Tools) -> tuple[str, str] | None:
    """{"name": NAME, <one of keys>: {...}} (the arguments may be left out: none) -> (name, arguments)."""
    if not isinstance(obj, dict) or not _known(obj.get("name"), tools):
        return None
    given = [k for k in keys if k in obj]
    if len(given) > 1 or set(obj) - {"name", "type", *keys} or obj.get("type", "function") != "function":
        return None
    args = obj[given[0]] if given else {}
    return (obj["name"], dumps(args)) if isinstance(args, dict) else None


# ------------------------------------------------------------------------------------ hermes

_HERMES_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def read_hermes(body: str, tools: Tools) -> Calls:
    """{"name": NAME, "arguments": {...}} between the tags; the arguments kept as the model wrote them."""
    m = _HERMES_HEADER.match(body)
    if m is None:
        return None
    rest = body[m.end():].rstrip()
    if not rest.endswith("}"):
        return None
    args = rest[:-1].rstrip()
    try:
        name = json.loads(f'"{m.group(1)}"')
        if not isinstance(loads(args), dict):
            return None
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the decoder goes
        return None
    return [(name, args)] if _known(name, tools) else None


def write_hermes(name: str, arguments: str) -> str:
    return f'{HERMES_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{HERMES_CLOSE}'


def grammar_hermes(fns: list[dict[str, Any]], args: ArgsFormat, single: bool) -> Format:
    tags = [{"type": "tag", "begin": f'{HERMES_OPEN}\n{{"name": {json.dumps(fn["name"])}, "arguments": ',
             "content": args(fn), "end": f"}}\n{HERMES_CLOSE}"} for fn in fns]
    return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
            "stop_after_first": single}


# ------------------------------------------------------------------------------------ llama3_json

def read_llama3_json(body: str, tools: Tools) -> Calls:
    """JSON objects {"name", "parameters"} separated by ';' (a last ';' allowed), nothing else."""
    calls = []
    pos = _skip_ws(body, 0)
    try:
        while pos < len(body):
            obj, pos = _DECODER.raw_decode(body, pos)
            call = _object_call(obj, ("parameters", "arguments"), tools)
            if call is None:
                return None
            calls.append(call)
            pos = _skip_ws(body, pos)
            if pos < len(body):
                if body[pos] != ";":
                    return None
                pos = _skip_ws(body, pos + 1)
    except (ValueError, RecursionError):
        return None
    return calls or None


def write_llama3_json(name: str, arguments: str) -> str:
    return f'{{"name": {json.dumps(name)}, "parameters": {arguments}}}'


def grammar_llama3_json(fns: list[dict[str, Any]], args: ArgsFormat, single: bool) -> Format:
    # no <|python_tag|>: a special token, which a grammar over text does not produce (the rule reads
    # an answer that opens with '{' as calls just the same)
    tags = [{"type": "tag", "begin": f'{{"name": {json.dumps(fn["name"])}, "parameters": ', "content": args(fn),
             "end": "}"} for fn in fns]
    return {"type": "tags_with_separator", "tags": tags, "separator": "; ", "at_least_one": True,
            "stop_after_first": single}


# ------------------------------------------------------------------------------------ mistral

_MISTRAL_CALL = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]{1,64})?\[ARGS\]")


def read_mistral(body: str, tools: Tools) -> Calls:
    """After [TOOL_CALLS]: a JSON array of {"name", "arguments"}; or name[ARGS]{...}, further calls each
    after a [TOOL_CALLS] of their own (the block runs to the answer's end, so they are in the body)."""
    body = body.rstrip()
    # the end-of-sequence token's text: in the text when the request keeps special tokens, as the
    # server makes it do where [TOOL_CALLS] is one
    body = body[:-len("</s>")] if body.endswith("</s>") else body
    try:
        start = _skip_ws(body, 0)
        if body.startswith("[", start):
            items = loads(body)
            if not isinstance(items, list) or not items:
                return None
            calls = [_object_call(x, ("arguments", "parameters"), tools) for x in items]
            return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
        calls = []
        for part in body.split(TOOL_CALLS):
            m = _MISTRAL_CALL.match(part)
            if m is None or not _known(m.group(1), tools):
                return None
            args = loads(part[m.end():])
            if not isinstance(args, dict):
                return None
            calls.append((m.group(1), dumps(args)))
        return calls
    except (ValueError, RecursionError):
        return None


def write_mistral(name: str, arguments: str) -> str:
    return f'{TOOL_CALLS}[{{"name": {json.dumps(name)}, "arguments": {arguments}}}]'


def grammar_mistral(fns: list[dict[str, Any]], args: ArgsFormat, single: bool) -> Format:
    # the array form: [TOOL_CALLS] spelled as text (the special token is not a grammar's to produce)
    tags = [{"type": "tag", "begin": f'{{"name": {json.dumps(fn["name"])}, "arguments": ', "content": args(fn),
             "end": "}"} for fn in fns]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
             "stop_after_first": single}
    return {"type": "tag", "begin": f"{TOOL_CALLS}[", "content": calls, "end": "]"}


# ------------------------------------------------------------------------------------ qwen3_coder

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema says: text for strings and for parameters without a schema, less
    one newline or space either side (layout: the template writes each value on lines of its own, a
    grammar's qwen_xml style puts at most one blank character there); for any other schema (numbers,
    booleans, objects, enums, ...) the text without surrounding whitespace, read as JSON where it is."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or kind == "string" or (isinstance(kind, list) and "string" in kind):
        value = value[1:] if value[:1] in ("\n", " ") else value
        return value[:-1] if value[-1:] in ("\n", " ") else value
    try:
        return loads(value)
    except (ValueError, RecursionError):
        return value.strip()


def read_qwen3_coder(body: str, tools: Tools) -> Calls:
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    if not _known(name, tools):
        return None
    schema = tools.get(name) if tools is not None else None
    props = schema.get("properties") if isinstance(schema, dict) else None
    props = props if isinstance(props, dict) else {}
    args: dict[str, Any] = {}
    pos = 0
    while (p := _PARAMETER.match(inner, pos)) is not None:
        key, value = p.group(1).strip(), p.group(2)
        if key in args:
            return None
        args[key] = _typed(value, props.get(key))
        pos = p.end()
    if inner[pos:].strip():
        return None
    try:
        return [(name, dumps(args))]
    except ValueError:
        return None


def write_qwen3_coder(name: str, arguments: str) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else dumps(v)}\n</parameter>\n"
                     for k, v in json.loads(arguments).items())
    return f"{HERMES_OPEN}\n<function={name}>\n{params}</function>\n{HERMES_CLOSE}"


def grammar_qwen3_coder(fns: list[dict[str, Any]], args: ArgsFormat, single: bool) -> Format:
    # xgrammar's qwen_xml style: <parameter=key>value</parameter> per property, under the schema
    tags = [{"type": "tag", "begin": f"{HERMES_OPEN}\n<function={fn['name']}>\n", "content": args(fn, "qwen_xml"),
             "end": f"\n</function>\n{HERMES_CLOSE}"} for fn in fns]
    return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
            "stop_after_first": single}


# ------------------------------------------------------------------------------------ pythonic

class _NotLiteral(Exception):
    pass


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """A literal's JSON value: strings, finite numbers, True / False / None (and JSON's true / false /
    null, which models used to JSON write too), lists, tuples and dicts with string keys."""
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (str, bool, int)) or (isinstance(v, float) and math.isfinite(v)):
            return v
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _literal(node.operand)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(x) for x in node.elts]
    elif isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = None if k is None else _literal(k)  # None: a **spread inside the dict
            if not isinstance(key, str) or key in out:
                raise _NotLiteral
            out[key] = _literal(v)
        return out
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotLiteral


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _spread(text: str, node: ast.expr) -> Any:
    """**{...}: read as JSON when it is JSON (what grammar_pythonic writes: JSON's escapes and numbers
    are not quite Python's), else as Python literals."""
    source = ast.get_source_segment(text, node)
    try:
        return loads(source) if source is not None else _literal(node)
    except (ValueError, RecursionError):
        return _literal(node)


def read_pythonic(body: str, tools: Tools) -> Calls:
    """A Python list of calls with keyword arguments (and **{...}) whose values are literals."""
    text = body.strip()
    text = text[len(PYTHON_START):] if text.startswith(PYTHON_START) else text
    text = text[:-len(PYTHON_END)] if text.endswith(PYTHON_END) else text
    try:
        with warnings.catch_warnings():  # invalid escapes ('\\/' in JSON text) warn; a model's text is no code of ours
            warnings.simplefilter("ignore")
            tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            name = _dotted(node.func) if isinstance(node, ast.Call) else None
            if name is None or node.args or not _known(name, tools):  # type: ignore[union-attr]
                return None
            args: dict[str, Any] = {}
            for kw in node.keywords:  # type: ignore[union-attr]
                value = _spread(text, kw.value) if kw.arg is None else _literal(kw.value)
                if kw.arg is None and not isinstance(value, dict):
                    return None
                for k, v in (value.items() if kw.arg is None else [(kw.arg, value)]):
                    if k in args:
                        return None
                    args[k] = v
            calls.append((name, dumps(args)))
        return calls
    except (_NotLiteral, SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def write_pythonic(name: str, arguments: str) -> str:
    return f"[{name}(**{arguments})]"


def python_name(name: str) -> bool:
    """Whether `name` can be called in Python (dotted identifiers, no keyword)."""
    return all(p.isidentifier() and not keyword.iskeyword(p) for p in name.split("."))


def grammar_pythonic(fns: list[dict[str, Any]], args: ArgsFormat, single: bool) -> Format:
    # name(**{...}): the arguments as one JSON object under the schema, a Python dict literal as well
    # (the rule reads JSON's true / false / null)
    bad = [fn["name"] for fn in fns if not python_name(fn["name"])]
    if bad:
        raise ValueError(f"the function name {bad[0]!r} cannot be written as a Python call (pythonic tool calls)")
    tags = [{"type": "tag", "begin": f"{fn['name']}(**", "content": args(fn), "end": ")"} for fn in fns]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
             "stop_after_first": single}
    return {"type": "tag", "begin": "[", "content": calls, "end": "]"}
