"""The measuring side of `augury bench --workload scale` (bench/scale.py): each job in a process of its
own, started as its users would start it (bench/worker.py's environment rules: a peer gets the user's
environment without AUGURY_* and as the shell had OMP_WAIT_POLICY, before llama.cpp is imported).

Jobs (each prints one JSON line, the last on its stdout):
- convert: augury's one-time GGUF conversion (resolve.gguf_folder): seconds and peak RSS.
- augury: load (seconds, RSS), decode tokens a second at each batch size (the time of N tokens less the
  time of 1, each with the prompts computed afresh: B (N - 1) / (t_N - t_1)), prefill of P tokens at
  batch 1, and the rows-per-verification-step table (bench/rows.py's time_rows) at a context.
- llama.cpp: its own batched decoding through llama-cpp-python's C API (one context of n_seq_max
  sequences, all rows of a step in one llama_decode, greedy by argmax): load, the same figures.
- spec: augury with an EAGLE-3 head, a static tree every step: per step the draft's levels, the rest of
  the step (verification: the target over the tree's rows, acceptance, commit) and the decode step
  (one row through the target and its output layer, time_rows), in milliseconds.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

# the process's first lines: note the environment before anything of augury is imported
BOOT = ("import os, sys; start = dict(os.environ); sys.path.insert(0, sys.argv[1]); "
        "from augury.bench.scale_worker import main; main(start, sys.argv[2], sys.argv[3])")


def memory() -> dict[str, float]:
    """This process's resident set now and at its peak, GB (Linux /proc; zeros elsewhere)."""
    out = {"rss_gb": 0.0, "peak_rss_gb": 0.0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss_gb" if key == "VmRSS" else "peak_rss_gb"] = int(value.split()[0]) / 1e6
    except OSError:
        pass
    return out


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    from augury.bench import make_prompts

    return make_prompts(batch, length, vocab - 256, seed)  # ordinary ids, below the special ones


def convert(job: dict[str, Any]) -> dict[str, Any]:
    from pathlib import Path

    from augury.resolve import gguf_folder

    t0 = time.perf_counter()
    folder = gguf_folder(Path(job["gguf"]))
    out = {"convert_s": time.perf_counter() - t0, "folder": str(folder), **memory()}
    # the first load packs every linear for its kernel and keeps the layouts (models/packed_cache.py): the
    # rounds' jobs then time a later start, as a user's every start after the first
    t1 = time.perf_counter()
    _augury_llm(job, speculative_algorithm="none")
    return out | {"first_load_s": time.perf_counter() - t1}


def _augury_llm(job: dict[str, Any], **kwargs: Any):
    import torch

    from augury import LLM

    torch.set_num_threads(job["threads"])
    return LLM(job["gguf"], dtype="bfloat16", quantization="auto", max_num_seqs=max(job["batch_sizes"]),
               max_model_len=job["max_len"], num_kv_blocks=job["kv_blocks"], log_stats_interval=0.0, **kwargs)


def _generate(llm, prompts: list[list[int]], n: int) -> float:
    """Seconds to generate n tokens for each prompt, every prompt computed afresh (greedy, EOS ignored)."""
    from augury.sampling_params import SamplingParams

    llm.engine.reset_prefix_cache()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _ in prompts]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def augury(job: dict[str, Any]) -> dict[str, Any]:
    from augury import cpu
    from augury.bench.rows import time_rows

    t0 = time.perf_counter()
    llm = _augury_llm(job, speculative_algorithm="none")
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "load_rss_gb": memory()["rss_gb"],
                           "isa": cpu.status()["kernels_isa"], "decode": {}}
    n, vocab = job["output_len"], job["vocab"]
    for b in job["batch_sizes"]:
        prompts = _prompts(b, job["prompt_len"], vocab, job["seed"])
        _generate(llm, prompts, min(n, 8))  # warm-up
        rates = []
        for _ in range(job["repeats"]):
            first = _generate(llm, prompts, 1)
            rates.append(b * (n - 1) / max(_generate(llm, prompts, n) - first, 1e-9))
        out["decode"][b] = statistics.median(rates)
    long = _prompts(1, job["prefill_len"], vocab, job["seed"] + 1)
    _generate(llm, long, 1)
    out["prefill"] = job["prefill_len"] / statistics.median(_generate(llm, long, 1) for _ in range(job["repeats"]))
    if job.get("time_rows", True):  # the first round's job only (bench/scale.py)
        rows = time_rows(llm, job["context"], tuple(job["rows"]), job["row_repeats"], job["row_inner"],
                         job["row_warmup"])
        out["rows"] = {"decode_ms": rows["decode_ms"], "ratio": rows["ratio"], "threads": rows["threads"]}
    return out | memory()


