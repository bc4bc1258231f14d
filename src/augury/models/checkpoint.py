"""A checkpoint folder's safetensors files, read a tensor (or a tensor-parallel rank's part) at a time.

`TensorFile` reads with plain reads, no mmap: a mapped file's touched pages count as the process's
memory until it is closed (a whole side file's, during a GGUF load); `TensorWriter` writes one a
tensor at a time (a GGUF conversion, the packed-layout cache). `Checkpoint` is a folder's files
as a name -> tensor mapping that reads each tensor when asked, straight into its destination where
the dtypes agree. `shard_part` says which part of a tensor a rank holds.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

from augury.models.config import TargetConfig
from augury.models.llama import Shard
from augury.models.quant import INT4_FILE, PACKED_PREFIX


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder}: shard(s) named in model.safetensors.index.json are missing: {', '.join(missing)}")
        return files
    # not the native side file nor the packed layouts' cache
    files = sorted(f for f in folder.glob("*.safetensors") if f.name != INT4_FILE and not f.name.startswith(PACKED_PREFIX))
    if not files:
        raise ValueError(f"{folder} has no .safetensors weights (only safetensors checkpoints are supported)")
    return files


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


class TensorFile:
    """One safetensors file read with plain reads, a tensor (or a rank's rows of it) at a time: no
    mmap, so the file's pages never count as this process's memory (a mapped file's touched pages
    do, until it is closed: the whole side file's, during a GGUF load)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "rb", buffering=0)
        try:
            (size,) = struct.unpack("<Q", self._f.read(8))
            header = json.loads(self._f.read(size))
        except (struct.error, ValueError) as e:
            self._f.close()
            raise ValueError(f"{path} is not a safetensors file ({e})") from e
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._start = 8 + size
        self._entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {
            name: (_SAFETENSORS_DTYPES[e["dtype"]], list(e["shape"]), *e["data_offsets"]) for name, e in header.items()}

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> list[int]:
        return list(self._entries[name][1])

    def _read(self, offset: int, nbytes: int, buf: torch.Tensor | None = None) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8) if buf is None else buf
        view, done = memoryview(buf.numpy()), 0
        while done < nbytes:  # a read may return less than asked
            got = os.preadv(self._f.fileno(), [view[done:]], self._start + offset + done)
            if got <= 0:
                raise ValueError(f"{self.path} is truncated")
            done += got
        return buf

    def read_into(self, name: str, dest: torch.Tensor) -> bool:
        """Tensor `name` read straight into `dest` (no copy beside it) where `dest` is a contiguous CPU
        tensor of its dtype and size; False (nothing read) otherwise."""
        dtype, shape, begin, end = self._entries[name]
        if dest.dtype != dtype or dest.device.type != "cpu" or not dest.is_contiguous() or \
                dest.numel() * dest.element_size() != end - begin or dest.numel() == 0:
            return False
        self._read(begin, end - begin, dest.view(-1).view(torch.uint8))
        return True

    def get_tensor(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name`, or only its rows a..b-1 (dimension 0)."""
        dtype, shape, begin, end = self._entries[name]
        if rows is not None:
            row = (end - begin) // max(1, shape[0])
            begin, end = begin + rows[0] * row, begin + rows[1] * row
            shape = [rows[1] - rows[0], *shape[1:]]
        return self._read(begin, end - begin).view(dtype).reshape(shape)

    def part(self, name: str, part: Part, per: int = 1) -> torch.Tensor:
        """Only `part` (shard_part's) of tensor `name`, as _read_part gives it from safe_open (`per`
        checkpoint values per stored column)."""
        if part is None:
            return self.get_tensor(name)
        dim, a, b, _ = part
        if dim == 0:
            return self.get_tensor(name, (a, b))
        return self.get_tensor(name)[:, a // per: b // per].contiguous()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorWriter:
    """A safetensors file written a tensor at a time (8 bytes of header length, the JSON header, then
    the tensors' bytes back to back): room for the header reserved first, bounded from the names to
    come, each tensor appended as it is made, the header written last, padded with spaces (as the
    format allows; safetensors' own writer pads too). Memory: the tensor being added. `align`: each
    tensor's bytes start at a multiple of it in the file (for a reader that maps the file and views
    the tensors in place), the gaps held by `PAD`-named uint8 entries (the format has no holes)."""

    _ENTRY = 160  # bytes of header an entry may take beyond its name: dtype, a 2-D shape, two offsets
    _DTYPES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    PAD = "__pad__"

    def __init__(self, path: Path, names: list[str], metadata: dict[str, str], align: int = 8) -> None:
        pads = len(names) if align > 8 else 0
        self._room = 64 + len(json.dumps({"__metadata__": metadata})) + sum(len(n) + self._ENTRY for n in names) \
            + pads * (len(self.PAD) + 8 + self._ENTRY)
        self._room += -(8 + self._room) % max(align, 8)  # the data starts aligned
        self._align = align
        self._header: dict[str, Any] = {"__metadata__": metadata}
        self._offset = 0
        self._f = open(path, "wb")
        self._f.seek(8 + self._room)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._align > 8 and (gap := -self._offset % self._align):
            self._f.write(bytes(gap))
            self._header[f"{self.PAD}{self._offset}"] = {"dtype": "U8", "shape": [gap],
                                                         "data_offsets": [self._offset, self._offset + gap]}
            self._offset += gap
        t = tensor.contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        self._f.write(memoryview(data))
        self._header[name] = {"dtype": self._DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self._offset, self._offset + data.size]}
        self._offset += data.size

    def close(self) -> None:
        header = json.dumps(self._header, separators=(",", ":")).encode()
        if len(header) > self._room:
            raise RuntimeError(f"safetensors header of {len(header)} bytes outgrew its {self._room} reserved")
        self._f.seek(0)
        self._f.write(struct.pack("<Q", self._room) + header + b" " * (self._room - len(header)))
        self._f.close()

    def abandon(self) -> None:
        """Closes the file unfinished (its folder is being removed)."""
        self._f.close()


class Checkpoint(Mapping):
    """A folder's safetensors files, open: name -> tensor, each read when asked for (one tensor's copy
    at a time, never the whole state dict). A context manager; closes the files on exit."""

    def __init__(self, folder: Path) -> None:
        self._files = ExitStack()
        self._where: dict[str, TensorFile] = {}
        for file in checkpoint_files(folder):
            f = self._files.enter_context(TensorFile(file))
            self._where.update((name, f) for name in f.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def part(self, name: str, part: Part) -> torch.Tensor:
        """Only `part` of tensor `name` (shard_part's)."""
        return self._where[name].part(name, part)

    def shape(self, name: str) -> list[int]:
        return self._where[name].shape(name)

    def read_into(self, name: str, dest: torch.Tensor) -> bool:
        return self._where[name].read_into(name, dest)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._files.close()


# A checkpoint tensor's part on one tensor-parallel rank: (dimension, start, stop, full length) of the
# tensor in the checkpoint; None: the whole tensor (norms, and row-parallel biases added once).
Part = tuple[int, int, int, int] | None


def shard_part(name: str, cfg: TargetConfig, shard: Shard) -> Part:
    """Which part of HF tensor `name` rank `shard.rank` holds: q/k/v and gate/up by rows (its heads and
    MLP columns), o/down by columns, the embedding and the output layer by vocabulary rows."""
    hd = cfg.head_dim
    (h0, h1), (k0, k1), (i0, i1), (v0, v1) = shard.heads, shard.kv_heads, shard.inter, shard.vocab
    leaf = name.rsplit(".", 1)[-1]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (0, v0, v1, cfg.vocab_size)
    if name.endswith("self_attn.q_proj." + leaf):
        return (0, h0 * hd, h1 * hd, cfg.num_heads * hd)
    if name.endswith(("self_attn.k_proj." + leaf, "self_attn.v_proj." + leaf)):
        return (0, k0 * hd, k1 * hd, cfg.num_kv_heads * hd)
    if name.endswith("self_attn.o_proj.weight"):
        return (1, h0 * hd, h1 * hd, cfg.num_heads * hd)
    if name.endswith(("mlp.gate_proj." + leaf, "mlp.up_proj." + leaf)):
        return (0, i0, i1, cfg.intermediate_size)
    if name.endswith("mlp.down_proj.weight"):
        return (1, i0, i1, cfg.intermediate_size)
    return None


def _read_part(f, name: str, part: Part, per: int = 1) -> torch.Tensor:
    """Only `part` of tensor `name` from an open safetensors file (`per` checkpoint values per stored
    column: 2 for int4 codes packed two to a byte, 32 for per-group scales)."""
    sl = f.get_slice(name)
    if part is None:
        return sl[:]
    dim, a, b, _ = part
    return sl[a:b] if dim == 0 else sl[:, a // per : b // per]
