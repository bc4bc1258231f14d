"""Paged KV cache: fixed-size blocks handed out by an allocator, one tensor per K and V.

Slot s of the cache is token (s % block_size) of block (s // block_size). Block 0 is
reserved: padding tokens write there, so it is never handed to a request.
"""
from __future__ import annotations

import torch


def slot_of(table: list[int], pos: int, block_size: int) -> int:
    """Cache slot of logical position `pos` of a request with block table `table`."""
    return table[pos // block_size] * block_size + pos % block_size


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # block 0 reserved

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_usable

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache out of blocks: need {n}, {len(self._free)} free")
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return out

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend a block table to hold num_tokens; False (and no change) if blocks ran out."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        table.extend(self.allocate(need))
        return True


class KVCache:
    """K and V storage [layers, slots, kv_heads, head_dim] for one model."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move KV entries src -> dst (all layers): compacts the accepted path of a tree."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
