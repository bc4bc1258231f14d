"""Prometheus metrics (prometheus-client), one registry per server.

Engine gauges are read at scrape time from the engine loop's published Snapshot, so a
scrape never touches the Engine from the HTTP thread. Request-level figures (time to first
token, end-to-end latency, finish reasons, rejections, each speculating request's acceptance
length) are recorded by the handlers.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from augury import cpu, distributed
from augury.server.engine_loop import Snapshot

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# tokens per verification step (accepted drafts + 1): 1 = nothing accepted
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0, 16.0)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self._model], value)
        return g

    def collect(self) -> Iterator:
        s = self._snapshot()
        yield self._gauge("augury:num_requests_running", "Requests in the running batch.", s.running)
        yield self._gauge("augury:num_requests_waiting", "Requests admitted and waiting to run.", s.waiting)
        yield self._gauge("augury:num_requests_in_flight", "Requests admitted and not finished.", s.in_flight)
        yield self._gauge("augury:kv_cache_usage_ratio", "Fraction of usable KV cache blocks in use.", s.kv_usage)
        yield self._gauge("augury:kv_cache_free_blocks", "Free KV cache blocks.", s.kv_free_blocks)
        yield self._gauge("augury:kv_cache_usable_blocks", "Usable KV cache blocks.", s.kv_usable_blocks)
        yield self._gauge("augury:kv_cache_written_blocks", "KV cache blocks written at least once since start: "
                          "the cache takes memory as it is written, up to its reservation.", s.kv_written_blocks)
        yield self._gauge("augury:prefix_cache_hit_rate",
                          "Of the prompt tokens admitted requests had to prefill, the fraction served from the "
                          "prefix cache.", s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
        yield self._gauge("augury:engine_alive", "1 while the engine loop is serving.", 1.0 if s.alive else 0.0)
        yield self._gauge("augury:spec_accept_length",
                          "Mean tokens emitted per speculative verification (accepted drafts + 1).", s.accept_length)
        yield self._gauge("augury:spec_num_draft_tokens",
                          "Draft tokens per request chosen at the last decode step (0 = speculation off).",
                          s.last_draft_tokens)
        cpu_now = cpu.status()
        kernels = GaugeMetricFamily("augury:cpu_kernels_info",
                                    "1 for each of augury's CPU kernels that runs, with the ISA level it was built "
                                    "for and the CPU's own.", labels=["model_name", "kernel", "isa", "host_isa"])
        for name, on in cpu_now["kernels"].items():
            kernels.add_metric([self._model, name, str(cpu_now["kernels_isa"]), str(cpu_now["host_isa"])],
                               1.0 if on else 0.0)
        yield kernels
        tp = distributed.status()
        ranks = GaugeMetricFamily("augury:tensor_parallel_info", "1, with the number of tensor-parallel ranks and "
                                  "their backend (size 1: no tensor parallelism).",
                                  labels=["model_name", "size", "backend"])
        ranks.add_metric([self._model, str(tp["size"]), str(tp["backend"] or "none")], 1.0)
        yield ranks
        comm = CounterMetricFamily("augury:tensor_parallel_seconds", "Seconds rank 0 spent in tensor-parallel "
                                   "collectives, by kind (all_reduce: the sums inside forwards; command: handing "
                                   "each target call to the other ranks; logits: gathering them).",
                                   labels=["model_name", "kind"])
        for kind, seconds in tp.get("seconds", {}).items():
            comm.add_metric([self._model, kind], seconds)
        yield comm
        rates = GaugeMetricFamily("augury:spec_acceptance_rate",
                                  "Acceptance rate of the proposer's draft token at each depth (position 1 = "
                                  "first draft; a grammar's forced tokens not counted).",
                                  labels=["model_name", "position"])
        for i, rate in enumerate(s.acceptance_rates):
            rates.add_metric([self._model, str(i + 1)], rate)
        yield rates
        drafted = CounterMetricFamily("augury:spec_draft_tokens",
                                      "Draft tokens verified, by source (head: the EAGLE-3 head; lookup: prompt "
                                      "lookup; forced: the tokens a grammar forces).", labels=["model_name", "source"])
        accepted = CounterMetricFamily("augury:spec_accepted_tokens",
                                       "Draft tokens accepted, by source (head, lookup, forced; as for "
                                       "augury:spec_draft_tokens).", labels=["model_name", "source"])
        for source, n_drafted, n_accepted in s.spec_tokens_by_source:
            drafted.add_metric([self._model, source], n_drafted)
            accepted.add_metric([self._model, source], n_accepted)
        yield drafted
        yield accepted
        chosen = CounterMetricFamily("augury:spec_draft_size_steps",
                                     "Decode steps by the draft size the speculation policy chose (0 = off).",
                                     labels=["model_name", "draft_tokens"])
        for size, steps in s.draft_size_steps:
            chosen.add_metric([self._model, str(size)], steps)
        yield chosen
        for name, doc, value in (
            ("augury:generation_tokens", "Generated tokens.", s.generation_tokens_total),
            ("augury:spec_steps", "Decode steps that speculated.", s.steps_spec),
            ("augury:plain_steps", "Decode steps without speculation.", s.steps_plain),
            ("augury:num_preemptions", "Requests preempted for lack of KV cache.", s.num_preemptions),
            ("augury:prefix_cache_queries", "Prompt tokens admitted requests had to prefill (a preempted "
             "request's recomputation included).", s.prefix_cache_queries),
            ("augury:prefix_cache_hits", "Of those, tokens served from the prefix cache.", s.prefix_cache_hits),
            ("augury:engine_step_errors", "Engine steps that raised (requests in flight were failed).",
             s.step_errors),
            ("augury:constrained_requests", "Requests admitted with a grammar (structured output, tool calls).",
             s.constrained_requests),
            ("augury:grammar_mask_seconds", "Time spent building and applying grammar masks.", s.mask_seconds),
            ("augury:grammar_masked_tokens", "Token choices (decode rows and verified tree nodes) made under a "
             "grammar mask; mask seconds over masked tokens is the mask time per token.", s.masked_tokens),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], value)
            yield c


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], Snapshot], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(snapshot, model_name))
        labels = ["model_name"]
        self._model = model_name
        self.ttft = Histogram("augury:time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("augury:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("augury:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter("augury:requests_rejected", "Requests refused before they ran, by HTTP status.",
                                labels + ["status"], registry=self.registry)
        self.aborted = Counter("augury:requests_aborted", "Requests aborted because the client went away.",
                               labels, registry=self.registry)
        self.accept_length = Histogram(
            "augury:request_spec_accept_length",
            "Per finished request that speculated: its tokens per verification step (accepted drafts + 1).",
            labels, buckets=_ACCEPT_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("augury:prompt_tokens", "Prompt tokens of admitted requests.",
                                     labels, registry=self.registry)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(self._model).observe(seconds)

    def observe_finished(self, reason: str, seconds: float) -> None:
        self.finished.labels(self._model, reason).inc()
        self.e2e.labels(self._model).observe(seconds)

    def observe_accept_length(self, tokens_per_step: float) -> None:
        self.accept_length.labels(self._model).observe(tokens_per_step)

    def observe_rejected(self, status: int) -> None:
        self.rejected.labels(self._model, str(status)).inc()

    def observe_aborted(self, count: int = 1) -> None:
        self.aborted.labels(self._model).inc(count)

    def observe_prompt_tokens(self, count: int) -> None:
        self.prompt_tokens.labels(self._model).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
