"""Acceptance of a trained head measured the way it is used: augury's engine, greedy.

Runs LLM(target, draft_model=head, speculative_algorithm="eagle3", speculative_policy="static")
with a chain of `num_steps` drafts (the head alone: no prompt-lookup branch) over held-out
prompts, once one request at a time (batch 1) and once all together (a batch), and reads the
per-request spec_stats and the engine's per-position acceptance counters.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from augury.train.prompts import Prompt


def _run(llm, prompts: list[Prompt], params, batch: bool) -> tuple[list, float]:
    groups = [prompts] if batch else [[p] for p in prompts]
    outs = []
    t0 = time.perf_counter()
    for group in groups:
        if group[0].ids is not None:
            outs += llm.generate([list(p.ids) for p in group], params, use_tqdm=False)
        else:
            outs += llm.chat([[{"role": "user", "content": p.text}] for p in group], params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def evaluate_head(target: str | Path, head: str | Path, prompts: list[Prompt], num_steps: int, max_tokens: int,
                  dtype: str, batch1_prompts: int, device: str | None = None,
                  varied: list[tuple[str, str]] | None = None) -> dict:
    """{"batch1": {...}, "batchN": {...}[, "varied": {...}]}: the first `batch1_prompts` prompts one
    at a time, then all prompts as one batch, then the (kind, text) prompts of `varied` (the varied
    held-out set, prompts.VARIED_PROMPTS) as one batch. Each: acceptance length (tokens per
    verification), the fraction of verifications that accepted the draft at depth i (per
    position) and the same conditioned on depth i-1 being accepted, and generated tokens per
    second; "varied" also the acceptance length per kind."""
    from augury import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    varied = varied or []
    llm = LLM(str(target), draft_model=str(head), speculative_algorithm="eagle3", speculative_policy="static",
              speculative_num_steps=num_steps, speculative_eagle_topk=1, speculative_num_draft_tokens=num_steps + 1,
              speculative_ngram_branch=0, dtype=dtype, device=device, max_num_seqs=max(len(prompts), len(varied)),
              log_stats_interval=0.0)
    result = {}
    runs = [("batch1", prompts[:batch1_prompts], False), (f"batch{len(prompts)}", prompts, True)]
    if varied:
        runs.append(("varied", [Prompt(t) for _, t in varied], True))
    for name, group, batch in runs:
        from augury.core.stats import EngineStats

        llm.engine.stats = EngineStats()
        outs, seconds = _run(llm, group, params, batch)
        steps = sum(o.spec_stats.num_verify_steps for o in outs)
        accepted = sum(o.spec_stats.num_accepted_draft_tokens for o in outs)
        tokens = sum(len(o.token_ids) for o in outs)
        stats = llm.engine.stats
        rates = stats.acceptance_rates()
        cond = [r / prev if prev else 0.0 for r, prev in zip(rates, [1.0] + rates[:-1])]
        result[name] = {
            "requests": len(outs),
            "generated_tokens": tokens,
            "verify_steps": steps,
            "accept_length": round((accepted + steps) / max(steps, 1), 4),
            "engine_accept_length": round(stats.accept_length, 4),
            "accept_rate_per_position": [round(r, 4) for r in rates],
            "conditional_accept_rate_per_position": [round(r, 4) for r in cond],
            "tokens_per_second": round(tokens / max(seconds, 1e-9), 2),
        }
        if name == "varied":
            by_kind: dict[str, list[int]] = {}
            for (kind, _), o in zip(varied, outs):
                rec = by_kind.setdefault(kind, [0, 0])
                rec[0] += o.spec_stats.num_verify_steps
                rec[1] += o.spec_stats.num_accepted_draft_tokens
            result[name]["accept_length_by_kind"] = {k: round((a + s) / max(s, 1), 4) for k, (s, a) in by_kind.items()}
    return result


def format_eval(result: dict, num_steps: int) -> str:
    lines = []
    for name, r in result.items():
        rates = " ".join(f"{x:.2f}" for x in r["accept_rate_per_position"])
        lines.append(f"{name}: {r['requests']} requests, {r['generated_tokens']} tokens, acceptance length "
                     f"{r['accept_length']:.2f} (chain of {num_steps}), per-position acceptance [{rates}], "
                     f"{r['tokens_per_second']:.1f} tok/s")
        if "accept_length_by_kind" in r:
            lines.append("  by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in r["accept_length_by_kind"].items()))
    return "\n".join(lines)


def record_acceptance(head: str | Path, rates: list[float]) -> None:
    """Write the measured P(accepted length >= i) into the head's config.json as
    `augury_acceptance`, which augury's adaptive policy reads as its prior (others ignore it)."""
    path = Path(head) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["augury_acceptance"] = [round(float(r), 4) for r in rates]
    path.write_text(json.dumps(cfg, indent=2) + "\n")
