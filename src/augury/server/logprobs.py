"""Log-probabilities in OpenAI's shapes, from RequestOutput's TokenLogprobs ({token id: Logprob}).

The values are the engine's: raw log-softmax of the target's logits (see augury.outputs.Logprob),
whether a token was accepted from a draft or decoded plainly. Token strings are each id decoded
alone (`tokenizer.decode([id])`), or "token_id:<id>" for a model without a tokenizer. Callers run
these on the tokenizer thread (the tokenizer copy lives there).
"""
from __future__ import annotations

from typing import Any

from augury.outputs import TokenLogprobs


def token_text(tok: Any, token_id: int) -> str:
    return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"


def completion_logprobs(tok: Any, token_ids: list[int], entries: list[TokenLogprobs | None],
                        offset: int = 0) -> dict[str, Any]:
    """/v1/completions' choice.logprobs: tokens, token_logprobs, top_logprobs (the chosen token's
    and the k most likely, by string) and text_offset (from `offset`, each token's string length
    on). An entry None (the first prompt token under echo) gives null logprobs."""
    tokens, values, tops, offsets = [], [], [], []
    for t, d in zip(token_ids, entries):
        s = token_text(tok, t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if d is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(d[t].logprob)
        tops.append({token_text(tok, i): lp.logprob for i, lp in d.items()})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok: Any, token_ids: list[int], entries: list[TokenLogprobs], k: int) -> dict[str, Any]:
    """/v1/chat/completions' choice.logprobs: {"content": [{token, logprob, bytes, top_logprobs}]},
    top_logprobs the k most likely tokens in rank order (the chosen one among them only if it is)."""
    content = []
    for t, d in zip(token_ids, entries):
        s = token_text(tok, t)
        top = sorted(((i, lp) for i, lp in d.items() if lp.rank <= k), key=lambda x: x[1].rank)[:k]
        content.append({"token": s, "logprob": d[t].logprob, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": (ts := token_text(tok, i)), "logprob": lp.logprob,
                                          "bytes": list(ts.encode())} for i, lp in top]})
    return {"content": content}
