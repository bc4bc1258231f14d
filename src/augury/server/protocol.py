"""OpenAI-compatible request and response bodies (pydantic), the subset augury serves.

Request models keep the fields they do not declare (extra="allow") so that fields.FieldPolicy can
name them: logged once and listed in a response header, or a 400 with --strict-fields. Fields augury
does not implement but a client may send are declared and accepted when they carry their neutral
value, a 400 otherwise (fields.refuse), never silently misapplied. docs/api.md has the table.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
Prompt = Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # extension (vLLM): usage so far in every chunk


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
    return_token_sources: bool | None = False  # extension (augury): each token's source, each step's (provenance.py)
    # extensions (vLLM): honoured
    min_tokens: StrictInt | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    truncate_prompt_tokens: StrictInt | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    add_special_tokens: bool | None = None  # completions: True by default; chat: False (the template has them)
    request_id: str | None = None  # the request's id when no X-Request-Id header gives one
    # accepted, no effect on the answer (OpenAI's informational fields)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # declared to be refused unless neutral (fields.REFUSED_*)
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    prompt_logprobs: Any = None
    priority: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    mm_processor_kwargs: Any = None
    store: Any = None


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


class ChatTemplateFields(_Request):
    """How messages become a prompt (vLLM's fields), shared by chat completions and /tokenize."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message left open: the answer continues it
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template (enable_thinking, ...)
    chat_template: Any = None  # refused (fields.REFUSED_CHAT)


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    top_logprobs: StrictInt | None = None  # 0..20, with logprobs: true
    # declared to be refused unless neutral (fields.REFUSED_CHAT)
    echo: Any = None
    documents: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None


class TokenizeCompletionRequest(_Request):
    """vLLM's /tokenize for text."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """vLLM's /tokenize for chat messages: the prompt a chat completion would get."""

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


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
    reasoning_content: str | None = None  # with --reasoning-parser: the <think> block, split off the content


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
    reasoning_content: str | None = None  # with --reasoning-parser
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
