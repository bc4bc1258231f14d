"""What a finished (or progressing) request hands back to its caller."""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class SpecStats:
    """Speculation counters of one request (all zero when it was never speculated): draft tokens
    verified and accepted (emitted) in all, and by where they came from (the EAGLE-3 head, prompt
    lookup, the tokens a grammar forces), which sum to the totals."""

    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_head_draft_tokens: int = 0
    num_head_accepted_tokens: int = 0
    num_lookup_draft_tokens: int = 0
    num_lookup_accepted_tokens: int = 0
    num_forced_draft_tokens: int = 0
    num_forced_accepted_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens produced per verification step (accepted drafts + the bonus token)."""
        if self.num_verify_steps == 0:
            return 0.0
        return (self.num_accepted_draft_tokens + self.num_verify_steps) / self.num_verify_steps


@dataclass(frozen=True)
class SpecStep:
    """What one decode step did for one request (SamplingParams.return_token_sources).

    mode: "draft" (the proposer's drafts were verified: the EAGLE-3 head's or the n-gram
    proposer's, with any prompt-lookup branch and forced tokens grafted on), "free" (drafts that
    cost no draft model alone: a grammar's forced tokens, prompt lookup) or "plain" (one token
    decoded, nothing verified). draft_tokens: draft tokens verified for this request; accepted: of
    those, emitted (the step emitted accepted + 1 tokens, but where a stop ended it). reason: why
    speculation chose this, as the policy measured it (e.g. its predicted tokens per second drafting
    against plain decoding's), in words."""

    mode: str
    draft_tokens: int
    accepted: int
    reason: str


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the target (raw: log-softmax of the target's float32
    logits, before temperature, top-k and top-p) and its rank there (1 = the most likely)."""

    logprob: float
    rank: int


TOKEN_SOURCES = ("head", "lookup", "forced", "target")  # RequestOutput.token_sources' values

# Per position: token id -> Logprob, the chosen token's first, then the top k (vLLM's shape).
TokenLogprobs = dict[int, Logprob]


@dataclass
class RequestOutput:
    """One request's output. ``token_ids`` and ``text`` hold the generated part only.

    What an output covers depends on the request's SamplingParams.output_kind. cumulative (the
    default): ``token_ids``, ``text``, ``logprobs`` and ``prompt_logprobs`` hold everything so far,
    and ``new_token_ids`` / ``new_text`` what this engine step added. delta: every field holds only
    what this step added (``new_*`` equal ``token_ids`` / ``text``; ``prompt_logprobs`` come whole
    in the first output, empty after), so a stream's outputs concatenated are the cumulative
    output, and no step copies the request's history. final_only: one output, at the end, as the
    cumulative one (its ``new_*`` then hold everything). ``text`` never shows what may still turn
    out to begin a stop string.

    ``finish_reason`` is None while running, else "stop" (EOS, stop token or stop string),
    "length", "abort" or "error" (the engine ended this request alone for a fault of its own,
    ``error`` says which); the last output carries the final ``spec_stats``.
    ``logprobs`` (when SamplingParams.logprobs is set): one TokenLogprobs per generated token,
    ``prompt_logprobs`` (when SamplingParams.prompt_logprobs is set): one per prompt token, None
    for the first (nothing predicts it). See Logprob for which distribution.
    ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache at admission.
    ``first_token_time``: time.monotonic() when the engine emitted the request's first generated
    token (None before it), whatever the output kind.
    ``token_sources`` and ``spec_steps`` (only when SamplingParams.return_token_sources is set, else
    None; covering what ``token_ids`` covers, by output kind): per generated token, how it came,
    one of TOKEN_SOURCES ("head", "lookup", "forced": an accepted draft of the EAGLE-3 head, of
    text lookup (suffix drafts, prompt lookup), a grammar's forced token; "target": the target's
    own, sampled or the bonus token of a verification); per decode step, a SpecStep (the prefill's
    first token has none).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)
    first_token_time: float | None = None
    error: str | None = None  # with finish_reason "error": why (Engine.fail)
    token_sources: list[str] | None = None
    spec_steps: list[SpecStep] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class MergedOutputs:
    """Successive outputs of one request that nobody has read yet, held as one.

    A reader that falls behind then holds one pending output per request, of the size of what it
    has not read (pieces are appended, never copied per output): ``take`` joins them into the
    output a reader that had kept up would have put together. ``delta`` says how the outputs
    relate: deltas concatenate; cumulative outputs (and a final_only one) replace each other,
    their ``new_*`` fields concatenating."""

    def __init__(self, first: RequestOutput, delta: bool) -> None:
        self.delta = delta
        self.last = first
        self.first_token_time = first.first_token_time
        self.ids = list(first.new_token_ids)
        self.texts = [first.new_text]
        self.logprobs = list(first.logprobs) if delta and first.logprobs is not None else None
        self.prompt_logprobs = list(first.prompt_logprobs) if delta and first.prompt_logprobs is not None else None
        self.sources = list(first.token_sources) if delta and first.token_sources is not None else None
        self.steps = list(first.spec_steps) if delta and first.spec_steps is not None else None

    def add(self, later: RequestOutput) -> None:
        self.last = later
        if self.first_token_time is None:
            self.first_token_time = later.first_token_time
        self.ids.extend(later.new_token_ids)
        self.texts.append(later.new_text)
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs.extend(later.logprobs)
        if self.prompt_logprobs is not None and later.prompt_logprobs is not None:
            self.prompt_logprobs.extend(later.prompt_logprobs)
        if self.sources is not None and later.token_sources is not None:
            self.sources.extend(later.token_sources)
        if self.steps is not None and later.spec_steps is not None:
            self.steps.extend(later.spec_steps)

    @property
    def held_tokens(self) -> int:
        """Token ids held: the deltas' together, or the latest cumulative output's and the new ones."""
        return len(self.ids) + (0 if self.delta else len(self.last.token_ids))

    def take(self) -> RequestOutput:
        text = "".join(self.texts)
        if not self.delta:
            return replace(self.last, new_token_ids=self.ids, new_text=text, first_token_time=self.first_token_time)
        return replace(self.last, token_ids=self.ids, text=text, new_token_ids=self.ids, new_text=text,
                       logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
                       first_token_time=self.first_token_time, token_sources=self.sources, spec_steps=self.steps)
