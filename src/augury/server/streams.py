"""Answers: collect a group's outputs into one JSON body (each request's one final output: admit
asks for final_only), or stream them as server-sent events (each chunk a request's delta outputs).

Either way a client that goes away aborts its requests (their KV blocks are freed before the
engine's next step): a non-streamed handler watches for the ASGI disconnect while it waits,
and a streamed response aborts whatever has not finished when the response ends for any reason,
a client that reads nothing for the stream timeout included.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from augury.outputs import RequestOutput
from augury.server.engine_loop import EngineUnavailable, RequestFailed, RequestGroup
from augury.server.errors import APIError, error_body
from augury.server.logprobs import chat_logprobs, completion_logprobs
from augury.server.provenance import HeldProvenance, asked
from augury.server.serving import Job, ServerState
from augury.server.chat_text import ChatTextStream

log = logging.getLogger("augury.server")


def usage(prompt_tokens: int, completion_tokens: int, finals: list[RequestOutput] | None = None) -> dict[str, Any]:
    """OpenAI's usage (with prompt_tokens_details.cached_tokens), plus augury's extension `speculative`: the speculation figures of the
    finished choices (their RequestOutput.spec_stats, summed): draft tokens verified, drafts
    accepted (and emitted) and verification steps, and the drafts and accepted drafts by source (the
    EAGLE-3 head, prompt lookup, a grammar's forced tokens: they sum to the totals); all 0 for a
    request that never speculated."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    # OpenAI's prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served (of the
    # choices sharing one prompt, the most any of them was served)
    cached = max((o.num_cached_tokens for o in finals or []), default=0)
    out["prompt_tokens_details"] = {"cached_tokens": min(cached, prompt_tokens)}
    stats = [o.spec_stats for o in finals or []]
    out["speculative"] = {"draft_tokens": sum(s.num_draft_tokens for s in stats),
                          "accepted_tokens": sum(s.num_accepted_draft_tokens for s in stats),
                          "verify_steps": sum(s.num_verify_steps for s in stats),
                          "head_draft_tokens": sum(s.num_head_draft_tokens for s in stats),
                          "head_accepted_tokens": sum(s.num_head_accepted_tokens for s in stats),
                          "lookup_draft_tokens": sum(s.num_lookup_draft_tokens for s in stats),
                          "lookup_accepted_tokens": sum(s.num_lookup_accepted_tokens for s in stats),
                          "forced_draft_tokens": sum(s.num_forced_draft_tokens for s in stats),
                          "forced_accepted_tokens": sum(s.num_forced_accepted_tokens for s in stats)}
    return out


def _failure(exc: BaseException) -> tuple[int, str, str]:
    if isinstance(exc, RequestFailed):
        return exc.status, str(exc), "invalid_value" if exc.status < 500 else "engine_error"
    return 503, f"the engine is not available: {exc}", "engine_unavailable"


class _Observer:
    """Per-request metrics: time to first token, finish reasons, latency."""

    def __init__(self, state: ServerState, t0: float) -> None:
        self.state, self.t0, self.first = state, t0, True

    def __call__(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if self.first and out.first_token_time is not None:  # when the engine emitted it (a final_only
            self.first = False  # answer's one output comes at the end)
            self.state.metrics.observe_ttft(max(0.0, out.first_token_time - self.t0))
        if out.finished:
            self.state.metrics.observe_finished(out.finish_reason or "unknown", now - self.t0)
            if out.spec_stats.num_verify_steps:
                self.state.metrics.observe_accept_length(out.spec_stats.accept_length)


async def _client_gone(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(state: ServerState, group: RequestGroup, request: Request, t0: float) -> list[RequestOutput] | None:
    """The final output of every member, or None when the client went away first (all aborted)."""
    results: list[RequestOutput | None] = [None] * len(group)
    observe = _Observer(state, t0)

    async def consume() -> None:
        async for index, out in group.outputs():
            observe(out)
            if out.finished:
                results[index] = out

    task = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        if not group.finished:
            group.abort()
            state.metrics.observe_aborted()
    if not task.done() or task.cancelled():
        return None
    exc = task.exception()
    if exc is not None:
        if isinstance(exc, (RequestFailed, EngineUnavailable)):
            status, message, code = _failure(exc)
            raise APIError(status, message, code)
        raise exc
    return [r for r in results if r is not None]


class _Stalled(Exception):
    """The client accepted none of the stream's bytes for the response's stall timeout."""


class GroupStreamingResponse(StreamingResponse):
    """An SSE response that aborts its group's unfinished requests however it ends.

    A client that accepts no data for `stall_timeout` seconds (None: no limit) ends it too: a send
    waits while the connection's write buffer is full, so the response gives up on that send, its
    requests are aborted (their KV blocks freed before the engine's next step) and the HTTP server
    closes the connection once what it has buffered goes out. Meanwhile the group holds one merged
    output per request (engine_loop.RequestGroup), so a stalled reader costs O(its answer)."""

    def __init__(self, content: AsyncIterator[str], group: RequestGroup, on_abort: Callable[[], None],
                 stall_timeout: float | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.group = group
        self.on_abort = on_abort
        self.stall_timeout = stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.stall_timeout

        async def send_or_give_up(message: Message) -> None:
            try:
                with anyio.fail_after(timeout):
                    await send(message)
            except TimeoutError:
                raise _Stalled from None

        try:
            await super().__call__(scope, receive, send if timeout is None else send_or_give_up)
        except _Stalled:
            log.warning("a streaming client read nothing for %g s: its request %s (%d engine request(s)) is "
                        "aborted and the connection closed", timeout, self.group.request_ids[0], len(self.group))
        finally:
            if not self.group.finished:
                self.group.abort()
                self.on_abort()


class _HeldLogprobs:
    """Per choice, the tokens (and their logprobs) of deltas that showed no text yet: the next chunk
    carries them."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[list[int], list]] = {}

    def add(self, index: int, out: RequestOutput) -> None:
        if out.logprobs is not None:
            ids, entries = self.held.setdefault(index, ([], []))
            ids.extend(out.token_ids)
            entries.extend(out.logprobs)

    def take(self, index: int) -> tuple[list[int], list]:
        return self.held.pop(index, ([], []))


def _usage_field(job: Job, include_usage: bool, generated: int) -> dict[str, Any]:
    """A chunk's usage: with stream_options.continuous_usage_stats (vLLM's) the tokens so far, in every
    chunk; else null with include_usage (the last chunk has it all), none without."""
    if job.continuous_usage:
        return {"usage": {"prompt_tokens": job.prompt_tokens, "completion_tokens": generated,
                          "total_tokens": job.prompt_tokens + generated}}
    return {"usage": None} if include_usage else {}


def _provenance(job: Job) -> HeldProvenance | None:
    """The stream's holder of augury's extension (provenance.py), None when the request did not ask."""
    return HeldProvenance(job.params[0].skip_special_tokens) if asked(job.params) else None


# Characters JSON leaves raw with ensure_ascii=False that Python's str.splitlines (and so httpx's
# iter_lines) takes for line ends: inside an SSE `data:` line they would cut it in two for such a client
# (a sampled answer of the tiny test model held one). Escaped, the JSON decodes to the same string.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(obj: Any) -> str:
    """obj as compact JSON for one SSE data line: UTF-8 as it is, but for the line breaks above."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


def _sse(obj: Any) -> str:
    return f"data: {sse_json(obj)}\n\n"


async def completion_events(state: ServerState, job: Job, group: RequestGroup, t0: float,
                            include_usage: bool) -> AsyncIterator[str]:
    base = {"id": job.request_id, "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}
    observe, generated, finals = _Observer(state, t0), 0, []
    started: set[int] = set()  # choices whose first chunk went out
    held = _HeldLogprobs()
    prov = _provenance(job)
    offset: dict[int, int] = {}  # per choice: text_offset of its next token
    try:
        async for index, out in group.outputs():  # deltas (admit asks for them when streaming)
            observe(out)
            job.note(out)
            generated += len(out.new_token_ids)
            if out.finished:
                finals.append(out)
            held.add(index, out)
            if prov is not None:  # augury's extension (provenance.py): decoded on the tokenizer thread
                await state.on_tokenizer_thread(prov.add, state.tokenizer, index, out)
            first = index not in started
            if not out.new_text and not out.finished and not (first and job.echo) \
                    and not (prov is not None and prov.pending(index)):
                continue
            started.add(index)
            text, logprobs = out.new_text, None
            if first and job.echo:  # the prompt opens the choice's first chunk
                text = job.prompt_texts[index // job.n] + text
            if job.logprobs is not None:
                ids, entries = held.take(index)
                if first and job.echo:  # a delta stream's first output carries the prompt's logprobs
                    ids, entries = out.prompt_token_ids + ids, (out.prompt_logprobs or []) + entries
                tok = state.tokenizer
                logprobs = await state.on_tokenizer_thread(completion_logprobs, tok, ids, entries,
                                                           offset.get(index, 0))
                if logprobs["tokens"]:
                    offset[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
            if prov is not None and prov.pending(index):
                choice["augury"] = prov.take(index)
            chunk = {**base, "choices": [choice], **_usage_field(job, include_usage, generated)}
            yield _sse(chunk)
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage(job.prompt_tokens, generated, finals)})
    except (RequestFailed, EngineUnavailable) as exc:
        yield _sse(error_body(*_failure(exc)))
    yield "data: [DONE]\n\n"


async def chat_events(state: ServerState, job: Job, group: RequestGroup, t0: float,
                      include_usage: bool) -> AsyncIterator[str]:
    """Chat chunks. With tools or a reasoning parser, each choice's text goes through a ChatTextStream
    (chat_text.py): reasoning as reasoning_content deltas, text outside calls as content deltas, each
    call once its block is whole and parses as OpenAI's tool_calls deltas (index, id, type and name
    first, then its arguments), and a choice that called a tool and stopped finishes with
    "tool_calls": the same reasoning, content, calls and finish as the whole answer's."""
    base = {"id": job.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": state.model_name}
    observe, generated, finals = _Observer(state, t0), 0, []
    parsers: dict[int, ChatTextStream] = {}
    try:
        for index in range(len(group)):
            role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}
            yield _sse({**base, "choices": [role], **_usage_field(job, include_usage, generated)})
        held = _HeldLogprobs()
        prov = _provenance(job)
        async for index, out in group.outputs():  # deltas (admit asks for them when streaming)
            observe(out)
            job.note(out)
            generated += len(out.new_token_ids)
            if out.finished:
                finals.append(out)
            held.add(index, out)
            if prov is not None:  # augury's extension (provenance.py): decoded on the tokenizer thread
                await state.on_tokenizer_thread(prov.add, state.tokenizer, index, out)
            if not out.new_text and not out.finished and not (prov is not None and prov.pending(index)):
                continue
            finish = out.finish_reason
            if job.parse_tools or job.reasoning is not None:
                parser = parsers.setdefault(index, ChatTextStream(job))
                deltas = parser.feed(out.new_text) + (parser.finish() if out.finished else [])
                if parser.called and finish == "stop":
                    finish = "tool_calls"
            else:
                deltas = [{"content": out.new_text}] if out.new_text else []
            logprobs = None
            if job.logprobs is not None:  # every token not sent yet, whether or not it showed text
                ids, entries = held.take(index)
                logprobs = await state.on_tokenizer_thread(chat_logprobs, state.tokenizer, ids, entries, job.logprobs)
            extension = prov.take(index) if prov is not None else None
            if not deltas and (finish is not None or logprobs is not None or extension is not None):
                deltas = [{}]
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                choice = {"index": index, "delta": delta, "logprobs": logprobs if last else None,
                          "finish_reason": finish if last else None}
                if last and extension is not None:
                    choice["augury"] = extension
                yield _sse({**base, "choices": [choice], **_usage_field(job, include_usage, generated)})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage(job.prompt_tokens, generated, finals)})
    except (RequestFailed, EngineUnavailable) as exc:
        yield _sse(error_body(*_failure(exc)))
    yield "data: [DONE]\n\n"
