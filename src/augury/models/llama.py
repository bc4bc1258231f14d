"""The target family (Llama, Mistral, Qwen2, Qwen3) as one PyTorch module over a paged KV cache.

Projections are fused (q|k|v and gate|up) to cut per-layer operator count; the loader
splits Hugging Face tensors into them. The forward returns the final-norm hidden states
and, in the same pass, the raw outputs of chosen layers that EAGLE-3 conditions on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from augury.models.config import TargetConfig
from augury.models.layers import RMSNorm, Rotary, TransposedLinear, apply_rope, attend, prefer_transposed


@dataclass
class ExactTree:
    """Exact attention (see engine.attention.exact_rows) over `rows` queries (the flattened B*Q):
    each group is one attention call, (its query rows: a slice or an index tensor, the cache slots
    of each row's W keys flattened [G*W], which of them are real [G, 1, 1, W])."""

    rows: int
    groups: tuple[tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor], ...]


@dataclass
class AttnBatch:
    """Where a batch's new tokens go in the paged cache and what each may attend to.

    slot_mapping [B*Q]: cache slot of each new token (padding writes to reserved slot 0).
    kv_index [B, C+Q] or None: cache slots of every key a request sees, its C context tokens
    then its Q new ones (read after the new ones are written); None when no request has
    context, and the keys are the new tokens themselves.
    mask [B, 1, Q, C+Q] bool or None; when None, `causal` selects causal vs full visibility.
    exact, when set, replaces kv_index and mask: each query attends to exactly the keys a
    decode step at its position would read (see ExactTree).
    """

    slot_mapping: torch.Tensor
    kv_index: torch.Tensor | None
    mask: torch.Tensor | None
    causal: bool = True
    exact: ExactTree | None = None


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch: AttnBatch, k_cache: torch.Tensor, v_cache: torch.Tensor):
        b, ql, _ = x.shape
        qkv = self.qkv_proj(x)  # [B, Q, (nh + 2 nkv) hd]
        q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = q.view(b, ql, self.nh, self.hd)
        k = k.view(b, ql, self.nkv, self.hd)
        v = v.view(b, ql, self.nkv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # k_cache/v_cache [S, nkv, hd]: write the new tokens, read the context by slot
        k_cache.index_copy_(0, batch.slot_mapping, k.reshape(b * ql, self.nkv, self.hd))
        v_cache.index_copy_(0, batch.slot_mapping, v.reshape(b * ql, self.nkv, self.hd))
        if batch.exact is not None:
            return self.o_proj(self._attend_exact(q, batch.exact, k_cache, v_cache).view(b, ql, -1))
        if batch.kv_index is not None:
            # one flat gather of context + new keys (index_select beats advanced indexing ~5x on CPUs)
            flat, n_keys = batch.kv_index.view(-1), batch.kv_index.shape[1]
            k = k_cache.index_select(0, flat).view(b, n_keys, self.nkv, self.hd)  # [B, C+Q, nkv, hd]
            v = v_cache.index_select(0, flat).view(b, n_keys, self.nkv, self.hd)
        out = attend(q, k, v, None, None, batch.mask, batch.causal)
        return self.o_proj(out)

    def _attend_exact(self, q, exact: ExactTree, k_cache, v_cache) -> torch.Tensor:
        """Each query as one aligned decode step over its own keys: q [B, Q, nh, hd] -> [B*Q, 1, nh*hd]."""
        flat = q.reshape(-1, 1, self.nh, self.hd)
        out = None
        for rows, slots, valid in exact.groups:
            g, w = valid.shape[0], valid.shape[-1]
            k = k_cache.index_select(0, slots).view(g, w, self.nkv, self.hd)
            v = v_cache.index_select(0, slots).view(g, w, self.nkv, self.hd)
            o = attend(flat[rows], k, v, None, None, valid, False)
            if len(exact.groups) == 1:
                return o
            if out is None:
                out = o.new_empty(exact.rows, 1, o.shape[-1])
            out[rows] = o
        return out


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, h, cos, sin, batch, k_cache, v_cache):
        # h is the float32 residual stream; the norms hand the projections the weights' dtype
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetModel(nn.Module):
    """Llama-family causal LM. ``forward`` -> (normed hidden [B,Q,H], aux [B,Q,len(aux)*H] or None)."""

    def __init__(self, cfg: TargetConfig, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, max_len)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttnBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # input_ids, positions [B, Q]; k_cache/v_cache [layers, S, nkv, hd]
        h = self.embed_tokens(input_ids)
        dtype = h.dtype
        cos, sin = self.rotary(positions, dtype)
        # The residual stream stays in float32 under 16-bit weights: each layer's output is added
        # unrounded (bfloat16 demo, 8 chat answers: mean |logit error| against float32 0.064,
        # 0.105 with a bfloat16 stream, transformers' 0.110). Elementwise, so rows stay independent.
        h = h.float()
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, batch, k_cache[i], v_cache[i])
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
        if prefer_transposed(self.layers):
            # tied output layer: a transposed copy of the embedding (float32 only)
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.lm_head = TransposedLinear(weight)
