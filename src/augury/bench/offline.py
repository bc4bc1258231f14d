"""`augury bench`: offline greedy throughput of named systems, side by side in one run.

For each batch size, every system generates exactly --output-len tokens (EOS ignored) for the
same --batch-size prompts of --prompt-len random token ids, in the same dtype and device; with
--prompts chat, one run goes through --num-prompts held-out chat prompts in batches of the
batch size (so batch 1 is an average over prompts, not one prompt's luck). With --stop-at-eos
each sequence ends at its end-of-sequence token instead (at most --output-len), as a chat user
sees it, and every system is measured in the tokens it generated per second.
After warm-up, the systems take turns (order alternating per repeat, so slow drift in a
shared machine's load hits all of them alike); the median of the repeats is reported as
output tokens per second, with the ratio to the reference system (the first one), each
repeat's own ratio (the two systems ran back to back in that repeat: "paired"), their median
and spread, and how many greedy sequences equal the reference's. Beside these end-to-end figures,
which include every prompt's prefill, each system that notes when its first tokens came (augury,
transformers, llama.cpp) gets a decode-only rate: tokens after each sequence's first over the time
after each group's last first token (worker.run_groups), its paired median ratio to the reference's,
and the median share of a run's time spent up to first tokens (prefill %): long prompts, the same
work in every system, dilute the end-to-end ratio of what speculation changes. Process CPU time is
recorded beside wall-clock time: on a machine shared with other work it is the steadier of the two
(use --threads 1). A table is printed; JSON and a PNG plot are written into --out.

Every system runs in a worker process of its own (bench/worker.py), started with the user's
environment (a peer such as llama.cpp or transformers without augury's AUGURY_* variables and
without the OMP_WAIT_POLICY augury's import sets), loaded once and driven by this process; each
run is timed inside its worker (wall-clock and the worker's CPU time). The table and JSON name
each system's process id, thread count, the CPU's ISA level, the level augury's kernels run at and
OMP_WAIT_POLICY as the worker saw it.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from augury.bench import (SHAPED, SYSTEMS, System, SystemSettings, count_parameters, int_list, make_prompts,
                          random_llama, system_factory)
from augury.bench.json_prompts import JSON_OUTPUT_LEN
from augury.bench.workloads import WORKLOADS
from augury.config import OPTION, add_flags, one_line

PROG = "augury bench"


@dataclass(frozen=True)
class BenchSettings:
    model: str = "random"
    dtype: str = "auto"  # as LLM resolves it for the model (the demo: bfloat16), one for every system
    device: str = "cpu"
    batch_sizes: tuple[int, ...] = (1, 8)
    prompt_len: int = 32
    output_len: int = 64
    repeats: int = 3
    warmup: int = 1
    systems: tuple[str, ...] = ("transformers", "augury")
    # random token ids, "chat": held-out chat prompts through the chat template, "varied": the varied
    # held-out set (prompts.VARIED_PROMPTS, acceptance also reported per kind), "mixed", or "json" (answers
    # constrained to a JSON schema each: bench/json_prompts.py), or a workload speculation is used for
    # (code_edit, agentic, summarise, extract: bench/workloads.py)
    prompts: str = "random"
    num_prompts: int = 8  # chat prompts per run (batches of the batch size; a larger batch cycles them)
    # code_edit / agentic: "cold" times each conversation's whole prompt; "warm" prefills its earlier
    # turns untimed first (bench/workloads.py), as a live session leaves them in the prefix cache
    history: str = "cold"
    temperature: float = 0.0  # 0 = greedy (the default); >0 samples (seeded), greedy-match is then moot
    top_p: float = 1.0  # with temperature > 0: the nucleus every system keeps (1: none)
    stop_at_eos: bool = False  # end each sequence at its EOS token (at most output_len) instead of a fixed length
    draft_model: str | None = None
    out: str = "bench_out/offline"
    seed: int = 0
    threads: int | None = None
    random_config: dict[str, Any] = field(default_factory=dict)
    quantization: str = "auto"
    gguf: str | None = None  # GGUF file for the llama.cpp system (default: the model's own, when it is one)
    tensor_parallel_size: int = 1  # augury systems' tensor-parallel ranks (a system's @tpN overrides it)
    processes: int = 1  # worker processes per system; repeat r runs in process r % processes (worker.WorkerPool)


@dataclass
class Row:
    system: str
    batch_size: int
    seconds: list[float]  # wall-clock, one per repeat
    cpu_seconds: list[float]  # the system's process's CPU time, one per repeat (steadier on a shared machine)
    output_tokens: int  # per repeat: batch_size * output_len, or what was generated with stop_at_eos
    ratio: float = 1.0  # tokens/s over the reference system's (wall-clock medians)
    # each repeat's tokens/s over the reference's in the same repeat (the two ran back to back, order
    # alternating), so a noisy machine shows as their spread
    paired_ratios: list[float] = field(default_factory=list)
    cpu_ratio: float = 1.0  # the same with CPU-time medians
    greedy_match: float = 1.0  # fraction of sequences equal to the reference's
    accept_length: float = 0.0  # speculative systems: tokens per verification step
    accept_by_kind: dict[str, float] = field(default_factory=dict)  # --prompts varied: the same per kind
    spec_fraction: float = 0.0  # speculative systems: share of decoded tokens that came from verification
    # augury under a grammar (--prompts json): share of its timed wall time spent filling and applying masks
    mask_share: float = 0.0
    # --stop-at-eos: sequences (of the first timed repeat) that reached --output-len, their answers cut short
    cut: int = 0
    sequences: int = 0
    # per repeat, summed over its groups (worker.run_groups): seconds from each group's start to its last
    # first token (prefill and first tokens) and from there to its end; None for a system that did not say
    # when its first tokens came (a registered system without first_token_times): no decode-only figures
    first_token_seconds: list[float] | None = None
    decode_seconds: list[float] | None = None
    decode_tokens: int = 0  # output_tokens less each sequence's first
    decode_paired_ratios: list[float] = field(default_factory=list)  # as paired_ratios, decode-only rates
    # the process the system ran in (its worker): id, CPU threads (torch's; llama.cpp's n_threads),
    # the CPU's ISA level (cpu.isa.host_level), augury's kernels' level (augury systems) and
    # OMP_WAIT_POLICY as that process saw it (None: unset)
    pid: int | None = None
    threads: int | None = None
    isa: str | None = None
    kernels_isa: str | None = None
    omp_wait_policy: str | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.median_s

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.cpu_seconds)

    @property
    def paired_ratio(self) -> float:
        """Median of the paired ratios: the figure to quote on a shared machine."""
        return statistics.median(self.paired_ratios) if self.paired_ratios else self.ratio

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after each sequence's first per decode-only second (median seconds over the repeats): the
        rate speculation changes, without the prefill; None where unknown (or no sequence went past its first)."""
        if not self.decode_seconds or not self.decode_tokens or min(self.decode_seconds) <= 0:
            return None
        return self.decode_tokens / statistics.median(self.decode_seconds)

    @property
    def decode_paired_ratio(self) -> float | None:
        """Median of the paired decode-only ratios (None where this system or the reference has no such rate)."""
        return statistics.median(self.decode_paired_ratios) if self.decode_paired_ratios else None

    @property
    def prefill_share(self) -> float | None:
        """Median over the repeats of the time to first tokens over the run's wall time (None where unknown)."""
        if self.first_token_seconds is None:
            return None
        return statistics.median(f / s for f, s in zip(self.first_token_seconds, self.seconds))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"median_s": self.median_s, "tokens_per_s": self.tokens_per_s,
                               "median_cpu_s": self.median_cpu_s, "paired_ratio": self.paired_ratio,
                               "decode_tokens_per_s": self.decode_tokens_per_s,
                               "decode_paired_ratio": self.decode_paired_ratio, "prefill_share": self.prefill_share}


