"""The interface every attention backend implements (a Protocol: backends need not inherit)."""
from __future__ import annotations

from typing import Protocol

import torch

from augury.models.layers import PagedAttention


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
