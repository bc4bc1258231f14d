"""GGUF (llama.cpp) -> Hugging Face checkpoint folder, for the `llama`, `qwen2` and `qwen3`
architectures (what each means: models/gguf_arch.py).

The output folder holds config.json, model.safetensors (HF tensor names),
generation_config.json and the tokenizer files (with the chat template), so any
HF-folder loader, ours and transformers' included, can read it. Quantised tensors are
dequantised with the `gguf` package and stored in `dtype`. Both weight files are written a tensor at
a time as it is made (`TensorWriter`), each tensor dequantised or decoded a chunk of rows at a time,
so a conversion holds about one tensor beside the GGUF's mapped pages (a random 1B Q4_0: 1.1 GB peak,
3.9 GB when the whole dense state dict was built before writing).

For the llama architecture, llama.cpp's converter permutes the rows of attn_q / attn_k from
HF's rotate-half RoPE layout (per head: first half of the pairs, then the second half) to the
GGML interleaved layout (per head: pairs adjacent). We undo that here; qwen2 / qwen3 files are
not permuted. A Llama 3.1-style `rope_freqs.weight` becomes config.json's llama3 rope_scaling.

Quantised tensors augury runs natively are also written, unrounded, to a side file (`INT4_FILE`,
described by `INT4_INDEX`: each tensor's kind, models/native.py), rows in HF order (Q/K unpermuted):
- Q4_0 / Q4_1 ("int4"): `<name>.codes` uint8 [N, K/2] (column 2i in the low nibble, 2i+1 in the
  high), `<name>.scale` float16 [N, K/32] and `<name>.zero` float32 [N, K/32], with
  w = (q - 8) * scale + zero, the int4 kernel's convention: Q4_0 (value d*(q-8)) is scale d,
  zero 0; Q4_1 (value d*q + m) is scale d, zero m + 8d.
- Q4_K ("q4k"): codes as int4's, its own scales d and dmin float16 [N, K/256], sc and m uint8
  [N, K/32] (6-bit), w = d * sc * q - dmin * m; Q5_K ("q5k") the same with the codes' fifth bits in
  `<name>.high` uint8 [N, K/8] (bit j of byte i: column 8i + j).
- Q6_K ("q6k"): codes int8 q - 32 [N, K], d float16 [N, K/256], sub int8 [N, K/16], w = d * sub * q.
- Q8_0, Q5_0, Q5_1 ("q8g"): codes int8 [N, K], scale float32 [N, K/32], and where the
  format has them zero float32 [N, K/32] and sub int8 [N, K/16], w = scale * sub * q + zero, exact
  (models/gguf_blocks.py).
Other types (IQ*, Q2_K, Q3_K, ...) are only in the dense file; the loader runs them dense and says so.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from augury.models import gguf_blocks
from augury.models.checkpoint import TensorWriter
from augury.models.gguf_arch import ROPE_FREQS, arch_spec, expected_shapes, hf_name, read_config
from augury.models.quant import INT4_FILE, INT4_FORMAT, INT4_INDEX

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}
_MISSING = object()
_SIDE_PARTS = ("codes", "scale", "zero", "sub", "d", "dmin", "sc", "m", "high")  # a native tensor's, at most
_Q4_TYPES = {gguf.GGMLQuantizationType.Q4_0: "Q4_0", gguf.GGMLQuantizationType.Q4_1: "Q4_1"}
_QK4 = 32  # elements per Q4_0 / Q4_1 block
_CHUNK_ROWS = 2048  # rows dequantised or decoded at a time


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError...
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def _meta(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    traits = getattr(gguf.quants, "_type_traits", None)
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return True
    return traits is None or qtype in traits  # without the registry, dequantize() is the judge


def _unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's Q/K row permutation.

    w: [n_head * head_dim, in]. GGUF order per head is (head_dim/2 pairs, 2); HF order is
    (2 halves, head_dim/2). Returns [n_head * head_dim, in] in HF order.
    """
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _repack_q4(qtype: gguf.GGMLQuantizationType, data: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of Q4_0 / Q4_1 blocks (uint8 [N, K/32 * block bytes]) -> codes [N, K/2] uint8, scale
    [N, K/32] float16 (d, exact), zero [N, K/32] float32 (0, or m + 8d rounded once), so that
    (q - 8) * scale + zero is the block's value: Q4_0 d*(q-8), Q4_1 d*q + m."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    rows = data.shape[0]
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, -1, block_bytes)
    cols = blocks.shape[1] * _QK4
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [N, K/32]
    if qtype == gguf.GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        zero = (m.astype(np.float64) + 8.0 * d.astype(np.float64)).astype(np.float32)
        qs = blocks[..., 4:]
    else:
        zero = np.zeros(d.shape, dtype=np.float32)
        qs = blocks[..., 2:]
    # element j of a block: byte j's low nibble (j < 16), byte j-16's high nibble (j >= 16)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # [N, K] 0..15
    codes = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # [N, K/2]
    return {"codes": codes, "scale": d.copy(), "zero": zero}


