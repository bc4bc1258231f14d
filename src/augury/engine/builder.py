"""Start-up as named stages; each completes or raises StartupError naming it.

configuration -> target -> draft head -> KV cache -> CUDA graphs -> warm-up. The Engine is
constructed only from parts that finished building, so a failure anywhere leaves no
half-built engine behind. The optional stage (CUDA graphs) degrades to eager execution
with a warning instead.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from augury.config import EngineConfig
from augury.engine.engine import Engine
from augury.engine.kv_cache import BlockAllocator, KVCache
from augury.engine.stats import EngineStats
from augury.models.loader import load_target
from augury.sampling_params import SamplingParams
from augury.stages import StartupError, stage

log = logging.getLogger("augury.startup")
__all__ = ["STAGES", "StartupError", "build_engine", "run_warmup"]
STAGES = ("configuration", "target", "draft head", "KV cache", "CUDA graphs", "warm-up")


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = checkpoint_dtype if checkpoint_dtype in ("float32", "bfloat16", "float16") else "float32"
        if name == "float16" and device.type == "cpu":
            name = "bfloat16"  # float16 matmuls are slow on CPUs; bfloat16 is not
    return getattr(torch, name)


def load_tokenizer(folder: Path):
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def eos_ids(folder: Path, cfg_eos: tuple[int, ...], tokenizer) -> set[int]:
    ids = set(cfg_eos)
    gen = folder / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [e] if isinstance(e, int) else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def build_engine(config: EngineConfig, notify: Callable[[str], None] | None = None, warmup: bool = True) -> Engine:
    with stage("configuration", notify):
        from augury.demo import resolve_model

        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but no CUDA device is available")
        folder = resolve_model(config.model)
        from augury.models.config import TargetConfig

        tcfg = TargetConfig.from_folder(folder)
        dtype = resolve_dtype(config.dtype, tcfg.torch_dtype, device)
        limits = [tcfg.max_position_embeddings] + ([tcfg.sliding_window] if tcfg.sliding_window else [])
        max_len = config.max_model_len or min(limits)
        if max_len > min(limits):
            raise ValueError(f"max_model_len {max_len} exceeds the model's context of {min(limits)} tokens")
    with stage("target", notify):
        model, tcfg = load_target(folder, dtype, device, max_len)
        tokenizer = load_tokenizer(folder)
    with stage("draft head", notify):
        from augury.speculative.worker import plan_speculation

        plan = plan_speculation(config, model, tcfg, dtype, device, max_len)
    with stage("KV cache", notify):
        bs = config.block_size
        per_token = KVCache.bytes_per_token(tcfg.num_layers, tcfg.num_kv_heads, tcfg.head_dim, dtype)
        if plan is not None:
            per_token += plan.kv_bytes_per_token()
        needed = config.max_num_seqs * -(-(max_len + 64) // bs) + 1
        budget = int(config.kv_cache_memory_gb * 2**30) // (per_token * bs)
        num_blocks = config.num_kv_blocks or max(2, min(needed, budget))
        allocator = BlockAllocator(num_blocks, bs)
        max_len = min(max_len, allocator.num_usable * bs - 64)
        if max_len < 16:
            raise ValueError(f"the KV cache ({num_blocks} blocks of {bs}) is too small; raise num_kv_blocks")
        kv = KVCache(tcfg.num_layers, num_blocks, bs, tcfg.num_kv_heads, tcfg.head_dim, dtype, device)
        speculator = plan.build(num_blocks, bs) if plan is not None else None
        engine = Engine(config, model, tcfg, kv, allocator, tokenizer, eos_ids(folder, tcfg.eos_token_ids, tokenizer),
                        max_len, device, speculator)
    try:
        # Optional stage: its documented fallback is eager execution, so a failure here warns
        # and start-up goes on with an engine that never depended on graphs.
        with stage("CUDA graphs", notify):
            if device.type == "cuda":
                log.warning("CUDA graph capture is not implemented yet; running eagerly")
    except StartupError as exc:
        log.warning("stage 'CUDA graphs' failed (%s); falling back to eager execution", exc.cause)
    if warmup:
        with stage("warm-up", notify):
            run_warmup(engine)
    return engine


def run_warmup(engine: Engine) -> None:
    """One short greedy request through the whole path; it must finish and free its blocks."""
    free_before = engine.allocator.num_free
    rid = engine.add_request([engine.model_cfg.bos_token_id or 1] * 4,
                             SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), "warmup")
    done = False
    for _ in range(64):
        for out in engine.step():
            done = done or (out.request_id == rid and out.finished)
        if done:
            break
    if not done:
        raise RuntimeError("the warm-up request did not finish")
    if engine.allocator.num_free != free_before:
        raise RuntimeError("the warm-up request leaked KV cache blocks")
    if engine.speculator is not None:
        engine.speculator.after_warmup(engine)
    engine.stats = EngineStats()  # the warm-up is not traffic