def run_benchmark(settings: BenchSettings, systems: list[System], vocab_size: int, progress: bool = True,
                  chat: list[list[int]] | None = None, kinds: list[str] | None = None) -> list[Row]:
    """kinds: each chat prompt's kind (--prompts varied), for acceptance per kind."""
    from tqdm.auto import tqdm

    runs = len(settings.batch_sizes) * len(systems) * (settings.warmup + settings.repeats)
    bar = tqdm(total=runs, desc="bench", unit="run", disable=not progress)
    rows: list[Row] = []
    try:
        all_systems = systems
        for b in settings.batch_sizes:
            systems = [s for s in all_systems if getattr(s, "supports", lambda n: True)(b)]
            if chat:
                n = max(len(chat), 1)
                groups = [[chat[(g * b + i) % n] for i in range(b)] for g in range(max(1, -(-n // b)))]
            else:
                groups = [make_prompts(b, settings.prompt_len, vocab_size, settings.seed)]
            for system in systems:
                for _ in range(settings.warmup):
                    # the whole workload once, untimed (in every process of a pool): the repeats then time
                    # a running system, not its first steps (the first probes of drafting in each batch
                    # bucket, kernels' thread counts; an 8-token warm-up left them to the first repeat:
                    # augury-default's first b16 run 1.98-2.11 s against 1.46-1.58 s after, AMX Xeon)
                    for prompts in groups:
                        system.generate(prompts, settings.output_len, settings.stop_at_eos)
                    bar.update(1)
                getattr(system, "reset_counts", lambda: None)()  # acceptance over the timed runs only
            seconds: dict[str, list[float]] = {s.name: [] for s in systems}
            cpu: dict[str, list[float]] = {s.name: [] for s in systems}
            splits: dict[str, list[tuple[float, float] | None]] = {s.name: [] for s in systems}
            outputs: dict[str, list[list[int]]] = {}
            for r in range(settings.repeats):
                for system in systems if r % 2 == 0 else systems[::-1]:
                    bar.set_postfix_str(f"batch {b} {system.name}")
                    out, wall, cpu_s, split = _timed_run(system, groups, settings.output_len, settings.stop_at_eos)
                    seconds[system.name].append(wall)
                    cpu[system.name].append(cpu_s)
                    splits[system.name].append(split)
                    _check_lengths(system.name, out, settings.output_len, settings.stop_at_eos)
                    outputs.setdefault(system.name, out)
                    bar.update(1)
            new = _rows_for(b, systems, seconds, cpu, outputs, splits)
            if settings.stop_at_eos:
                for row in new:
                    row.cut = sum(len(o) >= settings.output_len for o in outputs[row.system])
                    row.sequences = len(outputs[row.system])
            if chat and kinds:
                by_kind = {k: [p for p, pk in zip(chat, kinds) if pk == k] for k in dict.fromkeys(kinds)}
                for row, system in zip(new, systems):
                    if hasattr(system, "accept_by_kind"):  # a worker: None for a system that counts nothing
                        row.accept_by_kind = system.accept_by_kind(by_kind) or {}
                    elif hasattr(system, "accept_length_of"):
                        row.accept_by_kind = {k: system.accept_length_of(ps) for k, ps in by_kind.items()}
            rows.extend(new)
    finally:
        bar.close()
    return rows


def _timed_run(system: System, groups: list[list[list[int]]], output_len: int,
               stop_at_eos: bool) -> tuple[list[list[int]], float, float, tuple[float, float] | None]:
    """Every group through the system in turn: worker.run_groups' (outputs, wall seconds, CPU seconds,
    (seconds to first tokens, decode-only seconds) or None). A worker times itself (its own CPU time); a
    system in this process is timed here."""
    if hasattr(system, "timed_run"):
        return system.timed_run(groups, output_len, stop_at_eos)
    from augury.bench.worker import run_groups

    return run_groups(system, groups, output_len, stop_at_eos)


def system_info(system: System) -> dict[str, Any]:
    """The process a system runs in (pid, threads, ISA levels, OMP_WAIT_POLICY): its worker's, or
    this process's for a system built here."""
    info = getattr(system, "info", None)
    if info:
        return dict(info)
    import os

    from augury.bench.worker import process_info

    return process_info(system, system.name, os.environ.get("OMP_WAIT_POLICY"))


def _check_lengths(name: str, out: list[list[int]], output_len: int, stop_at_eos: bool) -> None:
    if stop_at_eos:
        if any(not 1 <= len(o) <= output_len for o in out):
            raise RuntimeError(f"{name} generated a sequence outside 1..{output_len} tokens")
    elif any(len(o) != output_len for o in out):
        raise RuntimeError(f"{name} did not generate {output_len} tokens per prompt")


def _rows_for(b: int, systems: list[System], seconds: dict[str, list[float]], cpu: dict[str, list[float]],
              outputs: dict[str, list[list[int]]],
              splits: dict[str, list[tuple[float, float] | None]] | None = None) -> list[Row]:
    """One row per system; ratios are tokens per second over the reference's (the systems may
    generate different numbers of tokens when sequences stop at EOS). splits: per system, each repeat's
    (seconds to first tokens, decode-only seconds), None where the system did not give them."""
    ref = systems[0].name
    rows = [Row(s.name, b, seconds[s.name], cpu[s.name], sum(len(o) for o in outputs[s.name]),
                accept_length=getattr(s, "accept_length", 0.0), spec_fraction=getattr(s, "spec_fraction", 0.0),
                mask_share=getattr(s, "mask_share", 0.0), **system_info(s))
            for s in systems]
    for row in rows:
        parts = (splits or {}).get(row.system) or [None]
        if all(p is not None for p in parts):
            row.first_token_seconds, row.decode_seconds = [p[0] for p in parts], [p[1] for p in parts]
        row.decode_tokens = row.output_tokens - len(outputs[row.system])
    base = rows[0]
    for row in rows:
        if row.decode_tokens_per_s is not None and base.decode_tokens_per_s is not None:
            row.decode_paired_ratios = [(row.decode_tokens / s) / (base.decode_tokens / r)
                                        for s, r in zip(row.decode_seconds, base.decode_seconds)]
        row.ratio = row.tokens_per_s / base.tokens_per_s
        row.paired_ratios = [(row.output_tokens / s) / (base.output_tokens / r) for s, r in zip(row.seconds, base.seconds)]
        row.cpu_ratio = (row.output_tokens / row.median_cpu_s) / (rows[0].output_tokens / rows[0].median_cpu_s)
        row.greedy_match = sum(a == r for a, r in zip(outputs[row.system], outputs[ref])) / len(outputs[ref])
    return rows


def format_table(rows: list[Row]) -> str:
    ref = rows[0].system if rows else ""
    head = (f"{'batch':>5}  {'system':<20} {'tok/s':>8} {'median s':>9} {'min..max s':>15} {'vs ' + ref:>16} "
            f"{'paired':>7} {'paired min..max':>15} {'cpu s':>8} {'cpu ratio':>9} {'greedy =':>9} {'acc len':>8} "
            f"{'spec %':>7} {'dec tok/s':>9} {'dec paired':>10} {'prefill %':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = f"{min(r.seconds):.3f}..{max(r.seconds):.3f}"
        paired = f"{min(r.paired_ratios, default=r.ratio):.2f}..{max(r.paired_ratios, default=r.ratio):.2f}"
        lines.append(f"{r.batch_size:>5}  {r.system:<20} {r.tokens_per_s:>8.1f} {r.median_s:>9.3f} {spread:>15} "
                     f"{r.ratio:>15.2f}x {r.paired_ratio:>6.2f}x {paired:>15} {r.median_cpu_s:>8.3f} "
                     f"{r.cpu_ratio:>8.2f}x {r.greedy_match:>9.0%} {r.accept_length:>8.2f} {r.spec_fraction:>7.0%} "
                     f"{_maybe(r.decode_tokens_per_s, '.1f'):>9} {_maybe(r.decode_paired_ratio, '.2f', 'x'):>10} "
                     f"{_maybe(r.prefill_share, '.0%'):>9}")
    kinds = list(dict.fromkeys(k for r in rows for k in r.accept_by_kind))
    spec = [r for r in rows if any(r.accept_by_kind.values())]
    if kinds and spec:  # acceptance length per prompt kind (--prompts varied)
        width = max(len(k) for k in kinds)
        head = f"{'acceptance length by kind':<{width}}  " + " ".join(f"{f'b{r.batch_size} {r.system}':>24}" for r in spec)
        lines += ["", head, "-" * len(head)]
        for k in kinds:
            lines.append(f"{k:<{width}}  " + " ".join(f"{r.accept_by_kind.get(k, 0.0):>24.2f}" for r in spec))
    cut = [r for r in rows if r.cut]
    if cut:  # answers the length cap ended, not their EOS: a JSON answer cut short is not JSON
        lines += ["", "reached --output-len before their end-of-sequence token (cut short): " +
                  ", ".join(f"b{r.batch_size} {r.system} {r.cut}/{r.sequences}" for r in cut)]
    masked = [r for r in rows if r.mask_share]
    if masked:  # --prompts json: what the grammar masks cost
        lines += ["", "grammar masks, share of the timed wall time: " +
                  ", ".join(f"b{r.batch_size} {r.system} {r.mask_share:.1%}" for r in masked)]
    procs = {r.system: r for r in rows}
    if procs:  # the process each system ran in
        width = max(20, *(len(n) for n in procs))
        head = (f"{'process of':<{width}} {'pid':>8} {'threads':>7} {'cpu isa':>12} {'kernels isa':>12} "
                f"{'OMP_WAIT_POLICY':>15}")
        lines += ["", head, "-" * len(head)]
        for name, r in procs.items():
            lines.append(f"{name:<{width}} {r.pid if r.pid is not None else '-':>8} "
                         f"{r.threads if r.threads is not None else '-':>7} {r.isa or '-':>12} "
                         f"{r.kernels_isa or '-':>12} {r.omp_wait_policy or '(unset)':>15}")
    return "\n".join(lines)


def _maybe(value: float | None, spec: str, suffix: str = "") -> str:
    """A figure for the table, '-' where it is unavailable."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r.batch_size for r in rows})
    names = list(dict.fromkeys(r.system for r in rows))
    by = {(r.system, r.batch_size): r for r in rows}
    fig, (ax_tps, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        have = [j for j, b in enumerate(batches) if (name, b) in by]  # a system may skip batch sizes
        xs = [j + (i - (len(names) - 1) / 2) * width for j in have]
        ax_tps.bar(xs, [by[name, batches[j]].tokens_per_s for j in have], width, label=name)
        ax_ratio.plot(have, [by[name, batches[j]].ratio for j in have], marker="o", label=name)
    for ax in (ax_tps, ax_ratio):
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.legend()
    ax_tps.set_ylabel("output tokens / s (median)")
    ax_ratio.set_ylabel(f"throughput / {names[0]}")
    ax_ratio.axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(settings: BenchSettings) -> dict[str, Any]:
    import os

    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "device": settings.device, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def bench(settings: BenchSettings, progress: bool = True) -> tuple[list[Row], Path]:
    """Run the whole benchmark; returns the rows and the folder holding offline.json/.png."""
    import torch

    from augury.builder import resolve_dtype
    from augury.models.config import TargetConfig

    for name in settings.systems:  # bad names fail before any loading
        system_factory(name)
    from augury.bench.worker import WorkerPool, start_workers, user_environment

    user_env = user_environment()  # as the user started `augury bench`, before it set anything
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the output to our own bar and table
    if settings.threads:
        torch.set_num_threads(settings.threads)
    threads = torch.get_num_threads()  # every system's: --threads, else torch's default here
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    draft = settings.draft_model
    if settings.model == "random":
        folder, params = random_llama(out / "random-llama", settings.random_config, settings.seed)
    else:  # one resolution for every system: they get folders ("demo": its folder and shipped head)
        from augury.config import EngineConfig
        from augury.resolve import resolve

        resolved = resolve(EngineConfig(model=settings.model, draft_model=settings.draft_model))
        folder = resolved.target_dir
        draft = str(resolved.draft_dir) if resolved.draft_dir is not None else None
        params = count_parameters(folder)
    cfg = TargetConfig.from_folder(folder)
    # "auto" as augury's engine resolves it (builder.resolve_dtype): the dtype a user of LLM(model) runs
    # (float32 for the demo would time another path, ~10x slower), given to every system as one concrete dtype
    dtype = str(resolve_dtype(settings.dtype, cfg.torch_dtype, torch.device(settings.device))).removeprefix("torch.")
    chat = kinds = None
    schemas: tuple[tuple[tuple[int, ...], str], ...] = ()
    histories: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    if settings.history not in ("cold", "warm"):
        raise ValueError(f"--history must be cold or warm, got {settings.history!r}")
    if settings.history == "warm":
        if settings.prompts not in WORKLOADS:
            raise ValueError(f"--history warm needs --prompts code_edit or agentic, not {settings.prompts}")
        peers = [s for s in settings.systems if not s.startswith("augury")]
        if peers:
            raise ValueError(f"--history warm prefills earlier turns in augury's systems only; drop {', '.join(peers)}")
    prompt_len = settings.prompt_len
    if settings.prompts == "json":
        from augury.bench.json_prompts import json_chat_prompts
        from augury.models.tokenizer import load_tokenizer

        if not settings.stop_at_eos:
            raise ValueError("--prompts json needs --stop-at-eos (an answer ends where its JSON does)")
        tokenizer = load_tokenizer(Path(folder))
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("--prompts json needs a model with a tokenizer and a chat template")
        chat, texts = json_chat_prompts(tokenizer, settings.num_prompts)
        schemas = tuple((tuple(p), t) for p, t in zip(chat, texts))
        prompt_len = max(len(p) for p in chat)
    if settings.prompts in WORKLOADS:
        from augury.bench.workloads import workload_prompts
        from augury.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(Path(folder))
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"--prompts {settings.prompts} needs a model with a tokenizer and a chat template")
        chat = workload_prompts(tokenizer, settings.prompts, settings.num_prompts, settings.seed)
        prompt_len = max(len(p) for p in chat)
        if settings.history == "warm":
            from augury.bench.workloads import workload_histories

            histories = tuple((tuple(p), tuple(h)) for p, h in zip(
                chat, workload_histories(tokenizer, settings.prompts, settings.num_prompts, settings.seed)) if h)
            if not histories:
                raise ValueError(f"--history warm needs a multi-turn workload (code_edit, agentic), not "
                                 f"{settings.prompts}")
    if settings.prompts in ("chat", "mixed", "varied"):
        from augury.bench import chat_prompts, mixed_prompts, varied_chat_prompts
        from augury.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(Path(folder))
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("--prompts chat needs a model with a tokenizer and a chat template")
        if settings.prompts == "varied":
            chat, kinds = varied_chat_prompts(tokenizer, settings.num_prompts)
        else:
            chat = (chat_prompts if settings.prompts == "chat" else mixed_prompts)(tokenizer, settings.num_prompts)
        prompt_len = max(len(p) for p in chat)
    from augury.bench import _eos_ids

    shared = SystemSettings(str(folder), dtype, settings.device, max(settings.batch_sizes),
                            prompt_len + settings.output_len + 8, draft, settings.temperature,
                            settings.quantization, _gguf_file(settings), threads,
                            tuple(sorted(_eos_ids(folder))), settings.tensor_parallel_size, json_schemas=schemas,
                            histories=histories, top_p=settings.top_p)
    per = settings.processes
    workers = start_workers([n for n in settings.systems for _ in range(per)], shared, user_env)  # loaded
    systems = workers if per == 1 else [WorkerPool(workers[i : i + per]) for i in range(0, len(workers), per)]
    try:
        rows = run_benchmark(settings, systems, cfg.vocab_size, progress, chat, kinds)
        processes = {s.name: system_info(s) for s in systems}
    finally:
        for s in systems:
            s.close()
    model_info = {"path": str(folder), "family": cfg.family, "parameters": params, "layers": cfg.num_layers,
                  "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "dtype": dtype}
    report = {"settings": asdict(settings), "model": model_info, "environment": environment(settings),
              "systems": processes, "results": [r.to_dict() for r in rows]}
    (out / "offline.json").write_text(json.dumps(report, indent=2) + "\n")
    title = (f"{cfg.family} {params / 1e6:.1f}M params, {dtype}, {settings.device}, "
             + (f"{settings.prompts} ({settings.history} history), " if settings.prompts in WORKLOADS else "") +
             f"prompt {settings.prompt_len}, output {settings.output_len}, {threads} threads")
    plot(rows, out / "offline.png", title)
    return rows, out


def _gguf_file(settings: BenchSettings) -> str | None:
    """The GGUF file behind the benchmark's model, for the peer systems (only when one asks for it)."""
    if settings.gguf is not None or "llama.cpp" not in settings.systems:
        return settings.gguf
    if settings.model.endswith(".gguf"):
        return settings.model
    if settings.model == "demo":
        from augury.demo import ensure_demo_gguf

        return str(ensure_demo_gguf())
    return None


# config fields -> the benchmark's flags, for messages (a tree shape comes in a system's name, not a flag)
_BENCH_FLAGS = {"dtype": "--dtype", "device": "--device", "draft_model": "--draft-model", "threads": "--threads",
                "quantization": "--quantization"}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see `{PROG} --help`)")


def _key_values(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected key=value pairs, got {item!r}")
        out[key] = json.loads(value) if value[:1] in "-0123456789tfn[{" else value
    return out


def build_parser() -> argparse.ArgumentParser:
    d = BenchSettings()
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    # the engine options the benchmark passes on to its systems, from the one table (config.OPTIONS)
    add_flags(p, ("model", "dtype", "device", "draft_model", "threads", "quantization", "speculative_policy",
                  "tensor_parallel_size"),
              model=dict(default=d.model, help=OPTION["model"].help + ", or 'random' (a ~30M-parameter "
                         "random Llama written into --out)"),
              dtype=dict(default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                         help="weights and compute dtype of every system: auto (default: as augury's engine "
                         "resolves it for the model, the demo's bfloat16), float32, bfloat16 or float16"),
              device=dict(default=d.device),
              draft_model=dict(flags=("--draft-model", OPTION["draft_model"].flag),
                               help="EAGLE-3 head folder for the augury-static/adaptive systems",
                               default=None),
              threads=dict(default=None), quantization=dict(default=d.quantization),
              tensor_parallel_size=dict(default=1, help="tensor-parallel ranks of every augury system (a system "
                                        "named NAME@tpN takes N instead); each rank gets cores / N threads"),
              speculative_policy=dict(default="adaptive", choices=["adaptive", "static"],
                                      help="--workload document / multi-turn: both engines' speculation policy "
                                      "(static compares acceptance on the same trees; throughput systems name "
                                      "their own)"))
    p.add_argument("--gguf", default=None, help="GGUF file the llama.cpp system loads (default: --model when it is "
                   "a .gguf file; the demo's own GGUF for --model demo)")
    p.add_argument("--random-config", type=_key_values, default={}, help="LlamaConfig overrides for --model random, "
                   "e.g. vocab_size=32000,tie_word_embeddings=false")
    p.add_argument("--batch-sizes", type=int_list, default=d.batch_sizes,
                   help="comma-separated batch sizes, each run on its own, e.g. 1,8")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len,
                   help=f"tokens per random prompt (default: {d.prompt_len}; chat prompts have their own)")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"tokens each sequence generates (at most, with --stop-at-eos) (default: {d.output_len}; "
                   f"--prompts json: {JSON_OUTPUT_LEN}, so that every answer ends where its JSON does)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed runs per system and batch size (median)")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help=f"untimed runs of the whole workload per system and batch size first (default: {d.warmup})")
    p.add_argument("--processes", type=int, default=d.processes,
                   help="worker processes per system (default: 1); repeat r runs in process r %% N, so what sets "
                   "one process apart from another (a few percent) is spread over the repeats; each process holds "
                   "its own model and KV cache")
    p.add_argument("--systems", default=",".join(d.systems), help=f"first is the reference; known: {', '.join(SYSTEMS)}; "
                   f"{' and '.join(SHAPED)} take a tree shape, e.g. {SHAPED[0]}:5-4-12 (num_steps-topk-num_draft_tokens), "
                   f"and a prompt-lookup branch, e.g. {SHAPED[0]}:3-4-8+6")
    p.add_argument("--prompts", default=d.prompts, choices=["random", "chat", "varied", "mixed", "json", *WORKLOADS],
                   help="random token ids; chat: held-out prompts of the training templates' split, through the "
                   "model's chat template; varied: the varied held-out set (code, SQL and shell, maths, recipes, "
                   "poems, rewriting, data formats, advice, copying; acceptance reported per kind), which no "
                   "training template produces; mixed: every other prompt asks to repeat a paragraph (an answer "
                   "that copies its prompt), the rest are held-out chat prompts; json: prompts asking for JSON, "
                   "each answer constrained to its schema in augury's systems (needs --stop-at-eos; peers answer "
                   "unconstrained; augury-off-unconstrained is augury without the schemas)")
    p.add_argument("--history", default=d.history, choices=["cold", "warm"],
                   help="--prompts code_edit / agentic: cold times each conversation's whole prompt; warm prefills "
                   "its earlier turns first, untimed, as a live multi-turn session leaves them in the prefix cache "
                   "(augury's systems only)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help="--prompts chat / varied / mixed: prompts per run, in batches of the batch size "
                   "(varied has 60: 10 kinds x 6, kinds taken in turn)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; >0 = seeded sampling")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="with --temperature > 0: the nucleus every system samples from (default 1: none)")
    p.add_argument("--stop-at-eos", action="store_true", help="end each sequence at its end-of-sequence token "
                   "(at most --output-len), as in a chat; default: exactly --output-len tokens")
    p.add_argument("--out", default=d.out, help="folder for offline.json and offline.png")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed of the random prompts and of the random model (default: {d.seed})")
    p.add_argument("--workload", default="throughput",
                   choices=["throughput", "document", "multi-turn", "stress", "scale"],
                   help="throughput: the systems' decoding speed (the default); document: one long document "
                   "with a new question per request, and multi-turn: a chat growing turn by turn, each timing the "
                   "first token with and without prefix caching (see augury/bench/prefix.py); stress: load and "
                   "faults against a real `augury serve` over HTTP, with flags of its own (see "
                   "`augury bench --workload stress --help`, augury/bench/stress.py); scale: augury and llama.cpp "
                   "on random-weight GGUFs of Llama 1B/3B/8B shapes, with flags of its own (`augury bench "
                   "--workload scale --help`, augury/bench/scale.py)")
    p.add_argument("--doc-tokens", type=int, default=1500, help="--workload document: the document's length in tokens")
    p.add_argument("--questions", type=int, default=6,
                   help="--workload document: questions asked after the first request")
    p.add_argument("--turns", type=int, default=4, help="--workload multi-turn: turns of the chat")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="tracebacks with errors")
    return p


