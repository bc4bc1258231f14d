"""What a verification step costs against a decode step, per ISA level: `python -m augury.bench.rows`.

A verification step runs the target over a request's draft tree: R rows at once (each node of the
tree), attention over the context plus the node's ancestors, logits for every row. A decode step
runs one row. Speculation pays when the tokens a verification accepts outnumber its cost in decode
steps, so this ratio, per row count, is what the policy weighs (speculative/adaptive.py).

Each ISA level runs in a process of its own (AUGURY_CPU_ISA=level: the kernels built for that
level; levels the CPU lacks are skipped), loads the demo target as `LLM("demo")` does, and times
the target's forward plus its output layer on a chain of R nodes after a context of C tokens
(the cache's values do not change the cost, whether its pages were ever written does: every slot
read is written first), against a decode step at the same context, paired:
each repeat times every row count once, in alternating order, and the ratio is the median over
repeats of (R rows) / (1 row) of the same repeat; each level runs in --processes processes (the
levels' order alternating between rounds), and the table gives the median over them, since on a
shared machine one process's figures can sit well off the next one's (2026-12-04, Zen 4 EPYC, 8
rows at avx512_bf16: 1.61x to 2.18x between processes minutes apart). Threads: torch's default
unless --threads; the fused stack's thread choice (cpu/threads.py) first settles over --warmup
steps per row count (its first calls try every count, 1 thread included), and its later tries stay
in the timings (they are part of what a step costs): `trials` in the JSON counts them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROWS = (1, 2, 4, 8, 16)


def _worker(context: int, rows: tuple[int, ...], repeats: int, inner: int, warmup: int) -> dict:
    from augury import LLM

    return time_rows(LLM("demo", speculative_algorithm="none", log_stats_interval=0), context, rows, repeats, inner,
                     warmup)


def time_rows(llm, context: int, rows: tuple[int, ...], repeats: int, inner: int, warmup: int) -> dict:
    """The table's figures for one loaded LLM (its KV cache must hold context + max(rows) tokens): decode
    step milliseconds and, per row count, the paired median of (R rows) / (1 row)."""
    import torch

    from augury import cpu
    from augury.cpu import threads as cpu_threads

    engine = llm.engine
    model, attention, bs = engine.model, engine.attention, engine.allocator.block_size
    need = -(-(context + max(rows)) // bs)
    table = list(range(1, 1 + need))  # free blocks at start-up (block 0 is never handed out)
    # the slots the steps read, written first: a page of the lazily taken cache (core/kv_cache.lazy_zeros)
    # that was never written reads the kernel's shared zero page, as no real request's context does (a
    # demo decode step after 1,445 tokens: 2.0-2.2 ms over such pages, 4.0 ms over written ones; Zen 5
    # EPYC, 2 threads), so the table understated the rows' attention at long contexts
    span = slice(bs, (1 + need) * bs)
    for cache in (engine.kv.k, engine.kv.v):
        cache[:, span].copy_(0.5 * torch.randn(cache[:, span].shape))

    def step(r: int):
        parents = (torch.arange(r) - 1)[None]
        attn = attention.prepare_tree([table], [context], parents)
        ids = torch.ones(1, r, dtype=torch.long)
        pos = (context + torch.arange(r))[None]
        with torch.inference_mode():
            h, _ = model(ids, pos, attn, ())
            model.logits(h[0])

    times: dict[int, list[float]] = {r: [] for r in rows}
    for w in range(max(warmup, 1)):  # until the thread choice has measured every count of every bucket
        for r in rows if w % 2 == 0 else rows[::-1]:
            step(r)
    trials = cpu_threads.trials()
    for rep in range(repeats):
        for r in rows if rep % 2 == 0 else rows[::-1]:
            t0 = time.perf_counter()
            for _ in range(inner):
                step(r)
            times[r].append((time.perf_counter() - t0) / inner)
    status = cpu.status()
    return {"isa": status["kernels_isa"], "host_isa": status["host_isa"], "threads": torch.get_num_threads(),
            "decode_ms": statistics.median(times[1]) * 1e3, "trials": cpu_threads.trials() - trials,
            "chosen_threads": {r: cpu_threads.choice().best(r) for r in rows},
            "ratio": {r: statistics.median(t / d for t, d in zip(times[r], times[1])) for r in rows}}


def host_levels(spec: str | None) -> list[str]:
    """The ISA levels asked for (comma-separated; default every level this CPU runs), those the CPU
    cannot run said on stderr and dropped."""
    from augury.cpu import isa

    levels = spec.split(",") if spec else [lv for lv in isa.LEVELS if isa.allowed_on_host(lv)]
    for lv in [lv for lv in levels if not isa.allowed_on_host(lv)]:
        print(f"{lv}: not on this CPU, skipped", file=sys.stderr)
    return [lv for lv in levels if isa.allowed_on_host(lv)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m augury.bench.rows", description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=200, help="tokens in the cache before the rows (default 200)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts (default 1,2,4,8,16)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=5, help="steps per timing")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps per row count first (default 20)")
    ap.add_argument("--isa", default=None, help="levels to measure, comma-separated (default: every level this CPU runs)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--processes", type=int, default=3,
                    help="worker processes a level (default 3): a process's figures can sit well off another's")
    ap.add_argument("--json", default=None, help="write every process's figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    rows = tuple(sorted({1, *map(int, args.rows.split(","))}))
    if args.worker:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(_worker(args.context, rows, args.repeats, args.inner, args.warmup)), flush=True)
        return
    levels = host_levels(args.isa)
    runs: dict[str, list[dict]] = {lv: [] for lv in levels}
    processes = max(args.processes, 1)
    for p in range(processes):  # the levels' order alternates between rounds
        for lv in levels if p % 2 == 0 else levels[::-1]:
            env = dict(os.environ, AUGURY_CPU_ISA=lv)
            cmd = [sys.executable, "-m", "augury.bench.rows", "--worker", "--context", str(args.context),
                   "--rows", ",".join(map(str, rows)), "--repeats", str(args.repeats), "--inner", str(args.inner),
                   "--warmup", str(args.warmup)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[lv].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"target forward + logits, R rows (a chain) after {args.context} tokens, / one decode step "
          f"(paired medians of {args.repeats} in each process; the median over {processes} processes a level, "
          f"their range in brackets)")
    print("| ISA level | threads | decode step ms | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|---|---|" + "---|" * len(rows))
    for lv, res in runs.items():
        if not res:
            continue
        cells = []
        for r in rows:
            each = [x["ratio"][str(r)] for x in res]
            cells.append(f"{statistics.median(each):.2f}x" + (f" ({min(each):.2f}-{max(each):.2f})" if r > 1 and len(res) > 1 else ""))
        print(f"| {res[0]['isa']} | {res[0]['threads']} | {statistics.median(x['decode_ms'] for x in res):.2f} | "
              + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
