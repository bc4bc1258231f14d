"""Hugging Face checkpoint folders -> augury modules, strictly.

Every tensor the module needs must be in the checkpoint with the right shape, and every
tensor in the checkpoint must be used: anything else is a ValueError naming the tensor.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from augury.models.checkpoint import Checkpoint, _read_part, checkpoint_files, shard_part
from augury.models.config import TargetConfig
from augury.models.dense import (bf16_panel_linears, fbgemm_half_available, pack_half_linears, packed_output_layer,
                                 row_padding)
from augury.models.layers import Rotary
from augury.models.llama import Collectives, Shard, TargetModel
from augury.models.quant import INT4_INDEX

# Tensors some checkpoints carry that no forward needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def materialise(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Every tensor of `model` still on the meta device made real (uninitialised) on `device`,
    floating ones in `dtype`: to_empty().to(dtype) for what is left, leaving built modules alone.
    torch.empty from the shape, not empty_like of the meta tensor: that goes through torch's Python
    reference (torch._refs), whose first call imports sympy (0.3 s of a start)."""
    def real(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(tuple(t.shape), device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                setattr(module, name, torch.nn.Parameter(real(p), requires_grad=p.requires_grad))
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                setattr(module, name, real(b))


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
        shape = tensors.shape(name) if isinstance(tensors, Checkpoint) else list(tensors[name].shape)
        if tuple(shape) != tuple(dest.shape):
            raise ValueError(
                f"{where}: tensor {name} has shape {list(shape)}, expected {list(dest.shape)}"
            )
        with torch.no_grad():
            if not (isinstance(tensors, Checkpoint) and tensors.read_into(name, dest)):
                dest.copy_(tensors[name].to(dest.dtype))


def target_weight_map(model: TargetModel) -> dict[str, torch.Tensor]:
    """HF tensor name -> destination view inside our fused parameters. A linear that is no longer an
    nn.Linear (built from a GGUF side file already: models/native_load.py) has no destination."""
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dense = lambda m: isinstance(m, torch.nn.Linear)  # noqa: E731
    out: dict[str, torch.Tensor] = {"model.norm.weight": model.norm.weight}
    if isinstance(model.embed_tokens, torch.nn.Embedding):  # not one kept in its GGUF type (native_embed.py)
        out["model.embed_tokens.weight"] = model.embed_tokens.weight
    if dense(model.lm_head):
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        if dense(attn.qkv_proj):
            w = attn.qkv_proj.weight
            out[p + "self_attn.q_proj.weight"] = w[:q]
            out[p + "self_attn.k_proj.weight"] = w[q : q + kv]
            out[p + "self_attn.v_proj.weight"] = w[q + kv :]
            if attn.qkv_proj.bias is not None:
                b = attn.qkv_proj.bias
                out[p + "self_attn.q_proj.bias"] = b[:q]
                out[p + "self_attn.k_proj.bias"] = b[q : q + kv]
                out[p + "self_attn.v_proj.bias"] = b[q + kv :]
        if dense(attn.o_proj):
            out[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
            if attn.o_proj.bias is not None:
                out[p + "self_attn.o_proj.bias"] = attn.o_proj.bias
        if attn.o_bias is not None:  # a row-parallel shard: the bias is added after the sum over ranks
            out[p + "self_attn.o_proj.bias"] = attn.o_bias
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = attn.q_norm.weight
            out[p + "self_attn.k_norm.weight"] = attn.k_norm.weight
        inter = cfg.intermediate_size
        if dense(mlp.gate_up_proj):
            gu = mlp.gate_up_proj.weight
            out[p + "mlp.gate_proj.weight"] = gu[:inter]
            out[p + "mlp.up_proj.weight"] = gu[inter:]
            if mlp.gate_up_proj.bias is not None:
                out[p + "mlp.gate_proj.bias"] = mlp.gate_up_proj.bias[:inter]
                out[p + "mlp.up_proj.bias"] = mlp.gate_up_proj.bias[inter:]
        if dense(mlp.down_proj):
            out[p + "mlp.down_proj.weight"] = mlp.down_proj.weight
        if mlp.down_bias is not None:  # row-parallel, as o_bias
            out[p + "mlp.down_proj.bias"] = mlp.down_bias
        elif dense(mlp.down_proj) and mlp.down_proj.bias is not None:
            out[p + "mlp.down_proj.bias"] = mlp.down_proj.bias
    return out


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
    model.rotary = Rotary(cfg.rope, cfg.head_dim, max_len).to(device)
    # A tied model may still carry lm_head.weight (a copy of the embedding); it is unused.
    optional: tuple[str, ...] = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    where = f"target checkpoint {folder}"
    plan = packed = None
    with Checkpoint(folder) as checkpoint:  # each tensor read when copied: no second copy of the weights
        if mode == "gguf-int4":  # the native linears first, each from the side file into its kernel's layout
            from augury.models import native_load, packed_cache

            # a start after the first reads the kernels' layouts as the first packed them (packed_cache.py)
            packed = packed_cache.key(folder, dtype, device) if shard is None and device.type == "cpu" else None
            kept = None if packed is None else packed_cache.load(folder, packed)
            if kept is not None:
                plan = packed_cache.restore(model, *kept)
                packed = None  # nothing to write
            else:
                plan = native_load.swap_in(model, folder, dtype, device, lambda n: checkpoint.part(
                    n, None if shard is None else shard_part(n, cfg, shard)))
            optional += tuple(sorted(plan.covered))
        materialise(model, device, dtype)  # what is left: embedding, norms, linears not native
        if shard is None:
            copy_strict(target_weight_map(model), checkpoint, where, optional)
        else:
            copy_sharded(target_weight_map(model), folder, cfg, shard, where, optional)
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    if plan is not None:
        native_load.finish(model, plan, dtype, device)
        model.quantization = "int4"
        if packed is not None:
            packed_cache.save(model, folder, packed, packed_cache.plan_state(model, plan))
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
