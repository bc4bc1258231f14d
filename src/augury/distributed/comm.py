"""One tensor-parallel process group: the collectives a sharded target runs and the command channel.

Two torch.distributed groups over the same ranks:

- the *compute* group (bounded timeout, `dist_timeout`): the sums inside a forward (after each
  row-parallel projection and the vocabulary-parallel embedding), the hidden rows rank 0 hands out
  for logits and the logits gathered back. Every rank runs the same forward at the same time, so a
  rank that does not arrive within the timeout is dead or hung.
- the *command* group (no practical timeout): rank 0 broadcasts each step's plan (what to run, with
  which inputs) to ranks that wait, idle, for as long as the engine has no work.

Sums are deterministic and the same bits on every rank: two ranks add a + b (commutative, hence one
result whoever adds); more ranks gather every part and add them in rank order, so a row's sum never
depends on how many rows travelled with it (gloo's ring would split a larger tensor into other
chunks, and a verified row would then differ from a decode row). Gloo on CPU, NCCL on CUDA; the
command group is gloo either way (its buffers live on the CPU).

`Group` implements models.llama.Collectives. Every failed collective is re-raised as one RuntimeError
naming the rank the watchdog found dead or silent (distributed/watchdog.py), when it knows one.
"""
from __future__ import annotations

import mmap
import os
import pickle
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

COMMAND_BYTES = 8192  # one broadcast carries a command up to this size (a decode step's is ~1 KB)
IDLE_TIMEOUT = timedelta(days=3650)  # ranks wait for the next command as long as the engine idles
EXCHANGE_ROWS = 1024  # rows (tokens) one shared-memory exchange carries; larger steps sum through gloo
EXCHANGE_HEADER = 4096  # forward.cpp's Exchange::HEADER: one 64-byte counter line per rank


