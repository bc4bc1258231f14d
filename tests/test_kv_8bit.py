"""--kv-cache-dtype fp8 (e4m3, no scale, as vLLM's "fp8"): keys and values rounded as they are written,
widened exactly as every attention path reads them. The CPU kernel over an fp8 cache gives the bits it
gives over the same values in float32 (at every ISA level), its widening is torch's for every byte,
attention stays within the rounding's error of the float reference, greedy speculative output equals
plain greedy output over the same fp8 cache, and devices without the fp8 paths refuse the flag."""
from __future__ import annotations

import pytest
import torch

from augury import LLM, SamplingParams
from augury.attention import PagedBackend
from augury.attention.kv_dtype import FP8_MAX, as_stored, kv_cache_dtype, store_slots
from augury.config import EngineConfig
from augury.core.kv_cache import KVCache
from augury.cpu import build, isa
from augury.cpu import kernels as cpu_kernels
from augury.stages import StartupError
from conftest import random_prompts
from speculative_helpers import checkpoints

FP8 = torch.float8_e4m3fn
needs_kernel = pytest.mark.skipif(isa.why_unsupported() is not None or build.compiler() is None,
                                  reason="needs x86-64 with AVX2 and a C++ compiler")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _case(rows=6, nh=6, nkv=2, hd=64, slots=120, width=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, nh, hd, generator=g)
    kc = torch.randn(slots, nkv, hd, generator=g) * 2
    vc = torch.randn(slots, nkv, hd, generator=g) * 2
    sl = torch.randint(0, slots, (rows, width), generator=g)
    nk = torch.randint(1, width + 1, (rows,), generator=g).to(torch.int32)
    return q, kc, vc, sl, nk


def test_names_and_writes() -> None:
    """fp8 and fp8_e4m3 name e4m3; writing saturates at +-448 (no inf in e4m3fn, and torch's cast alone
    would give NaN on some versions) and rounds to the nearest e4m3 number; a cache of it takes one byte
    a value."""
    assert kv_cache_dtype("fp8", torch.bfloat16) == kv_cache_dtype("fp8_e4m3", torch.float32) == FP8
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert EngineConfig.create(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig.create(kv_cache_dtype="int8")
    x = torch.tensor([1e4, -1e4, 448.0, 0.3, 1e-4, -3.3])
    got = as_stored(x, FP8).float()
    assert got[:3].tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]
    assert got[3].item() == 0.3125 and got[4].item() == 0.0 and got[5].item() == -3.25  # nearest e4m3
    cache = torch.zeros(4, 2, 8, dtype=FP8)
    store_slots(cache, torch.tensor([2, 0]), torch.full((2, 2, 8), 1000.0))
    assert cache.float()[[0, 2]].eq(FP8_MAX).all() and cache.float()[[1, 3]].eq(0).all()
    assert KVCache.bytes_per_token(30, 3, 64, FP8) * 2 == KVCache.bytes_per_token(30, 3, 64, torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("hd", [16, 24, 64, 80, 128])
def test_kernel_over_fp8_is_the_float32_kernel_over_its_values(hd) -> None:
    """The fp8 cache is widened exactly: the kernel's rows are bit for bit its rows over the same
    values held in float32 (which tests/test_cpu_kernels.py checks against torch's SDPA); head sizes
    reach each lane split (16, 32 on AVX-512, the 8 or 16 left)."""
    at = cpu_kernels.attention()
    q, kc, vc, sl, nk = _case(hd=hd)
    k8, v8 = as_stored(kc, FP8), as_stored(vc, FP8)
    for qd in (torch.float32, torch.bfloat16):
        got = at.attend_rows(q.to(qd), k8, v8, sl, nk, hd ** -0.5)
        assert torch.equal(got, at.attend_rows(q.to(qd), k8.float(), v8.float(), sl, nk, hd ** -0.5))


@needs_kernel
def test_fp8_attention_is_within_its_rounding_of_the_float_reference() -> None:
    """Against attention over the unrounded float32 keys and values (torch's SDPA): each row's error,
    relative to the row's norm, stays under 0.1. e4m3 rounds a value by at most 1/16 of itself (3
    mantissa bits); the output is a convex mix of rounded values under slightly moved weights, so its
    error is of that order (measured on these cases: ~0.04; a bfloat16 cache's ~0.003)."""
    at = cpu_kernels.attention()
    for seed, hd in ((0, 64), (1, 128)):
        q, kc, vc, sl, nk = _case(hd=hd, seed=seed)
        got = at.attend_rows(q, as_stored(kc, FP8), as_stored(vc, FP8), sl, nk, hd ** -0.5)
        for r in range(q.shape[0]):
            keys, vals = kc[sl[r, : nk[r]]], vc[sl[r, : nk[r]]]
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[r][None, :, None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], scale=hd ** -0.5,
                enable_gqa=True)[0, :, 0].reshape(-1)
            err = ((got[r] - ref).norm() / ref.norm()).item()
            assert err < 0.1, (seed, r, err)


