"""Scaled dot-product attention of new queries over [context keys, new keys] (torch's kernel): the
masked path of every backend, prefill chunks, the draft head and training."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_ctx: torch.Tensor | None,
    v_ctx: torch.Tensor | None,
    mask: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """Scaled dot-product attention of new queries over [context keys, new keys].

    q [B, Q, H, hd]; k_new/v_new [B, Q, Hkv, hd]; k_ctx/v_ctx [B, C, Hkv, hd] or None;
    mask [B, 1, Q, C+Q] bool (True = may attend) or None (then `causal` says whether the
    new block is causal with no context, or everything is visible). Returns [B, Q, H*hd].
    """
    if k_ctx is not None:
        k = torch.cat([k_ctx, k_new], dim=1)
        v = torch.cat([v_ctx, v_new], dim=1)
    else:
        k, v = k_new, v_new
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, len, hd]
    gqa = qt.shape[1] != kt.shape[1]
    if mask is not None:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal and q.shape[1] > 1, enable_gqa=gqa)
    b, _, ql, _ = out.shape
    return out.transpose(1, 2).reshape(b, ql, -1)
