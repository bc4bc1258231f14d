"""The exact paged-attention backend in plain torch (the CPU reference, and any torch device).

Metadata is built once per step as index tensors: where each new token's K/V go (slot
mapping), which cached slots each query reads, and a mask where one is needed. Target decode
steps and verified tree nodes take *exact* attention (see `exact_rows`); prefill chunks and
the draft head take one masked attention over [context, new tokens].
"""
from __future__ import annotations

import contextlib
import math

from dataclasses import dataclass

import numpy as np
import torch

from augury.attention.tree_mask import ancestor_masks, tree_attention_mask
from augury.cpu import kernels as cpu_kernels
from augury.attention.base import FusedRows
from augury.attention.sdpa import attend
from augury.attention.kv_dtype import as_stored, store_slots

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
# Prompt chunks that end within PREFILL_ROWS_MAX positions (context included; every request's chunk as
# long: a lone prompt), and chunks of at most PREFILL_CHUNK_ROWS tokens after any context (a
# conversation's new turn over its cached history), are exact rows on augury's attention kernel, row j
# reading its request's positions 0 .. ctx + j: through the fused stack, a prompt's forward is one call and
# its every token's numbers are the ones decoding it would give (no batch- or chunk-dependent blocking).
# Other chunks take torch's attention layer by layer. The demo's prefill in the engine (Zen 5 EPYC VM,
# 2 threads, the two paths alternating in one process, medians of 4-6; context + chunk tokens: kernel
# rows' time over the layers'): at avx512_bf16 0 + 800 0.75x, 0 + 1,500 0.74x, 0 + 2,048 0.74x,
# 496 + 64 0.64x, 1,504 + 96 0.65x, 1,504 + 256 0.72x, 2,048 + 2,048 0.59x, 4,096 + 512 0.94x,
# 6,144 + 64 0.34x; with the kernels and torch at avx2 0 + 800 0.93x, 0 + 1,500 0.97x, 0 + 2,048
# 1.00x, 1,504 + 96 0.87x, 4,096 + 128 1.03x, and 0.89-1.38x for chunks of 512-2,048 after 2,048-4,096
# (noisy), so those keep the layer path. (Before the attention kernel's scores and sums were rewritten,
# the layer path won from ~1,000 tokens on the first AVX-512 EPYC.) PREFILL_SLOTS_MAX bounds the
# rows' slot table (rows x positions, int64).
PREFILL_ROWS_MAX = 2048
PREFILL_CHUNK_ROWS = 256
PREFILL_SLOTS_MAX = 1 << 23


def _align(n: int) -> int:
    return -(-n // KEY_ALIGN) * KEY_ALIGN


@dataclass
class ExactRows:
    """Exact attention over `rows` queries (the flattened B*Q): each group is one attention call,
    (its query rows: a slice or an index tensor, the cache slots of each row's W keys flattened
    [G*W], which of them are real [G, 1, 1, W])."""

    rows: int
    groups: tuple[tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor], ...]


@dataclass
class MaskedMetadata:
    """Where a batch's new tokens go in the paged cache and what each may attend to.

    slot_mapping [B*Q]: cache slot of each new token (padding writes to reserved slot 0).
    kv_index [B, C+Q] or None: cache slots of every key a request sees, its C context tokens
    then its Q new ones (read after the new ones are written); None when no request has
    context, and the keys are the new tokens themselves.
    mask [B, 1, Q, C+Q] bool or None; when None, `causal` selects causal vs full visibility.
    """

    slot_mapping: torch.Tensor
    kv_index: torch.Tensor | None
    mask: torch.Tensor | None
    causal: bool = True


def _block_array(block_tables: list[list[int]], width: int) -> np.ndarray:
    """[B, width] block ids, zero-padded (block 0 is the reserved padding block, never read), in numpy:
    the slot lists augury's attention kernel reads are built in numpy (a torch operator costs several
    microseconds a call, a numpy one about one; a decode step's at batch 16 took 0.39 ms in torch,
    0.21 ms in numpy, between two forwards of the demo on an AVX-512 EPYC)."""
    bt = np.zeros((len(block_tables), width), dtype=np.int64)
    for i, table in enumerate(block_tables):
        n = min(len(table), width)
        if n:
            bt[i, :n] = table[:n]
    return bt


