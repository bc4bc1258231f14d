"""What a draft level of the EAGLE-3 head costs against a target decode step, per ISA level, and what
quantising the head does to its acceptance: `python -m augury.bench.head_cost`.

Cost (the default): each ISA level runs in a process of its own (AUGURY_CPU_ISA=level; levels the CPU
lacks are skipped), loads the demo target with its head (a static chain of --steps drafts, no
suffix drafts grafted), and in each repeat (a) generates --tokens tokens greedily from a held-out chat
prompt at batch 1, timing every call of the proposer (the catch-up on the tokens the last step
accepted, then the draft levels: one head forward, its top k over the draft vocabulary and the tree's
bookkeeping each), once with the head kernel (models/eagle3_fused.py) and once with the torch head
(the reference path), in alternating order; (b) times a target decode step (forward of one row and
its logits after --context tokens, as bench/rows.py does). A level's cost is a proposer call's time
over --steps; its share is that over the decode step of the same repeat; the table gives medians over
repeats, and over --processes processes a level.

Acceptance (--acceptance): the demo target (int4) with its head in each form, the bfloat16 head
(dense), int4 linears with an int4 draft-vocabulary output layer, and int4 linears with that layer
int8 on w8a8 (as load_eagle3 loads an int4 head, and as the target keeps its own output layer):
the same static chain over --prompts held-out chat prompts (the 'eval' split, which the head's
training never saw), greedy, so the output is the plain greedy output whatever the head (checked);
printed: the share of steps whose first draft was accepted and the mean accepted drafts per step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from augury.bench.rows import host_levels


def _spec_llm(steps: int):
    from augury import LLM

    return LLM("demo", speculative_algorithm="eagle3", speculative_policy="static", speculative_num_steps=steps,
               speculative_eagle_topk=1, speculative_num_draft_tokens=steps, speculative_ngram_branch=0,
               log_stats_interval=0)


def _decode_step(engine, context: int):
    """A target decode step (one row after `context` tokens, then its logits), as a callable."""
    import torch

    model, attention, bs = engine.model, engine.attention, engine.allocator.block_size
    table = list(range(1, 1 + -(-(context + 1) // bs)))  # free blocks at start-up (block 0 is never handed out)

    def step() -> None:
        attn = attention.prepare_tree([table], [context], torch.full((1, 1), -1))
        with torch.inference_mode():
            h, _ = model(torch.ones(1, 1, dtype=torch.long), torch.tensor([[context]]), attn, ())
            model.logits(h[0])

    return step


def _cost_worker(steps: int, tokens: int, context: int, repeats: int, inner: int) -> dict:
    import torch

    from augury import SamplingParams, cpu
    from augury.bench import chat_prompts

    llm = _spec_llm(steps)
    proposer = llm.engine.speculator.proposer
    fused = proposer.fused
    calls: list[float] = []
    propose = proposer.propose

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = propose(*a, **kw)
        calls.append(time.perf_counter() - t0)
        return out

    proposer.propose = timed
    prompts = chat_prompts(llm.tokenizer, repeats)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    step = _decode_step(llm.engine, context)
    for _ in range(20):  # the thread choice settles (cpu/threads.py), caches warm
        step()
    llm.generate(prompts[:1], params, use_tqdm=False)
    paths = {"kernel": fused, "torch": None} if fused is not None else {"torch": None}
    level = {p: [] for p in paths}
    decode, share = [], {p: [] for p in paths}
    for rep in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            step()
        d = (time.perf_counter() - t0) / inner
        decode.append(d)
        for name in list(paths) if rep % 2 == 0 else list(paths)[::-1]:
            proposer.fused = paths[name]
            calls.clear()
            llm.generate([prompts[rep]], params, use_tqdm=False)
            if not calls:  # every step verified suffix drafts alone: nothing of the head's to time
                continue
            per_level = statistics.median(calls) / steps
            level[name].append(per_level)
            share[name].append(per_level / d)
    proposer.fused = fused
    status = cpu.status()
    return {"isa": status["kernels_isa"], "threads": torch.get_num_threads(), "decode_ms": statistics.median(decode) * 1e3,
            "level_ms": {p: statistics.median(v) * 1e3 for p, v in level.items() if v},
            "share": {p: statistics.median(v) for p, v in share.items() if v}}


def _variants(llm) -> dict:
    """The demo head in each form the acceptance table compares, loaded afresh."""
    import torch

    from augury.heads import demo_head_dir
    from augury.models.eagle3_head import load_eagle3
    from augury.models.quant import Int4Linear

    engine = llm.engine
    old = engine.speculator.proposer.head
    model = engine.model

    def load(mode: str):
        return load_eagle3(demo_head_dir(), model.cfg, model.embed_tokens, old.dtype, old.device, old.rotary.max_len,
                           quantization=mode)

    dense, mixed, int4 = load("none"), load("int4"), load("int4")  # int4 loads with an int8 output layer
    int4.lm_head = Int4Linear.from_float(dense.lm_head.weight, None, torch.bfloat16)
    return {"bf16 (dense)": dense, "int4, int4 lm_head": int4, "int4, int8 lm_head": mixed}


def _acceptance_worker(steps: int, tokens: int, prompts: int) -> dict:
    from augury import LLM, SamplingParams
    from augury.bench import chat_prompts
    from augury.models.eagle3_fused import FusedHead

    plain = LLM("demo", speculative_algorithm="none", log_stats_interval=0)
    texts = chat_prompts(plain.tokenizer, prompts)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, return_token_sources=True)
    want = [o.token_ids for o in plain.generate(texts, params, use_tqdm=False)]
    del plain
    out = {}
    for name in ("bf16 (dense)", "int4, int4 lm_head", "int4, int8 lm_head"):
        llm = _spec_llm(steps)  # a fresh engine per form: no head KV offered by another form
        proposer = llm.engine.speculator.proposer
        proposer.head = _variants(llm)[name]
        proposer.fused = FusedHead.build(proposer.head)
        proposer.offered.clear()
        got = llm.generate(texts, params, use_tqdm=False)
        drafts = [s for o in got for s in (o.spec_steps or []) if s.mode == "draft" and s.draft_tokens]
        out[name] = {"steps": len(drafts), "first": sum(s.accepted >= 1 for s in drafts) / max(len(drafts), 1),
                     "accepted": sum(s.accepted for s in drafts) / max(len(drafts), 1),
                     "kernel": proposer.fused is not None, "same_output": [o.token_ids for o in got] == want}
        del llm
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m augury.bench.head_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="draft levels a step (a chain; default 3)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated a repeat (default 64)")
    ap.add_argument("--context", type=int, default=100, help="context of the timed target decode step (default 100)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20, help="target decode steps a timing (default 20)")
    ap.add_argument("--processes", type=int, default=2, help="worker processes a level (default 2)")
    ap.add_argument("--isa", default=None, help="levels, comma-separated (default: every level this CPU runs)")
    ap.add_argument("--acceptance", action="store_true", help="the acceptance table instead of the cost table")
    ap.add_argument("--prompts", type=int, default=16, help="--acceptance: held-out chat prompts (default 16)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.acceptance:
        res = _acceptance_worker(args.steps, args.tokens * 2, args.prompts)
        print(f"demo head, static chain of {args.steps}, {args.prompts} held-out chat prompts, greedy "
              f"(max {args.tokens * 2} tokens)")
        print("| head | kernel path | drafting steps | first draft accepted | accepted drafts a step | output = plain |")
        print("|---|---|---|---|---|---|")
        for name, r in res.items():
            print(f"| {name} | {'yes' if r['kernel'] else 'no (torch)'} | {r['steps']} | {r['first']:.3f} | "
                  f"{r['accepted']:.3f} | {r['same_output']} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    if args.worker:
        print(json.dumps(_cost_worker(args.steps, args.tokens, args.context, args.repeats, args.inner)), flush=True)
        return
    levels = host_levels(args.isa)
    runs: dict[str, list[dict]] = {lv: [] for lv in levels}
    for p in range(max(args.processes, 1)):
        for lv in levels if p % 2 == 0 else levels[::-1]:
            cmd = [sys.executable, "-m", "augury.bench.head_cost", "--worker", "--steps", str(args.steps), "--tokens",
                   str(args.tokens), "--context", str(args.context), "--repeats", str(args.repeats), "--inner",
                   str(args.inner)]
            out = subprocess.run(cmd, env=dict(os.environ, AUGURY_CPU_ISA=lv), capture_output=True, text=True,
                                 check=True)
            runs[lv].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"demo at batch 1: a head draft level (a proposer call over {args.steps} levels: catch-up, levels, top k, "
          f"tree) against a target decode step (1 row after {args.context} tokens + logits); medians")
    print("| ISA level | threads | decode step ms | head level ms (kernel) | share | head level ms (torch) | share |")
    print("|---|---|---|---|---|---|---|")
    for lv, res in runs.items():
        if not res:
            continue

        def med(key: str, path: str) -> float:
            vals = [r[key][path] for r in res if path in r[key]]
            return statistics.median(vals) if vals else float("nan")

        print(f"| {res[0]['isa']} | {res[0]['threads']} | {statistics.median(r['decode_ms'] for r in res):.2f} | "
              f"{med('level_ms', 'kernel'):.3f} | {100 * med('share', 'kernel'):.1f}% | {med('level_ms', 'torch'):.3f} | "
              f"{100 * med('share', 'torch'):.1f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
