"""The target family (Llama, Mistral, Qwen2, Qwen3) as one PyTorch module over a paged KV cache.

Projections are fused (q|k|v and gate|up) to cut per-layer operator count; the loader
splits Hugging Face tensors into them. The forward returns the final-norm hidden states
and, in the same pass, the raw outputs of chosen layers that EAGLE-3 conditions on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from augury.models.config import TargetConfig
from augury.models import fused
from augury.models.fused import FusedStack, Watched
from augury.attention.base import PagedAttention
from augury.models.layers import RMSNorm, Rotary, TransposedLinear, apply_rope, prefer_transposed, silu_mul


class Norm(Watched, RMSNorm):
    """The target's RMSNorm, watched for the fused table (models/fused.py)."""


class LayerList(Watched, nn.ModuleList):
    """The target's layer stack, watched for the fused table (`model.layers[i] = ...`)."""


class Attention(Watched, nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = Norm(self.hd, cfg.rms_norm_eps)
            self.k_norm = Norm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn: PagedAttention, layer: int):
        b, ql, _ = x.shape
        qkv = self.qkv_proj(x).view(b, ql, self.nh + 2 * self.nkv, self.hd)  # [B, Q, heads, hd]
        qk, v = qkv[:, :, : self.nh + self.nkv], qkv[:, :, self.nh + self.nkv :]  # views (cheaper than split)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :, : self.nh]), self.k_norm(qk[:, :, self.nh :])], dim=2)
        # one rotation for the query and key heads together (elementwise per head: the same numbers)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :, : self.nh], qk[:, :, self.nh :]
        return self.o_proj(attn(layer, q, k, v))  # the backend writes k, v to the cache and attends


class MLP(Watched, nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(Watched, nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, h, cos, sin, attn: PagedAttention, layer: int):
        # h is the float32 residual stream; the norms hand the projections the weights' dtype
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetModel(Watched, nn.Module):
    """Llama-family causal LM. ``forward`` -> (normed hidden [B,Q,H], aux [B,Q,len(aux)*H] or None).

    Its layers, norms and kernel linears are `fused.Watched`: moving, converting or swapping any of
    them after a forward makes the fused table (`_fused`) stale, and the next forward builds it again."""

    def __init__(self, cfg: TargetConfig, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.quantization = "none"  # the linears' mode once loaded: "none", "int8" or "int4" (models/quant.py)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = LayerList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, max_len)
        self._fused: FusedStack | None | bool = None  # models/fused.py: None until tried, False if it cannot

    def _apply(self, fn, *args, **kwargs):
        self._fused = None  # tensors moved or converted: the fused kernel's addresses are stale
        return super()._apply(fn, *args, **kwargs)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: PagedAttention,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # input_ids, positions [B, Q]; attn: this step's attention (an attention backend prepared it)
        h = self.embed_tokens(input_ids)
        dtype = h.dtype
        cos, sin = self.rotary(positions, dtype)
        # The residual stream stays in float32 under 16-bit weights: each layer's output is added
        # unrounded (bfloat16 demo, 8 chat answers: mean |logit error| against float32 0.064,
        # 0.105 with a bfloat16 stream, transformers' 0.110). Elementwise, so rows stay independent.
        h = h.float()
        if self._fused is not False:  # the whole stack in one C++ call where model and step allow
            if self._fused is None or self._fused.epoch != fused.epoch():  # none yet, or stale
                self._fused = FusedStack.build(self) or False
            if self._fused and (done := self._fused.run(h, cos, sin, attn, aux_layers)) is not None:
                return done
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attn, i)
            if i in aux_layers:
                captured[i] = h.to(dtype)
        # in the order asked for (a layer may be named twice on very shallow targets)
        aux_out = torch.cat([captured[i] for i in aux_layers], dim=-1) if aux_layers else None
        return self.norm(h), aux_out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., V]."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def prepare_for_inference(self) -> None:
        """Pick the fastest weight layout for this device and dtype (after loading)."""
        self._fused = None  # weights may have moved: rebuild the fused kernel's table on the next forward
        if prefer_transposed(self.layers):
            # tied output layer: a transposed copy of the embedding (float32 only)
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.lm_head = TransposedLinear(weight)
