"""Weight-only quantised linears, and the model-wide swap.

Int8Linear: per-output-channel symmetric int8, `torch._weight_int8pack_mm`.
Int4Linear: group 32, asymmetric (a scale and a zero per group). The device and dtype choose the
kernel (`default_int4_backend`): on the CPU, in bfloat16 augury's w4a8 kernel (augury/cpu) where it
builds, else `torch._weight_int4pack_mm_for_cpu` on weights packed by
`torch._convert_weight_to_int4pack_for_cpu`; on CUDA, in bfloat16 on sm80+, torch's CUDA kernel
(`torch._weight_int4pack_mm` on `torch._convert_weight_to_int4pack`'s layout); elsewhere none
(loader.resolve_quantization then loads "auto" dense, and asks for "int4" fail).

Torch facts these modules stand on (torch 2.13 CPU, checked by tests/test_quant.py):
- int4 value convention: w = (q - 8) * scale + zero, q in 0..15; `scales_and_zeros` is
  [K / 32, N, 2] (scale, zero), and the kernel wants N % 16 == 0, K % 32 == 0.
- both kernels want the scales in the activations' dtype (float32 with float32, bfloat16 with
  bfloat16); a float32 dequantisation is therefore exact only in float32 mode.
- both kernels compute each output row independently: a row comes out bit for bit the same
  alone or inside 8, 12 or 64 rows (measured at 1 and 2 threads, AVX2).

One numeric path per mode at every row count: a quantised linear always runs its kernel (no dense
copy above some row count: that switch changed the last bits of verified rows on CPUs with native
bfloat16, and greedy speculative output left plain decoding's), so verification rows equal decode
rows bit for bit and no second copy of the weights is held.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from augury.cpu import kernels as cpu_kernels
from augury.cpu import threads as cpu_threads
from augury.models.fused import KernelModule

log = logging.getLogger(__name__)

MODES = ("none", "int8", "int4")
# Native int4 weights a GGUF conversion writes beside the dense ones (models/gguf.py)
INT4_FILE = "augury-int4.safetensors"
INT4_INDEX = "augury-quant.json"
PACKED_PREFIX = "augury-packed-"  # the kernels' packed layouts of a later start (models/packed_cache.py)
INT4_FORMAT = "augury-int4-v2"  # v2: Q4_K ("q4k") and Q8_0 / Q6_K / Q5_* ("q8g") too (models/native.py)
INT4_FORMATS = ("augury-int4-v1", INT4_FORMAT)  # v1 folders: Q4_0 / Q4_1 only
INT4_GROUP = 32
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"

# The output layer's mode for each mode. int4 keeps it at int8 (as llama.cpp's Q4 files keep
# theirs at 6-8 bits): on the demo, mean |logit error| against float32 in bfloat16 was 0.43 with
# an int4 output layer (top-1 88.3%), 0.12 with an int8 one (96.6%; native Q4_1 layers: 0.09);
# at one row the int8 kernel is no slower (3072x576: int8 0.15 ms, int4 0.25 ms, AVX2).
OUTPUT_LAYER_MODE = {"int8": "int8", "int4": "int8"}


class _QuantLinear(KernelModule, nn.Module):
    """Shared forward: the quantised kernel at every row count, then the bias. Computes in `dtype`
    whatever the model is converted to (KernelModule: `.to(dtype)` leaves its tensors); activations
    of another floating dtype are rounded to `dtype` on the way in, and the output is returned in
    theirs (in a model as loaded they are always `dtype`)."""

    in_features: int
    out_features: int

    def __init__(self, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device=device, dtype=dtype).clone(),
                                                           requires_grad=False)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:  # x [M, in] -> [M, out]
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """[out, in] weights in `dtype`, as the kernel sees them (computed through the kernel)."""
        eye = torch.eye(self.in_features, dtype=self.dtype, device=self.scales_device())
        return self._kernel(eye).t().contiguous()

    def scales_device(self) -> torch.device:
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised [out, in] weight (for dtype/device/shape queries and training code;
        computed on each call)."""
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        y = self._kernel(x2.contiguous())
        if self.bias is not None:
            y = y + self.bias
        if x.dtype != self.dtype and x.is_floating_point():  # a converted model's activations: back to theirs
            y = y.to(x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.dtype}")


