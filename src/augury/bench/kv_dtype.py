"""What an 8-bit KV cache does to the demo's answers and to EAGLE-3's acceptance (quality, not speed):
`python -m augury.bench.kv_dtype`.

For each --kv-cache-dtype (float32, bfloat16, the demo's own, and fp8): the demo target greedy over --prompts
varied held-out chat prompts (bench.varied_chat_prompts), --tokens tokens each (ignore_eos, so every
answer is as long), plainly and with its EAGLE-3 head (a static chain of --steps, no suffix drafts).
Printed: how many fp8 answers are bfloat16's token for token, where the others first differ (the
position in the answer; float32's beside them: how far a cache wider than the model moves them), the
acceptance of each cache (the share of drafting steps whose first draft
was accepted, accepted drafts a step), and whether speculative output equals plain output over the
same cache (it must: every target path reads the cache as stored).
"""
from __future__ import annotations

import argparse
import json
import statistics

DTYPES = ("float32", "bfloat16", "fp8")  # float32: how far a cache wider than the model moves the answers


def _run(kv: str, prompts: list[list[int]], tokens: int, steps: int) -> dict:
    from augury import LLM, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, return_token_sources=True)
    plain = LLM("demo", speculative_algorithm="none", kv_cache_dtype=kv, log_stats_interval=0)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    spec = LLM("demo", speculative_algorithm="eagle3", speculative_policy="static", speculative_num_steps=steps,
               speculative_eagle_topk=1, speculative_num_draft_tokens=steps, speculative_ngram_branch=0,
               kv_cache_dtype=kv, log_stats_interval=0)
    got = spec.generate(prompts, params, use_tqdm=False)
    drafts = [s for o in got for s in (o.spec_steps or []) if s.mode == "draft" and s.draft_tokens]
    return {"tokens": want, "steps": len(drafts),
            "first": sum(s.accepted >= 1 for s in drafts) / max(len(drafts), 1),
            "accepted": sum(s.accepted for s in drafts) / max(len(drafts), 1),
            "spec_equals_plain": [o.token_ids for o in got] == want}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m augury.bench.kv_dtype", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="varied held-out chat prompts (default 16)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens an answer (default 128)")
    ap.add_argument("--steps", type=int, default=3, help="draft levels a step (a chain; default 3)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    from augury import LLM
    from augury.bench import varied_chat_prompts

    tok = LLM("demo", speculative_algorithm="none", log_stats_interval=0).tokenizer
    prompts, _ = varied_chat_prompts(tok, args.prompts)
    res = {kv: _run(kv, prompts, args.tokens, args.steps) for kv in DTYPES}
    print(f"demo, greedy, {args.prompts} varied held-out chat prompts, {args.tokens} tokens each; EAGLE-3 static "
          f"chain of {args.steps}")
    diffs = {}
    for kv in DTYPES:
        if kv == "bfloat16":
            continue
        diffs[kv] = [_first_difference(a, b) for a, b in zip(res["bfloat16"]["tokens"], res[kv]["tokens"])]
        differ = sorted(d for d in diffs[kv] if d is not None)
        print(f"{kv} answers equal to bfloat16's: {len(diffs[kv]) - len(differ)} of {len(diffs[kv])}; the others "
              f"first differ at token {differ} (median {statistics.median(differ) if differ else '-'})")
    print("| KV cache | drafting steps | first draft accepted | accepted drafts a step | speculative = plain |")
    print("|---|---|---|---|---|")
    for kv in DTYPES:
        r = res[kv]
        print(f"| {kv} | {r['steps']} | {r['first']:.3f} | {r['accepted']:.3f} | {r['spec_equals_plain']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"first_difference": diffs, **res}, f)


if __name__ == "__main__":
    main()
