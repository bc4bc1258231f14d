"""Next-token choice for a batch: greedy rows by argmax, the rest by seeded sampling."""
from __future__ import annotations

import torch

from augury.core.request import Request
from augury.sampling import draw_sampled, greedy_ids


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits [B, V] float32 -> one token id per request: argmax for greedy rows; a sampled row draws
    its next output token at that position's uniform (Request.uniforms), as verification does. A
    request's shaper (penalties, logit bias, bad words, a grammar's mask) shapes a copy of its row
    first; `logits` itself is left raw (log-probabilities read it)."""
    greedy = [i for i, r in enumerate(requests) if r.params.temperature == 0.0]
    sampled = [i for i, r in enumerate(requests) if r.params.temperature != 0.0]
    out = [0] * len(requests)
    if greedy:  # greedy rows take their shaper's greedy token (LogitsShaper.greedy), the raw argmax else
        rows = logits if len(greedy) == len(requests) else logits[greedy]
        for i, tok in zip(greedy, greedy_ids(rows, [requests[i].shaper for i in greedy])):
            out[i] = tok
    if sampled:  # each draws at its position's uniform from a shaped copy of its row
        shaped = [a for a, i in enumerate(sampled) if requests[i].shaper is not None]
        rows = logits if len(sampled) == len(requests) else logits[sampled]
        if shaped:
            rows = rows.clone() if rows is logits else rows  # (an indexed subset is a copy already)
            for a in shaped:
                requests[sampled[a]].shaper.apply(rows[a])
        ps = [requests[i].params for i in sampled]
        drawn = draw_sampled(rows, [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                             [p.min_p for p in ps],
                             [requests[i].uniforms(len(requests[i].output_token_ids), 1)[0] for i in sampled])
        for i, tok in zip(sampled, drawn):
            out[i] = tok
    return out
