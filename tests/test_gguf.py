"""GGUF -> HF conversion on tiny random Llamas written to GGUF by the test itself.

References: the original HF model, and transformers' own GGUF loading of the same file.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from augury.models.gguf import convert_gguf_to_hf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
GGUF_NAMES = {  # HF module under model.layers.N -> GGUF short name in blk.N
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _tokens() -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary: 256 byte symbols, two merges, three control tokens."""
    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 1 NORMAL, 3 CONTROL
    return tokens, types


def _permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K permutation: per head, rows (2 halves, hd/2) -> (hd/2 pairs, 2)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tiny_model(tied: bool, rope_scaling: dict | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(_tokens()[0]), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=tied,
        bos_token_id=len(_tokens()[0]) - 2, eos_token_id=len(_tokens()[0]) - 1,
        rope_scaling=rope_scaling,
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # random norms, so a wrong norm mapping shows up in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _write_gguf(model: LlamaForCausalLM, path: Path, qtype: gguf.GGMLQuantizationType,
                linear_factor: float | None = None,
                tensor_types: dict[str, gguf.GGMLQuantizationType] | None = None,
                written: dict[str, np.ndarray] | None = None) -> None:
    """tensor_types: GGUF short name ("attn_q", "token_embd", ...) -> quant type, overriding qtype;
    K-quant tensors get random valid blocks (see _quantized), not the model's weights.
    written: filled with each 2-D tensor's raw bytes as stored."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if linear_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_factor)
    tokens, types = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_chat_template(CHAT_TEMPLATE)

    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}

    def add(name: str, array: np.ndarray) -> None:
        # 2-D weights may be quantised; norms stay F32 as llama.cpp keeps them.
        kind = (tensor_types or {}).get(name.split(".")[-2], qtype)
        if array.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            data = _quantized(kind, array, seed=len(written or {}))
            w.add_tensor(name, data, raw_dtype=kind)
        else:
            data = array
            w.add_tensor(name, array)
        if written is not None and array.ndim == 2:
            written[name] = data

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, short in GGUF_NAMES.items():
            array = state[f"model.layers.{i}.{hf}.weight"]
            if short == "attn_q":
                array = _permute_rope_rows(array, cfg.num_attention_heads)
            elif short == "attn_k":
                array = _permute_rope_rows(array, cfg.num_key_value_heads)
            add(f"blk.{i}.{short}.weight", array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


IDS = torch.tensor([[5, 70, 256, 257, 33, 100, 259, 12, 200, 44, 9, 3]])


@pytest.mark.parametrize("tied,qtype", [(True, gguf.GGMLQuantizationType.F32),
                                        (False, gguf.GGMLQuantizationType.Q8_0)],
                         ids=["tied-f32", "untied-q8_0"])
def test_matches_transformers_gguf_loading(tmp_path: Path, tied: bool,
                                           qtype: gguf.GGMLQuantizationType) -> None:
    model = _tiny_model(tied)
    path = tmp_path / "tiny.gguf"
    _write_gguf(model, path, qtype)
    out = convert_gguf_to_hf(path, tmp_path / "hf", dtype=torch.float32)

    files = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(files)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # staging folder renamed away
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert config["rope_theta"] == 50000.0 and config["rms_norm_eps"] == 1e-5
    assert (config["num_key_value_heads"], config["torch_dtype"]) == (2, "float32")

    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    got, ref = _logits(ours, IDS), _logits(model, IDS)  # [1, 12, vocab]
    if qtype == gguf.GGMLQuantizationType.F32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:  # Q8_0 rounding: close, not exact
        assert (got - ref).abs().max() < 0.05 * ref.abs().max()

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "he"}], tokenize=False) == \
        "<|im_start|>he<|im_end|>"
    assert tok("the")["input_ids"] == [_byte_index("t"), 257]  # "t" + merged "he"

    # transformers' own GGUF loader dequantises the same file: must agree to float rounding.
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers' GGUF loading needs accelerate")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    torch.testing.assert_close(got, _logits(theirs, IDS), rtol=1e-5, atol=1e-5)


def _byte_index(ch: str) -> int:
    return list(bytes_to_unicode().values()).index(ch)


def test_linear_rope_scaling(tmp_path: Path) -> None:
    model = _tiny_model(tied=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    _write_gguf(model, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.F32, linear_factor=2.0)
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(ours, IDS), _logits(model, IDS), rtol=1e-5, atol=1e-5)


def test_bfloat16_default(tmp_path: Path) -> None:
    model = _tiny_model(tied=True)
    _write_gguf(model, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.F32)
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ours = AutoModelForCausalLM.from_pretrained(out)
    assert ours.dtype == torch.bfloat16
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(tmp_path / "tiny.gguf", out)


def test_not_gguf_raises(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        convert_gguf_to_hf(bad, tmp_path / "out")
    with pytest.raises(ValueError, match="does not exist"):
        convert_gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_raises(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        convert_gguf_to_hf(path, tmp_path / "out")


def test_unsupported_quant_type_raises(tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.zeros((4,), dtype=np.int32))  # I32: no dequantizer
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="unsupported quant type I32"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------- quantised tensor types
QT = gguf.GGMLQuantizationType
QUANT_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K]
# Byte ranges of a K-quant block's float16 super-block scales (the rest are packed codes and
# 6-/8-bit sub-block scales, valid whatever their bits): Q4_K d, dmin first; Q6_K d last.
_F16_FIELDS = {QT.Q4_K: [(0, 2), (2, 4)], QT.Q6_K: [(208, 210)]}


def _quantized(qtype: gguf.GGMLQuantizationType, array: np.ndarray, seed: int = 0) -> np.ndarray:
    """array [rows, cols] float32 -> its GGUF blocks as bytes [rows, cols / block * block_bytes].

    The gguf package quantises the legacy types; it cannot quantise K-quants, whose blocks are
    built here instead: random bytes with finite random float16 scales (the array's values are
    then not used)."""
    if qtype not in _F16_FIELDS:
        return gguf.quants.quantize(array, qtype)
    rows, cols = array.shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block == 0
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for a, b in _F16_FIELDS[qtype]:
        scale = rng.uniform(-0.05, 0.05, (rows, cols // block)).astype(np.float16)
        raw[..., a:b] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _reference(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """The gguf package's own dequantisation of the bytes written, float32."""
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape))


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype == torch.float32 and got.shape == want.shape and \
        torch.equal(got.contiguous().view(torch.int32), want.contiguous().view(torch.int32))


