"""Random-weight GGUF files of real model shapes, and random EAGLE-3 heads to match (`augury bench
--workload scale`, bench/scale.py).

A file is written block by block, straight in its quantised form: each tensor's blocks are random
bytes (the codes) with scales chosen so the values have the spread of a trained model's weights
(standard deviation `SIGMA`, mean about 0), so no float copy of the model is ever held (an 8B file
needs one tensor's blocks in memory at a time) and no download or float file is needed. The tensor
types follow llama.cpp's rules for each file type (`tensor_type`): Q4_K_M and Q5_K_M keep attn_v and
ffn_down in Q6_K in the first and last eighth of the layers and every third layer between, the output
layer (or a tied embedding) in Q6_K. A byte-level tokenizer of the vocabulary's size is written too
(256 byte symbols, filler tokens, the last 256 ids special as in Llama 3), so augury's converter
and llama.cpp both load the file. The outputs of random weights mean nothing: time them, ignore EOS.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
SIGMA = 0.02  # the weights' standard deviation (a trained Llama's linears sit near it)
WRITER_VERSION = 1  # in every file name: a change to what is written makes new files, never reuses old ones
LLAMA3_VOCAB = 128256
SPECIALS = 256  # the last ids: <|begin_of_text|>, <|end_of_text|>, ..., <|eot_id|> at +9 (Llama 3's layout)


@dataclass(frozen=True)
class Shape:
    """A Llama's shape (what a GGUF file of it holds)."""

    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # the output layer is the token embedding

    @property
    def q_rows(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.kv_heads * self.head_dim


SHAPES: dict[str, Shape] = {
    "1b": Shape("Llama-3.2-1B", 2048, 16, 8192, 32, 8, 64, tied=True),
    "3b": Shape("Llama-3.2-3B", 3072, 28, 8192, 24, 8, 128, tied=True),
    "8b": Shape("Llama-3.1-8B", 4096, 32, 14336, 32, 8, 128, tied=False),
    "tiny": Shape("tiny (tests, smoke runs)", 256, 2, 512, 4, 2, 64, tied=False),
}
# file type -> (the type of most linears, general.file_type)
FILE_TYPES: dict[str, tuple[QT, gguf.LlamaFileType]] = {
    "q4_0": (QT.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_k_m": (QT.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k_m": (QT.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M),
    "q6_k": (QT.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(file_type: str, role: str, layer: int, layers: int, tied: bool) -> QT:
    """The type llama.cpp gives tensor `role` (token_embd, output, attn_q, ..., ffn_down) of layer
    `layer` in a file of `file_type`."""
    base, _ = FILE_TYPES[file_type]
    if role == "output" or (role == "token_embd" and tied):
        return QT.Q8_0 if base == QT.Q8_0 else QT.Q6_K
    if role in ("attn_v", "ffn_down") and file_type in ("q4_k_m", "q5_k_m") and more_bits(layer, layers):
        return QT.Q6_K
    return base


def plan(shape: Shape, file_type: str, vocab: int) -> list[tuple[str, tuple[int, ...], QT]]:
    """Every tensor of the file: (GGUF name, shape in torch order [rows, columns] or [n], type)."""
    h, f, L = shape.hidden, shape.ffn, shape.layers
    out: list[tuple[str, tuple[int, ...], QT]] = [
        ("token_embd.weight", (vocab, h), tensor_type(file_type, "token_embd", 0, L, shape.tied)),
        ("output_norm.weight", (h,), QT.F32)]
    if not shape.tied:
        out.append(("output.weight", (vocab, h), tensor_type(file_type, "output", 0, L, False)))
    linears = (("attn_q", shape.q_rows, h), ("attn_k", shape.kv_rows, h), ("attn_v", shape.kv_rows, h),
               ("attn_output", h, shape.q_rows), ("ffn_gate", f, h), ("ffn_up", f, h), ("ffn_down", h, f))
    for i in range(L):
        out.append((f"blk.{i}.attn_norm.weight", (h,), QT.F32))
        out.append((f"blk.{i}.ffn_norm.weight", (h,), QT.F32))
        out += [(f"blk.{i}.{role}.weight", (rows, cols), tensor_type(file_type, role, i, L, shape.tied))
                for role, rows, cols in linears]
    return out


# ---------------------------------------------------------------- random blocks
def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float values [..] -> their float16 bytes [.., 2]."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and mins [.., 8] each (llama.cpp's
    get_scale_min_k4, inverted): bytes 0-3 and 4-7 hold sub-blocks 0-3's scale and min in their low
    six bits and the top two bits of 4-7's, bytes 8-11 4-7's low four bits of scale and min."""
    out = np.empty((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((m[..., 4:8] & 0x0F) << 4)
    return out


def random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator, sigma: float = SIGMA) -> np.ndarray:
    """A [rows, cols] tensor of `qtype` as its blocks' bytes, uint8 [rows, cols / block * bytes]: random
    codes, scales drawn around the one that gives values of standard deviation `sigma` and mean about 0
    (each code's spread: Q4_0 (q-8) 4.64, Q8_0 73.9, Q4_K's q 0..15 4.61 times a 6-bit scale of rms 36.8,
    Q5_K's q 0..31 9.23 times the same, Q6_K's q-32 18.5 times an int8 scale of rms ~43; the K-quants'
    mins are their scales, so a block's mean is d sc (mean q) - dmin sc = 0 with dmin = d mean(q))."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % per:
        raise ValueError(f"{qtype.name} needs columns in multiples of {per}, got {cols}")
    nb = cols // per
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)

    def spread(rms: float) -> np.ndarray:  # a block's scale, +-25% around the one of standard deviation sigma
        return sigma / rms * rng.uniform(0.75, 1.25, (rows, nb))

    if qtype == QT.Q4_0:
        raw[..., 0:2] = _f16_bytes(spread(4.64))
    elif qtype == QT.Q8_0:
        raw[..., 0:2] = _f16_bytes(spread(73.9))
    elif qtype in (QT.Q4_K, QT.Q5_K):
        mean_q, rms = (7.5, 4.61) if qtype == QT.Q4_K else (15.5, 9.23)
        d = spread(36.8 * rms).astype(np.float16)
        raw[..., 0:2] = _f16_bytes(d)
        raw[..., 2:4] = _f16_bytes(d.astype(np.float32) * mean_q)  # dmin
        sc = rng.integers(1, 64, (rows, nb, 8), dtype=np.uint8)
        raw[..., 4:16] = _pack_k_scales(sc, sc)
    elif qtype == QT.Q6_K:  # ql 128, qh 64, scales int8 16, d
        sc = rng.integers(16, 65, (rows, nb, 16)) * rng.choice(np.array([-1, 1]), (rows, nb, 16))
        raw[..., 192:208] = sc.astype(np.int8).view(np.uint8)
        raw[..., 208:210] = _f16_bytes(spread(43.3 * 18.5))
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return raw.reshape(rows, nb * size)


def _tensor_bytes(qtype: QT, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One tensor's data as the file stores it (norms: float32 near 1), written in row chunks of ~64 MB."""
    if qtype == QT.F32:
        return rng.uniform(0.8, 1.2, shape).astype(np.float32)
    rows, cols = shape
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    out = np.empty((rows, cols // per * size), dtype=np.uint8)
    step = max(1, (64 << 20) // out.shape[1])
    for r in range(0, rows, step):
        n = min(step, rows - r)
        out[r:r + n] = random_blocks(qtype, n, cols, rng)
    return out


# ---------------------------------------------------------------- files
def _tokens(vocab: int) -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary of `vocab` tokens: the 256 byte symbols, two merges' results,
    filler tokens, and the last SPECIALS ids special (control)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if vocab < 512 + SPECIALS:
        raise ValueError(f"a vocabulary of at least {512 + SPECIALS} tokens, got {vocab}")
    normal = list(bytes_to_unicode().values()) + ["Ġt", "he"]
    normal += [f"t{i}" for i in range(vocab - SPECIALS - len(normal))]
    names = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 9: "<|eot_id|>"}
    specials = [names.get(i, f"<|reserved_special_token_{i}|>") for i in range(SPECIALS)]
    return normal + specials, [1] * len(normal) + [3] * SPECIALS  # 1 NORMAL, 3 CONTROL


def special_ids(vocab: int) -> dict[str, int]:
    """bos, eos and eot ids of a file of this vocabulary."""
    first = vocab - SPECIALS
    return {"bos": first, "eos": first + 1, "eot": first + 9}


def file_name(size: str, file_type: str, vocab: int, seed: int) -> str:
    return f"random-{size}-{file_type}-v{vocab}-s{seed}-w{WRITER_VERSION}.gguf"


def file_bytes(size: str, file_type: str, vocab: int = LLAMA3_VOCAB) -> int:
    """The tensors' bytes of such a file (the header adds the vocabulary's strings, a few MB)."""
    total = 0
    for _, shape, qt in plan(SHAPES[size], file_type, vocab):
        n = int(np.prod(shape))
        total += n * 4 if qt == QT.F32 else n // gguf.GGML_QUANT_SIZES[qt][0] * gguf.GGML_QUANT_SIZES[qt][1]
    return total


def write_gguf(path: str | os.PathLike[str], shape: Shape, file_type: str, vocab: int = LLAMA3_VOCAB,
               seed: int = 0) -> Path:
    """Write a random-weight GGUF file of `shape` in `file_type` (see FILE_TYPES) to `path`, one tensor's
    blocks in memory at a time, through a temporary sibling renamed at the end (a file at `path` is whole)."""
    path = Path(path)
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r}; known: {', '.join(FILE_TYPES)}")
    tensors = plan(shape, file_type, vocab)
    rng = np.random.default_rng(seed)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "llama")
    try:
        w.add_name(f"random {shape.name} {file_type.upper()} (augury bench --workload scale)")
        w.add_file_type(FILE_TYPES[file_type][1])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_block_count(shape.layers)
        w.add_context_length(131072)
        w.add_embedding_length(shape.hidden)
        w.add_feed_forward_length(shape.ffn)
        w.add_head_count(shape.heads)
        w.add_head_count_kv(shape.kv_heads)
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        w.add_rope_dimension_count(shape.head_dim)
        w.add_rope_freq_base(500000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(vocab)
        tokens, types = _tokens(vocab)
        ids = special_ids(vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(["Ġ t", "h e"])
        w.add_bos_token_id(ids["bos"])
        w.add_eos_token_id(ids["eos"])
        for name, dims, qt in tensors:
            if qt == QT.F32:
                w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
            else:
                per, size = gguf.GGML_QUANT_SIZES[qt]
                byte_shape = (dims[0], dims[1] // per * size)
                w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, dims, qt in tensors:
            w.write_tensor_data(_tensor_bytes(qt, dims, rng))
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def ensure_gguf(folder: str | os.PathLike[str], size: str, file_type: str, vocab: int = LLAMA3_VOCAB,
                seed: int = 0) -> tuple[Path, bool]:
    """The file of (size, type, vocabulary, seed) in `folder`, written unless it is there already.
    Returns (path, whether it was written now)."""
    if size not in SHAPES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SHAPES)}")
    path = Path(folder) / file_name(size, file_type, vocab, seed)
    if path.is_file():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf(path, SHAPES[size], file_type, vocab, seed), True


# ---------------------------------------------------------------- EAGLE-3 heads
DRAFT_VOCAB = 32000


def write_eagle3_head(folder: str | os.PathLike[str], shape: Shape, vocab: int = LLAMA3_VOCAB,
                      draft_vocab: int = DRAFT_VOCAB, seed: int = 0) -> Path:
    """A random EAGLE-3 head for a target of `shape` in the layout SGLang and vLLM load
    (LlamaForCausalLMEagle3: config.json and model.safetensors with fc, midlayer.*, norm, lm_head, d2t,
    t2d), bfloat16, weights of standard deviation SIGMA, norms near 1; its draft vocabulary a random
    subset of the target's. Written unless a head of the same config is there."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    h, f, hd = shape.hidden, shape.ffn, shape.head_dim
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": h, "intermediate_size": f, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "head_dim": hd, "rms_norm_eps": 1e-5,
              "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": h,
              "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "augury_random": {"seed": seed, "writer": WRITER_VERSION}}
    cfg_path = folder / "config.json"
    if cfg_path.is_file() and (folder / "model.safetensors").is_file() and json.loads(cfg_path.read_text()) == config:
        return folder
    g = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * SIGMA).to(torch.bfloat16)

    def norm() -> torch.Tensor:
        return (0.8 + 0.4 * torch.rand(h, generator=g)).to(torch.bfloat16)

    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values  # the draft vocabulary's target ids
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {"fc.weight": linear(h, 3 * h), "midlayer.input_layernorm.weight": norm(),
               "midlayer.hidden_norm.weight": norm(),
               "midlayer.self_attn.q_proj.weight": linear(shape.q_rows, 2 * h),
               "midlayer.self_attn.k_proj.weight": linear(shape.kv_rows, 2 * h),
               "midlayer.self_attn.v_proj.weight": linear(shape.kv_rows, 2 * h),
               "midlayer.self_attn.o_proj.weight": linear(h, shape.q_rows),
               "midlayer.post_attention_layernorm.weight": norm(),
               "midlayer.mlp.gate_proj.weight": linear(f, h), "midlayer.mlp.up_proj.weight": linear(f, h),
               "midlayer.mlp.down_proj.weight": linear(h, f), "norm.weight": norm(),
               "lm_head.weight": linear(draft_vocab, h),
               "d2t": ids - torch.arange(draft_vocab), "t2d": t2d}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg_path.write_text(json.dumps(config, indent=2) + "\n")  # last: a config names a whole head
    return folder
