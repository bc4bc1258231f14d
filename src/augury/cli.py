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
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from augury import config
from augury.config import add_flags

PROG = "augury"
COMMANDS = {
    "generate": "generate text for one prompt and print it",
    "serve": "serve a model over an OpenAI-compatible HTTP API (see `augury serve --help`)",
    "bench": "offline throughput, augury vs transformers (see `augury bench --help`)",
    "train-draft": "train an EAGLE-3 head for a target (see `augury train-draft --help`)",
}
# generate flag -> (SamplingParams field, type, default, help)
SAMPLING_FLAGS: dict[str, tuple[str, type, Any, str]] = {
    "--max-tokens": ("max_tokens", int, 128, "most tokens to generate (default: 128)"),
    "--temperature": ("temperature", float, 0.0, "sampling temperature; 0 picks the likeliest token (default: 0)"),
    "--top-p": ("top_p", float, 1.0, "sample only from the likeliest tokens whose probabilities add up to this "
                "(default: 1, all)"),
    "--top-k": ("top_k", int, None, "sample only from the k likeliest tokens (default: all)"),
    "--seed": ("seed", int, None, "makes sampling reproducible (default: not seeded)"),
}
# config and sampling fields -> generate's flags, for messages
GENERATE_FLAGS = {**config.FLAGS, **{dest: flag for flag, (dest, *_rest) in SAMPLING_FLAGS.items()}}


class CliError(ValueError):
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
    add_flags(gen)  # every engine option, from the one table in config.py
    return parser


def _metavar(dest: str, kind: type) -> str:
    return {int: "N", float: "X"}.get(kind, "NAME")


def _version() -> str:
    from augury import __version__

    return __version__


def run_generate(args: argparse.Namespace) -> int:
    """Build the sampling settings first (bad flags fail before any model loads), then generate."""
    from augury.sampling_params import SamplingParams

    sampling = {dest: getattr(args, dest) for dest, *_ in SAMPLING_FLAGS.values()}
    params = SamplingParams(ignore_eos=args.ignore_eos, **sampling)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise CliError("the prompt is empty")
    engine_kwargs = config.given_options(args)
    model = engine_kwargs.pop("model") or config.OPTION["model"].default
    from augury.distributed import launch
    from augury.llm import LLM

    launch.exit_on_failure()  # this process is augury's: a tensor-parallel rank that fails ends it, one line

    llm = LLM(model, **engine_kwargs)
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
        sys.stderr.write(f"{PROG}: error: {config.one_line(exc, GENERATE_FLAGS)}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
