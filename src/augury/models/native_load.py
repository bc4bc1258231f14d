"""A GGUF conversion's native linears, each read once from the side file into its kernel's layout.

models/loader.load_target builds the target on the meta device, then `swap_in` builds every linear
the side file (gguf.INT4_FILE) can run natively, one at a time: its tensors' blocks read from the
file's mmap (this rank's part under tensor parallelism), packed for its kernel (models/native.py),
put in the model's place; only the temporaries of one linear live beside the weights built so far.
No dense copy of those linears is ever made, nor of the token embedding where it stays in its GGUF
type (models/native_embed.py: bfloat16 on the CPU, unsharded, and a tied output layer built natively).
The output layer is built first, in its own type and exactly (native_embed.output_layer: Q8_0 on the
w8a8 output kernel's panels, Q6_K / Q4_K / Q5_K on their native linears, float32 logits), a chunk of
rows at a time; a tied model's embedding then looks its rows up in that same module (one copy of the
vocabulary matrix), an untied one's is packed from its own tensor. The loader then materialises and
copies only what is left (norms, linears with no native kind, an embedding kept dense), and `finish`
gives those linears their fallbacks (the output layer on the w8a8 kernel or fbgemm, Q8_0 as int8 per
channel), which need the dense weights. The codes travel as uint8 (a byte a code) until packed.
"""
from __future__ import annotations

import ctypes
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from augury.models import native, quant
from augury.models.dense import packed_output_layer
from augury.models.llama import TargetModel
from augury.models.native_embed import NativeOutputLinear, PackedEmbedding, output_layer
from augury.models.checkpoint import TensorFile, shard_part
from augury.models.quant import INT4_FILE, INT4_FORMAT, INT4_INDEX

log = logging.getLogger(__name__)
_FLOAT_SOURCES = ("F32", "F16", "BF16")
EMBEDDING = "model.embed_tokens.weight"


@dataclass
class NativePlan:
    """What swap_in did: the checkpoint names the native linears hold (the dense copy skips them), the
    linears left to finish() (path -> their checkpoint names), how many run natively so far."""

    sources: dict[str, str]
    covered: set[str] = field(default_factory=set)
    left: dict[str, tuple[str, ...]] = field(default_factory=dict)
    tried: set[str] = field(default_factory=set)  # left paths whose native build was tried: no fallback
    count: int = 0


