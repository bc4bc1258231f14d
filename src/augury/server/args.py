"""`augury serve` flags -> validated settings. Imports no torch: bad flags fail in milliseconds.

The engine flags are config.OPTIONS' (the one table every command derives its flags from);
they go through EngineConfig.create (which also reads the AUGURY_* environment), so the
engine and the server validate the same way. Its messages name config fields; the one-line
error names the flag the user typed (config.name_flags).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from augury.config import EngineConfig, ResolvedModel, add_flags, api_key_from_env, given_options, name_flags
from augury.generation_config import check_setting as check_generation_config
from augury.limits import RequestLimits, add_limit_flags, limits_from_args
from augury.server.responses_store import DEFAULT_MAX_MB, DEFAULT_MAX_RESPONSES
from augury.server.templates import load_chat_template

# structured.tool_parsers.FORMATS and structured.reasoning.PARSERS (importing them here would load
# torch through augury.structured; tests/test_tool_parsers.py checks the lists agree)
TOOL_FORMATS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "qwen3_xml", "pythonic")
REASONING_PARSERS = ("qwen3", "deepseek_r1")

DEFAULT_MAX_QUEUE_SIZE = 256
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_STREAM_TIMEOUT = 60.0


@dataclass(frozen=True)
class ServeSettings:
    host: str
    port: int
    api_key: str | None
    debug: bool
    max_queue_size: int
    served_model_name: str
    engine: EngineConfig
    tool_call_parser: str | None = "auto"  # a tool-call format; auto: the chat template's; None: tools refused
    reasoning_parser: str | None = None  # qwen3, deepseek_r1: <think> blocks become reasoning_content
    chat_template: str | None = None  # --chat-template's text (None: the tokenizer's)
    enable_docs: bool = False  # /docs, /redoc, /openapi.json served (behind the key when one is set)
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT  # seconds a drain waits for requests in flight
    stream_timeout: float = DEFAULT_STREAM_TIMEOUT  # a streaming client reading nothing this long is cut off; 0: never
    limits: RequestLimits = RequestLimits()  # what one request may ask (--limit-*)
    resolved: ResolvedModel | None = None  # the folders behind engine.model, once start-up resolved them
    served_model_names: tuple[str, ...] = ()  # every --served-model-name (served_model_name is the first)
    strict_fields: bool = False  # unknown request fields are a 400 (default: warned once, listed in a header)
    log_requests: bool = False  # one log line per request (--enable-log-requests)
    allowed_origins: tuple[str, ...] = ()  # CORS (--allowed-origins); none: no CORS headers
    generation_config: str = "auto"  # the model's sampling defaults: auto, vllm (none) or a folder (generation_config.py)
    max_stored_responses: int = DEFAULT_MAX_RESPONSES  # /v1/responses kept for previous_response_id (0: none)
    max_stored_responses_mb: float = DEFAULT_MAX_MB  # and the bytes they may take

    def describe(self) -> dict[str, Any]:
        """For /server_info: everything except the key itself."""
        return {"host": self.host, "port": self.port, "api_key_set": self.api_key is not None,
                "debug": self.debug, "max_queue_size": self.max_queue_size,
                "served_model_name": self.served_model_name, "tool_call_parser": self.tool_call_parser,
                "reasoning_parser": self.reasoning_parser, "chat_template_given": self.chat_template is not None,
                "enable_docs": self.enable_docs, "shutdown_timeout": self.shutdown_timeout,
                "limits": dataclasses.asdict(self.limits),
                "stream_timeout": self.stream_timeout,
                "served_model_names": list(self.served_model_names or (self.served_model_name,)),
                "strict_fields": self.strict_fields, "enable_log_requests": self.log_requests,
                "allowed_origins": list(self.allowed_origins), "generation_config": self.generation_config,
                "max_stored_responses": self.max_stored_responses,
                "max_stored_responses_mb": self.max_stored_responses_mb}


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2), not usage + error."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="augury serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version "
                        "(default: $AUGURY_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model ids clients may use, one or more; answers carry the first "
                        "(default: --model as given)")
    p.add_argument("--strict-fields", action="store_true",
                   help="refuse requests with fields augury does not know (a 400 naming the field); default: "
                        "each such field is warned about once and listed in the X-Augury-Ignored-Fields header")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per request: its id, route, status, time, tokens and finish reasons")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="origins (e.g. http://localhost:3000, or '*') whose browser pages may call this server "
                        "(CORS); default: none")
    p.add_argument("--max-queue-size", type=int, default=DEFAULT_MAX_QUEUE_SIZE,
                   help="requests that may wait beyond --max-num-seqs running ones; more get 429")
    p.add_argument("--debug", action="store_true", help="debug logging, and tracebacks with start-up errors")
    p.add_argument("--enable-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (behind --api-key when one is set; default: off)")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                   help="on SIGTERM or SIGINT, stop admitting (503) and give requests in flight this long to "
                        "finish before they are cut; a second signal stops at once (default 30)")
    p.add_argument("--stream-timeout", type=float, default=DEFAULT_STREAM_TIMEOUT, metavar="SECONDS",
                   help="a streaming client that reads nothing for this long is disconnected and its request "
                        "aborted (its KV cache freed); 0: never (default 60)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_FORMATS, "none"],
                   help="how tool calls are written and read in chat answers: hermes (<tool_call> JSON: SmolLM2, "
                        "Qwen 2.5 / 3), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]), qwen3_coder or "
                        "qwen3_xml (<function=...> XML), pythonic ([f(a=1)]: Llama 3.2 / 4); auto (default): the "
                        "format the chat template renders calls in, hermes when it renders none; none: requests "
                        "with tools get a 400")
    p.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="split the model's <think> reasoning off chat answers into reasoning_content (qwen3: "
                        "Qwen3, QwQ-style templates; deepseek_r1: DeepSeek-R1 and its distills); structured output "
                        "then applies to the answer after it; default: none")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the chat template (a Jinja file, or the template itself) instead of the tokenizer's")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="the sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens) of requests that do not set them: auto (default) from the model's "
                        "generation_config.json, vllm (or none) the server's own, or a folder's "
                        "generation_config.json")
    p.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_RESPONSES, metavar="N",
                   help="/v1/responses answers kept in memory for previous_response_id, least recently used "
                        f"dropped first; 0: none kept (default {DEFAULT_MAX_RESPONSES})")
    p.add_argument("--max-stored-responses-mb", type=float, default=DEFAULT_MAX_MB, metavar="MB",
                   help=f"memory those kept responses may take, as JSON (default {DEFAULT_MAX_MB:g})")
    add_limit_flags(p)  # every request limit, from the one table in limits.py
    add_flags(p)  # every engine option, from the one table in config.py
    return p


def parse_origins(values: list[str] | None) -> tuple[str, ...]:
    """--allowed-origins: origins (scheme://host[:port]) or "*"; vLLM's JSON list form is read too.
    ValueError naming the flag for anything else."""
    if not values:
        return ()
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            values = json.loads(values[0])
        except ValueError as e:
            raise ValueError(f"--allowed-origins: not a JSON list: {e}") from None
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError("--allowed-origins: a JSON list must hold origins as strings")
    out = []
    for v in values:
        v = v.strip()
        scheme, sep, rest = v.partition("://")
        if v != "*" and not (sep and scheme in ("http", "https") and rest and "/" not in rest.rstrip("/")):
            raise ValueError(f"--allowed-origins: {v!r} is not an origin (scheme://host[:port], e.g. "
                             "http://localhost:3000) nor '*'")
        out.append(v.rstrip("/"))
    return tuple(out)


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Validate everything the flags and the environment say; ValueError names the culprit."""
    try:
        engine = EngineConfig.create(**given_options(args))
    except ValueError as e:
        raise ValueError(name_flags(str(e))) from None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue_size < 0:
        raise ValueError(f"--max-queue-size must be a non-negative integer, got {args.max_queue_size}")
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        raise ValueError(f"--shutdown-timeout must be a non-negative number of seconds, got {args.shutdown_timeout}")
    if not (math.isfinite(args.stream_timeout) and args.stream_timeout >= 0):
        raise ValueError(f"--stream-timeout must be a non-negative number of seconds (0: never), got {args.stream_timeout}")
    api_key = args.api_key if args.api_key is not None else api_key_from_env()
    source = "--api-key" if args.api_key is not None else "environment variable AUGURY_API_KEY"
    if api_key is not None and not api_key.strip():
        raise ValueError(f"{source} must not be empty")
    if api_key is not None and api_key != api_key.strip():  # a header's value arrives stripped: it could never match
        raise ValueError(f"{source} must not begin or end with whitespace")
    if not args.host:
        raise ValueError("--host must not be empty")
    names = list(args.served_model_name) if args.served_model_name else [engine.model]
    if any(not n.strip() for n in names):
        raise ValueError("--served-model-name must not be empty")
    if len(set(names)) != len(names):
        raise ValueError(f"--served-model-name names one model twice: {', '.join(names)}")
    name = names[0]
    origins = parse_origins(args.allowed_origins)
    generation = check_generation_config(args.generation_config)
    if args.max_stored_responses < 0:
        raise ValueError(f"--max-stored-responses must be a non-negative integer, got {args.max_stored_responses}")
    if not (math.isfinite(args.max_stored_responses_mb) and args.max_stored_responses_mb >= 0):
        raise ValueError(f"--max-stored-responses-mb must be a non-negative number, got {args.max_stored_responses_mb}")
    limits = limits_from_args(args)
    return ServeSettings(host=args.host, port=args.port, api_key=api_key, debug=args.debug,
                         max_queue_size=args.max_queue_size, served_model_name=name, engine=engine, limits=limits,
                         tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser,
                         chat_template=None if args.chat_template is None else load_chat_template(args.chat_template),
                         enable_docs=args.enable_docs, shutdown_timeout=args.shutdown_timeout,
                         stream_timeout=args.stream_timeout, served_model_names=tuple(names),
                         strict_fields=args.strict_fields, log_requests=args.enable_log_requests,
                         allowed_origins=origins, generation_config=generation,
                         max_stored_responses=args.max_stored_responses,
                         max_stored_responses_mb=args.max_stored_responses_mb)