def _native_rows(qtype: gguf.GGMLQuantizationType, data: np.ndarray) -> tuple[str | None, dict[str, np.ndarray]]:
    """(kind, side-file parts) of rows of a tensor augury runs natively (uint8 [N, row bytes]), or
    (None, {}) for another type."""
    if qtype in _Q4_TYPES:
        return "int4", _repack_q4(qtype, data)
    if qtype not in gguf_blocks.DECODERS:
        return None, {}
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = np.asarray(data, dtype=np.uint8).reshape(data.shape[0], -1, block_bytes)
    kind, parts = gguf_blocks.decode(blocks, qtype)
    if kind in ("q4k", "q5k"):  # the low four bits two a byte, as int4's; Q5_K's fifth bits eight a byte
        q = parts["codes"]
        parts["codes"] = ((q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)).astype(np.uint8)
        if kind == "q5k":
            parts["high"] = np.packbits(q >> 4, axis=1, bitorder="little")  # [N, K/8]: bit j of byte i = k 8i + j
    return kind, parts


def _native_parts(t: Any) -> tuple[str | None, dict[str, torch.Tensor]]:
    """(kind, side-file parts) of a 2-D tensor augury runs natively, or (None, {}) for another type,
    decoded _CHUNK_ROWS rows at a time (one chunk's temporaries beside the parts)."""
    data = t.data.reshape(int(t.shape.tolist()[-1]), -1)  # [rows, row bytes]
    kind, pieces = None, []
    for a in range(0, data.shape[0], _CHUNK_ROWS):
        kind, parts = _native_rows(t.tensor_type, data[a:a + _CHUNK_ROWS])
        if kind is None:
            return None, {}
        pieces.append(parts)
    if len(pieces) == 1:
        return kind, {k: torch.from_numpy(v) for k, v in pieces[0].items()}
    return kind, {k: torch.from_numpy(np.concatenate([p.pop(k) for p in pieces])) for k in list(pieces[0])}


