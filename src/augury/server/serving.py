"""Turn OpenAI requests into engine work: validate, tokenize, build SamplingParams, admit.

Everything a client can get wrong is checked here and answered with a 400 before the engine
sees the request; the engine thread only ever receives well-formed prompts and parameters.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from augury.limits import RequestLimits
from augury.sampling_params import MAX_LOGPROBS, OutputKind, SamplingParams, StructuredOutputsParams
from augury.server.engine_loop import EngineLoop, EngineUnavailable, QueueFull, RequestGroup
from augury.server.errors import APIError, bad_request
from augury.server.fields import REFUSED_CHAT, REFUSED_COMPLETION, FieldPolicy, refuse, template_kwargs, truncate
from augury.server.info import ServerInfo
from augury.server.messages import chat_template_check, message_dicts, render_chat, with_tools_prompt
from augury.server.metrics import ServerMetrics
from augury.server.responses_store import ResponseStore
from augury.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from augury.server.templates import TemplateInfo, inspect_template
from augury.structured import tools as tool_calls
from augury.structured.backend import constraint_format
from augury.structured.reasoning import after_reasoning, start_state
from augury.structured.tool_parsers import get_format
from augury.structured.shaper import bad_word_ids

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass
class ServerState:
    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # a private copy, used only on the tokenizer thread
    executor: ThreadPoolExecutor
    info: ServerInfo
    api_key: str | None
    ready: bool = False
    stream_timeout: float | None = 60.0  # a streaming client that reads nothing this long is cut off (None: never)
    draining: bool = False  # a stop signal came: no new request is admitted (httpserver.py's drain)
    grammar: Any = None  # () -> structured.GrammarBackend (thread-safe), to compile constraints before admission
    tool_call_parser: str | None = "hermes"  # how tool calls are read out of answers; None: tools are refused
    reasoning_parser: str | None = None  # qwen3, deepseek_r1 (structured/reasoning.py); None: answers are not split
    template: TemplateInfo | None = None  # what the chat template does with tools (templates.py); None: found on first use
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask (limits.py)
    # compiles structured-output constraints (and builds tool grammars) off the event loop and the
    # tokenizer thread; two threads, so one slow compile does not hold every other
    grammar_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="augury-grammar"))
    model_names: tuple[str, ...] = ()  # every --served-model-name (model_name is the first; answers name it)
    fields: FieldPolicy = field(default_factory=FieldPolicy)  # unknown request fields: warned, or refused
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept (responses_store.py)
    # the model's sampling defaults (generation_config.py) for the fields a request leaves unset:
    # temperature, top_p, top_k, min_p, repetition_penalty, max_tokens
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    async def on_tokenizer_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


@dataclass
class Job:
    """One HTTP request's engine work: `n` choices per prompt, choice i of prompt p at p * n + i.
    logprobs: None, or the k of top alternatives per token asked for; echo (completions): each
    choice's text (and logprobs) start with its prompt's, prompt_texts."""

    request_id: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    logprobs: int | None = None
    echo: bool = False
    prompt_texts: list[str] | None = None
    parse_tools: bool = False  # chat with tools: answers are parsed for tool calls
    tool_names: Any = None  # and the functions a call may name, each to its parameters schema (others are content)
    tool_format: str = "hermes"  # the format calls are read in (structured/tool_parsers.py)
    reasoning: str | None = None  # with a reasoning parser: where its answers start (reasoning.start_state)
    engine_id: str = ""  # the id its engine requests are submitted under (unique); "": request_id
    continuous_usage: bool = False  # streamed: usage so far in every chunk (stream_options.continuous_usage_stats)
    # what the request log says of it once answered (note())
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)

    def note(self, out) -> None:
        """An output of one of its requests went to the client (a delta, or a final output)."""
        self.completion_tokens += len(out.new_token_ids)
        if out.finished:
            self.finish_reasons.append(out.finish_reason or "unknown")

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def choice_prompts(self) -> list[list[int]]:
        return [p for p in self.prompts for _ in range(self.n)]


def check_model(state: ServerState, model: str | None) -> None:
    names = state.model_names or (state.model_name,)
    if model is not None and model not in names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       + ", ".join(repr(n) for n in names), "model_not_found", "model")


def job_ids(prefix: str, request_id: str | None, given: bool) -> tuple[str, str]:
    """(the id answers carry, the id its engine requests go by). A client's id (X-Request-Id or the
    body's request_id) names the answer, prefix-ID as vLLM does; the engine's id adds a random part,
    since two requests in flight may carry the same id."""
    public = f"{prefix}-{request_id or uuid.uuid4().hex}"
    return public, (f"{public}-{uuid.uuid4().hex[:8]}" if given else public)


def _reject_unsupported(req: SamplingFields, extra: dict[str, Any]) -> None:
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        value = getattr(req, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number", name)
    for name, (value, ok) in extra.items():
        if value not in ok:
            raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")


def _top_k(value: Any, name: str) -> int:
    """A count of top alternatives (completions' logprobs, chat's top_logprobs): 0..MAX_LOGPROBS."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)
    return value


