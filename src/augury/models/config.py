"""Target model configuration, parsed from a Hugging Face config.json and validated once."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TargetConfig:
    """The numbers a Llama-family forward needs; everything else in config.json is ignored."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> "TargetConfig":
        family = cfg.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"unsupported model_type {family!r} in config.json; augury supports {', '.join(SUPPORTED_FAMILIES)}"
            )
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise ValueError(f"config.json: {key} must be a positive integer, got {cfg.get(key)!r}")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        sliding = None
        if family == "mistral" or cfg.get("use_sliding_window"):
            sliding = cfg.get("sliding_window")
        return TargetConfig(
            family=family,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; the others say so in attention_bias.
            attention_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
            # Llama and Qwen3 put attention_bias on o_proj too; Qwen2 and Mistral never do
            o_proj_bias=family in ("llama", "qwen3") and bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @staticmethod
    def from_folder(path: str | Path) -> "TargetConfig":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{path} has no config.json; pass a Hugging Face checkpoint folder")
        return TargetConfig.from_dict(json.loads(cfg_path.read_text()))


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes rope_parameters (with rope_theta inside); older checkpoints
    # write rope_theta at the top level and an optional rope_scaling dict.
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" not in params and "rope_theta" not in params:
        # per-layer-type form: {"full_attention": {...}}; all layers here use full attention
        params = params.get("full_attention") or next(iter(params.values()), None)
    scaling = dict(params) if isinstance(params, dict) else dict(cfg.get("rope_scaling") or {})
    theta = scaling.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f"unsupported rope type {rope_type!r}; augury supports {', '.join(SUPPORTED_ROPE)}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )
