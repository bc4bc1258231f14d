"""The engine's own thread: after start-up, the only code that touches the Engine.

HTTP handlers never call the Engine. They `submit` a group of requests (one per prompt and
choice) and read the outputs from the group in their own event loop (one pending output per
request, what arrives meanwhile merged into it: a slow reader holds its answer, not a queue of
copies); they `abort` a group when the client goes away. Commands go into an inbox the engine thread drains
before each step, so an abort frees its KV blocks before the next forward. Admission is
bounded: at most max_num_seqs running plus max_queue_size waiting requests are in flight,
beyond that `submit` raises QueueFull at once instead of queueing without limit.

A fault that belongs to one request (its logit shaping leaves no valid token, its grammar refuses
a token, its text cannot be detokenized) ends that request alone inside the engine (finish_reason
"error", Engine.fail); it reaches its client as a RequestFailed naming the reason, and the rest of
the batch goes on untouched. If a step itself raises (an engine bug, no single request to blame), the
newest request in flight (the usual suspect: whatever it brought is what the step had not seen
before) is failed and the step is retried once without it; if the retry raises too, every request
in flight gets an error, is aborted, and the loop checks that the engine is clean again (nothing
scheduled, every KV block free); if it is not, the loop stops for good and reports the failure
through `on_fatal`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from augury.engine.engine import NONFINITE
from augury.outputs import MergedOutputs, RequestOutput
from augury.sampling_params import OutputKind, SamplingParams
from augury.core.sources import SOURCE_NAMES

log = logging.getLogger("augury.server")


class QueueFull(Exception):
    """Admission refused: the server holds as many requests as it may."""


class EngineUnavailable(Exception):
    """The engine loop is stopping or has failed."""


class RequestFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Snapshot:
    """Engine state published after each step, readable from any thread."""

    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    kv_usage: float = 0.0
    kv_free_blocks: int = 0
    kv_usable_blocks: int = 0
    kv_written_blocks: int = 0  # blocks written at least once since start: the cache memory taken so far
    generation_tokens_total: int = 0
    accept_length: float = 0.0
    acceptance_rates: tuple[float, ...] = ()
    last_draft_tokens: int = 0
    steps_spec: int = 0
    steps_plain: int = 0
    draft_size_steps: tuple[tuple[int, int], ...] = ()  # (draft tokens chosen, decode steps that chose it)
    # (source: head, lookup, forced; draft tokens verified, accepted): core/stats.EngineStats by source
    spec_tokens_by_source: tuple[tuple[str, int, int], ...] = ()
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens admitted requests had to prefill
    prefix_cache_hits: int = 0  # of those, tokens served from the prefix cache
    step_errors: int = 0
    alive: bool = False
    constrained_requests: int = 0  # requests admitted with a grammar (structured output, tool calls)
    mask_seconds: float = 0.0  # time spent building and applying grammar masks
    masked_tokens: int = 0  # rows (decode steps' and verified nodes') a grammar mask was built for


@dataclass
class RequestGroup:
    """The engine requests of one HTTP request; outputs arrive as (index, output).

    What the reader has not taken yet is held per member, each new output merged into the one
    waiting (outputs.MergedOutputs; `delta[i]`: whether member i's outputs are deltas): a reader
    that stops reading holds at most one pending output per member, of the size of what it has not
    read, never a queue of copies. An error (RequestFailed, EngineUnavailable) comes after the
    member's pending output."""

    request_ids: list[str]
    owner: "EngineLoop"
    delta: list[bool]
    done: set[int] = field(default_factory=set)
    _pending: dict[int, RequestOutput | MergedOutputs] = field(default_factory=dict)  # in order of arrival
    _failed: dict[int, BaseException] = field(default_factory=dict)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def __len__(self) -> int:
        return len(self.request_ids)

    def put(self, index: int, item: RequestOutput | BaseException) -> None:
        """One output (or error) of member `index`; on the event loop's thread only."""
        if isinstance(item, BaseException):
            self._failed[index] = item
        else:
            held = self._pending.get(index)
            if held is None:
                self._pending[index] = item
            elif isinstance(held, MergedOutputs):
                held.add(item)
            else:
                merged = self._pending[index] = MergedOutputs(held, self.delta[index])
                merged.add(item)
        self._ready.set()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while len(self.done) < len(self.request_ids):
            while not (self._pending or self._failed):
                self._ready.clear()
                await self._ready.wait()
            if self._pending:
                index = next(iter(self._pending))
                item = self._pending.pop(index)
                out = item.take() if isinstance(item, MergedOutputs) else item
                if out.finished:
                    self.done.add(index)
                yield index, out
                continue
            index, exc = self._failed.popitem()
            self.done.add(index)
            raise exc

    @property
    def pending_outputs(self) -> int:
        """Outputs (and errors) waiting for the reader: at most one per member."""
        return len(self._pending) + len(self._failed)

    @property
    def pending_tokens(self) -> int:
        """Token ids the waiting outputs hold (a cumulative output's whole list counts)."""
        return sum(held.held_tokens if isinstance(held, MergedOutputs) else len(held.token_ids)
                   for held in self._pending.values())

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.request_ids)

    def abort(self) -> None:
        """Abort every member that has not finished (a no-op once all have)."""
        for i, rid in enumerate(self.request_ids):
            if i not in self.done:
                self.done.add(i)
                self.owner.abort(rid)


