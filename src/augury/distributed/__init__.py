"""Tensor parallelism over torch.distributed: one model split across processes and machines.

- topology.py: where the ranks are (one machine, --nnodes/--node-rank/--dist-init-addr, torchrun),
  their cores and threads (torch-free)
- comm.py: the process group: deterministic sums, the logits gather, rank 0's command channel
- launch.py: rank 0 starts, joins, checks and stops the ranks (builder.py's stages call it)
- worker.py: a rank other than 0 (`python -m augury.distributed.worker`)
- runner.py: rank 0's stand-ins for the engine's model, cache and attention backend, and the
  command loop of the other ranks
- watchdog.py: heartbeats; a dead or silent rank stops every rank with one line naming it

models/llama.py holds the shards themselves (plan_shards, row- and column-parallel layers); it never
imports this package: the builder hands it a group (`models.llama.Collectives`).
"""
from __future__ import annotations

import sys


def status() -> dict:
    """This process's tensor parallelism: {"size": 1, "backend": None} without it, else its size,
    backend, rank and the seconds spent in collectives (read by /server_info and /metrics)."""
    launch = sys.modules.get("augury.distributed.launch")  # never imported: no tensor parallelism
    return launch.status() if launch is not None else {"size": 1, "backend": None}
