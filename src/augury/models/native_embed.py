"""A GGUF vocabulary matrix kept in its own format: the token embedding and the output layer, once.

A model's token embedding is its largest tensor after the output layer (Llama-3.2-1B: 128256 x 2048,
525 MB in bfloat16); a step looks up a few of its rows. `PackedEmbedding` holds the table as one
native linear of the GGUF type (models/native.py: Q4_K / Q5_K on W4KLinear, Q6_K on W6KLinear,
Q8_0 / Q5_0 / Q5_1 on W8GLinear, 4.6 to 9.5 bits a weight), whose buffers are panels of 16 rows, and
a lookup dequantises just the panels holding the ids asked for (each once), through the linear's own
`dequantize()`, and picks the rows. Every format's values are exact in float32 and are rounded once to
bfloat16, so the rows are the dense bfloat16 embedding a conversion writes (gguf-py's values rounded
the same way), bit for bit. Q4_0 is held on W40Linear (its float16 d, 4.5 bits a weight, rows computed
as d (q - 8), as gguf-py does: q d - 8 d gives the same numbers but +0.0 where d (q - 8) is -0.0), Q4_1
on W4FLinear (w = q d + m, float32 per 32: 6 bits a weight) instead of the int4 linear's bfloat16
scales, which would round d (a Q4_0 table from an index without types too, its rows as d (q - 8)).

`output_layer` builds the output layer from one GGUF tensor in its own type, exactly: Q8_0 (and Q5_0,
whose codes and scales are Q8_0's form) as a W8A8OutputLinear on its panels as they are (chosen
columns for grammars), any other type as a `NativeOutputLinear` around the type's native linear
(Q6_K on W6KLinear, Q4_K / Q5_K on W4KLinear, Q5_1 on W8GLinear), float32 logits from the same
kernels. A tied model's embedding is then a PackedEmbedding over that very module (the inner linear,
or the W8A8OutputLinear's panels): one copy of the matrix, as llama.cpp keeps it. Both are packed
BUILD_ROWS rows at a time (`packed_table`), never a whole float32 or byte-a-code copy.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np
import torch
from torch import nn

from augury.cpu import kernels as cpu_kernels
from augury.cpu import threads as cpu_threads
from augury.models import native
from augury.models.fused import KernelModule
from augury.models.quant import INT4_N_MULTIPLE, W8A8OutputLinear

PANELS_AT_ONCE = 64  # panels of 16 rows dequantised at a time: float32 temporaries of 1024 rows
# Looked-up rows kept (bfloat16, least recently used dropped first), at most this many bytes: a decode
# step looks up one token a request and a draft level one a row, where dequantising its panel of 16
# rows through torch's operators took ~100 us (the demo's Q8_0 table, Zen 5 VM, under cProfile: a
# quarter of a head draft level's time), and text repeats its tokens. 8 MiB holds 7,281 of the demo's
# rows, 1,024 of an 8B model's.
KEPT_ROWS_BYTES = 8 << 20
BUILD_ROWS = 4096  # rows packed at a time (a multiple of 16): one chunk's temporaries, not the table's


def _padded(part: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """A tensor's parts with zero rows to `rows` (a whole number of panels): values 0, never looked up."""
    return {k: torch.cat([v, v.new_zeros(rows - v.shape[0], *v.shape[1:])]) if v.shape[0] < rows else v
            for k, v in part.items()}


