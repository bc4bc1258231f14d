"""`augury train-draft`: prompts -> target-generated data -> draft vocab -> TTT training ->
export (SGLang/vLLM EAGLE-3 folder) -> acceptance measured with augury's engine.

Every stage is resumable from --work-dir: generated shards are kept, the draft vocabulary is
fixed once made, training resumes from its last checkpoint with --resume.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from augury.config import add_flags

log = logging.getLogger("augury.train")
STAGES = ("generate", "train", "export", "eval")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" where there is a default worth saying and the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="augury train-draft", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    a = p.add_argument
    # the engine options training passes on to its target, from the one table (config.OPTIONS)
    add_flags(p, ("model", "dtype", "device", "threads"),
              model=dict(flags=("--target",), dest="target", required=True,
                         help="the target model: a Hugging Face checkpoint folder, a llama-architecture .gguf "
                              "file, or 'demo'"),
              dtype=dict(default="bfloat16", choices=("bfloat16", "float32"),
                         help="the target's dtype (generation, features): bfloat16 or float32"),
              device=dict(default="cpu"), threads=dict(default=None))
    a("--out", required=True, type=Path, help="where the exported head folder goes")
    a("--work-dir", type=Path, help="data, vocabulary, checkpoints and logs (default: <out>-work)")
    a("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    a("--resume", action="store_true", help="continue training from <work-dir>/ckpt/latest.pt")
    a("--init-from", type=Path, help="start from this checkpoint's head weights, or from an exported head folder "
                                     "(whose draft vocabulary then becomes this run's) (new optimizer and schedule)")
    a("--ckpt-dir", help="checkpoint folder name under --work-dir (a warm-started run can use its own)")
    a("--prompts-file", type=Path, help='JSON lines of {"text": ...} or {"ids": [...]} instead of the built-in prompts')
    a("--num-prompts", type=int, default=3000, help="training prompts (validation adds 3%%)")
    a("--magpie-prompts", type=int, default=0,
      help="user turns the target writes itself (train/magpie.py: the chat template up to the user's text, sampled "
           "at temperature 1), added to the prompt pool; made once by the generate stage into "
           "<work-dir>/magpie.jsonl (0 = none)")
    a("--max-new-tokens", type=int, default=256, help="most tokens the target generates per prompt")
    a("--temperatures", default="0,0.7", help="generation temperatures, cycled over prompts")
    a("--gen-batch", type=int, default=48, help="requests generated together")
    a("--shard-size", type=int, default=96, help="prompts per data shard (the unit of resumption)")
    a("--gen-workers", type=int, default=1, help="generation processes (each takes every N-th shard)")
    a("--gen-kv-gb", type=float, default=4.0, help="KV cache memory per generation process (GB)")
    a("--draft-vocab-size", type=int, default=8192, help="tokens in the head's vocabulary (the most frequent)")
    a("--aux-layers", help="comma-separated target layers whose outputs feed the head (default 1,n//2-1,n-4)")
    a("--ttt-length", type=int, default=7, help="training-time-test unroll steps")
    a("--ttt-fraction", type=float, default=1.0,
      help="share of positions unrolled past step 0 (each an independent draft chain); <1 trades data for speed")
    a("--max-seq-len", type=int, default=512, help="training sequences are cut to this many tokens")
    a("--batch-tokens", type=int, default=2048, help="padded tokens per training batch")
    a("--epochs", type=int, default=1, help="passes over the training data")
    a("--max-steps", type=int, help="stop after this many optimizer steps")
    a("--lr", type=float, default=5e-4, help="peak learning rate")
    a("--warmup-ratio", type=float, default=0.03, help="share of the steps spent warming the learning rate up")
    a("--save-every", type=int, default=100, help="checkpoint + held-out check every N steps")
    a("--time-limit", type=float, help="stop training after this many minutes (checkpointed; --resume continues)")
    a("--feature-cache-gb", type=float, default=4.0,
      help="memory for the target's features kept between epochs (later epochs skip the target forward; 0 = off)")
    a("--precision", default="bf16", choices=("bf16", "fp32"), help="head compute (bf16 = autocast, fp32 weights)")
    a("--export-dtype", default="bfloat16", choices=("bfloat16", "float32"), help="dtype of the exported weights")
    a("--export-from", default="best", choices=("best", "latest"),
      help="export the checkpoint with the best held-out loss, or the latest")
    a("--eval-prompts", type=int, default=32, help="held-out prompts for the engine evaluation")
    a("--eval-batch1", type=int, default=8, help="of those, how many also run one at a time")
    a("--eval-max-tokens", type=int, default=256, help="most tokens generated per prompt in the engine evaluation")
    a("--eval-varied", type=int, default=60,
      help="prompts of the varied held-out set (augury.prompts.VARIED_PROMPTS: kinds no training template makes) "
           "the evaluation also runs, as one batch, reporting acceptance per kind; its per-depth acceptance becomes "
           "the head's augury_acceptance prior (0 = skip; then the template split's batch run gives the prior)")
    a("--spec-steps", type=int, default=6,
      help="draft chain length in the evaluation (which also records the measured per-depth acceptance "
           "in <out>/config.json as augury_acceptance, the adaptive policy's prior)")
    a("--seed", type=int, default=0, help="seed of the prompt split, generation and training")
    a("--no-progress", action="store_true", help="no tqdm bars (logs only)")
    return p


def _setup_logging(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger("augury")
    root.setLevel(logging.INFO)
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == (work / "train.log").resolve()
               for h in root.handlers):
        for h in (logging.FileHandler(work / "train.log"), logging.StreamHandler(sys.stderr)):
            h.setFormatter(fmt)
            root.addHandler(h)


def _magpie(args, folder: Path, work: Path, make: bool) -> list[str]:
    """The target's own user turns in <work>/magpie.jsonl; with `make`, written up to --magpie-prompts."""
    from augury.train.magpie import write_user_turns

    path = work / "magpie.jsonl"
    have = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    if len(have) >= args.magpie_prompts or not make:
        return have[: args.magpie_prompts]
    from augury import LLM

    llm = LLM(str(folder), speculative_algorithm="none", dtype=args.dtype, device=args.device,
              max_num_seqs=args.gen_batch, seed=args.seed, log_stats_interval=0.0, kv_cache_memory_gb=args.gen_kv_gb)
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError("--magpie-prompts needs a target with a tokenizer and a chat template")
    return write_user_turns(llm, args.magpie_prompts, path, batch=args.gen_batch, seed=args.seed)[: args.magpie_prompts]


