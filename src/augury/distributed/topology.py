"""Where the ranks are: this process's rank, the rendezvous address, the cores and threads per rank.

Three ways to be started, one result (`Topology`):

- one machine, `tensor_parallel_size=N`: this process is rank 0 and starts ranks 1..N-1 itself;
- several machines, the same command on each with `--nnodes M --node-rank k --dist-init-addr
  host:port` (SGLang's names): node k's process is rank k*N/M and starts that node's other ranks;
  node 0's hosts the rendezvous store at host:port;
- under torchrun (its RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT): every process is one
  rank, started by torchrun, and the store is torchrun's.

Cores: the CPUs this process may run on (its affinity) split into N/M contiguous sets, one per local
rank, each rank pinned to its set with `threads` = the set's size unless --threads says otherwise.
Torch-free.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from augury.config import EngineConfig

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Topology:
    size: int  # ranks in all
    rank: int  # this process's
    nnodes: int
    per_node: int  # ranks per machine
    host: str  # the rendezvous store
    port: int  # 0: rank 0 picks a free port (one machine)
    hosts_store: bool  # this process runs the store's server
    torchrun: bool
    cores: tuple[tuple[int, ...], ...]  # per local rank, this machine's
    threads: int | None  # torch threads per rank (--threads); None: each rank's core count

    def threads_of(self, local: int) -> int:
        return self.threads or len(self.cores[local])

    @property
    def node_rank(self) -> int:
        return self.rank // self.per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.per_node

    def local_ranks(self) -> list[int]:
        """This machine's ranks, this process's first."""
        first = self.node_rank * self.per_node
        return [self.rank] + [r for r in range(first, first + self.per_node) if r != self.rank]


def under_torchrun() -> bool:
    return all(os.environ.get(v) for v in TORCHRUN_VARS) and int(os.environ["WORLD_SIZE"]) > 1


def requested_size(config: EngineConfig) -> int:
    """The number of ranks asked for: torchrun's WORLD_SIZE when started by it, else the config's."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if config.tensor_parallel_size not in (1, world):
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} differs from torchrun's "
                             f"WORLD_SIZE {world}")
        return world
    return config.tensor_parallel_size


def available_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def plan(config: EngineConfig, device_type: str, cuda_devices: int = 0) -> Topology:
    """This process's place among the ranks; ValueError naming the numbers that do not fit."""
    size = requested_size(config)
    if under_torchrun():
        rank = int(os.environ["RANK"])
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or size)
        nnodes = max(1, size // per_node)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # torchrun's agent runs the store (TORCHELASTIC_USE_AGENT_STORE); plain env:// has rank 0 run it
        hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
        torchrun = True
        local = int(os.environ.get("LOCAL_RANK", rank % per_node))
        rank_check = local == rank % per_node
        if not rank_check:
            raise ValueError(f"torchrun's LOCAL_RANK {local} is not RANK {rank} modulo LOCAL_WORLD_SIZE {per_node}")
    else:
        nnodes, node = config.nnodes, config.node_rank
        if size % nnodes:
            raise ValueError(f"tensor_parallel_size {size} is not a multiple of nnodes {nnodes}")
        per_node = size // nnodes
        rank = node * per_node
        if nnodes > 1:
            host, port = _address(config.dist_init_addr)
        elif config.dist_init_addr:
            host, port = _address(config.dist_init_addr)
        else:
            host, port = "127.0.0.1", 0
        hosts, torchrun = rank == 0, False
    cores = available_cores()
    if device_type == "cuda":
        if cuda_devices < per_node:
            raise ValueError(f"tensor_parallel_size {size} needs {per_node} CUDA devices on this machine, "
                             f"which has {cuda_devices}")
    elif per_node > len(cores):
        raise ValueError(f"tensor_parallel_size {size} needs {per_node} ranks on this machine, more than its "
                         f"{len(cores)} CPU cores (one rank per core at least); choose at most {len(cores)}")
    sets = tuple(tuple(cores[i * len(cores) // per_node : (i + 1) * len(cores) // per_node]) for i in range(per_node))
    return Topology(size, rank, nnodes, per_node, host, port, hosts, torchrun, sets, config.threads)


def _address(addr: str | None) -> tuple[str, int]:
    if not addr:
        raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0's rendezvous)")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def pin(cores: tuple[int, ...]) -> bool:
    """Pin the calling thread (and the threads it starts later) to `cores`; False where the OS says no."""
    try:
        os.sched_setaffinity(0, cores)
        return True
    except (AttributeError, OSError):
        return False
