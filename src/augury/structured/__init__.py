"""Structured output and logit shaping: a request's constraint compiled by xgrammar (backend.py), and
the per-request object that shapes its logits wherever a token is chosen, in decode steps and in
speculative verification alike (shaper.py), and prunes and extends its draft trees (the grammar as
a proposer). tools.py checks OpenAI's tools and builds their grammars; tool_formats.py and
tool_parsers.py read tool calls out of the text in each model family's format, whole or streamed;
reasoning.py splits a <think> block off the answer and places a constraint after it."""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from augury.sampling_params import SamplingParams
from augury.structured.backend import GrammarBackend, ShapingStats
from augury.structured.shaper import RequestShaper, bad_word_ids

__all__ = ["GrammarBackend", "RequestShaper", "ShapingStats", "make_shaper"]


def make_shaper(params: SamplingParams, prompt_ids: Sequence[int], *, vocab_size: int, device: torch.device,
                tokenizer, backend: Callable[[], GrammarBackend],
                eos_token_ids: Collection[int] = ()) -> RequestShaper | None:
    """The request's shaper, or None when nothing but temperature, top-k, top-p and min-p acts on its
    logits (eos_token_ids: what min_tokens holds off, with the request's stop_token_ids). ValueError (naming the parameter) for what this model cannot take: a token id outside
    its vocabulary, bad words or a grammar without a tokenizer, a grammar xgrammar refuses."""
    if not params.shapes_logits:
        return None
    if params.logit_bias:
        bad = [t for t in params.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias has token id {bad[0]}, outside this model's vocabulary [0, {vocab_size})")
    if (params.bad_words or params.structured_outputs is not None) and tokenizer is None:
        what = "bad_words" if params.bad_words else "structured_outputs"
        raise ValueError(f"{what} needs a tokenizer, and this model folder has none")
    words = bad_word_ids(tokenizer, params.bad_words) if params.bad_words else None
    matcher = grammar = None
    if params.structured_outputs is not None:
        grammar = backend()
        matcher = grammar.matcher(params.structured_outputs)
    ends = [*([] if params.ignore_eos else eos_token_ids), *params.stop_token_ids]
    shaper = RequestShaper(params, prompt_ids, vocab_size, device, matcher, grammar, words,
                           grammar.stats if grammar is not None else None, ends)
    if grammar is not None:
        grammar.stats.constrained_requests += 1
    return shaper