def _prompts(args, magpie: list[str] | None = None) -> dict:
    from augury.prompts import VARIED_PROMPTS
    from augury.train.prompts import Prompt, builtin_prompts, make_splits, read_prompts_file

    pool = read_prompts_file(args.prompts_file) if args.prompts_file else [Prompt(t) for t in builtin_prompts()]
    if magpie:
        pool = list({p.key: p for p in pool + [Prompt(t) for t in magpie]}.values())
    held_out = {t for texts in VARIED_PROMPTS.values() for t in texts}  # never trained on, whatever the source
    pool = [p for p in pool if p.text not in held_out]
    splits = make_splits(pool, args.num_prompts, args.seed)
    log.info("prompts: %d available -> train %d, valid %d, eval %d", len(pool), len(splits["train"]),
             len(splits["valid"]), len(splits["eval"]))
    return splits


def stage_generate(args, folder: Path, work: Path, splits: dict) -> None:
    from augury.train.data import check_meta, count_tokens, load_split

    temps = [float(t) for t in args.temperatures.split(",")]
    data = work / "data"
    check_meta(data, {"target": str(folder), "max_new_tokens": args.max_new_tokens, "temperatures": temps,
                      "shard_size": args.shard_size, "seed": args.seed,
                      "prompts_file": str(args.prompts_file) if args.prompts_file else None,
                      **({"magpie_prompts": args.magpie_prompts} if args.magpie_prompts else {})})
    try:
        need = any(len(load_split(data, s, len(splits[s]), args.shard_size)) < len(splits[s]) for s in ("train", "valid"))
    except ValueError:  # a shard is missing
        need = True
    if need:
        t0 = time.perf_counter()
        jobs = [(w, args.gen_workers, str(folder), splits, data, temps, args) for w in range(args.gen_workers)]
        if args.gen_workers == 1:
            made = _generate_worker(jobs[0])
        else:  # one process per worker, one thread each: no thread barriers on a busy machine
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(args.gen_workers) as pool:
                made = sum(pool.map(_generate_worker, jobs))
        log.info("generated %d tokens in %.0f s (%.1f tok/s)", made, time.perf_counter() - t0,
                 made / max(time.perf_counter() - t0, 1e-9))
    for s in ("train", "valid"):
        records = load_split(data, s, len(splits[s]), args.shard_size)
        pt, rt = count_tokens(records)
        log.info("data %s: %d sequences, %d prompt tokens, %d response tokens", s, len(records), pt, rt)