def _prefix_main(args: argparse.Namespace) -> int:
    from augury.bench.prefix import PrefixSettings, bench_prefix

    if args.model == "random":
        raise ValueError("--workload document and multi-turn need a model with a chat template "
                         "(e.g. --model demo), not --model random")
    settings = PrefixSettings(model=args.model, workload=args.workload, dtype=args.dtype, device=args.device,
                              draft_model=args.draft_model, threads=args.threads, quantization=args.quantization,
                              speculative_policy=args.speculative_policy,
                              doc_tokens=args.doc_tokens, questions=args.questions, turns=args.turns,
                              output_len=args.output_len, repeats=args.repeats,
                              out=args.out if args.out != BenchSettings().out else PrefixSettings().out)
    text, path = bench_prefix(settings, progress=not args.no_progress)
    print(text)
    print(f"wrote {path}")
    return 0


def _stress_argv(argv: list[str], workload: str = "stress") -> list[str] | None:
    """argv without its `--workload stress` (or `workload`) when it asks for that workload, else None."""
    for i, a in enumerate(argv):
        if a == f"--workload={workload}":
            return argv[:i] + argv[i + 1:]
        if a == "--workload" and argv[i + 1:i + 2] == [workload]:
            return argv[:i] + argv[i + 2:]
    return None