def test_quant_types_dequantise_bit_for_bit(tmp_path: Path) -> None:
    """One file holding every type (shapes differ, F32 and F16 tensors in between shift the
    offsets): each tensor loads exactly as gguf.quants.dequantize reads its bytes."""
    from augury.models.gguf import _load_tensor, _open

    rng = np.random.default_rng(0)
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    written: dict[str, tuple[np.ndarray, QT, tuple[int, int]]] = {}
    for i, qtype in enumerate(QUANT_TYPES):
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        shape = (3 + 2 * i, block * (2 + i % 3))  # [rows, cols]: never square, several blocks a row
        raw = _quantized(qtype, rng.standard_normal(shape).astype(np.float32), seed=i)
        w.add_tensor(f"t{i}.{qtype.name}", raw, raw_dtype=qtype)
        written[f"t{i}.{qtype.name}"] = (raw, qtype, shape)
        w.add_tensor(f"pad{i}", rng.standard_normal(7 + i).astype(np.float32 if i % 2 else np.float16))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

    tensors = {t.name: t for t in _open(path).tensors}
    for name, (raw, qtype, shape) in written.items():
        assert tensors[name].tensor_type == qtype
        want = _reference(raw, qtype, shape)
        assert torch.isfinite(want).all() and want.unique().numel() > shape[1], name  # not degenerate
        got = _load_tensor(tensors[name], torch.float32)
        assert _same_bits(got, want), (name, (got - want).abs().max())
        assert torch.equal(_load_tensor(tensors[name], torch.bfloat16), want.to(torch.bfloat16)), name


def _wide_model() -> LlamaForCausalLM:
    """Every weight's input width a multiple of 256, as K-quant blocks need."""
    torch.manual_seed(0)
    n = len(_tokens()[0])
    config = LlamaConfig(vocab_size=n, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=n - 2, eos_token_id=n - 1)
    return LlamaForCausalLM(config).float().eval()


def test_mixed_quant_types_convert_bit_for_bit(tmp_path: Path) -> None:
    """A whole model, each weight in another of the six types (Q and K rows permuted by
    llama.cpp): every HF tensor the converter writes (float32) is the gguf package's
    dequantisation of its GGUF tensor, bit for bit, with the Q/K permutation undone."""
    from safetensors.numpy import load_file

    model = _wide_model()
    # the K-quants on the permuted Q and K rows (Q8_0 there: test_matches_transformers_gguf_loading)
    types = dict(token_embd=QT.Q8_0, output=QT.Q6_K, attn_q=QT.Q4_K, attn_k=QT.Q6_K, attn_v=QT.Q4_0,
                 attn_output=QT.Q4_1, ffn_gate=QT.Q5_0, ffn_up=QT.Q4_K, ffn_down=QT.Q8_0)
    written: dict[str, np.ndarray] = {}
    path = tmp_path / "mixed.gguf"
    _write_gguf(model, path, QT.F32, tensor_types=types, written=written)
    assert set(types.values()) == set(QUANT_TYPES)
    out = convert_gguf_to_hf(path, tmp_path / "hf", dtype=torch.float32)
    hf = {k: torch.from_numpy(v) for k, v in load_file(str(out / "model.safetensors")).items()}

    heads = {"attn_q": 4, "attn_k": 2}
    gguf_of = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    for i in range(2):
        gguf_of.update({f"model.layers.{i}.{m}.weight": f"blk.{i}.{s}.weight" for m, s in GGUF_NAMES.items()
                        if "norm" not in s})
    assert len(written) == len(gguf_of)
    for hf_name, gguf_name in gguf_of.items():
        short = gguf_name.split(".")[-2]
        got = hf[hf_name]
        if short in heads:  # compare in GGUF row order: llama.cpp's own permutation of ours
            got = torch.from_numpy(_permute_rope_rows(got.numpy(), heads[short]))
        want = _reference(written[gguf_name], types[short], tuple(hf[hf_name].shape))
        assert _same_bits(got, want), (hf_name, types[short].name)
    # and the norms, stored F32, are the model's
    torch.testing.assert_close(hf["model.norm.weight"], model.model.norm.weight, rtol=0, atol=0)
