"""What one request may ask of a server: the bounds every request is held to before admission.

Each bound is a field of RequestLimits and a flag of `augury serve` (`--limit-<field>`, from LIMITS,
the one table), with a default that suits a public server: large enough for every ordinary client
(OpenAI's own limits where it has one), small enough that no single request does unbounded work on
the engine thread, which every other request waits for. The checks raise ValueError whose message
opens with the request's field (the server's 400 names it as the parameter) and says the limit.
Torch-free plain data, as config.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from augury.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class Limit:
    name: str  # the RequestLimits field; the flag is --limit-<name with dashes>
    help: str
    type: type = int


LIMITS: tuple[Limit, ...] = (
    Limit("max_tokens", "most tokens one choice may generate (0: as many as the context leaves)"),
    Limit("n", "most choices one request may ask for (n)"),
    Limit("stop", "most stop strings a request may give"),
    Limit("stop_length", "most characters in each stop string and each bad word"),
    Limit("stop_token_ids", "most stop_token_ids a request may give"),
    Limit("bad_words", "most bad_words a request may give"),
    Limit("logit_bias", "most logit_bias entries a request may give (OpenAI's limit: 300)"),
    Limit("tools", "most tools a chat request may give (OpenAI's limit: 128)"),
    Limit("tools_bytes", "most bytes of the tools' definitions, as JSON, in one request"),
    Limit("schema_bytes", "most bytes of a structured-output constraint (a JSON schema as JSON, a grammar, "
                          "a structural tag, the choices together)"),
    Limit("schema_depth", "deepest nesting of objects and arrays in a JSON schema"),
    Limit("regex_length", "most characters in a structured-output regex"),
    Limit("choices", "most strings in a structured-output choice"),
    Limit("compile_seconds", "longest a request's grammar may take to compile; longer is a 400", float),
)


@dataclass(frozen=True)
class RequestLimits:
    max_tokens: int = 0
    n: int = 16
    stop: int = 16
    stop_length: int = 256
    stop_token_ids: int = 256
    bad_words: int = 256
    logit_bias: int = 300
    tools: int = 128
    tools_bytes: int = 2**20
    schema_bytes: int = 2**18
    schema_depth: int = 32
    regex_length: int = 4096
    choices: int = 256
    compile_seconds: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (v == 0 and f.name != "max_tokens"):
                flag = "--limit-" + f.name.replace("_", "-")
                raise ValueError(f"{flag} must be a positive number, got {v!r}")

    # ---------------------------------------------------------------- checks
    def check_n(self, n: int) -> None:
        _at_most("n", n, self.n, "choices")

    def check_tools(self, tools: list[Any] | None) -> None:
        if not tools:
            return
        _at_most("tools", len(tools), self.tools, "tools")
        _at_most("tools", _depth(tools) - 3, self.schema_depth, "levels of nesting in a tool's parameters")
        _at_most("tools", _json_size(tools), self.tools_bytes, "bytes of definitions (as JSON)")

    def check_sampling(self, p: SamplingParams) -> None:
        """The sizes of what a SamplingParams carries (its values are valid already); its structured
        output is check_structured's, with the request field it came from."""
        if self.max_tokens:
            _at_most("max_tokens", p.max_tokens, self.max_tokens, "tokens")
        _at_most("stop", len(p.stop), self.stop, "stop strings")
        for s in p.stop:
            _at_most("stop", len(s), self.stop_length, "characters in a stop string")
        _at_most("stop_token_ids", len(p.stop_token_ids), self.stop_token_ids, "token ids")
        words = p.bad_words or []
        _at_most("bad_words", len(words), self.bad_words, "words")
        for w in words:
            _at_most("bad_words", len(w), self.stop_length, "characters in a word")
        _at_most("logit_bias", len(p.logit_bias or {}), self.logit_bias, "entries")

    def check_structured(self, so: StructuredOutputsParams, param: str) -> None:
        """A constraint's size and shape; `param` is the request field it came from."""
        kind = so.kind
        if kind == "json" and isinstance(so.json, dict):
            _at_most(param, _depth(so.json), self.schema_depth, "levels of nesting in the JSON schema")
            _at_most(param, _json_size(so.json), self.schema_bytes, "bytes of JSON schema")
        elif kind == "regex":
            _at_most(param, len(so.regex), self.regex_length, "characters of regex")
        elif kind == "choice":
            _at_most(param, len(so.choice), self.choices, "choices")
            _at_most(param, sum(len(c.encode()) for c in so.choice), self.schema_bytes, "bytes of choices")
        elif kind in ("grammar", "structural_tag"):
            _at_most(param, len(getattr(so, kind).encode()), self.schema_bytes, f"bytes of {kind}")


def _at_most(field: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        raise ValueError(f"{field}: at most {limit} {what} are allowed on this server, got {value}")


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _depth(value: Any) -> int:
    """Nesting of dicts and lists (a scalar is 0), iteratively: a deep schema cannot overflow the stack."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        todo.extend((x, d + 1) for x in items)
    return deepest


# ------------------------------------------------------------------ flags (augury serve)

def add_limit_flags(parser) -> None:
    """--limit-<name> for every field of RequestLimits (argparse), default None: the field's default."""
    defaults = RequestLimits()
    group = parser.add_argument_group("request limits", "what one request may ask (a 400 naming the field beyond)")
    for lim in LIMITS:
        group.add_argument("--limit-" + lim.name.replace("_", "-"), dest="limit_" + lim.name, type=lim.type,
                           default=None, metavar="N" if lim.type is int else "SECONDS",
                           help=f"{lim.help} (default {getattr(defaults, lim.name)})")


def limits_from_args(args) -> RequestLimits:
    """The RequestLimits the flags give (ValueError naming the flag for a bad value)."""
    given = {lim.name: getattr(args, "limit_" + lim.name) for lim in LIMITS
             if getattr(args, "limit_" + lim.name, None) is not None}
    return RequestLimits(**given)
