"""Next-token choice for a batch: greedy rows by argmax, the rest by seeded sampling."""
from __future__ import annotations

import torch

from augury.engine.request import Request
from augury.sampling import apply_sampling_filters


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits [B, V] float32 -> one token id per request."""
    out = logits.argmax(dim=-1).tolist()
    for i, req in enumerate(requests):
        p = req.params
        if p.temperature == 0.0:
            continue
        # [V]; request generators live on the CPU, so draw there
        probs = apply_sampling_filters(logits[i], p.temperature, p.top_k, p.top_p).cpu()
        out[i] = int(torch.multinomial(probs, 1, generator=req.generator).item())
    return out
