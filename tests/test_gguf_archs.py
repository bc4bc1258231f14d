"""GGUF architectures beyond plain llama: Llama 3.x rope scaling (`rope_freqs.weight`), qwen2 (q/k/v
biases), qwen3 (q/k norms), Mistral-style llama files.

Each tiny random model is built with transformers' own config class, saved as an HF folder AND
written as a GGUF the way llama.cpp's converter writes it (tensor names, F32 norms and biases, Q/K
rows permuted for the llama architecture only, the llama3 divisors as a tensor). augury loads both
and the float32 logits must agree with each other and with transformers' model class.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from augury.models.config import TargetConfig
from augury.models.gguf import convert_gguf_to_hf
from augury.models.gguf_arch import llama3_divisors, rope_scaling_from_freqs
from augury.models.loader import load_target
from test_gguf import CHAT_TEMPLATE, _permute_rope_rows, _tokens
from test_quant import _logits as _augury_logits

F32, F16, Q40 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q4_0
PROMPT = [(7 * i + 3) % 259 for i in range(48)]  # 48 positions: long enough for rope scaling to show
VOCAB = len(_tokens()[0])
SHORT = {  # HF module under model.layers.N -> GGUF short name in blk.N (llama.cpp's tensor names)
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def _tiny(family: str, tied: bool = False, **extra: Any) -> torch.nn.Module:
    """A 2-layer random model; norms and biases random too, so a wrong mapping shows in the logits."""
    torch.manual_seed(0)
    config_cls, model_cls = FAMILIES[family]
    kw: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                              rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=VOCAB - 3,
                              eos_token_id=VOCAB - 1)
    kw.update(extra)
    model = model_cls(config_cls(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def _divisors_as_llama_cpp(rope: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """Llama 3's per-frequency divisors, computed the way llama.cpp's converter does: float32
    frequencies, the rule of HF's llama3 rope, stored float32. (The converter takes the original
    context from the config's top level, 8192 by default; here from the rope parameters, so that
    the test's HF model and its GGUF describe the same rotary frequencies.)"""
    freqs = (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    old, lo, hi, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                           rope["high_freq_factor"], rope["factor"])
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _write(model: torch.nn.Module, path: Path, arch: str, qtype: gguf.GGMLQuantizationType = F32,
           pre: str = "llama-bpe", name: str | None = None, window: int | None = None,
           tokens: tuple[list[str], list[int], list[str]] | None = None) -> None:
    """`model` as llama.cpp's converter writes it for GGUF architecture `arch`."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    w = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)  # the converter writes these when config.json has head_dim
    w.add_value_length(head_dim)
    if arch == "llama":  # llama's converter adds these two; qwen's do not
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if window is not None:
        w.add_sliding_window(window)
    vocab, types, merges = tokens or (*_tokens(), ["Ġ t", "h e"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(tensor_name: str, array: np.ndarray) -> None:
        if array.ndim == 2 and qtype != F32:  # norms and biases stay F32, as llama.cpp keeps them
            w.add_tensor(tensor_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(tensor_name, array)

    if rope.get("rope_type") == "llama3":  # Llama 3.1-style scaling travels as a tensor
        add("rope_freqs.weight", _divisors_as_llama_cpp(rope, theta, head_dim))
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"])
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    for i in range(cfg.num_hidden_layers):
        for hf, short in SHORT.items():
            for kind in ("weight", "bias"):
                array = state.get(f"model.layers.{i}.{hf}.{kind}")
                if array is None:
                    continue
                if arch == "llama" and short in heads:  # only the llama converter permutes (q/k biases too)
                    array = _permute_rope_rows(array.reshape(array.shape[0], -1), heads[short]).reshape(array.shape)
                add(f"blk.{i}.{short}.{kind}", array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _ours(folder: Path) -> torch.Tensor:
    model, cfg = load_target(folder, torch.float32, torch.device("cpu"), 64)
    return _augury_logits(model, cfg, PROMPT, torch.float32)  # [48, vocab]


def _theirs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


def _check_parity(model: torch.nn.Module, tmp_path: Path, arch: str, **write: Any) -> dict[str, Any]:
    """HF folder and GGUF of `model`: augury on both and transformers agree (float32). Returns the
    converted config.json."""
    model.save_pretrained(tmp_path / "hf")
    _write(model, tmp_path / "m.gguf", arch, **write)
    out = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "conv", dtype=torch.float32)
    ref = _theirs(model)
    from_hf, from_gguf = _ours(tmp_path / "hf"), _ours(out)
    torch.testing.assert_close(from_hf, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(from_gguf, from_hf, rtol=1e-5, atol=1e-5)
    # and the converted folder is an HF checkpoint transformers itself reads to the same logits
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(_theirs(again), ref, rtol=1e-5, atol=1e-5)
    return json.loads((out / "config.json").read_text())


# ------------------------------------------------------------------------- Llama 3.x rope scaling
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def test_llama31_rope_freqs_give_the_hf_folders_logits(tmp_path: Path) -> None:
    """Llama 3.1's own rope parameters (theta 500000): the file's rope_freqs.weight becomes exactly
    those parameters in config.json, and the logits are the HF folder's."""
    model = _tiny("llama", rope_theta=500000.0, rope_scaling=dict(LLAMA31), head_dim=32)
    config = _check_parity(model, tmp_path, "llama")
    assert config["rope_scaling"] == LLAMA31 and config["rope_theta"] == 500000.0
    assert TargetConfig.from_dict(config).rope.rope_type == "llama3"


