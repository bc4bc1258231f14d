"""`augury bench --workload document|multi-turn`: time to first token with and without prefix caching.

Two augury engines with the same options, one with prefix caching and one without, take turns
(order alternating per repeat; each repeat starts both from an empty cache):

- document: one long document (Python's standard-library documentation, --doc-tokens long) in the
  chat template with a different question each request, one request at a time. The first request
  computes the document; the later ones may reuse it. Reported: the median TTFT of the later
  requests, its ratio without/with caching in each repeat (paired) and their median, and tokens per
  verify step of the later requests (speculation must not lose acceptance on a cache hit).
- multi-turn: a chat of --turns turns, each turn's prompt the whole conversation so far plus a new
  user message; TTFT per turn.

Greedy answers are compared between the two engines. Results go to --out/prefix.json.
"""
from __future__ import annotations

import importlib
import inspect
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# documentation the document workload is cut from (any Python has it; no download)
DOC_MODULES = ("argparse", "json", "logging", "collections", "itertools", "functools", "pathlib", "unittest",
               "subprocess", "datetime", "re", "dataclasses", "typing", "asyncio", "sqlite3", "csv")
QUESTIONS = (
    "Summarise the document above in two sentences.",
    "Which Python modules does the document describe? List them.",
    "What does the document say about regular expressions?",
    "Explain what a dataclass is, using only the document.",
    "Write a short title for the document.",
    "Which part of the document would help someone parse command-line arguments?",
    "Give three keywords for the document.",
    "Is there anything about dates or times in the document? Answer briefly.",
    "What is JSON, according to the document?",
    "Name one function the document mentions and say what it does.",
    "Which module would you use to run another program? Quote the document.",
    "Write one question a reader of this document might ask.",
)
TURNS = (
    "I am planning a small vegetable garden on a sunny balcony. What should I grow first?",
    "How often should I water those plants in summer?",
    "Some leaves are turning yellow. What could be wrong?",
    "Write me a short checklist for the next month, based on what we discussed.",
    "Which of those tasks matters most, and why?",
    "Thanks! Summarise our whole conversation in three bullet points.",
)
SYSTEM_PROMPT = "You are a helpful assistant. Answer from the document the user gives you."


@dataclass(frozen=True)
class PrefixSettings:
    model: str = "demo"
    workload: str = "document"  # or "multi-turn"
    dtype: str = "auto"  # as LLM resolves it (the demo: bfloat16)
    device: str = "cpu"
    draft_model: str | None = None
    threads: int | None = None
    quantization: str = "auto"
    speculative_policy: str = "adaptive"
    doc_tokens: int = 1500
    questions: int = 6  # requests after the first (document workload)
    turns: int = 4  # multi-turn workload
    output_len: int = 32
    repeats: int = 3
    out: str = "bench_out/prefix"


@dataclass
class PrefixRow:
    system: str  # "cache" or "no-cache"
    ttft: list[list[float]] = field(default_factory=list)  # per repeat, per request (seconds)
    accept_lengths: list[float] = field(default_factory=list)  # per repeat: later requests' tokens per verify step
    cached_tokens: list[list[int]] = field(default_factory=list)  # per repeat, per request
    answers: list[list[int]] = field(default_factory=list)  # greedy answers of the last repeat

    def later_median(self, rep: int) -> float:
        return statistics.median(self.ttft[rep][1:])


def document(tokenizer, n_tokens: int) -> str:
    """About n_tokens of English prose: the documentation of standard-library modules, cut at a token."""
    parts, ids = [], []
    for name in DOC_MODULES:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        parts.append(doc.strip())
        ids = tokenizer.encode("\n\n".join(parts), add_special_tokens=False)
        if len(ids) >= n_tokens:
            break
    if len(ids) < n_tokens:
        raise ValueError(f"the documentation available has only {len(ids)} tokens; ask for fewer (--doc-tokens)")
    return tokenizer.decode(ids[:n_tokens])


def _chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def timed_request(llm, ids: list[int], max_tokens: int):
    """(seconds to the first generated token, final RequestOutput) of one request run alone."""
    from augury import SamplingParams

    eng = llm.engine
    t0 = time.perf_counter()
    rid = eng.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    ttft, final = None, None
    while final is None:
        for out in eng.step():
            if out.request_id != rid:
                continue
            if ttft is None and out.token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                final = out
    return ttft, final


def _accept_length(outs) -> float:
    steps = sum(o.spec_stats.num_verify_steps for o in outs)
    return 1.0 + sum(o.spec_stats.num_accepted_draft_tokens for o in outs) / steps if steps else 0.0


def _run_document(llm, tokenizer, s: PrefixSettings, doc: str):
    ttft, outs = [], []
    for q in QUESTIONS[: s.questions + 1]:
        ids = _chat(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT},
                                {"role": "user", "content": f"{doc}\n\n{q}"}])
        t, out = timed_request(llm, ids, s.output_len)
        ttft.append(t)
        outs.append(out)
    return ttft, outs


def _run_turns(llm, tokenizer, s: PrefixSettings):
    messages: list[dict[str, str]] = []
    ttft, outs = [], []
    for msg in TURNS[: s.turns]:
        messages.append({"role": "user", "content": msg})
        t, out = timed_request(llm, _chat(tokenizer, messages), s.output_len)
        messages.append({"role": "assistant", "content": out.text})
        ttft.append(t)
        outs.append(out)
    return ttft, outs


