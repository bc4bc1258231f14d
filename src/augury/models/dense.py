"""Dense 16-bit linears on CPUs without native bfloat16 GEMMs: fbgemm's half-precision GEMM.

On such CPUs (AVX2: torch emulates bfloat16 arithmetic) `F.linear` on bfloat16 weights costs time
linear in the rows: on the demo's linears at 2 threads, per token, 23.5 ms at one row, 149 ms at
8, 286 ms at 16. fbgemm (shipped inside torch's x86 builds) keeps the weights packed as float16
(as many bytes as bfloat16) and multiplies float32 activations against them, converting each
weight panel once for all rows: 25.7 ms at one row, 36 ms at 8, 49 ms at 16. So verification
rows, batches and prefill chunks run 4-6x faster, and a single row costs what it cost before.

Numbers: the weights' bfloat16 values are held exactly in float16 wherever they lie in float16's
normal range (|w| >= 2**-14; smaller ones round to float16 subnormals, an absolute error below
3e-8; larger than 65504 cannot be held, and such a layer keeps F.linear). Activations are
upcast exactly, products accumulate in float32 and the output rounds once into the model's
dtype, as a bfloat16 F.linear does.

Row-count invariance: fbgemm splits the rows among kernels of several heights, and its one- and
two-row kernels sum in another order than the others (rows 1-2 of a call, or a 1-2-row
remainder, come out different in the last bits). The target pads each call with zero rows to a
count whose split avoids them (`row_padding`, probed at first use: on AVX2 the kernel height is 6,
1-2 rows run as 3, 7 as 8, 14 as 15, and most counts as themselves), so each row's result is
independent of the rows beside it: a verified node equals a decode step at its position bit for
bit, and a request's tokens do not depend on its batch.
The EAGLE-3 head's drafts are only proposals and never pad. Without an invariant padding the
target keeps F.linear.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from augury.cpu import isa
from augury.cpu import kernels as cpu_kernels
from augury.models.fused import KernelModule

log = logging.getLogger(__name__)

HALF_MAX = 65504.0
PROBE_ROWS = 128  # row counts whose padding is probed one by one; above, multiples of the kernel height
# candidate kernel heights, the most likely first (fbgemm's float16 GEMM: 6 rows on AVX2)
ROW_BLOCK_CANDIDATES = (6, 14, 12, 8, 16, 24, 28)


def fbgemm_half_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether 16-bit dense linears may take fbgemm's packed float16 GEMM: CPU, a 16-bit dtype, no
    native bfloat16 GEMM (where oneDNN's own is faster), and an fbgemm build."""
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not isa.native_bf16()
            and "fbgemm" in torch.backends.quantized.supported_engines)


@dataclass(frozen=True)
class RowPadding:
    """How many rows a call of m rows runs as (zero rows appended) so that each row comes out as it
    would alone: table[m] for m < len(table), else the next multiple of `block` (fbgemm's full
    kernel height)."""

    block: int
    table: tuple[int, ...]

    def __call__(self, m: int) -> int:
        return self.table[m] if m < len(self.table) else -(-m // self.block) * self.block


NO_PADDING = RowPadding(1, ())


def _gemm(x: torch.Tensor, packed, rows: int) -> torch.Tensor:
    """x [m, K] through the packed weight as a call of `rows` >= m rows."""
    m = x.shape[0]
    if rows > m:
        x = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
    y = torch.ops.quantized.linear_dynamic_fp16(x, packed)
    return y[:m] if rows > m else y


def _up(m: int, block: int) -> int:
    return -(-m // block) * block


@functools.lru_cache(maxsize=1)
def row_padding() -> RowPadding | None:
    """Probe fbgemm's float16 GEMM: first the smallest kernel height `block` such that padding every
    call to a multiple of it computes each row as alone (at 2..3*block+1 rows, two offsets), then,
    against those rows, the smallest padding of each m up to PROBE_ROWS that does the same (most
    m need none: on AVX2 1 and 2 rows run as 3, 7 as 8, 14 as 15, 31-32 as 33). None if no block
    passes (then the target keeps F.linear)."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 320, generator=gen) * 0.05).bfloat16().float()
    x = torch.randn(PROBE_ROWS + 16, 320, generator=gen).bfloat16().float()
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    for block in ROW_BLOCK_CANDIDATES:
        alone = torch.cat([_gemm(x[i : i + 1], packed, block) for i in range(64)])
        if all(torch.equal(_gemm(x[s : s + m], packed, _up(m, block)), alone[s : s + m])
               for m in range(2, min(3 * block + 2, 64 - 5)) for s in (0, 5)):
            break
    else:
        log.warning("no row padding makes fbgemm's float16 GEMM row-count invariant here; the target keeps F.linear")
        return None
    ref = torch.cat([_gemm(x[i : i + block], packed, block) for i in range(0, x.shape[0], block)])
    table = [0]
    for m in range(1, PROBE_ROWS + 1):
        table.append(next(r for r in range(m, _up(m, block) + 1)
                          if r == _up(m, block) or all(torch.equal(_gemm(x[s : s + m], packed, r), ref[s : s + m])
                                                       for s in (0, 7, 16 - m % 5))))
    return RowPadding(block, tuple(table))


class HalfPackedLinear(KernelModule, nn.Module):
    """y = x @ W.T (+ b) with W packed for fbgemm as float16; input and output in `dtype`.

    padding: how many rows a call of m rows runs as (NO_PADDING: m; see the module doc). The packed
    weight is an fbgemm object on the CPU (no tensor: `.to()` never reaches it); the float32 bias
    keeps its dtype through conversions (KernelModule)."""

    kernel_devices = ("cpu",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 padding: RowPadding = NO_PADDING) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.padding = padding

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] in `dtype`, unpacked (for shape/dtype queries and training code; a copy)."""
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0].to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float().contiguous()
        y = _gemm(x2, self.packed, self.padding(x2.shape[0]))
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.dtype}, padded={self.padding is not NO_PADDING}")