@pytest.mark.parametrize("theta,rope", [
    # smoothed band of 4 frequencies: slope and offset fitted; short original contexts, so that the
    # scaling changes the rotation within the prompt's 48 positions
    (10000.0, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
               "original_max_position_embeddings": 64}),
    # one frequency in the band: read with Llama 3's high/low ratio of 4
    (500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                "original_max_position_embeddings": 128}),
], ids=["band-of-4", "band-of-1"])
def test_other_llama3_settings_are_recovered_from_the_divisors(tmp_path: Path, theta: float,
                                                               rope: dict[str, Any]) -> None:
    """Settings other than Llama 3.1's: config.json gets parameters that may be spelled differently
    (the divisors fix the rule only up to the original context's scale) but give the same
    frequencies, hence the same logits; and the scaling matters here (unscaled logits differ)."""
    model = _tiny("llama", rope_theta=theta, rope_scaling=dict(rope), head_dim=32)
    config = _check_parity(model, tmp_path, "llama")
    got = config["rope_scaling"]
    assert got["rope_type"] == "llama3" and got["factor"] == rope["factor"]
    np.testing.assert_allclose(llama3_divisors(got, theta, 32), llama3_divisors(rope, theta, 32), rtol=1e-6)
    plain = _tiny("llama", rope_theta=theta, head_dim=32)
    assert (_theirs(plain) - _theirs(model)).abs().max() > 1e-3  # 100 times the tolerance above


def test_rope_freqs_without_a_smoothed_band_and_those_following_no_rule() -> None:
    # no wavelength between L / high and L / low (62.8 and 111.7 around 66.7..100): thresholds anywhere between
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.5, "original_max_position_embeddings": 100}
    divisors = llama3_divisors(rope, 10000.0, 32).astype(np.float32)
    assert set(divisors.tolist()) == {1.0, 8.0}
    got = rope_scaling_from_freqs(divisors, 10000.0, 32)
    assert got is not None and got["rope_type"] == "llama3"
    np.testing.assert_array_equal(llama3_divisors(got, 10000.0, 32), divisors)
    assert rope_scaling_from_freqs(np.ones(8, dtype=np.float32), 10000.0, 16) is None
    assert rope_scaling_from_freqs(np.full(8, 2.0, dtype=np.float32), 10000.0, 16) == \
        {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="does not follow Llama 3's rope scaling rule"):
        rope_scaling_from_freqs(np.array([1, 3, 1, 2, 8, 1, 8, 8], dtype=np.float32), 10000.0, 16)
    with pytest.raises(ValueError, match="has 4 values, expected rope dim / 2 = 8"):
        rope_scaling_from_freqs(np.ones(4, dtype=np.float32), 10000.0, 16)


# ------------------------------------------------------------------------------ qwen2 / qwen3
@pytest.mark.parametrize("tied,qtype", [(True, F32), (False, F16)], ids=["tied-f32", "untied-f16"])
def test_qwen2_gguf_gives_the_hf_folders_logits(tmp_path: Path, tied: bool, qtype) -> None:
    """q/k/v biases, rows not permuted, rope theta from the metadata."""
    model = _tiny("qwen2", tied=tied, rope_theta=1000000.0)
    if qtype == F16:  # the HF reference holds the values the file can: float16-rounded weights
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 2:
                    p.copy_(p.half().float())
    config = _check_parity(model, tmp_path, "qwen2", qtype=qtype, pre="qwen2")
    assert (config["model_type"], config["tie_word_embeddings"], config["rope_theta"]) == ("qwen2", tied, 1e6)
    assert TargetConfig.from_dict(config).attention_bias


