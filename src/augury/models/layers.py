"""Building blocks shared by the target and the draft head: RMSNorm, rotary embedding, attention."""
from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from augury.cpu import kernels as cpu_kernels
from augury.models.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and self.weight.dtype in _KERNEL_DTYPES \
                and not _needs_grad(x, self.weight):
            k = _elementwise()
            if k is not None:  # one call instead of torch's several operators (models/cpu_kernels.py)
                return k.rms_norm(x, self.weight, self.eps)
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # a float32 residual stream under 16-bit weights: normalise and scale in float32, round once
        return (F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight).to(self.weight.dtype)


_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """The kernels do not differentiate: training (the draft head's norms and rotary) takes torch's."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _elementwise():
    """augury's per-row CPU kernels (RMSNorm, rotary), or None where they cannot run: torch then."""
    return cpu_kernels.elementwise()


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2 n] (a fused gate|up projection) -> silu(gate) * up [..., n]."""
    if gu.device.type == "cpu" and gu.dtype in _KERNEL_DTYPES and not _needs_grad(gu):
        k = _elementwise()
        if k is not None:  # float32 arithmetic, rounded once (models/cpu_kernels.py)
            return k.silu_mul(gu)
    n = gu.shape[-1] // 2
    return F.silu(gu[..., :n]) * gu[..., n:]


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for default, linear and Llama-3 rope scaling."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


class Rotary(nn.Module):
    """cos/sin tables [max_len, head_dim] computed once; looked up by position each forward."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        if torch.empty(0).is_meta:  # built under torch.device("meta"): shapes only (the loader builds the real
            # one); no arithmetic, since the first meta arange is a Python reference that imports torch._dynamo
            self.register_buffer("cos", torch.empty(max_len, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_len, head_dim), persistent=False)
            return
        inv = rope_inv_freq(rope, head_dim)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)  # [L, hd/2], float32 angles
        # cos and sin of the float32 angles in float64 (numpy, one thread), rounded once to float32: the
        # same table in every process. torch's float32 cos/sin on the CPU split the table over threads,
        # and a process's first call has computed one thread's half ~3e-5 off (MKL's vector maths, at
        # start-up of LLM("demo") on an AMX Xeon, about 1 process in 4), moving that process's tokens.
        angles = freqs.double().cpu().numpy()
        cos = torch.from_numpy(np.cos(angles)).float().to(freqs.device)
        sin = torch.from_numpy(np.sin(angles)).float().to(freqs.device)
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)  # [L, hd]
        self.register_buffer("sin", torch.cat([sin, sin], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, Q] -> cos, sin [B, Q, 1, hd] (broadcast over heads)
        return self.cos[positions].to(dtype).unsqueeze(2), self.sin[positions].to(dtype).unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, Q, heads, hd]; Llama's rotate-half convention (first half paired with second half)
    if x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES and cos.dtype == x.dtype and cos.dim() == 4 \
            and cos.shape[2] == 1 and cos.shape[:2] == x.shape[:2] and not _needs_grad(x, cos, sin):
        k = _elementwise()
        if k is not None:  # float32 arithmetic, rounded once (models/cpu_kernels.py)
            return k.rope(x, cos, sin)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class TransposedLinear(nn.Module):
    """y = x @ wt (+ b) with the weight stored [in, out]: on CPUs, float32 GEMMs with a few
    rows run much faster in this layout than nn.Linear's [out, in] (measured 1.9x at 8 rows)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.wt = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)  # [in, out]
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return self.wt.t()  # [out, in] view, for shape/dtype queries

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.wt
        return y + self.bias if self.bias is not None else y


def prefer_transposed(module: nn.Module) -> bool:
    """Swap every nn.Linear of a float32 CPU module to the transposed layout; True if it did."""
    p = next(module.parameters(), None)
    if p is None or p.dtype != torch.float32 or p.device.type != "cpu":
        return False
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, TransposedLinear(child.weight, child.bias))
        else:
            prefer_transposed(child)
    return True
