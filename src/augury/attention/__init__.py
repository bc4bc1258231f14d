"""Attention backends: metadata for one step's forward, prepared once as tensors, and attention
for one layer over the paged KV cache.

The model code (models/) sees only `PagedAttention` (base.py): a callable taking a layer's
queries and new keys/values, and the step's rows as one table for the fused layer stack. A backend
prepares one for a batch of decode rows, prefill chunks or draft trees; `PagedBackend` (paged.py:
exact, any torch device, augury's CPU attention kernel where it runs) is today's only one. A
faster CPU backend or a CUDA backend with static-shape metadata buffers implements the same
three `prepare_*` methods and needs no change in the model.
"""
from augury.attention.base import AttentionBackend, FusedRows, PagedAttention
from augury.attention.paged import (
    KEY_ALIGN,
    CausalNoCache,
    WIDTH_FREE_DTYPES,
    MaskedMetadata,
    PagedBackend,
    masked_metadata,
    padded_positions,
)

__all__ = ["KEY_ALIGN", "CausalNoCache", "WIDTH_FREE_DTYPES", "AttentionBackend", "FusedRows", "PagedAttention", "MaskedMetadata", "PagedBackend",
           "masked_metadata", "padded_positions"]
