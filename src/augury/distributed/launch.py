"""Starting, joining and stopping the tensor-parallel ranks (rank 0's side; worker.py is the others').

Start-up (builder.py's stages): "configuration" checks the numbers (`check`: ranks against cores or
GPUs, heads, vocabulary); "tensor parallel" (`Ranks.start`) runs the rendezvous store, starts this
machine's other ranks as fresh processes (`python -m augury.distributed.worker`, pinned to their
cores, killed with their parent), waits for every rank to join and forms the process group; the ranks
load their shards while rank 0 loads its own ("target"), and `wait_loaded` collects their verdicts:
a rank that failed names itself and its cause, and every local rank is stopped, so nothing is left
running or listening. "KV cache" ends with `attach`: the cache size goes to every rank, and the engine
gets rank 0's stand-ins (runner.py).

Faults after start-up: the watchdog (watchdog.py) reports a dead or silent rank; rank 0 then kills
its local ranks (so a collective waiting on them fails at once) and, where augury owns the process
(`augury serve`, `generate`, `bench`: `exit_on_failure()`), prints one line naming the rank and
exits; inside a Python program the next or current call raises a RuntimeError with that line.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch

from augury.config import EngineConfig
from augury.distributed import topology
from augury.distributed.comm import Group, Shared, SharedLib
from augury.distributed.rendezvous import HELLO, SPEC_KEY, STATUS, rank_device, spawn_local, start_timeout
from augury.distributed.topology import Topology
from augury.distributed.watchdog import Watchdog, exit_description

log = logging.getLogger("augury.distributed")

_exit_on_failure = False
_active: "Ranks | None" = None  # this process's group (torch.distributed allows one default group)


def exit_on_failure() -> None:
    """This process belongs to augury (a CLI command): a failed rank ends it with one line."""
    global _exit_on_failure
    _exit_on_failure = True


def status() -> dict:
    """Tensor parallelism as /server_info and /metrics show it: ranks, backend, collective times."""
    if _active is None or _active.group is None:
        return {"size": 1, "backend": None}
    return _active.group.stats()


@dataclass(frozen=True)
class ModelSpec:
    """What every rank loads, as rank 0 decided it (published in the store: machines may differ)."""

    dtype: str
    max_len: int
    quantization: str
    device_type: str
    timeout: float
    exchange: str | None = None  # the shared-memory channel's file, where every rank is on this machine
    exchange_cap: int = 0  # floats per rank's slot in it (comm.Shared)


def check(config: EngineConfig, tcfg, device: torch.device) -> Topology:
    """The configuration stage's checks: the ranks fit this machine and the model splits among them
    (ValueError naming the numbers)."""
    from augury.models.llama import plan_shards

    plan_shards(tcfg, topology.requested_size(config))
    cuda = torch.cuda.device_count() if device.type == "cuda" else 0
    topo = topology.plan(config, device.type, cuda)
    if topo.rank == 0 and torch.distributed.is_initialized():
        raise ValueError("this process already belongs to a torch.distributed group (one tensor-parallel "
                         "engine per process); close the other LLM first")
    return topo


class Ranks:
    """Rank 0's handle on the tensor-parallel ranks: the store, its local workers, the group."""

    def __init__(self, topo: Topology, store, spec: ModelSpec, children: dict[int, subprocess.Popen],
                 exchange_fd: int | None = None) -> None:
        self.topo, self.store, self.spec, self.children = topo, store, spec, children
        self.exchange_fd = exchange_fd  # the shared-memory channel's memfd, open until every rank has mapped it
        self.group: Group | None = None
        self.watchdog: Watchdog | None = None
        self.shard = None
        self.serving = False  # after start-up a failed rank may end the process (exit_on_failure)
        self.closed = False
        self._threads = torch.get_num_threads()
        self._affinity = topology.available_cores()

    # ------------------------------------------------------------------ start-up
    @staticmethod
    def start(config: EngineConfig, topo: Topology, folder: Path, device: torch.device, dtype: torch.dtype,
              max_len: int, quantization: str) -> "Ranks":
        """Start (or join) the ranks. On a rank other than 0 (another machine, or torchrun's) this runs
        that rank until rank 0 stops it, then raises SystemExit."""
        global _active
        if topo.rank != 0:
            from augury.distributed.worker import run_node

            raise SystemExit(run_node(topo, folder))
        import torch.distributed as dist

        from augury.config import tp_shared_memory_enabled
        from augury.models.config import TargetConfig
        from augury.models.llama import plan_shards

        tcfg = TargetConfig.from_folder(folder)
        store = dist.TCPStore(topo.host, topo.port, None, topo.hosts_store, wait_for_workers=False,
                              timeout=timedelta(seconds=start_timeout(config.dist_timeout, topo.nnodes)))
        if topo.hosts_store:
            topo = _with_port(topo, store.port)
        area, shards = None, plan_shards(tcfg, topo.size)
        cap = Shared.capacity(topo.size, tcfg.hidden_size, max(shards[0].vocab_sizes))
        if topo.nnodes == 1 and device.type == "cpu" and tp_shared_memory_enabled() and SharedLib.load() is not None:
            area = Shared.create(topo.size, cap)
            if area is None:
                log.warning("tensor parallelism: no memfd or /proc here for the shared-memory channel; the ranks "
                            "sum through gloo instead (slower)")
        exchange = None if area is None else area[1]
        spec = ModelSpec(str(dtype).removeprefix("torch."), max_len, quantization, device.type, config.dist_timeout,
                         None if exchange is None else str(exchange), cap)
        ranks = Ranks(topo, store, spec, {}, None if area is None else area[0])
        _active = ranks
        try:
            store.set(SPEC_KEY, json.dumps(asdict(spec)))
            if not topo.torchrun:  # torchrun started every rank itself
                ranks.children.update(spawn_local(topo, folder, skip_first=True))
            topology.pin(topo.cores[0])
            torch.set_num_threads(topo.threads_of(0))
            ranks._wait("join", [HELLO.format(r) for r in range(1, topo.size)])
            ranks.group = Group.init(store, 0, topo.size, rank_device(device, 0), spec.timeout)
            ranks.watchdog = Watchdog(topo.host, topo.port, 0, list(range(1, topo.size)), spec.timeout,
                                      ranks.children, ranks._failed)
            ranks.group.watchdog = ranks.watchdog
            ranks.watchdog.start()
            if exchange is not None:
                ranks.group.shared = Shared(exchange, 0, topo.size, cap, spec.timeout, SharedLib.load())
            ranks.shard = shards[0]
        except BaseException:
            ranks.close()
            raise
        log.info("tensor parallelism: %d ranks (%s%s), %d on this machine, %d threads each, store %s:%d",
                 topo.size, ranks.group.backend, " + shared memory" if exchange is not None else "",
                 topo.per_node, topo.threads_of(0), topo.host, topo.port)
        return ranks

    def wait_loaded(self) -> None:
        """Every other rank has loaded its shard, or a RuntimeError names the first that failed."""
        self._wait("load", [STATUS.format(r) for r in range(1, self.topo.size)])
        self._release_exchange()  # every rank has mapped it (or failed): its path is no longer needed
        for r in range(1, self.topo.size):
            verdict = self.store.get(STATUS.format(r)).decode()
            if verdict != "ok":
                raise RuntimeError(f"tensor-parallel rank {r} failed to load its shard: {verdict.removeprefix('error: ')}")

    def _release_exchange(self) -> None:
        """Close rank 0's descriptor of the channel: the memory lives on in the ranks' mappings alone."""
        if self.exchange_fd is not None:
            os.close(self.exchange_fd)
            self.exchange_fd = None

    def _wait(self, what: str, keys: list[str]) -> None:
        deadline = time.monotonic() + start_timeout(self.spec.timeout, self.topo.nnodes)
        pending = list(keys)
        while pending:
            pending = [k for k in pending if not self.store.check([k])]
            if not pending:
                return
            for r, proc in self.children.items():
                code = proc.poll()
                if code is not None:
                    raise RuntimeError(f"tensor-parallel rank {r} (pid {proc.pid}) {exit_description(code)} "
                                       f"before it could {what}")
            if self.group is not None and self.group.failure:
                raise RuntimeError(self.group.failure)
            if time.monotonic() > deadline:
                missing = ", ".join(k.rsplit("/", 1)[-1] for k in pending)
                raise RuntimeError(f"tensor-parallel rank(s) {missing} did not {what} within "
                                   f"{start_timeout(self.spec.timeout, self.topo.nnodes):.0f} s")
            time.sleep(0.05)

    def wrap(self, model, folder: Path):
        """Rank 0's stand-in for the target (every call also sent to the other ranks; its embed_tokens
        the whole embedding, for a replicated EAGLE-3 head); stopping it stops every rank."""
        from augury.distributed.runner import ShardedTarget

        return ShardedTarget(model, self.group, folder, self.close)

    def attach(self, kv, attention, num_blocks: int, block_size: int):
        """Size every rank's cache and give the engine rank 0's stand-ins: (kv, attention)."""
        from augury.distributed.runner import ReplayedBackend, ShardedKV

        self.group.send(("setup", num_blocks, block_size, str(kv.k.dtype).removeprefix("torch.")))
        self.serving = True
        return ShardedKV(kv, self.group), ReplayedBackend(attention)

    # ------------------------------------------------------------------ faults and the end
    def _failed(self, line: str) -> None:
        """The watchdog's report (its thread): stop the local ranks, then raise or exit."""
        if self.group is not None:
            self.group.failure = line
            if self.group.shared is not None:
                self.group.shared.abort()  # this rank's own waits in shared memory end now
        log.error("%s", line)
        self._kill_children()
        if _exit_on_failure and self.serving:
            print(f"augury: error: {line}; every rank stopped", file=sys.stderr, flush=True)
            os._exit(1)

    def _kill_children(self) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.children.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Stop every rank (politely when they are all well, else by killing the local ones) and give
        back the process group, this thread's cores and torch's thread count."""
        global _active
        if self.closed:
            return
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.serving and self.group is not None and not self.group.failure:
            try:
                self.group.send(("stop",))
            except Exception:  # noqa: BLE001 - a rank already gone: the kill below is all there is
                pass
            for proc in self.children.values():
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self._kill_children()
        self._release_exchange()
        if self.group is not None:
            self.group.destroy()
        topology.pin(tuple(self._affinity))
        torch.set_num_threads(self._threads)
        if _active is self:
            _active = None


def _with_port(topo: Topology, port: int) -> Topology:
    from dataclasses import replace

    return replace(topo, port=port)
