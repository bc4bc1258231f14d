"""Turns block tables and lengths into the index tensors and masks one forward needs."""
from __future__ import annotations

import torch

from augury.models.llama import AttnBatch, ExactTree

# Exact attention (the target's forwards): a single-query row reads its keys in position order,
# padded with masked keys to a multiple of KEY_ALIGN. On CPUs such a row comes out bit for bit the
# same whatever batch it shares a call with, and (in WIDTH_FREE_DTYPES) whatever wider multiple it
# is padded to; without the alignment the key count's remainder changes the summation (measured;
# a test in tests/test_speculative.py checks both against torch). So a decode step and every node
# of a verified tree compute the same numbers, and a whole tree takes one attention call.
KEY_ALIGN = 16
WIDTH_FREE_DTYPES = (torch.float32, torch.bfloat16)
# rows x keys gathered per exact attention call (bounds the copy of a large batch's keys)
EXACT_CALL_SLOTS = 1 << 16
# without merge_widths, past this many distinct padded widths a batch takes the masked call
MAX_EXACT_GROUPS = 16


def _align(n: int) -> int:
    return -(-n // KEY_ALIGN) * KEY_ALIGN


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
    exact: bool = False,
    merge_widths: bool = False,
) -> AttnBatch:
    """Metadata for B requests, each with ctx_lens[b] cached tokens and q_lens[b] new ones.

    New token i of request b sits at logical position ctx_lens[b] + i (its cache slot).
    q_width is the padded query width Q. tree_mask [B, Q, Q] (True = may attend) replaces
    the causal mask among new tokens (speculative verification). With write=False the new
    tokens go to the reserved slot 0 (drafting scratch that must not touch the cache).
    exact=True (the target's forwards) computes a decode step (one new token each), and with
    tree_parents [B, Q] every node of a verified tree, as an aligned single-query attention over
    exactly its own keys (see KEY_ALIGN and `exact_rows`); merge_widths lets rows with different
    key counts share one call (true of WIDTH_FREE_DTYPES).
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

    if exact and write and c > 0 and all(x == q_width for x in q_lens):
        parents = tree_parents if tree_parents is not None else (None if q_width > 1 else torch.full((b, 1), -1))
        if parents is not None:
            rows = exact_rows(parents, bt, block_size, ctx_lens, slot_mapping.view(b, q_width), merge_widths)
            if rows is not None:  # no mask needed: every query reads exactly its own keys
                return AttnBatch(slot_mapping, None, None, causal=False, exact=rows)

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


def exact_rows(parents: torch.Tensor, bt: torch.Tensor, block_size: int, ctx_lens: list[int],
               node_slots: torch.Tensor, merge_widths: bool) -> ExactTree | None:
    """Attention that computes each query exactly as plain decoding computes that token.

    Query j of request b (a tree node with parents [B, Q], -1 for a root; a decode step is a
    one-node tree) reads its request's context keys, then its ancestors' and its own, in position
    order: exactly the keys a decode step at its position reads, padded with masked keys to a
    multiple of KEY_ALIGN. One masked attention over a whole tree would sum each node's keys in
    another order and blocking, and in bfloat16 a near-tie would flip a greedy choice. Rows with
    the same padded width share a call (all rows, padded to the widest, with merge_widths).
    None when a batch would take more than MAX_EXACT_GROUPS calls.
    """
    b, q = parents.shape
    par = parents.tolist()
    paths = [[[j] for j in range(q)] for _ in range(b)]  # node -> its path from the root
    for i in range(b):
        for j in range(1, q):  # a parent comes before its children
            if par[i][j] >= 0:
                paths[i][j] = paths[i][par[i][j]] + [j]
    n_keys = [ctx_lens[i] + len(path) for i in range(b) for path in paths[i]]
    widths = [_align(n) for n in n_keys]
    if merge_widths:
        widths = [max(widths)] * len(widths)
    distinct = sorted(set(widths))
    if len(distinct) > MAX_EXACT_GROUPS:
        return None
    dev, w_max, depth = node_slots.device, max(widths), max(len(p) for ps in paths for p in ps)
    # slot of key k of row r: context position k, else its path's (k - ctx)-th node, else padding
    ctx = torch.tensor([ctx_lens[i] for i in range(b) for _ in range(q)], device=dev)[:, None]  # [R, 1]
    keys = torch.arange(w_max, device=dev)[None, :]  # [1, W]
    in_ctx = keys < ctx
    pos = torch.minimum(keys, (ctx - 1).clamp(min=0))
    req = torch.arange(b, device=dev).repeat_interleave(q)[:, None]  # [R, 1]
    ctx_slot = bt[req, pos // block_size] * block_size + pos % block_size  # [R, W]
    path_slot = torch.zeros(b * q, depth + 1, dtype=torch.long)  # column `depth`: padding
    path_len = torch.zeros(b * q, 1, dtype=torch.long)
    node_cpu = node_slots.cpu()  # one copy, not one per node
    for i in range(b):
        for j, path in enumerate(paths[i]):
            path_slot[i * q + j, : len(path)] = node_cpu[i, path]
            path_len[i * q + j] = len(path)
    path_slot, path_len = path_slot.to(dev), path_len.to(dev)
    along = (keys - ctx).clamp(min=0)
    along = torch.where(along < path_len, along, depth)
    index = torch.where(in_ctx, ctx_slot, path_slot.gather(1, along.expand(b * q, w_max)))
    valid = keys < (ctx + path_len)
    groups = []
    for w in distinct:
        members = [r for r, x in enumerate(widths) if x == w]
        per_call = max(1, EXACT_CALL_SLOTS // w)
        for lo in range(0, len(members), per_call):
            chunk = members[lo : lo + per_call]
            rows: slice | torch.Tensor
            if chunk == list(range(chunk[0], chunk[-1] + 1)):
                rows = slice(chunk[0], chunk[-1] + 1)
            else:
                rows = torch.tensor(chunk, device=dev)
            groups.append((rows, index[rows, :w].contiguous().view(-1), valid[rows, :w][:, None, None, :]))
    return ExactTree(b * q, tuple(groups))
