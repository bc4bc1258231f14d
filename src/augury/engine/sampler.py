"""Next-token choice for a batch: greedy rows by argmax, the rest by seeded sampling."""
from __future__ import annotations

import torch

from augury.core.request import Request
from augury.sampling import apply_sampling_filters, argmax_ids, draw_rows


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits [B, V] float32 -> one token id per request: argmax for greedy rows; a sampled row draws
    its next output token at that position's uniform (Request.uniforms), as verification does. A
    request's shaper (penalties, logit bias, bad words, a grammar's mask) shapes a copy of its row
    first; `logits` itself is left raw (log-probabilities read it)."""
    shaped = [i for i, req in enumerate(requests) if req.shaper is not None]
    picked: dict[int, int] = {}  # greedy shaped rows: their token (LogitsShaper.greedy)
    if shaped:
        logits = logits.clone()
        for i in shaped:
            if requests[i].params.temperature == 0.0:
                picked[i] = requests[i].shaper.greedy(logits[i])
            else:
                requests[i].shaper.apply(logits[i])
    out = argmax_ids(logits) if len(picked) < len(requests) else [0] * len(requests)
    for i, tok in picked.items():
        out[i] = tok
    rows = [i for i, req in enumerate(requests) if req.params.temperature != 0.0]
    for i in rows:
        req, p = requests[i], requests[i].params
        # [1, V]; request generators live on the CPU, so draw there
        probs = apply_sampling_filters(logits[i : i + 1], p.temperature, p.top_k, p.top_p, p.min_p).cpu()
        out[i] = draw_rows(probs, req.uniforms(len(req.output_token_ids), 1))[0]
    return out
