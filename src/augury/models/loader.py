"""Hugging Face checkpoint folders -> augury modules, strictly.

Every tensor the module needs must be in the checkpoint with the right shape, and every
tensor in the checkpoint must be used: anything else is a ValueError naming the tensor.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from augury.models.config import TargetConfig
from augury.models.layers import Rotary
from augury.models.llama import TargetModel

# Tensors some checkpoints carry that no forward needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder}: shard(s) named in model.safetensors.index.json are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
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
            out[p + "mlp.down_proj.bias"] = mlp.down_proj.bias
    return out


def load_target(
    folder: str | Path, dtype: torch.dtype, device: torch.device, max_len: int
) -> tuple[TargetModel, TargetConfig]:
    """Build the target from a checkpoint folder; raises ValueError naming any mismatch."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"model path {folder} does not exist or is not a folder")
    cfg = TargetConfig.from_folder(folder)
    tensors = read_tensors(folder)
    with torch.device("meta"):
        model = TargetModel(cfg, max_len=1)
    model = model.to_empty(device=device).to(dtype)
    model.rotary = Rotary(cfg.rope, cfg.head_dim, max_len).to(device)
    # A tied model may still carry lm_head.weight (a copy of the embedding); it is unused.
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    copy_strict(target_weight_map(model), tensors, f"target checkpoint {folder}", optional)
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    return model, cfg
