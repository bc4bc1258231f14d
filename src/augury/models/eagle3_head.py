"""EAGLE-3 draft head in the checkpoint format SGLang and vLLM load (LlamaForCausalLMEagle3).

One decoder layer whose attention reads cat(input_layernorm(embed(token)), hidden_norm(h)),
with the residual stream on h. The first step's h is fc(cat of three target hidden
states); later steps feed back the head's own pre-norm output. Logits are over a draft
vocabulary mapped back to target ids by d2t (target_id = draft_id + d2t[draft_id]).

Aux layer convention (documented; SGLang's): `eagle_aux_hidden_state_layer_ids` name the
0-based target layers whose OUTPUT is captured. vLLM reads the same ids as the layers whose
INPUT is captured (one lower). Default: outputs of layers [1, n//2 - 1, n - 4].
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from augury.models.config import RopeConfig, TargetConfig, _parse_rope
from augury.attention.sdpa import attend
from augury.models.layers import RMSNorm, Rotary, apply_rope
from augury.models.llama import MLP
from augury.models.loader import copy_strict, read_tensors

ARCHITECTURES = ("LlamaForCausalLMEagle3",)


AUX_COUNT = 3  # EAGLE-3 conditions on three target layers: fc.weight is [H, 3 * Ht]


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Target layers (0-based) whose OUTPUTS the head reads when its config names none: EAGLE-3's
    [1, n//2 - 1, n - 4]. Targets under 5 layers take layers 0, 1, 2, repeating the last layer
    when there are fewer than three (a 2-layer target: 0, 1, 1), so fc always gets 3 features."""
    if num_layers >= 5:
        return (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(min(i, num_layers - 1) for i in range(AUX_COUNT))


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rope: RopeConfig
    aux_layer_ids: tuple[int, ...] | None
    fc_bias: bool
    # P(accepted length >= i) measured for this head (augury's own heads record it); a prior
    # for the adaptive policy
    acceptance: tuple[float, ...] | None = None

    @staticmethod
    def from_folder(folder: Path) -> "Eagle3Config":
        path = folder / "config.json"
        if not path.is_file():
            raise ValueError(f"draft head {folder} has no config.json")
        cfg = json.loads(path.read_text())
        arch = cfg.get("architectures") or []
        if not any(a in ARCHITECTURES for a in arch):
            raise ValueError(f"draft head {folder}: architectures {arch} is not an EAGLE-3 head ({', '.join(ARCHITECTURES)})")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"draft head {folder}: num_hidden_layers must be 1, got {cfg.get('num_hidden_layers')}")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise ValueError(f"draft head config.json: {key} must be a positive integer, got {cfg.get(key)!r}")
        heads = cfg["num_attention_heads"]
        eagle = cfg.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return Eagle3Config(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
            rope=_parse_rope(cfg),
            aux_layer_ids=tuple(ids) if ids else None,
            fc_bias=bool(cfg.get("bias", False)),
            acceptance=_acceptance(cfg.get("augury_acceptance")),
        )