def run(s: PrefixSettings, progress: bool = True) -> tuple[list[PrefixRow], dict[str, Any]]:
    import torch

    from augury import LLM

    if s.workload not in ("document", "multi-turn"):
        raise ValueError(f"unknown workload {s.workload!r}")
    if s.workload == "multi-turn" and not 1 <= s.turns <= len(TURNS):
        raise ValueError(f"--turns must be in [1, {len(TURNS)}]")
    if s.workload == "document" and not 1 <= s.questions < len(QUESTIONS):
        raise ValueError(f"--questions must be in [1, {len(QUESTIONS) - 1}]")
    if s.threads:
        torch.set_num_threads(s.threads)
    common = dict(dtype=s.dtype, device=s.device, quantization=s.quantization, log_stats_interval=0,
                  speculative_policy=s.speculative_policy)
    if s.draft_model:
        common["draft_model"] = s.draft_model
    if s.threads:
        common["threads"] = s.threads
    rows = {name: PrefixRow(name) for name in ("no-cache", "cache")}
    llms = {name: LLM(s.model, enable_prefix_caching=(name == "cache"), **common) for name in rows}
    tokenizer = llms["cache"].tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("the prefix workloads need a model with a tokenizer and a chat template")
    doc = document(tokenizer, s.doc_tokens) if s.workload == "document" else ""
    for name, llm in llms.items():  # warm-up, untimed
        llm.engine.reset_prefix_cache()
        timed_request(llm, _chat(tokenizer, [{"role": "user", "content": "Hello!"}]), 4)
    for rep in range(s.repeats):
        order = list(rows) if rep % 2 == 0 else list(reversed(rows))
        for name in order:
            llm = llms[name]
            llm.engine.reset_prefix_cache()
            ttft, outs = (_run_document(llm, tokenizer, s, doc) if s.workload == "document"
                          else _run_turns(llm, tokenizer, s))
            row = rows[name]
            row.ttft.append(ttft)
            row.accept_lengths.append(_accept_length(outs[1:]))
            row.cached_tokens.append([o.num_cached_tokens for o in outs])
            row.answers = [o.token_ids for o in outs]
            if progress:
                print(f"repeat {rep + 1}/{s.repeats} {name}: TTFT " + " ".join(f"{t * 1000:.0f}" for t in ttft) + " ms",
                      flush=True)
    info = {"threads": torch.get_num_threads(), "prompt_tokens": [len(o.prompt_token_ids) for o in outs]}
    return list(rows.values()), info


def summary(rows: list[PrefixRow], s: PrefixSettings) -> dict[str, Any]:
    off, on = rows
    n = len(off.ttft[0])
    paired = [off.later_median(r) / on.later_median(r) for r in range(len(on.ttft))]
    per_request = [statistics.median(off.ttft[r][i] / on.ttft[r][i] for r in range(len(on.ttft))) for i in range(n)]
    return {
        "later_ttft_ms": {row.system: 1000 * statistics.median(row.later_median(r) for r in range(len(row.ttft)))
                          for row in rows},
        "first_ttft_ms": {row.system: 1000 * statistics.median(row.ttft[r][0] for r in range(len(row.ttft)))
                          for row in rows},
        "paired_speedup": paired, "median_speedup": statistics.median(paired),
        "per_request_speedup": per_request,
        "per_request_ttft_ms": {row.system: [1000 * statistics.median(row.ttft[r][i] for r in range(len(row.ttft)))
                                             for i in range(n)] for row in rows},
        "accept_length": {row.system: statistics.median(row.accept_lengths) for row in rows},
        "cached_tokens": {row.system: row.cached_tokens[-1] for row in rows},
        "same_answers": sum(a == b for a, b in zip(off.answers, on.answers)), "requests": n,
    }


def format_summary(sm: dict[str, Any], s: PrefixSettings, info: dict[str, Any]) -> str:
    label = "request" if s.workload == "document" else "turn"
    lines = [f"workload {s.workload}, {info['threads']} threads, {s.repeats} repeats, prompt tokens "
             f"{info['prompt_tokens']}"]
    lines.append(f"{label:>8} {'no-cache ms':>12} {'cache ms':>9} {'speed-up':>9} {'cached tokens':>14}")
    for i in range(sm["requests"]):
        lines.append(f"{i + 1:>8} {sm['per_request_ttft_ms']['no-cache'][i]:>12.0f} "
                     f"{sm['per_request_ttft_ms']['cache'][i]:>9.0f} {sm['per_request_speedup'][i]:>8.2f}x "
                     f"{sm['cached_tokens']['cache'][i]:>14}")
    spread = ", ".join(f"{x:.2f}" for x in sm["paired_speedup"])
    lines.append(f"later {label}s' median TTFT: no-cache {sm['later_ttft_ms']['no-cache']:.0f} ms, cache "
                 f"{sm['later_ttft_ms']['cache']:.0f} ms; paired speed-up median {sm['median_speedup']:.2f}x [{spread}]")
    acc = sm["accept_length"]
    if acc["cache"] or acc["no-cache"]:
        lines.append(f"tokens per verify step (later {label}s): no-cache {acc['no-cache']:.2f}, cache {acc['cache']:.2f}")
    lines.append(f"greedy answers equal: {sm['same_answers']}/{sm['requests']}")
    return "\n".join(lines)


def bench_prefix(s: PrefixSettings, progress: bool = True) -> tuple[str, Path]:
    rows, info = run(s, progress)
    sm = summary(rows, s)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": asdict(s), "environment": info, "summary": sm,
              "rows": [{k: v for k, v in asdict(r).items() if k != "answers"} for r in rows]}
    (out / "prefix.json").write_text(json.dumps(report, indent=2) + "\n")
    return format_summary(sm, s, info), out / "prefix.json"
