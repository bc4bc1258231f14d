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

Row-count invariance: fbgemm splits the rows into blocks of its kernel's height and runs the
remainder through smaller kernels, whose sums come out different in the last bits. Padding every
call to a multiple of the full height makes each row's result independent of the rows beside it
(`row_block`; found by a probe at first use, 6 on AVX2). The target always pads, so a verified
node equals a decode step at its position bit for bit, and a request's tokens do not depend on
its batch; the price is at one row: 34.5 ms padded against 25.7 ms unpadded (demo, per token).
The EAGLE-3 head's drafts are only proposals and never pad. Without an invariant padding the
target keeps F.linear.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

HALF_MAX = 65504.0
# candidate kernel heights, the most likely first (fbgemm's float16 GEMM: 6 rows on AVX2)
ROW_BLOCK_CANDIDATES = (6, 14, 12, 8, 16, 24, 28)


def half_gemm_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether 16-bit dense linears take the packed float16 GEMM: CPU, a 16-bit dtype, no native
    bfloat16 GEMM (where oneDNN's own is faster), and an fbgemm build."""
    from augury.models.quant import native_bf16_gemm

    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not native_bf16_gemm()
            and "fbgemm" in torch.backends.quantized.supported_engines)


def _padded_gemm(x: torch.Tensor, packed, block: int) -> torch.Tensor:
    m = x.shape[0]
    pad = (-m) % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    y = torch.ops.quantized.linear_dynamic_fp16(x, packed)
    return y[:m] if pad else y


@functools.lru_cache(maxsize=1)
def invariant_row_block() -> int | None:
    """The smallest row padding under which fbgemm's float16 GEMM computes each row the same
    whatever rows share the call (alone, beside 1..3*block others, at any position); None if no
    candidate passes (then the target keeps F.linear)."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 320, generator=gen) * 0.05).bfloat16().float()
    x = torch.randn(64, 320, generator=gen).bfloat16().float()
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    for block in ROW_BLOCK_CANDIDATES:
        alone = torch.cat([_padded_gemm(x[i : i + 1], packed, block) for i in range(x.shape[0])])
        if all(torch.equal(_padded_gemm(x[s : s + m].contiguous(), packed, block), alone[s : s + m])
               for m in range(2, min(3 * block + 2, x.shape[0] - 5)) for s in (0, 5)):
            return block
    log.warning("no row padding makes fbgemm's float16 GEMM row-count invariant here; the target keeps F.linear")
    return None


class HalfPackedLinear(nn.Module):
    """y = x @ W.T (+ b) with W packed for fbgemm as float16; input and output in `dtype`.

    row_block: pad each call's rows to a multiple of this (1: no padding; see the module doc)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 row_block: int = 1) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.row_block = row_block

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] in `dtype`, unpacked (for shape/dtype queries and training code; a copy)."""
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0].to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float().contiguous()
        y = _padded_gemm(x2, self.packed, self.row_block)
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.dtype}, row_block={self.row_block}")


def pack_half_linears(root: nn.Module, dtype: torch.dtype, row_block: int = 1) -> int:
    """Swap every nn.Linear under `root` for a HalfPackedLinear padding its rows to `row_block`
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
                HalfPackedLinear(child.weight, child.bias, dtype, row_block))
        swapped += 1
    return swapped


def packed_output_layer(layer: nn.Module, dtype: torch.dtype, device: torch.device) -> HalfPackedLinear | None:
    """The target's output layer (`layer`: an nn.Linear, or the embedding of a tied model) packed
    and padded, wherever the float16 GEMM serves this dtype and device; None otherwise. Quantised
    targets take it too, instead of an int8 output layer: on the demo's (49152 x 576, 2 threads)
    1 row 4.75 ms against int8's 4.36, 9 rows 9.8 against 17.1, 12 rows 10.5 against 20.1, and
    float16 holds the weights closer than int8 does."""
    block = invariant_row_block() if half_gemm_available(dtype, device) else None
    if block is None or layer.weight.detach().abs().max().item() > HALF_MAX:
        return None
    return HalfPackedLinear(layer.weight, getattr(layer, "bias", None), dtype, block)
