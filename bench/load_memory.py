"""Peak resident memory and time of loading a model the way `augury serve` does, in a fresh process.

    python bench/load_memory.py MODEL [--max-model-len 4096] [--kv-cache-memory-gb 0.5]

MODEL is what `augury serve --model` takes (a .gguf file: its cached conversion is made first, in its
own process, so the figure is a second start's). The child resolves the name, loads the CPU kernels,
then builds the engine without warm-up (target, KV cache), and prints one JSON line:
runtime_mb (resident before the target: Python, torch, kernels), weights_mb (the model's parameters
and buffers), kv_mb (allocated; its pages are touched lazily), peak_mb (VmHWM), final_mb
(resident at the end), load_s (the build's seconds), peak_anon_mb / peak_file_mb (the highest
anonymous and file-backed resident memory seen, sampled every 20 ms) and
ratio = peak / (runtime + weights + kv).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _rss_parts() -> tuple[float, float]:
    """(anonymous, file-backed) resident MiB now (/proc/self/status)."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                got[line.split(":")[0]] = int(line.split()[1]) / 1024
    return got.get("RssAnon", 0.0), got.get("RssFile", 0.0)


def child(model: str, max_len: int, kv_gb: float) -> None:
    import threading
    import time

    import torch

    from augury.builder import build_engine
    from augury.config import EngineConfig
    from augury.cpu import kernels as cpu_kernels
    from augury.resolve import resolve

    config = EngineConfig(model=model, speculative_algorithm="none", max_model_len=max_len, kv_cache_memory_gb=kv_gb)
    resolved = resolve(config)
    cpu_kernels.load_all()
    runtime = _rss_mb()
    peaks = [0.0, 0.0]
    done = threading.Event()

    def sample() -> None:  # the peaks of each kind, every 20 ms (ru_maxrss counts both together)
        while not done.wait(0.02):
            anon, file = _rss_parts()
            peaks[0], peaks[1] = max(peaks[0], anon), max(peaks[1], file)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    engine = build_engine(config, resolved, warmup=False)
    load_s = time.perf_counter() - t0
    done.set()
    sampler.join()
    model_ = engine.model
    seen: set[int] = set()
    weights = 0
    for t in (*model_.parameters(), *model_.buffers()):
        if t.data_ptr() not in seen and t.device.type != "meta":
            seen.add(t.data_ptr())
            weights += t.untyped_storage().nbytes()
    kv = sum(t.untyped_storage().nbytes() for t in (engine.kv.k, engine.kv.v)) if hasattr(engine.kv, "k") else 0
    with open("/proc/self/status") as f:  # this program's own peak (ru_maxrss also counts the parent's before exec)
        peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    out = {"runtime_mb": round(runtime), "weights_mb": round(weights / 2**20), "kv_mb": round(kv / 2**20),
           "peak_mb": round(peak), "final_mb": round(_rss_mb()), "load_s": round(load_s, 2),
           "peak_anon_mb": round(peaks[0]), "peak_file_mb": round(peaks[1])}
    out["ratio"] = round(peak / (runtime + (weights + kv) / 2**20), 3)
    print(json.dumps(out), flush=True)
    del torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.model, a.max_model_len, a.kv_cache_memory_gb)
        return
    if a.model.endswith(".gguf"):  # the conversion once, in a process of its own
        subprocess.run([sys.executable, "-c", "import sys; from augury.config import EngineConfig; "
                        "from augury.resolve import resolve; resolve(EngineConfig(model=sys.argv[1]))", a.model],
                       check=True)
    subprocess.run([sys.executable, __file__, a.model, "--max-model-len", str(a.max_model_len),
                    "--kv-cache-memory-gb", str(a.kv_cache_memory_gb), "--child"], check=True)


if __name__ == "__main__":
    main()
