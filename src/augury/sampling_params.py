"""Per-request sampling settings, validated where they are made."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as in vLLM)
MAX_LOGPROBS = 20  # most alternatives per position a request may ask for (OpenAI's top_logprobs limit)


@dataclass
class SamplingParams:
    """How one request samples and when it stops (vLLM's names).

    temperature 0 means greedy. top_k <= 0 or None means no top-k; top_p 1.0 means no
    nucleus cut. ``seed`` makes a request's samples reproducible on its own,
    whatever else shares its batch.

    ``max_draft_tokens`` caps the draft tokens (tree nodes beyond the root) verified for this
    request per speculative step: None = whatever the policy drafts, 0 = no speculation for this
    request (its tokens come from plain decode rows), n = at most n.

    ``logprobs`` = k returns, per generated token, its log-probability and the k most likely
    tokens' (0: the chosen token's alone); ``prompt_logprobs`` = k the same for the prompt's
    tokens. At most MAX_LOGPROBS. Raw log-probabilities of the target (see outputs.Logprob).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_draft_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0  # dividing logits by ~0 overflows; it means greedy anyway
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < -1):
            raise ValueError(f"top_k must be a positive integer, or -1/None for no limit, got {self.top_k!r}")
        if self.top_k is not None and self.top_k <= 0:
            self.top_k = None
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.max_draft_tokens is not None and (not isinstance(self.max_draft_tokens, int)
                                                  or isinstance(self.max_draft_tokens, bool)
                                                  or self.max_draft_tokens < 0):
            raise ValueError(f"max_draft_tokens must be a non-negative integer or None, got {self.max_draft_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
