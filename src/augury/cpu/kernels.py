"""augury's own CPU kernels: C++ sources in cpu/csrc/, built at first use by the system's
C++ compiler into the user cache (<cache>/kernels/, keyed by source, flags and compiler) and
loaded with ctypes. When a kernel cannot be built or loaded (no compiler, not x86-64 with AVX2
and FMA, AUGURY_CPU_KERNELS=0, a failed build or self-check), augury warns once and the callers
run torch's kernels instead: a model never comes up half-built.

w4a8 (csrc/w4a8.cpp): int4 weights in groups of 32 (a scale and a zero per group, torch's
convention w = (q - 8) s + z) against activations rounded per row to int8 in the same groups, the
integer dot products summed exactly (AVX2 maddubs). It computes every output row in one fixed
order whatever the other rows and the threads, so rows are row-count invariant (figures against
torch's int4 kernel in quant.Int4Linear and docs/architecture.md).

w8a8 (csrc/w8a8.cpp): int8 weights with a float32 scale per group of 32 (GGUF's Q8_0) against the
same int8 activations, float32 out: a quantised target's output layer. Its general form (w8a8.h,
`W8A8.linear_general`) adds an int8 sub-scale per 16 and a float32 zero per group, each optional:
GGUF's Q8_0, Q6_K, Q5_0, Q5_1 and Q5_K linears in their exact values (models/native.py). w4a8's
float32 form (`W4A8.linear` with float32 scales) takes the codes as they are, w = q s + z: Q4_K.

bf16 (csrc/bf16.cpp): dense bfloat16 weights repacked in panels of 8 columns against float32
activations, float32 sums in a fixed order (row-count invariant): a dense bfloat16 target on CPUs
without native bfloat16 GEMMs.

attention (csrc/attention.cpp): exact attention rows, each over its own slot list read in place
from the paged KV cache, float32. elementwise (csrc/elementwise.cpp): RMSNorm of the float32
residual stream, the rotary embedding and silu(gate) * up, float32, rounded once.

forward (csrc/forward.cpp): the whole layer stack of a bfloat16 int4 target in one call, built
from the same row functions (the kernels' *.h), bit for bit what the layer-by-layer path computes;
models/fused.py decides when it runs.

head (csrc/head.cpp): an EAGLE-3 head's forward for one draft level's (or catch-up chunk's) rows in
one call, its linears on the same row functions in their own formats, then the draft vocabulary's top
k with their log-softmax values; models/eagle3_fused.py builds its arguments.

The kernels' threads are OpenMP threads of the libgomp torch already loaded (one runtime in the
process), as many as torch.get_num_threads() or, once the fused stack has timed its steps,
as many as cpu/threads.py found fastest on this machine now (`threads.current()`).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from augury.config import CPU_KERNELS_VAR, cpu_kernels_enabled
from augury.cpu import isa
from augury.cpu import threads as cpu_threads
from augury.cpu.build import KernelUnavailable, build

log = logging.getLogger(__name__)

GROUP = 32
PANEL = 16  # w4a8 and w8a8 pack their weights in panels of this many columns
NAMES = ("w4a8", "w8a8", "bf16", "attention", "elementwise", "forward", "head")

_cache: dict[str, object] = {}
_warned: set[str] = set()  # reasons already warned about: one warning each, not one per kernel


_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _expect(kernel: str, what: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...],
            shape: tuple[int | None, ...]) -> None:
    """Raise a ValueError naming `what` unless t is a contiguous CPU tensor of one of `dtypes` and
    `shape` (None: any size there). The kernels read raw addresses: what they are handed is checked
    here, once per call, by every binding."""
    ok = (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype in dtypes and t.dim() == len(shape)
          and all(w is None or w == d for w, d in zip(shape, t.shape)))
    if ok and t.is_contiguous():
        return
    want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    dims = ", ".join("*" if w is None else str(w) for w in shape)
    got = (f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}"
           f"{'' if t.is_contiguous() else ', not contiguous'}") if isinstance(t, torch.Tensor) else type(t).__name__
    raise ValueError(f"{kernel}: {what} must be a contiguous CPU {want} tensor [{dims}], got {got}")


def _threads() -> int:
    """The thread count a kernel call runs with (cpu/threads.py: torch's, or the measured choice)."""
    return cpu_threads.current()


def _bind(lib: ctypes.CDLL, name: str, argtypes: list, restype=None):
    """lib's C function `name` with its argument and result types set."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


class W4A8:
    """The loaded w4a8 kernel."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._fn = _bind(self._lib, "augury_w4a8_linear",
                         [_P, _I32, _I64, _I64, _P, _P, _P, _I64, _P, _I32, _I32], _I32)
        self._fn_f32 = _bind(self._lib, "augury_w4f_linear",
                             [_P, _I32, _I64, _I64, _P, _P, _P, _I64, _P, _I32, _I32], _I32)
        self._fn_k = _bind(self._lib, "augury_w4k_linear",
                           [_P, _I32, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I32, _I32], _I32)
        self._fn_40 = _bind(self._lib, "augury_w40_linear", [_P, _I32, _I64, _I64, _P, _P, _I64, _P, _I32, _I32], _I32)

    @staticmethod
    def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
             dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
        """codes [N, K] integers 0..15, scale / zero [N, K / 32] (values of `dtype`), N a multiple of 16
        -> the kernel's panels of 16 columns (csrc/w4a8.h): codes [N / 16, G, 256] uint8, scale and
        zero [N / 16, G, 16] in `dtype`, G = K / 32. bfloat16: w = (q - 8) s + z; float32: w = q s + z
        (the kernel's float32 form, linear() choosing it by the scales' dtype); float16: GGUF's Q4_0,
        w = (q - 8) s (linear40, which reads no zero)."""
        n, k = codes.shape
        if k % GROUP or n % PANEL:
            raise ValueError(f"w4a8 needs in_features % {GROUP} == 0 and out_features % {PANEL} == 0, got [{n}, {k}]")
        g, p = k // GROUP, n // PANEL
        # [panel, column, group, block, low/high nibble, j] -> [panel, group, block, column, j] (in numpy:
        # torch's uint8 gather took ~2x as long, 4 of the demo's 25 s start-up)
        c = codes.cpu().numpy().astype(np.uint8).reshape(p, PANEL, g, 4, 2, 4).transpose(0, 2, 3, 1, 4, 5)
        nib = torch.from_numpy(np.ascontiguousarray(c[..., 0, :] | (c[..., 1, :] << 4)).reshape(p, g, 4 * PANEL * 4))

        if dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"w4a8 scales are bfloat16, float32 or float16, not {dtype}")

        def panels(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype).reshape(p, PANEL, g).transpose(1, 2).contiguous()

        return nib, panels(scale), panels(zero)

    @staticmethod
    def pack_k(codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
               m: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """GGUF Q4_K / Q5_K in their own scales: codes [N, K] 0..15 (Q4_K) or 0..31 (Q5_K), d / dmin
        [N, K / 256] float16, sc / m [N, K / 32] integers 0..63 (w = d sc q - dmin m) -> (codes [N / 16, G,
        256] uint8 as pack()'s (the low four bits), sm [N / 16, G, 32] uint8: the panel's 16 sc then its
        16 m, dd [N / 16, G / 8, 32] float16: 16 d then 16 dmin, high [N / 16, G, 64] uint8 or None: the
        fifth bits, byte 4 c + j's bit 2 b + plane for the code in that nibble of pack()'s block b)."""
        n, k = codes.shape
        if k % (8 * GROUP) or n % PANEL:
            raise ValueError(f"Q4_K needs in_features % 256 == 0 and out_features % {PANEL} == 0, got [{n}, {k}]")
        g, p = k // GROUP, n // PANEL
        c = codes.cpu().numpy().astype(np.uint8)
        nib = W4A8.pack(torch.from_numpy(c & 0x0F), torch.zeros(n, g), torch.zeros(n, g))[0]
        high = None
        if (c > 15).any():
            # [panel, column, group, block, plane, j] -> [panel, group, column, j, block, plane]
            h = (c >> 4).reshape(p, PANEL, g, 4, 2, 4).transpose(0, 2, 1, 5, 3, 4).reshape(p, g, PANEL, 4, 8)
            weights = (1 << np.arange(8, dtype=np.uint8))  # bit 2 b + plane
            high = torch.from_numpy(np.ascontiguousarray((h * weights).sum(-1).astype(np.uint8)).reshape(p, g, 64))

        def pair(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, groups: int) -> torch.Tensor:
            # [N, groups] twice -> [P, groups, 32]: per panel and group the 16 columns of a, then of b
            t = torch.stack([a.to(dtype).reshape(p, PANEL, groups), b.to(dtype).reshape(p, PANEL, groups)], 1)
            return t.permute(0, 3, 1, 2).reshape(p, groups, 2 * PANEL).contiguous()

        return nib, pair(sc, m, torch.uint8, g), pair(d, dmin, torch.float16, g // 8), high

    @staticmethod
    def unpack_k(codes: torch.Tensor, sm: torch.Tensor, dd: torch.Tensor,
                 high: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """pack_k()'s inverse: (codes [N, K], d [N, K / 256], dmin, sc [N, K / 32], m)."""
        p, g, _ = codes.shape
        c = W4A8.unpack(codes, torch.zeros(p, g, PANEL), torch.zeros(p, g, PANEL))[0]
        if high is not None:
            bits = (high.view(p, g, PANEL, 4, 1).to(torch.int32) >> torch.arange(8)) & 1  # [p, g, col, j, 2 b + plane]
            bits = bits.view(p, g, PANEL, 4, 4, 2).permute(0, 2, 1, 4, 5, 3).reshape(p * PANEL, g * GROUP)
            c = c | (bits.to(c.dtype) << 4)

        def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            u = t.view(p, t.shape[1], 2, PANEL).permute(2, 0, 3, 1).reshape(2, p * PANEL, t.shape[1])
            return u[0], u[1]

        (sc, m), (d, dmin) = split(sm), split(dd)
        return c, d, dmin, sc, m

    @staticmethod
    def _checked(x: torch.Tensor, codes: torch.Tensor, form: str, groups: int = 1) -> tuple[torch.Tensor, int, int]:
        """(x contiguous, panels p, groups g of the codes [p, g, 256]), or a ValueError naming what the kernel
        cannot take; K a multiple of 32 * groups (8 for the K-quants' super-blocks of 256)."""
        if x.dim() != 2 or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"w4a8 wants a 2-D bfloat16 or float32 CPU input, got {tuple(x.shape)} "
                             f"{x.dtype} on {x.device}")
        _expect("w4a8", "codes", codes, (torch.uint8,), (None, None, 4 * PANEL * 4))
        p, g, _ = codes.shape
        if x.shape[1] != g * GROUP or g % groups:
            multiple = f" (a multiple of {groups * GROUP})" if groups > 1 else ""
            raise ValueError(f"w4a8{form}: input has {x.shape[1]} features, the weights {g * GROUP}{multiple}")
        return x.contiguous(), p, g

    @staticmethod
    def _failed(rc: int) -> None:
        if rc:
            raise RuntimeError(f"w4a8 kernel failed (code {rc}: {'bad shapes' if rc == 1 else 'out of memory'})")

    def linear_k(self, x: torch.Tensor, codes: torch.Tensor, sm: torch.Tensor, dd: torch.Tensor,
                 high: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] (bfloat16 or float32, CPU) -> [M, N] in `out_dtype` (default x's), no bias: Q4_K in its
        own scales (pack_k's panels), the bits linear() gives the same weights with float32 scales."""
        x, p, g = self._checked(x, codes, " (Q4_K)", 8)
        m, k = x.shape
        _expect("w4a8", "sc and m", sm, (torch.uint8,), (p, g, 2 * PANEL))
        _expect("w4a8", "d and dmin", dd, (torch.float16,), (p, g // 8, 2 * PANEL))
        if high is not None:
            _expect("w4a8", "high bits", high, (torch.uint8,), (p, g, 4 * PANEL))
        out_dtype = out_dtype or x.dtype
        y = torch.empty(m, p * PANEL, dtype=out_dtype)
        rc = self._fn_k(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, codes.data_ptr(), sm.data_ptr(),
                        dd.data_ptr(), None if high is None else high.data_ptr(), p * PANEL, y.data_ptr(), int(out_dtype == torch.bfloat16), _threads())
        self._failed(rc)
        return y

    def linear40(self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] (bfloat16 or float32, CPU) -> [M, N] in `out_dtype` (default x's), no bias: GGUF's Q4_0
        in its own numbers, w = (q - 8) d with d [N / 16, G, 16] float16 (pack()'s panels, 4.5 bits a weight)."""
        x, p, g = self._checked(x, codes, " (Q4_0)")
        m, k = x.shape
        _expect("w4a8", "d", d, (torch.float16,), (p, g, PANEL))
        out_dtype = out_dtype or x.dtype
        y = torch.empty(m, p * PANEL, dtype=out_dtype)
        rc = self._fn_40(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, codes.data_ptr(), d.data_ptr(), p * PANEL,
                         y.data_ptr(), int(out_dtype == torch.bfloat16), _threads())
        self._failed(rc)
        return y

    @staticmethod
    def unpack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """pack()'s inverse: (codes [N, K] uint8 0..15, scale [N, G], zero [N, G] in their dtype)."""
        p, g, _ = codes.shape
        c = codes.reshape(p, g, 4, PANEL, 4)
        c = torch.stack([c & 0x0F, c >> 4], dim=-2)  # [panel, group, block, column, low/high, j]
        c = c.permute(0, 3, 1, 2, 4, 5).reshape(p * PANEL, g * GROUP)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(p * PANEL, g)

        return c, rows(scale), rows(zero)

    def linear(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] (bfloat16 or float32, CPU) -> [M, N] in `out_dtype` (default x's dtype), no bias
        (quant.Int4Linear adds its own). The weights are pack()'s output, bfloat16 scales and zeros
        (w = (q - 8) s + z) or float32 ones (w = q s + z)."""
        x, p, g = self._checked(x, codes, "")
        m, k = x.shape
        _expect("w4a8", "scale", scale, (torch.bfloat16, torch.float32), (p, g, PANEL))
        _expect("w4a8", "zero", zero, (torch.bfloat16, torch.float32), (p, g, PANEL))
        if zero.dtype != scale.dtype:
            raise ValueError(f"w4a8: scale ({scale.dtype}) and zero ({zero.dtype}) must be both bfloat16 "
                             f"(w = (q - 8) s + z) or both float32 (w = q s + z)")
        out_dtype = out_dtype or x.dtype
        n = p * PANEL
        y = torch.empty(m, n, dtype=out_dtype)
        fn = self._fn_f32 if scale.dtype == torch.float32 else self._fn
        rc = fn(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, codes.data_ptr(), scale.data_ptr(),
                zero.data_ptr(), n, y.data_ptr(), int(out_dtype == torch.bfloat16), _threads())
        self._failed(rc)
        return y


class W8A8:
    """The loaded w8a8 kernel (csrc/w8a8.cpp)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._fn = _bind(self._lib, "augury_w8a8_linear", [_P, _I32, _I64, _I64, _P, _P, _I64, _P, _I32], _I32)
        self._columns = _bind(self._lib, "augury_w8a8_columns", [_P, _I32, _I64, _I64, _P, _P, _I64, _P, _P, _P], _I32)
        self._general = _bind(self._lib, "augury_w8g_linear",
                              [_P, _I32, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I32, _I32], _I32)
        self._six = _bind(self._lib, "augury_w6k_linear", [_P, _I32, _I64, _I64, _P, _P, _P, _I64, _P, _I32, _I32], _I32)

    @staticmethod
    def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """weight [N, K] -> (codes int8 [P, G, 512], float32 scales [P, G, 16]): symmetric per group of
        32, the scale max |w| / 127 (GGUF's Q8_0 rule), codes -127..127, in panels of 16 columns
        (csrc/w8a8.cpp), P = ceil(N / 16), G = K / 32; the last panel's missing columns zero."""
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"w8a8 needs in_features % {GROUP} == 0, got {k}")
        g, p = k // GROUP, -(-n // PANEL)
        w = torch.zeros(p * PANEL, g, GROUP)
        w[:n] = weight.detach().float().view(n, g, GROUP)
        scale = w.abs().amax(-1) / 127.0
        q = torch.round(w / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-127, 127).to(torch.int8)
        # [panel, column, group, block, j] -> [panel, group, block, column, j]
        q = q.view(p, PANEL, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(p, g, 8 * PANEL * 4).contiguous()
        return q, scale.view(p, PANEL, g).transpose(1, 2).contiguous()

    @staticmethod
    def pack_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                   sub: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
        """The general form's panels from a format's own values: codes [N, K] int8, scale [N, K / 32]
        float32, zero [N, K / 32] float32 or None, sub [N, K / 16] int8 or None (w = scale sub codes +
        zero), N a multiple of 16 -> (codes [P, G, 512] int8, scale [P, G, 16] float32, zero [P, G, 16]
        float32 or None, sub [P, G, 32] int8 or None: per group the 16 columns' first half, then their
        second)."""
        n, k = codes.shape
        if k % GROUP or n % PANEL:
            raise ValueError(f"w8a8 needs in_features % {GROUP} == 0 and out_features % {PANEL} == 0, got [{n}, {k}]")
        g, p = k // GROUP, n // PANEL
        q = codes.to(torch.int8).reshape(p, PANEL, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(p, g, 8 * PANEL * 4)

        def panels(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.float().reshape(p, PANEL, g).transpose(1, 2).contiguous()

        subs = None if sub is None else \
            sub.to(torch.int8).reshape(p, PANEL, g, 2).permute(0, 2, 3, 1).reshape(p, g, 2 * PANEL).contiguous()
        return q.contiguous(), panels(scale), panels(zero), subs

    @staticmethod
    def pack6(codes: torch.Tensor, d: torch.Tensor, sub: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """GGUF Q6_K in six bits a code: codes [N, K] int8 q - 32 (-32..31), d [N, K / 256] float16, sub
        [N, K / 16] int8 (w = d sub (q - 32)), N a multiple of 16 -> (codes [P, G, 384] uint8: four
        blocks of 64 six-bit codes with two more bits each, then two of 64 nibbles (csrc/w8a8.h's
        columns6), d [P, G / 8, 16]
        float16, sub [P, G, 32] int8 as pack_codes()'s)."""
        n, k = codes.shape
        if k % (8 * GROUP) or n % PANEL:
            raise ValueError(f"Q6_K needs in_features % 256 == 0 and out_features % {PANEL} == 0, got [{n}, {k}]")
        g, p = k // GROUP, n // PANEL
        u = (codes.cpu().numpy().astype(np.int16) + 32).astype(np.uint8)
        u = u.reshape(p, PANEL, g, 8, 4).transpose(0, 2, 3, 1, 4)  # [panel, group, block, column, j]
        first = u[:, :, :4] | ((u[:, :, 4:] >> 4) << 6)  # block a's six bits, block a + 4's top two
        nib = (u[:, :, 4:6] & 0x0F) | ((u[:, :, 6:8] & 0x0F) << 4)  # blocks 4 + e and 6 + e's low four
        c = np.concatenate([first.reshape(p, g, 256), nib.reshape(p, g, 128)], axis=-1)
        dd = d.to(torch.float16).reshape(p, PANEL, g // 8).transpose(1, 2).contiguous()
        subs = sub.to(torch.int8).reshape(p, PANEL, g, 2).permute(0, 2, 3, 1).reshape(p, g, 2 * PANEL).contiguous()
        return torch.from_numpy(np.ascontiguousarray(c)), dd, subs

    @staticmethod
    def unpack6(codes: torch.Tensor, d: torch.Tensor, sub: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """pack6()'s inverse: (codes [N, K] int8 q - 32, d [N, K / 256] float16, sub [N, K / 16] int8)."""
        p, g, _ = codes.shape
        c = codes.numpy()
        first, nib = c[..., :256].reshape(p, g, 4, PANEL, 4), c[..., 256:].reshape(p, g, 2, PANEL, 4)
        late = ((first >> 6) << 4) | np.concatenate([nib & 0x0F, nib >> 4], axis=2)  # blocks 4..7
        q = np.concatenate([first & 0x3F, late], axis=2).astype(np.int16) - 32  # [p, g, 8 blocks, column, j]
        q = torch.from_numpy(q.astype(np.int8)).permute(0, 3, 1, 2, 4).reshape(p * PANEL, g * GROUP)
        return (q, d.transpose(1, 2).reshape(p * PANEL, g // 8),
                sub.view(p, g, 2, PANEL).permute(0, 3, 1, 2).reshape(p * PANEL, 2 * g))

    def linear6(self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, sub: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] (bfloat16 or float32, CPU) -> [M, N] in `out_dtype` (default x's), no bias: Q6_K in six
        bits a code (pack6()'s panels), the bits linear_general() gives the same weights."""
        if x.dim() != 2 or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"w8a8 wants a 2-D bfloat16 or float32 CPU input, got {tuple(x.shape)} "
                             f"{x.dtype} on {x.device}")
        x = x.contiguous()
        m, k = x.shape
        _expect("w8a8", "codes", codes, (torch.uint8,), (None, None, 384))
        p, g, _ = codes.shape
        if k != g * GROUP or g % 8:
            raise ValueError(f"w8a8 (Q6_K): input has {k} features, the weights {g * GROUP} (a multiple of 256)")
        _expect("w8a8", "d", d, (torch.float16,), (p, g // 8, PANEL))
        _expect("w8a8", "sub", sub, (torch.int8,), (p, g, 2 * PANEL))
        out_dtype = out_dtype or x.dtype
        y = torch.empty(m, p * PANEL, dtype=out_dtype)
        rc = self._six(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, codes.data_ptr(), d.data_ptr(),
                       sub.data_ptr(), p * PANEL, y.data_ptr(), int(out_dtype == torch.bfloat16), _threads())
        if rc:
            raise RuntimeError(f"w8a8 kernel failed (code {rc}: {'bad shapes' if rc == 1 else 'out of memory'})")
        return y

    @staticmethod
    def unpack_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     sub: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """pack_codes()'s inverse: (codes [N, K] int8, scale [N, G], zero [N, G] or None, sub [N, 2 G] or None)."""
        p, g, _ = codes.shape
        q = codes.view(p, g, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, g * GROUP)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.transpose(1, 2).reshape(p * PANEL, g)

        subs = None if sub is None else sub.view(p, g, 2, PANEL).permute(0, 3, 1, 2).reshape(p * PANEL, 2 * g)
        return q, rows(scale), rows(zero), subs

    def linear_general(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       sub: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] (bfloat16 or float32, CPU) -> [M, N] in `out_dtype` (default x's), no bias: the general
        form on pack_codes()'s panels (w = scale sub codes + zero; N every column the panels hold)."""
        x, n = self._checked(x, codes, scale, None)
        m, k = x.shape
        p, g, _ = codes.shape
        if zero is not None:
            _expect("w8a8", "zero", zero, (torch.float32,), (p, g, PANEL))
        if sub is not None:
            _expect("w8a8", "sub", sub, (torch.int8,), (p, g, 2 * PANEL))
        out_dtype = out_dtype or x.dtype
        y = torch.empty(m, n, dtype=out_dtype)
        rc = self._general(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, codes.data_ptr(), scale.data_ptr(),
                           None if zero is None else zero.data_ptr(), None if sub is None else sub.data_ptr(), n,
                           y.data_ptr(), int(out_dtype == torch.bfloat16), _threads())
        if rc:
            raise RuntimeError(f"w8a8 kernel failed (code {rc}: {'bad shapes' if rc == 1 else 'out of memory'})")
        return y

    @staticmethod
    def unpack(codes: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
        """The weights pack() stands for, float32 [n, K]: codes times their group's scale."""
        p, g, _ = codes.shape
        w = codes.view(p, g, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, g, GROUP).float()
        return (w * scale.transpose(1, 2).reshape(p * PANEL, g, 1)).reshape(p * PANEL, g * GROUP)[:n]

    @staticmethod
    def _checked(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, n: int | None) -> tuple[torch.Tensor, int]:
        """(x contiguous, the weight's rows n; None: every column the panels hold), or a ValueError
        naming what the kernel cannot take."""
        if x.dim() != 2 or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"w8a8 wants a 2-D bfloat16 or float32 CPU input, got {tuple(x.shape)} "
                             f"{x.dtype} on {x.device}")
        x = x.contiguous()
        m, k = x.shape
        _expect("w8a8", "codes", codes, (torch.int8,), (None, None, 8 * PANEL * 4))
        p, g, _ = codes.shape
        if k != g * GROUP:
            raise ValueError(f"w8a8: input has {k} features, the weights {g * GROUP}")
        _expect("w8a8", "scale", scale, (torch.float32,), (p, g, PANEL))
        n = p * PANEL if n is None else n
        if not p * PANEL - PANEL < n <= p * PANEL:
            raise ValueError(f"w8a8: {n} columns asked of {p} panels of {PANEL}")
        return x, n

    def linear(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, n: int | None = None,
               threads: int | None = None) -> torch.Tensor:
        """x [M, K] bfloat16 or float32 (CPU) -> float32 [M, n]; the weights are pack()'s output,
        n the weight's rows (default: every column the panels hold); threads: default torch's count."""
        x, n = self._checked(x, codes, scale, n)
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.float32)
        rc = self._fn(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, codes.data_ptr(), scale.data_ptr(), n,
                      y.data_ptr(), threads or _threads())
        if rc:
            raise RuntimeError(f"w8a8 kernel failed (code {rc}: {'bad shapes' if rc == 1 else 'out of memory'})")
        return y

    def columns(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, n: int,
                ids: list) -> list[torch.Tensor]:
        """Row m of x [M, K] (bfloat16 or float32, CPU) at columns ids[m] (integers in 0..n-1: a numpy
        array, a list or a CPU tensor) -> float32 values, the bits linear() gives those columns (one
        thread, column by column: for the few tokens a grammar's mask allows, without a pass over the
        whole weight)."""
        x, n = self._checked(x, codes, scale, n)
        m, k = x.shape
        if len(ids) != m:
            raise ValueError(f"w8a8 columns: {len(ids)} id lists for {m} rows")
        flat = np.ascontiguousarray(ids[0] if m == 1 else np.concatenate(ids) if m else [], dtype=np.int64)
        offsets = np.zeros(m + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(i) for i in ids])
        y = np.empty(len(flat), dtype=np.float32)
        rc = self._columns(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, codes.data_ptr(), scale.data_ptr(), n,
                           flat.ctypes.data, offsets.ctypes.data, y.ctypes.data)
        if rc == 1:
            raise ValueError(f"w8a8 columns: a column id outside 0..{n - 1}")
        if rc:
            raise RuntimeError("w8a8 columns: out of memory")
        return [torch.from_numpy(v) for v in np.split(y, offsets[1:-1])] if m > 1 else [torch.from_numpy(y)]


class BF16:
    """The loaded dense bfloat16 kernel (csrc/bf16.cpp)."""

    PANEL = 8

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._fn = _bind(self._lib, "augury_bf16_linear", [_P, _I32, _I64, _I64, _P, _I64, _P, _P, _I32, _I32], _I32)

    @classmethod
    def pack(cls, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] -> bfloat16 panels [ceil(N / 8), K, 8] (columns past N zero)."""
        n, k = weight.shape
        if k % 8:
            raise ValueError(f"the bf16 kernel needs in_features % 8 == 0, got {k}")
        p = -(-n // cls.PANEL)
        w = torch.zeros(p * cls.PANEL, k, dtype=torch.bfloat16)
        w[:n] = weight.detach().to(torch.bfloat16)
        return w.view(p, cls.PANEL, k).transpose(1, 2).contiguous()

    @classmethod
    def unpack(cls, packed: torch.Tensor, n: int) -> torch.Tensor:
        """pack()'s inverse: [N, K] bfloat16."""
        p, k, _ = packed.shape
        return packed.transpose(1, 2).reshape(p * cls.PANEL, k)[:n].contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [M, K] bfloat16 or float32 (CPU) -> [M, n] in out_dtype (bfloat16: rounded once, then
        + the bfloat16 bias rounded again, as nn.Linear in bfloat16; float32: unrounded)."""
        if x.dim() != 2 or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the bf16 kernel wants a 2-D bfloat16 or float32 CPU input, got {tuple(x.shape)} "
                             f"{x.dtype} on {x.device}")
        x = x.contiguous()
        m, k = x.shape
        _expect("bf16", "panels", packed, (torch.bfloat16,), (None, None, self.PANEL))
        if k != packed.shape[1]:
            raise ValueError(f"bf16 kernel: input has {k} features, the weights {packed.shape[1]}")
        if not 0 <= n <= self.PANEL * packed.shape[0]:
            raise ValueError(f"bf16 kernel: {n} columns asked of {packed.shape[0]} panels of {self.PANEL}")
        if bias is not None:
            _expect("bf16", "bias", bias, (torch.bfloat16,), (n,))
        y = torch.empty(m, n, dtype=out_dtype)
        rc = self._fn(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, packed.data_ptr(), n,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), int(out_dtype == torch.bfloat16),
                      _threads())
        if rc:
            raise RuntimeError(f"bf16 kernel failed (code {rc}: {'bad shapes' if rc == 1 else 'out of memory'})")
        return y


# the cache dtypes the attention kernel reads, by its format code (csrc/attention.h)
ATTENTION_CACHE_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}


class AttentionKernel:
    """The loaded exact-rows attention kernel (csrc/attention.cpp)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._fn = _bind(self._lib, "augury_attend_rows", [_P, _I32, _I64, _I64, _I64, _P, _P, _I32, _I64, _I64, _P,
                                                           _P, _I64, ctypes.c_float, _P, _I32, _I32], _I32)

    def attend_rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    nkeys: torch.Tensor, scale: float) -> torch.Tensor:
        """q [R, nh, hd]; k_cache / v_cache [S, nkv, hd] (float32, bfloat16 or float8_e4m3fn, contiguous;
        widened to float32 exactly as read); slots [R, W] int64, of which row r reads the first nkeys[r]
        (int32 [R]), each a slot of the cache (0..S-1; the kernel checks them before reading). Returns
        [R, nh * hd] in q's dtype."""
        if q.dtype not in (torch.bfloat16, torch.float32) or k_cache.dtype not in ATTENTION_CACHE_FORMATS \
                or v_cache.dtype != k_cache.dtype or slots.dtype != torch.int64 or nkeys.dtype != torch.int32:
            raise ValueError(f"attend_rows: unsupported dtypes q {q.dtype}, cache {k_cache.dtype}/{v_cache.dtype}, "
                             f"slots {slots.dtype}, nkeys {nkeys.dtype}")
        if q.dim() != 3 or k_cache.dim() != 3 or q.shape[2] % 8 or q.shape[1] % max(k_cache.shape[1], 1):
            raise ValueError(f"attend_rows: shapes q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, "
                             f"slots {tuple(slots.shape)}, nkeys {tuple(nkeys.shape)}")
        r, nh, hd = q.shape
        s, nkv = k_cache.shape[:2]
        _expect("attend_rows", "q", q, (q.dtype,), (r, nh, hd))
        _expect("attend_rows", "k_cache", k_cache, (k_cache.dtype,), (s, nkv, hd))
        _expect("attend_rows", "v_cache", v_cache, (k_cache.dtype,), (s, nkv, hd))
        _expect("attend_rows", "slots", slots, (torch.int64,), (r, None))
        _expect("attend_rows", "nkeys", nkeys, (torch.int32,), (r,))
        out = torch.empty(r, nh * hd, dtype=q.dtype)
        rc = self._fn(q.data_ptr(), int(q.dtype == torch.bfloat16), r, nh, hd, k_cache.data_ptr(), v_cache.data_ptr(),
                      ATTENTION_CACHE_FORMATS[k_cache.dtype], nkv, s, slots.data_ptr(), nkeys.data_ptr(), slots.shape[1],
                      scale, out.data_ptr(), int(q.dtype == torch.bfloat16), _threads())
        if rc:
            raise ValueError("attend_rows: " + {2: "key counts out of range (each row needs 1..W keys)",
                                                3: f"a row's slot is outside the cache (0..{s - 1})"}.get(rc, "bad shapes"))
        return out


class Elementwise:
    """The loaded per-row kernels (csrc/elementwise.cpp): RMSNorm of a float32 stream, rotary, silu(gate) *
    up, and the sampler's draw of a sampled row."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._rmsnorm = _bind(self._lib, "augury_rmsnorm", [_P, _I64, _I64, _P, _I32, ctypes.c_float, _P, _I32, _I32])
        self._rope = _bind(self._lib, "augury_rope", [_P, _I64, _I64, _I64, _P, _P, _I32, _P, _I32])
        self._silu_mul = _bind(self._lib, "augury_silu_mul", [_P, _I64, _I64, _I32, _P, _I32])
        self._draw = _bind(self._lib, "augury_draw_filtered", [_P, _I64, _I64, _P, _P, _P, _P, _P, _P])

    def draw(self, logits: torch.Tensor, temperatures: Sequence[float], top_ks: Sequence[int | None],
             top_ps: Sequence[float], min_ps: Sequence[float], uniforms: Sequence[float]) -> list[int]:
        """logits float32 CPU [R, V] -> one token per row drawn at the row's uniform from softmax(logits
        / t) under the row's top-k (None or <= 0: none), min-p and top-p, as
        sampling.apply_sampling_filters filters it (csrc/elementwise.cpp says how, in which order); -1
        where the row has a NaN or +inf logit or no finite one. Each t > 0."""
        r = logits.shape[0] if logits.dim() == 2 else -1
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 \
                or not len(temperatures) == len(top_ks) == len(top_ps) == len(min_ps) == len(uniforms) == r:
            raise ValueError(f"draw wants float32 CPU [R, V] logits and R temperatures, top-ks, top-ps, "
                             f"min-ps and uniforms, got {logits.dtype} {tuple(logits.shape)} on "
                             f"{logits.device}, {len(temperatures)}, {len(top_ks)}, {len(top_ps)}, "
                             f"{len(min_ps)} and {len(uniforms)}")
        if any(not t > 0.0 for t in temperatures):
            raise ValueError(f"draw: temperatures must be > 0, got {list(temperatures)}")
        x = logits.contiguous()
        v = x.shape[1]
        t = torch.tensor(temperatures, dtype=torch.float32)
        k = torch.tensor([0 if kk is None or kk <= 0 or kk >= v else kk for kk in top_ks], dtype=torch.int64)
        tp = torch.tensor(top_ps, dtype=torch.float32)
        mp = torch.tensor(min_ps, dtype=torch.float32)
        u = torch.tensor(uniforms, dtype=torch.float64)
        out = torch.empty(r, dtype=torch.int64)
        if r and v:
            self._draw(x.data_ptr(), r, v, t.data_ptr(), k.data_ptr(), tp.data_ptr(), mp.data_ptr(), u.data_ptr(),
                       out.data_ptr())
        else:
            out.fill_(-1)
        return out.tolist()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x float32 [..., dim] -> x / rms(x) * weight, in weight's dtype (bfloat16 or float32)."""
        if x.dtype != torch.float32 or weight.dtype not in (torch.bfloat16, torch.float32) \
                or x.device.type != "cpu" or weight.device.type != "cpu" or x.shape[-1] != weight.shape[0]:
            raise ValueError(f"rms_norm wants float32 CPU input and a bfloat16/float32 weight of its width, got "
                             f"{x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
        x = x.contiguous()
        w = weight.contiguous()
        out = torch.empty(x.shape, dtype=w.dtype)
        dim = x.shape[-1]
        self._rmsnorm(x.data_ptr(), x.numel() // dim, dim, w.data_ptr(), int(w.dtype == torch.bfloat16),
                                 eps, out.data_ptr(), int(w.dtype == torch.bfloat16), _threads())
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, Q, heads, hd]; cos / sin [B, Q, 1, hd] of x's dtype (bfloat16 or float32)."""
        b, q, heads, hd = x.shape
        if x.dtype not in (torch.bfloat16, torch.float32) or cos.dtype != x.dtype or sin.dtype != x.dtype \
                or tuple(cos.shape) != (b, q, 1, hd) or tuple(sin.shape) != (b, q, 1, hd) or hd % 2 \
                or x.device.type != "cpu":
            raise ValueError(f"rope: x {x.dtype} {tuple(x.shape)}, cos {cos.dtype} {tuple(cos.shape)}")
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rope(x.data_ptr(), b * q, heads, hd, cos.data_ptr(), sin.data_ptr(),
                              int(x.dtype == torch.bfloat16), out.data_ptr(), _threads())
        return out


    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [..., 2 n] (gate then up; bfloat16 or float32, CPU) -> silu(gate) * up [..., n], float32
        arithmetic rounded once."""
        if gu.dtype not in (torch.bfloat16, torch.float32) or gu.device.type != "cpu" or gu.shape[-1] % 2:
            raise ValueError(f"silu_mul wants a bfloat16/float32 CPU [..., 2n] tensor, got {gu.dtype} "
                             f"{tuple(gu.shape)} on {gu.device}")
        gu = gu.contiguous()
        n = gu.shape[-1] // 2
        out = torch.empty(*gu.shape[:-1], n, dtype=gu.dtype)
        self._silu_mul(gu.data_ptr(), gu.numel() // (2 * n) if n else 0, n, int(gu.dtype == torch.bfloat16),
                       out.data_ptr(), _threads())
        return out


class Forward:
    """The loaded whole-stack kernel (csrc/forward.cpp); models/fused.py builds its arguments."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self.nfields = _bind(self._lib, "augury_forward_nfields", [], _I32)()
        self.run = _bind(self._lib, "augury_forward_layers",
                         [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _P, _P, _P, _I64, _P, _P,
                          _P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _P, _P, _I32], _I32)


class HeadKernel:
    """The loaded EAGLE-3 head kernel (csrc/head.cpp); models/eagle3_fused.py builds its arguments."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self.nfields = _bind(self._lib, "augury_head_nfields", [], _I32)()
        self.run = _bind(self._lib, "augury_head_forward",
                         [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _P, _P, _P, _P, _I64, _P, _P,
                          _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _I32], _I32)


def _rounding_self_check(k: W4A8 | W8A8) -> None:
    """Identity weights give back the rounded activations (w4a8 and w8a8 round alike): catches a
    miscompiled or foreign library."""
    x = torch.tensor([[0.5, -1.0, 0.25, 2.0] * 16], dtype=torch.float32)  # [1, 64]: exactly representable
    if isinstance(k, W8A8):
        packed = k.pack(torch.eye(64))
    else:  # codes 8 + I with scale 1, zero 0: the values (q - 8) s + z are I
        packed = k.pack(8 + torch.eye(64, dtype=torch.int32), torch.ones(64, 2), torch.zeros(64, 2))
    got = k.linear(x, *packed)
    want = torch.round(x * (127.0 / 2.0)) * (2.0 / 127.0)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        raise KernelUnavailable(f"self-check failed ({k.path})")


def _bf16_self_check(k: BF16) -> None:
    """A small product against float64 (exact in float32: small integers)."""
    w = torch.arange(-40, 40, dtype=torch.float32).view(10, 8) / 8  # exact in bfloat16
    x = torch.arange(24, dtype=torch.float32).view(3, 8) - 12
    got = k.linear(x, k.pack(w), 10, out_dtype=torch.float32)
    if not torch.equal(got, (x.double() @ w.double().t()).float()) or not torch.equal(k.unpack(k.pack(w), 10).float(), w):
        raise KernelUnavailable(f"self-check failed ({k.path})")


def _attention_self_check(k: AttentionKernel) -> None:
    """One row over two keys against the softmax written out."""
    q = torch.ones(1, 1, 8)
    kc = torch.stack([torch.zeros(1, 8), torch.full((1, 8), 0.25)])  # [2 slots, 1 head, 8]
    vc = torch.stack([torch.ones(1, 8), torch.full((1, 8), 3.0)])
    got = k.attend_rows(q, kc, vc, torch.tensor([[0, 1]]), torch.tensor([2], dtype=torch.int32), 1.0)
    p = torch.softmax(torch.tensor([0.0, 2.0]), 0)
    if not torch.allclose(got, (p[0] * 1.0 + p[1] * 3.0).expand(1, 8), rtol=1e-5, atol=1e-6):
        raise KernelUnavailable(f"self-check failed ({k.path})")


def _elementwise_self_check(k: Elementwise) -> None:
    x = torch.tensor([[3.0, -4.0] * 4])  # rms 3.5355...
    got = k.rms_norm(x, torch.full((8,), 2.0), 0.0)
    if not torch.allclose(got, x / (12.5 ** 0.5) * 2.0, rtol=1e-6):
        raise KernelUnavailable(f"self-check failed ({k.path})")
    v = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    c, s_ = torch.full((1, 1, 1, 4), 0.5), torch.full((1, 1, 1, 4), 2.0)
    if not torch.equal(k.rope(v, c, s_), torch.tensor([-5.5, -7.0, 3.5, 6.0]).view(1, 1, 1, 4)):
        raise KernelUnavailable(f"self-check failed ({k.path})")
    gu = torch.tensor([[0.0, 2.0, 3.0, 5.0]])
    if not torch.allclose(k.silu_mul(gu), torch.tensor([[0.0, 2.0 / (1.0 + math.exp(-2.0)) * 5.0]]), rtol=1e-6):
        raise KernelUnavailable(f"self-check failed ({k.path})")


def _forward_self_check(k: Forward) -> None:
    """No layers: the final norm alone, against the formula."""
    h = torch.tensor([[3.0, -4.0] * 16])  # [1, 32]
    w = torch.full((32,), 2.0, dtype=torch.bfloat16)
    out = torch.empty(1, 32, dtype=torch.bfloat16)
    none, one = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32)
    rc = k.run(h.data_ptr(), 1, 32, 1, 1, 32, 32, 0, 0.0, none.data_ptr(), None, None, 32, none.data_ptr(),
               none.data_ptr(), one.data_ptr(), 1, None, None, None, 0, None, None, 0, w.data_ptr(), out.data_ptr(), 1)
    if rc or not torch.allclose(out.float(), h / (12.5 ** 0.5) * 2.0, rtol=1e-2):
        raise KernelUnavailable(f"self-check failed ({k.path})")


def _head_self_check(k: HeadKernel) -> None:
    """Its table's width, and its shape checks: no rows is fine, a head width outside whole groups is not."""
    none = torch.zeros(1, dtype=torch.int64)
    one = torch.ones(1, dtype=torch.int32)

    def call(h: int) -> int:
        return k.run(none.data_ptr(), 0, h, 0, 1, 1, 32, 32, 0.0, None, None, none.data_ptr(), None, 1, None, None,
                     1, none.data_ptr(), none.data_ptr(), one.data_ptr(), 1, None, None, none.data_ptr(), 0, 16, 16, 1,
                     None, None, 1)

    if k.nfields != 40 or call(32) != 0 or call(33) != 1:
        raise KernelUnavailable(f"self-check failed ({k.path})")


def _warn_once(reason: str, name: str) -> None:
    """Kernel `name` is off for `reason` (which names no kernel, so that one cause failing every
    kernel, e.g. a compiler that does not run, is one warning; the others say so at INFO)."""
    if reason in _warned:
        log.info("augury's %s CPU kernel is unavailable too (%s)", name, reason)
    else:
        _warned.add(reason)
        log.warning("augury's %s CPU kernel is unavailable (%s); torch's kernels run instead", name, reason)


def level() -> str | None:
    """The ISA level the kernels run at (cpu/isa.py), or None where they cannot run here."""
    return isa.selected_level() if isa.why_unsupported() is None else None


def _load(name: str, make, check) -> object | None:
    """Build, load and self-check kernel `name` once; None (after one warning per reason) where it
    cannot run."""
    if name in _cache:
        return _cache[name]
    kernel = None
    if not cpu_kernels_enabled():
        log.info("augury CPU kernels off (%s=%s): torch's kernels run", CPU_KERNELS_VAR,
                 os.environ.get(CPU_KERNELS_VAR))
    elif (why := isa.why_unsupported()) is not None:
        _warn_once(why, name)
    else:
        try:
            kernel = make(build(name, isa.selected_level()))
            check(kernel)
        except Exception as e:  # noqa: BLE001 - any failure to build, load or check: torch's kernels run
            _warn_once(str(e) or type(e).__name__, name)
            kernel = None
    _cache[name] = kernel
    return kernel


def w4a8() -> W4A8 | None:
    """The w4a8 kernel, built and loaded on first use; None (after one warning) where it cannot run."""
    return _load("w4a8", W4A8, _rounding_self_check)  # type: ignore[return-value]


def w8a8() -> W8A8 | None:
    """The w8a8 kernel, built and loaded on first use; None (after one warning) where it cannot run."""
    return _load("w8a8", W8A8, _rounding_self_check)  # type: ignore[return-value]


def bf16() -> BF16 | None:
    """The dense bfloat16 kernel, built and loaded on first use; None where it cannot run."""
    return _load("bf16", BF16, _bf16_self_check)  # type: ignore[return-value]


def attention() -> AttentionKernel | None:
    """The exact-rows attention kernel, built and loaded on first use; None where it cannot run."""
    return _load("attention", AttentionKernel, _attention_self_check)  # type: ignore[return-value]


def elementwise() -> Elementwise | None:
    """The per-row kernels (RMSNorm, rotary), built and loaded on first use; None where they cannot run."""
    return _load("elementwise", Elementwise, _elementwise_self_check)  # type: ignore[return-value]


@functools.cache
def _omp():
    """libgomp as torch loaded it (dlopen by its soname finds the copy already in the process, the one
    augury's kernels link too), or None where there is none to find (another runtime, not Linux)."""
    try:
        lib = ctypes.CDLL("libgomp.so.1")
        _bind(lib, "omp_get_max_threads", [], _I32)
        _bind(lib, "omp_set_num_threads", [_I32])
        return lib
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def torch_threads(n: int):
    """In this block, in the calling thread only, torch's own CPU operators run `n` threads (at most
    torch's count outside such blocks, threads.torch_count).

    torch's parallel operators size their OpenMP teams by the calling thread's nthreads ICV
    (omp_get_max_threads, which torch.get_num_threads reads), so setting it with omp_set_num_threads in
    this thread changes nothing for other threads (a host application's, a server's) and nothing
    process-wide; it is restored on exit. No-op where n is 0 or already the count, or where the
    runtime found is not the one torch reads (checked: torch's count must follow). Needs no kernel
    built: the kernels-off path uses it too (attention/paged.py)."""
    outer = cpu_threads.torch_count()
    n = min(n, outer)
    lib = _omp() if n > 0 and n != torch.get_num_threads() else None
    if lib is None:
        yield
        return
    before = lib.omp_get_max_threads()
    lib.omp_set_num_threads(n)
    if torch.get_num_threads() != n:  # not the runtime torch reads: leave both alone
        lib.omp_set_num_threads(before)
        yield
        return
    try:
        with cpu_threads.torch_outer(outer):
            yield
    finally:
        lib.omp_set_num_threads(before)


def forward() -> Forward | None:
    """The whole-stack kernel, built and loaded on first use; None where it cannot run."""
    return _load("forward", Forward, _forward_self_check)  # type: ignore[return-value]


def head() -> HeadKernel | None:
    """The EAGLE-3 head kernel, built and loaded on first use; None where it cannot run."""
    return _load("head", HeadKernel, _head_self_check)  # type: ignore[return-value]


def load_all() -> dict[str, bool]:
    """Build (or find in the cache) and load every kernel now, as the engine's "CPU kernels" start-up
    stage does, rather than at first use; name -> whether it runs here (each that cannot warned once)."""
    loaders = {"w4a8": w4a8, "w8a8": w8a8, "bf16": bf16, "attention": attention, "elementwise": elementwise,
               "forward": forward, "head": head}
    return {name: loaders[name]() is not None for name in NAMES}


def disable_all() -> None:
    """Every kernel off for this process (the start-up stage failed): torch's kernels run."""
    for name in NAMES:
        _cache[name] = None


def reset() -> None:
    """Forget what the kernel loaders found (tests)."""
    _cache.clear()
    _warned.clear()