def _generate_worker(job) -> int:
    from augury import LLM
    from augury.train.data import generate_split

    worker, num_workers, folder, splits, data, temps, args = job
    if num_workers > 1:
        torch.set_num_threads(args.threads or 1)
        _setup_logging(data.parent)
    llm = LLM(folder, speculative_algorithm="none", dtype=args.dtype, device=args.device, max_num_seqs=args.gen_batch,
              seed=args.seed, max_model_len=args.max_seq_len + args.max_new_tokens + 16,
              kv_cache_memory_gb=args.gen_kv_gb, log_stats_interval=0.0)
    return sum(generate_split(llm, splits[s], s, data, temps, args.max_new_tokens, args.shard_size, args.seed,
                              worker, num_workers) for s in ("valid", "train"))


def stage_train(args, folder: Path, work: Path, splits: dict) -> None:
    from augury.models.eagle3_head import default_aux_layers
    from augury.models.loader import load_target
    from augury.train.data import load_split, to_samples
    from augury.train.head import build_head, head_config
    from augury.train.trainer import Trainer, TrainSettings
    from augury.train.vocab import build_draft_vocab, coverage, exported_vocab, load_vocab, mapping_tensors, save_vocab

    dev = torch.device(args.device)
    target, tcfg = load_target(folder, getattr(torch, args.dtype), dev, args.max_seq_len + 8)
    records = {s: load_split(work / "data", s, len(splits[s]), args.shard_size) for s in ("train", "valid")}
    vocab_path = work / "vocab.pt"
    if not vocab_path.is_file() and args.init_from and args.init_from.is_dir():
        save_vocab(vocab_path, exported_vocab(args.init_from))  # the warm start keeps its vocabulary
    if vocab_path.is_file():
        draft_ids = load_vocab(vocab_path)
    else:
        draft_ids = build_draft_vocab([r["response"] for r in records["train"]], tcfg.vocab_size,
                                      min(args.draft_vocab_size, tcfg.vocab_size))
        save_vocab(vocab_path, draft_ids)
    log.info("draft vocabulary: %d tokens, covering %.2f%% of training response tokens", draft_ids.numel(),
             100 * coverage([r["response"] for r in records["train"]], draft_ids))
    aux = _aux_layers(args, tcfg.num_layers) or default_aux_layers(tcfg.num_layers)
    cfg = head_config(tcfg, draft_ids.numel(), aux)
    head = build_head(target, cfg, draft_ids, args.max_seq_len + args.ttt_length + 2, args.seed).to(dev)
    if not args.feature_cache_gb >= 0:
        raise ValueError(f"--feature-cache-gb must be >= 0, got {args.feature_cache_gb}")
    settings = TrainSettings(lr=args.lr, warmup_ratio=args.warmup_ratio, ttt_length=args.ttt_length,
                             ttt_fraction=args.ttt_fraction,
                             batch_tokens=args.batch_tokens, epochs=args.epochs, max_steps=args.max_steps,
                             save_every=args.save_every, seed=args.seed, bf16_autocast=args.precision == "bf16",
                             feature_cache_gb=args.feature_cache_gb)
    train, valid = (to_samples(records[s], args.max_seq_len) for s in ("train", "valid"))
    t2d = mapping_tensors(draft_ids, tcfg.vocab_size)[1]
    ckpt = work / (args.ckpt_dir or "ckpt")
    trainer = Trainer(target, head, draft_ids, t2d, tuple(sorted(aux)), train, valid, settings, ckpt)
    latest = ckpt / "latest.pt"
    if args.resume and latest.is_file():
        trainer.load(latest)
    elif latest.is_file():
        raise ValueError(f"{latest} exists: pass --resume to continue it, or use another --work-dir / --ckpt-dir")
    elif args.init_from and args.init_from.is_dir():
        trainer.load_exported(args.init_from)
    elif args.init_from:
        trainer.load_weights(args.init_from)
    log.info("training %d steps (%d sequences, %d epoch(s), %d tokens per batch), aux layers %s",
             trainer.total_steps, len(train), args.epochs, args.batch_tokens, sorted(aux))
    limit = args.time_limit * 60 if args.time_limit else None
    ckpt.mkdir(parents=True, exist_ok=True)
    trainer.run(ckpt / "train_log.jsonl", show_progress=not args.no_progress, time_limit=limit)


