"""GGUF quantised blocks -> the exact integer codes and float32 scales augury's kernels read.

Each function takes one tensor's raw blocks, uint8 [N, K / block elements, block bytes] (a row of
the weight is a run of blocks), and returns its values as

    w[n, k] = scale[n, k // 32] * sub[n, k // 16] * codes[n, k] + zero[n, k // 32]

with codes int8 [N, K] (or 0..15 for the 4-bit kinds), scale and zero float32 [N, K / 32], sub int8
[N, K / 16]; zero and sub None where the format has none (0 and 1). Q4_K keeps its own scales
instead (and Q5_K, its codes 0..31): d and dmin float16 [N, K / 256], sc and m uint8 [N, K / 32],
w = d sc q - dmin m. Every product is exact in
float32 (an f16 d times a 6-bit or int8 scale times a code of at most 6 bits needs at most 24
significant bits) and the zero is added once, so these are gguf-py's `dequantize` values to the
bit (tests/test_gguf_kquants.py). Layouts as ggml defines them (ggml-common.h's block_q*):

- Q8_0 (34 bytes / 32): d f16, qs int8[32]: w = d q.
- Q5_0 (22 / 32): d f16, qh u32 (bit j: element j's fifth bit), qs[16] (element j < 16: low nibble
  of byte j, else high nibble of byte j - 16): w = d (q - 16).
- Q5_1 (24 / 32): d, m f16, qh, qs as Q5_0: w = d q + m.
- Q4_K (144 / 256): d, dmin f16, 12 bytes of eight 6-bit (sc, m) pairs, qs[128] (four runs of 32
  bytes: sub-block 2i the low nibbles of run i, 2i + 1 the high ones): w = d sc q - dmin m.
- Q5_K (176 / 256): d, dmin, the scales as Q4_K, qh[32] (bit i of byte j: sub-block i's element
  j's fifth bit), qs[128] as Q4_K: w = d sc q - dmin m.
- Q6_K (210 / 256): ql[128], qh[64], sc int8[16] (one per 16), d f16: q = 6 bits - 32, w = d sc q
  (kept as codes q, d float16 [N, K / 256] and sub = sc).
"""
from __future__ import annotations

import gguf
import numpy as np

Parts = dict[str, np.ndarray]
_T = gguf.GGMLQuantizationType


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (the f16 values, exactly)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: elements 0..15 the low nibbles, 16..31 the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _per_group(x: np.ndarray, groups_per_block: int) -> np.ndarray:
    """[N, B] per block -> [N, B * groups_per_block] per group of 32."""
    return np.repeat(x, groups_per_block, axis=1)


def q8_0(blocks: np.ndarray) -> Parts:
    n = blocks.shape[0]
    return {"codes": blocks[..., 2:].view(np.int8).reshape(n, -1), "scale": _f16(blocks[..., 0:2])}


def _q5_low_high(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """The 32 five-bit values of Q5_0 / Q5_1 blocks: qh [N, B, 4], qs [N, B, 16] -> [N, B, 32] 0..31."""
    bits = np.ascontiguousarray(qh).view(np.uint32)  # [N, B, 1], little-endian as ggml writes it
    high = ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, B, 32]
    return _nibbles_32(qs) | (high << 4)


def q5_0(blocks: np.ndarray) -> Parts:
    n = blocks.shape[0]
    q = _q5_low_high(blocks[..., 2:6], blocks[..., 6:22]).astype(np.int8) - np.int8(16)
    return {"codes": q.reshape(n, -1), "scale": _f16(blocks[..., 0:2])}


def q5_1(blocks: np.ndarray) -> Parts:
    n = blocks.shape[0]
    q = _q5_low_high(blocks[..., 4:8], blocks[..., 8:24]).astype(np.int8)
    return {"codes": q.reshape(n, -1), "scale": _f16(blocks[..., 0:2]), "zero": _f16(blocks[..., 2:4])}


def _k_own_scales(blocks: np.ndarray) -> Parts:
    """Q4_K / Q5_K super-block scales: d, dmin float16 [N, B]; sc, m uint8 [N, B * 8] (6-bit)."""
    n, b = blocks.shape[:2]
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(n * b, 12))
    half = lambda f: np.ascontiguousarray(f).view(np.float16)[..., 0]  # noqa: E731
    return {"d": half(blocks[..., 0:2]), "dmin": half(blocks[..., 2:4]), "sc": sc.reshape(n, -1).astype(np.uint8),
            "m": m.reshape(n, -1).astype(np.uint8)}


