"""The interface every attention backend implements (a Protocol: backends need not inherit)."""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class FusedRows(NamedTuple):
    """Every row of an exact-rows step in one table, for the fused layer stack (models/fused.py):
    the cache it reads and writes, where each row's new key goes, and each row's key slots."""

    k_cache: torch.Tensor  # [layers, slots, nkv, hd]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [R] int64: the cache slot of row r's new key and value
    slots: torch.Tensor  # [R, W] int64: row r's keys, in position order, its own last
    nkeys: torch.Tensor  # [R] int32: how many of slots[r] row r reads


class PagedAttention(Protocol):
    """One step's attention over a paged KV cache, prepared by an attention backend (see
    augury.attention) once for all layers: the model calls it from every layer."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, Q, H, hd], k/v [B, Q, Hkv, hd] (rope applied): stores layer `layer`'s new keys and
        values in the cache and returns the attention output [B, Q, H*hd]."""
        ...

    def fused_rows(self) -> FusedRows | None:
        """This step's rows as one table where its attention is exact rows on augury's CPU kernel
        (decode steps, verified trees), so the whole layer stack may run as one call; else None."""
        ...


class AttentionBackend(Protocol):
    """Builds, once per step, what every layer's attention needs for a batch of B requests.

    block_tables[b]: request b's cache blocks; ctx_lens[b]: tokens of b already in the cache.
    The returned PagedAttention writes each layer's new keys and values into the cache and
    attends; the engine hands it to the model's forward.
    """

    name: str

    def prepare_prefill(self, block_tables: list[list[int]], ctx_lens: list[int],
                        q_lens: list[int]) -> PagedAttention:
        """q_lens[b] new tokens of request b (a prompt chunk), causal among themselves."""
        ...

    def prepare_decode(self, block_tables: list[list[int]], ctx_lens: list[int]) -> PagedAttention:
        """One new token per request."""
        ...

    def prepare_tree(self, block_tables: list[list[int]], ctx_lens: list[int], parents: torch.Tensor) -> PagedAttention:
        """A draft tree per request: parents [B, N] (-1 for the root; a parent precedes its children).
        Node i of request b attends to its context, its ancestors and itself, and is written to cache
        position ctx_lens[b] + i."""
        ...

    def prepare_packed_tree(self, block_tables: list[list[int]], ctx_lens: list[int], parents: torch.Tensor,
                            sizes: list[int]) -> PagedAttention | None:
        """As prepare_tree, for only the first sizes[b] nodes of each tree, packed b-major into one
        row of sum(sizes) queries; None when this backend cannot (the caller pads instead)."""
        ...
