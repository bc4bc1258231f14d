"""The `augury` command: generate (one prompt, printed), serve (HTTP), bench (offline throughput),
train-draft (EAGLE-3 head training).

`serve`, `bench` and `train-draft` hand their whole argv to their own modules, imported only when used,
so `augury generate` never loads the server and `augury serve` never loads the benchmark.
Every error is one line, `augury: error: ...`, with exit status 2; --debug adds the
traceback.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

PROG = "augury"
COMMANDS = {
    "generate": "generate text for one prompt and print it",
    "serve": "serve a model over an OpenAI-compatible HTTP API (see `augury serve --help`)",
    "bench": "offline throughput, augury vs transformers (see `augury bench --help`)",
    "train-draft": "train an EAGLE-3 head for a target (see `augury train-draft --help`)",
}
# generate flag -> (EngineConfig field, type, help)
ENGINE_FLAGS: dict[str, tuple[str, type, str]] = {
    "--model": ("model", str, "a Hugging Face checkpoint folder, or 'demo' (default)"),
    "--dtype": ("dtype", str, "auto (the checkpoint's), float32, bfloat16 or float16"),
    "--device": ("device", str, "cpu or cuda (default: cuda when available)"),
    "--max-model-len": ("max_model_len", int, "context length (default: the model's)"),
    "--speculative-algorithm": ("speculative_algorithm", str, "eagle3, ngram or none"),
    "--speculative-draft-model-path": ("draft_model", str, "EAGLE-3 head checkpoint folder"),
    "--speculative-num-steps": ("speculative_num_steps", int, "draft depth"),
    "--speculative-eagle-topk": ("speculative_eagle_topk", int, "children per draft node"),
    "--speculative-num-draft-tokens": ("speculative_num_draft_tokens", int, "draft tokens verified per step"),
    "--speculative-ngram-branch": ("speculative_ngram_branch", int,
                                   "eagle3: add up to this many prompt-lookup tokens to each tree (0 = off)"),
    "--speculative-policy": ("speculative_policy", str, "adaptive or static"),
    "--speculative-disable-batch-threshold": ("speculative_disable_batch_threshold", int,
                                              "no speculation at this batch size or above"),
}
# generate flag -> (SamplingParams field, type, default, help)
SAMPLING_FLAGS: dict[str, tuple[str, type, Any, str]] = {
    "--max-tokens": ("max_tokens", int, 128, "most tokens to generate (default 128)"),
    "--temperature": ("temperature", float, 0.0, "0 is greedy (default 0)"),
    "--top-p": ("top_p", float, 1.0, "nucleus sampling mass (default 1: off)"),
    "--top-k": ("top_k", int, None, "keep the k most likely tokens (default: off)"),
    "--seed": ("seed", int, None, "makes sampling reproducible"),
}
# config field names that read as ordinary words in messages are never rewritten as flags
_NOT_REWRITTEN = {"model", "device"}


class CliError(Exception):
    """A user error the command reports as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors become CliError: one line and exit status 2, from main()."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="augury: LLM inference with load-aware EAGLE-3 speculative decoding.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in ("serve", "bench", "train-draft"):
        sub.add_parser(name, help=COMMANDS[name], add_help=False)
    gen = sub.add_parser("generate", help=COMMANDS["generate"], description=COMMANDS["generate"] + ".")
    gen.add_argument("prompt", metavar="PROMPT", help="the prompt text; '-' reads it from stdin")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true", default=None,
                      help="wrap the prompt as a user message in the chat template (the default when the model has one)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="continue the prompt text as it is")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    gen.add_argument("--debug", action="store_true", help="info logging, and tracebacks with errors")
    for flag, (dest, kind, default, help_) in SAMPLING_FLAGS.items():
        gen.add_argument(flag, dest=dest, type=kind, default=default, help=help_, metavar=_metavar(dest, kind))
    for flag, (dest, kind, help_) in ENGINE_FLAGS.items():
        gen.add_argument(flag, dest=dest, type=kind, default=None, help=help_, metavar=_metavar(dest, kind))
    return parser


def _metavar(dest: str, kind: type) -> str:
    if dest in ("model", "draft_model"):
        return "DIR"
    return {int: "N", float: "X"}.get(kind, "NAME")


def _version() -> str:
    from augury import __version__

    return __version__


def name_flags(message: str) -> str:
    """Say `--max-tokens` where a validation message says `max_tokens`: the user typed the flag."""
    fields = {dest: flag for flag, (dest, *_rest) in {**ENGINE_FLAGS, **SAMPLING_FLAGS}.items()}
    for dest, flag in fields.items():
        if dest not in _NOT_REWRITTEN:
            message = re.sub(rf"(?<![\w-]){re.escape(dest)}\b", flag, message)
    return message


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    from_user = isinstance(exc, (ValueError, CliError, FileNotFoundError, MemoryError))
    if not from_user and type(exc).__name__ != "StartupError":
        text = f"{type(exc).__name__}: {text}"
    return name_flags(text)


def run_generate(args: argparse.Namespace) -> int:
    """Build the sampling settings first (bad flags fail before any model loads), then generate."""
    from augury.sampling_params import SamplingParams

    sampling = {dest: getattr(args, dest) for dest, *_ in SAMPLING_FLAGS.values()}
    params = SamplingParams(ignore_eos=args.ignore_eos, **sampling)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise CliError("the prompt is empty")
    engine_kwargs = {dest: getattr(args, dest) for dest, *_ in ENGINE_FLAGS.values()}
    engine_kwargs["model"] = engine_kwargs["model"] or "demo"
    from augury.llm import LLM

    llm = LLM(**engine_kwargs)
    chat = args.chat if args.chat is not None else bool(getattr(llm.tokenizer, "chat_template", None))
    if chat:
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    sys.stdout.write(out.text + "\n")
    sys.stdout.flush()
    return 0


def _delegate(command: str, argv: list[str]) -> int:
    if command == "serve":
        from augury.server import serve_main  # lazy: the server stack loads only for `serve`

        return int(serve_main(argv) or 0)
    if command == "train-draft":
        from augury.train import train_main  # lazy: the training stack loads only for `train-draft`

        return int(train_main(argv) or 0)
    from augury.bench.offline import main as bench_main  # lazy: matplotlib etc. only for `bench`

    return int(bench_main(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        if argv and argv[0] in ("serve", "bench", "train-draft"):
            return _delegate(argv[0], argv[1:])
        args = build_parser().parse_args(argv)
        if args.command is None:
            raise CliError(f"choose a command: {', '.join(COMMANDS)} (see `{PROG} --help`)")
        logging.basicConfig(level=logging.INFO if args.debug else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        return run_generate(args)
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130
    except Exception as exc:  # every failure is one line unless --debug asks for the traceback
        if debug:
            raise
        sys.stderr.write(f"{PROG}: error: {_one_line(exc)}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
