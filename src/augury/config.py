"""Engine configuration: one frozen dataclass, validated once, environment read in one place.

Settings that may also come from the environment use the AUGURY_ prefix and are listed in
ENV_VARS; an explicit argument always wins over the environment.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

# name of the environment variable -> config field it fills when the field is not given
ENV_VARS: dict[str, str] = {
    "AUGURY_SPEC_DISABLE_BATCH_THRESHOLD": "speculative_disable_batch_threshold",
    "AUGURY_DEVICE": "device",
    "AUGURY_KV_CACHE_GB": "kv_cache_memory_gb",
}
# Test hook: name a start-up stage here and that stage fails as if its work had raised.
FAULT_INJECT_VAR = "AUGURY_FAULT_INJECT"
ALGORITHMS = ("eagle3", "ngram", "none")
POLICIES = ("adaptive", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "demo"
    draft_model: str | None = None
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_branch: int | None = None  # eagle3: prompt-lookup tokens added to each tree (None = auto)
    speculative_policy: str = "adaptive"
    speculative_disable_batch_threshold: int | None = None
    dtype: str = "auto"
    device: str | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    seed: int = 0
    log_stats_interval: float = 10.0
    # weight-only quantisation of the linears: auto = the checkpoint's own (a GGUF's Q4 blocks run
    # as int4), else dense; none forces dense; int8 per channel; int4 group 32
    quantization: str = "auto"
    threads: int | None = None  # torch intra-op threads (None: the default, see engine/builder.py)

    @staticmethod
    def create(**kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments (None = not given) plus AUGURY_* variables; validate."""
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown argument(s): {', '.join(unknown)}")
        given = {k: v for k, v in kwargs.items() if v is not None}
        for var, name in ENV_VARS.items():
            if name not in given and os.environ.get(var, "") != "":
                given[name] = _parse_env(var, name, os.environ[var])
        cfg = EngineConfig(**given)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def positive(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            positive(name, allow_none=False)
        for name in ("max_model_len", "num_kv_blocks", "speculative_num_steps", "speculative_eagle_topk",
                     "speculative_num_draft_tokens", "speculative_disable_batch_threshold", "threads"):
            positive(name)
        b = self.speculative_ngram_branch
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 32):
            raise ValueError(f"speculative_ngram_branch must be an integer in [0, 32], got {b!r}")
        if self.speculative_algorithm is not None and self.speculative_algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(ALGORITHMS)}, got {self.speculative_algorithm!r}")
        if self.speculative_policy not in POLICIES:
            raise ValueError(f"speculative_policy must be one of {', '.join(POLICIES)}, got {self.speculative_policy!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.kv_cache_memory_gb, (int, float)) or self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be a positive number, got {self.kv_cache_memory_gb!r}")
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
        if self.speculative_algorithm == "eagle3" and self.draft_model is None and self.model != "demo":
            raise ValueError("speculative_algorithm eagle3 needs a draft model (speculative_draft_model_path / draft_model)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _parse_env(var: str, name: str, raw: str) -> Any:
    ftype = {f.name: f.type for f in dataclasses.fields(EngineConfig)}[name]
    if "int" in str(ftype):
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {var}={raw!r} must be a positive integer") from None
        if value < 1:
            raise ValueError(f"environment variable {var}={raw!r} must be a positive integer")
        return value
    if "float" in str(ftype):
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"environment variable {var}={raw!r} must be a number") from None
    return raw


def injected_fault_stage() -> str | None:
    """The start-up stage a test asked to fail (AUGURY_FAULT_INJECT), if any."""
    return os.environ.get(FAULT_INJECT_VAR) or None
