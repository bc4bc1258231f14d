"""Where a tensor-parallel decode step's time goes (not a test; run once, on an otherwise idle machine).

`augury bench ... --systems augury-off,augury-off@tp2` gives the paired throughput ratios; this gives
the note beside them: per decode step, the milliseconds rank 0 spent in the sums inside forwards
outside the fused stack (the embedding's, the logits gather's and any prefill layer's), handing
each target call to the other ranks, and in all of the step, for each batch size. The sums inside the
fused stack (2 per layer through shared memory) run inside its one C++ call and show only in the step
time against tp=1's. Plain decoding (no speculation), greedy, fixed output length; AUGURY_TP_SHM=0
repeats it with every collective through gloo.

    python bench/tp_comm.py [--tp 2] [--batch-sizes 1,16] [--output-len 64] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from augury import LLM, SamplingParams
from augury.prompts import held_out_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, speculative_algorithm="none", log_stats_interval=0.0,
              tensor_parallel_size=args.tp)
    group = llm.engine.model.group
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in held_out_prompts(64)]
    print(f"tensor parallelism: {group.size} ranks, {group.stats()['backend']}, "
          f"{torch.get_num_threads()} threads on rank 0")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        batch = prompts[:b] * (1 + b // len(prompts))
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        llm.generate(batch[:b], params, use_tqdm=False)  # warm-up
        rows = []
        for _ in range(args.repeats):
            llm.engine.reset_prefix_cache()
            before = dict(group.seconds)
            t0 = time.perf_counter()
            llm.generate(batch[:b], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            steps = args.output_len  # one prefill (the first token) + output_len - 1 decode steps
            rows.append({k: (group.seconds[k] - before[k]) / steps * 1e3 for k in before} | {"step": wall / steps * 1e3})
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"batch {b:3d}: {med['step']:.2f} ms per step (prefill included); of it all-reduce "
              f"{med['all_reduce']:.3f} ms, commands {med['command']:.3f} ms, logits gather {med['logits']:.3f} ms "
              f"(medians of {args.repeats})")
    llm.engine.model.close()


if __name__ == "__main__":
    main()
