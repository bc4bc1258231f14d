"""Engine configuration: one frozen dataclass, validated once, environment read in one place;
and OPTIONS, the one table of engine options every command's flags are derived from.

Each Option names an EngineConfig field, its flag, its type, a help text a user understands
and the AUGURY_ environment variable that may fill it (ENV_VARS is derived from the table);
an explicit argument always wins over the environment. `name_flags` rewrites field names in
validation messages as the flags a user typed, and `one_line` is the one-line error every
command prints. Torch-free: `augury serve` parses and validates its flags before any heavy import.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Test hook: name a start-up stage here and that stage fails as if its work had raised.
FAULT_INJECT_VAR = "AUGURY_FAULT_INJECT"
# Where augury keeps what it builds (the demo, GGUF conversions, its compiled CPU kernels).
CACHE_ENV = "AUGURY_CACHE_DIR"
# "0" turns augury's own CPU kernels off (augury/cpu/): torch's kernels run instead.
CPU_KERNELS_VAR = "AUGURY_CPU_KERNELS"
# An ISA level for augury's CPU kernels at or below the CPU's own (augury/cpu/isa.py: avx2, avx_vnni,
# avx512_vnni, avx512_bf16): for comparisons and tests.
CPU_ISA_VAR = "AUGURY_CPU_ISA"
# "0": tensor-parallel ranks on one machine sum through gloo, not their shared-memory exchange.
TP_SHM_VAR = "AUGURY_TP_SHM"
# `augury serve`'s API key when --api-key is not given (a key in the environment stays out of `ps`).
API_KEY_VAR = "AUGURY_API_KEY"
ALGORITHMS = ("eagle3", "suffix", "ngram", "none")
POLICIES = ("adaptive", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3")  # fp8: e4m3, as vLLM's


@dataclass(frozen=True)
class EngineConfig:
    model: str = "demo"
    draft_model: str | None = None
    revision: str | None = None  # of a model given as a Hugging Face Hub name (resolve.py); None: main
    draft_revision: str | None = None  # of a draft model given as a Hub name
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_branch: int | None = None  # eagle3: suffix-draft nodes added to each tree (None = auto)
    # tokens of recent outputs the suffix drafts search across requests (0: none; speculative/suffix.py)
    speculative_suffix_cache_tokens: int = 1 << 18
    speculative_policy: str = "adaptive"
    speculative_disable_batch_threshold: int | None = None
    dtype: str = "auto"
    device: str | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None  # None: sized automatically (core/kv_budget.py)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype
    seed: int = 0
    log_stats_interval: float = 10.0
    # weight-only quantisation of the linears: auto = the checkpoint's own (a GGUF's Q4 blocks run
    # as int4), else dense; none forces dense; int8 per channel; int4 group 32
    quantization: str = "auto"
    threads: int | None = None  # torch intra-op threads (None: the default, see engine/builder.py)
    enable_prefix_caching: bool = True  # reuse the KV of prompt prefixes earlier requests computed
    # tensor parallelism (augury/distributed): ranks in all, machines, this machine's index, node 0's
    # rendezvous host:port, and how long a rank may fall silent before every rank stops
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 30.0

    @staticmethod
    def create(**kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments (None = not given) plus AUGURY_* variables; validate.

        A message about a value that came from the environment names the variable."""
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown argument(s): {', '.join(unknown)}")
        given = {k: v for k, v in kwargs.items() if v is not None}
        from_env: dict[str, str] = {}
        for var, name in ENV_VARS.items():
            if name not in given and os.environ.get(var, "") != "":
                given[name] = _parse_env(var, name, os.environ[var])
                from_env[name] = var
        cfg = EngineConfig(**given)
        try:
            cfg.validate()
        except ValueError as e:
            raise ValueError(rename_fields(str(e), from_env)) from None
        return cfg

    def validate(self) -> None:
        def positive(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size", "nnodes"):
            positive(name, allow_none=False)
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) \
                or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be an integer in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of nnodes "
                             f"{self.nnodes} (the same number of ranks on every machine)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr: host:port of node 0, where the ranks meet")
        addr = self.dist_init_addr
        if addr is not None and (not isinstance(addr, str) or not addr.rpartition(":")[0]
                                 or not addr.rpartition(":")[2].isdigit()):
            raise ValueError(f"dist_init_addr must be host:port, got {addr!r}")
        if isinstance(self.dist_timeout, bool) or not isinstance(self.dist_timeout, (int, float)) \
                or not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be a positive number of seconds, got {self.dist_timeout!r}")
        for name in ("max_model_len", "num_kv_blocks", "speculative_num_steps", "speculative_eagle_topk",
                     "speculative_num_draft_tokens", "speculative_disable_batch_threshold", "threads"):
            positive(name)
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model must name a checkpoint folder, a Hugging Face Hub name, a .gguf file or 'demo'")
        for name in ("revision", "draft_revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a branch, tag or commit of the Hugging Face Hub, got {value!r}")
        b = self.speculative_ngram_branch
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 32):
            raise ValueError(f"speculative_ngram_branch must be an integer in [0, 32], got {b!r}")
        c = self.speculative_suffix_cache_tokens
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= 1 << 30:
            raise ValueError(f"speculative_suffix_cache_tokens must be an integer in [0, {1 << 30}] (0: no "
                             f"cross-request suffix cache), got {c!r}")
        if self.speculative_algorithm is not None and self.speculative_algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(ALGORITHMS)}, got {self.speculative_algorithm!r}")
        if self.speculative_policy not in POLICIES:
            raise ValueError(f"speculative_policy must be one of {', '.join(POLICIES)}, got {self.speculative_policy!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        gb = self.kv_cache_memory_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0):
            raise ValueError(f"kv_cache_memory_gb must be a positive number, got {gb!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if not isinstance(self.log_stats_interval, (int, float)) or not self.log_stats_interval >= 0:
            raise ValueError(f"log_stats_interval must be a number >= 0, got {self.log_stats_interval!r}")
        tree = (self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)
        if any(v is not None for v in tree) and any(v is None for v in tree):
            raise ValueError(
                "give all of speculative_num_steps, speculative_eagle_topk and speculative_num_draft_tokens, or none (auto)"
            )
        if all(v is not None for v in tree):
            steps, topk, ndt = tree
            most = 1 + topk + (steps - 1) * topk * topk
            if topk == 1 and ndt > steps + 1:
                raise ValueError(f"speculative_num_draft_tokens {ndt} exceeds num_steps + 1 = {steps + 1} for a chain (topk=1)")
            if ndt < 2 or ndt > most:
                raise ValueError(f"speculative_num_draft_tokens must be in [2, {most}] for num_steps={steps}, topk={topk}, got {ndt}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ResolvedModel:
    """What a model name means on this machine (see augury/resolve.py, which makes these): the target's
    Hugging Face folder, and the EAGLE-3 head folder to draft with (None: no head)."""

    target_dir: Path
    draft_dir: Path | None = None


# ------------------------------------------------------------------ the option table

_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_UNSET: Any = object()


@dataclass(frozen=True)
class Option:
    """One engine option: the EngineConfig field it sets, its flag, its type, what it does in a
    user's words, and the environment variable that fills it when it is not given (if any).
    The default is EngineConfig's; `default_help` says in words what a None default means."""

    name: str
    flag: str
    type: type
    help: str
    env: str | None = None
    default_help: str | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # more flags for the same option (--tp)

    @property
    def default(self) -> Any:
        return _DEFAULTS[self.name]

    def help_text(self, default: Any = _UNSET, env: bool = True, show_default: bool = True) -> str:
        """The --help line: what it does, the default (EngineConfig's unless given), the variable."""
        default = self.default if default is _UNSET else default
        said = (self.default_help if default is None else str(default)) if show_default else None
        text = f"{self.help} (default: {said})" if said else self.help
        if env and self.env:
            text += f" [environment: {self.env}]"
        return text.replace("%", "%%")  # argparse formats help with %


OPTIONS: tuple[Option, ...] = (
    Option("model", "--model", str,
           "what to run: a Hugging Face checkpoint folder, a Hugging Face Hub name (Org/Name: fetched into the "
           "Hugging Face cache; HF_HUB_OFFLINE=1 uses the cache alone), a llama-architecture .gguf file "
           "(converted once into the user cache), or 'demo' (SmolLM2-135M-Instruct with the EAGLE-3 head "
           "shipped in augury, downloaded once)", metavar="MODEL"),
    Option("revision", "--revision", str, "the branch, tag or commit of a --model given as a Hub name",
           default_help="main", metavar="REV"),
    Option("dtype", "--dtype", str,
           "weights and compute dtype: auto (the checkpoint's own; bfloat16 for float16 checkpoints on CPU), "
           "float32, bfloat16 or float16", metavar="DTYPE"),
    Option("quantization", "--quantization", str,
           "weight-only quantisation of the linear layers: auto (the checkpoint's own quantisation: a GGUF's "
           "Q4 blocks run as int4 in bfloat16/float16; float32, the reference, runs dense), none (dense), int8 "
           "(per-channel int8 weights) or int4 (group-32 int4 weights; a GGUF's own Q4 blocks where it has them)",
           metavar="KIND"),
    Option("device", "--device", str, "where to run: cpu, cuda or cuda:N", env="AUGURY_DEVICE",
           default_help="cuda when available, else cpu", metavar="DEVICE"),
    Option("threads", "--threads", int, "torch intra-op CPU threads", env="AUGURY_THREADS",
           default_help="torch's choice", metavar="N"),
    Option("max_model_len", "--max-model-len", int,
           "longest prompt plus output, in tokens; more than the KV cache holds is an error at start-up",
           default_help="the model's context length, lowered to what the KV cache holds (said at start-up)",
           metavar="N"),
    Option("max_num_seqs", "--max-num-seqs", int, "most requests generating at once (continuous batching)",
           metavar="N"),
    Option("max_num_batched_tokens", "--max-num-batched-tokens", int,
           "most prompt tokens one engine step prefills; longer prompts are prefilled in chunks", metavar="N"),
    Option("kv_cache_memory_gb", "--kv-cache-memory-gb", float,
           "memory for the KV cache, in GiB (the cache is smaller when the requests need less); memory is "
           "taken as the cache fills", env="AUGURY_KV_CACHE_GB",
           default_help="room for 2 requests of the full context (or 256 MiB for a model whose contexts are "
                        "small), at most half the memory available after the weights", metavar="GB"),
    Option("kv_cache_dtype", "--kv-cache-dtype", str,
           "dtype of the KV cache: auto (the model's), bfloat16, float16, float32 or fp8 (= fp8_e4m3, CPUs "
           "only); keys and values are converted as they are written (a float32 cache holds a bfloat16 "
           "model's exactly, at twice the memory; a 16-bit cache halves a float32 model's; fp8 halves a "
           "bfloat16 one's, rounding each key and value to 3 mantissa bits, no scale, +-448 at most: on the "
           "demo, 0 of 16 greedy answers stayed bfloat16's, their first differences a median 10.5 tokens in (of 128), "
           "EAGLE-3 acceptance unchanged; docs/architecture.md)",
           metavar="DTYPE"),
    Option("num_kv_blocks", "--num-kv-blocks", int, "KV cache size in blocks; overrides --kv-cache-memory-gb",
           default_help="sized automatically, see --kv-cache-memory-gb", metavar="N"),
    Option("block_size", "--block-size", int, "tokens per KV cache block", metavar="N"),
    Option("speculative_algorithm", "--speculative-algorithm", str,
           "speculative decoding: eagle3 (an EAGLE-3 head drafts, with suffix drafts grafted), suffix (suffix "
           "decoding alone: drafts from the request's own text and recent requests' outputs), ngram (prompt "
           "lookup drafts) or none (plain decoding)", default_help="eagle3 when a head is given or shipped, else none", metavar="NAME"),
    Option("draft_model", "--speculative-draft-model-path", str,
           "EAGLE-3 head (the SGLang/vLLM format) to draft with: a folder, or a Hugging Face Hub name (Org/Name)",
           default_help="the head shipped for 'demo', else none", metavar="DIR"),
    Option("draft_revision", "--speculative-draft-model-revision", str,
           "the branch, tag or commit of a draft model given as a Hub name", default_help="main", metavar="REV"),
    Option("speculative_num_steps", "--speculative-num-steps", int,
           "draft tree depth; give it with --speculative-eagle-topk and --speculative-num-draft-tokens, "
           "or none of the three for an automatic tree", default_help="automatic", metavar="N"),
    Option("speculative_eagle_topk", "--speculative-eagle-topk", int,
           "children kept per draft tree node (1 drafts a chain)", default_help="automatic", metavar="N"),
    Option("speculative_num_draft_tokens", "--speculative-num-draft-tokens", int,
           "draft tree nodes verified per step, the root included", default_help="automatic", metavar="N"),
    Option("speculative_ngram_branch", "--speculative-ngram-branch", int,
           "eagle3: suffix-draft nodes grafted onto each draft tree, 0 to 32 (0: off)",
           default_help="automatic", metavar="N"),
    Option("speculative_suffix_cache_tokens", "--speculative-suffix-cache-tokens", int,
           "tokens of recent requests' outputs that suffix drafts search (least recently used request "
           "evicted first; 0: each request's own text only)", metavar="N"),
    Option("speculative_policy", "--speculative-policy", str,
           "how much to draft each step: adaptive (the draft size expected to give the most tokens per "
           "second at the current load, possibly none) or static (always the configured tree)", metavar="NAME"),
    Option("speculative_disable_batch_threshold", "--speculative-disable-batch-threshold", int,
           "no speculation while more than this many requests generate at once",
           env="AUGURY_SPEC_DISABLE_BATCH_THRESHOLD", default_help="never off", metavar="N"),
    Option("enable_prefix_caching", "--enable-prefix-caching", bool,
           "reuse the KV cache of a prompt prefix an earlier request computed (a shared system prompt, "
           "document or conversation so far); --no-enable-prefix-caching computes every prompt whole"),
    Option("log_stats_interval", "--log-stats-interval", float,
           "seconds between engine statistics log lines (0: off)", metavar="S"),
    Option("tensor_parallel_size", "--tensor-parallel-size", int,
           "ranks (processes) the model is split across by tensor parallelism: on one machine augury starts "
           "them itself, one per core group (or GPU); across machines see --nnodes; under torchrun, its "
           "WORLD_SIZE", metavar="N", aliases=("--tp",)),
    Option("nnodes", "--nnodes", int,
           "machines the tensor-parallel ranks run on; run the same command on each, with --node-rank and "
           "--dist-init-addr", metavar="N"),
    Option("node_rank", "--node-rank", int, "this machine's index among --nnodes (0 serves, others compute)",
           metavar="K"),
    Option("dist_init_addr", "--dist-init-addr", str,
           "host:port on machine 0 where the tensor-parallel ranks meet", default_help="a free local port",
           metavar="HOST:PORT"),
    Option("dist_timeout", "--dist-timeout", float,
           "seconds a tensor-parallel rank may fall silent (dead or hung) before every rank stops",
           env="AUGURY_DIST_TIMEOUT", metavar="S"),
)
OPTION: dict[str, Option] = {o.name: o for o in OPTIONS}
# name of the environment variable -> config field it fills when the field is not given
ENV_VARS: dict[str, str] = {o.env: o.name for o in OPTIONS if o.env}
FLAGS: dict[str, str] = {o.name: o.flag for o in OPTIONS}  # config field -> flag


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None,
              **overrides: dict[str, Any]) -> None:
    """Add these options' flags (all of OPTIONS by default) to `parser`, each stored under its
    field name with default None, so that EngineConfig.create fills what was not given.

    `overrides[name]` changes argparse keywords for a command whose use differs: `flags` (the
    option strings), `dest`, `default` (the command's own: the environment then does not apply),
    `choices`, `required`, `help` (what it does; the default is added to it)."""
    for opt in OPTIONS if names is None else [OPTION[n] for n in names]:
        extra = dict(overrides.get(opt.name, {}))
        flags = extra.pop("flags", (opt.flag, *opt.aliases))
        shown = dataclasses.replace(opt, help=extra.pop("help")) if "help" in extra else opt
        own = "default" in extra
        text = shown.help_text(extra["default"] if own else _UNSET, env=not own,
                               show_default=not extra.get("required"))
        kwargs: dict[str, Any] = {"dest": opt.name, "type": opt.type, "default": None, "metavar": opt.metavar,
                                  "help": text}
        if opt.type is bool:  # --flag / --no-flag
            kwargs = {"dest": opt.name, "default": None, "action": argparse.BooleanOptionalAction, "help": text}
        kwargs.update(extra)
        parser.add_argument(*flags, **kwargs)


def given_options(args: argparse.Namespace, names: Iterable[str] | None = None) -> dict[str, Any]:
    """The option values an argparse namespace holds (None where a flag was not given)."""
    return {o.name: getattr(args, o.name) for o in (OPTIONS if names is None else [OPTION[n] for n in names])
            if hasattr(args, o.name)}


# ------------------------------------------------------------------ messages a user reads

def rename_fields(message: str, names: Mapping[str, str]) -> str:
    """Replace field names in a message: a name with an underscore anywhere it stands as a word, a
    plain word (dtype, model) only where it opens the message (elsewhere it may be prose)."""
    for name, new in sorted(names.items(), key=lambda kv: -len(kv[0])):
        if "_" in name:
            message = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", new, message)
        elif message.startswith(name + " "):
            message = new + message[len(name):]
    return message


def name_flags(message: str, flags: Mapping[str, str] | None = None) -> str:
    """Say the flag the user typed (`--max-model-len`) where a validation message names the field
    (`max_model_len`). `flags` maps fields to a command's flags (default: every option's)."""
    return rename_fields(message, FLAGS if flags is None else flags)


def one_line(exc: BaseException, flags: Mapping[str, str] | None = None) -> str:
    """An error as the one line a command prints after "augury: error: ".

    Messages written for users (ValueError, and the built-in RuntimeError, OSError and
    MemoryError) stand alone; other errors say their type. A start-up failure names its stage.
    Field names become the command's flags (`flags`, as for name_flags)."""
    stage, cause = getattr(exc, "stage", None), getattr(exc, "cause", None)
    if isinstance(stage, str) and isinstance(cause, BaseException):  # stages.StartupError
        return f"start-up failed at stage '{stage}': {one_line(cause, flags)}"
    text = " ".join(str(exc).split())
    if not text:
        return type(exc).__name__
    builtin = type(exc).__module__ == "builtins" and isinstance(exc, (RuntimeError, OSError, MemoryError))
    if not (isinstance(exc, ValueError) or builtin):
        text = f"{type(exc).__name__}: {text}"
    return name_flags(text, flags)


def _parse_env(var: str, name: str, raw: str) -> Any:
    kind = OPTION[name].type
    if kind is int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {var}={raw!r} must be a positive integer") from None
        if value < 1:
            raise ValueError(f"environment variable {var}={raw!r} must be a positive integer")
        return value
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"environment variable {var}={raw!r} must be a number") from None
    return raw


def cache_root() -> Path:
    """$AUGURY_CACHE_DIR if set, else the per-user cache dir for augury."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("augury"))


def cpu_kernels_enabled() -> bool:
    """False when AUGURY_CPU_KERNELS is "0" (or "false", "off", "no")."""
    return os.environ.get(CPU_KERNELS_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def tp_shared_memory_enabled() -> bool:
    """False when AUGURY_TP_SHM is "0" (or "false", "off", "no"): tensor-parallel ranks on one machine
    then sum through gloo instead of their shared-memory exchange (for comparisons)."""
    return os.environ.get(TP_SHM_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def cpu_isa_override() -> str | None:
    """The ISA level AUGURY_CPU_ISA asks for (lower-cased), or None when it is unset or empty."""
    value = os.environ.get(CPU_ISA_VAR, "").strip().lower()
    return value or None


def api_key_from_env() -> str | None:
    """AUGURY_API_KEY, or None when it is unset or empty."""
    return os.environ.get(API_KEY_VAR) or None


def injected_fault_stage() -> str | None:
    """The start-up stage a test asked to fail (AUGURY_FAULT_INJECT), if any."""
    return os.environ.get(FAULT_INJECT_VAR) or None