def default_output_len(prompts: str) -> int:
    """--output-len where it is not given: room for a whole answer under --prompts json, else the default."""
    return JSON_OUTPUT_LEN if prompts == "json" else BenchSettings().output_len


def main(argv: list[str] | None = None) -> int:
    """Entry point of `augury bench`; every error is one line and exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = _stress_argv(argv)
    if rest is not None:
        from augury.bench.stress import main as stress_main  # a server benchmark, with flags of its own

        return stress_main(rest)
    rest = _stress_argv(argv, "scale")
    if rest is not None:
        from augury.bench.scale import main as scale_main  # random GGUFs of real shapes, with flags of its own

        return scale_main(rest)
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    args.output_len = default_output_len(args.prompts) if args.output_len is None else args.output_len
    try:
        for name in ("prompt_len", "output_len", "repeats", "num_prompts", "doc_tokens", "processes"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer")
        if not 0.0 < args.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
        if args.top_p < 1.0 and args.temperature <= 0.0:
            raise ValueError("--top-p needs --temperature above 0 (greedy decoding keeps one token anyway)")
        if args.workload != "throughput":
            return _prefix_main(args)
        settings = BenchSettings(
            model=args.model, dtype=args.dtype, device=args.device, batch_sizes=args.batch_sizes,
            prompt_len=args.prompt_len, output_len=args.output_len, repeats=args.repeats, warmup=max(0, args.warmup),
            systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()), out=args.out, seed=args.seed,
            threads=args.threads, random_config=args.random_config, prompts=args.prompts,
            draft_model=args.draft_model, temperature=args.temperature, top_p=args.top_p, num_prompts=args.num_prompts,
            stop_at_eos=args.stop_at_eos, quantization=args.quantization, gguf=args.gguf,
            tensor_parallel_size=args.tensor_parallel_size, processes=args.processes, history=args.history)
        rows, out = bench(settings, progress=not args.no_progress)
    except Exception as exc:
        if args.debug:
            raise
        sys.stderr.write(f"{PROG}: error: {one_line(exc, _BENCH_FLAGS)}\n")
        return 2
    print(format_table(rows))
    print(f"wrote {out / 'offline.json'} and {out / 'offline.png'}")
    return 0
