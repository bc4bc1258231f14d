"""Quality of the demo's weight modes against its float32 dense forward (not a test; run once).

Answers are generated greedily by the float32 dense model for a few held-out chat prompts;
each mode then reads prompt + answer teacher-forced in one prefill, and the answer positions'
logits are compared with the float32 reference: mean |logit error| and top-1 agreement.

    OMP_NUM_THREADS=1 python bench/quant_quality.py [--prompts 8] [--tokens 48]
"""
from __future__ import annotations

import argparse
import os

import torch

from augury import LLM, SamplingParams
from augury.attention import PagedBackend
from augury.config import CPU_KERNELS_VAR
from augury.demo import ensure_demo_target
from augury.core.kv_cache import KVCache
from augury.cpu import kernels as cpu_kernels
from augury.models.loader import load_target
from augury.models.tokenizer import load_tokenizer
from augury.prompts import held_out_prompts

MODES = (  # label, dtype, quantization, augury's CPU kernels on (models/cpu_kernels.py)
    ("float32 dense (reference)", torch.float32, "none", True),
    ("bfloat16 dense", torch.bfloat16, "none", True),
    ("bfloat16 int8 (per channel)", torch.bfloat16, "int8", True),
    ("bfloat16 int4 (group 32, requantised), w4a8 kernel", torch.bfloat16, "int4", True),
    ("bfloat16 native Q4_1 (auto), w4a8 kernel", torch.bfloat16, "auto", True),
    ("bfloat16 native Q4_1 (auto), torch's int4 kernel", torch.bfloat16, "auto", False),
    ("float32 native Q4_1 (auto)", torch.float32, "auto", True),
)


def forward_logits(model, cfg, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    bs, n = 16, len(ids)
    blocks = -(-n // bs)
    kv = KVCache(cfg.num_layers, blocks + 1, bs, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
    attn = PagedBackend(kv.k, kv.v, bs).prepare_prefill([list(range(1, blocks + 1))], [0], [n])
    with torch.no_grad():
        hidden, _ = model(torch.tensor([ids]), torch.arange(n)[None], attn)
        return model.logits(hidden[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    folder = ensure_demo_target()
    tok = load_tokenizer(folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in held_out_prompts(args.prompts)]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    ref_llm = LLM(str(folder), dtype="float32", quantization="none", speculative_algorithm="none",
                  log_stats_interval=0)
    answers = [o.token_ids for o in ref_llm.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0.0),
                                                       use_tqdm=False)]
    del ref_llm
    seqs = [(p, a) for p, a in zip(prompts, answers) if a]
    ref_logits = None
    rows = []
    for label, dtype, mode, kernels in MODES:
        os.environ[CPU_KERNELS_VAR] = "1" if kernels else "0"
        cpu_kernels.reset()
        model, cfg = load_target(folder, dtype, torch.device("cpu"), 1024, quantization=mode)
        per = []
        for p, a in seqs:
            lg = forward_logits(model, cfg, p + a, dtype)[len(p) - 1 : len(p) + len(a) - 1]  # predicts a
            per.append(lg.float())
        if ref_logits is None:
            ref_logits = per
        err = torch.cat([(x - r).abs().mean(-1) for x, r in zip(per, ref_logits)]).mean().item()
        agree = torch.cat([x.argmax(-1) == r.argmax(-1) for x, r in zip(per, ref_logits)]).float().mean().item()
        rows.append((label, model.quantization, err, agree))
        print(f"{label:52s} {model.quantization:5s} mean|dlogit| {err:.4f}  top-1 {100 * agree:.1f}%", flush=True)
        del model
    n = sum(len(a) for _, a in seqs)
    print(f"\n{len(seqs)} chat answers, {n} teacher-forced positions, reference: float32 dense forward")
    print("| mode | runs as | mean abs logit error | top-1 agreement |\n|---|---|---|---|")
    for label, q, err, agree in rows:
        print(f"| {label} | {q} | {err:.4f} | {100 * agree:.1f}% |")


if __name__ == "__main__":
    main()