def test_qwen3_gguf_gives_the_hf_folders_logits(tmp_path: Path) -> None:
    """Per-head q/k norms (attn_q_norm / attn_k_norm), a head dim that is not hidden / heads."""
    model = _tiny("qwen3", tied=True, head_dim=32, rope_theta=1000000.0)
    config = _check_parity(model, tmp_path, "qwen3", pre="qwen2")
    assert (config["model_type"], config["head_dim"]) == ("qwen3", 32)
    assert TargetConfig.from_dict(config).qk_norm


def test_qwen2_native_int4_keeps_biases_and_row_order(tmp_path: Path) -> None:
    """Q4_0 weights in a qwen2 file: neither the dense rows nor the int4 side file's are unpermuted
    (the file never was permuted) and the biases stay, so both compute what transformers computes
    with the Q4_0-rounded weights."""
    model = _tiny("qwen2", tied=False)
    _write(model, tmp_path / "m.gguf", "qwen2", qtype=Q40, pre="qwen2")
    out = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "conv", dtype=torch.float32)
    with torch.no_grad():  # the reference: every 2-D weight as Q4_0 stores it (blocks run along rows)
        for p in model.parameters():
            if p.ndim == 2:
                q = gguf.quants.quantize(p.numpy(), Q40)
                p.copy_(torch.from_numpy(np.array(gguf.quants.dequantize(q, Q40), dtype=np.float32)))
    ref = _theirs(model)
    torch.testing.assert_close(_ours(out), ref, rtol=1e-4, atol=1e-4)
    int4, cfg = load_target(out, torch.float32, torch.device("cpu"), 64, quantization="int4")
    assert int4.quantization == "int4" and int4.layers[0].self_attn.qkv_proj.bias is not None
    torch.testing.assert_close(_augury_logits(int4, cfg, PROMPT, torch.float32), ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------- Mistral
def test_mistral_style_llama_files(tmp_path: Path) -> None:
    """llama.cpp converts HF Mistral to the llama architecture (no window written): that is a llama
    config with the same logits. A llama file that does carry a sliding window becomes HF's Mistral
    with that window (augury caps the context at it)."""
    model = _tiny("mistral", sliding_window=None)
    config = _check_parity(model, tmp_path / "plain", "llama", name="Mistral")
    assert config["model_type"] == "llama"

    # a window past the prompt: augury caps the context at it where the engine is built (builder.py)
    windowed = _tiny("mistral", sliding_window=128)
    config = _check_parity(windowed, tmp_path / "window", "llama", name="Mistral", window=128)
    assert (config["model_type"], config["sliding_window"]) == ("mistral", 128)
    assert TargetConfig.from_dict(config).sliding_window == 128


def _minimal(path: Path, arch: str, **meta: Any) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_refused_architectures_and_settings_say_why(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'mistral3' \(Mistral 3's YaRN rope.*supported: 'llama', 'qwen2', 'qwen3'"):
        convert_gguf_to_hf(_minimal(tmp_path / "m3.gguf", "mistral3"), tmp_path / "out")
    model = _tiny("qwen2")
    _write(model, tmp_path / "w.gguf", "qwen2", window=16, pre="qwen2")
    with pytest.raises(ValueError, match="sliding-window attention is not supported for GGUF architecture 'qwen2'"):
        convert_gguf_to_hf(tmp_path / "w.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ tokenizer
def test_bpe_pre_tokenizer_types_reach_the_tokenizer(tmp_path: Path) -> None:
    """The file's pre-tokenizer type decides how text splits before BPE: Llama 3's ("llama-bpe")
    keeps up to 3 digits together, Qwen2's ("qwen2") splits every digit. With a merge "1 2" in the
    vocabulary, "123" is then "12" + "3" for one and "1" + "2" + "3" for the other."""
    byte_tokens = list(bytes_to_unicode().values())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = byte_tokens + ["12"] + specials
    types = [1] * (len(vocab) - 3) + [3] * 3
    merges = ["1 2"]
    ids = {t: i for i, t in enumerate(vocab)}
    for arch, pre, want in [("llama", "llama-bpe", ["12", "3"]), ("qwen2", "qwen2", ["1", "2", "3"])]:
        model = _tiny(arch, vocab_size=len(vocab), bos_token_id=len(vocab) - 3, eos_token_id=len(vocab) - 1)
        _write(model, tmp_path / f"{arch}.gguf", arch, pre=pre, tokens=(vocab, types, merges))
        out = convert_gguf_to_hf(tmp_path / f"{arch}.gguf", tmp_path / arch, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(out)
        assert tok("123", add_special_tokens=False)["input_ids"] == [ids[t] for t in want], arch
        assert tok("<|im_end|>", add_special_tokens=False)["input_ids"] == [ids["<|im_end|>"]]
        assert tok.decode([ids["12"], ids["3"]]) == "123"
