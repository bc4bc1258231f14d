"""Build a trainable EAGLE-3 head for a target, and export it in the SGLang/vLLM format.

The head copies the target's attention shape (hidden, heads, kv heads, head dim, MLP
width, rope) so it shares the target's embedding. Initialisation: lm_head rows are the
target's output rows of the draft vocabulary, norm is the target's final norm; the rest
is PyTorch's default init. The exported folder is what `augury.models.eagle3_head.load_eagle3`
(and SGLang/vLLM) read: config.json + model.safetensors with HF tensor names.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from augury.models.config import TargetConfig
from augury.models.eagle3_head import Eagle3Config, Eagle3Head
from augury.models.llama import TargetModel
from augury.train.vocab import mapping_tensors


def head_config(tcfg: TargetConfig, draft_vocab_size: int, aux_layers: tuple[int, ...]) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size, num_heads=tcfg.num_heads,
        num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim, rms_norm_eps=tcfg.rms_norm_eps,
        vocab_size=tcfg.vocab_size, draft_vocab_size=draft_vocab_size, target_hidden_size=tcfg.hidden_size,
        rope=tcfg.rope, aux_layer_ids=tuple(sorted(aux_layers)), fc_bias=False,
    )


def config_json(cfg: Eagle3Config, tcfg: TargetConfig, dtype: torch.dtype) -> dict:
    """config.json of an exported head (LlamaForCausalLMEagle3, one layer)."""
    rope = cfg.rope
    scaling = None
    if rope.rope_type == "linear":
        scaling = {"rope_type": "linear", "factor": rope.factor}
    elif rope.rope_type == "llama3":
        scaling = {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                   "high_freq_factor": rope.high_freq_factor,
                   "original_max_position_embeddings": rope.original_max_position_embeddings}
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "max_position_embeddings": tcfg.max_position_embeddings,
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": False,
        "bos_token_id": tcfg.bos_token_id,
        "eos_token_id": list(tcfg.eos_token_ids) if len(tcfg.eos_token_ids) != 1 else tcfg.eos_token_ids[0],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids or ())},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def build_head(target: TargetModel, cfg: Eagle3Config, draft_ids: torch.Tensor, max_len: int,
               seed: int) -> Eagle3Head:
    """A float32 trainable head on the target's (frozen, shared) embedding."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, torch.nn.Embedding(1, 1), max_len).float()
    head.embed = target.embed_tokens  # shared, frozen, left in the target's dtype
    out_rows = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight  # [V, H]
    with torch.no_grad():
        head.lm_head.weight.copy_(out_rows[draft_ids].float())
        head.norm.weight.copy_(target.norm.weight.float())
    head.d2t = mapping_tensors(draft_ids, cfg.vocab_size)[0]
    target.embed_tokens.requires_grad_(False)
    return head


def trainable_parameters(head: Eagle3Head) -> list[tuple[str, torch.nn.Parameter]]:
    """Every head parameter except the shared target embedding."""
    return [(n, p) for n, p in head.named_parameters() if not n.startswith("embed.")]


def head_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainable_parameters(head)}


def export_tensors(head: Eagle3Head, draft_ids: torch.Tensor, dtype: torch.dtype,
                   aux_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """HF names -> tensors (fused q|k|v and gate|up split back apart). A head trained on
    aux / aux_scale [3Ht] gets the scale folded into fc: fc(aux / s) = (W / s) aux."""
    cfg = head.cfg
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    w, gu = head.qkv_proj.weight.detach(), head.mlp.gate_up_proj.weight.detach()
    tensors = {
        "fc.weight": head.fc.weight.detach() / (1.0 if aux_scale is None else aux_scale.float()[None, :]),
        "midlayer.input_layernorm.weight": head.input_layernorm.weight.detach(),
        "midlayer.hidden_norm.weight": head.hidden_norm.weight.detach(),
        "midlayer.self_attn.q_proj.weight": w[:q],
        "midlayer.self_attn.k_proj.weight": w[q : q + kv],
        "midlayer.self_attn.v_proj.weight": w[q + kv :],
        "midlayer.self_attn.o_proj.weight": head.o_proj.weight.detach(),
        "midlayer.post_attention_layernorm.weight": head.post_attention_layernorm.weight.detach(),
        "midlayer.mlp.gate_proj.weight": gu[:inter],
        "midlayer.mlp.up_proj.weight": gu[inter:],
        "midlayer.mlp.down_proj.weight": head.mlp.down_proj.weight.detach(),
        "norm.weight": head.norm.weight.detach(),
        "lm_head.weight": head.lm_head.weight.detach(),
    }
    out = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    d2t, t2d = mapping_tensors(draft_ids, cfg.vocab_size)
    out["d2t"], out["t2d"] = d2t, t2d
    return out


def export_head(head: Eagle3Head, tcfg: TargetConfig, draft_ids: torch.Tensor, out: Path,
                dtype: torch.dtype, aux_scale: torch.Tensor | None = None) -> Path:
    """Write config.json + model.safetensors into `out` (created; files replaced)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(head, draft_ids, dtype, aux_scale)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json(head.cfg, tcfg, dtype), indent=2) + "\n")
    return out