class _LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: one context holding `seqs` sequences, greedy decoding
    of a batch by argmax over each row's logits (llama.cpp's own sampler chain is not involved)."""

    def __init__(self, path: str, threads: int, seqs: int, per_seq: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        p = lc.llama_context_default_params()
        p.n_seq_max, p.n_ctx = seqs, seqs * -(-per_seq // 256) * 256  # llama.cpp pads each sequence's cells to 256
        p.n_batch = p.n_ubatch = 512
        p.n_threads = p.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise ValueError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(512, 0, seqs)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows (token, position, sequence, wants logits) in chunks of 512 -> argmax of each wanted row."""
        import numpy as np

        lc, b, picks = self.lc, self.batch, []
        for lo in range(0, len(rows), 512):
            chunk = rows[lo:lo + 512]
            b.n_tokens = len(chunk)
            for i, (tok, pos, seq, want) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
                b.seq_id[i][0] = seq
            if lc.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, _, want) in enumerate(chunk):
                if want:
                    picks.append(int(np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i),
                                                           shape=(self.n_vocab,)).argmax()))
        return picks

    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, float, list[list[int]]]:
        """(prefill seconds, seconds of the n - 1 decode steps after it, tokens) for the batch."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        last = self._decode([(tok, pos, s, pos == len(p) - 1)
                             for s, p in enumerate(prompts) for pos, tok in enumerate(p)])
        t1 = time.perf_counter()
        out = [[t] for t in last]
        for step in range(n - 1):
            last = self._decode([(last[s], len(p) + step, s, True) for s, p in enumerate(prompts)])
            for s, t in enumerate(last):
                out[s].append(t)
        return t1 - t0, time.perf_counter() - t1, out

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def _llama_cpp_isa(info: str) -> str:
    """The vector extensions llama.cpp was built with, from its system info ("CPU : AVX2 = 1 | ...")."""
    names = [x.split("=")[0].strip().rpartition(" ")[2] for x in info.split("|") if x.strip().endswith("= 1")]
    return ",".join(n for n in names if n.startswith(("AVX", "AMX"))) or info.strip()


def llama_cpp(job: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp as lc

    t0 = time.perf_counter()
    m = _LlamaCpp(job["gguf"], job["threads"], max(job["batch_sizes"]), job["max_len"])
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "load_rss_gb": memory()["rss_gb"],
                           "isa": _llama_cpp_isa(lc.llama_print_system_info().decode()),
                           "decode": {}}
    n, vocab = job["output_len"], job["vocab"]
    for b in job["batch_sizes"]:
        prompts = _prompts(b, job["prompt_len"], vocab, job["seed"])
        m.generate(prompts, min(n, 8))  # warm-up
        out["decode"][b] = statistics.median(b * (n - 1) / max(m.generate(prompts, n)[1], 1e-9)
                                             for _ in range(job["repeats"]))
    long = _prompts(1, job["prefill_len"], vocab, job["seed"] + 1)
    m.generate(long, 1)
    out["prefill"] = job["prefill_len"] / statistics.median(m.generate(long, 1)[0] for _ in range(job["repeats"]))
    out["tokens"] = m.generate(_prompts(1, job["prompt_len"], vocab, job["seed"]), 8)[2][0]
    out |= memory()
    m.close()
    return out


def _level_hooks(proposer, mark) -> None:
    """Call mark() as each draft level after the first starts and as the last one ends: the proposer's level
    objects (speculative/eagle3_proposer.py's _KernelLevels on the head kernel, _TorchLevels on the torch
    head) where it has them, else at the head's logits calls (one a level). The bench's own instrumentation
    of another module's internals: where neither exists, levels are not split (the draft's total stays)."""
    import sys

    module = sys.modules[type(proposer).__module__]
    classes = [getattr(module, n) for n in ("_KernelLevels", "_TorchLevels") if hasattr(module, n)]
    for cls in classes:
        real = cls.step

        def step(self, *args, _real=real, **kwargs):
            mark()
            out = _real(self, *args, **kwargs)
            mark(last=True)
            return out
        cls.step = step
    if not classes:
        real_logits = proposer.head.logits

        def logits(*args, **kwargs):
            out = real_logits(*args, **kwargs)
            mark()
            return out
        proposer.head.logits = logits


def spec(job: dict[str, Any]) -> dict[str, Any]:
    """One request at a time through a static EAGLE-3 tree (the random head's drafts are all rejected, so
    every step drafts the whole tree and verifies all its rows): each step's draft split by level
    (_level_hooks; level 1 also catches the head up on the tokens the last step committed), and the step's
    rest; steps that caught up on a whole prompt are left out."""
    from augury.bench.rows import time_rows

    steps, topk, nodes = job["shape"]
    llm = _augury_llm(job, speculative_algorithm="eagle3", draft_model=job["head"], speculative_policy="static",
                      speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes,
                      speculative_ngram_branch=0, speculative_suffix_cache_tokens=0)
    speculator = llm.engine.speculator
    proposer = speculator.proposer
    marks: list[float] = []  # a level's start (its end for the last level; the logits' return in the fallback)
    records: list[dict[str, Any]] = []

    def mark(last: bool = False) -> None:
        now = time.perf_counter()
        if last:  # the end of a level hook: kept only as the last level's end (overwritten by the next start)
            marks.append(-now)
            return
        if marks and marks[-1] < 0:
            marks.pop()
        marks.append(now)

    def timed_propose(real):
        def propose(host, reqs, shape):
            marks.clear()
            t0 = time.perf_counter()
            tree = real(host, reqs, shape)
            end = time.perf_counter()
            points = [t0, *(abs(m) for m in marks)]
            levels = [b - a for a, b in zip(points, points[1:])] if steps > 1 else [end - t0]
            records[-1]["levels"] = levels if len(levels) == steps else None
            records[-1]["draft"] = end - t0
            return tree
        return propose

    def timed_step(real):
        def step(host, reqs):
            catching_up = any(r.num_computed - r.draft_len > 1 + nodes for r in reqs)
            records.append({"first": catching_up})
            t0 = time.perf_counter()
            done = real(host, reqs)
            records[-1]["step"] = time.perf_counter() - t0
            return done
        return step

    _level_hooks(proposer, mark)
    proposer.propose = timed_propose(proposer.propose)
    speculator.step = timed_step(speculator.step)
    prompts = _prompts(1, job["prompt_len"], job["vocab"], job["seed"])
    _generate(llm, prompts, 8)  # warm-up
    records.clear()
    for _ in range(job["repeats"]):
        _generate(llm, prompts, job["output_len"])
    kept = [r for r in records if not r["first"] and "draft" in r]
    if not kept:
        raise RuntimeError("no speculative step was timed")
    split = [r["levels"] for r in kept if r["levels"] is not None]
    rows = time_rows(llm, job["context"], (1, nodes + 1), job["row_repeats"], job["row_inner"], job["row_warmup"])

    def med(values):
        return statistics.median(values) * 1e3

    return {"shape": [steps, topk, nodes], "steps_timed": len(kept), "decode_ms": rows["decode_ms"],
            "verify_rows_ratio": rows["ratio"][nodes + 1],
            "levels_ms": [med([lv[i] for lv in split]) for i in range(steps)] if split else None,
            "draft_ms": med([r["draft"] for r in kept]),
            "rest_ms": med([r["step"] - r["draft"] for r in kept]),
            "step_ms": med([r["step"] for r in kept])} | memory()


JOBS = {"convert": convert, "augury": augury, "llama.cpp": llama_cpp, "spec": spec}


def main(start_env: dict[str, str], kind: str, job_json: str) -> None:
    """Run one job (started by BOOT) and print its JSON as the last line of stdout."""
    if kind == "llama.cpp":  # undo whatever importing augury did to the environment, before llama.cpp reads it
        for key in set(os.environ) - set(start_env):
            del os.environ[key]
        os.environ.update(start_env)
    result = JOBS[kind](json.loads(job_json))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
