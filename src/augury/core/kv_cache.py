"""Paged KV cache: fixed-size blocks handed out by an allocator, one tensor per K and V.

Slot s of the cache is token (s % block_size) of block (s // block_size). Block 0 is
reserved: padding tokens write there, so it is never handed to a request.
"""
from __future__ import annotations

import hashlib
import math
import mmap
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch


def slot_of(table: list[int], pos: int, block_size: int) -> int:
    """Cache slot of logical position `pos` of a request with block table `table`."""
    return table[pos // block_size] * block_size + pos % block_size


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: a 128-bit BLAKE2b digest chained over the parent
    block's key and this block's token ids, so equal keys mean equal whole prefixes."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockAllocator:
    """Blocks for requests, reference-counted, with an optional prefix cache.

    A block is free (no owner, no content anyone may ask for), in use (ref > 0: the number of
    requests whose block table holds it) or, with prefix caching, cached and idle (ref 0 but
    still holding the KV of the full block its key names, evictable). Allocation takes free
    blocks first, then evicts idle cached blocks, least recently used first; `num_free` counts
    both, since either can be handed out. A block is registered under its key only once every
    one of its token slots holds committed KV, and a registered block is never written again
    while registered: its owner writes only past its committed length, and a request that got
    it from the cache starts computing after it."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # block 0 reserved
        self.ref = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # cached block -> its tokens (checked on a hit)
        self._block_of: dict[bytes, int] = {}  # key -> cached block
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref 0, least recently used first
        self.num_evicted = 0
        # blocks 1..num_written have been handed out at least once: fresh blocks go out in order, freed ones
        # first, so these are all the blocks ever written, and the cache's memory taken so far (lazy_zeros)
        self.num_written = 0

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_usable

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"KV cache out of blocks: need {n}, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
                self.num_written = max(self.num_written, b)
            else:  # evict the least recently used idle cached block
                b, _ = self._idle.popitem(last=False)
                self._forget(b)
                self.num_evicted += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. The last block of a table is released first, so that of
        a released prefix its tail is evicted before its head (a head is shared more often)."""
        for b in reversed(blocks):
            if self.ref[b] <= 0:
                raise RuntimeError(f"KV block {b} freed more often than it was taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self._key_of:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend a block table to hold num_tokens; False (and no change) if blocks ran out."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        table.extend(self.allocate(need))
        return True

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, key: bytes, tokens: Sequence[int]) -> int | None:
        """The cached block holding this key's KV, or None. Takes no reference."""
        b = self._block_of.get(key)
        if b is None or self._tokens_of[b] != tuple(tokens):
            return None
        return b

    def take(self, block: int) -> None:
        """One more reference to a cached block (a request's prefix hit)."""
        if block not in self._key_of:
            raise RuntimeError(f"KV block {block} is not cached")
        if self.ref[block] == 0:
            del self._idle[block]
        self.ref[block] += 1

    def register(self, block: int, key: bytes, tokens: Sequence[int]) -> None:
        """Offer a full, committed block to the cache under its key. A key already cached keeps its
        block (this one stays private and is freed as usual)."""
        if not self.enable_caching or key in self._block_of or block in self._key_of:
            return
        if self.ref[block] <= 0:
            raise RuntimeError(f"KV block {block} registered while nobody holds it")
        self._key_of[block] = key
        self._tokens_of[block] = tuple(tokens)
        self._block_of[key] = block

    def reset_cache(self) -> None:
        """Forget every cached key (idle cached blocks become free); blocks in use stay in use."""
        for b in list(self._key_of):
            self._forget(b)
        self._free.extend(self._idle)
        self._idle.clear()

    def _forget(self, block: int) -> None:
        del self._block_of[self._key_of.pop(block)]
        del self._tokens_of[block]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose memory is taken only as it is written, on a CPU.

    The attention paths read slots no request wrote, with zero weight: block 0's padding slots and,
    in the masked path, positions past a shorter request's context. Zero weight does not make
    garbage harmless (0 * NaN is NaN), so the cache must hold finite values everywhere, and zeros
    filled page by page would make the whole nominal size resident at start. An anonymous private
    mapping is zero by the kernel's guarantee, and a page becomes resident only when first written
    (reads map the shared zero page): the cache's resident size grows with the traffic's high-water
    mark, never past it (freed blocks are handed out again first). Elsewhere: torch.zeros."""
    if torch.device(device).type != "cpu" or not hasattr(mmap, "MAP_ANONYMOUS"):  # (no such mapping on Windows)
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)  # the tensor keeps `buf` alive


class KVCache:
    """K and V storage [layers, slots, kv_heads, head_dim] for one model (lazy_zeros: memory is taken
    as slots are written). `dtype` is the cache's, which may differ from the model's (--kv-cache-dtype):
    keys and values are converted as they are written (attention/kv_dtype.py), and attention reads them in
    place."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = lazy_zeros(shape, dtype, device)
        self.v = lazy_zeros(shape, dtype, device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move KV entries src -> dst (all layers): compacts the accepted path of a tree."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