def _q4_as_w4f(part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """An int4 part (Q4_0 / Q4_1: w = (q - 8) d + z, z = 0 or fl32(m + 8 d)) as w = q d + m exactly, or
    None where m cannot be told from z (fl32(m + 8 d) the same for two float16 values m)."""
    d = part["scale"].numpy().astype(np.float16)  # the side file's float16 d
    z = part["zero"].numpy().astype(np.float32)
    eight_d = 8.0 * d.astype(np.float64)
    m = (z.astype(np.float64) - eight_d).astype(np.float16)  # Q4_0: -8 d exactly

    def gives_z(x: np.ndarray) -> np.ndarray:
        return (x.astype(np.float64) + eight_d).astype(np.float32) == z  # the conversion's own rounding

    up, down = np.nextafter(m, np.float16(np.inf)), np.nextafter(m, np.float16(-np.inf))
    if not (np.isfinite(m).all() and gives_z(m).all() and not gives_z(up).any() and not gives_z(down).any()):
        return None
    return {"codes": part["codes"], "scale": torch.from_numpy(d.astype(np.float32)),
            "zero": torch.from_numpy(m.astype(np.float32))}


def packed_table(kind: str, rows: Callable[[int, int], dict[str, torch.Tensor]], n: int, dtype: torch.dtype,
                 device: torch.device, make: Callable[[dict[str, torch.Tensor]], nn.Module | None] | None = None
                 ) -> nn.Module | None:
    """The native linear of an [n, K] GGUF tensor, `rows(a, b)` giving rows a..b-1 of its parts (models/
    native_load's read: codes a byte a code, their scales), its rows rounded up to whole panels of 16
    (the padding rows 0), packed BUILD_ROWS rows at a time into the whole table's buffers: every panel
    is packed alone, so the same bits as packing it whole, without a whole table's temporaries. `make`
    builds one chunk's linear (default native.build of `kind`). None where a chunk cannot be built here
    (another dtype or device, no kernel)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or kind not in native.KINDS:
        return None
    padded = -(-n // INT4_N_MULTIPLE) * INT4_N_MULTIPLE
    table, full = None, {}
    for a in range(0, padded, BUILD_ROWS):
        b = min(a + BUILD_ROWS, padded)
        part = _padded(rows(a, min(b, n)), b - a)
        chunk = make(part) if make is not None else native.build([kind], [part], None, dtype, device)
        if chunk is None:
            return None
        if table is None:
            table = chunk
        for k, v in chunk._buffers.items():  # a buffer a chunk lacks (Q5_K's fifth bits, none set) is zeros
            if v is not None:
                if full.get(k) is None:
                    full[k] = v.new_zeros(padded // INT4_N_MULTIPLE, *v.shape[1:])
                full[k][a // INT4_N_MULTIPLE: b // INT4_N_MULTIPLE] = v
    for k, v in full.items():
        table.register_buffer(k, v)
    table.out_features = padded
    return table


def _subset(table: nn.Module, panels: torch.Tensor) -> nn.Module:
    """`table` restricted to some of its panels: a detached copy of the module whose buffers are those
    panels alone (every packed buffer's first dimension), for its own dequantize(). Built without
    __setattr__, so nothing marks the fused tables stale."""
    sub = object.__new__(type(table))
    sub.__dict__.update(table.__dict__)
    sub.__dict__["_buffers"] = {k: None if v is None else v.index_select(0, panels) for k, v in table._buffers.items()}
    return sub


W8A8_ROWS_AT_ONCE = 1024  # rows _w8a8_rows takes a call (their float32 values: 16 MiB at 4,096 features)


class PackedEmbedding(KernelModule, nn.Module):
    """The token embedding [num_embeddings, embedding_dim] in a GGUF type's own values, looked up a
    panel of 16 rows at a time (bfloat16 rows, CPU)."""

    kernel_devices = ("cpu",)

    def __init__(self, table: nn.Module, num_embeddings: int, q4_0: bool = False) -> None:
        """table: a native linear of [num_embeddings rounded up to 16, embedding_dim] (build(), or a tied
        NativeOutputLinear's inner linear), or a tied W8A8OutputLinear (its panels' rows); q4_0: a
        W4FLinear holding Q4_0, whose values are computed as gguf-py does, d (q - 8)."""
        super().__init__()
        held = table.codes.shape[0] * INT4_N_MULTIPLE  # every kind's codes: panels of 16 rows first
        if held < num_embeddings or not isinstance(table, W8A8OutputLinear) and table.out_features != held:
            raise ValueError(f"a table of {held} rows cannot hold {num_embeddings} embeddings")
        self.table = table
        self.num_embeddings, self.embedding_dim = num_embeddings, table.in_features
        self.dtype = torch.bfloat16
        self.q4_0 = q4_0

    @staticmethod
    def build(kind: str, rows: Callable[[int, int], dict[str, torch.Tensor]], vocab: int, dtype: torch.dtype,
              device: torch.device, source: str | None = None) -> "PackedEmbedding | None":
        """From one GGUF tensor's native parts (packed_table's `rows`; source its GGUF type, as the side
        file's index names it). None where it cannot be held packed here (another dtype or device, no
        kernel to pack for, a Q4_1 zero whose m is ambiguous): the caller keeps the embedding dense."""
        zeros = [True]

        def make(part: dict[str, torch.Tensor]) -> nn.Module | None:
            if kind != "int4":
                return native.build([kind], [part], None, dtype, device)
            if source == "Q4_0" and cpu_kernels.w4a8() is not None and part["codes"].shape[1] % 32 == 0:
                return native.W40Linear(part["codes"], part["scale"], None)  # d (q - 8), as gguf-py
            zeros[0] = zeros[0] and not part["zero"].any()
            part = _q4_as_w4f(part)
            return None if part is None or cpu_kernels.w4a8() is None or part["codes"].shape[1] % 32 else \
                native.W4FLinear(part["codes"], part["scale"], part["zero"], None)

        table = packed_table(kind, rows, vocab, dtype, device, make)
        if table is None:
            return None
        # a W4FLinear holding Q4_0 (an index without types): its rows computed as d (q - 8)
        q4_0 = isinstance(table, native.W4FLinear) and (source == "Q4_0" or (source is None and zeros[0]))
        return PackedEmbedding(table, vocab, q4_0)

    def _values(self, panels: torch.Tensor) -> torch.Tensor:
        """The float32 values of some panels [16 n, H], each as gguf-py computes it."""
        sub = _subset(self.table, panels)
        if isinstance(sub, W8A8OutputLinear):  # a tied Q8_0 output layer's panels: scale times code
            return cpu_kernels.W8A8.unpack(sub.codes, sub.scale, sub.codes.shape[0] * INT4_N_MULTIPLE)
        if not self.q4_0:
            return sub.dequantize()
        # d (q - 8) rather than q d - 8 d: the same numbers, and a zero's sign as d's (-0.0 where d < 0)
        codes, scale, _ = cpu_kernels.W4A8.unpack(sub.codes, sub.scale, sub.zero)
        n, k = codes.shape
        return (scale[..., None] * (codes.float() - 8.0).view(n, k // 32, 32)).reshape(n, k)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 in range -> [T, H] bfloat16, dequantising each panel they touch once (a tied Q8_0
        output layer's: each row alone, _w8a8_rows)."""
        table = self.table
        if isinstance(table, W8A8OutputLinear) and table.codes.is_contiguous() and table.scale.is_contiguous():
            if ids.numel() <= W8A8_ROWS_AT_ONCE:
                return self._w8a8_rows(ids)
            return torch.cat([self._w8a8_rows(part) for part in ids.split(W8A8_ROWS_AT_ONCE)])
        panels, which = torch.unique(torch.div(ids, INT4_N_MULTIPLE, rounding_mode="floor"), return_inverse=True)
        rows = which * INT4_N_MULTIPLE + ids % INT4_N_MULTIPLE  # each id's row among the panels' rows
        if panels.numel() <= PANELS_AT_ONCE:
            values = self._values(panels)  # float32 [16 n, H]
            return torch.index_select(values, 0, rows).to(self.dtype)
        out = torch.empty(ids.numel(), self.embedding_dim, dtype=self.dtype)
        for a in range(0, panels.numel(), PANELS_AT_ONCE):
            values = self._values(panels[a:a + PANELS_AT_ONCE])
            pos = torch.nonzero((which >= a) & (which < a + PANELS_AT_ONCE)).squeeze(1)
            out[pos] = torch.index_select(values, 0, rows[pos] - a * INT4_N_MULTIPLE).to(self.dtype)
        return out

    def lookup(self, want: list[int]) -> torch.Tensor:
        """Token ids (a list) -> their rows [T, embedding_dim] bfloat16, as forward gives them, without
        its tensors' round trips (the head kernel's few tokens a call: ~40 us of its ~0.3 ms after a
        forward)."""
        if want and (min(want) < 0 or max(want) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got {min(want)}..{max(want)}")
        if not want:
            return torch.empty(0, self.embedding_dim, dtype=self.dtype)
        return self._lookup(want)

    def _w8a8_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """_rows of a tied Q8_0 output layer's panels (cpu/kernels.py's W8A8.unpack, row by row): each row's
        codes gathered from its panel in numpy and multiplied by its groups' float32 scales, the products
        W8A8.unpack gives, rounded once to bfloat16 (a panel through torch's operators took ~0.1 ms)."""
        codes, scale = self.table.codes.numpy(), self.table.scale.numpy()  # [P, G, 8 * 16 * 4], [P, G, 16]
        p, g, _ = codes.shape
        i = ids.numpy()
        panel, col = i // INT4_N_MULTIPLE, i % INT4_N_MULTIPLE
        mine = codes.reshape(p, g, 8, INT4_N_MULTIPLE, 4)[panel, :, :, col, :]  # [T, G, 8, 4]
        values = mine.astype(np.float32) * scale[panel, :, col][:, :, None, None]
        return torch.from_numpy(values.reshape(len(i), -1)).to(self.dtype)

    def _lookup(self, want: list[int]) -> torch.Tensor:
        """_rows through the kept rows (KEPT_ROWS_BYTES): the same bits, each row dequantised once while
        it is kept. A lookup of more distinct ids than it keeps goes to _rows whole. (Set up at first use:
        a module packed_cache.py rebuilds has its public attributes alone.) The kept rows are a numpy
        array of their bytes, written and gathered by numpy indexing: a torch tensor's index_put and
        index_select, with the index tensors they take, were ~40 of the ~100 us a fresh row cost (the
        demo, AVX2 EPYC), and a numpy array is written alike inside torch.inference_mode and out."""
        state = self.__dict__
        # token id -> its row of _kept_bytes (oldest first); the rows [_most, embedding_dim bytes], at need
        kept: OrderedDict[int, int] = state.setdefault("_kept", OrderedDict())
        most = state.setdefault("_most", KEPT_ROWS_BYTES // (2 * self.embedding_dim))
        distinct = dict.fromkeys(want)
        if len(distinct) > most:
            return self._rows(torch.tensor(want, dtype=torch.int64))
        fresh = [t for t in distinct if t not in kept]
        for t in want:  # this lookup's kept rows are the most recently used: none of them is dropped below
            if t in kept:
                kept.move_to_end(t)
        store = state.get("_kept_bytes")
        if fresh:
            rows = self._rows(torch.tensor(fresh, dtype=torch.int64)).contiguous().view(torch.uint8)
            if store is None:
                store = state["_kept_bytes"] = np.empty((most, rows.shape[1]), dtype=np.uint8)
            at = []
            for t in fresh:
                at.append(len(kept) if len(kept) < most else kept.popitem(last=False)[1])
                kept[t] = at[-1]
            store[at] = rows.numpy()
        return torch.from_numpy(store[[kept[t] for t in want]]).view(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] -> [..., embedding_dim] bfloat16: the dense embedding's rows, bit for bit."""
        out = self.lookup(input_ids.reshape(-1).long().tolist())
        return out.to(input_ids.device).view(*input_ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantised [num_embeddings, embedding_dim] bfloat16 (a new tensor each call:
        for rare whole-table uses, never a step's)."""
        return self._rows(torch.arange(self.num_embeddings))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, packed as {type(self.table).__name__}"


class NativeOutputLinear(KernelModule, nn.Module):
    """The output layer [out_features, in_features] in its GGUF type's own values: `inner`, the type's
    native linear (models/native.py, its rows rounded up to whole panels of 16), run for float32 logits
    (its kernel rounds the activations to int8 per 32, as the w8a8 output layer's does). Rows are
    row-count invariant (each output is its own row's). No `columns`: a grammar-masked step computes
    the whole row (TargetModel.masked_logits declines)."""

    kernel_devices = ("cpu",)

    def __init__(self, inner: nn.Module, out_features: int) -> None:
        super().__init__()
        if not out_features <= inner.out_features < out_features + INT4_N_MULTIPLE:
            raise ValueError(f"a linear of {inner.out_features} rows is not an output layer of {out_features}")
        self.inner = inner
        self.out_features, self.in_features = out_features, inner.in_features
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = cpu_threads.timed_output(x2.shape[0], lambda: self.inner._kernel(x2, torch.float32))
        if y.shape[1] != self.out_features:  # the last panel's padding rows
            y = y[:, :self.out_features].contiguous()
        return y.view(*shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] weight, float32 (dequantised on each call: for rare callers, never a step's)."""
        return self.inner.dequantize()[:self.out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {type(self.inner).__name__}"


def output_layer(kind: str, rows: Callable[[int, int], dict[str, torch.Tensor]], n: int, dtype: torch.dtype,
                 device: torch.device) -> nn.Module | None:
    """The output layer from one GGUF tensor of a native kind other than int4 (packed_table's `rows`, n
    rows), in its exact values: a W8A8OutputLinear where the type is int8 codes with a float32 scale per
    32 and nothing else (Q8_0, Q5_0: the w8a8 output kernel's own panels, with chosen columns), else a
    NativeOutputLinear. None off the CPU, outside bfloat16 or without the kernels."""
    if kind == "int4":
        return None
    table = packed_table(kind, rows, n, dtype, device)
    if table is None:
        return None
    if isinstance(table, native.W8GLinear) and table.zero is None and table.sub is None:
        shape = torch.empty(n, table.in_features, device="meta")
        return W8A8OutputLinear(shape, cpu_kernels.w8a8(), (table.codes, table.scale))
    return NativeOutputLinear(table, n)
