"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) on the chat path.

A request becomes a chat completion request (`chat_request`): `instructions` a system message first,
`input` (a string, or items: messages, function calls, function call outputs) the messages, `text.format`
the response_format, function `tools` and `tool_choice` chat's, `max_output_tokens` the completion
budget; serving.chat_job then validates, renders and builds the job exactly as for chat, and a
400's `param` is renamed to the Responses field it came from. The answer's text is read as chat's is
(chat_text.chat_message: reasoning, content, tool calls) and laid out as output items: a `reasoning`
item, a `message` with one `output_text` part, `function_call` items. Streamed, the same items are
built from the same parser's deltas with the events that announce them (responses_items.py), so the final
`response.completed` carries what the non-streamed answer would.

`previous_response_id`: a finished response is kept (unless `store: false`) with its conversation in a
bounded LRU (responses_store.py) for the server's lifetime; a follow-up continues that conversation
(its instructions are not carried over, as OpenAI's are not). An id never kept, or evicted, is a 404
naming the field.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from augury.server.chat_text import ChatTextStream
from augury.server.engine_loop import EngineUnavailable, RequestFailed
from augury.server.errors import APIError, bad_request
from augury.server.fields import refuse
from augury.server.ops import request_id
from augury.server.protocol import ChatCompletionRequest, _Request
from augury.server.serving import ServerState, admit, chat_job
from augury.server.responses_items import OutputBuilder
from augury.server.streams import GroupStreamingResponse, collect, sse_json, usage
from augury.server.streams import _failure as failure, _Observer as Observer  # chat's own, shared

# field -> the values that ask for nothing; anything else is a 400 naming it (fields.refuse)
REFUSED_RESPONSES: dict[str, tuple[Any, ...]] = {
    "background": (None, False),  # runs to completion in the request; no polling
    "truncation": (None, "disabled"),  # "auto" would drop earlier items to fit the context
    "conversation": (None,),  # OpenAI's server-side conversations (previous_response_id is kept)
    "prompt": (None,),  # OpenAI's stored prompt templates
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "reasoning": (None, {}),  # effort / summary settings: the chat template decides whether it reasons
}
# a chat field's name in a 400 -> the Responses field a client sent
_PARAMS = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "response_format": "text.format"}


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    store: bool | None = True
    # accepted, no effect on the answer (informational; metadata is echoed back)
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None
    # declared to be refused unless neutral (REFUSED_RESPONSES)
    background: Any = None
    truncation: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    reasoning: Any = None


def _text_of(content: Any, where: str) -> str:
    """A message's (or a call output's) text: a string, or text parts (input_text, output_text)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of text parts", where)
    out = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"only text content parts are supported, got {kind!r}", f"{where}.{k}",
                              "unsupported_parameter")
        out.append(part["text"])
    return "".join(out)


def chat_messages(items: list[dict[str, Any]], where: list[str]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages. where[i]: the field a 400 about items[i] names. Function
    calls join the assistant message before them (one assistant turn, as chat has it); reasoning items
    are left out (chat templates show no earlier turn's reasoning)."""
    out: list[dict[str, Any]] = []
    joinable = False  # the last message is an assistant turn that the next function call belongs to
    for item, at in zip(items, where):
        if not isinstance(item, dict):
            raise bad_request("an input item must be an object", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"a message's role must be user, system, developer or assistant, got {role!r}",
                                  f"{at}.role")
            out.append({"role": role, "content": _text_of(item.get("content"), f"{at}.content")})
            joinable = role == "assistant"
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise bad_request("a function_call item needs name, arguments (JSON text) and call_id", at)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if not joinable:
                out.append({"role": "assistant", "content": "", "tool_calls": []})
            out[-1].setdefault("tool_calls", []).append(call)
            joinable = True
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request("a function_call_output item needs call_id", at)
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(item.get("output"), f"{at}.output")})
            joinable = False
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"input items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output and reasoning are)", f"{at}.type", "unsupported_parameter")
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's form ({type, function: {name, description, parameters, strict}})."""
    if not tools:
        return None
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"only function tools are supported, got {kind!r}", f"tools.{j}.type",
                              "unsupported_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be none, auto, required or {type: function, name}", "tool_choice",
                      "unsupported_parameter")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity is not supported by this server", "text.verbosity", "unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(f"text.format type {kind!r} is not supported; use text, json_object or json_schema",
                      "text.format", "unsupported_parameter")