def k_scales(p: Parts) -> tuple[np.ndarray, np.ndarray]:
    """(scale d sc, zero -dmin m) float32 [N, K / 32] of Q4_K / Q5_K scales, exact (an 11-bit
    significand times a 6-bit integer)."""
    d, dmin = (np.repeat(p[k].astype(np.float32), 8, axis=1) for k in ("d", "dmin"))
    return d * p["sc"].astype(np.float32), -(dmin * p["m"].astype(np.float32))


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return k_scales(_k_own_scales(blocks))


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K qs [N, B, 128] -> [N, B, 8, 32] low four bits: sub-block 2i the low nibbles of
    bytes 32i..32i+31, 2i + 1 their high nibbles."""
    n, b = qs.shape[:2]
    runs = qs.reshape(n, b, 4, 1, 32)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=3).reshape(n, b, 8, 32)


def q4_k(blocks: np.ndarray) -> Parts:
    n = blocks.shape[0]
    return {"codes": _k_low(blocks[..., 16:144]).reshape(n, -1), **_k_own_scales(blocks)}


def q5_k(blocks: np.ndarray) -> Parts:
    n, b = blocks.shape[:2]
    qh = blocks[..., 16:48].reshape(n, b, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1  # [N, B, 8, 32]
    q = _k_low(blocks[..., 48:176]) | (high << 4)
    return {"codes": q.reshape(n, -1), **_k_own_scales(blocks)}


def q6_k(blocks: np.ndarray) -> Parts:
    n, b = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(n, b, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(n, b, 2, 4, 32)  # half h: 4 runs of 32
    qh = blocks[..., 128:192].reshape(n, b, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3  # [N, B, 2, 4, 32]
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    sub = blocks[..., 192:208].view(np.int8).reshape(n, -1)  # [N, B * 16]
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16)[..., 0]  # [N, B]
    return {"codes": q.reshape(n, -1), "d": d, "sub": sub}


# type -> (decoder, kind): "q4k" / "q5k" (codes 0..15 / 0..31 with Q4_K's / Q5_K's own scales, w4a8's
# super-block form) or "q8g" (int8 codes, the w8a8 kernel's general form); models/native.py runs them.
DECODERS = {
    _T.Q8_0: (q8_0, "q8g"),
    _T.Q5_0: (q5_0, "q8g"),
    _T.Q5_1: (q5_1, "q8g"),
    _T.Q4_K: (q4_k, "q4k"),
    _T.Q5_K: (q5_k, "q5k"),
    _T.Q6_K: (q6_k, "q6k"),
}


def decode(blocks: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[str, Parts]:
    """(kind, parts) for one tensor's blocks [N, B, bytes] of a type in DECODERS."""
    fn, kind = DECODERS[qtype]
    parts = fn(blocks)
    out = {k: np.ascontiguousarray(v) for k, v in parts.items()}
    out["codes"] = out["codes"].astype(np.uint8 if kind in ("q4k", "q5k") else np.int8)
    return kind, out


def values(parts: Parts) -> np.ndarray:
    """The float32 weights the parts stand for, [N, K] (as the kernels see them; tests compare them
    with gguf-py's dequantize)."""
    if "dmin" in parts:  # Q4_K's / Q5_K's own scales
        scale, zero = k_scales(parts)
        parts = {"codes": parts["codes"], "scale": scale, "zero": zero}
    elif "d" in parts:  # Q6_K's d per 256: each group's scale
        parts = {**parts, "scale": _per_group(parts["d"].astype(np.float32), 8)}
    codes = parts["codes"].astype(np.float32)
    n, k = codes.shape
    sub = parts.get("sub")
    scale = np.repeat(parts["scale"].astype(np.float32), 32, axis=1)
    if sub is not None:  # scale * sub is exact (an f16 times an int8), then times the code, exact too
        scale = scale * np.repeat(sub.astype(np.float32), 16, axis=1)
    w = scale * codes
    if parts.get("zero") is not None:
        w = w + np.repeat(parts["zero"].astype(np.float32), 32, axis=1)
    return w.reshape(n, k)
