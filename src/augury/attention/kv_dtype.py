"""The KV cache's element types (--kv-cache-dtype): names, and how keys and values are written into a
cache of each. Attention reads every type in place and widens it exactly (attention/paged.py, the CPU
kernel in cpu/csrc/attention.h).

An 8-bit cache is fp8 e4m3 (torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, largest 448), the type
vLLM's `--kv-cache-dtype fp8` names, stored with no scale (vLLM's default k/v scale of 1.0): a key or value
rounds to the nearest e4m3 number, a relative error of at most 1/16, and magnitudes past 448 saturate.
"""
from __future__ import annotations

import torch

# --kv-cache-dtype's names beyond torch's own
KV_DTYPE_ALIASES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
FP8_MAX = 448.0


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a --kv-cache-dtype name ("auto": the model's)."""
    return model_dtype if name == "auto" else KV_DTYPE_ALIASES.get(name) or getattr(torch, name)


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x converted into a cache of `dtype` as writing it there would (an fp8 cache saturates at +-448)."""
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def store_slots(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots[i]] = x[i], converted into the cache's dtype (as_stored). torch has no float8 index_copy_
    on CPUs: an 8-bit cache's bytes are copied through a uint8 view."""
    x = as_stored(x, cache.dtype)
    if cache.element_size() == 1:
        cache.view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, x)
