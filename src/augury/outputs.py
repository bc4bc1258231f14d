"""What a finished (or progressing) request hands back to its caller."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Speculation counters of one request (all zero when it was never speculated)."""

    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens produced per verification step (accepted drafts + the bonus token)."""
        if self.num_verify_steps == 0:
            return 0.0
        return (self.num_accepted_draft_tokens + self.num_verify_steps) / self.num_verify_steps


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the target (raw: log-softmax of the target's float32
    logits, before temperature, top-k and top-p) and its rank there (1 = the most likely)."""

    logprob: float
    rank: int


# Per position: token id -> Logprob, the chosen token's first, then the top k (vLLM's shape).
TokenLogprobs = dict[int, Logprob]


@dataclass
class RequestOutput:
    """One request's output. ``token_ids`` and ``text`` hold the generated part only.

    ``new_token_ids`` is what this engine step added (for streaming); ``finish_reason``
    is None while running, else "stop" (EOS, stop token or stop string), "length", "abort", or "error"
    (a fault of this request alone, ``error`` says which: e.g. its logit shaping left no valid token).
    ``logprobs`` (when SamplingParams.logprobs is set): one TokenLogprobs per generated token,
    ``prompt_logprobs`` (when SamplingParams.prompt_logprobs is set): one per prompt token, None
    for the first (nothing predicts it). See Logprob for which distribution.
    ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache at admission.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None  # with finish_reason "error": why this request failed
    spec_stats: SpecStats = field(default_factory=SpecStats)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