def _block_table(block_tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """_block_array's block ids as a torch tensor on `device`."""
    return torch.from_numpy(_block_array(block_tables, width)).to(device)


def _new_slots(bt: torch.Tensor, ctx_lens: list[int], q_lens: list[int], q_width: int, block_size: int
               ) -> torch.Tensor:
    """[B*Q] cache slot of each new token (token i of request b at position ctx_lens[b] + i); padding
    queries write to slot 0."""
    dev = bt.device
    qi = torch.arange(q_width, device=dev)
    new_pos = torch.tensor(ctx_lens, device=dev)[:, None] + qi  # [B, Q]
    slots = bt.gather(1, new_pos // block_size) * block_size + new_pos % block_size
    valid_q = qi[None, :] < torch.tensor(q_lens, device=dev)[:, None]  # [B, Q]
    return torch.where(valid_q, slots, 0).reshape(-1)


def _width(ctx_lens: list[int], q_width: int, block_size: int) -> int:
    return -(-(max(ctx_lens) + q_width) // block_size)


def _position_slots(block_tables: list[list[int]], ctx_lens: list[int], n: int, block_size: int) -> np.ndarray:
    """[B, max(ctx_lens) + n]: each request's cache slot of every position 0 .. max(ctx_lens) + n - 1
    (block 0's slots past a request's blocks, never read)."""
    bt = _block_array(block_tables, _width(ctx_lens, n, block_size))
    at = np.arange(max(ctx_lens) + n)
    return bt[:, at // block_size] * block_size + at % block_size


def padded_positions(ctx_lens: list[int], q_lens: list[int], q_width: int) -> torch.Tensor:
    """Positions [B, q_width] (on the CPU) of B requests' new tokens, q_lens[b] of them after ctx_lens[b]
    cached ones, each row padded to q_width. A padding slot repeats its row's last position: past a
    request near the context's end, padding would lie past the largest position a model's rope table
    holds (its outputs are never read)."""
    last = torch.tensor(q_lens)[:, None] - 1
    return torch.tensor(ctx_lens)[:, None] + torch.minimum(torch.arange(q_width)[None, :], last)


def masked_metadata(block_tables: list[list[int]], ctx_lens: list[int], q_lens: list[int], q_width: int,
                    block_size: int, device: torch.device, tree_mask: torch.Tensor | None = None) -> MaskedMetadata:
    """Metadata for one masked attention: B requests, each with ctx_lens[b] cached tokens and q_lens[b]
    new ones (padded to q_width), causal among the new ones unless tree_mask [B, Q, Q] (True = may
    attend) says otherwise."""
    b, c = len(block_tables), max(ctx_lens)
    bt = _block_table(block_tables, _width(ctx_lens, q_width, block_size), device)
    slot_mapping = _new_slots(bt, ctx_lens, q_lens, q_width, block_size)
    kv_index = None
    if c > 0:
        ci = torch.arange(c, device=device)
        ctx_index = bt.gather(1, (ci // block_size).expand(b, c)) * block_size + ci % block_size  # [B, C]
        kv_index = torch.cat([ctx_index, slot_mapping.view(b, q_width)], dim=1)  # [B, C+Q]
    uniform = all(x == q_width for x in q_lens) and all(x == c for x in ctx_lens)
    if tree_mask is None and uniform and (c == 0 or q_width == 1):
        # no padding anywhere: plain causal (no context) or full visibility (one query)
        return MaskedMetadata(slot_mapping, kv_index, None, causal=(c == 0))
    qi = torch.arange(q_width, device=device)
    if tree_mask is None:
        new_mask = torch.ones(q_width, q_width, dtype=torch.bool, device=device).tril().expand(b, q_width, q_width)
    else:
        new_mask = tree_mask
    key_valid = qi[None, :] < torch.tensor(q_lens, device=device)[:, None]  # [B, Q] new keys that are real
    new_mask = new_mask & key_valid[:, None, :]
    # a padded query row must still see one key (softmax of nothing is NaN): itself
    new_mask = new_mask | torch.eye(q_width, dtype=torch.bool, device=device)[None]
    parts = []
    if c > 0:
        ctx_mask = torch.arange(c, device=device)[None, :] < torch.tensor(ctx_lens, device=device)[:, None]
        parts.append(ctx_mask[:, None, :].expand(b, q_width, c))
    parts.append(new_mask)
    mask = torch.cat(parts, dim=-1)[:, None]  # [B, 1, Q, C+Q]
    return MaskedMetadata(slot_mapping, kv_index, mask, causal=False)


def exact_rows(parents: torch.Tensor, bt: torch.Tensor, block_size: int, ctx_lens: list[int],
               node_slots: torch.Tensor, merge_widths: bool, keep: list[int] | None = None) -> ExactRows | None:
    """Attention that computes each query exactly as plain decoding computes that token.

    Query j of request b (a tree node with parents [B, Q], -1 for a root; a decode step is a
    one-node tree) reads its request's context keys, then its ancestors' and its own, in position
    order: exactly the keys a decode step at its position reads, padded with masked keys to a
    multiple of KEY_ALIGN. One masked attention over a whole tree would sum each node's keys in
    another order and blocking, and in bfloat16 a near-tie would flip a greedy choice. Rows with
    the same padded width share a call (all rows, padded to the widest, with merge_widths).
    None when a batch would take more than MAX_EXACT_GROUPS calls. keep: the flattened rows
    (b * Q + j) that are real queries, in the order the forward packs them (None: all B * Q).
    """
    b, q = parents.shape
    par = parents.tolist()
    paths = [[[j] for j in range(q)] for _ in range(b)]  # node -> its path from the root
    for i in range(b):
        for j in range(1, q):  # a parent comes before its children
            if par[i][j] >= 0:
                paths[i][j] = paths[i][par[i][j]] + [j]
    rows_kept = list(range(b * q)) if keep is None else keep
    n_keys = [ctx_lens[r // q] + len(paths[r // q][r % q]) for r in rows_kept]
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
    if keep is not None:  # packed: row k of the call is flattened row keep[k]
        sel = torch.tensor(keep, device=dev)
        index, valid = index[sel], valid[sel]
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
    return ExactRows(len(rows_kept), tuple(groups))


class StepAttention:
    """One step's attention (attention.base.PagedAttention): layer i writes its new keys and values
    into the cache at the step's slots, then attends exactly (ExactRows) or through one mask."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 masked: MaskedMetadata | None, exact: ExactRows | None,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache  # [layers, slots, nkv, hd]
        self.slot_mapping = slot_mapping
        self.masked = masked
        self.exact = exact
        self.compute_dtype = compute_dtype  # None: the cache's dtype
        # Per exact group, once per step rather than once per layer: the additive mask SDPA would make
        # of its key mask (0 where a key is real, -inf on padding: the same scores), and a lone row's
        # slots and mask doubled. torch's CPU attention computes a lone row another way than a row
        # among others at more than one thread (the last bits differ; measured at 2 threads, none at
        # 1), so a lone row runs as two identical rows: a decode step's row is a verified node's row.
        dt = compute_dtype or k_cache.dtype
        self.exact_calls: list[tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []
        # augury's attention kernel (models/cpu_kernels.py) where it runs: each row over its own slots,
        # read in place from the cache, in float32; the same per row whatever the batch
        self.kernel = _attention_kernel(k_cache) if exact is not None else None
        self.kernel_calls: list[tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._fused_rows = None
        self.timed = True  # the fused stack times its call for the thread choice (False: a prompt's rows)
        if self.kernel is not None:
            for rows, slots, valid in exact.groups:
                g, w = valid.shape[0], valid.shape[-1]
                nkeys = valid.reshape(g, w).sum(-1, dtype=torch.int32)  # valid keys are each row's first ones
                self.kernel_calls.append((rows, slots.view(g, w).contiguous(), nkeys.contiguous()))
            return
        for rows, slots, valid in exact.groups if exact is not None else ():
            mask = torch.zeros(valid.shape, dtype=dt, device=valid.device).masked_fill_(~valid, float("-inf"))
            lone = valid.shape[0] == 1 and valid.device.type == "cpu"
            if lone:
                slots, mask = torch.cat([slots, slots]), torch.cat([mask, mask])
            self.exact_calls.append((rows, slots, mask, lone))

    @classmethod
    def kernel_rows(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    slots: torch.Tensor, nkeys: torch.Tensor, compute_dtype: torch.dtype | None = None
                    ) -> "StepAttention":
        """Exact rows on augury's attention kernel from their slot lists directly: row r reads the
        first nkeys[r] of slots [R, W] (int64) and writes its key and value to slot_mapping[r]."""
        att = cls(k_cache, v_cache, slot_mapping, None, ExactRows(slots.shape[0], ()), compute_dtype)
        if att.kernel is None:
            raise ValueError("kernel_rows needs augury's attention kernel for this cache")
        att.kernel_calls = [(slice(0, slots.shape[0]), slots, nkeys)]
        return att

    def fused_rows(self) -> FusedRows | None:
        """For the fused layer stack (models/fused.py): (k_cache, v_cache, slot_mapping [R], slots [R, W],
        nkeys [R] int32), every row's keys in one table, or None where this step's attention is not
        exact rows on augury's kernel. Built once per step."""
        if not self.kernel_calls:
            return None
        if self._fused_rows is None:
            r = self.exact.rows
            if len(self.kernel_calls) == 1 and self.kernel_calls[0][0] == slice(0, r):
                _, slots, nkeys = self.kernel_calls[0]
            else:
                w = max(s.shape[1] for _, s, _ in self.kernel_calls)
                slots = torch.zeros(r, w, dtype=torch.int64)
                nkeys = torch.zeros(r, dtype=torch.int32)
                for rows, s, n in self.kernel_calls:
                    slots[rows, : s.shape[1]] = s
                    nkeys[rows] = n
            self._fused_rows = FusedRows(self.k_cache, self.v_cache, self.slot_mapping.contiguous(), slots, nkeys)
        return self._fused_rows

    def _attend(self, q, k, v, mask, causal) -> torch.Tensor:
        # a cache of another dtype than the model's (--kv-cache-dtype): the wider of the two
        c = self.compute_dtype or (torch.promote_types(q.dtype, k.dtype) if q.dtype != k.dtype else None)
        if c is None:
            return attend(q, k, v, None, None, mask, causal)
        # upcasting is exact; the output rounds once, into q's dtype
        return attend(q.to(c), k.to(c), v.to(c), None, None, mask, causal).to(q.dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [B, Q, nh, hd]; k, v [B, Q, nkv, hd] -> [B, Q, nh*hd]
        b, ql, nkv, hd = k.shape
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        # converted into the cache's dtype as written (a no-op when it is the model's)
        store_slots(k_cache, self.slot_mapping, k.reshape(b * ql, nkv, hd))
        store_slots(v_cache, self.slot_mapping, v.reshape(b * ql, nkv, hd))
        if self.exact is not None:
            return self._attend_exact(q, k_cache, v_cache).view(b, ql, -1)
        meta = self.masked
        if meta.kv_index is not None:
            # one flat gather of context + new keys (index_select beats advanced indexing ~5x on CPUs)
            flat, n_keys = meta.kv_index.view(-1), meta.kv_index.shape[1]
            k = k_cache.index_select(0, flat).view(b, n_keys, nkv, hd)  # [B, C+Q, nkv, hd]
            v = v_cache.index_select(0, flat).view(b, n_keys, nkv, hd)
        else:  # the new keys alone: read as stored, so that every path sees the cache's values
            k, v = as_stored(k, k_cache.dtype), as_stored(v, v_cache.dtype)
        return self._attend(q, k, v, meta.mask, meta.causal)

    def _attend_exact(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Each query as one aligned decode step over its own keys: q [B, Q, nh, hd] -> [B*Q, 1, nh*hd]."""
        nh, hd = q.shape[2], q.shape[3]
        nkv = k_cache.shape[1]
        exact = self.exact
        if self.kernel is not None:
            flat = q.reshape(-1, nh, hd)
            scale = 1.0 / math.sqrt(hd)
            out = None
            for rows, slots, nkeys in self.kernel_calls:
                o = self.kernel.attend_rows(flat[rows].contiguous(), k_cache, v_cache, slots, nkeys, scale)
                if len(self.kernel_calls) == 1:
                    return o.view(-1, 1, nh * hd)
                if out is None:
                    out = o.new_empty(exact.rows, 1, nh * hd)
                out[rows] = o.view(-1, 1, nh * hd)
            return out
        flat = q.reshape(-1, 1, nh, hd)
        # torch's CPU attention at 2+ threads gives the query where its second thread starts other bits
        # than the same query in another batch (torch 2.13, float32 with a mask): one thread, so a
        # verified node's row is the decode step's (tests/test_cpu_threads.py)
        with cpu_kernels.torch_threads(1) if q.device.type == "cpu" else contextlib.nullcontext():
            return self._attend_torch_rows(flat, k_cache, v_cache, nkv, hd)

    def _attend_torch_rows(self, flat, k_cache, v_cache, nkv: int, hd: int) -> torch.Tensor:
        exact = self.exact
        out = None
        for rows, slots, mask, lone in self.exact_calls:
            g, w = mask.shape[0], mask.shape[-1]
            k = k_cache.index_select(0, slots).view(g, w, nkv, hd)
            v = v_cache.index_select(0, slots).view(g, w, nkv, hd)
            qr = flat[rows]
            if lone:
                o = self._attend(torch.cat([qr, qr]), k, v, mask, False)[:1]
            else:
                o = self._attend(qr, k, v, mask, False)
            if len(exact.groups) == 1:
                return o
            if out is None:
                out = o.new_empty(exact.rows, 1, o.shape[-1])
            out[rows] = o
        return out


def _attention_kernel(k_cache: torch.Tensor):
    """augury's exact-rows attention kernel for this cache, or None (not a CPU cache it takes, or the
    kernel cannot be built here: then torch's attention runs)."""
    if (k_cache.device.type != "cpu" or k_cache.dtype not in cpu_kernels.ATTENTION_CACHE_FORMATS
            or k_cache.shape[-1] % 8 or not k_cache.is_contiguous()):
        return None
    return cpu_kernels.attention()


class CausalNoCache:
    """PagedAttention for a forward that needs no cache (training's frozen target pass): causal
    attention among the new tokens of each row; nothing is stored."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, None, None, None, True)

    def fused_rows(self) -> None:
        return None


class PagedBackend:
    """AttentionBackend over one model's paged cache (k_cache/v_cache [layers, slots, nkv, hd]).

    merge_widths lets exact rows with different key counts share one call, padded to the widest
    (bit-exact in WIDTH_FREE_DTYPES); otherwise rows are grouped by padded width, and a batch
    needing more than MAX_EXACT_GROUPS calls falls back to one masked call.

    A 16-bit cache on a CPU attends in float32: the keys and values are upcast exactly after the
    gather and the output is rounded once. On CPUs with native bfloat16 too: there torch's bfloat16
    attention is faster, but its bits depend on how the rows are batched (a prompt prefilled after a
    prefix-cache hit came out other than the same prompt prefilled whole, AVX512-BF16 EPYC), so
    float32 is the one path on every CPU. An fp8 cache (--kv-cache-dtype fp8) attends in float32 too, widened
    exactly as read, on the kernel and in torch alike. On an AVX2 CPU float32 is also the fast one. Measured on such a CPU (one thread, 9 query / 3 KV heads of 64, one query): bfloat16
    SDPA 126 us at 112 keys and 627 us at 512, float32 29 us and 83 us. Float32 rows keep the
    properties exact attention stands on (WIDTH_FREE_DTYPES), so verification stays decoding.
    """

    name = "paged-exact"

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
                 merge_widths: bool | None = None, compute_dtype: torch.dtype | None = None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.block_size = block_size
        self.device = k_cache.device
        if compute_dtype is None and (k_cache.dtype in (torch.bfloat16, torch.float16) and self.device.type == "cpu"
                                      or k_cache.element_size() == 1):
            compute_dtype = torch.float32
        self.compute_dtype = compute_dtype
        widths_free = (compute_dtype or k_cache.dtype) in WIDTH_FREE_DTYPES
        self.merge_widths = widths_free if merge_widths is None else merge_widths

    def prepare_prefill(self, block_tables: list[list[int]], ctx_lens: list[int],
                        q_lens: list[int]) -> StepAttention:
        q = max(q_lens)
        span = max(ctx_lens) + q
        if q > 1 and min(q_lens) == q and (span <= PREFILL_ROWS_MAX or q <= PREFILL_CHUNK_ROWS) \
                and len(q_lens) * q * span <= PREFILL_SLOTS_MAX and self.device.type == "cpu" \
                and _attention_kernel(self.k_cache) is not None:
            return self._prompt_rows(block_tables, ctx_lens, q)
        parents = torch.full((len(q_lens), 1), -1) if q == 1 else None  # one-token chunks are decode steps
        return self._prepare(block_tables, ctx_lens, q_lens, parents)

    def prepare_decode(self, block_tables: list[list[int]], ctx_lens: list[int]) -> StepAttention:
        if self._rows_on_kernel(ctx_lens):
            return self._decode_rows(block_tables, ctx_lens)
        return self._prepare(block_tables, ctx_lens, [1] * len(ctx_lens), torch.full((len(ctx_lens), 1), -1))

    def _decode_rows(self, block_tables: list[list[int]], ctx_lens: list[int]) -> StepAttention:
        """A decode step on augury's attention kernel: each row's slots (its context in position order,
        then its new token) built in a few numpy operations, with no width groups, padding or mask
        (the kernel reads only a row's first nkeys slots): the keys exact_rows would give it, in the
        same order, for a fraction of the per-step Python (~1 ms a step at batch 1 under cProfile)."""
        ctx = np.asarray(ctx_lens)
        slots = np.ascontiguousarray(_position_slots(block_tables, ctx_lens, 1, self.block_size))  # [B, W]; past
        # a row's own new token its slots are never read
        slot_mapping = np.ascontiguousarray(slots[np.arange(len(ctx_lens)), ctx])
        return StepAttention.kernel_rows(self.k_cache, self.v_cache, torch.from_numpy(slot_mapping),
                                         torch.from_numpy(slots), torch.from_numpy((ctx + 1).astype(np.int32)),
                                         self.compute_dtype)

    def prepare_tree(self, block_tables: list[list[int]], ctx_lens: list[int], parents: torch.Tensor
                     ) -> StepAttention:
        n = parents.shape[1]
        if self._rows_on_kernel(ctx_lens):
            return self._tree_rows(block_tables, ctx_lens, parents.cpu())
        return self._prepare(block_tables, ctx_lens, [n] * len(ctx_lens), parents.cpu(), tree=True)

    def _prompt_rows(self, block_tables: list[list[int]], ctx_lens: list[int], q: int) -> StepAttention:
        """Prompt chunks of q tokens each on augury's attention kernel (PREFILL_ROWS_MAX and the bounds
        beside it): token j of request b is written at position ctx_b + j and reads positions 0 .. ctx_b +
        j, in order (a chain's keys, as _tree_rows gives them, without walking paths). Untimed: a prompt's
        forward is too rare and too dear for the thread choice to explore on (cpu/threads.py)."""
        ctx_all = np.asarray(ctx_lens)
        req_slots = _position_slots(block_tables, ctx_lens, q, self.block_size)  # [B, span]
        req = np.repeat(np.arange(len(ctx_lens)), q)
        pos = np.tile(np.arange(q), len(ctx_lens)) + ctx_all[req]  # [R] each row's position
        slots = torch.from_numpy(np.ascontiguousarray(req_slots[req]))  # [R, span]; past nkeys never read
        slot_mapping = torch.from_numpy(np.ascontiguousarray(req_slots[req, pos]))
        nkeys = torch.from_numpy((pos + 1).astype(np.int32))
        att = StepAttention.kernel_rows(self.k_cache, self.v_cache, slot_mapping, slots, nkeys, self.compute_dtype)
        att.timed = False
        return att

    def _rows_on_kernel(self, ctx_lens: list[int]) -> bool:
        """Whether a step's exact rows go to augury's attention kernel as slot lists built directly
        (_decode_rows, _tree_rows): a CPU cache the kernel takes, and every request with context."""
        return min(ctx_lens) > 0 and self.device.type == "cpu" and _attention_kernel(self.k_cache) is not None

    def _tree_rows(self, block_tables: list[list[int]], ctx_lens: list[int], parents: torch.Tensor,
                   sizes: list[int] | None = None) -> StepAttention:
        """Verified trees on augury's attention kernel, as _decode_rows does decode steps: node j of
        request b (parents [B, N], a parent before its children, -1 for the root) reads its request's
        context, positions 0 .. ctx_b - 1, then its path's nodes root .. j (node i is written at position
        ctx_b + i), in that order: the keys exact_rows gives it, built in a few numpy operations over
        the whole batch (exact_rows walks every node's path in Python and groups rows by width, which
        fused_rows then merges again: 0.5 ms a step for one 15-node tree, 4.5 ms for 16 and 15 ms for 48
        on an AVX-512 EPYC, against 0.06 to 0.6 ms for the decode steps of those batches). sizes: only
        the first sizes[b] nodes of each tree, packed b-major (prepare_packed_tree); None: every node."""
        bs = self.block_size
        par = parents.numpy()
        b, n = par.shape
        idx = np.arange(n)
        if (sizes is None or all(x == n for x in sizes)) and (par == idx - 1).all():
            att = self._prompt_rows(block_tables, ctx_lens, n)  # chains (a lone request's free drafts):
            att.timed = True  # each node's path is every node before it, as a prompt's rows read
            return att
        on_path = ancestor_masks(par)  # [b, j, i]: node i is on node j's path
        counts = np.asarray(sizes if sizes is not None else [n] * b)
        req = np.repeat(np.arange(b), counts)  # [R] each row's request ...
        node = np.arange(req.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)  # ... and its node
        on_path = on_path[req, node]  # [R, N]
        path_len = on_path.sum(-1)
        # each row's path nodes in index order, which is root first (parents precede children), then n's
        path = np.sort(np.where(on_path, idx, n), axis=-1)
        ctx_all = np.asarray(ctx_lens)
        ctx = ctx_all[req]
        nkeys = ctx + path_len
        # each request's slot of every position its rows may read (its context and its tree's nodes):
        # a row's keys are its request's context slots, then its path's, which overwrite what follows
        req_slots = _position_slots(block_tables, ctx_lens, n, bs)  # [B, span]
        slots = req_slots[:, : int(nkeys.max())][req]  # [R, W]; past a row's nkeys: never read
        real = idx[None, :] < path_len[:, None]  # [R, N]: the row's k-th path node exists
        row = np.broadcast_to(np.arange(req.shape[0])[:, None], real.shape)[real]
        slots[row, (ctx[:, None] + idx)[real]] = req_slots[req[row], (ctx[:, None] + path)[real]]
        slot_mapping = torch.from_numpy(np.ascontiguousarray(req_slots[req, ctx + node]))
        slots = torch.from_numpy(slots)
        nkeys = torch.from_numpy(nkeys.astype(np.int32))
        return StepAttention.kernel_rows(self.k_cache, self.v_cache, slot_mapping, slots, nkeys, self.compute_dtype)

    def prepare_packed_tree(self, block_tables: list[list[int]], ctx_lens: list[int], parents: torch.Tensor,
                            sizes: list[int]) -> StepAttention | None:
        """Only the first sizes[b] nodes of each tree, packed into one row of sum(sizes) queries (b-major):
        node i of request b is still written to cache position ctx_lens[b] + i. None when the exact
        path cannot take the batch (the caller then verifies the padded trees)."""
        b, n = parents.shape
        if min(ctx_lens) <= 0:
            return None
        if self._rows_on_kernel(ctx_lens):
            return self._tree_rows(block_tables, ctx_lens, parents.cpu(), sizes)
        bs, dev = self.block_size, self.device
        keep = [i * n + j for i in range(b) for j in range(sizes[i])]
        bt = _block_table(block_tables, _width(ctx_lens, n, bs), dev)
        slots = _new_slots(bt, ctx_lens, [n] * b, n, bs)
        rows = exact_rows(parents.cpu(), bt, bs, ctx_lens, slots.view(b, n), self.merge_widths, keep)
        if rows is None:
            return None
        return StepAttention(self.k_cache, self.v_cache, slots[torch.tensor(keep, device=dev)], None, rows,
                                  self.compute_dtype)

    def _prepare(self, block_tables, ctx_lens, q_lens, parents, tree: bool = False) -> StepAttention:
        q_width, bs, dev = max(q_lens), self.block_size, self.device
        if parents is not None and max(ctx_lens) > 0 and all(x == q_width for x in q_lens):
            bt = _block_table(block_tables, _width(ctx_lens, q_width, bs), dev)
            slots = _new_slots(bt, ctx_lens, q_lens, q_width, bs)
            rows = exact_rows(parents, bt, bs, ctx_lens, slots.view(len(q_lens), q_width), self.merge_widths)
            if rows is not None:  # no mask needed: every query reads exactly its own keys
                return StepAttention(self.k_cache, self.v_cache, slots, None, rows, self.compute_dtype)
        # the masked fallback: a tree's ancestor mask, built only here (the exact path needs none)
        tree_mask = tree_attention_mask(parents).to(dev) if tree else None
        meta = masked_metadata(block_tables, ctx_lens, q_lens, q_width, bs, dev, tree_mask)
        return StepAttention(self.k_cache, self.v_cache, meta.slot_mapping, meta, None, self.compute_dtype)
