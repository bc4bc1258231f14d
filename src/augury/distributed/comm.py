"""One tensor-parallel process group: the collectives a sharded target runs and the command channel.

Two torch.distributed groups over the same ranks:

- the *compute* group (bounded timeout, `dist_timeout`): the sums inside a forward (after each
  row-parallel projection and the vocabulary-parallel embedding) and the logits gathered to rank 0.
  Every rank runs the same forward at the same time, so a rank that does not arrive within the
  timeout is dead or hung.
- the *command* group (no practical timeout): rank 0 broadcasts each target call (what to run, with
  which inputs) to ranks that wait, idle, for as long as the engine has no work.

Where every rank runs on this machine (on CPUs), all of that goes through one shared-memory area
instead (`Shared`: an anonymous memfd of rank 0's, which the others open through /proc, so no
file is left behind however any rank ends): gloo's round trip cost ~2 ms per collective on the 2-core test machine under load
(small all-reduces, measured), and a decode step has 2 per layer. The exchange (forward.cpp): each
rank writes its part into its slot of a double-buffered area, publishes a counter and waits for the
others' (a bounded spin, then yields; the fused stack does this inside its one call); commands go
through a double-buffered mailbox that ranks acknowledge. Waiting ranks spin briefly, then sleep.

Sums are deterministic and the same bits on every rank: parts are added in rank order (gloo with two
ranks adds a + b, the same sum whoever adds), so a row's sum never depends on how many rows travelled
with it (gloo's ring would split a larger tensor into other chunks, and a verified row would then
differ from a decode row). Gloo on CPU, NCCL on CUDA; the command group is gloo either way.

`Group` implements models.llama.Collectives. Every failed collective is re-raised as one RuntimeError
naming the rank the watchdog found dead or silent (distributed/watchdog.py), when it knows one.
"""
from __future__ import annotations

import ctypes
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

COMMAND_BYTES = 8192  # one gloo broadcast carries a command up to this size (a decode step's is ~1 KB)
IDLE_TIMEOUT = timedelta(days=3650)  # ranks wait for the next command as long as the engine idles
EXCHANGE_ROWS = 1024  # rows (tokens) one shared-memory sum carries; larger ones sum through gloo
GATHER_ROWS = 256  # rows of logits one shared-memory gather carries (a verified batch's nodes)
HEADER = 4096  # forward.cpp's Exchange::HEADER: one 64-byte counter line per rank
MAILBOX = 1 << 20  # bytes per command buffer (a longer command goes in pieces)
SPIN_US = 2000  # a rank waiting for the next command spins this long before it sleeps
GRACE = 5.0  # collectives give up this long after the watchdog would have named a silent rank


