"""A tensor-parallel rank other than 0: join, load this rank's shard, replay rank 0's commands, leave.

`python -m augury.distributed.worker '<json>'` is how rank 0 (or another machine's first rank) starts
a local rank; `run_node` is what a process that *is* a rank other than 0 runs in place (the first rank
of machine k > 0, or any rank torchrun started). The rank pins itself to its cores and sets its
thread count before anything starts threads, says hello in the store, joins the process group,
starts its watchdog, builds the CPU kernels, loads its shard and reports "ok" or its error in the
store (rank 0 stops start-up with that line), then serves commands (runner.serve_commands) until
rank 0 says stop. A rank started this way ignores SIGINT and SIGTERM: its starter stops it. A failure after that prints one line naming this rank and exits: rank 0's watchdog
reports it, and every rank stops.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    args = json.loads((sys.argv[1:] if argv is None else argv)[0])
    import signal

    # a rank augury started stops when its starter says so (or dies): a Ctrl-C or SIGTERM sent to the whole
    # process group is the starter's to act on (it drains first). Also set before exec where it can be.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from augury.distributed import topology

    topology.pin(tuple(args["cores"]))  # before torch starts a thread: they all inherit it
    return run_rank(args["rank"], args["size"], args["nnodes"], args["host"], args["port"], Path(args["folder"]),
                    args["threads"], args["per_node"])


def run_node(topo, folder: Path) -> int:
    """This process is rank topo.rank (not 0): start this machine's other ranks if augury launches
    them (not under torchrun), then be a rank; the exit status."""
    from augury.distributed import topology
    from augury.distributed.rendezvous import spawn_local

    children = {} if topo.torchrun else spawn_local(topo, folder, skip_first=True)
    topology.pin(topo.cores[topo.local_rank])
    try:
        return run_rank(topo.rank, topo.size, topo.nnodes, topo.host, topo.port, folder,
                        topo.threads_of(topo.local_rank), topo.per_node, children)
    finally:
        for proc in children.values():
            if proc.poll() is None:
                proc.kill()


def run_rank(rank: int, size: int, nnodes: int, host: str, port: int, folder: Path, threads: int, per_node: int,
             children: dict | None = None) -> int:
    import torch
    import torch.distributed as dist

    from augury.config import injected_fault_stage, one_line
    from augury.distributed.comm import Group
    from augury.distributed.rendezvous import HELLO, SPEC_KEY, STATUS, rank_device, start_timeout
    from augury.distributed.watchdog import Watchdog

    torch.set_num_threads(threads)
    store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=start_timeout(0, nnodes)))
    store.set(HELLO.format(rank), str(os.getpid()))
    spec = json.loads(store.get(SPEC_KEY))
    device = rank_device(torch.device(spec["device_type"]), rank % per_node)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = Group.init(store, rank, size, device, spec["timeout"])

    def failed(line: str) -> None:  # the watchdog's thread: this rank cannot go on
        group.failure = line
        print(f"augury: error: {line}; rank {rank} stops", file=sys.stderr, flush=True)
        for proc in (children or {}).values():
            if proc.poll() is None:
                proc.kill()
        os._exit(1)

    watchdog = Watchdog(host, port, rank, [0], spec["timeout"], children or {}, failed)
    group.watchdog = watchdog
    watchdog.start()
    try:
        dtype = getattr(torch, spec["dtype"])
        if device.type == "cpu":
            from augury.cpu import kernels as cpu_kernels

            cpu_kernels.load_all()
        if injected_fault_stage() == f"target@rank{rank}":  # test hook: this rank fails to load
            raise RuntimeError(f"fault injected at stage 'target' on rank {rank}")
        from augury.core.kv_cache import KVCache
        from augury.attention import PagedBackend
        from augury.models.config import TargetConfig
        from augury.models.llama import plan_shards
        from augury.models.loader import load_target

        cfg = TargetConfig.from_folder(folder)
        shard = plan_shards(cfg, size)[rank]
        model, _ = load_target(folder, dtype, device, spec["max_len"], spec["quantization"], shard, group)
        if spec.get("exchange"):  # every rank on this machine: collectives and commands in shared memory
            from augury.distributed.comm import Shared, SharedLib

            lib = SharedLib.load()
            if lib is None:
                raise RuntimeError("rank 0 uses the shared-memory channel, but augury's forward kernel does not "
                                   "load on this rank")
            group.shared = Shared(Path(spec["exchange"]), rank, size, spec["exchange_cap"], spec["timeout"], lib)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which stops start-up naming this rank
        store.set(STATUS.format(rank), "error: " + one_line(e))
        watchdog.stop()
        return 1
    store.set(STATUS.format(rank), "ok")

    def make_cache(num_blocks: int, block_size: int, kv_dtype: str):  # rank 0's sizes and dtype (--kv-cache-dtype)
        kv = KVCache(cfg.num_layers, num_blocks, block_size, model.cfg.num_kv_heads, model.cfg.head_dim,
                     getattr(torch, kv_dtype), device)
        return kv, PagedBackend(kv.k, kv.v, block_size)

    from augury.distributed.runner import serve_commands

    try:
        serve_commands(group, model, make_cache)
    except Exception as e:  # noqa: BLE001 - one line naming this rank (and the rank it lost, if known)
        if group.failure is None:
            print(f"augury: error: tensor-parallel rank {rank}: {one_line(e)}", file=sys.stderr, flush=True)
        watchdog.stop()
        os._exit(1)
    watchdog.stop()
    group.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