class Group:
    """This process's tensor-parallel group: rank, size, backend, the two torch groups, timings."""

    def __init__(self, rank: int, size: int, backend: str, device: torch.device, compute, command) -> None:
        self.rank, self.size, self.backend, self.device = rank, size, backend, device
        self.compute, self.command = compute, command
        self.watchdog = None  # set by whoever starts one (launch.py): names a failed rank
        self.failure: str | None = None  # the first failure seen, once there is one
        self.exchange = None  # models.llama.SharedExchange where every rank is on this machine (map_exchange)
        self._mapping: mmap.mmap | None = None
        # seconds and calls per kind of collective (the benchmark's "all-reduce time per step")
        self.seconds = {"all_reduce": 0.0, "command": 0.0, "logits": 0.0}
        self.calls = {"all_reduce": 0, "command": 0, "logits": 0}

    @staticmethod
    def init(store, rank: int, size: int, device: torch.device, timeout: float) -> "Group":
        """Join the process group through `store` (every rank calls this at the same time)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("augury/pg", store), rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout))
        compute = dist.group.WORLD
        command = dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT, backend="gloo")
        return Group(rank, size, backend, device, compute, command)

    # ------------------------------------------------------------------ Collectives (models/llama.py)
    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        with self._failing("all-reduce"):
            if self.size == 2:
                dist.all_reduce(t, group=self.compute)
            else:
                parts = [torch.empty_like(t) for _ in range(self.size)]
                dist.all_gather(parts, t, group=self.compute)
                _ordered_sum(parts, t)
        self.seconds["all_reduce"] += time.perf_counter() - t0
        self.calls["all_reduce"] += 1
        return t

    def gather_vocab(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        t0 = time.perf_counter()
        width = max(sizes)
        if t.shape[-1] < width:
            t = torch.cat([t, t.new_zeros(*t.shape[:-1], width - t.shape[-1])], dim=-1)
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        with self._failing("logits gather"):
            dist.gather(t.contiguous(), parts, dst=0, group=self.compute)
        self.seconds["logits"] += time.perf_counter() - t0
        self.calls["logits"] += 1
        if parts is None:
            return None
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def shared_exchange(self):
        return self.exchange

    def failed(self, what: str) -> Exception:
        return RuntimeError(self.explain(what, RuntimeError("a rank did not arrive within the timeout")))

    # ------------------------------------------------------------------ shared memory (one machine)
    @staticmethod
    def exchange_bytes(size: int, hidden: int) -> tuple[int, int]:
        """(floats per slot, bytes of the mapping) for `size` ranks and a hidden size."""
        cap = EXCHANGE_ROWS * hidden
        return cap, EXCHANGE_HEADER + 2 * size * cap * 4

    @staticmethod
    def create_exchange(path: Path, size: int, hidden: int) -> None:
        """Rank 0: the zeroed file every rank of this machine maps (under /dev/shm: memory, not disk)."""
        _, nbytes = Group.exchange_bytes(size, hidden)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)

    def map_exchange(self, path: Path, hidden: int, timeout: float) -> None:
        """Map the exchange file (every rank, before rank 0 removes its name)."""
        from augury.models.llama import SharedExchange

        cap, nbytes = Group.exchange_bytes(self.size, hidden)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        view = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._view = view  # keeps the buffer exported (its address is what the kernel gets)
        self.exchange = SharedExchange(view.data_ptr(), self.rank, self.size, cap, torch.zeros(1, dtype=torch.int64),
                                       int(timeout * 1000))

    # ------------------------------------------------------------------ rank 0 -> every rank
    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor into every rank's `t` (same shape and dtype), as bytes."""
        t0 = time.perf_counter()
        with self._failing("broadcast"):
            dist.broadcast(t.view(-1).view(torch.uint8), src=0, group=self.compute)
        self.seconds["logits"] += time.perf_counter() - t0
        return t

    def send(self, command: tuple) -> None:
        """Rank 0: hand every rank the next command (see runner.py); one broadcast when it is small."""
        t0 = time.perf_counter()
        data = pickle.dumps(_portable(command), protocol=pickle.HIGHEST_PROTOCOL)
        buf = torch.zeros(COMMAND_BYTES, dtype=torch.uint8)
        buf[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        head = data[: COMMAND_BYTES - 8]
        buf[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        with self._failing("command"):
            dist.broadcast(buf, src=0, group=self.command)
            if len(data) > len(head):
                rest = torch.frombuffer(bytearray(data[len(head):]), dtype=torch.uint8)
                dist.broadcast(rest, src=0, group=self.command)
        self.seconds["command"] += time.perf_counter() - t0
        self.calls["command"] += 1

    def receive(self) -> tuple:
        """Ranks other than 0: wait (as long as it takes) for rank 0's next command."""
        buf = torch.empty(COMMAND_BYTES, dtype=torch.uint8)
        with self._failing("command"):
            dist.broadcast(buf, src=0, group=self.command)
            n = int.from_bytes(bytes(buf[:8].tolist()), "little")
            data = bytes(buf[8 : 8 + min(n, COMMAND_BYTES - 8)].numpy())
            if n > COMMAND_BYTES - 8:
                rest = torch.empty(n - (COMMAND_BYTES - 8), dtype=torch.uint8)
                dist.broadcast(rest, src=0, group=self.command)
                data += bytes(rest.numpy())
        return _restored(pickle.loads(data))

    # ------------------------------------------------------------------ failures and the end
    def _failing(self, what: str) -> "_Failing":
        return _Failing(self, what)

    def explain(self, what: str, exc: BaseException) -> str:
        """The one line a failed collective raises: the rank the watchdog found dead or silent, if any."""
        if self.failure is None and self.watchdog is not None:
            self.watchdog.check_now()
        if self.failure is not None:
            return self.failure
        return f"tensor-parallel {what} failed on rank {self.rank}: {' '.join(str(exc).split())}"

    def stats(self) -> dict[str, Any]:
        return {"size": self.size, "backend": self.backend, "rank": self.rank,
                "seconds": {k: round(v, 6) for k, v in self.seconds.items()}, "calls": dict(self.calls)}

    def destroy(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group whose peers are gone cannot be torn down politely
                pass


class _Failing:
    """Context: a collective's exception becomes one RuntimeError naming the failed rank."""

    def __init__(self, group: Group, what: str) -> None:
        self.group, self.what = group, what

    def __enter__(self) -> None:
        if self.group.failure is not None:
            raise RuntimeError(self.group.failure)

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and isinstance(exc, Exception) and not isinstance(exc, (ValueError, TypeError)):
            raise RuntimeError(self.group.explain(self.what, exc)) from exc
        return False


def _ordered_sum(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """out = parts[0] + parts[1] + ... in rank order (the same bits on every rank)."""
    out.copy_(parts[0])
    for p in parts[1:]:
        out.add_(p)


def _portable(x):
    """Tensors (CPU) as numpy arrays, recursively, for a compact pickle."""
    if isinstance(x, torch.Tensor):
        return _Array(x.detach().cpu().numpy())
    if isinstance(x, (list, tuple)):
        return type(x)(_portable(v) for v in x)
    return x


def _restored(x):
    if isinstance(x, _Array):
        return torch.from_numpy(x.a)
    if isinstance(x, (list, tuple)):
        return type(x)(_restored(v) for v in x)
    return x


class _Array:
    """A tensor in transit (numpy pickles in a few hundred bytes, with no torch storage machinery)."""

    __slots__ = ("a",)

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __getstate__(self):
        return self.a

    def __setstate__(self, a) -> None:
        self.a = a
