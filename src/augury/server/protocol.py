"""OpenAI-compatible request and response bodies (pydantic), the subset augury serves.

Unknown request fields are ignored, as OpenAI-compatible servers do; fields augury does not
implement but a client may send are accepted when they carry their neutral value and
rejected with a 400 otherwise (see serving.py), never silently misapplied.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
Prompt = Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool | None = False


class SamplingFields(_Request):
    """What /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM, SGLang); -1 or 0: off
    n: int | None = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None  # extension (vLLM): 1 = off
    min_p: float | None = None  # extension (vLLM): 0 = off
    bad_words: list[str] | None = None  # extension (vLLM)
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict[str, Any] | None = None  # extension (vLLM): json, regex, choice, grammar, ...
    guided_json: Any = None  # extension (older vLLM names of structured_outputs' fields)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logprobs: Any = None  # completions: an int k (0..20); chat: a bool
    user: str | None = None
    ignore_eos: bool | None = False  # extension (vLLM)
    stop_token_ids: list[StrictInt] | None = None  # extension (vLLM)
    max_draft_tokens: StrictInt | None = None  # extension (augury): this request's draft budget, 0 = no speculation


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(..., description="text, a list of texts, token ids, or a list of token-id lists")
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to that call


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    top_logprobs: StrictInt | None = None  # 0..20, with logprobs: true


class SpeculativeUsage(BaseModel):
    """augury's extension of usage: the request's speculation figures (its choices summed)."""

    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, accepted and emitted
    verify_steps: int = 0  # verification steps (each also emits one token of the target's own)
    # the same drafts by source (they sum to the two totals): the EAGLE-3 head's, prompt lookup's (the
    # n-gram proposer, the branch grafted onto head trees) and the tokens a grammar forces
    head_draft_tokens: int = 0
    head_accepted_tokens: int = 0
    lookup_draft_tokens: int = 0
    lookup_accepted_tokens: int = 0
    forced_draft_tokens: int = 0
    forced_accepted_tokens: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    speculative: SpeculativeUsage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {index, id?, type?, function: {name?, arguments}}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "augury"
    root: str
    max_model_len: int
    tensor_parallel_size: int = 1  # ranks the model is split across (augury/distributed)
    tensor_parallel_backend: str | None = None  # gloo (+ shared memory) or nccl; None without


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
