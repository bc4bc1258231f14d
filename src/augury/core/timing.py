"""Wall-clock reads that wait for the device: on CUDA, time.perf_counter alone would time kernel
launches, not the kernels. Every timer that feeds the adaptive policy's decisions (its measured
step times) reads this clock."""
from __future__ import annotations

import time

import torch


def clock(device: torch.device) -> float:
    """perf_counter seconds, after everything queued on `device` has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