def _load_tensor(t: Any, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor -> torch tensor in `dtype`, shape in torch order (GGUF lists dims reversed),
    dequantised _CHUNK_ROWS rows at a time (float32 temporaries of one chunk, not of the tensor)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    rows = shape[0] if len(shape) > 1 else 1
    data = t.data.reshape(rows, -1)
    out = torch.empty((rows, int(np.prod(shape)) // rows), dtype=dtype)
    for a in range(0, rows, _CHUNK_ROWS):
        try:
            array = gguf.quants.dequantize(data[a:a + _CHUNK_ROWS], t.tensor_type)  # float32 (or float16 view)
        except NotImplementedError as e:
            raise ValueError(f"tensor {t.name!r} has unsupported quant type {t.tensor_type.name}") from e
        out[a:a + _CHUNK_ROWS] = torch.from_numpy(np.array(array, dtype=np.float32).reshape(len(array), -1))  # writable
    return out.reshape(shape)


def _save_tokenizer(gguf_path: Path, reader: gguf.GGUFReader, out: Path) -> None:
    """Builds the tokenizer through transformers' GGUF support and saves it (with chat template)."""
    from transformers import AutoTokenizer  # heavy import, only needed here

    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError(f"{gguf_path} has no tokenizer (tokenizer.ggml.tokens missing)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise ValueError(f"could not build a tokenizer from {gguf_path} ({type(e).__name__}: {e})") from e
    template = _meta(reader, "tokenizer.chat_template", None)
    if template is not None and tokenizer.chat_template != template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))


def convert_gguf_to_hf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Converts a llama / qwen2 / qwen3 GGUF file into a Hugging Face checkpoint folder.

    Everything is written into a temporary sibling folder that is renamed onto
    `out_dir` at the end, so `out_dir` either is complete or does not exist.
    Raises ValueError for a non-GGUF file, another architecture, an unsupported
    quant type or tensor; FileExistsError if `out_dir` already exists.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {list(_DTYPE_NAMES)}")
    if out_dir.exists():
        raise FileExistsError(f"output folder {out_dir} already exists; remove it or choose another")
    reader = _open(gguf_path)
    arch = _meta(reader, "general.architecture", None)
    spec = arch_spec(arch, str(gguf_path))

    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if not _dequantizable(t.tensor_type):
            raise ValueError(f"tensor {t.name!r} has unsupported quant type {t.tensor_type.name}")
    if "token_embd.weight" not in by_name:
        raise ValueError(f"{gguf_path}: tensor 'token_embd.weight' is missing")
    vocab_rows = int(by_name["token_embd.weight"].shape[-1])  # GGUF shape is [hidden, vocab]
    freqs = by_name.pop(ROPE_FREQS, None)  # Llama 3.1-style rope scaling: into config.json, not a weight
    config = read_config(lambda key, *default: _meta(reader, key, *default), arch, spec, vocab_rows,
                         tied="output.weight" not in by_name,
                         rope_freqs=None if freqs is None else _load_tensor(freqs, torch.float32).numpy())
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    expected = expected_shapes(config, spec)

    hf_to_gguf = {hf_name(name, arch): name for name in by_name}
    missing = sorted(set(expected) - set(hf_to_gguf))
    extra = sorted(set(hf_to_gguf) - set(expected))
    if missing or extra:
        raise ValueError(f"{gguf_path}: tensors missing {missing[:5]} / unexpected {extra[:5]}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    writers: list[TensorWriter] = []
    try:
        # each tensor written as it is made: one tensor's dense and native forms in memory at a time
        dense_file = TensorWriter(staging / "model.safetensors", list(expected), {"format": "pt"})
        writers.append(dense_file)
        side_names = [f"{n}.{part}" for n in expected for part in _SIDE_PARTS]
        int4 = TensorWriter(staging / INT4_FILE, side_names, {"format": INT4_FORMAT})
        writers.append(int4)
        source_types: dict[str, str] = {}
        kinds: dict[str, str] = {}
        for name, shape in expected.items():
            t = by_name[hf_to_gguf[name]]
            w = _load_tensor(t, dtype)
            if tuple(w.shape) != shape:
                raise ValueError(f"tensor {name} has shape {tuple(w.shape)}, expected {shape}")
            source_types[name] = t.tensor_type.name
            kind, parts = _native_parts(t) if len(shape) == 2 else (None, {})
            if kind is not None:
                kinds[name] = kind
            heads = None
            if spec.permuted_qk and name.endswith("self_attn.q_proj.weight"):  # [heads * head_dim, hidden]
                heads = config["num_attention_heads"]
            elif spec.permuted_qk and name.endswith("self_attn.k_proj.weight"):  # [kv_heads * head_dim, hidden]
                heads = config["num_key_value_heads"]
            if heads is not None:  # rows permute: so do the int4 rows with their codes and groups
                w = _unpermute_rope_rows(w, heads)
                parts = {k: _unpermute_rope_rows(v, heads) for k, v in parts.items()}
            dense_file.add(name, w)
            for k, v in parts.items():
                int4.add(f"{name}.{k}", v)
            del w, parts
        dense_file.close()
        int4.close()
        if not kinds:
            (staging / INT4_FILE).unlink()
        else:
            index = {"format": INT4_FORMAT, "file": INT4_FILE, "group_size": _QK4,
                     "value": {"int4": "(q - 8) * scale + zero", "q4k": "d * sc * q - dmin * m",
                               "q5k": "d * sc * (q + 16 * high) - dmin * m", "q6k": "d * sub * q",
                               "q8g": "scale * sub * q + zero"},
                     "int4": sorted(n for n, k in kinds.items() if k == "int4"),
                     "kinds": kinds, "source_types": source_types}
            (staging / INT4_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        _save_tokenizer(gguf_path, reader, staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        # mkdtemp makes the folder 0700 (and safetensors writes 0600): give it ordinary modes.
        os.chmod(staging, 0o755)
        for f in staging.iterdir():
            os.chmod(f, 0o644)
        os.rename(staging, out_dir)  # atomic on one filesystem; fails if out_dir appeared meanwhile
    except BaseException:
        for writer in writers:
            writer.abandon()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
