"""GGUF tensors run in their own formats' values (not dequantised): the linears and the plan.

A GGUF conversion (models/gguf.py) writes each quantised tensor it can run natively to a side file
in one of these kinds (models/gguf_blocks.py decodes the blocks):

- "int4": Q4_0 / Q4_1, codes 0..15 with w = (q - 8) scale + zero: Q4_0 (zero 0) on W40Linear, the
  w4a8 kernel with its float16 d and no zero (4.5 bits a weight, the format's values exactly); Q4_1 on
  quant.Int4Linear, the w4a8 kernel with bfloat16 scales and zeros (5 bits a weight, d and m + 8d
  rounded to bfloat16);
- "q4k": Q4_K, codes 0..15 and its own scales, w = d sc q - dmin m (W4KLinear, the w4a8 kernel's
  super-block form: d, dmin float16 per 256, sc, m 6-bit per 32 in a byte each: 4.625 bits a weight,
  the format's values exactly);
- "q5k": Q5_K, the same with codes 0..31, their fifth bits beside (W4KLinear too: 5.625 bits);
- "q6k": Q6_K, codes q - 32 in six bits, d float16 per 256, int8 sub-scales per 16 (W6KLinear, the
  w8a8 kernel's six-bit form: 6.5625 bits a weight, exact);
- "q8g": Q8_0, Q5_0, Q5_1, int8 codes with w = scale sub q + zero, a float32 scale per 32 and Q5_1's
  float32 zero per 32 (W8GLinear, the w8a8 kernel's general form: exact, 9-10 bits a weight; it also
  takes Q6_K's sub-scales and the K-quants' mins where a linear mixes them with an 8-bit part).

One module holds one linear of the target, and the target fuses q|k|v and gate|up: a Q4_K_M file
keeps q and k in Q4_K and v in Q6_K in some layers. `plan` takes the narrowest kind every part fits
exactly: all int4 -> W40Linear where every zero is 0 (Q4_0), else Int4Linear; all q4k / q5k ->
W4KLinear; all q6k -> W6KLinear. Parts of several kinds run as a SegmentedLinear, each run of one kind on its own kernel (whole panels of 16 rows each);
where that cannot be, int4 with q4k -> W4FLinear (float32 scale and zero per 32, 6 bits a weight:
Q4_K's d sc and -dmin m exactly, Q4_0's zero -8d exactly, Q4_1's m + 8d as rounded once already) and
anything else W8GLinear (4-, 5- and 6-bit codes are int8 codes too, with their sub-scales and zeros). A part
with no native kind (an IQ type, F16) keeps the whole linear dense, and the loader names every such
linear and its types in one start-up line.
"""
from __future__ import annotations

import logging

import torch

from torch import nn

from augury.cpu import kernels as cpu_kernels
from augury.models.fused import KernelModule, linear_fields
from augury.models.quant import INT4_GROUP, INT4_N_MULTIPLE, Int4Linear, _QuantLinear

log = logging.getLogger(__name__)

KINDS = ("int4", "q4k", "q5k", "q6k", "q8g")
# forward.cpp's projection kinds (its Kind enum)
FUSED_W4F, FUSED_W8G, FUSED_W4K, FUSED_W6K, FUSED_SEGMENTS, FUSED_W40 = 2, 3, 4, 5, 6, 7


