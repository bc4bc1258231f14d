"""Attention backends: metadata for one step's forward, prepared once as tensors, and attention
for one layer over the paged KV cache.

The model code (models/) sees only `models.layers.PagedAttention`: a callable taking a layer's
queries and new keys/values. A backend prepares one for a batch of decode rows, prefill chunks
or draft trees; `TorchPagedBackend` (exact, CPU and any torch device) is today's only one. A
faster CPU backend or a CUDA backend with static-shape metadata buffers implements the same
three `prepare_*` methods and needs no change in the model.
"""
from augury.attention.base import AttentionBackend
from augury.attention.torch_paged import (
    KEY_ALIGN,
    CausalNoCache,
    WIDTH_FREE_DTYPES,
    MaskedMetadata,
    TorchPagedBackend,
    masked_metadata,
)

__all__ = ["KEY_ALIGN", "CausalNoCache", "WIDTH_FREE_DTYPES", "AttentionBackend", "MaskedMetadata", "TorchPagedBackend",
           "masked_metadata"]