def _acceptance(value) -> tuple[float, ...] | None:
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in value):
        return None  # absent or unreadable: the policy falls back to its own prior
    return tuple(float(v) for v in value)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, embed: nn.Embedding, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=cfg.fc_bias)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(2 * h, (self.nh + 2 * self.nkv) * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=False)
        self.embed = embed  # the target's embedding unless the checkpoint ships its own
        self.rotary = Rotary(cfg.rope, cfg.head_dim, max_len)

    def forward(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                kv_ctx: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None, causal: bool):
        """tokens [B, Q] (target ids), h [B, Q, H] (fc output or fed-back), positions [B, Q].

        kv_ctx: keys/values [B, C, nkv, hd] visible besides the new ones. Returns the pre-norm
        output [B, Q, H] (fed back as the next step's h) and the new keys/values
        [B, Q, nkv, hd] for the caller to cache or keep as tree scratch.
        """
        b, q, _ = h.shape
        x = torch.cat([self.input_layernorm(self.embed(tokens)), self.hidden_norm(h)], dim=-1)  # [B, Q, 2H]
        qkv = self.qkv_proj(x)
        qq, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        cos, sin = self.rotary(positions, h.dtype)
        qq = apply_rope(qq.view(b, q, self.nh, self.hd), cos, sin)
        k = apply_rope(k.view(b, q, self.nkv, self.hd), cos, sin)
        v = v.view(b, q, self.nkv, self.hd)
        k_ctx, v_ctx = kv_ctx if kv_ctx is not None else (None, None)
        residual = h + self.o_proj(attend(qq, k, v, k_ctx, v_ctx, mask, causal))
        out = residual + self.mlp(self.post_attention_layernorm(residual))
        return out, k, v

    @property
    def dtype(self) -> torch.dtype:
        """The head's compute dtype (read off a norm, which stays dense: a quantised linear's .weight
        would dequantise the whole layer to answer)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm output [..., H] -> float32 draft-vocabulary logits [..., Vd]."""
        return self.lm_head(self.norm(out)).float()  # a module call: lm_head may be quantised

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def load_eagle3(folder: str | Path, target_cfg: TargetConfig, target_embed: nn.Embedding,
                dtype: torch.dtype, device: torch.device, max_len: int, quantization: str = "none") -> Eagle3Head:
    """Load a head strictly and check that it fits the target; errors name the tensor or size.

    quantization: the target's mode ("none", "int8", "int4"; see models/quant.quantize_head; int4 keeps the
    output layer at int8 on the w8a8 kernel where it serves, as the target's own)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"draft model path {folder} does not exist or is not a folder")
    cfg = Eagle3Config.from_folder(folder)
    where = f"draft head {folder}"
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"{where}: vocab_size {cfg.vocab_size} does not match the target's {target_cfg.vocab_size}")
    if cfg.target_hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"{where}: target_hidden_size {cfg.target_hidden_size} does not match the target's hidden_size {target_cfg.hidden_size}"
        )
    if cfg.aux_layer_ids is not None:
        bad = [i for i in cfg.aux_layer_ids if not 0 <= i < target_cfg.num_layers]
        if len(cfg.aux_layer_ids) != AUX_COUNT or bad:
            raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {list(cfg.aux_layer_ids)} must be 3 layers in [0, {target_cfg.num_layers})")
    tensors = {k.removeprefix("model."): v for k, v in read_tensors(folder).items()}
    embed = target_embed
    if "embed_tokens.weight" in tensors:
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
    elif cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"{where}: hidden_size {cfg.hidden_size} differs from the target's and the head has no embed_tokens.weight")
    with torch.device("meta"):
        head = Eagle3Head(cfg, nn.Embedding(1, 1), max_len=1)
    head = head.to_empty(device=device).to(dtype)
    head.embed = embed
    head.rotary = Rotary(cfg.rope, cfg.head_dim, max_len).to(device)
    head.d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=device)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    w, gu = head.qkv_proj.weight, head.mlp.gate_up_proj.weight
    targets = {
        "fc.weight": head.fc.weight,
        "midlayer.input_layernorm.weight": head.input_layernorm.weight,
        "midlayer.hidden_norm.weight": head.hidden_norm.weight,
        "midlayer.self_attn.q_proj.weight": w[:q],
        "midlayer.self_attn.k_proj.weight": w[q : q + kv],
        "midlayer.self_attn.v_proj.weight": w[q + kv :],
        "midlayer.self_attn.o_proj.weight": head.o_proj.weight,
        "midlayer.post_attention_layernorm.weight": head.post_attention_layernorm.weight,
        "midlayer.mlp.gate_proj.weight": gu[:inter],
        "midlayer.mlp.up_proj.weight": gu[inter:],
        "midlayer.mlp.down_proj.weight": head.mlp.down_proj.weight,
        "norm.weight": head.norm.weight,
        "lm_head.weight": head.lm_head.weight,
    }
    if cfg.fc_bias:
        targets["fc.bias"] = head.fc.bias
    if embed is not target_embed:
        targets["embed_tokens.weight"] = embed.weight
    fc = tensors.get("fc.weight")
    aux = cfg.aux_layer_ids or default_aux_layers(target_cfg.num_layers)
    if fc is not None and fc.dim() == 2 and fc.shape[1] != len(aux) * target_cfg.hidden_size:
        raise ValueError(f"{where}: tensor fc.weight has shape {list(fc.shape)}, but the head reads {len(aux)} target "
                         f"layers {list(aux)} of hidden size {target_cfg.hidden_size}: expected "
                         f"{len(aux) * target_cfg.hidden_size} inputs")
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)
    copy_strict(targets, tensors, where)
    if cfg.draft_vocab_size != cfg.vocab_size:
        if d2t is None:
            raise ValueError(f"{where}: draft_vocab_size {cfg.draft_vocab_size} < vocab_size needs a d2t tensor")
        if tuple(d2t.shape) != (cfg.draft_vocab_size,):
            raise ValueError(f"{where}: tensor d2t has shape {list(d2t.shape)}, expected [{cfg.draft_vocab_size}]")
        ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"{where}: tensor d2t maps draft ids outside the target vocabulary")
        head.d2t = d2t.long().to(device)
    if t2d is not None and tuple(t2d.shape) != (cfg.vocab_size,):
        raise ValueError(f"{where}: tensor t2d has shape {list(t2d.shape)}, expected [{cfg.vocab_size}]")
    head.eval().requires_grad_(False)
    if quantization != "none":
        from augury.models.quant import quantize_head, w8a8_output_layer

        if quantization == "int4":
            # the draft vocabulary's output layer at 8 bits (w8a8), as an int4 target keeps its own: on the
            # demo (16 held-out chat prompts, a chain of 3) first drafts accepted 0.597 and 0.958 drafts a
            # step against the bfloat16 head's 0.596 and 0.954; int4 there gave 0.589 and 0.925
            # (python -m augury.bench.head_cost --acceptance)
            head.lm_head = w8a8_output_layer(head.lm_head, dtype, device) or head.lm_head
        quantize_head(head, quantization)
    else:
        from augury.models.dense import fbgemm_half_available, pack_half_linears

        if fbgemm_half_available(dtype, device):
            pack_half_linears(head, dtype)  # drafts need no row-count invariance: never padded
    return head