def conversation(state: ServerState, req: ResponsesRequest) -> tuple[list[dict[str, Any]], int]:
    """(every input item of the conversation: the previous response's, then this request's; how many
    came from the previous response)."""
    own = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if req.previous_response_id is None:
        return list(own), 0
    stored = state.responses.get(req.previous_response_id)
    if stored is None:
        raise APIError(404, f"previous response with id {req.previous_response_id!r} not found (never stored, "
                       "stored with store: false, or evicted: this server keeps the last "
                       f"{state.responses.max_items} responses)", "previous_response_not_found", "previous_response_id")
    history = stored.conversation()
    return [*history, *own], len(history)


def chat_request(req: ResponsesRequest, items: list[dict[str, Any]], earlier: int) -> ChatCompletionRequest:
    where = ["previous_response_id"] * earlier + [f"input.{i}" for i in range(len(items) - earlier)]
    if isinstance(req.input, str):
        where[-1] = "input"
    messages = chat_messages(items, where)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise bad_request("input must hold at least one message", "input")
    body = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": _tools(req.tools),
            "tool_choice": _tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text)}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # a value of the request's own fields (temperature, top_p, ...)
        err = e.errors()[0]
        name = _PARAMS.get(str(err["loc"][0]), str(err["loc"][0]))
        raise bad_request(f"{name}: {err['msg']}", name) from None


def _renamed(e: APIError) -> APIError:
    """chat_job's 400 in the Responses API's words: its param and the message's field names."""
    param = e.param
    if param is not None:
        head = param.split(".")[0]
        param = _PARAMS.get(head, param) if head in _PARAMS else param
    message = e.message
    for chat, ours in (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                       ("response_format", "text.format")):
        message = message.replace(chat, ours)
    return APIError(e.status, message, e.code, param, e.headers)


def response_object(state: ServerState, req: ResponsesRequest, rid: str, created: float, status: str,
                    output: list[dict[str, Any]], use: dict[str, Any] | None = None,
                    finish: str | None = None, error: str | None = None) -> dict[str, Any]:
    """The Response object: status in_progress (streamed, before the answer), completed, incomplete
    (max_output_tokens reached) or failed (the engine ended the request with an error)."""
    if finish == "length":
        status = "incomplete"
    elif finish == "error" or error is not None:
        status = "failed"
    done = status in ("completed", "incomplete", "failed")
    return {"id": rid, "object": "response", "created_at": int(created), "status": status,
            "completed_at": int(time.time()) if done else None, "background": False,
            "error": {"code": "server_error", "message": error or "the engine failed this request"}
            if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "model": state.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store is not False, "temperature": req.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "top_p": req.top_p, "truncation": "disabled", "usage": use, "user": req.user}


async def responses_usage(state: ServerState, job: Any, outs: list[Any], generated: int,
                          output: list[dict[str, Any]]) -> dict[str, Any]:
    """Responses' usage from chat's (streams.usage, augury's `speculative` included); reasoning tokens
    counted by encoding the reasoning text again (the engine does not tell them apart)."""
    chat = usage(job.prompt_tokens, generated, outs)
    thought = "".join(c["text"] for item in output if item["type"] == "reasoning" for c in item["content"])
    reasoning = 0
    if thought and state.tokenizer is not None:
        tok = state.tokenizer
        reasoning = await state.on_tokenizer_thread(lambda: len(tok.encode(thought, add_special_tokens=False)))
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": chat["prompt_tokens_details"],
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat["total_tokens"], "speculative": chat["speculative"]}


