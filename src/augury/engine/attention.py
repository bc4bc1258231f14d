"""Turns block tables and lengths into the index tensors and masks one forward needs."""
from __future__ import annotations

import torch

from augury.models.llama import AttnBatch, ExactTree

# Exact tree attention splits a verification into one attention call per key count; past this
# many calls (a batch of requests of different lengths) it falls back to one masked call. A
# single request's tree always takes the exact path (one call per depth).
MAX_EXACT_GROUPS = 16


def build_attn_batch(
    block_tables: list[list[int]],
    ctx_lens: list[int],
    q_lens: list[int],
    q_width: int,
    block_size: int,
    device: torch.device,
    tree_mask: torch.Tensor | None = None,
    write: bool = True,
    tree_parents: torch.Tensor | None = None,
) -> AttnBatch:
    """Metadata for B requests, each with ctx_lens[b] cached tokens and q_lens[b] new ones.

    New token i of request b sits at logical position ctx_lens[b] + i (its cache slot).
    q_width is the padded query width Q. tree_mask [B, Q, Q] (True = may attend) replaces
    the causal mask among new tokens (speculative verification). With write=False the new
    tokens go to the reserved slot 0 (drafting scratch that must not touch the cache).
    tree_parents [B, Q] (with tree_mask) asks for exact tree attention, see `exact_groups`.
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

    if tree_parents is not None and write and all(x == q_width for x in q_lens):
        exact = exact_groups(tree_parents, kv_index, ctx_lens, slot_mapping.view(b, q_width))
        if exact is not None:  # no mask needed: every query reads exactly its own keys
            return AttnBatch(slot_mapping, kv_index, None, causal=False, exact=exact)
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


def exact_groups(parents: torch.Tensor, kv_index: torch.Tensor | None, ctx_lens: list[int],
                 node_slots: torch.Tensor) -> ExactTree | None:
    """Tree attention that computes each node exactly as plain decoding would compute that token.

    One masked attention over the whole tree sums each node's keys in another order and
    blocking than a decode step over exactly its own keys, so in bfloat16 a near-tie can flip
    a greedy choice. Here node i of request b attends to its request's context keys followed by
    its ancestors' and its own, in position order: exactly the keys a decode step at that
    position reads. Nodes with the same number of keys share one attention call (the rows of a
    batched call are computed independently, so the result is bit for bit the single-query one).
    None when a batch of several requests would take more than MAX_EXACT_GROUPS calls.
    """
    b, q = parents.shape
    par = parents.tolist()
    paths = [[[j] for j in range(q)] for _ in range(b)]  # node -> its path from the root
    for i in range(b):
        for j in range(1, q):  # a parent comes before its children
            paths[i][j] = paths[i][par[i][j]] + [j]
    lengths = {ctx_lens[i] + len(path) for i in range(b) for path in paths[i]}
    if b > 1 and len(lengths) > MAX_EXACT_GROUPS:
        return None
    by_len: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
    for i in range(b):
        ctx = kv_index[i, : ctx_lens[i]] if kv_index is not None else node_slots.new_empty(0)
        for j, path in enumerate(paths[i]):
            rows, slots = by_len.setdefault(ctx_lens[i] + len(path), ([], []))
            rows.append(i * q + j)
            slots.append(torch.cat([ctx, node_slots[i, path]]))
    dev = node_slots.device
    groups, offset = [], 0
    for n_keys, (rows, slots) in by_len.items():
        groups.append((torch.tensor(rows, device=dev), len(rows), n_keys, offset))
        offset += len(rows) * n_keys
    return ExactTree(torch.cat([t for _, slots in by_len.values() for t in slots]), tuple(groups))
