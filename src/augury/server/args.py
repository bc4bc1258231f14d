"""`augury serve` flags -> validated settings. Imports no torch: bad flags fail in milliseconds.

Engine flags go through EngineConfig.create (which also reads the AUGURY_* environment), so
the engine and the server validate the same way; its messages name config fields, and are
rewritten here to name the flag the user typed.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from augury.config import EngineConfig

# flag -> (EngineConfig field, type)
ENGINE_FLAGS: dict[str, tuple[str, type]] = {
    "--model": ("model", str),
    "--dtype": ("dtype", str),
    "--device": ("device", str),
    "--max-num-seqs": ("max_num_seqs", int),
    "--max-model-len": ("max_model_len", int),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--num-kv-blocks": ("num_kv_blocks", int),
    "--kv-cache-memory-gb": ("kv_cache_memory_gb", float),
    "--speculative-algorithm": ("speculative_algorithm", str),
    "--speculative-draft-model-path": ("draft_model", str),
    "--speculative-num-steps": ("speculative_num_steps", int),
    "--speculative-eagle-topk": ("speculative_eagle_topk", int),
    "--speculative-num-draft-tokens": ("speculative_num_draft_tokens", int),
    "--speculative-ngram-branch": ("speculative_ngram_branch", int),
    "--speculative-policy": ("speculative_policy", str),
    "--speculative-disable-batch-threshold": ("speculative_disable_batch_threshold", int),
}
DEFAULT_MAX_QUEUE_SIZE = 256


@dataclass(frozen=True)
class ServeSettings:
    host: str
    port: int
    api_key: str | None
    debug: bool
    max_queue_size: int
    served_model_name: str
    engine: EngineConfig

    def describe(self) -> dict[str, Any]:
        """For /server_info: everything except the key itself."""
        return {"host": self.host, "port": self.port, "api_key_set": self.api_key is not None,
                "debug": self.debug, "max_queue_size": self.max_queue_size,
                "served_model_name": self.served_model_name}


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2), not usage + error."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="augury serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /server_info")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model as given)")
    p.add_argument("--max-queue-size", type=int, default=DEFAULT_MAX_QUEUE_SIZE,
                   help="requests that may wait beyond --max-num-seqs running ones; more get 429")
    p.add_argument("--debug", action="store_true", help="debug logging, and tracebacks with start-up errors")
    for flag, (name, kind) in ENGINE_FLAGS.items():
        default = EngineConfig.__dataclass_fields__[name].default
        p.add_argument(flag, dest=name, type=kind, default=None,
                       help=f"EngineConfig.{name} (default {default!r})")
    return p


def _name_flags(message: str, given: dict[str, Any]) -> str:
    """Rewrite config field names in a validation message as the flags the user passed."""
    message = message.replace("speculative_draft_model_path", "--speculative-draft-model-path")
    for flag, (name, _) in sorted(ENGINE_FLAGS.items(), key=lambda kv: -len(kv[1][0])):
        if name not in given:
            continue
        if "_" in name:
            message = re.sub(rf"(?<![\w-]){name}(?!\w)", flag, message)
        elif message.startswith(name + " "):
            message = flag + message[len(name):]
    return message


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Validate everything the flags and the environment say; ValueError names the culprit."""
    given = {name: getattr(args, name) for _, (name, _) in ENGINE_FLAGS.items() if getattr(args, name) is not None}
    try:
        engine = EngineConfig.create(**given)
    except ValueError as e:
        raise ValueError(_name_flags(str(e), given)) from None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue_size < 0:
        raise ValueError(f"--max-queue-size must be a non-negative integer, got {args.max_queue_size}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")
    if not args.host:
        raise ValueError("--host must not be empty")
    name = args.served_model_name if args.served_model_name is not None else engine.model
    if not name.strip():
        raise ValueError("--served-model-name must not be empty")
    return ServeSettings(host=args.host, port=args.port, api_key=args.api_key, debug=args.debug,
                         max_queue_size=args.max_queue_size, served_model_name=name, engine=engine)