class Group:
    """This process's tensor-parallel group: rank, size, backend, the torch groups, the shared-memory
    channel where there is one, and the time spent in each kind of collective."""

    def __init__(self, rank: int, size: int, backend: str, device: torch.device, compute, command) -> None:
        self.rank, self.size, self.backend, self.device = rank, size, backend, device
        self.compute, self.command = compute, command
        self.watchdog = None  # set by whoever starts one (launch.py, worker.py): names a failed rank
        self.failure: str | None = None  # the first failure seen, once there is one
        self.shared: Shared | None = None  # every rank on this machine: the shared-memory channel
        self.timeout = 0.0  # the watchdog's; collectives wait a little longer, so that it names the rank
        # seconds and calls per kind of collective (the benchmark's "all-reduce time per step")
        self.seconds = {"all_reduce": 0.0, "command": 0.0, "logits": 0.0}
        self.calls = {"all_reduce": 0, "command": 0, "logits": 0}

    @staticmethod
    def init(store, rank: int, size: int, device: torch.device, timeout: float) -> "Group":
        """Join the process group through `store` (every rank calls this at the same time)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("augury/pg", store), rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout + GRACE))
        compute = dist.group.WORLD
        command = dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT, backend="gloo")
        group = Group(rank, size, backend, device, compute, command)
        group.timeout = timeout
        return group

    # ------------------------------------------------------------------ Collectives (models/llama.py)
    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        with self._failing("all-reduce"):
            if self.shared is not None and t.numel() <= self.shared.cap and t.device.type == "cpu":
                parts = self.shared.exchange(t, self._late)
                torch.add(parts[0], parts[1], out=t) if len(parts) == 2 else _ordered_sum(parts, t)
            elif self.size == 2:
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
        t = t.contiguous()
        with self._failing("logits gather"):
            if self.shared is not None and t.numel() <= self.shared.cap and t.device.type == "cpu":
                parts = [p.view(t.shape) for p in self.shared.exchange(t, self._late)]
                parts = parts if self.rank == 0 else None
            else:
                parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
                dist.gather(t, parts, dst=0, group=self.compute)
        self.seconds["logits"] += time.perf_counter() - t0
        self.calls["logits"] += 1
        if parts is None:
            return None
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def shared_exchange(self):
        return None if self.shared is None else self.shared.kernel_view

    def failed(self, what: str) -> Exception:
        return RuntimeError(self.explain(what, RuntimeError("a rank did not arrive within the timeout")))

    # ------------------------------------------------------------------ rank 0 -> every rank
    def send(self, command: tuple) -> None:
        """Rank 0: hand every rank the next command (see runner.py; tensors travel inside it)."""
        t0 = time.perf_counter()
        data = pickle.dumps(_portable(command), protocol=pickle.HIGHEST_PROTOCOL)
        with self._failing("command"):
            if self.shared is not None:
                self.shared.post(data, self._late)
            else:
                self._broadcast_bytes(data)
        self.seconds["command"] += time.perf_counter() - t0
        self.calls["command"] += 1

    def receive(self) -> tuple:
        """Ranks other than 0: wait (as long as it takes) for rank 0's next command."""
        with self._failing("command"):
            data = self.shared.take() if self.shared is not None else self._broadcast_bytes(None)
        return _restored(pickle.loads(data))

    def _broadcast_bytes(self, data: bytes | None) -> bytes:
        """One gloo broadcast of a fixed-size buffer (length first), a second for what does not fit."""
        buf = torch.zeros(COMMAND_BYTES, dtype=torch.uint8)
        if data is not None:
            buf[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
            head = data[: COMMAND_BYTES - 8]
            if head:
                buf[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.command)
        n = int.from_bytes(bytes(buf[:8].tolist()), "little")
        if n <= COMMAND_BYTES - 8:
            return data if data is not None else bytes(buf[8 : 8 + n].numpy())
        rest = torch.empty(n - (COMMAND_BYTES - 8), dtype=torch.uint8) if data is None else \
            torch.frombuffer(bytearray(data[COMMAND_BYTES - 8 :]), dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=self.command)
        return data if data is not None else bytes(buf[8:].numpy()) + bytes(rest.numpy())

    # ------------------------------------------------------------------ failures and the end
    def _late(self, what: str) -> None:
        raise RuntimeError(f"a rank did not arrive at the {what} within {self.timeout + GRACE:g} s")

    def _failing(self, what: str) -> "_Failing":
        return _Failing(self, what)

    def explain(self, what: str, exc: BaseException) -> str:
        """The one line a failed collective raises: the rank the watchdog found dead or silent, if any."""
        if self.failure is None and self.watchdog is not None:
            self.watchdog.blame()
        if self.failure is not None:
            return self.failure
        return f"tensor-parallel {what} failed on rank {self.rank}: {' '.join(str(exc).split())}"

    def stats(self) -> dict[str, Any]:
        return {"size": self.size, "backend": self.backend + (" + shared memory" if self.shared is not None else ""),
                "rank": self.rank, "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
                "calls": dict(self.calls)}

    def destroy(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group whose peers are gone cannot be torn down politely
                pass
        # and let go of the torch groups now: held here (the model holds this Group), gloo's worker
        # threads outlived destroy_process_group until the interpreter's exit freed them, and a rank that
        # had stopped cleanly then died with "terminate called without an active exception" (SIGABRT),
        # 1 run in 7-14 of tests/test_tp.py's two-machine test
        self.compute = self.command = None


class Shared:
    """The shared-memory channel of the ranks of one machine: one memfd of rank 0's (no name in any
    file system), mapped by every rank. Layout: HEADER bytes of mailbox counters (rank 0's post count, then each rank's
    acknowledgement, a 64-byte line each); from HEADER on, forward.cpp's exchange: HEADER bytes of its
    counters, then two buffers of `size` slots of `cap` floats; then two mailbox buffers (8 bytes of
    length and a last-piece flag, 8 spare, then the data)."""

    def __init__(self, path: Path, rank: int, size: int, cap: int, timeout: float, lib) -> None:
        self.rank, self.size, self.cap, self.timeout_ms = rank, size, cap, int((timeout + GRACE) * 1000)
        self.lib = lib
        nbytes = Shared.nbytes(size, cap)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise RuntimeError(f"cannot open rank 0's shared-memory channel {path} ({e.strerror}); "
                               "AUGURY_TP_SHM=0 makes the ranks sum through gloo instead") from None
        try:
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._raw = raw
        self.base = raw.data_ptr()
        self.counter = torch.zeros(1, dtype=torch.int64)  # this rank's exchanges so far (the kernel's too)
        slots = raw[2 * HEADER : 2 * HEADER + 2 * size * cap * 4].view(torch.float32)
        self.slots = slots.view(2, size, cap)
        box = raw[2 * HEADER + 2 * size * cap * 4 :]
        self.boxes = [box[i * (MAILBOX + 16) : (i + 1) * (MAILBOX + 16)] for i in range(2)]
        self.posts = 0  # mailbox pieces posted (rank 0) or taken (the others) so far
        from augury.models.llama import SharedExchange

        # forward.cpp's exchange (the fused stack's and augury_shm_exchange's) starts at HEADER
        self.kernel_view = SharedExchange(self.base + HEADER, rank, size, cap, self.counter, self.timeout_ms)
        self._exchange_base = ctypes.c_void_p(self.base + HEADER)
        self._abort = self.base + 2 * HEADER - 64  # forward.cpp's Exchange::abort_flag

    def abort(self) -> None:
        """Every rank's waits in this channel end now (a rank has failed: the watchdog's call)."""
        self.lib.publish(self._abort, 1)

    @staticmethod
    def nbytes(size: int, cap: int) -> int:
        return 2 * HEADER + 2 * size * cap * 4 + 2 * (MAILBOX + 16)

    @staticmethod
    def capacity(size: int, hidden: int, vocab_part: int) -> int:
        return max(EXCHANGE_ROWS * hidden, GATHER_ROWS * vocab_part)

    @staticmethod
    def create(size: int, cap: int) -> tuple[int, Path] | None:
        """Rank 0: the zeroed area every rank maps (memory, given only to pages written), as an open
        descriptor and the path the other ranks open it by, /proc/<rank 0>/fd/<fd> (valid while rank 0
        keeps the descriptor). Unlike a /dev/shm file it has no name to leave behind when a rank is
        killed, and a container's small /dev/shm does not limit it. None where there is no memfd."""
        if not hasattr(os, "memfd_create"):
            return None
        fd = os.memfd_create("augury-tp", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, Shared.nbytes(size, cap))
            path = Path(f"/proc/{os.getpid()}/fd/{fd}")
            os.close(os.open(path, os.O_RDWR))  # /proc shows this process's descriptors: the others can open it
        except OSError:
            os.close(fd)
            return None
        return fd, path

    def _counter(self, line: int) -> int:
        """Address of the mailbox's counter `line` (0: posts, 1 + r: rank r's acknowledgements)."""
        return self.base + 64 * line

    # -------------------------------------------------------------- the exchange (sums and gathers)
    def exchange(self, t: torch.Tensor, late) -> list[torch.Tensor]:
        """Every rank's t (this rank's given), in rank order, as views of the shared slots: valid until
        this rank's exchange after next (double buffering)."""
        n = t.numel()
        src = t if t.dtype == torch.float32 else t.float()
        buf = self.lib.exchange(self._exchange_base, self.rank, self.size, self.cap, self.counter.data_ptr(),
                                src.data_ptr(), n, self.timeout_ms)
        if buf < 0:
            late("shared-memory exchange")
        return [self.slots[buf, r, :n].view(t.shape) for r in range(self.size)]

    # -------------------------------------------------------------- the mailbox (rank 0's commands)
    def post(self, data: bytes, late) -> None:
        pieces = [data[i : i + MAILBOX] for i in range(0, len(data), MAILBOX)] or [b""]
        for j, piece in enumerate(pieces):
            k = self.posts + 1
            for r in range(1, self.size):  # the buffer's last piece (k - 2) was taken by every rank
                if self.lib.wait(self._counter(1 + r), k - 2, self.timeout_ms, 0, self._abort):
                    late("command mailbox")
            box = self.boxes[k & 1]
            box[:8].view(torch.int64)[0] = len(piece) | ((j == len(pieces) - 1) << 62)
            if piece:
                ctypes.memmove(box.data_ptr() + 16, piece, len(piece))
            self.lib.publish(self._counter(0), k)
            self.posts = k

    def take(self) -> bytes:
        out = bytearray()
        while True:
            k = self.posts + 1
            if self.lib.wait(self._counter(0), k, 0, SPIN_US, self._abort):  # as long as it takes: the watchdog
                raise RuntimeError("the tensor-parallel ranks were stopped")   # covers rank 0
            box = self.boxes[k & 1]
            word = int(box[:8].view(torch.int64)[0])
            n, last = word & ((1 << 62) - 1), bool(word >> 62)
            out += ctypes.string_at(box.data_ptr() + 16, n)
            self.lib.publish(self._counter(1 + self.rank), k)
            self.posts = k
            if last:
                return bytes(out)


class SharedLib:
    """forward.cpp's shared-memory functions (augury/cpu's forward kernel library), bound here."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        P, I64 = ctypes.c_void_p, ctypes.c_int64
        self.exchange = lib.augury_shm_exchange
        self.exchange.argtypes, self.exchange.restype = [P, I64, I64, I64, P, P, I64, I64], I64
        self.publish = lib.augury_shm_publish
        self.publish.argtypes, self.publish.restype = [P, I64], None
        self.wait = lib.augury_shm_wait
        self.wait.argtypes, self.wait.restype = [P, I64, I64, I64, P], ctypes.c_int

    @staticmethod
    def load() -> "SharedLib | None":
        """None where augury's forward kernel does not run here (the ranks then use gloo alone)."""
        from augury.cpu import kernels as cpu_kernels

        kernel = cpu_kernels.forward()
        if kernel is None:
            return None
        try:
            return SharedLib(str(kernel.path))
        except (OSError, AttributeError):
            return None


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
    """Tensors (CPU) as raw bytes with their dtype and shape, recursively, for a compact pickle."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        return _Array(t.view(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8),
                      str(t.dtype).removeprefix("torch."), tuple(t.shape))
    if isinstance(x, (list, tuple)):
        return type(x)(_portable(v) for v in x)
    return x


def _restored(x):
    if isinstance(x, _Array):
        dtype = getattr(torch, x.dtype)
        if not x.data.size:
            return torch.empty(x.shape, dtype=dtype)
        return torch.from_numpy(x.data).view(dtype).view(x.shape)
    if isinstance(x, (list, tuple)):
        return type(x)(_restored(v) for v in x)
    return x


class _Array:
    """A tensor in transit: its bytes (numpy pickles them with no torch storage machinery), dtype, shape."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
        self.data, self.dtype, self.shape = data, dtype, shape

    def __getstate__(self):
        return self.data, self.dtype, self.shape

    def __setstate__(self, state) -> None:
        self.data, self.dtype, self.shape = state