def _every_byte_case():
    """Values of all 256 e4m3 bytes but the two NaNs, one 16-value row per slot, and rows that each read
    one slot: a lone key's weight is exactly 1, so the row is its value widened."""
    b = torch.arange(256, dtype=torch.uint8)
    b[0x7F], b[0xFF] = 0x7E, 0xFE  # S.1111.111 is NaN in e4m3fn
    vc = b.view(FP8).reshape(16, 1, 16).contiguous()
    q = torch.randn(16, 1, 16)
    return q, torch.zeros_like(vc), vc, torch.arange(16).reshape(16, 1), torch.ones(16, dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize("level", [lv for lv in isa.LEVELS if isa.allowed_on_host(lv)])
def test_each_isa_level_widens_every_byte_as_torch_and_gives_the_avx2_bits(level) -> None:
    """The widening table read by each level's gathers is torch's float8_e4m3fn -> float32 for every
    byte, and attention over fp8 caches at each level is the AVX2 variant's bit for bit (head sizes
    64 and 128 unrolled, another multiple of 16, and 24 on the 8-lane path; 3 query heads a
    key-value head; 1..37 keys)."""
    q, kc, vc, sl, nk = _every_byte_case()
    g = torch.Generator().manual_seed(3)
    cases = []
    for hd in (64, 128, 48, 24):
        qh = torch.randn(4, 6, hd, generator=g).to(torch.bfloat16)
        kh, vh = (as_stored(torch.randn(50, 2, hd, generator=g) * 4, FP8) for _ in range(2))
        cases.append((qh, kh, vh, torch.randint(0, 50, (4, 37), generator=g),
                      torch.tensor([1, 9, 37, 16], dtype=torch.int32), hd ** -0.5))
    outs = {}
    for lv in {"avx2", level}:
        at = cpu_kernels.AttentionKernel(build.build("attention", lv))
        widened = at.attend_rows(q, kc, vc, sl, nk, 1.0)
        assert torch.equal(widened, vc.float().reshape(16, 16)), lv
        outs[lv] = [at.attend_rows(*c) for c in cases]
    for a, b in zip(outs["avx2"], outs[level]):
        assert torch.equal(a, b)


def test_an_fp8_cache_attends_in_float32_on_torch_paths_too() -> None:
    """The torch path (any device; the masked path and exact rows off the kernel) reads the cache as
    stored and computes in float32, as the kernel does."""
    k = torch.zeros(1, 64, 2, 16, dtype=FP8)
    v = torch.zeros(1, 64, 2, 16, dtype=FP8)
    backend = PagedBackend(k, v, 16)
    assert backend.compute_dtype == torch.float32
    g = torch.Generator().manual_seed(2)
    q, kn, vn = torch.randn(1, 5, 4, 16, generator=g), torch.randn(1, 5, 2, 16, generator=g) * 3, \
        torch.randn(1, 5, 2, 16, generator=g) * 3
    att = backend.prepare_prefill([[1]], [0], [5])
    out = att(0, q, kn, vn)
    ks, vs = as_stored(kn, FP8).float(), as_stored(vn, FP8).float()
    assert torch.equal(k[0, 16:21].float(), ks[0]) and torch.equal(v[0, 16:21].float(), vs[0])
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2),
                                                           is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(1, 5, -1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculative_equals_plain_over_an_fp8_cache(tmp_path_factory, dtype) -> None:
    """Every target path reads the keys as stored, so greedy EAGLE-3 over an fp8 cache equals greedy
    plain decoding over an fp8 cache token for token (the rounding changes both alike)."""
    ck = checkpoints(tmp_path_factory.mktemp("kv8spec"))
    prompts = random_prompts([5, 17, 9, 30], seed=8)
    outs = {}
    for name, kw in {"plain": dict(speculative_algorithm="none"),
                     "eagle3": dict(draft_model=str(ck["bigram_head"]), speculative_algorithm="eagle3",
                                    speculative_policy="static", speculative_num_steps=3,
                                    speculative_eagle_topk=2, speculative_num_draft_tokens=6)}.items():
        llm = LLM(str(ck["bigram"]), dtype=dtype, device="cpu", kv_cache_dtype="fp8", log_stats_interval=0, **kw)
        assert llm.engine.kv.k.dtype == FP8 and llm.engine.kv.k.element_size() == 1
        outs[name] = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert all(len(t) == GREEDY.max_tokens for t in outs[name])
    assert outs["eagle3"] == outs["plain"]


def test_fp8_is_refused_off_cpus(tiny_checkpoint) -> None:
    """Only the CPU paths read fp8 (augury's kernel and torch's CPU path); elsewhere start-up says so."""
    with pytest.raises(StartupError, match="fp8 is implemented for CPUs only"):
        LLM(str(tiny_checkpoint("llama")), device="meta", kv_cache_dtype="fp8", log_stats_interval=0)
