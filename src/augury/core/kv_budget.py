"""How big the KV cache is: sized once at start-up from what the configuration can use and what the
machine has, and how long a request may then be (max_model_len).

Torch-free and pure apart from `available_memory`, so the rule is tested on its numbers alone.

The rule, in order (the first that applies):
- `--num-kv-blocks N`: N blocks.
- `--kv-cache-memory-gb G`: G GiB, or less when max_num_seqs requests of the full context need less.
- automatic: room for DEFAULT_SEQUENCES requests of the full context (max_num_seqs if fewer), or
  DEFAULT_FLOOR_BYTES if that is more and the requests can use it (a small model's contexts are
  cheap); never more than MEMORY_FRACTION of the memory available once the weights are loaded.

A lone request must fit whole, its draft-tree slack included. A max_model_len the user gave that
does not fit is an error naming both numbers; an automatic one (not given: the model's context) is
lowered to what fits, and the start-up line says so.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MIB = 2**20
GIB = 2**30
DEFAULT_SEQUENCES = 2
DEFAULT_FLOOR_BYTES = 256 * MIB
MEMORY_FRACTION = 0.5


@dataclass(frozen=True)
class KVPlan:
    """The cache's size and the context it leaves. `sizing` says in words what bounded it."""

    num_blocks: int  # block 0 included (reserved for padding writes)
    block_size: int
    bytes_per_token: int  # K and V of every layer (the draft head's too), in the cache's dtype
    max_model_len: int
    model_len: int  # what max_model_len would be with room enough (given, or the model's context)
    sizing: str

    @property
    def tokens(self) -> int:
        """Token slots requests can hold (block 0 is never handed out)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def lowered(self) -> bool:
        return self.max_model_len < self.model_len

    def line(self, dtype: str) -> str:
        """The start-up line."""
        ctx = f"max_model_len {self.max_model_len:,}"
        if self.lowered:
            ctx += (f" (the model's {self.model_len:,} lowered to what the cache holds; raise "
                    "--kv-cache-memory-gb for more)")
        return (f"KV cache: {self.tokens:,} tokens ({self.num_blocks:,} blocks of {self.block_size}, {dtype}, "
                f"{self.nbytes / MIB:,.0f} MiB reserved, taken as written; {self.sizing}); {ctx}")

    def describe(self, dtype: str) -> dict[str, object]:
        """/server_info's view."""
        return {"tokens": self.tokens, "num_blocks": self.num_blocks, "block_size": self.block_size,
                "dtype": dtype, "bytes": self.nbytes, "bytes_per_token": self.bytes_per_token,
                "sizing": self.sizing, "max_model_len": self.max_model_len,
                "max_model_len_lowered_from": self.model_len if self.lowered else None}


def plan_kv_cache(*, bytes_per_token: int, block_size: int, max_num_seqs: int, model_len: int,
                  len_given: bool, num_kv_blocks: int | None, memory_gb: float | None,
                  available_bytes: int | None, slack: int, min_context: int) -> KVPlan:
    """Size the cache (see the module docstring). model_len: the max_model_len asked for (len_given)
    or the model's context; slack: slots a request may use past its context (a draft tree)."""
    per_block = bytes_per_token * block_size
    seq_blocks = -(-(model_len + slack) // block_size)
    needed = max_num_seqs * seq_blocks + 1  # every request at the full context (+ the reserved block)
    if num_kv_blocks is not None:
        num_blocks, sizing = num_kv_blocks, f"--num-kv-blocks {num_kv_blocks}"
    elif memory_gb is not None:
        budget = int(memory_gb * GIB) // per_block
        num_blocks = max(2, min(needed, budget))
        sizing = (f"--kv-cache-memory-gb {memory_gb:g}" if budget < needed
                  else f"what {max_num_seqs} request(s) of the full context need, under --kv-cache-memory-gb "
                       f"{memory_gb:g}")
        if available_bytes is not None and num_blocks * per_block > available_bytes:
            sizing += f"; more than the {available_bytes / GIB:.1f} GiB available"
    else:
        seqs = min(max_num_seqs, DEFAULT_SEQUENCES)
        want = max(seqs * seq_blocks + 1, -(-DEFAULT_FLOOR_BYTES // per_block))
        sizing = (f"automatic: {seqs} request(s) of the full context" if want == seqs * seq_blocks + 1
                  else f"automatic: {DEFAULT_FLOOR_BYTES // MIB} MiB")
        if needed < want:
            want, sizing = needed, f"automatic: what {max_num_seqs} request(s) of the full context need"
        num_blocks = want
        if available_bytes is not None:
            cap = int(available_bytes * MEMORY_FRACTION) // per_block
            if cap < num_blocks:
                num_blocks = max(2, cap)
                sizing = (f"automatic: {MEMORY_FRACTION:.0%} of the {available_bytes / GIB:.1f} GiB available; "
                          "--kv-cache-memory-gb sets it")
    holds = (num_blocks - 1) * block_size - slack  # the longest lone request, its draft tree included
    if model_len > holds and len_given:
        raise ValueError(
            f"max_model_len {model_len} does not fit the KV cache: a request that long needs "
            f"{model_len + slack} token slots ({slack} for a draft tree), the cache holds "
            f"{(num_blocks - 1) * block_size} ({sizing}), so a context of at most {max(holds, 0)}; "
            "lower max_model_len, or raise kv_cache_memory_gb (or num_kv_blocks)")
    max_len = min(model_len, holds)
    if max_len < min_context:
        raise ValueError(f"the KV cache ({num_blocks} blocks of {block_size}: {sizing}) leaves a context of "
                         f"{max(max_len, 0)} tokens (under {min_context}); raise num_kv_blocks or kv_cache_memory_gb")
    return KVPlan(num_blocks, block_size, bytes_per_token, max_len, model_len, sizing)


def available_memory(device_type: str, device_index: int | None = None) -> int | None:
    """Bytes this process could still take on the device: CUDA's free memory; on a CPU, the kernel's
    MemAvailable (psutil where installed), bounded by a cgroup v2 limit (a container's). None when
    unknown (then nothing caps the automatic size)."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device_index)[0])
    if device_type != "cpu":
        return None
    avail = _mem_available()
    limit = _cgroup_room()
    if avail is None or (limit is not None and limit < avail):
        return limit
    return avail


def _mem_available() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or None without a limit."""
    try:
        rel = next(l[3:] for l in Path(f"/proc/{os.getpid()}/cgroup").read_text().splitlines()
                   if l.startswith("0::"))
        folder = root / rel.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((folder / "memory.current").read_text()))
    except (OSError, ValueError, StopIteration):
        return None