def keep(state: ServerState, req: ResponsesRequest, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
    """Store a finished response for previous_response_id, unless the request said store: false."""
    if req.store is not False and response["status"] != "failed":
        state.responses.put(response, items)


async def job_for(state: ServerState, req: ResponsesRequest, request: Request) -> tuple[Any, list[dict[str, Any]]]:
    """(the chat job that answers req, the conversation's input items)."""
    refuse(req, REFUSED_RESPONSES)
    items, earlier = conversation(state, req)
    chat = chat_request(req, items, earlier)
    try:
        job = await chat_job(state, chat, *request_id(request, None))
    except APIError as e:
        raise _renamed(e) from None
    # a response id is unique whatever X-Request-Id says: it keys the stored conversation
    return dataclasses.replace(job, request_id=f"resp_{uuid.uuid4().hex}"), items


def items_of(job: Any, text: str, finish: str | None) -> list[dict[str, Any]]:
    """A whole answer's output items: its text through the parser and builder a stream uses."""
    parser, builder = ChatTextStream(job), OutputBuilder()
    for delta in parser.feed(text) + parser.finish():
        builder.feed(delta)
    builder.finish("incomplete" if finish == "length" else "completed")
    return builder.items


async def response_events(state: ServerState, req: ResponsesRequest, job: Any, group: Any, t0: float,
                          created: float, items: list[dict[str, Any]]) -> AsyncIterator[str]:
    """The streamed answer: response.created and response.in_progress, the builder's events as the
    text arrives, then response.completed (or .incomplete, or .failed) with the whole response."""
    seq = 0

    def event(body: dict[str, Any]) -> str:
        nonlocal seq
        seq += 1
        return f"event: {body['type']}\ndata: {dumps({**body, 'sequence_number': seq - 1})}\n\n"

    rid = job.request_id
    start = response_object(state, req, rid, created, "in_progress", [])
    yield event({"type": "response.created", "response": start})
    yield event({"type": "response.in_progress", "response": start})
    observe, parser, builder, finals, generated = Observer(state, t0), ChatTextStream(job), OutputBuilder(), [], 0
    try:
        async for _, out in group.outputs():  # deltas (admit asks for them when streaming)
            observe(out)
            job.note(out)
            generated += len(out.new_token_ids)
            deltas = parser.feed(out.new_text) if out.new_text else []
            if out.finished:
                finals.append(out)
                deltas += parser.finish()
            for delta in deltas:
                for body in builder.feed(delta):
                    yield event(body)
    except (RequestFailed, EngineUnavailable) as exc:
        _, message, code = failure(exc)
        yield event({"type": "error", "code": code, "message": message, "param": None})
        failed = response_object(state, req, rid, created, "failed", builder.items, error=message)
        yield event({"type": "response.failed", "response": failed})
        return
    finish = finals[0].finish_reason if finals else None
    for body in builder.finish("incomplete" if finish == "length" else "completed"):
        yield event(body)
    use = await responses_usage(state, job, finals, generated, builder.items)
    error = finals[0].error if finals and finish == "error" else None
    response = response_object(state, req, rid, created, "completed", builder.items, use, finish, error)
    keep(state, req, response, items)
    yield event({"type": f"response.{response['status']}", "response": response})


def add_response_routes(app, state: ServerState, dependencies: list, responses: dict) -> None:
    @app.post("/v1/responses", dependencies=dependencies, responses=responses)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        t0 = time.monotonic()
        state.fields.check(body, request.scope.get("state"))
        job, items = await job_for(state, body, request)
        group = admit(state, job, stream=bool(body.stream))
        request.state.job = job  # what the request log says of it
        created = time.time()
        if body.stream:
            return GroupStreamingResponse(response_events(state, body, job, group, t0, created, items), group,
                                          state.metrics.observe_aborted, state.stream_timeout)
        outs = await collect(state, group, request, t0)
        if outs is None:
            return Response(status_code=499)
        out = outs[0]
        job.note(out)
        output = items_of(job, out.text, out.finish_reason)
        use = await responses_usage(state, job, outs, len(out.token_ids), output)
        response = response_object(state, body, job.request_id, created, "completed", output, use,
                                   out.finish_reason, out.error if out.finish_reason == "error" else None)
        keep(state, body, response, items)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}", dependencies=dependencies, responses=responses)
    async def get_response(response_id: str) -> Response:
        stored = state.responses.get(response_id)
        if stored is None:
            raise APIError(404, f"response with id {response_id!r} not found", "not_found", "response_id")
        return JSONResponse(stored.response)

    @app.delete("/v1/responses/{response_id}", dependencies=dependencies, responses=responses)
    async def delete_response(response_id: str) -> Response:
        if not state.responses.delete(response_id):
            raise APIError(404, f"response with id {response_id!r} not found", "not_found", "response_id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def dumps(obj: Any) -> str:
    return sse_json(obj)