def _structured(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the parameter it came from: response_format (OpenAI),
    structured_outputs (vLLM) or guided_json / guided_regex / guided_choice / guided_grammar (vLLM's
    older names); at most one of them."""
    given = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            given.append(({"json_object": True}, "response_format"))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                                  "response_format")
            given.append(({"json": schema}, "response_format"))
        elif kind != "text":
            raise bad_request(f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                              "response_format", "unsupported_parameter")
    if req.structured_outputs is not None:
        given.append((dict(req.structured_outputs), "structured_outputs"))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            given.append(({name: value}, f"guided_{name}"))
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not {' and '.join(p for _, p in given)}", given[1][1])
    fields, param = given[0]
    try:
        return StructuredOutputsParams(**fields), param
    except (TypeError, ValueError) as e:
        raise bad_request(f"{param}: {e}", param) from None


async def _compile(state: ServerState, so: StructuredOutputsParams | None, param: str | None,
                   bad_words: list[str] | None = None, checked: bool = False) -> None:
    """Compile the constraint now, on a grammar thread (never the event loop, the tokenizer thread or
    the engine's) within --limit-compile-seconds, and hand the compiled grammar to the engine with
    the request (so.compiled), so a bad one is a 400 naming it and the engine thread never compiles.
    Bad words that leave the grammar no first token, or no end, are a 400 too (GrammarBackend.dead_end)."""
    if so is None:
        return
    if state.grammar is None:
        raise bad_request("structured output needs a tokenizer, and this model has none", param)
    try:
        # a tool grammar's size is the tools' (RequestLimits.check_tools); checked: as sent, before
        # _after_reasoning rewrote it
        if param != "tools" and not checked:
            state.limits.check_structured(so, param or "structured_outputs")
    except ValueError as e:
        raise bad_request(str(e), param) from None
    banned: set[int] = set()
    if bad_words and state.tokenizer is not None:
        ids = await state.on_tokenizer_thread(bad_word_ids, state.tokenizer, bad_words)
        banned = {w[0] for w in ids if len(w) == 1}
    started = threading.Event()

    def work():
        started.set()
        backend = state.grammar()
        compiled = backend.compile(so)
        return compiled, backend.dead_end(compiled, banned) if banned else None

    seconds = state.limits.compile_seconds
    try:
        compiled, conflict = await asyncio.wait_for(
            asyncio.get_running_loop().run_in_executor(state.grammar_executor, work), seconds)
    except asyncio.TimeoutError:
        if not started.is_set():  # it waited behind other compiles all that time
            raise APIError(503, "the grammar compiler is busy; retry later", "grammar_compiler_busy",
                           headers={"Retry-After": "1"}) from None
        raise bad_request(f"{param}: the constraint did not compile within {seconds:g} s "
                          "(this server's --limit-compile-seconds)", param) from None
    except ValueError as e:
        message = str(e) if param == "structured_outputs" else str(e).replace("structured_outputs.", f"{param}: ", 1)
        raise bad_request(message, param) from None
    if conflict is not None:
        raise bad_request(f"{conflict} ({param} with bad_words)", "bad_words")
    so.compiled = compiled


def _sampling(req: SamplingFields, max_tokens: int | None, prompt_len: int, state: ServerState,
              default_max: int | None, choice: int, logprobs: int | None = None,
              prompt_logprobs: int | None = None, structured: StructuredOutputsParams | None = None) -> SamplingParams:
    room = state.max_model_len - prompt_len
    if room < 1:
        raise bad_request(f"the prompt has {prompt_len} tokens; this model's context is {state.max_model_len} "
                          "tokens, which must leave room for at least one generated token",
                          "prompt", "context_length_exceeded")
    default_max = state.sampling_defaults.get("max_tokens", default_max)  # the model's, else the route's
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    elif max_tokens > room:
        raise bad_request(f"this model's context is {state.max_model_len} tokens; the prompt has {prompt_len} "
                          f"and {max_tokens} were asked for (max_tokens); ask for at most {room}",
                          "max_tokens", "context_length_exceeded")
    model = state.sampling_defaults  # what the request leaves unset, generation_config.json may give

    def given(name: str, default: Any) -> Any:
        value = getattr(req, name)
        return model.get(name, default) if value is None else value

    temperature, top_p, top_k = given("temperature", 1.0), given("top_p", 1.0), given("top_k", None)
    if top_k is not None and (top_k < -1 or top_k > 2**31):
        raise bad_request(f"top_k must be -1 (off), 0 (off) or a positive integer, got {top_k}", "top_k")
    seed = req.seed
    if seed is not None:
        if not -(2**63) <= seed < 2**64:
            raise bad_request("seed must fit in 64 bits", "seed")
        seed = (seed + choice) % 2**64
    if req.bad_words and state.tokenizer is None:
        raise bad_request("bad_words needs a tokenizer, and this model has none", "bad_words")
    try:  # SamplingParams validates temperature, top_p, penalties, ... (once, for every entry point)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=req.stop, stop_token_ids=req.stop_token_ids or [],
                                ignore_eos=bool(req.ignore_eos), max_draft_tokens=req.max_draft_tokens,
                                return_token_sources=bool(req.return_token_sources),
                                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                presence_penalty=req.presence_penalty or 0.0,
                                frequency_penalty=req.frequency_penalty or 0.0,
                                repetition_penalty=given("repetition_penalty", 1.0),
                                min_p=given("min_p", 0.0), logit_bias=req.logit_bias or None,
                                bad_words=req.bad_words or None, structured_outputs=structured,
                                min_tokens=req.min_tokens or 0,
                                include_stop_str_in_output=bool(req.include_stop_str_in_output),
                                skip_special_tokens=req.skip_special_tokens is not False,
                                spaces_between_special_tokens=req.spaces_between_special_tokens is not False)
        state.limits.check_sampling(params)  # sizes (limits.py): before anything scans them
    except ValueError as e:  # its messages open with the field's name, which is the request's parameter
        message = str(e)
        param = message.split(" ", 1)[0].rstrip(":")
        raise bad_request(message, param if param in _SAMPLING_FIELDS else None) from None
    if any(t >= state.vocab_size for t in params.stop_token_ids):
        raise bad_request(f"stop_token_ids must be in [0, {state.vocab_size})", "stop_token_ids")
    if params.logit_bias and max(params.logit_bias) >= state.vocab_size:
        raise bad_request(f"logit_bias keys must be token ids in [0, {state.vocab_size}), got {max(params.logit_bias)}",
                          "logit_bias")
    return params


def _check_n(req: SamplingFields, num_prompts: int, state: ServerState) -> int:
    n = 1 if req.n is None else req.n
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}", "n")
    try:
        state.limits.check_n(n)
    except ValueError as e:
        raise bad_request(str(e), "n") from None
    if n * num_prompts > state.loop.capacity:
        raise bad_request(f"{n * num_prompts} choices were asked for; this server holds at most "
                          f"{state.loop.capacity} requests at a time", "n")
    return n


def _check_ids(ids: list[int], state: ServerState) -> list[int]:
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    if any(isinstance(t, bool) or not 0 <= t < state.vocab_size for t in ids):
        raise bad_request(f"prompt token ids must be integers in [0, {state.vocab_size})", "prompt")
    return ids


def _need_tokenizer(state: ServerState) -> Any:
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer; send prompts as token ids", "prompt")
    return state.tokenizer


async def completion_job(state: ServerState, req: CompletionRequest, request_id: str | None = None,
                         given: bool = False) -> Job:
    check_model(state, req.model)
    _reject_unsupported(req, {})
    refuse(req, REFUSED_COMPLETION)
    k = None if req.logprobs is None else _top_k(req.logprobs, "logprobs")
    echo = bool(req.echo)
    p = req.prompt
    if isinstance(p, str):
        p = [p]
    if not p:
        raise bad_request("the prompt is empty", "prompt")
    if all(isinstance(x, int) for x in p):
        prompts: list[list[int]] = [list(p)]
    elif all(isinstance(x, list) for x in p):
        prompts = [list(x) for x in p]
    else:
        tok = _need_tokenizer(state)
        special = req.add_special_tokens is not False
        prompts = await state.on_tokenizer_thread(lambda: [tok.encode(text, add_special_tokens=special) for text in p])
    whole = [len(ids) for ids in prompts]
    prompts = [_check_ids(truncate(ids, req.truncate_prompt_tokens, state.max_model_len), state) for ids in prompts]
    truncated = [len(ids) for ids in prompts] != whole
    n = _check_n(req, len(prompts), state)
    texts = None
    if echo:  # the prompt as sent, or its ids decoded (no tokenizer: no text, as for the output)
        if all(isinstance(x, str) for x in p) and not truncated:
            texts = list(p)
        elif state.tokenizer is not None:
            tok = state.tokenizer
            texts = await state.on_tokenizer_thread(lambda: [tok.decode(ids) for ids in prompts])
        else:
            texts = [""] * len(prompts)
    so, param = _structured(req)
    params = [_sampling(req, req.max_tokens, len(ids), state, 16, c, k, k if echo else None, so)
              for ids in prompts for c in range(n)]
    await _compile(state, so, param, req.bad_words)  # after the limits: the choices share `so`
    public, engine_id = job_ids("cmpl", request_id, given)
    return Job(public, prompts, params, n, k, echo, texts, engine_id=engine_id)


async def chat_prompt(state: ServerState, req: Any, tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt ids of req's messages (a chat request or a /tokenize chat body), tools described
    to the model (natively, or in the system message for a template that takes none); a 400 for
    messages the template rejects."""
    tok = _need_tokenizer(state)
    if not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    chat_template_check(req)
    if state.template is None:  # a state built without build_server: found on first use
        state.template = await state.on_tokenizer_thread(inspect_template, tok)
    info, fmt = state.template, state.tool_call_parser or "hermes"
    messages = message_dicts(req, info.renders_calls, fmt)
    described = tools
    if described and not info.renders_tools:
        messages, described = with_tools_prompt(messages, described, fmt), None
    template_kwargs(tok, req.chat_template_kwargs)  # a 400 before the tokenizer thread
    try:
        return await state.on_tokenizer_thread(render_chat, tok, messages, described, req)
    except APIError:
        raise
    except Exception as e:  # a template that raises on these messages (e.g. role order it forbids)
        raise bad_request(f"the chat template rejected these messages: {e}", "messages") from None


async def chat_job(state: ServerState, req: ChatCompletionRequest, request_id: str | None = None,
                   given: bool = False) -> Job:
    check_model(state, req.model)
    _reject_unsupported(req, {})
    refuse(req, REFUSED_CHAT)
    if req.logprobs is not None and not isinstance(req.logprobs, bool):
        raise bad_request(f"logprobs must be true or false, got {req.logprobs!r}", "logprobs")
    top = None if req.top_logprobs is None else _top_k(req.top_logprobs, "top_logprobs")
    if top and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    k = (top or 0) if req.logprobs else None
    tok = _need_tokenizer(state)
    template = getattr(tok, "chat_template", None)
    if not template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    tools = None
    if req.tools:
        try:
            state.limits.check_tools(req.tools)
            tools = tool_calls.check_tools(req.tools)
        except ValueError as e:
            raise bad_request(str(e), "tools") from None
    try:
        choice = tool_calls.check_tool_choice(req.tool_choice, tools)
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from None
    if choice != "none" and state.tool_call_parser is None:
        raise bad_request("tool calling is off on this server (--tool-call-parser none)", "tools",
                          "unsupported_parameter")
    so, param = _structured(req)
    if choice == "required" or isinstance(choice, dict):
        if so is not None:
            raise bad_request(f"{param} cannot be combined with tool_choice {'required' if choice == 'required' else 'naming a function'}",
                              param)
        try:  # on a grammar thread: it walks every tool's schema
            grammar = await asyncio.get_running_loop().run_in_executor(
                state.grammar_executor, tool_calls.tool_grammar, tools, choice, req.parallel_tool_calls is not False,
                state.tool_call_parser)
        except ValueError as e:
            raise bad_request(str(e), "tools") from None
        so, param = StructuredOutputsParams(structural_tag=grammar), "tools"
    ids = await chat_prompt(state, req, tools if choice != "none" else None)
    ids = _check_ids(truncate(ids, req.truncate_prompt_tokens, state.max_model_len), state)
    n = _check_n(req, 1, state)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    fmt = get_format(state.tool_call_parser or "hermes")
    tail, keep = await state.on_tokenizer_thread(_answer_start, tok, ids, fmt.markers if choice != "none" else ())
    reasoning, rewritten = None, False
    if state.reasoning_parser is not None:
        reasoning = start_state(state.reasoning_parser, tail)
        if so is not None and reasoning != "done":  # the constraint shapes the answer, not the reasoning
            so, rewritten = await _after_reasoning(state, so, param, reasoning), True
    params = [_sampling(req, max_tokens, len(ids), state, None, c, k, None, so) for c in range(n)]
    if keep and req.skip_special_tokens is None:  # the format's markers are special tokens: keep them (as vLLM)
        params = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
    await _compile(state, so, param, req.bad_words, rewritten)  # after the limits: the choices share `so`
    names = {t["function"]["name"]: t["function"].get("parameters") for t in tools or []}
    public, engine_id = job_ids("chatcmpl", request_id, given)
    return Job(public, [ids], params, n, k, parse_tools=choice != "none", tool_names=names, engine_id=engine_id,
               tool_format=fmt.name, reasoning=reasoning)


def _answer_start(tok: Any, ids: list[int], markers: tuple[str, ...]) -> tuple[str, bool]:
    """(the prompt's last characters, whether any of `markers` is a special token of the tokenizer,
    which the text leaves out unless the request keeps special tokens). On the tokenizer thread."""
    tail = tok.decode(ids[-16:], skip_special_tokens=False)
    added = getattr(tok, "added_tokens_decoder", None) or {}
    special = {t.content for t in added.values() if getattr(t, "special", False)} | set(tok.all_special_tokens)
    return tail, any(m in special for m in markers)


async def _after_reasoning(state: ServerState, so: StructuredOutputsParams, param: str | None,
                           start: str) -> StructuredOutputsParams:
    """The constraint placed after the reasoning block (reasoning.after_reasoning): checked against the
    limits as sent, rewritten as a structural tag on a grammar thread (within --limit-compile-seconds);
    a 400 naming `param` when xgrammar refuses it."""
    try:
        if param != "tools":
            state.limits.check_structured(so, param or "structured_outputs")
        fmt = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
            state.grammar_executor, constraint_format, so), state.limits.compile_seconds)
    except asyncio.TimeoutError:
        raise bad_request(f"{param}: the constraint did not compile within {state.limits.compile_seconds:g} s "
                          "(this server's --limit-compile-seconds)", param) from None
    except ValueError as e:
        message = str(e) if param == "structured_outputs" else str(e).replace("structured_outputs.", f"{param}: ", 1)
        raise bad_request(message, param) from None
    tag = json.dumps({"type": "structural_tag", "format": after_reasoning(fmt, start)})
    return StructuredOutputsParams(structural_tag=tag, disable_any_whitespace=so.disable_any_whitespace)


def admit(state: ServerState, job: Job, stream: bool) -> RequestGroup:
    """Submit the job's requests: streamed, each output a delta (what a chunk carries); else one
    final output per request (a non-streamed answer waits for it), so neither copies an answer
    per step nor queues more than the reader takes."""
    if state.draining:  # what is in flight finishes; a client retries on another replica, or once this restarts
        state.metrics.observe_rejected(503)
        raise APIError(503, "the server is shutting down and admits no new requests; retry later",
                       "server_shutting_down", headers={"Retry-After": "1"})
    try:
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        params = [dataclasses.replace(p, output_kind=kind) for p in job.params]
        group = state.loop.submit(job.engine_id or job.request_id, job.choice_prompts, params)
    except QueueFull as e:
        state.metrics.observe_rejected(429)
        raise APIError(429, f"the server is at capacity ({e}); retry later", "queue_full",
                       headers={"Retry-After": "1"}) from None
    except EngineUnavailable as e:
        state.metrics.observe_rejected(503)
        raise APIError(503, f"the engine is not available: {e}", "engine_unavailable") from None
    state.metrics.observe_prompt_tokens(job.prompt_tokens)
    return group