def _aux_layers(args, num_layers: int) -> tuple[int, ...] | None:
    if not args.aux_layers:
        return None
    ids = tuple(int(x) for x in args.aux_layers.split(","))
    if len(ids) != 3 or any(not 0 <= i < num_layers for i in ids):
        raise ValueError(f"--aux-layers needs 3 layer ids in [0, {num_layers}), got {args.aux_layers}")
    return ids


def stage_export(args, folder: Path, work: Path) -> None:
    from augury.models.config import TargetConfig
    from augury.models.eagle3_head import default_aux_layers
    from augury.models.loader import load_target
    from augury.train.head import build_head, export_head, head_config
    from augury.train.vocab import load_vocab

    ckpt = work / (args.ckpt_dir or "ckpt") / f"{args.export_from}.pt"
    if not ckpt.is_file():
        raise ValueError(f"no checkpoint {ckpt}; run the train stage first")
    state = torch.load(ckpt, weights_only=False)
    tcfg = TargetConfig.from_folder(folder)
    target, _ = load_target(folder, torch.float32, torch.device("cpu"), 16)
    draft_ids = load_vocab(work / "vocab.pt")
    aux = _aux_layers(args, tcfg.num_layers) or default_aux_layers(tcfg.num_layers)
    head = build_head(target, head_config(tcfg, draft_ids.numel(), aux), draft_ids, 16, args.seed)
    params = dict(head.named_parameters())
    with torch.no_grad():
        for name, t in state["head"].items():
            params[name].copy_(t)
    export_head(head, tcfg, draft_ids, args.out, getattr(torch, args.export_dtype), state.get("aux_scale"))
    log.info("exported %s (step %d) to %s", ckpt.name, state["step"], args.out)


def stage_eval(args, folder: Path, work: Path, splits: dict) -> dict:
    from augury.prompts import varied_prompts
    from augury.train.evaluate import evaluate_head, format_eval, record_acceptance

    if args.eval_varied < 0:
        raise ValueError(f"--eval-varied must be >= 0, got {args.eval_varied}")
    prompts = splits["eval"][: args.eval_prompts]
    varied = varied_prompts(args.eval_varied) if args.eval_varied else []
    if varied:
        from augury.models.tokenizer import load_tokenizer

        tok = load_tokenizer(Path(folder))
        if tok is None or not getattr(tok, "chat_template", None):
            log.info("the target has no chat template: the varied held-out set is not evaluated")
            varied = []
    result = evaluate_head(folder, args.out, prompts, args.spec_steps, args.eval_max_tokens, args.dtype,
                           args.eval_batch1, args.device, varied)
    text = format_eval(result, args.spec_steps)
    print(text, flush=True)
    log.info("evaluation on held-out prompts:\n%s", text)
    (work / "eval.json").write_text(json.dumps({"spec_steps": args.spec_steps, "max_tokens": args.eval_max_tokens,
                                                "dtype": args.dtype, **result}, indent=2) + "\n")
    # the prior the adaptive policy starts from: measured on prompts of kinds training never saw
    prior = result["varied"] if "varied" in result else result[f"batch{len(prompts)}"]
    record_acceptance(args.out, prior["accept_rate_per_position"])
    return result


def train_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        print(f"augury train-draft: unknown stage(s) {', '.join(bad)}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    work = args.work_dir or args.out.with_name(args.out.name + "-work")
    _setup_logging(work)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        from augury.config import EngineConfig
        from augury.resolve import resolve

        # one resolution ("demo": its folder; a .gguf file: its cached conversion); the head is ours to train
        folder = resolve(EngineConfig(model=args.target, speculative_algorithm="none")).target_dir
        if args.magpie_prompts < 0:
            raise ValueError(f"--magpie-prompts must be >= 0, got {args.magpie_prompts}")
        magpie = _magpie(args, folder, work, "generate" in stages) if args.magpie_prompts else None
        splits = _prompts(args, magpie)
        if "generate" in stages:
            stage_generate(args, folder, work, splits)
        if "train" in stages:
            stage_train(args, folder, work, splits)
        if "export" in stages:
            stage_export(args, folder, work)
        if "eval" in stages:
            stage_eval(args, folder, work, splits)
    except ValueError as e:
        print(f"augury train-draft: {e}", file=sys.stderr)
        return 2
    return 0
