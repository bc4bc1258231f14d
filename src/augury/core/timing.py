"""Wall-clock reads that wait for the device: on CUDA, time.perf_counter alone would time kernel
launches, not the kernels. Every timer that feeds a decision (the adaptive policy's cost model,
its step times) reads this clock."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def clock(device: torch.device) -> float:
    """perf_counter seconds, after everything queued on `device` has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_call(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    """Median seconds of `reps` calls (an odd count, at least 3: a median of two is their mean) after
    one warm-up call, each timed to the device's completion."""
    if reps < 3 or reps % 2 == 0:
        raise ValueError(f"time_call needs an odd number of repeats >= 3, got {reps}")
    fn()
    times = []
    for _ in range(reps):
        t = clock(device)
        fn()
        times.append(clock(device) - t)
    return statistics.median(times)
