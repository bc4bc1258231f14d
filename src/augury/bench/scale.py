"""`augury bench --workload scale`: augury and llama.cpp on random-weight GGUFs of real model shapes.

For each size (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B: bench/scale_gguf.py's SHAPES) and file type
(Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0 with llama.cpp's mix of tensor types), a file of random blocks is
written into --work-dir (or reused: one name per size, type, vocabulary, seed and writer version) and
each system runs it in a process of its own with the same threads (bench/scale_worker.py), --rounds
times in alternating order (a figure is the median over rounds, a ratio the median of the rounds'
paired ratios: one process's figures swing by +-20% on a shared machine): load time,
RSS after loading and at the end (peak), decode tokens a second at each batch size, prefill tokens a
second of one --prefill-len prompt; for augury also its one-time conversion (seconds, peak RSS) and first
load (which packs the kernels' layouts and keeps them: the rounds time later starts), and the
rows-per-verification-step table (a chain of R rows through the target and its output layer after
--context tokens, over one row: what verifying a draft costs where decoding is bound by memory). At the
--spec-sizes a random EAGLE-3 head of the target's shape (draft vocabulary 32000, the SGLang/vLLM
layout) drafts a static tree every step: each draft level, the draft, the rest of the step (the
target over the tree's rows, acceptance, commit) and the whole step as multiples of a decode step.
The weights are random, so the outputs mean nothing (EOS is ignored) and every draft is rejected.

Results go to --out/scale.json after every job (a run cut short keeps what it measured); the tables
are printed at the end. --delete removes each file and augury's conversion of it once measured.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from augury.bench import int_list
from augury.bench.scale_gguf import (DRAFT_VOCAB, FILE_TYPES, LLAMA3_VOCAB, SHAPES, ensure_gguf, file_bytes,
                                     write_eagle3_head)

PROG = "augury bench --workload scale"
SYSTEMS = ("augury", "llama.cpp")
# the peak RSS of augury's one-time GGUF conversion and first load, bytes a parameter, at most: it writes
# tensor by tensor (2026-12-05, 128k vocabulary: 1B Q8_0 2.07 GB for 1.24B parameters, 3B Q4_K_M 2.84,
# Q6_K 3.46 and Q8_0 4.18 GB for 3.21B)
PEAK_BYTES_PER_PARAM = 1.7


def _list(known) -> Any:
    def parse(text: str) -> list[str]:
        items = [x.strip().lower() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in known]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(known)}, got {text!r}")
        return items
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_list(SHAPES), default=["1b", "3b", "8b"],
                   help=f"model shapes, comma-separated (default 1b,3b,8b; known: {', '.join(SHAPES)})")
    p.add_argument("--types", type=_list(FILE_TYPES), default=["q4_0", "q4_k_m"],
                   help=f"file types (default q4_0,q4_k_m; known: {', '.join(FILE_TYPES)})")
    p.add_argument("--systems", type=_list(SYSTEMS), default=list(SYSTEMS), help="default augury,llama.cpp")
    p.add_argument("--work-dir", default="bench_out/scale/files", help="where the GGUF files and heads are written "
                   "and reused (an 8B Q8_0 file is 8.5 GB; augury's conversion of it sits in its cache)")
    p.add_argument("--delete", action="store_true", help="remove each GGUF file and augury's conversion of it "
                   "once measured")
    p.add_argument("--out", default="bench_out/scale", help="folder for scale.json")
    p.add_argument("--vocab", type=int, default=LLAMA3_VOCAB, help=f"vocabulary size (default {LLAMA3_VOCAB}, "
                   "Llama 3's; e.g. 49152 for a smaller output layer)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts (default 0)")
    p.add_argument("--threads", type=int, default=None, help="threads of every system (default: the CPU count)")
    p.add_argument("--batch-sizes", type=int_list, default=(1, 8), help="decode batch sizes (default 1,8)")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens of each decode prompt (default 16)")
    p.add_argument("--output-len", type=int, default=64, help="tokens each decode run generates (default 64)")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the prefill prompt (default 512)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each figure in a job (median; default 2)")
    p.add_argument("--rounds", type=int, default=3, help="jobs of each system per file, the systems' order alternating "
                   "between rounds; figures are medians over rounds, ratios the median of each round's pair "
                   "(default 3)")
    p.add_argument("--rows", type=int_list, default=(1, 2, 4, 8, 16), help="row counts of the verification table")
    p.add_argument("--context", type=int, default=512, help="tokens before the verified rows (default 512)")
    p.add_argument("--row-repeats", type=int, default=5, help="paired repeats of the rows table (default 5)")
    p.add_argument("--spec-sizes", type=_list((*SHAPES, "none")), default=["8b"],
                   help="sizes whose speculative step is timed with a random EAGLE-3 head (default 8b; none: no head)")
    p.add_argument("--spec-shape", default="3-4-8", help="the head's static tree, STEPS-TOPK-TOKENS (default 3-4-8)")
    p.add_argument("--job-timeout", type=float, default=3600.0, help="seconds a job may take (default 3600)")
    p.add_argument("--debug", action="store_true", help="tracebacks with errors")
    return p


def _mem_available_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return None


def run_job(kind: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One job of bench/scale_worker.py in a fresh interpreter with the user's environment (a peer's without
    AUGURY_*); its JSON, or {"error": its last lines}."""
    import augury
    from augury.bench.worker import user_environment, worker_environment

    src = str(Path(augury.__file__).resolve().parents[1])
    from augury.bench.scale_worker import BOOT

    env = worker_environment(kind, user_environment())
    try:
        done = subprocess.run([sys.executable, "-c", BOOT, src, kind, json.dumps(job)], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{kind}: no answer after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join((done.stderr or "").strip().splitlines()[-6:])
        return {"error": f"{kind}: exit status {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def _job(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    from augury.bench import SystemSettings, _kv_blocks_for

    max_len = max(args.prompt_len + args.output_len, args.prefill_len + 1, args.context + max(args.rows)) + 8
    blocks = _kv_blocks_for(SystemSettings(model=str(path), dtype="bfloat16", device="cpu",
                                           max_batch_size=max(args.batch_sizes), max_len=max_len))
    return {"gguf": str(path), "threads": args.threads or os.cpu_count() or 1, "batch_sizes": args.batch_sizes,
            "prompt_len": args.prompt_len, "output_len": args.output_len, "prefill_len": args.prefill_len,
            "repeats": args.repeats, "rows": sorted({1, *args.rows}), "context": args.context,
            "row_repeats": args.row_repeats, "row_inner": 3, "row_warmup": 20, "seed": args.seed, "vocab": args.vocab,
            "max_len": max_len, "kv_blocks": blocks}


def bench_scale(args: argparse.Namespace, say=print) -> dict[str, Any]:
    from augury.resolve import gguf_cache_dir

    try:
        shape = tuple(int(x) for x in args.spec_shape.split("-"))
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"--spec-shape must be STEPS-TOPK-TOKENS, e.g. 3-4-8, got {args.spec_shape!r}") from None
    for name in ("prompt_len", "output_len", "prefill_len", "repeats", "context", "row_repeats", "vocab"):
        least = 2 if name == "output_len" else 1
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {least}")
    work, out = Path(args.work_dir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "debug"}, "runs": []}

    def save() -> None:
        (out / "scale.json").write_text(json.dumps(report, indent=1) + "\n")

    for size in args.sizes:
        for ftype in args.types:
            run: dict[str, Any] = {"size": size, "type": ftype, "file_gb": file_bytes(size, ftype, args.vocab) / 1e9}
            report["runs"].append(run)
            avail, need = _mem_available_gb(), PEAK_BYTES_PER_PARAM * sum(_params(size, args.vocab)) / 1e9
            if "augury" in args.systems and avail is not None and need > avail:
                say(f"note: augury's conversion of the file may need ~{need:.0f} GB at its peak; "
                    f"{avail:.1f} GB of memory is available")
            t0 = time.perf_counter()
            path, written = ensure_gguf(work, size, ftype, args.vocab, args.seed)
            run["write_s"] = time.perf_counter() - t0 if written else None
            say(f"{size} {ftype}: {path} ({'written in %.1f s' % run['write_s'] if written else 'reused'})")
            job = _job(args, path)
            systems = [s for s in SYSTEMS if s in args.systems]
            if "augury" in systems:
                run["convert"] = run_job("convert", job, args.job_timeout)
                say(f"  augury conversion: {_brief(run['convert'])}")
                if "error" in run["convert"]:
                    systems.remove("augury")
                save()
            run["rounds"] = {s: [] for s in systems}
            for rnd in range(args.rounds):  # a shared machine's load drifts: each round pairs the systems
                for system in systems if rnd % 2 == 0 else systems[::-1]:
                    r = run_job(system, job | {"time_rows": rnd == 0}, args.job_timeout)
                    run["rounds"][system].append(r)
                    say(f"  {system} (round {rnd + 1}): {_brief(r)}")
                    save()
            for system in systems:
                run[system] = summarise_rounds(run["rounds"][system])
            run["ratios"] = paired_ratios(run["rounds"])
            save()
            if size in args.spec_sizes and "augury" in args.systems and "error" not in run.get("convert", {}):
                head = write_eagle3_head(work / f"eagle3-head-{size}-v{args.vocab}-s{args.seed}", SHAPES[size],
                                         args.vocab, min(DRAFT_VOCAB, args.vocab // 2), args.seed)
                run["spec"] = run_job("spec", job | {"head": str(head), "shape": list(shape)}, args.job_timeout)
                say(f"  augury + EAGLE-3 head {args.spec_shape}: {_brief(run['spec'])}")
                save()
            if args.delete:
                shutil.rmtree(gguf_cache_dir(path), ignore_errors=True)
                path.unlink(missing_ok=True)
    return report


_FIGURES = ("load_s", "load_rss_gb", "peak_rss_gb", "prefill")


def summarise_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's rounds as one result: each figure's median over the rounds that ran (decode per batch
    size), the rows table and the ISA from the first; an error where no round ran."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"error": rounds[0]["error"] if rounds else "no round ran"}
    out = {k: v for k, v in ok[0].items() if k not in (*_FIGURES, "decode")}
    out.update({k: statistics.median(r[k] for r in ok) for k in _FIGURES if all(k in r for r in ok)})
    out["decode"] = {b: statistics.median(r["decode"][b] for r in ok) for b in ok[0]["decode"]}
    out["rounds_run"] = len(ok)
    return out


def paired_ratios(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """augury over llama.cpp, per figure the median over the rounds both ran of that round's ratio (load
    time as a difference in seconds, augury's less llama.cpp's)."""
    pairs = [(a, b) for a, b in zip(rounds.get("augury", []), rounds.get("llama.cpp", []))
             if "error" not in a and "error" not in b]
    if not pairs:
        return None
    out: dict[str, Any] = {"rounds": len(pairs), "decode": {b: statistics.median(a["decode"][b] / p["decode"][b]
                                                             for a, p in pairs) for b in pairs[0][0]["decode"]}}
    for k in ("prefill", "load_rss_gb", "peak_rss_gb"):
        out[k] = statistics.median(a[k] / p[k] for a, p in pairs)
    out["load_s_more"] = statistics.median(a["load_s"] - p["load_s"] for a, p in pairs)
    return out


def _params(size: str, vocab: int) -> tuple[int, int]:
    """(parameters of the layers, of the embedding and output layer)."""
    s = SHAPES[size]
    layer = s.hidden * (s.q_rows + 2 * s.kv_rows) + s.q_rows * s.hidden + 3 * s.hidden * s.ffn
    return s.layers * layer, vocab * s.hidden * (1 if s.tied else 2)


def _brief(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"FAILED ({r['error']})"
    keys = ("convert_s", "first_load_s", "load_s", "peak_rss_gb", "decode", "prefill", "step_ms", "decode_ms")
    return ", ".join(f"{k} {_fmt(r[k])}" for k in keys if k in r)


def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def format_tables(report: dict[str, Any]) -> str:
    s = report["settings"]
    bs = s["batch_sizes"]
    lines = [f"decode tokens/s (B sequences, {s['output_len']} tokens after {s['prompt_len']}), prefill tokens/s "
             f"({s['prefill_len']} tokens, one prompt), load seconds, RSS GB after loading / peak; "
             f"{s['threads'] or os.cpu_count()} threads each",
             "| size | type | file GB | system | ISA | load s | RSS GB | " + " | ".join(f"decode B={b}" for b in bs)
             + f" | prefill {s['prefill_len']} |",
             "|---|---|---|---|---|---|---|" + "---|" * len(bs) + "---|"]
    for run in report["runs"]:
        for system in SYSTEMS:
            r = run.get(system)
            if r is None:
                continue
            head = f"| {run['size']} | {run['type']} | {run['file_gb']:.2f} | {system} |"
            if "error" in r:
                lines.append(f"{head} failed: {r['error'][:120]} |")
                continue
            cv = run.get("convert", {})
            extra = f" (conversion {cv['convert_s']:.0f} s, peak {cv['peak_rss_gb']:.1f} GB; first load " \
                f"{cv.get('first_load_s', float('nan')):.1f} s)" if system == "augury" and "convert_s" in cv else ""
            rss = f"{r['load_rss_gb']:.2f} / {r['peak_rss_gb']:.2f}"
            lines.append(f"{head} {r['isa']} | {r['load_s']:.1f}{extra} | {rss} | "
                         + " | ".join(f"{r['decode'][str(b)]:.1f}" for b in bs) + f" | {r['prefill']:.1f} |")
    lines += ["", "augury / llama.cpp: per figure the median over rounds of that round's ratio (load: augury's "
              "seconds less llama.cpp's)",
              "| size | type | rounds | " + " | ".join(f"decode B={b}" for b in bs)
              + f" | prefill {s['prefill_len']} | RSS after load | peak RSS | load s more |",
              "|---|---|---|" + "---|" * len(bs) + "---|---|---|---|"]
    for run in report["runs"]:
        q = run.get("ratios")
        if q:
            lines.append(f"| {run['size']} | {run['type']} | {q['rounds']} | "
                         + " | ".join(f"{q['decode'][str(b)]:.2f}x" for b in bs)
                         + f" | {q['prefill']:.2f}x | {q['load_rss_gb']:.2f}x | {q['peak_rss_gb']:.2f}x | "
                         f"{q['load_s_more']:+.1f} |")
    rows = sorted({1, *s["rows"]})
    lines += ["", f"augury: target forward + output layer over R rows (a chain) after {s['context']} tokens, / one row",
              "| size | type | decode step ms | " + " | ".join(f"{r} rows" for r in rows) + " |",
              "|---|---|---|" + "---|" * len(rows)]
    for run in report["runs"]:
        r = run.get("augury")
        if r and "rows" in r:
            ratio = {int(k): v for k, v in r["rows"]["ratio"].items()}
            lines.append(f"| {run['size']} | {run['type']} | {r['rows']['decode_ms']:.1f} | "
                         + " | ".join(f"{ratio[n]:.2f}x" for n in rows) + " |")
    specs = [run for run in report["runs"] if "spec" in run]
    if specs:
        lines += ["", f"augury + random EAGLE-3 head, static tree {s['spec_shape']} (steps-topk-tokens), batch 1: "
                  "milliseconds and multiples of a decode step (one row through the target and its output layer)",
                  "| size | type | decode step ms | draft levels | draft | rest of the step | step | target over "
                  "the tree's rows |", "|---|---|---|---|---|---|---|---|"]
        for run in specs:
            r = run["spec"]
            if "error" in r:
                lines.append(f"| {run['size']} | {run['type']} | failed: {r['error'][:120]} |||||")
                continue
            d = r["decode_ms"]
            levels = ", ".join(f"{x:.1f} ({x / d:.2f}x)" for x in r["levels_ms"]) if r["levels_ms"] else "not split"
            parts = " | ".join(f"{r[k]:.1f} ({r[k] / d:.2f}x)" for k in ("draft_ms", "rest_ms", "step_ms"))
            lines.append(f"| {run['size']} | {run['type']} | {d:.1f} | {levels} | {parts} | "
                         f"{r['verify_rows_ratio']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point (augury bench --workload scale, flags of its own); errors are one line, status 2."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        report = bench_scale(args, say=lambda line: print(line, flush=True))
    except Exception as exc:
        if args.debug:
            raise
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    print(format_tables(report))
    print(f"wrote {Path(args.out) / 'scale.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