class Int8Linear(_QuantLinear):
    """Per-output-channel symmetric int8: w[n, k] = q[n, k] * scale[n], q in -127..127."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(bias, dtype)
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())  # [N, K]
        self.register_buffer("scales", scales.to(dtype).contiguous())  # [N]

    @staticmethod
    def from_float(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> "Int8Linear":
        w = weight.detach().float()  # [N, K]
        # the scale is rounded to the kernel's dtype first, so the codes fit the scale it will use
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(dtype).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # underflowed in 16 bits
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return Int8Linear(q, scale, bias, dtype)

    def scales_device(self) -> torch.device:
        return self.scales.device

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)


INT4_BACKENDS = ("torch", "w4a8", "cuda")
# the device types each backend's packed layout serves (meta: shapes only, for checks without a GPU)
INT4_DEVICES = {"torch": ("cpu",), "w4a8": ("cpu",), "cuda": ("cuda", "meta")}
CPU = torch.device("cpu")


def _has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether this torch build registers a `dispatch_key` ("CPU", "CUDA") kernel for aten::`op`."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", dispatch_key)


def cuda_int4_available(device: torch.device) -> bool:
    """Whether torch's CUDA int4 kernel runs on `device`: a CUDA (not ROCm) build registering
    `_convert_weight_to_int4pack` and `_weight_int4pack_mm` for CUDA, and a GPU of compute
    capability 8.0 or more (the kernel's tensor-core path; it takes bfloat16 activations only)."""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return False
    if not (_has_kernel("_convert_weight_to_int4pack", "CUDA") and _has_kernel("_weight_int4pack_mm", "CUDA")):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def int8_available(device: torch.device) -> bool:
    """Whether Int8Linear's kernel (`torch._weight_int8pack_mm`) runs on `device`."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.is_available() and _has_kernel("_weight_int8pack_mm", "CUDA")


def default_int4_backend(dtype: torch.dtype, device: torch.device | str = CPU) -> str | None:
    """The int4 kernel for activations of `dtype` on `device`, or None where none runs (the caller
    keeps such linears dense: loader.resolve_quantization). On the CPU "w4a8" (augury's kernel,
    augury/cpu) for bfloat16 where it builds and loads, else "torch" (torch's CPU int4 kernel:
    float32, the reference mode, always takes it); on CUDA "cuda" (torch's CUDA int4 kernel) for
    bfloat16 where cuda_int4_available, else None; on any other device None."""
    device = torch.device(device)
    if device.type == "cpu":
        return "w4a8" if dtype == torch.bfloat16 and cpu_kernels.w4a8() is not None else "torch"
    if device.type == "cuda":
        return "cuda" if dtype == torch.bfloat16 and cuda_int4_available(device) else None
    return None


def mode_available(mode: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether quantisation `mode` ("none", "int8", "int4") has a kernel for `dtype` on `device`."""
    if mode == "int4":
        return default_int4_backend(dtype, device) is not None
    if mode == "int8":
        return int8_available(device)
    return True


def cuda_int4_layout(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] 0..15 -> [N, K/2] uint8 as `torch._convert_weight_to_int4pack` (CUDA) takes
    them: column 2i in the high nibble, 2i+1 in the low one (INT4_FILE's order is the reverse)."""
    c = codes.to(torch.int32)
    return ((c[:, ::2] << 4) | c[:, 1::2]).to(torch.uint8)


def _inner_k_tiles(k: int) -> int:
    """The CUDA layout's tiles of 16 along K per packed row: the largest of 8, 4, 2 dividing K / 16."""
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


class Int4Linear(_QuantLinear):
    """Group-32 asymmetric int4: w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], g = k // 32.

    Three kernels (`backend`, chosen by dtype and device: default_int4_backend): "torch" (torch's
    CPU int4 kernel on its packed layout; the activations stay in their dtype), "w4a8" (augury's
    CPU kernel, augury/cpu: the activations are rounded to int8 per row and group of 32, as
    llama.cpp does for its Q4 types) and "cuda" (torch's CUDA int4 kernel, bfloat16). The CPU
    ones are row-count invariant; w4a8 cost less on the demo (all its int4 linears, 2 threads,
    AVX2: 1 row 9.0 vs 11.3 ms, 9 rows 30.7 vs 43.4 ms) and rounds the activations
    (docs/architecture.md). A packed layout serves its backend's device only (INT4_DEVICES)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, backend: str | None = None, device: torch.device | str | None = None) -> None:
        """codes [N, K] integers 0..15; scale, zero [N, K / 32] (any float dtype; rounded to `dtype`);
        device: where the module runs (None: the codes' device); backend None =
        default_int4_backend(dtype, device)."""
        n, k = codes.shape
        if n % INT4_N_MULTIPLE or k % INT4_GROUP:
            raise ValueError(f"int4 needs out_features % {INT4_N_MULTIPLE} == 0 and in_features % {INT4_GROUP} == 0, "
                             f"got [{n}, {k}]")
        device = codes.device if device is None else torch.device(device)
        backend = backend or default_int4_backend(dtype, device)
        if backend is None:
            raise ValueError(f"no int4 kernel runs {dtype} on {device} (on CUDA: torch's, bfloat16 on sm80+)")
        if backend not in INT4_BACKENDS or (backend in ("w4a8", "cuda") and dtype != torch.bfloat16):
            raise ValueError(f"int4 backend must be one of {', '.join(INT4_BACKENDS)} (w4a8 and cuda with bfloat16 "
                             f"only), got {backend!r} with {dtype}")
        if device.type not in INT4_DEVICES[backend]:
            raise ValueError(f"the {backend!r} int4 backend runs on {' or '.join(INT4_DEVICES[backend])}, not {device}")
        super().__init__(bias, dtype, device)
        self.backend = backend
        self.kernel_devices = INT4_DEVICES[backend]
        self.out_features, self.in_features = n, k
        scale, zero = scale.to(device=device, dtype=dtype), zero.to(device=device, dtype=dtype)
        if backend == "cuda":
            self.register_buffer("packed", torch._convert_weight_to_int4pack(
                cuda_int4_layout(codes.to(device)).contiguous(), _inner_k_tiles(k)))
            sz = torch.stack([scale, zero], dim=-1)  # [N, K/32, 2]
            self.register_buffer("scales_and_zeros", sz.transpose(0, 1).contiguous())  # [K/32, N, 2]
        elif backend == "w4a8":
            nib, s, z = cpu_kernels.W4A8.pack(codes, scale, zero)
            self.register_buffer("w4a8_codes", nib)  # [N/16, K/32, 256] uint8: panels of 16 columns
            self.register_buffer("w4a8_scale", s)  # [N/16, K/32, 16] bfloat16
            self.register_buffer("w4a8_zero", z)
        else:
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2))
            sz = torch.stack([scale, zero], dim=-1)  # [N, K/32, 2]
            self.register_buffer("scales_and_zeros", sz.transpose(0, 1).contiguous())  # [K/32, N, 2]

    @staticmethod
    def from_float(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                   backend: str | None = None, device: torch.device | str | None = None) -> "Int4Linear":
        n, k = weight.shape
        w = weight.detach().float().view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
        # min..max over 16 levels; scale and zero are rounded to the kernel's dtype before the
        # codes are chosen, so the codes are the nearest for the values the kernel will use
        scale = ((hi - lo) / 15.0).to(dtype).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group
        zero = (lo + 8.0 * scale).to(dtype).float()
        q = torch.round((w - zero[..., None]) / scale[..., None] + 8.0).clamp_(0, 15)
        return Int4Linear(q.view(n, k).to(torch.int32), scale, zero, bias, dtype, backend,
                          weight.device if device is None else device)

    def scales_device(self) -> torch.device:
        return (self.w4a8_scale if self.backend == "w4a8" else self.scales_and_zeros).device

    def dequantize(self) -> torch.Tensor:
        if self.backend != "w4a8":
            return super().dequantize()
        # the weight values themselves (the kernel also rounds the activations, which no weight shows)
        codes, scale, zero = cpu_kernels.W4A8.unpack(self.w4a8_codes, self.w4a8_scale, self.w4a8_zero)
        return int4_values(codes, scale.float(), zero.float()).to(self.dtype)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "w4a8":
            kernel = cpu_kernels.w4a8()
            if kernel is None:  # turned off after this module was built for it (AUGURY_CPU_KERNELS)
                raise RuntimeError("this int4 linear was packed for augury's w4a8 kernel, which is unavailable now")
            return kernel.linear(x, self.w4a8_codes, self.w4a8_scale, self.w4a8_zero)
        if self.backend == "cuda":
            return torch._weight_int4pack_mm(x, self.packed, INT4_GROUP, self.scales_and_zeros)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)

    def fused_fields(self) -> list[int] | None:
        """(codes, scale, zero, bias) for the fused stack: w4a8 in bfloat16 only (models/fused.py)."""
        bias = self.bias
        if self.backend != "w4a8" or self.dtype != torch.bfloat16 or \
                bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            return None
        return [self.w4a8_codes.data_ptr(), self.w4a8_scale.data_ptr(), self.w4a8_zero.data_ptr(),
                0 if bias is None else bias.data_ptr()]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", backend={self.backend}"


class W8A8OutputLinear(KernelModule, nn.Module):
    """A quantised target's output layer on augury's w8a8 kernel (augury/cpu): int8
    weights with a float32 scale per group of 32 (GGUF's Q8_0 layout and rule) against activations
    rounded to int8 per group, float32 logits out. Measured on the demo's 49152 x 576 (2 threads,
    paired, median of 7): 1 row 2.0 ms against fbgemm's float16 GEMM 4.4 ms, 4 rows 2.7 vs 4.6,
    9 rows 8.7 vs 10.0, 16 rows 9.3 vs 14.0. Rows are row-count invariant."""

    kernel_devices = ("cpu",)

    def __init__(self, weight: torch.Tensor, kernel: cpu_kernels.W8A8,
                 packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """weight [N, K] (quantised by Q8_0's rule), or its shape with `packed` (codes, scale) panels
        already made (a GGUF Q8_0 tensor as it is: W8A8.pack_codes)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scale = packed if packed is not None else \
            pack_output_rows(kernel, lambda a, b: weight[a:b], *weight.shape)
        self.register_buffer("codes", codes)  # [ceil(N / 16), K / 32, 512] int8: panels of 16 columns
        self.register_buffer("scale", scale)  # [ceil(N / 16), K / 32, 16] float32
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised [out, in] weight, float32 (computed on each call)."""
        return cpu_kernels.W8A8.unpack(self.codes, self.scale, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = cpu_kernels.w8a8()
        if kernel is None:
            raise RuntimeError("this output layer was packed for augury's w8a8 kernel, which is unavailable now")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = cpu_threads.timed_output(x2.shape[0], lambda: kernel.linear(x2, self.codes, self.scale, self.out_features))
        return y.view(*shape[:-1], self.out_features)

    def columns(self, x: torch.Tensor, ids: list) -> list[torch.Tensor]:
        """x [A, in] -> row a's outputs at columns ids[a] (float32), the bits forward() gives them."""
        kernel = cpu_kernels.w8a8()
        if kernel is None:
            raise RuntimeError("this output layer was packed for augury's w8a8 kernel, which is unavailable now")
        return kernel.columns(x, self.codes, self.scale, self.out_features, ids)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"


OUTPUT_PACK_ROWS = 1024  # rows quantised at a time (a multiple of 16): ~5 float32 copies of a chunk live at once


def pack_output_rows(kernel: cpu_kernels.W8A8, rows: Callable[[int, int], torch.Tensor], n: int,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8.pack of an [n, k] weight given by `rows(a, b)` (its rows a..b-1, any float dtype), a chunk of
    OUTPUT_PACK_ROWS rows at a time, into the panels made once: the same bits as packing it whole
    (every group's scale and codes are its own row's), without a float32 copy of the whole weight."""
    p, g = -(-n // INT4_N_MULTIPLE), k // INT4_GROUP
    codes = torch.empty(p, g, 8 * INT4_N_MULTIPLE * 4, dtype=torch.int8)
    scale = torch.empty(p, g, INT4_N_MULTIPLE, dtype=torch.float32)
    for a in range(0, n, OUTPUT_PACK_ROWS):
        c, s = kernel.pack(rows(a, min(n, a + OUTPUT_PACK_ROWS)))
        codes[a // INT4_N_MULTIPLE: a // INT4_N_MULTIPLE + c.shape[0]] = c
        scale[a // INT4_N_MULTIPLE: a // INT4_N_MULTIPLE + s.shape[0]] = s
    return codes, scale


def w8a8_output_layer(layer: nn.Module, dtype: torch.dtype, device: torch.device) -> W8A8OutputLinear | None:
    """The output layer (an nn.Linear, or the embedding of a tied model) on the w8a8 kernel, where it
    serves: a bfloat16 model on the CPU, no bias, in_features % 32 == 0 and the kernel built; else None."""
    weight = layer.weight
    if device.type != "cpu" or dtype != torch.bfloat16 or getattr(layer, "bias", None) is not None \
            or weight.shape[1] % INT4_GROUP:
        return None
    kernel = cpu_kernels.w8a8()
    return None if kernel is None else W8A8OutputLinear(weight, kernel)


def int4_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q - 8) * scale + zero in float32: codes [N, K], scale/zero [N, K/32] -> [N, K]."""
    n, k = codes.shape
    q = codes.float().view(n, k // INT4_GROUP, INT4_GROUP)
    return ((q - 8.0) * scale.float()[..., None] + zero.float()[..., None]).view(n, k)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K/2] uint8 (INT4_FILE layout: column 2i low nibble, 2i+1 high) -> [N, K] int32 0..15.
    In numpy: torch's uint8 shifts and interleaving stack took 7 of the demo's 25 s start-up (AMX Xeon),
    numpy's ~10x less."""
    c = codes.cpu().numpy()
    out = np.stack((c & 0x0F, c >> 4), axis=-1).reshape(c.shape[0], -1).astype(np.int32)
    return torch.from_numpy(out).to(codes.device)


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, mode: str, dtype: torch.dtype,
                    name: str = "", _warned: set | None = None, device: torch.device | None = None
                    ) -> nn.Module | None:
    """A quantised module for weight [out, in] on `device` (None: the weight's), or None when `mode`
    cannot take this shape or has no kernel for `dtype` there (mode_available)."""
    device = weight.device if device is None else torch.device(device)
    n, k = weight.shape
    reason = None
    if not mode_available(mode, dtype, device):
        reason = f"no {mode} kernel runs {dtype} on {device.type}"
    elif mode == "int8":
        return Int8Linear.from_float(weight, bias, dtype).to(device)
    elif n % INT4_N_MULTIPLE or k % INT4_GROUP:
        reason = (f"int4 needs in_features % {INT4_GROUP} == 0 and out_features % {INT4_N_MULTIPLE} == 0 "
                  f"(torch's int4 kernel)")
    if reason is not None:
        key = (n, k)
        if _warned is None or key not in _warned:
            log.warning("%s [%d, %d] stays dense: %s", name or "a linear", n, k, reason)
            if _warned is not None:
                _warned.add(key)
        return None
    return Int4Linear.from_float(weight, bias, dtype, device=device)


def _dense_linears(module: nn.Module):
    from augury.models.layers import TransposedLinear

    for name, child in module.named_modules():
        if isinstance(child, (nn.Linear, TransposedLinear)):
            yield name, child


def _swap(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, new)


def quantize_linears(root: nn.Module, mode: str, dtype: torch.dtype, device: torch.device,
                     skip: tuple[str, ...] = ()) -> int:
    """Swap every nn.Linear / TransposedLinear under `root` (names in `skip` excepted) for its
    quantised module; returns how many were swapped. Linears the mode cannot take stay dense."""
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return 0
    warned: set = set()
    swapped = 0
    for name, child in list(_dense_linears(root)):
        if name in skip:
            continue
        new = quantize_linear(child.weight, child.bias, mode, dtype, name, warned, device)
        if new is not None:
            _swap(root, name, new)
            swapped += 1
    return swapped


def quantize_model(model: nn.Module, mode: str, dtype: torch.dtype) -> nn.Module:
    """Quantise a TargetModel's layer stack and output layer in place (the embedding lookup stays
    dense; a tied output layer gets its own quantised copy of the embedding, in
    OUTPUT_LAYER_MODE[mode], or on the w8a8 kernel (bfloat16 on CPUs that build it), or packed for
    fbgemm's float16 GEMM where that serves: dense.py).
    Returns `model`, with `model.quantization` set to the mode."""
    device = model.embed_tokens.weight.device
    if mode != "none":
        quantize_linears(model.layers, mode, dtype, device)
        from augury.models.dense import packed_output_layer

        layer = model.lm_head if model.lm_head is not None else model.embed_tokens  # tied: the embedding
        out_mode = OUTPUT_LAYER_MODE[mode]
        head = w8a8_output_layer(layer, dtype, device) or packed_output_layer(layer, dtype, device)
        if head is None:
            head = quantize_linear(layer.weight, getattr(layer, "bias", None), out_mode, dtype, "lm_head",
                                   device=device)
        if head is not None:
            model.lm_head = head.to(device)
    model.quantization = mode
    model._fused = None  # new linears: models/fused.py builds its table again
    return model


def quantize_head(head: nn.Module, mode: str) -> nn.Module:
    """Quantise an EAGLE-3 head's fc, decoder-layer projections and lm_head in place (its
    embedding, shared with the target, stays dense). `mode` is the target's (`model.quantization`)."""
    p = head.fc.weight
    quantize_linears(head, mode, p.dtype, p.device)
    head.quantization = mode
    return head
