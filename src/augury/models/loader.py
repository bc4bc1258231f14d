"""Hugging Face checkpoint folders -> augury modules, strictly.

Every tensor the module needs must be in the checkpoint with the right shape, and every
tensor in the checkpoint must be used: anything else is a ValueError naming the tensor.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from augury.models.config import TargetConfig
from augury.models.dense import (bf16_panel_linears, fbgemm_half_available, pack_half_linears, packed_output_layer,
                                 row_padding)
from augury.models.layers import Rotary
from augury.models.llama import Collectives, Shard, TargetModel
from augury.models.quant import INT4_FILE, INT4_FORMAT, INT4_INDEX

# Tensors some checkpoints carry that no forward needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


log = logging.getLogger(__name__)

def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder}: shard(s) named in model.safetensors.index.json are missing: {', '.join(missing)}")
        return files
    files = sorted(f for f in folder.glob("*.safetensors") if f.name != INT4_FILE)  # not the int4 side file
    if not files:
        raise ValueError(f"{folder} has no .safetensors weights (only safetensors checkpoints are supported)")
    return files


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def copy_strict(
    targets: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    where: str,
    optional: tuple[str, ...] = (),
) -> None:
    """Copy checkpoint tensors into destination views; names and shapes must match exactly.

    `targets` maps a checkpoint name to the (possibly sliced) destination tensor. Names in
    `optional` may be present in the checkpoint and are then ignored.
    """
    missing = sorted(set(targets) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: missing tensor {missing[0]}{more}")
    unexpected = sorted(
        n for n in set(tensors) - set(targets) if n not in optional and not n.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"{where}: unexpected tensor {unexpected[0]}{more}")
    for name, dest in targets.items():
        src = tensors[name]
        if tuple(src.shape) != tuple(dest.shape):
            raise ValueError(
                f"{where}: tensor {name} has shape {list(src.shape)}, expected {list(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(src.to(dest.dtype))


def target_weight_map(model: TargetModel) -> dict[str, torch.Tensor]:
    """HF tensor name -> destination view inside our fused parameters."""
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
    }
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        w = attn.qkv_proj.weight
        out[p + "self_attn.q_proj.weight"] = w[:q]
        out[p + "self_attn.k_proj.weight"] = w[q : q + kv]
        out[p + "self_attn.v_proj.weight"] = w[q + kv :]
        if attn.qkv_proj.bias is not None:
            b = attn.qkv_proj.bias
            out[p + "self_attn.q_proj.bias"] = b[:q]
            out[p + "self_attn.k_proj.bias"] = b[q : q + kv]
            out[p + "self_attn.v_proj.bias"] = b[q + kv :]
        out[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
        if attn.o_proj.bias is not None:
            out[p + "self_attn.o_proj.bias"] = attn.o_proj.bias
        elif attn.o_bias is not None:  # a row-parallel shard: the bias is added after the sum over ranks
            out[p + "self_attn.o_proj.bias"] = attn.o_bias
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = attn.q_norm.weight
            out[p + "self_attn.k_norm.weight"] = attn.k_norm.weight
        inter = cfg.intermediate_size
        gu = mlp.gate_up_proj.weight
        out[p + "mlp.gate_proj.weight"] = gu[:inter]
        out[p + "mlp.up_proj.weight"] = gu[inter:]
        out[p + "mlp.down_proj.weight"] = mlp.down_proj.weight
        if mlp.gate_up_proj.bias is not None:
            out[p + "mlp.gate_proj.bias"] = mlp.gate_up_proj.bias[:inter]
            out[p + "mlp.up_proj.bias"] = mlp.gate_up_proj.bias[inter:]
            out[p + "mlp.down_proj.bias"] = mlp.down_proj.bias if mlp.down_bias is None else mlp.down_bias
    return out


# A checkpoint tensor's part on one tensor-parallel rank: (dimension, start, stop, full length) of the
# tensor in the checkpoint; None: the whole tensor (norms, and row-parallel biases added once).
Part = tuple[int, int, int, int] | None


def shard_part(name: str, cfg: TargetConfig, shard: Shard) -> Part:
    """Which part of HF tensor `name` rank `shard.rank` holds: q/k/v and gate/up by rows (its heads and
    MLP columns), o/down by columns, the embedding and the output layer by vocabulary rows."""
    hd = cfg.head_dim
    (h0, h1), (k0, k1), (i0, i1), (v0, v1) = shard.heads, shard.kv_heads, shard.inter, shard.vocab
    leaf = name.rsplit(".", 1)[-1]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (0, v0, v1, cfg.vocab_size)
    if name.endswith("self_attn.q_proj." + leaf):
        return (0, h0 * hd, h1 * hd, cfg.num_heads * hd)
    if name.endswith(("self_attn.k_proj." + leaf, "self_attn.v_proj." + leaf)):
        return (0, k0 * hd, k1 * hd, cfg.num_kv_heads * hd)
    if name.endswith("self_attn.o_proj.weight"):
        return (1, h0 * hd, h1 * hd, cfg.num_heads * hd)
    if name.endswith(("mlp.gate_proj." + leaf, "mlp.up_proj." + leaf)):
        return (0, i0, i1, cfg.intermediate_size)
    if name.endswith("mlp.down_proj.weight"):
        return (1, i0, i1, cfg.intermediate_size)
    return None


def _read_part(f, name: str, part: Part, per: int = 1) -> torch.Tensor:
    """Only `part` of tensor `name` from an open safetensors file (`per` checkpoint values per stored
    column: 2 for int4 codes packed two to a byte, 32 for per-group scales)."""
    sl = f.get_slice(name)
    if part is None:
        return sl[:]
    dim, a, b, _ = part
    return sl[a:b] if dim == 0 else sl[:, a // per : b // per]


def copy_sharded(targets: dict[str, torch.Tensor], folder: Path, cfg: TargetConfig, shard: Shard, where: str,
                 optional: tuple[str, ...] = ()) -> None:
    """copy_strict for one tensor-parallel rank: every name checked against the checkpoint's full
    shapes (missing, unexpected and mis-shaped tensors are errors naming them), and only this rank's
    part of each read from the files (safetensors slices: no full copy per rank)."""
    located: dict[str, Path] = {}
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt") as f:
            located.update((name, file) for name in f.keys())
    missing = sorted(set(targets) - set(located))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: missing tensor {missing[0]}{more}")
    unexpected = sorted(n for n in set(located) - set(targets)
                        if n not in optional and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"{where}: unexpected tensor {unexpected[0]}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(located[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                dest, part = targets[name], shard_part(name, cfg, shard)
                full = list(dest.shape)
                if part is not None:
                    full[part[0]] = part[3]
                shape = list(f.get_slice(name).get_shape())
                if shape != full:
                    raise ValueError(f"{where}: tensor {name} has shape {shape}, expected {full}")
                with torch.no_grad():
                    dest.copy_(_read_part(f, name, part).to(dest.dtype))


def load_embedding(folder: str | Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Embedding:
    """The target's whole embedding alone (for a replicated EAGLE-3 head beside a vocabulary-parallel
    target, which holds only its own rows)."""
    folder = Path(folder)
    cfg = TargetConfig.from_folder(folder)
    name = "model.embed_tokens.weight"
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():
                weight = f.get_tensor(name)
                if list(weight.shape) != [cfg.vocab_size, cfg.hidden_size]:
                    raise ValueError(f"target checkpoint {folder}: tensor {name} has shape {list(weight.shape)}, "
                                     f"expected {[cfg.vocab_size, cfg.hidden_size]}")
                embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
                with torch.no_grad():
                    embed.weight.copy_(weight.to(dtype))
                return embed.requires_grad_(False)
    raise ValueError(f"target checkpoint {folder}: missing tensor {name}")


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


def load_native_int4(model: TargetModel, folder: Path, dtype: torch.dtype) -> int:
    """Swap in the native weights a GGUF conversion wrote beside the dense ones (gguf.INT4_FILE), each
    linear on the kernel its tensors' kinds take (models/native.py: Q4_0/Q4_1 as int4, Q4_K on w4a8's
    super-block form, Q8_0/Q6_K/Q5_* on w8a8's general form, all in their exact values; int4 scales
    rounded to `dtype`); an output layer not native runs on augury's w8a8 kernel (Q8_0's rule,
    quant.w8a8_output_layer) or fbgemm's float16 GEMM (models/dense.packed_output_layer) where they
    serve, and a Q8_0 one without them as int8 per channel; anything else stays dense, named in one
    warning. Returns how many linears run natively."""
    from augury.models import native, quant

    index = json.loads((folder / INT4_INDEX).read_text())
    if index.get("format") not in quant.INT4_FORMATS or index.get("group_size") != quant.INT4_GROUP:
        raise ValueError(f"{folder / INT4_INDEX}: format {index.get('format')!r}, group {index.get('group_size')!r} "
                         f"is not {INT4_FORMAT!r} with groups of {quant.INT4_GROUP}")
    kinds: dict[str, str] = index.get("kinds") or {n: "int4" for n in index.get("int4", [])}
    sources = index.get("source_types", {})
    device = model.embed_tokens.weight.device
    shard = model.shard
    # a tensor-parallel rank reads its part of each source tensor (whole groups of 32 along the input)
    parts = {n: shard_part(n, model.full_cfg, shard) for names in fused_linears(model).values() for n in names} \
        if shard is not None else {}
    count, dense_left = 0, {}
    with safe_open(str(folder / INT4_FILE), framework="pt") as f:
        stored = set(f.keys())

        def read(n: str) -> dict[str, torch.Tensor]:
            kind, part = kinds[n], parts.get(n)
            g = quant.INT4_GROUP
            out = {k: _read_part(f, f"{n}.{k}", part, per) for k, per in
                   (("codes", 2 if kind in ("int4", "q4k", "q5k") else 1), ("scale", g), ("zero", g),
                    ("sub", g // 2), ("d", 8 * g), ("dmin", 8 * g), ("sc", g), ("m", g), ("high", 8))
                   if f"{n}.{k}" in stored}
            if kind in ("int4", "q4k", "q5k"):
                out["codes"] = quant.unpack_codes(out["codes"])
            if "high" in out:  # Q5_K's fifth bits, eight a byte
                bits = np.unpackbits(out.pop("high").numpy(), axis=1, bitorder="little")
                out["codes"] = out["codes"] | (torch.from_numpy(bits.astype(np.int32)) << 4)
            return out

        for path, names in fused_linears(model).items():
            # tied and not yet given its own copy: the output layer reads the embedding
            dense = model.embed_tokens if path == "lm_head" and model.lm_head is None else model.get_submodule(path)
            new: torch.nn.Module | None = None
            # whole groups of 32 along the input (of 256 for Q4_K's super-blocks)
            whole_groups = all(p is None or p[0] == 0 or (p[1] % w == 0 and p[2] % w == 0) for p, w in
                               ((parts.get(n), 256 if kinds.get(n) in ("q4k", "q5k", "q6k") else quant.INT4_GROUP) for n in names))
            part_kinds = [kinds.get(n, "dense") for n in names]
            output_q8 = path == "lm_head" and part_kinds != ["int4"]  # the output layer: int8 per 32 unless Q4
            if whole_groups and not output_q8 and native.plan(part_kinds) is not None:
                blocks = [read(n) for n in names]
                got = (sum(b["codes"].shape[0] for b in blocks), blocks[0]["codes"].shape[1])
                if got != tuple(dense.weight.shape):
                    raise ValueError(f"{folder / INT4_FILE}: {', '.join(names)} give {list(got)}, "
                                     f"expected {list(dense.weight.shape)}")
                # packed where it runs, for the kernel the dtype and device choose
                new = native.build(part_kinds, blocks, getattr(dense, "bias", None), dtype, device)
                count += new is not None
            elif output_q8 and whole_groups and part_kinds[0] in ("q8g", "q4k", "q5k", "q6k") and \
                    (exact := native.output_layer(part_kinds[0], read(names[0]), dtype, device)) is not None:
                new = exact  # Q8_0 as it is; Q6_K / Q5_* requantised from their exact values
                count += sources.get(names[0]) == "Q8_0"
            elif path == "lm_head" and (packed := quant.w8a8_output_layer(dense, dtype, device)
                                        or packed_output_layer(dense, dtype, device)) is not None:
                new = packed
            elif all(sources.get(n) == "Q8_0" for n in names) and quant.int8_available(device):
                new = quant.Int8Linear.from_float(dense.weight, getattr(dense, "bias", None), dtype)
            if new is not None:
                parent, _, attr = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, new.to(device))
            elif any(sources.get(n, "F32") not in ("F32", "F16", "BF16") for n in names):
                dense_left[path] = "/".join(sorted({sources.get(n, "?") for n in names}))
    if dense_left:
        why = "no native kernel for the type here" if dtype == torch.bfloat16 and device.type == "cpu" else \
            f"native GGUF kernels run bfloat16 on the CPU, not {dtype} on {device.type}"
        log.warning("GGUF linears running dense (%s): %s", why,
                    ", ".join(f"{p} ({t})" for p, t in dense_left.items()))
    return count


def resolve_quantization(folder: Path, quantization: str, dtype: torch.dtype,
                         device: torch.device | str = "cpu") -> str:
    """The mode a target loads in on `device`. A GGUF conversion's native int4 weights ("gguf-int4")
    serve "int4" and, in 16-bit dtypes where an int4 kernel runs that dtype on the device
    (quant.default_int4_backend: the CPU's, or torch's CUDA kernel in bfloat16 on sm80+), "auto";
    elsewhere "auto" runs dense. float32 is the reference mode, so "auto" runs it dense (the
    kernels' float32 path is also slow: on the demo at one row, AVX2, int4 277 ms per token against
    F.linear's 45 ms, and a 1536-token prefill took 188 s in the int4 kernel). An explicit "int4" or
    "int8" with no kernel for the dtype on the device is a ValueError."""
    from augury.models import quant

    device = torch.device(device)
    native = (folder / INT4_INDEX).is_file()
    if quantization == "auto":
        fast = dtype in (torch.bfloat16, torch.float16) and quant.default_int4_backend(dtype, device) is not None
        return "gguf-int4" if native and fast else "none"
    if quantization in ("int4", "int8") and not quant.mode_available(quantization, dtype, device):
        raise ValueError(f"quantization={quantization!r}: no {quantization} kernel runs {dtype} on {device.type} "
                         f"(int4 on CUDA: torch's kernel, bfloat16 on sm80+); use 'auto' or 'none'")
    if quantization == "int4" and native:
        return "gguf-int4"
    return quantization


def load_target(
    folder: str | Path, dtype: torch.dtype, device: torch.device, max_len: int, quantization: str = "none",
    shard: Shard | None = None, tp: Collectives | None = None,
) -> tuple[TargetModel, TargetConfig]:
    """Build the target from a checkpoint folder; raises ValueError naming any mismatch.

    shard / tp: one tensor-parallel rank's part (llama.plan_shards) and its process group: the model
    holds only that part, read from the files as slices, and its forward sums over the group. The
    returned config is the whole model's either way.

    quantization: "none" (dense), "int8" / "int4" (quantise the dense weights, models/quant.py; int4 takes a
    GGUF conversion's native int4 weights when the folder has them), or "auto" (those native weights in
    16-bit dtypes, else dense; see resolve_quantization).
    The mode the model runs in is left in `model.quantization` ("none", "int8" or "int4")."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"model path {folder} does not exist or is not a folder")
    cfg = TargetConfig.from_folder(folder)
    mode = resolve_quantization(folder, quantization, dtype, device)  # before the weights: fails fast
    with torch.device("meta"):
        model = TargetModel(cfg, max_len=1, shard=shard, tp=tp)
    model = model.to_empty(device=device).to(dtype)
    model.rotary = Rotary(cfg.rope, cfg.head_dim, max_len).to(device)
    # A tied model may still carry lm_head.weight (a copy of the embedding); it is unused.
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    if shard is None:
        copy_strict(target_weight_map(model), read_tensors(folder), f"target checkpoint {folder}", optional)
    else:
        copy_sharded(target_weight_map(model), folder, cfg, shard, f"target checkpoint {folder}", optional)
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    if mode == "gguf-int4":
        load_native_int4(model, folder, dtype)
        model.quantization = "int4"
    else:
        from augury.models.quant import quantize_model

        quantize_model(model, mode, dtype)
    if model.quantization == "none" and bf16_panel_linears(model, dtype, device):
        pass  # augury's dense bfloat16 kernel (models/dense.py), row-count invariant without padding
    elif model.quantization == "none" and fbgemm_half_available(dtype, device) and (padding := row_padding()):
        # fbgemm's float16 GEMM, rows padded so each is computed as if alone (models/dense.py)
        pack_half_linears(model.layers, dtype, padding)
        out = packed_output_layer(model.embed_tokens if model.lm_head is None else model.lm_head, dtype, device)
        if out is not None:  # None: weights past float16's range, the output layer stays as it was
            model.lm_head = out
    return model, cfg