class EngineLoop:
    def __init__(self, engine, max_queue_size: int, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.capacity = engine.config.max_num_seqs + max_queue_size
        self.on_fatal = on_fatal
        self.fatal_error: BaseException | None = None
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._members: dict[str, tuple[RequestGroup, int]] = {}  # in flight: id -> (group, index)
        self._stopping = False
        self._step_errors = 0
        self._draft_sizes: dict[int, int] = {}  # the policy's choice at each decode step, counted
        self._policy_steps = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="augury-engine", daemon=True)
        self.snapshot = self._take_snapshot(alive=False)

    # ------------------------------------------------------- event-loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None and not self._stopping

    def submit(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams]) -> RequestGroup:
        """Admit all of one HTTP request's prompts at once, or none (QueueFull, EngineUnavailable)."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        group = RequestGroup(ids, self, [p.output_kind is OutputKind.DELTA for p in params])
        with self._cond:
            if not self.alive:
                raise EngineUnavailable("the engine is not running")
            if len(self._members) + len(ids) > self.capacity:
                raise QueueFull(f"{len(self._members)} requests are in flight and the limit is {self.capacity}")
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
                self._members[rid] = (group, i)
                self._inbox.append(("add", rid, prompt, p))
            self._cond.notify()
        return group

    def abort(self, request_id: str) -> None:
        with self._cond:
            if self._members.pop(request_id, None) is not None:
                self._inbox.append(("abort", request_id))
                self._cond.notify()

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished yet (a drain waits until none is left)."""
        with self._cond:
            return len(self._members)

    def cut(self, reason: str) -> int:
        """End every request in flight now, each with EngineUnavailable(reason), on the event loop's
        thread (a drain out of time); the engine frees their blocks before its next step. How many."""
        with self._cond:
            members, self._members = self._members, {}
            self._inbox.extend(("abort", rid) for rid in members)
            self._cond.notify()
        _dispatch([(group, index, EngineUnavailable(reason)) for group, index in members.values()])
        return len(members)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---------------------------------------------------------- engine side
    def _run(self) -> None:
        engine = self.engine
        self.snapshot = self._take_snapshot(alive=True)
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stopping or engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._inbox = self._inbox, []
                self._apply(commands)
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except Exception as exc:  # an engine bug: contain it, or stop for good
                        outputs = self._recover(exc)
                    self._count_draft_size()
                    routed = self._route([(out.request_id, _failure_of(out) or out) for out in outputs])
                    self.snapshot = self._take_snapshot(alive=True)  # before a client can see its output
                    self._send(routed)
                self.snapshot = self._take_snapshot(alive=True)
        except BaseException as exc:
            self.fatal_error = exc
            log.error("the engine loop failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        finally:
            self._shutdown_requests()
            self.snapshot = self._take_snapshot(alive=False)
            if self.fatal_error is not None and self.on_fatal is not None:
                self.on_fatal(self.fatal_error)

    def _apply(self, commands: list[tuple]) -> None:
        for cmd in commands:
            if cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
                continue
            _, rid, prompt, params = cmd
            with self._cond:
                if rid not in self._members:  # aborted before it was added
                    continue
            try:
                self.engine.add_request(prompt, params, rid)
            except ValueError as exc:
                self._deliver([(rid, RequestFailed(400, str(exc)))])
            except Exception as exc:
                log.error("could not add request %s", rid, exc_info=exc)
                self._deliver([(rid, RequestFailed(500, f"could not add the request: {type(exc).__name__}"))])

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """After engine.step raised: fail the newest request and retry the step without it (its
        outputs returned); where that fails too, fail them all (and [] is returned)."""
        engine = self.engine
        self._step_errors += 1
        if len(engine.requests) > 1:
            suspect = next(reversed(engine.requests))  # admitted last (the dict keeps admission order)
            log.error("engine step failed; retrying it without the newest request %s", suspect, exc_info=exc)
            engine.abort_request(suspect)
            self._deliver([(suspect, RequestFailed(
                500, f"the engine failed on the step that first ran this request ({type(exc).__name__})"))])
            try:
                return engine.step()
            except Exception as again:
                exc = again
                self._step_errors += 1
        victims = list(engine.requests)
        log.error("engine step failed; failing the %d request(s) in flight", len(victims), exc_info=exc)
        for rid in victims:
            engine.abort_request(rid)
        failure = RequestFailed(500, f"the engine failed while running this request ({type(exc).__name__})")
        self._deliver([(rid, failure) for rid in victims])
        clean = not engine.has_unfinished_requests() and engine.allocator.num_free == engine.allocator.num_usable
        if not clean:
            raise RuntimeError(f"engine state is inconsistent after a failed step ({type(exc).__name__}: {exc})")
        return []

    def _count_draft_size(self) -> None:
        """One count per decode step the speculation policy decided (its choice: stats.last_draft_tokens)."""
        stats = self.engine.stats
        steps = stats.steps_spec + stats.steps_plain
        if steps < self._policy_steps:  # the stats were reset
            self._policy_steps = 0
        if steps > self._policy_steps:
            size = stats.last_draft_tokens
            self._draft_sizes[size] = self._draft_sizes.get(size, 0) + steps - self._policy_steps
            self._policy_steps = steps

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Route outputs (or errors) to their groups' queues in the event loop."""
        self._send(self._route(items))

    def _route(self, items: list[tuple[str, object]]) -> list[tuple[RequestGroup, int, object]]:
        """Find each item's group; a final item takes its request out of the in-flight set."""
        routed = []
        with self._cond:
            for rid, item in items:
                member = self._members.get(rid)
                if member is None:
                    continue  # aborted meanwhile: nobody is listening
                if isinstance(item, BaseException) or item.finished:
                    del self._members[rid]
                routed.append((member[0], member[1], item))
        return routed

    def _send(self, routed: list[tuple[RequestGroup, int, object]]) -> None:
        if routed and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(_dispatch, routed)
            except RuntimeError:  # the event loop is closed: the server is going away
                pass

    def _shutdown_requests(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        with self._cond:
            rids = list(self._members)
        self._deliver([(rid, EngineUnavailable("the server is shutting down")) for rid in rids])

    def _take_snapshot(self, alive: bool) -> Snapshot:
        engine, stats = self.engine, self.engine.stats
        alloc = engine.allocator
        shaping = engine.shaping_stats()
        masks = {} if shaping is None else {"constrained_requests": shaping.constrained_requests,
                                            "mask_seconds": shaping.mask_seconds, "masked_tokens": shaping.masked_tokens}
        return Snapshot(**masks,
            running=engine.num_running, waiting=engine.num_waiting, in_flight=len(self._members),
            kv_usage=alloc.usage, kv_free_blocks=alloc.num_free, kv_usable_blocks=alloc.num_usable,
            kv_written_blocks=alloc.num_written,
            generation_tokens_total=stats.generation_tokens_total, accept_length=stats.accept_length,
            acceptance_rates=tuple(stats.acceptance_rates()), last_draft_tokens=stats.last_draft_tokens,
            steps_spec=stats.steps_spec, steps_plain=stats.steps_plain,
            draft_size_steps=tuple(sorted(self._draft_sizes.items())),
            spec_tokens_by_source=tuple(zip(SOURCE_NAMES, stats.drafted_by_source, stats.accepted_by_source)),
            num_preemptions=engine.scheduler.num_preemptions, step_errors=self._step_errors, alive=alive,
            prefix_cache_queries=engine.scheduler.prefix_queries, prefix_cache_hits=engine.scheduler.prefix_hits,
        )


def _failure_of(out: RequestOutput) -> RequestFailed | None:
    """A request the engine ended with finish_reason "error" (a fault of its own): the error its
    client gets, a 400 where its own logit shaping (bias, bad words, grammar) is to blame."""
    if out.finish_reason != "error":
        return None
    status = 500 if (out.error or "").endswith(NONFINITE) else 400
    return RequestFailed(status, f"this request failed: {out.error}")


def _dispatch(routed: list[tuple[RequestGroup, int, object]]) -> None:
    for group, index, item in routed:
        group.put(index, item)
