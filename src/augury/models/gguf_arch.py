"""What a GGUF file's architecture means for the Hugging Face folder gguf.py writes from it.

Per architecture, what llama.cpp's converter (convert_hf_to_gguf.py) puts in the file:

- `llama`: Llama 1-3.x, and Mistral (both HF `MistralForCausalLM` and Mistral's own format convert
  to it, with no sliding-window metadata). attn_q / attn_k rows are in GGML's interleaved rope
  order: the converter permutes HF's rotate-half rows (Mistral's own format is interleaved
  already); gguf.py undoes it. Llama 3.1-style rope scaling travels as the tensor
  `rope_freqs.weight` (one divisor per rotary frequency), with no metadata.
- `qwen2`: q/k/v biases; rows not permuted (llama.cpp runs these models in NEOX rope order,
  which is HF's rotate-half order).
- `qwen3`: per-head q/k RMSNorm weights (`attn_q_norm` / `attn_k_norm`), no biases, no permutation.

Anything else (`mistral3`, MoE, ...) is refused by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class ArchSpec:
    model_type: str  # HF model_type (models/config.py SUPPORTED_FAMILIES)
    hf_class: str  # HF architectures entry
    permuted_qk: bool  # llama.cpp's converter permuted the attn_q / attn_k rows (GGML interleaved rope)
    qkv_bias: bool  # attn_q / attn_k / attn_v carry biases (and attn_output none)
    qk_norm: bool  # attn_q_norm / attn_k_norm: RMSNorm weights [head_dim] applied per head


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", permuted_qk=True, qkv_bias=False, qk_norm=False),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", permuted_qk=False, qkv_bias=True, qk_norm=False),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", permuted_qk=False, qkv_bias=False, qk_norm=True),
}
_REFUSED_WHY = {
    "mistral3": "Mistral 3's YaRN rope and attention temperature scaling",
}

ROPE_FREQS = "rope_freqs.weight"
# GGUF tensor name -> HF tensor name, for tensors outside the layer stack.
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF per-layer short name ("blk.N.<short>.weight|bias") -> HF module under model.layers.N.
_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MISSING = object()
Meta = Callable[..., Any]  # gguf._meta bound to a reader: (key, default=_MISSING) -> value


def arch_spec(arch: Any, where: str) -> ArchSpec:
    spec = ARCHS.get(arch) if isinstance(arch, str) else None
    if spec is None:
        why = f" ({_REFUSED_WHY[arch]})" if arch in _REFUSED_WHY else ""
        raise ValueError(f"{where}: GGUF architecture {arch!r}{why} is not supported "
                         f"(supported: {', '.join(repr(a) for a in ARCHS)})")
    return spec


def _f32(value: Any) -> float:
    """GGUF stores floats as float32; 7 significant digits recover the value the converter was given."""
    return float(f"{float(value):.7g}")


def _int(meta: Meta, key: str, default: Any = _MISSING) -> int:
    value = meta(key) if default is _MISSING else meta(key, default)
    if not isinstance(value, (int, np.integer)):  # per-layer arrays (OpenELM style) are not these models
        raise ValueError(f"GGUF metadata {key!r} = {value!r} is not a single integer")
    return int(value)


def read_config(meta: Meta, arch: str, spec: ArchSpec, vocab_rows: int, tied: bool,
                rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """The HF config dict from the `<arch>.*` metadata (and rope_freqs.weight's values, if any)."""
    a = arch
    hidden = _int(meta, f"{a}.embedding_length")
    heads = _int(meta, f"{a}.attention.head_count")
    kv_heads = _int(meta, f"{a}.attention.head_count_kv", heads)
    head_dim = _int(meta, f"{a}.attention.key_length", hidden // heads)
    rope_dim = _int(meta, f"{a}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim}) "
                         "are not supported")
    theta = _f32(meta(f"{a}.rope.freq_base", 10000.0))
    scaling_type = meta(f"{a}.rope.scaling.type", "none")
    rope_scaling: dict[str, Any] | None = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(meta(f"{a}.rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ValueError(f"rope scaling type {scaling_type!r} is not supported")
    if rope_freqs is not None:
        if rope_scaling is not None:
            raise ValueError(f"{ROPE_FREQS} together with rope scaling type {scaling_type!r} is not supported")
        rope_scaling = rope_scaling_from_freqs(rope_freqs, theta, rope_dim, _int(meta, f"{a}.context_length"))
    vocab = _int(meta, f"{a}.vocab_size", vocab_rows)
    if vocab != vocab_rows:
        raise ValueError(f"vocab_size {vocab} disagrees with token_embd.weight rows {vocab_rows}")
    config: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": _int(meta, f"{a}.feed_forward_length"),
        "num_hidden_layers": _int(meta, f"{a}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta(f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": _int(meta, f"{a}.context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "attention_bias": spec.qkv_bias,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if spec.model_type == "llama":
        config["mlp_bias"] = False
    else:  # Qwen's HF configs name their (unused here) sliding window explicitly off
        config.update(use_sliding_window=False, sliding_window=None)
    window = meta(f"{a}.attention.sliding_window", None)
    if window is not None:
        if spec.model_type != "llama":
            raise ValueError(f"{a}.attention.sliding_window = {window!r}: sliding-window attention is not "
                             f"supported for GGUF architecture {a!r}")
        # llama.cpp's converter writes none for Mistral; a file that has one means Mistral's window:
        # HF's Mistral class applies it (augury caps the context at it, builder.py)
        config.update(architectures=["MistralForCausalLM"], model_type="mistral",
                      sliding_window=_int(meta, f"{a}.attention.sliding_window"))
        del config["mlp_bias"]
    for name in ("bos", "eos", "padding"):
        token_id = meta(f"tokenizer.ggml.{name}_token_id", None)
        if token_id is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(token_id)
    return config


def expected_shapes(cfg: dict[str, Any], spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """HF name -> shape (torch order: [out_features, in_features]) of every tensor we must write."""
    h, i, v, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q_rows, kv_rows = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_rows, h), "self_attn.k_proj.weight": (kv_rows, h),
        "self_attn.v_proj.weight": (kv_rows, h), "self_attn.o_proj.weight": (h, q_rows),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }
    if spec.qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
                          "self_attn.v_proj.bias": (kv_rows,)})
    if spec.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    for layer in range(cfg["num_hidden_layers"]):
        for module, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{module}"] = shape
    return shapes


def hf_name(gguf_name: str, arch: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        module = _LAYER_NAMES.get(parts[2])
        if module is not None:
            return f"model.layers.{parts[1]}.{module}.{parts[3]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for a {arch} model")


# ------------------------------------------------------------------ Llama 3.1-style rope scaling
# rope_freqs.weight holds, per rotary frequency i, the divisor llama.cpp applies to theta^(-2i/d) at
# run time. llama.cpp's converter derives it from HF's rope_type "llama3" parameters (factor,
# low_freq_factor, high_freq_factor, original_max_position_embeddings), by the same rule as HF's
# `_compute_llama3_parameters`, with wavelength w_i = 2 pi theta^(2i/d) and L the original context:
#   w < L / high_freq_factor: 1;   w > L / low_freq_factor: factor;
#   else 1 / ((1 - s) / factor + s),  s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor).
# The HF folder must say it as those parameters (transformers loads the folder too: the benchmarks'
# reference), so they are recovered here and checked to give back every stored divisor.
_LLAMA3_USUAL = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_RTOL = 1e-5  # the divisors are stored in float32 (6e-8); a fit from them is good to ~1e-7


def llama3_divisors(params: dict[str, Any], theta: float, rope_dim: int) -> np.ndarray:
    """The per-frequency divisors [rope_dim/2] the rule above gives for HF llama3 `params` (float64)."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    factor, old = float(params["factor"]), float(params["original_max_position_embeddings"])
    lo, hi = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, mid))


def _fit_llama3(f: np.ndarray, factor: float, wavelen: np.ndarray, old: int) -> dict[str, Any] | None:
    """llama3 parameters whose rule may give divisors `f` (checked by the caller), or None.

    In the smoothed band s = L / (hi - lo) * (1 / w) - lo / (hi - lo): linear in 1 / w, so two
    numbers (slope a, offset b) fix it, and any original context L gives the same divisors: `old`."""
    ones, full = np.isclose(f, 1.0, rtol=_RTOL), np.isclose(f, factor, rtol=_RTOL)
    band = ~(ones | full)
    x = 1.0 / wavelen
    s = (1.0 / f[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    if band.sum() >= 2:
        a, c = np.polyfit(x[band], s, 1)
        b = -c
    elif band.sum() == 1:
        b = 1.0 / 3.0  # one point: take Llama 3's ratio hi / lo = 4 (s = 0 at w = a / b, 1 at a / (1 + b))
        a = (s[0] + b) / x[band][0]
    else:  # no smoothed band: put both thresholds between the last 1 and the first `factor`
        if not ones.any():
            return None
        last_one, first_full = wavelen[ones].max(), wavelen[full].min()
        r = first_full / last_one
        high_w, low_w = last_one * r ** (1 / 3), last_one * r ** (2 / 3)
        return {"factor": factor, "low_freq_factor": old / low_w, "high_freq_factor": old / high_w,
                "original_max_position_embeddings": old}
    if not (a > 0 and b > 0):
        return None
    return {"factor": factor, "low_freq_factor": b * old / a, "high_freq_factor": (1 + b) * old / a,
            "original_max_position_embeddings": old}


def rope_scaling_from_freqs(freqs: np.ndarray, theta: float, rope_dim: int,
                            context: int = 8192) -> dict[str, Any] | None:
    """rope_freqs.weight [rope_dim/2] -> the HF rope_scaling dict that gives the same rotary
    frequencies (None: every divisor is 1), or ValueError if no llama3 (or linear) setting does.
    Llama 3's own setting is tried first; else one is fitted, with an original context of 8192 or
    the model's `context` if shorter (transformers warns when it is not below the context)."""
    f = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if f.shape[0] != rope_dim // 2:
        raise ValueError(f"{ROPE_FREQS} has {f.shape[0]} values, expected rope dim / 2 = {rope_dim // 2}")
    if not np.isfinite(f).all() or (f <= 0).any():
        raise ValueError(f"{ROPE_FREQS} holds non-finite or non-positive divisors")
    factor = _f32(f.max())
    if np.allclose(f, 1.0, rtol=_RTOL, atol=0):
        return None  # no scaling at all
    if np.allclose(f, factor, rtol=_RTOL, atol=0):
        return {"rope_type": "linear", "factor": factor}  # every frequency divided alike: linear scaling
    candidates = [{"factor": factor, **_LLAMA3_USUAL}]
    wavelen = 2 * math.pi * theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    fitted = _fit_llama3(f, factor, wavelen, min(int(_LLAMA3_USUAL["original_max_position_embeddings"]), context))
    if fitted is not None:
        rounded = {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in fitted.items()}
        candidates += [rounded, fitted]  # 6 digits first: 1.0 rather than 0.99999994 where both fit
    for params in candidates:
        if np.allclose(llama3_divisors(params, theta, rope_dim), f, rtol=_RTOL, atol=0):
            return {"rope_type": "llama3", **params}
    raise ValueError(f"{ROPE_FREQS} does not follow Llama 3's rope scaling rule (divisors 1 for short "
                     f"wavelengths, a factor for long ones, smoothed between); got {np.round(f, 4).tolist()}")