class W4FLinear(_QuantLinear):
    """4-bit codes with float32 scales and zeros per group of 32, w = q scale + zero (GGUF's Q4_K
    exactly: scale = d sc, zero = -dmin m), on the w4a8 kernel's float32 form (bfloat16, CPU)."""

    kernel_devices = ("cpu",)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None) -> None:
        """codes [N, K] integers 0..15; scale, zero [N, K / 32] float32 (their values are kept exactly)."""
        kernel = cpu_kernels.w4a8()
        n, k = codes.shape
        if kernel is None or n % INT4_N_MULTIPLE or k % INT4_GROUP:
            raise ValueError(f"W4FLinear needs augury's w4a8 kernel and a [N % 16, K % 32] shape, got [{n}, {k}]")
        super().__init__(bias, torch.bfloat16, torch.device("cpu"))
        self.out_features, self.in_features = n, k
        c, s, z = kernel.pack(codes, scale, zero, torch.float32)
        self.register_buffer("codes", c)  # [N/16, K/32, 256] uint8
        self.register_buffer("scale", s)  # [N/16, K/32, 16] float32
        self.register_buffer("zero", z)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K] the kernel multiplies (before the activations' rounding)."""
        codes, scale, zero = cpu_kernels.W4A8.unpack(self.codes, self.scale, self.zero)
        n, k = codes.shape
        q = codes.float().view(n, k // INT4_GROUP, INT4_GROUP)
        return (q * scale[..., None] + zero[..., None]).view(n, k)

    def scales_device(self) -> torch.device:
        return self.scale.device

    def _kernel(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        kernel = cpu_kernels.w4a8()
        if kernel is None:
            raise RuntimeError("this linear was packed for augury's w4a8 kernel, which is unavailable now")
        return kernel.linear(x, self.codes, self.scale, self.zero, out_dtype)

    def fused_fields(self) -> list[int] | None:
        b = self.bias
        if b is not None and not b.is_contiguous():
            return None
        return [FUSED_W4F, self.codes.data_ptr(), self.scale.data_ptr(), self.zero.data_ptr(), 0,
                0 if b is None else b.data_ptr()]

    def extra_repr(self) -> str:
        return super().extra_repr() + ", w4a8 float32 scales (Q4_K)"


class W40Linear(_QuantLinear):
    """GGUF's Q4_0 in its own numbers, w = (q - 8) d (d float16 per 32, no zero), on the w4a8 kernel
    (bfloat16, CPU): 4.5 bits a weight, the bytes llama.cpp reads a token, where Int4Linear's bfloat16
    scale and zero take 5 and round d to 8 significant bits."""

    kernel_devices = ("cpu",)

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None) -> None:
        """codes [N, K] integers 0..15; d [N, K / 32] float16 (any dtype holding float16 values exactly)."""
        kernel = cpu_kernels.w4a8()
        n, k = codes.shape
        if kernel is None or n % INT4_N_MULTIPLE or k % INT4_GROUP:
            raise ValueError(f"W40Linear needs augury's w4a8 kernel and a [N % 16, K % 32] shape, got [{n}, {k}]")
        half = d.to(torch.float16)
        if not torch.equal(half.to(d.dtype), d):
            raise ValueError("W40Linear's scales must be float16 values (GGUF's Q4_0 d)")
        super().__init__(bias, torch.bfloat16, torch.device("cpu"))
        self.out_features, self.in_features = n, k
        c, dp, _ = kernel.pack(codes, half, half, torch.float16)
        self.register_buffer("codes", c)  # [N/16, K/32, 256] uint8
        self.register_buffer("d", dp)  # [N/16, K/32, 16] float16

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K] the kernel multiplies (before the activations' rounding)."""
        codes, d, _ = cpu_kernels.W4A8.unpack(self.codes, self.d, self.d)
        n, k = codes.shape
        q = codes.float().view(n, k // INT4_GROUP, INT4_GROUP) - 8.0
        return (q * d.float()[..., None]).view(n, k)

    def scales_device(self) -> torch.device:
        return self.d.device

    def _kernel(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        kernel = cpu_kernels.w4a8()
        if kernel is None:
            raise RuntimeError("this linear was packed for augury's w4a8 kernel, which is unavailable now")
        return kernel.linear40(x, self.codes, self.d, out_dtype)

    def fused_fields(self) -> list[int] | None:
        b = self.bias
        if b is not None and not b.is_contiguous():
            return None
        return [FUSED_W40, self.codes.data_ptr(), self.d.data_ptr(), 0, 0, 0 if b is None else b.data_ptr()]

    def extra_repr(self) -> str:
        return super().extra_repr() + ", w4a8 Q4_0 float16 scales"


class W4KLinear(_QuantLinear):
    """GGUF's Q4_K (and Q5_K, its codes' fifth bits beside) in its own scales, w = d sc q - dmin m (d, dmin float16 per 256; sc, m 6-bit per 32),
    on the w4a8 kernel's super-block form (bfloat16, CPU): the bits W4FLinear gives the same weights,
    in 4.625 bits a weight instead of 6."""

    kernel_devices = ("cpu",)

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        """codes [N, K] 0..15 (Q4_K) or 0..31 (Q5_K: the fifth bits kept beside, 5.625 bits a weight);
        d, dmin [N, K / 256] float16; sc, m [N, K / 32] integers 0..63."""
        kernel = cpu_kernels.w4a8()
        n, k = codes.shape
        if kernel is None or n % INT4_N_MULTIPLE or k % (8 * INT4_GROUP):
            raise ValueError(f"W4KLinear needs augury's w4a8 kernel and a [N % 16, K % 256] shape, got [{n}, {k}]")
        super().__init__(bias, torch.bfloat16, torch.device("cpu"))
        self.out_features, self.in_features = n, k
        c, sm, dd, high = kernel.pack_k(codes, d, dmin, sc, m)
        self.register_buffer("codes", c)  # [N/16, K/32, 256] uint8: the low four bits
        self.register_buffer("sm", sm)  # [N/16, K/32, 32] uint8: sc, then m
        self.register_buffer("dd", dd)  # [N/16, K/256, 32] float16: d, then dmin
        self.register_buffer("high", high)  # [N/16, K/32, 64] uint8: Q5_K's fifth bits, or None

    def dequantize(self) -> torch.Tensor:
        codes, d, dmin, sc, m = cpu_kernels.W4A8.unpack_k(self.codes, self.sm, self.dd, self.high)
        n, k = codes.shape
        scale = d.float().repeat_interleave(8, dim=1) * sc.float()  # exact, as the kernel computes it
        zero = -(dmin.float().repeat_interleave(8, dim=1) * m.float())
        q = codes.float().view(n, k // INT4_GROUP, INT4_GROUP)
        return (q * scale[..., None] + zero[..., None]).view(n, k)

    def scales_device(self) -> torch.device:
        return self.sm.device

    def _kernel(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        kernel = cpu_kernels.w4a8()
        if kernel is None:
            raise RuntimeError("this linear was packed for augury's w4a8 kernel, which is unavailable now")
        return kernel.linear_k(x, self.codes, self.sm, self.dd, self.high, out_dtype)

    def fused_fields(self) -> list[int] | None:
        b = self.bias
        if b is not None and not b.is_contiguous():
            return None
        return [FUSED_W4K, self.codes.data_ptr(), self.sm.data_ptr(), self.dd.data_ptr(),
                0 if self.high is None else self.high.data_ptr(), 0 if b is None else b.data_ptr()]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", w4a8 {'Q5_K' if self.high is not None else 'Q4_K'} super-block scales"


class W6KLinear(_QuantLinear):
    """GGUF's Q6_K in its own six bits a code, w = d sub (q - 32) (d float16 per 256, sub int8 per 16),
    on the w8a8 kernel's six-bit form (bfloat16, CPU): the bits W8GLinear gives the same weights, in
    6.5625 bits a weight instead of 9.5."""

    kernel_devices = ("cpu",)

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, sub: torch.Tensor, bias: torch.Tensor | None) -> None:
        """codes [N, K] int8 q - 32; d [N, K / 256] float16; sub [N, K / 16] int8."""
        kernel = cpu_kernels.w8a8()
        n, k = codes.shape
        if kernel is None or n % INT4_N_MULTIPLE or k % (8 * INT4_GROUP):
            raise ValueError(f"W6KLinear needs augury's w8a8 kernel and a [N % 16, K % 256] shape, got [{n}, {k}]")
        super().__init__(bias, torch.bfloat16, torch.device("cpu"))
        self.out_features, self.in_features = n, k
        c, dd, sb = kernel.pack6(codes, d, sub)
        self.register_buffer("codes", c)  # [N/16, K/32, 384] uint8
        self.register_buffer("d", dd)  # [N/16, K/256, 16] float16
        self.register_buffer("sub", sb)  # [N/16, K/32, 32] int8

    def dequantize(self) -> torch.Tensor:
        codes, d, sub = cpu_kernels.W8A8.unpack6(self.codes, self.d, self.sub)
        s = d.float().repeat_interleave(8 * INT4_GROUP, dim=1) * sub.float().repeat_interleave(INT4_GROUP // 2, dim=1)
        return s * codes.float()

    def scales_device(self) -> torch.device:
        return self.d.device

    def _kernel(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        kernel = cpu_kernels.w8a8()
        if kernel is None:
            raise RuntimeError("this linear was packed for augury's w8a8 kernel, which is unavailable now")
        return kernel.linear6(x, self.codes, self.d, self.sub, out_dtype)

    def fused_fields(self) -> list[int] | None:
        b = self.bias
        if b is not None and not b.is_contiguous():
            return None
        return [FUSED_W6K, self.codes.data_ptr(), self.d.data_ptr(), 0, self.sub.data_ptr(),
                0 if b is None else b.data_ptr()]

    def extra_repr(self) -> str:
        return super().extra_repr() + ", w8a8 Q6_K six-bit codes"


class W8GLinear(_QuantLinear):
    """int8 codes, w = scale sub q + zero (a float32 scale per 32; an int8 sub-scale per 16 and a
    float32 zero per 32 where given), on the w8a8 kernel's general form (bfloat16, CPU): GGUF's Q8_0,
    Q6_K, Q5_0, Q5_1 and Q5_K in their exact values."""

    kernel_devices = ("cpu",)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, sub: torch.Tensor | None,
                 bias: torch.Tensor | None) -> None:
        kernel = cpu_kernels.w8a8()
        n, k = codes.shape
        if kernel is None or n % INT4_N_MULTIPLE or k % INT4_GROUP:
            raise ValueError(f"W8GLinear needs augury's w8a8 kernel and a [N % 16, K % 32] shape, got [{n}, {k}]")
        super().__init__(bias, torch.bfloat16, torch.device("cpu"))
        self.out_features, self.in_features = n, k
        c, s, z, x = kernel.pack_codes(codes, scale, zero, sub)
        self.register_buffer("codes", c)  # [N/16, K/32, 512] int8
        self.register_buffer("scale", s)  # [N/16, K/32, 16] float32
        self.register_buffer("zero", z)  # [N/16, K/32, 16] float32 or None
        self.register_buffer("sub", x)  # [N/16, K/32, 32] int8 or None

    def dequantize(self) -> torch.Tensor:
        codes, scale, zero, sub = cpu_kernels.W8A8.unpack_codes(self.codes, self.scale, self.zero, self.sub)
        n, k = codes.shape
        s = scale.float().repeat_interleave(INT4_GROUP, dim=1)
        if sub is not None:
            s = s * sub.float().repeat_interleave(INT4_GROUP // 2, dim=1)
        w = s * codes.float()
        return w if zero is None else w + zero.float().repeat_interleave(INT4_GROUP, dim=1)

    def scales_device(self) -> torch.device:
        return self.scale.device

    def _kernel(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        kernel = cpu_kernels.w8a8()
        if kernel is None:
            raise RuntimeError("this linear was packed for augury's w8a8 kernel, which is unavailable now")
        return kernel.linear_general(x, self.codes, self.scale, self.zero, self.sub, out_dtype)

    def fused_fields(self) -> list[int] | None:
        b = self.bias
        if b is not None and not b.is_contiguous():
            return None
        addr = [0 if t is None else t.data_ptr() for t in (self.codes, self.scale, self.zero, self.sub, b)]
        return [FUSED_W8G, *addr]

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", w8a8 general (zero={self.zero is not None}, "
                f"sub-scales={self.sub is not None})")


class SegmentedLinear(KernelModule, nn.Module):
    """One linear whose row blocks run on different kernels, each in its own format (a Q4_K_M layer's
    q|k on W4KLinear, its v on W6KLinear): the outputs side by side, each rounded to bfloat16 by its
    own kernel, then the bias; in the fused stack one SEGMENTS projection over the same rounded
    activations (forward.cpp), the same bits."""

    kernel_devices = ("cpu",)

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.dtype = torch.bfloat16
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16).clone(), requires_grad=False)
        # [count, then per segment n0, n, kind, C, S, Z, X]: refilled in place by fused_fields (assigning a
        # tensor would mark every fused table stale, models/fused.py)
        self.register_buffer("seg_table", torch.zeros(1 + 7 * len(parts), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def fused_fields(self) -> list[int] | None:
        b = self.bias
        rows, n0 = [len(self.parts)], 0
        for p in self.parts:
            f = linear_fields(p)
            if f is None or f[0] == 0 or f[5] != 0:  # dense parts, or a part with a bias of its own
                return None
            rows += [n0, p.out_features, *f[:5]]
            n0 += p.out_features
        if b is not None and not b.is_contiguous():
            return None
        self.seg_table.copy_(torch.tensor(rows, dtype=torch.int64))
        return [FUSED_SEGMENTS, self.seg_table.data_ptr(), 0, 0, 0, 0 if b is None else b.data_ptr()]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


Part = dict[str, torch.Tensor]


def _q4k_scales(p: Part) -> Part:
    """A q4k part as float32 scale d sc and zero -dmin m per 32 (exact)."""
    d, dmin = (p[k].float().repeat_interleave(8, dim=1) for k in ("d", "dmin"))
    return {"codes": p["codes"], "scale": d * p["sc"].float(), "zero": -(dmin * p["m"].float())}


def _as_q4f(kind: str, p: Part) -> Part:
    if kind in ("q4k", "q5k"):
        return _q4k_scales(p)
    # int4: (q - 8) s + z = q s + (z - 8 s); Q4_0's z = 0 gives -8d exactly
    scale = p["scale"].float()
    return {"codes": p["codes"], "scale": scale, "zero": (p["zero"].double() - 8.0 * scale.double()).float()}


def _as_q8g(kind: str, p: Part) -> Part:
    if kind == "q8g":
        return p
    if kind == "q6k":  # d per 256 as the scale of each of its 8 groups
        return {"codes": p["codes"], "scale": p["d"].float().repeat_interleave(8, dim=1), "sub": p["sub"]}
    if kind in ("q4k", "q5k"):
        p = _q4k_scales(p)
    # 4-bit parts as int8 codes: int4's (q - 8) s + z as code q - 8 with zero z; q4k's with
    # zero -dmin m
    codes = p["codes"].to(torch.int16) - (8 if kind == "int4" else 0)
    return {"codes": codes.to(torch.int8), "scale": p["scale"].float(), "zero": p["zero"].float()}


def plan(kinds: list[str]) -> str | None:
    """The module kind for a linear whose row blocks are of `kinds` (None: one has no native kind)."""
    if any(k not in KINDS for k in kinds):
        return None
    if all(k == "int4" for k in kinds):
        return "int4"
    if all(k in ("q4k", "q5k") for k in kinds):
        return "q4k"
    if all(k == "q6k" for k in kinds):
        return "q6k"
    return "q4f" if all(k in ("int4", "q4k") for k in kinds) else "q8g"


def _rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' rows one under another (a lone part as it is: the kernels' packing copies it anyway)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def build(kinds: list[str], parts: list[Part], bias: torch.Tensor | None, dtype: torch.dtype,
          device: torch.device) -> torch.nn.Module | None:
    """One linear from its row blocks (each a GGUF tensor's parts: codes [n_i, K] unpacked, scale,
    zero, sub), or None where no kernel runs it here (the caller keeps it dense)."""
    kind = plan(kinds)
    n = sum(p["codes"].shape[0] for p in parts)
    if kind is None or n % INT4_N_MULTIPLE:
        return None
    if kind in ("q4f", "q8g") and dtype == torch.bfloat16 and device.type == "cpu":
        # parts of several kinds: each run of one kind on its own kernel, where every run has whole panels
        runs: list[tuple[list[str], list[Part]]] = []
        for k, p in zip(kinds, parts):
            if runs and (k == runs[-1][0][-1] or plan([*runs[-1][0], k]) not in ("q4f", "q8g")):
                runs[-1][0].append(k), runs[-1][1].append(p)
            else:
                runs.append(([k], [p]))
        if len(runs) > 1 and all(sum(p["codes"].shape[0] for p in r[1]) % INT4_N_MULTIPLE == 0 for r in runs):
            mods = [build(k, p, None, dtype, device) for k, p in runs]
            if all(m is not None for m in mods):
                return SegmentedLinear(mods, bias)
    if kind == "int4":
        cat = {k: _rows([p[k] for p in parts]) for k in ("codes", "scale", "zero")}
        if dtype == torch.bfloat16 and device.type == "cpu" and cpu_kernels.w4a8() is not None \
                and not cat["zero"].any() and torch.equal(cat["scale"].to(torch.float16).to(cat["scale"].dtype),
                                                         cat["scale"]):
            return W40Linear(cat["codes"], cat["scale"], bias)  # Q4_0: w = (q - 8) d, d float16
        return Int4Linear(cat["codes"], cat["scale"], cat["zero"], bias, dtype, device=device)
    if dtype != torch.bfloat16 or device.type != "cpu":
        return None  # the float32 and general forms run in augury's CPU kernels, bfloat16 only
    if kind == "q4k":
        if cpu_kernels.w4a8() is None or parts[0]["codes"].shape[1] % (8 * INT4_GROUP):
            return None
        return W4KLinear(*(_rows([p[k] for p in parts]) for k in ("codes", "d", "dmin", "sc", "m")), bias)
    if kind == "q6k":
        if cpu_kernels.w8a8() is None or parts[0]["codes"].shape[1] % (8 * INT4_GROUP):
            return None
        return W6KLinear(*(_rows([p[k] for p in parts]) for k in ("codes", "d", "sub")), bias)
    if kind == "q4f":
        if cpu_kernels.w4a8() is None:
            return None
        q = [_as_q4f(k, p) for k, p in zip(kinds, parts)]
        return W4FLinear(_rows([p["codes"] for p in q]), _rows([p["scale"] for p in q]),
                         _rows([p["zero"] for p in q]), bias)
    if cpu_kernels.w8a8() is None:
        return None
    q = [_as_q8g(k, p) for k, p in zip(kinds, parts)]
    k_in = q[0]["codes"].shape[1]

    def joined(key: str, width: int, fill: float, dt: torch.dtype) -> torch.Tensor | None:
        if all(p.get(key) is None for p in q):
            return None  # absent everywhere: the kernel's variant without it
        return torch.cat([p[key].to(dt) if p.get(key) is not None else
                          torch.full((p["codes"].shape[0], width), fill, dtype=dt) for p in q])

    return W8GLinear(_rows([p["codes"] for p in q]), _rows([p["scale"].float() for p in q]),
                     joined("zero", k_in // INT4_GROUP, 0.0, torch.float32), joined("sub", k_in // 16, 1, torch.int8),
                     bias)
