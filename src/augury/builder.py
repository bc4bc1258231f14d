"""Start-up as named stages; each completes or raises StartupError naming it.

configuration -> target -> draft head -> KV cache -> CUDA graphs -> warm-up. The Engine is
constructed only from parts that finished building, so a failure anywhere leaves no
half-built engine behind. The optional stage (CUDA graphs) degrades to eager execution
with a warning instead.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from augury.attention import PagedBackend
from augury.attention.kv_dtype import kv_cache_dtype
from augury.config import EngineConfig, ResolvedModel
from augury.engine.engine import Engine
from augury.core.kv_budget import available_memory, plan_kv_cache
from augury.core.kv_cache import BlockAllocator, KVCache
from augury.core.stats import EngineStats
from augury.cpu import threads as cpu_threads
from augury.models.loader import load_target
from augury.models.tokenizer import eos_ids, load_tokenizer
from augury.sampling_params import SamplingParams
from augury.stages import StartupError, stage

log = logging.getLogger("augury.startup")
__all__ = ["STAGES", "StartupError", "build_engine", "run_warmup"]
# Positions (and cache slots) a request may use past its context: a draft tree verified at the end
# of the context computes nodes there, which are never committed. The speculative step drafts
# only trees that fit (Engine.reserve), so this bounds the rope table and the KV sizing, not depth.
DRAFT_SLACK = 64
MIN_CONTEXT = 16  # a smaller context cannot hold even the warm-up request and a reply
STAGES = ("configuration", "tensor parallel", "target", "draft head", "KV cache", "CUDA graphs", "warm-up")


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = checkpoint_dtype if checkpoint_dtype in ("float32", "bfloat16", "float16") else "float32"
        if name == "float16" and device.type == "cpu":
            name = "bfloat16"  # float16 matmuls are slow on CPUs; bfloat16 is not
    return getattr(torch, name)


def build_engine(config: EngineConfig, resolved: ResolvedModel | None = None,
                 notify: Callable[[str], None] | None = None, warmup: bool = True) -> Engine:
    """Build an engine for `config` from the folders `resolved` names (augury/resolve.py makes them
    from a model name). Without it, config.model and config.draft_model must be folders already."""
    started = time.perf_counter()
    with stage("configuration", notify):
        if resolved is None:
            resolved = _as_folders(config)
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but no CUDA device is available")
        folder = resolved.target_dir
        from augury.models.config import TargetConfig

        tcfg = TargetConfig.from_folder(folder)
        dtype = resolve_dtype(config.dtype, tcfg.torch_dtype, device)
        if kv_cache_dtype(config.kv_cache_dtype, dtype).itemsize == 1 and device.type != "cpu":
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} is implemented for CPUs only (its attention "
                             f"reads widen fp8 in augury's CPU kernel and torch's CPU path); on {device.type} use "
                             "auto, bfloat16, float16 or float32")
        limits = [tcfg.max_position_embeddings] + ([tcfg.sliding_window] if tcfg.sliding_window else [])
        max_len = config.max_model_len or min(limits)
        if max_len > min(limits):
            raise ValueError(f"max_model_len {max_len} exceeds the model's context of {min(limits)} tokens")
        topo = None
        if config.tensor_parallel_size > 1 or _under_torchrun():  # ranks, cores, heads, vocabulary: they fit
            from augury.distributed import launch

            topo = launch.check(config, tcfg, device)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    if device.type == "cpu":
        # Optional stage: a kernel that cannot be built or loaded warns and torch's kernels run
        # (augury/cpu); built once per source, ISA level and compiler into the user cache. If the
        # stage itself fails, every kernel is turned off: the engine runs torch's, never half of each.
        from augury import cpu
        from augury.cpu import kernels as cpu_kernels

        try:
            with stage("CPU kernels", notify):
                t0 = time.perf_counter()
                ready = cpu_kernels.load_all()
                status = cpu.status()
                log.info("CPU kernels in %.1f s, built for %s (CPU: %s): %s", time.perf_counter() - t0,
                         status["kernels_isa"], status["host_isa"],
                         ", ".join(f"{k} {'on' if v else 'off'}" for k, v in ready.items()))
        except StartupError as exc:
            log.warning("stage 'CPU kernels' failed (%s); torch's kernels run instead", exc.cause)
            cpu_kernels.disable_all()
    ranks = None
    if topo is not None:  # a rank other than 0 runs its rank inside this stage, then exits
        with stage("tensor parallel", notify):
            ranks = launch.Ranks.start(config, topo, folder, device, dtype, max_len + DRAFT_SLACK, config.quantization)
    try:
        return _build_rest(config, resolved, notify, warmup, started, folder, device, dtype, max_len, ranks)
    except BaseException:
        if ranks is not None:  # nothing of the other ranks outlives a failed start-up
            ranks.close()
        raise


def _under_torchrun() -> bool:
    from augury.distributed.topology import under_torchrun

    return under_torchrun()


def _build_rest(config: EngineConfig, resolved: ResolvedModel, notify, warmup: bool, started: float, folder: Path,
                device: torch.device, dtype: torch.dtype, max_len: int, ranks) -> Engine:
    with stage("target", notify):
        model, tcfg = load_target(folder, dtype, device, max_len + DRAFT_SLACK, config.quantization,
                                  *((ranks.shard, ranks.group) if ranks is not None else ()))
        if ranks is not None:  # rank 0's target stands in for every rank's (the head gets the whole embedding)
            ranks.wait_loaded()
            model = ranks.wrap(model, folder)
        tokenizer = load_tokenizer(folder)
    with stage("draft head", notify):
        from augury.speculative.worker import plan_speculation

        plan = plan_speculation(config, resolved, model, tcfg, dtype, device, max_len)
    with stage("KV cache", notify):
        bs = config.block_size
        local = model.cfg  # this rank's KV heads (all of them without tensor parallelism)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
        per_token = KVCache.bytes_per_token(tcfg.num_layers, local.num_kv_heads, tcfg.head_dim, kv_dtype)
        if plan is not None:
            per_token += plan.kv_bytes_per_token()
        # measured now, after the weights: what the cache may take (ranks on this machine share it)
        available = available_memory(device.type, device.index)
        if available is not None:
            available //= max(1, config.tensor_parallel_size // config.nnodes)
        # every request may hold max_len tokens plus a draft tree past them (DRAFT_SLACK)
        sized = plan_kv_cache(bytes_per_token=per_token, block_size=bs, max_num_seqs=config.max_num_seqs,
                              model_len=max_len, len_given=config.max_model_len is not None,
                              num_kv_blocks=config.num_kv_blocks, memory_gb=config.kv_cache_memory_gb,
                              available_bytes=available, slack=DRAFT_SLACK, min_context=MIN_CONTEXT)
        num_blocks, max_len = sized.num_blocks, sized.max_model_len
        log.info("%s", sized.line(str(kv_dtype).removeprefix("torch.")))
        allocator = BlockAllocator(num_blocks, bs, enable_caching=config.enable_prefix_caching)
        kv = KVCache(tcfg.num_layers, num_blocks, bs, local.num_kv_heads, tcfg.head_dim, kv_dtype, device)
        speculator = plan.build(num_blocks, bs, config.max_num_seqs, warming=warmup) if plan is not None else None
        attention = PagedBackend(kv.k, kv.v, bs)
        if ranks is not None:  # every rank sizes its cache alike; the engine drives them all from here
            kv, attention = ranks.attach(kv, attention, num_blocks, bs)
        engine = Engine(config, model, tcfg, kv, allocator, tokenizer, eos_ids(folder, tcfg.eos_token_ids, tokenizer),
                        max_len, max_len - 1 + DRAFT_SLACK, device, attention, speculator, dtype=dtype, kv_plan=sized)
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
    log.info("engine ready: start-up took %.1f s", time.perf_counter() - started)
    return engine


def _as_folders(config: EngineConfig) -> ResolvedModel:
    """A config whose model (and head) are folders already: no name is resolved here."""
    folder = Path(config.model).expanduser()
    if not folder.is_dir():
        raise ValueError(f"model folder {config.model} does not exist; resolve the name first "
                         "(augury.resolve.resolve(config))")
    return ResolvedModel(folder, Path(config.draft_model).expanduser() if config.draft_model else None)


def run_warmup(engine: Engine) -> None:
    """One short greedy request through the whole path (a speculator warming up decodes one step
    plainly and drafts the rest of 8 tokens, and tells its policy nothing; without one, 2 tokens); it
    must finish and free its blocks.
    Nothing is profiled: the adaptive policy measures both arms online, each batch bucket starting
    plain."""
    free_before = engine.allocator.num_free
    # without a speculator a prefill and one decode step cover the path: each more step was a decode
    # step's time added to every start (~30 ms at 1B, ~90 at 3B, ~150 at 8B, Q4-Q6 files on 2 threads)
    tokens = 8 if engine.speculator is not None else 2
    rid = engine.add_request([engine.model_cfg.bos_token_id or 1] * 4,
                             SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), "warmup")
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
    if engine.device.type == "cpu":  # nor load: its thread choices stand until requests time the calls
        cpu_threads.forget_times()
    engine.scheduler.prefix_queries = engine.scheduler.prefix_hits = 0