class BF16PanelLinear(KernelModule, nn.Module):
    """y = x @ W.T (+ b) on augury's dense bfloat16 kernel (models/cpu_kernels.py): the weights, in
    panels of 8 columns, widened exactly and summed in float32 in one fixed order per value, the
    output rounded once (+ a bfloat16 bias rounded again, as a bfloat16 nn.Linear). Rows are
    row-count invariant, so no padding. Measured on the demo's linears (2 threads, paired, medians of
    5) against fbgemm's float16 GEMM: 1 row 22.3 vs 37.2 ms, 4 rows 28.0 vs 38.4, 8 rows 33.6 vs
    48.1, 16 rows 46.3 vs 58.1, 64 rows 147 vs 141, 256 rows 581 vs 529. `out_dtype` float32 (an
    output layer's logits) skips the rounding. Its panels and bias stay bfloat16 through `.to(dtype)`
    (KernelModule)."""

    kernel_devices = ("cpu",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel,
                 out_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = torch.bfloat16
        self.out_dtype = out_dtype
        self.register_buffer("panels", kernel.pack(weight))  # [ceil(N / 8), K, 8] bfloat16
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16).clone(),
                                                           requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] bfloat16, unpacked (a copy)."""
        return cpu_kernels.BF16.unpack(self.panels, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = cpu_kernels.bf16()
        if kernel is None:
            raise RuntimeError("this linear was packed for augury's bf16 kernel, which is unavailable now")
        shape = x.shape
        bias = self.bias if self.out_dtype == torch.bfloat16 else None
        y = kernel.linear(x.reshape(-1, shape[-1]), self.panels, self.out_features, bias, self.out_dtype)
        if self.bias is not None and bias is None:
            y = y + self.bias.float()
        return y.view(*shape[:-1], self.out_features)

    def fused_fields(self) -> list[int] | None:
        """(panels, 0, 0, bias) for the fused stack (models/fused.py): a bfloat16 layer projection."""
        bias = self.bias
        if self.out_dtype != torch.bfloat16 or bias is not None and not bias.is_contiguous():
            return None
        return [self.panels.data_ptr(), 0, 0, 0 if bias is None else bias.data_ptr()]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"out_dtype={self.out_dtype}")


def bf16_panel_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """A dense bfloat16 target's layer linears and output layer on augury's bf16 kernel, where it
    serves (bfloat16 on the CPU, the kernel built, widths % 8 == 0; with or without native bfloat16
    GEMMs, whose row-count-dependent blocking would give verified rows other bits than decode rows);
    True if it swapped them, False (nothing changed) otherwise."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    linears = [(n, m) for n, m in model.layers.named_modules() if isinstance(m, nn.Linear)]
    out = model.lm_head if model.lm_head is not None else model.embed_tokens
    if any(m.in_features % 8 for _, m in linears) or out.weight.shape[1] % 8:
        return False
    kernel = cpu_kernels.bf16()
    if kernel is None:
        return False
    for name, child in linears:
        parent, _, attr = name.rpartition(".")
        setattr(model.layers.get_submodule(parent) if parent else model.layers, attr,
                BF16PanelLinear(child.weight, child.bias, kernel))
    model.lm_head = BF16PanelLinear(out.weight, getattr(out, "bias", None), kernel, out_dtype=torch.float32)
    return True


def pack_half_linears(root: nn.Module, dtype: torch.dtype, padding: RowPadding = NO_PADDING) -> int:
    """Swap every nn.Linear under `root` for a HalfPackedLinear padding its rows by `padding`
    (those with weights past float16's range stay); returns how many were swapped."""
    swapped = 0
    for name, child in list(root.named_modules()):
        if not isinstance(child, nn.Linear):
            continue
        if child.weight.detach().abs().max().item() > HALF_MAX:
            log.info("%s keeps F.linear: weights past float16's range", name)
            continue
        parent, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, attr,
                HalfPackedLinear(child.weight, child.bias, dtype, padding))
        swapped += 1
    return swapped


def packed_output_layer(layer: nn.Module, dtype: torch.dtype, device: torch.device) -> HalfPackedLinear | None:
    """The target's output layer (`layer`: an nn.Linear, or the embedding of a tied model) packed
    and padded, wherever the float16 GEMM serves this dtype and device; None otherwise. Quantised
    targets take it too, instead of an int8 output layer: on the demo's (49152 x 576, 2 threads)
    1 row 4.75 ms against int8's 4.36, 9 rows 9.8 against 17.1, 12 rows 10.5 against 20.1, and
    float16 holds the weights closer than int8 does."""
    padding = row_padding() if fbgemm_half_available(dtype, device) else None
    if padding is None or layer.weight.detach().abs().max().item() > HALF_MAX:
        return None
    return HalfPackedLinear(layer.weight, getattr(layer, "bias", None), dtype, padding)