def read_index(folder: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(kind of each native tensor, GGUF type of every tensor) from the conversion's index."""
    index = json.loads((folder / INT4_INDEX).read_text())
    if index.get("format") not in quant.INT4_FORMATS or index.get("group_size") != quant.INT4_GROUP:
        raise ValueError(f"{folder / INT4_INDEX}: format {index.get('format')!r}, group {index.get('group_size')!r} "
                         f"is not {INT4_FORMAT!r} with groups of {quant.INT4_GROUP}")
    kinds: dict[str, str] = index.get("kinds") or {n: "int4" for n in index.get("int4", [])}
    return kinds, index.get("source_types", {})


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K/2] uint8 (INT4_FILE's layout: column 2i the low nibble, 2i+1 the high) -> [N, K] uint8."""
    c = codes.numpy()
    return torch.from_numpy(np.stack((c & 0x0F, c >> 4), axis=-1).reshape(c.shape[0], -1))


def _read_parts(f: TensorFile, stored: set[str], name: str, kind: str, part) -> dict[str, torch.Tensor]:
    """One tensor's native parts from the open side file (codes unpacked, a byte a code)."""
    g = quant.INT4_GROUP
    out = {k: f.part(f"{name}.{k}", part, per) for k, per in
           (("codes", 2 if kind in ("int4", "q4k", "q5k") else 1), ("scale", g), ("zero", g),
            ("sub", g // 2), ("d", 8 * g), ("dmin", 8 * g), ("sc", g), ("m", g), ("high", 8))
           if f"{name}.{k}" in stored}
    if kind in ("int4", "q4k", "q5k"):
        out["codes"] = unpack_nibbles(out["codes"])
    if "high" in out:  # Q5_K's fifth bits, eight a byte
        bits = np.unpackbits(out.pop("high").numpy(), axis=1, bitorder="little")
        out["codes"] |= torch.from_numpy(bits) << 4
    return out


_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None


def release_freed_memory() -> None:
    """Hands the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere). Freed
    temporaries under glibc's mmap threshold (which grows to 32 MiB once a larger block is freed) stay
    in the heap, and a load's mix of sizes leaves ~150 MiB of them resident on a 1B model."""
    if _TRIM is not None:
        _TRIM(0)


def _put(model: TargetModel, path: str, new: torch.nn.Module, device: torch.device) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new.to(device))


def _dense_module(model: TargetModel, path: str) -> torch.nn.Module:
    # tied and not yet given its own copy: the output layer reads the embedding
    return model.embed_tokens if path == "lm_head" and model.lm_head is None else model.get_submodule(path)


def _output_layer(model: TargetModel, f: TensorFile, stored: set[str], name: str, kind: str, dense: torch.nn.Module,
                  dtype: torch.dtype, device: torch.device) -> torch.nn.Module | None:
    """The output layer from GGUF tensor `name` in its own type (native_embed.output_layer), this rank's
    vocabulary rows read a chunk at a time."""
    total = f.shape(f"{name}.codes")[0]
    part = None if model.shard is None else shard_part(name, model.full_cfg, model.shard)
    lo, hi = (0, total) if part is None else part[1:3]
    vocab, hidden = dense.weight.shape
    if hi - lo != vocab:
        raise ValueError(f"{INT4_FILE}: {name} gives {hi - lo} rows, expected {vocab}")
    new = output_layer(kind, lambda a, b: _read_parts(f, stored, name, kind, (0, lo + a, lo + b, total)), vocab,
                       dtype, device)
    if new is not None and new.in_features != hidden:
        raise ValueError(f"{INT4_FILE}: {name} has {new.in_features} columns, expected {hidden}")
    return new


def _pack_embedding(model: TargetModel, kind: str | None, f: TensorFile, stored: set[str], plan: NativePlan,
                    tied: bool, dtype: torch.dtype, device: torch.device) -> None:
    """The token embedding kept in its GGUF type (models/native_embed.py), no dense copy made: where it
    has a native kind, the model runs bfloat16 on the CPU, whole (a tensor-parallel rank keeps its
    vocabulary rows dense) and, tied, its output layer was built natively (else that layer reads the
    dense table, which stays). Tied, it looks its rows up in the output layer's own module where that
    holds the GGUF type's values (native_embed.output_layer's); else it is read and packed a chunk of
    rows at a time."""
    if kind is None or model.shard is not None or model.lm_head is None or dtype != torch.bfloat16 \
            or device.type != "cpu":
        return
    vocab, hidden = model.embed_tokens.weight.shape
    if (got := f.shape(f"{EMBEDDING}.codes")[0]) != vocab:
        raise ValueError(f"{INT4_FILE}: {EMBEDDING} has {got} rows, expected {vocab}")
    head = model.lm_head
    if tied and isinstance(head, (NativeOutputLinear, quant.W8A8OutputLinear)) and head.out_features == vocab:
        new = PackedEmbedding(head.inner if isinstance(head, NativeOutputLinear) else head, vocab)
    else:
        new = PackedEmbedding.build(kind, lambda a, b: _read_parts(f, stored, EMBEDDING, kind, (0, a, b, vocab)),
                                    vocab, dtype, device, plan.sources.get(EMBEDDING))
    release_freed_memory()
    if new is None:
        return
    if new.embedding_dim != hidden:
        raise ValueError(f"{INT4_FILE}: {EMBEDDING} has {new.embedding_dim} columns, expected {hidden}")
    _put(model, "embed_tokens", new, device)
    plan.covered.add(EMBEDDING)


def fused_linears(model: TargetModel) -> dict[str, tuple[str, ...]]:
    """Module path of each linear in the target -> the HF weights whose rows it concatenates."""
    out: dict[str, tuple[str, ...]] = {}
    for i in range(len(model.layers)):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        out[m + "self_attn.qkv_proj"] = tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")
        out[m + "self_attn.o_proj"] = (p + "self_attn.o_proj.weight",)
        out[m + "mlp.gate_up_proj"] = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        out[m + "mlp.down_proj"] = (p + "mlp.down_proj.weight",)
    out["lm_head"] = ("model.embed_tokens.weight",) if model.cfg.tie_word_embeddings else ("lm_head.weight",)
    return out


def swap_in(model: TargetModel, folder: Path, dtype: torch.dtype, device: torch.device,
            read_dense: Callable[[str], torch.Tensor]) -> NativePlan:
    """Builds each linear the side file runs natively and puts it in `model` (still on the meta device
    elsewhere): Q4_0/Q4_1 as int4, Q4_K on w4a8's super-block form, Q8_0/Q6_K/Q5_* on w8a8's forms,
    all in their exact values (int4 scales rounded to `dtype`); an output layer of those kinds other
    than Q4 in its own type (native_embed.output_layer: Q8_0 on the w8a8 output kernel as it is), and a
    tied model's embedding over that same module. `read_dense` reads a checkpoint tensor (this rank's
    part) for the biases."""
    kinds, sources = read_index(folder)
    plan = NativePlan(sources)
    shard = model.shard
    tied = model.lm_head is None
    with TensorFile(folder / INT4_FILE) as f:
        stored = set(f.keys())

        def read(n: str) -> dict[str, torch.Tensor]:
            return _read_parts(f, stored, n, kinds[n], None if shard is None else shard_part(n, model.full_cfg, shard))

        linears = fused_linears(model)
        # the output layer first: its temporaries (the whole vocabulary's codes) beside the fewest weights;
        # then the embedding's, for the same reason
        for path in ["lm_head", "embed_tokens", *(p for p in linears if p != "lm_head")]:
            if path == "embed_tokens":
                _pack_embedding(model, kinds.get(EMBEDDING), f, stored, plan, tied, dtype, device)
                continue
            names = linears[path]
            dense = _dense_module(model, path)
            part_kinds = [kinds.get(n, "dense") for n in names]
            # a tensor-parallel rank's part holds whole groups of 32 along the input (of 256 for the K-quants)
            whole = shard is None or all(
                p is None or p[0] == 0 or (p[1] % w == 0 and p[2] % w == 0) for p, w in
                ((shard_part(n, model.full_cfg, shard), 256 if kinds.get(n) in ("q4k", "q5k", "q6k") else
                  quant.INT4_GROUP) for n in names))
            output = path == "lm_head" and part_kinds != ["int4"]  # the output layer in its own type unless Q4
            new = None
            if whole and not output and native.plan(part_kinds) is not None:
                blocks = [read(n) for n in names]
                got = (sum(b["codes"].shape[0] for b in blocks), blocks[0]["codes"].shape[1])
                if got != tuple(dense.weight.shape):
                    raise ValueError(f"{folder / INT4_FILE}: {', '.join(names)} give {list(got)}, "
                                     f"expected {list(dense.weight.shape)}")
                biases = [n.removesuffix("weight") + "bias" for n in names] \
                    if getattr(dense, "bias", None) is not None else []
                bias = torch.cat([read_dense(b) for b in biases]) if biases else None
                if bias is not None and bias.shape != dense.bias.shape:
                    raise ValueError(f"{folder}: {', '.join(biases)} give {list(bias.shape)}, "
                                     f"expected {list(dense.bias.shape)}")
                new = native.build(part_kinds, blocks, bias, dtype, device)
                del blocks
                if new is None:
                    plan.tried.add(path)
                else:
                    plan.covered.update(biases)
                    plan.count += 1
            elif output and whole and part_kinds[0] in native.KINDS:
                new = _output_layer(model, f, stored, names[0], part_kinds[0], dense, dtype, device)
                plan.count += new is not None
            release_freed_memory()
            if new is None:
                plan.left[path] = names
                continue
            _put(model, path, new, device)
            if not (path == "lm_head" and tied):  # a tied model still looks its tokens up in the embedding
                plan.covered.update(names)
    return plan


def finish(model: TargetModel, plan: NativePlan, dtype: torch.dtype, device: torch.device) -> int:
    """After the dense tensors are in: the linears swap_in left, on a fallback where one serves (the
    output layer on augury's w8a8 kernel, Q8_0's rule, or fbgemm's float16 GEMM; Q8_0 linears as int8
    per channel); any other quantised one stays dense, named in one warning. Returns how many linears
    run natively."""
    dense_left: dict[str, str] = {}
    for path, names in plan.left.items():
        dense = _dense_module(model, path)
        new = None
        if path in plan.tried:
            pass  # its kind runs natively, but not here (dtype, device): dense, as it is
        elif path == "lm_head" and (packed := quant.w8a8_output_layer(dense, dtype, device)
                                    or packed_output_layer(dense, dtype, device)) is not None:
            new = packed
        elif all(plan.sources.get(n) == "Q8_0" for n in names) and quant.int8_available(device):
            new = quant.Int8Linear.from_float(dense.weight, getattr(dense, "bias", None), dtype)
        if new is not None:
            _put(model, path, new, device)
        elif any(plan.sources.get(n, "F32") not in _FLOAT_SOURCES for n in names):
            dense_left[path] = "/".join(sorted({plan.sources.get(n, "?") for n in names}))
    if dense_left:
        why = "no native kernel for the type here" if dtype == torch.bfloat16 and device.type == "cpu" else \
            f"native GGUF kernels run bfloat16 on the CPU, not {dtype} on {device.type}"
        log.warning("GGUF linears running dense (%s): %s", why,
                    ", ".join(f"{p} ({t})" for p, t in dense_left.items()))
    model._fused = None  # new linears: models/fused.py builds its table again
    return plan.count
