"""Turns block tables and lengths into the index tensors and masks one forward needs."""
from __future__ import annotations

import torch

from augury.models.llama import AttnBatch


def build_attn_batch(
    block_tables: list[list[int]],
    ctx_lens: list[int],
    q_lens: list[int],
    q_width: int,
    block_size: int,
    device: torch.device,
    tree_mask: torch.Tensor | None = None,
    write: bool = True,
) -> AttnBatch:
    """Metadata for B requests, each with ctx_lens[b] cached tokens and q_lens[b] new ones.

    New token i of request b sits at logical position ctx_lens[b] + i (its cache slot).
    q_width is the padded query width Q. tree_mask [B, Q, Q] (True = may attend) replaces
    the causal mask among new tokens (speculative verification). With write=False the new
    tokens go to the reserved slot 0 (drafting scratch that must not touch the cache).
    """
    b = len(block_tables)
    c = max(ctx_lens)
    width = -(-(c + q_width) // block_size)
    bt = torch.zeros(b, width, dtype=torch.long)
    for i, table in enumerate(block_tables):
        n = min(len(table), width)
        if n:
            bt[i, :n] = torch.tensor(table[:n])
    bt = bt.to(device)
    ctx_len_t = torch.tensor(ctx_lens, device=device)
    q_len_t = torch.tensor(q_lens, device=device)
    qi = torch.arange(q_width, device=device)
    new_pos = ctx_len_t[:, None] + qi  # [B, Q] logical positions of the new tokens
    slots = bt.gather(1, new_pos // block_size) * block_size + new_pos % block_size
    valid_q = qi[None, :] < q_len_t[:, None]  # [B, Q]
    if not write:
        valid_q = torch.zeros_like(valid_q)
    slot_mapping = torch.where(valid_q, slots, 0).reshape(-1)

    kv_index = None
    if c > 0:
        ci = torch.arange(c, device=device)
        ctx_index = bt.gather(1, (ci // block_size).expand(b, c)) * block_size + ci % block_size  # [B, C]
        kv_index = torch.cat([ctx_index, slot_mapping.view(b, q_width)], dim=1)  # [B, C+Q]

    uniform = all(x == q_width for x in q_lens) and all(x == c for x in ctx_lens)
    if tree_mask is None and uniform and (c == 0 or q_width == 1):
        # no padding anywhere: plain causal (no context) or full visibility (one query)
        return AttnBatch(slot_mapping, kv_index, None, causal=(c == 0))
    if tree_mask is None:
        new_mask = torch.ones(q_width, q_width, dtype=torch.bool, device=device).tril()
        new_mask = new_mask.expand(b, q_width, q_width)
    else:
        new_mask = tree_mask
    key_valid = qi[None, :] < q_len_t[:, None]  # [B, Q] new keys that are real tokens
    new_mask = new_mask & key_valid[:, None, :]
    # a padded query row must still see one key (softmax of nothing is NaN): itself
    new_mask = new_mask | torch.eye(q_width, dtype=torch.bool, device=device)[None]
    parts = []
    if c > 0:
        ctx_mask = torch.arange(c, device=device)[None, :] < ctx_len_t[:, None]  # [B, C]
        parts.append(ctx_mask[:, None, :].expand(b, q_width, c))
    parts.append(new_mask)
    mask = torch.cat(parts, dim=-1)[:, None]  # [B, 1, Q, C+Q]
    return AttnBatch(slot_mapping, kv_index, mask, causal=False)
