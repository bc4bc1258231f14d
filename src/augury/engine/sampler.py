"""Next-token choice for a batch: greedy rows by argmax, the rest by seeded sampling."""
from __future__ import annotations

import torch

from augury.core.request import Request
from augury.sampling import apply_sampling_filters, draw_rows, greedy_ids


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits [B, V] float32 -> one token id per request: argmax for greedy rows; a sampled row draws
    its next output token at that position's uniform (Request.uniforms), as verification does. A
    request's shaper (penalties, logit bias, bad words, a grammar's mask) shapes a copy of its row
    first; `logits` itself is left raw (log-probabilities read it)."""
    # greedy rows take their shaper's greedy token (LogitsShaper.greedy); sampled ones draw from a shaped copy
    greedy = [r.shaper if r.shaper is not None and r.params.temperature == 0.0 else None for r in requests]
    shaped = [i for i, r in enumerate(requests) if r.shaper is not None and r.params.temperature != 0.0]
    if shaped:
        logits = logits.clone()
        for i in shaped:
            requests[i].shaper.apply(logits[i])
    out = greedy_ids(logits, greedy)
    rows = [i for i, req in enumerate(requests) if req.params.temperature != 0.0]
    for i in rows:
        req, p = requests[i], requests[i].params
        # [1, V]; request generators live on the CPU, so draw there
        probs = apply_sampling_filters(logits[i : i + 1], p.temperature, p.top_k, p.top_p, p.min_p).cpu()
        out[i] = draw_rows(probs, req.uniforms(len(req.output_token_ids), 1))[0]
    return out
