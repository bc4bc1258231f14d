"""Per-request sampling settings, validated where they are made."""
from __future__ import annotations

import enum
import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as in vLLM)
MAX_LOGPROBS = 20  # most alternatives per position a request may ask for (OpenAI's top_logprobs limit)
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class OutputKind(str, enum.Enum):
    """What each RequestOutput of a request carries (vLLM's RequestOutputKind).

    cumulative: everything generated so far, every step (the engine's default); delta: only what
    this step added (a stream concatenates them); final_only: one output, when the request
    finishes, with everything (what a non-streamed answer needs)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names); exactly one kind is set.

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: the output is one of these strings; grammar: an
    EBNF grammar (GBNF style, rule `root` first); structural_tag: xgrammar's structural tag as JSON
    text (what the server builds for tool calls). The output ends with an end-of-sequence token once
    the constraint is complete (the grammar allows nothing else then).

    disable_any_whitespace (JSON kinds): True (augury's default) makes JSON compact, one space after
    ':' and ',' and nowhere else between tokens, so a small model cannot loop on whitespace and the
    keys and punctuation between values are forced (drafted for free under speculation); False
    allows any whitespace (vLLM's default).
    """

    json: dict | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = True
    # the grammar compiled before admission (a server compiles it off the engine thread and hands it
    # over, so the engine thread never compiles: structured.GrammarBackend.matcher); None: compiled there
    compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of " + ", ".join(_KINDS)
                             + (f"; got {', '.join(given)}" if given else ""))
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.json_object not in (None, True):
            raise ValueError("structured_outputs.json_object must be true when given")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, compact): equal keys compile to the same grammar."""
        value: Any = getattr(self, self.kind)
        text = value if isinstance(value, str) else _json.dumps(value, sort_keys=True, separators=(",", ":"))
        return self.kind, text, self.disable_any_whitespace


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

    Logit shaping, applied in this order before temperature wherever a token is chosen (decode
    steps and every node a speculative verification visits, counting the tokens on the node's
    path): ``logit_bias`` {token id: bias in [-100, 100]} added; ``bad_words`` never completed
    (a word's last token is banned where the output ends with the rest of it, with and without a
    leading space); ``repetition_penalty`` r (> 0; 1 = off) divides positive logits of every token
    seen in the prompt or output by r and multiplies negative ones; ``frequency_penalty`` and
    ``presence_penalty`` in [-2, 2] subtract count x f and p from tokens already generated;
    ``structured_outputs`` masks every token its grammar does not allow. ``min_p`` in [0, 1] then
    drops tokens less probable than min_p x the most probable one (after temperature and top-k,
    before top-p).

    ``output_kind`` (an OutputKind, or its value as a string): whether the engine's outputs for this
    request are cumulative (default), deltas, or one final output (see OutputKind).

    vLLM's output extras: ``min_tokens`` n (<= max_tokens): the first n output tokens cannot be an
    end-of-sequence token (unless ignore_eos) or one of ``stop_token_ids`` (they are masked, a logit
    shaping like the above) and stop strings are not looked for before the n-th token;
    ``include_stop_str_in_output``: the stop string that ended the text stays at its end;
    ``skip_special_tokens`` (default True): special tokens are left out of the text;
    ``spaces_between_special_tokens`` (default True, only with skip_special_tokens False): the
    tokenizer's own decoding; False: special and added tokens' text joined to the text around them
    with nothing in between (engine/detokenizer.py).

    ``return_token_sources`` (augury's): outputs also say how each generated token came
    (RequestOutput.token_sources: an accepted draft of the EAGLE-3 head, of text lookup, a
    grammar's forced token, or the target's own) and what speculation decided at each decode step
    for this request (RequestOutput.spec_steps). Off by default: a request that does not ask keeps
    no such lists.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: OutputKind = OutputKind.CUMULATIVE
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_sources: bool = False

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
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "return_token_sources"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_shaping()
        try:
            self.output_kind = OutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be one of {', '.join(k.value for k in OutputKind)}, "
                             f"got {self.output_kind!r}") from None

    def _check_shaping(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        if not _number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be a number in (0, 100] (1: off), got {self.repetition_penalty!r}")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to biases in [-100, 100]")
            bias = {}
            for k, v in self.logit_bias.items():
                # a JSON key is text: ASCII digits only ("²" is a digit to str.isdigit, not to int)
                tok = int(k) if isinstance(k, str) and k.strip().isascii() and k.strip().isdigit() else k
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {k!r}")
                if not _number(v) or not -100.0 <= v <= 100.0:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}")
                bias[tok] = float(v)
            self.logit_bias = bias or None
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError("bad_words must be a list of non-empty strings")
            self.bad_words = list(self.bad_words) or None
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    @property
    def shapes_logits(self) -> bool:
        """Whether anything besides temperature, top-k, top-p and min-p acts on this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.bad_words or self.structured_outputs is not None
                    or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
