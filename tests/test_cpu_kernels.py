"""augury's own CPU kernel (models/cpu_kernels.py, models/kernels/w4a8.cpp): built and loaded
where the machine allows, against a float64 reference of its arithmetic, row-count and thread
invariant, bit for bit; and the fallback to torch's kernel when it cannot be built."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from augury.cpu import build, isa
from augury.cpu import kernels as cpu_kernels
from augury.models.quant import Int4Linear, default_int4_backend, int4_values

G = 32
CAN_BUILD = isa.why_unsupported() is None and build.compiler() is not None

def _draw_t(kernel, logits, temperatures, uniforms):
    """Elementwise.draw with the temperature alone (no top-k, top-p or min-p)."""
    n = len(temperatures)
    return kernel.draw(logits, temperatures, [None] * n, [1.0] * n, [0.0] * n, uniforms)

needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and a C++ compiler")


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.W4A8:
    k = cpu_kernels.w4a8()
    assert k is not None, "the w4a8 kernel did not build or load on a machine that can build it"
    return k


def _parts(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = (torch.rand(n, k // G, generator=g) * 0.05 + 0.005).to(torch.bfloat16)
    zero = (torch.randn(n, k // G, generator=g) * 0.1).to(torch.bfloat16)
    return codes, scale, zero


def _reference(x: torch.Tensor, codes, scale, zero) -> torch.Tensor:
    """The kernel's arithmetic in float64: activations rounded to int8 per row and group of 32
    (scale max|x| / 127, ties to even), times the int4 weights' values (q - 8) * s + z."""
    m, k = x.shape
    xf = x.float().view(m, k // G, G)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # a true division
    xq = torch.round(xf * inv)
    xt = (xq.double() * (amax / 127.0).double()).view(m, k)
    w = int4_values(codes, scale.float(), zero.float()).double()
    return xt @ w.t()


@needs_kernel
@pytest.mark.parametrize("k", [32, 224, 256, 288, 576, 1536])  # 1, 7, 8, 9, 18, 48 groups
def test_w4a8_matches_its_reference(kernel, k) -> None:
    n = 48
    codes, scale, zero = _parts(n, k, seed=k)
    packed = kernel.pack(codes, scale, zero)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[3, :G] = 0.0  # an all-zero group
    got = kernel.linear(x, *packed, out_dtype=torch.float32).double()
    ref = _reference(x, codes, scale, zero)
    # float32 sums of exact integer dot products: a few float32 steps of the row's magnitude
    tol = 4e-6 * (ref.abs().amax(-1, keepdim=True) + 1)
    assert ((got - ref).abs() <= tol).all(), float((got - ref).abs().max())
    # and the activations are really rounded: the exact-activation product differs
    exact = x.double() @ int4_values(codes, scale.float(), zero.float()).double().t()
    assert not torch.allclose(got, exact, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_w4a8_output_dtypes(kernel) -> None:
    codes, scale, zero = _parts(32, 96)
    packed = kernel.pack(codes, scale, zero)
    x = torch.randn(5, 96).to(torch.bfloat16)
    f32 = kernel.linear(x, *packed, out_dtype=torch.float32)
    # bfloat16 output is the float32 result rounded to nearest
    assert torch.equal(kernel.linear(x, *packed), f32.to(torch.bfloat16))
    # a float32 input holding the same values gives the same bits
    assert torch.equal(kernel.linear(x.float(), *packed, out_dtype=torch.float32), f32)


def test_w4a8_linear_has_no_bias_path() -> None:
    """No caller passes the kernel a bias (Int4Linear adds its own): the C bias path is gone."""
    import inspect

    assert "bias" not in inspect.signature(cpu_kernels.W4A8.linear).parameters


def test_serial_rounding_below_a_few_rows_is_written_once() -> None:
    """The "round the rows serially below 16 rows, else inside the parallel region" block lives in
    one function of a shared header, not in each kernel's .cpp."""
    import re

    for src in sorted(build.SOURCE_DIR.glob("*.cpp")):
        text = src.read_text()
        assert not re.search(r"\bM\s*(<|>=)\s*16\b", text), src.name


@needs_kernel
def test_w4a8_rows_are_row_count_and_thread_invariant(kernel) -> None:
    """Each row comes out bit for bit the same alone, among 1-70 others (past the kernel's tiles of 4
    and 64 rows) and at 1 or 2 threads."""
    codes, scale, zero = _parts(64, 576, seed=3)
    packed = kernel.pack(codes, scale, zero)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernel.linear(x[i:i + 1], *packed) for i in range(70)])
        torch.set_num_threads(2)
        for m in (1, 2, 3, 5, 8, 9, 13, 64, 65, 70):
            for start in (0, 70 - m):
                assert torch.equal(kernel.linear(x[start:start + m], *packed), alone[start:start + m]), (m, start)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_w8a8_matches_its_reference_and_is_row_count_invariant() -> None:
    """int8 weights per group of 32 (Q8_0's rule) against the same int8-rounded activations: exact
    integer dot products, float32 sums; a row alone equals the row among others, 1 or 2 threads."""
    k8 = cpu_kernels.w8a8()
    assert k8 is not None
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 288, generator=g) * 0.1
    w[5, :G] = 0.0  # an all-zero weight group
    codes, scale = k8.pack(w)  # 3 panels of 16 columns, the last one 8 short
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127 and codes.shape == (3, 9, 512)
    assert scale.shape == (3, 9, 16) and scale[2, :, 8:].eq(0).all()
    deq = k8.unpack(codes, scale, 40).double()
    step = scale.transpose(1, 2).reshape(48, 9)[:40].double().repeat_interleave(G, 1)
    assert ((deq - w.double()).abs() <= step / 2 + 1e-9).all()
    x = torch.randn(13, 288, generator=g).to(torch.bfloat16)
    got = k8.linear(x, codes, scale, 40)
    assert torch.equal(k8.linear(x, codes, scale)[:, :40], got)
    for bad in (32, 49):
        with pytest.raises(ValueError, match="columns"):
            k8.linear(x, codes, scale, bad)
    xf = x.float().view(13, 9, G)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # a true division
    xt = (torch.round(xf * inv) * (amax / 127.0)).view(13, 288)
    ref = xt.double() @ deq.t()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in (0, 6, 12):
                assert torch.equal(k8.linear(x[r : r + 1], codes, scale, 40), got[r : r + 1])
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_w8a8_columns_are_the_whole_rows_bits_at_those_columns() -> None:
    """augury_w8a8_columns (a grammar's few allowed tokens): each row's chosen columns, in any order,
    repeated or none, equal the whole product's values bit for bit, for bfloat16 and float32 rows,
    columns in the last, short panel included; an id outside the columns is a ValueError."""
    k8 = cpu_kernels.w8a8()
    g = torch.Generator().manual_seed(11)
    n = 200  # 13 panels, the last one 8 short
    codes, scale = k8.pack(torch.randn(n, 96, generator=g))
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(5, 96, generator=g) * 4).to(dtype)
        whole = k8.linear(x, codes, scale, n)
        ids = [torch.randint(0, n, (40,), generator=g).numpy(), np.array([], dtype=np.int64),
               np.array([199, 0, 192, 199, 7]), np.arange(n), [3, 5]]
        got = k8.columns(x, codes, scale, n, ids)
        assert len(got) == 5
        for row, (want_ids, vals) in enumerate(zip(ids, got)):
            assert vals.dtype == torch.float32
            assert torch.equal(vals, whole[row, torch.as_tensor(np.asarray(want_ids, dtype=np.int64))]), (dtype, row)
        one = k8.columns(x[2:3], codes, scale, n, [ids[2]])
        assert torch.equal(one[0], got[2])
    for bad in ([np.array([n])], [np.array([-1])]):
        with pytest.raises(ValueError, match="column"):
            k8.columns(x[:1], codes, scale, n, bad)
    with pytest.raises(ValueError, match="id lists"):
        k8.columns(x[:2], codes, scale, n, [[1]])


@needs_kernel
def test_w4a8_rejects_bad_inputs(kernel) -> None:
    codes, scale, zero = _parts(16, 64)
    packed = kernel.pack(codes, scale, zero)
    with pytest.raises(ValueError, match="features"):
        kernel.linear(torch.randn(2, 96), *packed)
    with pytest.raises(ValueError, match="2-D"):
        kernel.linear(torch.randn(2, 64, dtype=torch.float16), *packed)
    with pytest.raises(ValueError, match="in_features"):
        kernel.pack(torch.zeros(16, 40, dtype=torch.int32), scale, zero)


@needs_kernel
def test_w4a8_rejects_bad_weights(kernel) -> None:
    """Panels of 16 columns: codes uint8 [N / 16, G, 256], scale and zero bfloat16 [N / 16, G, 16],
    all contiguous: anything else is a ValueError naming the tensor, not a read out of bounds or
    garbage."""
    codes, scale, zero = _parts(32, 64)
    c, s, z = kernel.pack(codes, scale, zero)  # 2 panels, G = 2
    assert c.shape == (2, 2, 256) and s.shape == z.shape == (2, 2, 16)
    x = torch.randn(2, 64)
    kernel.linear(x, c, s, z)
    bad = {
        "scale": [s.float(), s[:, :1].contiguous(), s[..., :8].contiguous(), s[:1], torch.cat([s, s], 2)[..., ::2],
                  s.reshape(2, 32), torch.zeros(2, 2, 32, dtype=torch.bfloat16)],
        "zero": [z.half(), z[:, :1].contiguous(), z[:1], torch.cat([z, z], 2)[..., ::2]],
        "codes": [c.to(torch.int8), c.to(torch.int32), c[:, :, :128].contiguous(), c.view(4, 256),
                  torch.cat([c, c], 2)[:, :, ::2]],
    }
    for what, tensors in bad.items():
        for t in tensors:
            args = {"codes": c, "scale": s, "zero": z} | {what: t}
            with pytest.raises(ValueError, match=what):
                kernel.linear(x, args["codes"], args["scale"], args["zero"])


@needs_kernel
def test_w8a8_rejects_bad_weights() -> None:
    k8 = cpu_kernels.w8a8()
    codes, scale = k8.pack(torch.randn(16, 64))
    x = torch.randn(2, 64)
    k8.linear(x, codes, scale)
    for what, c, s in (("codes", codes.to(torch.int32), scale), ("codes", codes[:, :, ::2], scale),
                       ("codes", torch.cat([codes, codes], 2)[:, :, ::2], scale), ("codes", codes.view(2, 512), scale),
                       ("scale", codes, scale.to(torch.bfloat16)), ("scale", codes, scale[:, :1].contiguous()),
                       ("scale", codes, scale[:, :, :8].contiguous()),
                       ("scale", codes, torch.cat([scale, scale], 2)[..., ::2])):
        with pytest.raises(ValueError, match=what):
            k8.linear(x, c, s)


@needs_kernel
def test_bf16_linear_rejects_bad_panels() -> None:
    """More columns than the panels hold would read past them; panels must be [P, K, 8] bfloat16."""
    kb = cpu_kernels.bf16()
    assert kb is not None
    w = torch.randn(20, 64)
    panels = kb.pack(w)  # [3, 64, 8]: 24 columns
    x = torch.randn(2, 64)
    assert torch.equal(kb.linear(x, panels, 24, out_dtype=torch.float32)[:, :20],
                       kb.linear(x, panels, 20, out_dtype=torch.float32))
    with pytest.raises(ValueError, match="columns"):
        kb.linear(x, panels, 25)
    with pytest.raises(ValueError, match="columns"):
        kb.linear(x, panels[:1].contiguous(), 20)
    for bad in (panels.float(), panels.reshape(6, 64, 4), panels.reshape(3, 512), panels.transpose(0, 1),
                panels[:, :32].contiguous()):
        with pytest.raises(ValueError, match="panels|features"):
            kb.linear(x, bad, 20)
    with pytest.raises(ValueError, match="bias"):
        kb.linear(x, panels, 20, torch.zeros(20))


@needs_kernel
@pytest.mark.parametrize("where", [0, 5, 17, 31, 40], ids=lambda w: f"k{w}")
def test_a_nan_activation_gives_a_nan_row(kernel, where) -> None:
    """A NaN (or an infinity) in an input row stays visible: w4a8's and w8a8's output row is all
    NaN (the int8 rounding does not turn it into finite codes and a plausible token), the other rows
    bit for bit as without it, at 3 rows (rounded serially) and 20 (inside the parallel region)."""
    k8 = cpu_kernels.w8a8()
    codes, scale, zero = _parts(32, 96, seed=5)
    p4 = kernel.pack(codes, scale, zero)
    p8 = k8.pack(int4_values(codes, scale.float(), zero.float()))
    for m in (3, 20):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        clean4 = kernel.linear(x, *p4, out_dtype=torch.float32)
        clean8 = k8.linear(x, *p8)
        for bad in (float("nan"), float("inf"), float("-inf")):
            xb = x.clone()
            xb[1, where] = bad
            for got, clean in ((kernel.linear(xb, *p4, out_dtype=torch.float32), clean4),
                               (kernel.linear(xb.float(), *p4, out_dtype=torch.float32), clean4),
                               (kernel.linear(xb, *p4).float(), clean4.to(torch.bfloat16).float()),
                               (k8.linear(xb, *p8), clean8)):
                assert got[1].isnan().all(), (m, bad, got[1])
                keep = torch.arange(m) != 1
                assert torch.equal(got[keep], clean[keep]), (m, bad)


@needs_kernel
def test_int4_linear_takes_w4a8_in_bfloat16_and_torch_in_float32(kernel) -> None:
    codes, scale, zero = _parts(32, 128)
    mod = Int4Linear(codes, scale, zero, None, torch.bfloat16)
    assert mod.backend == "w4a8" and default_int4_backend(torch.float32) == "torch"
    assert Int4Linear(codes, scale, zero, None, torch.float32).backend == "torch"
    # the weights it stands for are the int4 values
    assert torch.equal(mod.dequantize(), int4_values(codes, scale.float(), zero.float()).to(torch.bfloat16))
    x = torch.randn(3, 128).to(torch.bfloat16)
    assert torch.equal(mod(x), kernel.linear(x, mod.w4a8_codes, mod.w4a8_scale, mod.w4a8_zero))
    with pytest.raises(ValueError, match="backend"):
        Int4Linear(codes, scale, zero, None, torch.float32, backend="w4a8")


def test_kernels_off_or_unbuildable_fall_back_to_torch(monkeypatch, tmp_path, caplog) -> None:
    codes, scale, zero = _parts(16, 64)
    x = torch.randn(2, 64).to(torch.bfloat16)
    try:
        monkeypatch.setenv("AUGURY_CPU_KERNELS", "0")
        cpu_kernels.reset()
        assert cpu_kernels.w4a8() is None
        assert Int4Linear(codes, scale, zero, None, torch.bfloat16).backend == "torch"
        # a compiler that fails: one warning, torch's kernel, and the module still computes
        monkeypatch.delenv("AUGURY_CPU_KERNELS")
        monkeypatch.setenv("AUGURY_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("CXX", "false")
        cpu_kernels.reset()
        with caplog.at_level(logging.WARNING, logger="augury.cpu.kernels"):
            mod = Int4Linear(codes, scale, zero, None, torch.bfloat16)
            Int4Linear(codes, scale, zero, None, torch.bfloat16)
        assert mod.backend == "torch"
        if CAN_BUILD:
            assert sum("w4a8" in r.getMessage() and "unavailable" in r.getMessage() for r in caplog.records) == 1
        ref = x.float() @ int4_values(codes, scale.float(), zero.float()).t()
        torch.testing.assert_close(mod(x).float(), ref, rtol=2e-2, atol=2e-2)
        assert not list(tmp_path.glob("kernels/*.so"))  # nothing half-built left behind
    finally:
        cpu_kernels.reset()


# ---- exact-rows attention (kernels/attention.cpp) ---------------------------------------------------

@pytest.fixture(scope="module")
def attn_kernel() -> cpu_kernels.AttentionKernel:
    k = cpu_kernels.attention()
    assert k is not None, "the attention kernel did not build or load on a machine that can build it"
    return k


def _attn_case(dtype, rows=5, nh=6, nkv=2, hd=16, slots=40, width=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, nh, hd, generator=g).to(dtype)
    kc = torch.randn(slots, nkv, hd, generator=g).to(dtype)
    vc = torch.randn(slots, nkv, hd, generator=g).to(dtype)
    sl = torch.randint(0, slots, (rows, width), generator=g)
    nk = torch.randint(1, width + 1, (rows,), generator=g).to(torch.int32)
    return q, kc, vc, sl, nk


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hd", [16, 24, 64, 80])
def test_attention_kernel_matches_sdpa_over_each_rows_slots(attn_kernel, dtype, hd) -> None:
    """Row r attends over cache slots slots[r, :nkeys[r]] (GQA: query head h reads key-value head
    h // (nh / nkv), as torch's enable_gqa), in float32 whatever the cache's dtype. Head sizes: each
    way the value rows are split into lanes (16 at a time, 32 on AVX-512, and the 8 or 16 left)."""
    q, kc, vc, sl, nk = _attn_case(dtype, hd=hd)
    got = attn_kernel.attend_rows(q, kc, vc, sl, nk, 0.25)
    assert got.dtype == dtype and got.shape == (5, 6 * hd)
    for r in range(5):
        keys, vals = kc[sl[r, : nk[r]]].float(), vc[sl[r, : nk[r]]].float()  # [n, nkv, hd]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[r].float()[None, :, None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], scale=0.25,
            enable_gqa=True)[0, :, 0].reshape(-1)
        if dtype == torch.float32:
            torch.testing.assert_close(got[r], ref, rtol=1e-5, atol=1e-6)
        else:  # computed in float32 and rounded once
            torch.testing.assert_close(got[r].float(), ref.to(dtype).float(), rtol=8e-3, atol=8e-3)


@needs_kernel
def test_attention_kernel_rows_are_batch_and_thread_invariant(attn_kernel) -> None:
    """A row comes out bit for bit the same alone, among others (past the size where the kernel goes
    parallel) and at 1 or 2 threads; slots past a row's own count are never read."""
    q, kc, vc, sl, nk = _attn_case(torch.bfloat16, rows=40, nh=9, nkv=3, hd=64, slots=400, width=300, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([attn_kernel.attend_rows(q[i:i + 1].contiguous(), kc, vc, sl[i:i + 1].contiguous(),
                                                   nk[i:i + 1].contiguous(), 0.125) for i in range(40)])
        torch.set_num_threads(2)
        assert torch.equal(attn_kernel.attend_rows(q, kc, vc, sl, nk, 0.125), alone)
        junk = sl.clone()
        for r in range(40):
            junk[r, int(nk[r]):] = 10**9  # out of range: reading one would crash or change the row
        assert torch.equal(attn_kernel.attend_rows(q, kc, vc, junk, nk, 0.125), alone)
    finally:
        torch.set_num_threads(threads)


def _tree_rows(g, context: list[int], parents: list[int], fresh: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A verification's slot lists: node i reads the context, then its ancestors and itself (fresh
    slots), in position order; rows padded with junk past their counts."""
    rows = []
    for i in range(len(parents)):
        chain, p = [], i
        while p >= 0:
            chain.append(fresh[p])
            p = parents[p]
        rows.append(context + chain[::-1])
    width = max(map(len, rows)) + 3
    sl = torch.full((len(rows), width), 10**9, dtype=torch.int64)
    for i, row in enumerate(rows):
        sl[i, : len(row)] = torch.tensor(row)
    return sl, torch.tensor([len(r) for r in rows], dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("hd,nh,nkv", [(64, 9, 3), (128, 8, 2), (32, 10, 2), (96, 4, 4), (80, 12, 2), (16, 5, 1)])
def test_attention_kernel_rows_sharing_their_context_come_out_as_alone(attn_kernel, kv, hd, nh, nkv) -> None:
    """Rows whose slot lists start alike (a verification tree's nodes over one context, a prompt's rows,
    a second sequence on a cached prefix) are taken together a part of the keys at a time (attention.h:
    attend_group); each row's numbers are still those it has alone, bit for bit, at contexts longer than
    a part (~96 KiB of keys and values: 192 to 1,536 keys here), heads per key-value head that do not
    fill the kernel's groups of 4, and each head size's lane split. A batch of such groups next to rows
    of their own, at 1 and 2 threads, comes out as each row alone."""
    g = torch.Generator().manual_seed(hd + nh)
    slots = 4000
    dt = getattr(torch, kv)
    kc = torch.randn(slots, nkv, hd, generator=g).to(dt)
    vc = torch.randn(slots, nkv, hd, generator=g).to(dt)
    perm = torch.randperm(slots, generator=g).tolist()
    a_ctx, b_ctx = perm[:1700], perm[1700:1700 + 37]  # two sequences: a long context, a short one
    sl_a, nk_a = _tree_rows(g, a_ctx, [-1, 0, 0, 1, 3, 3, 2], perm[3000:3007])  # a tree of 7 nodes
    sl_b, nk_b = _tree_rows(g, b_ctx, [-1, 0, 1], perm[3100:3103])
    prompt = perm[2000:2020]  # a prompt's rows: row t reads its first t + 1 slots
    sl_p = torch.full((20, 20), 10**9, dtype=torch.int64)
    for t in range(20):
        sl_p[t, : t + 1] = torch.tensor(prompt[: t + 1])
    nk_p = torch.arange(1, 21, dtype=torch.int32)
    lone = torch.tensor([[perm[2500 + i] for i in range(9)]])  # a row of its own between the groups
    width = max(sl_a.shape[1], sl_b.shape[1], 20, 9)
    pad = lambda s: torch.nn.functional.pad(s, (0, width - s.shape[1]), value=10**9)  # noqa: E731
    sl = torch.cat([pad(sl_a), pad(lone), pad(sl_b), pad(sl_p)])
    nk = torch.cat([nk_a, torch.tensor([9], dtype=torch.int32), nk_b, nk_p])
    q = torch.randn(sl.shape[0], nh, hd, generator=g).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([attn_kernel.attend_rows(q[i:i + 1].contiguous(), kc, vc, sl[i:i + 1].contiguous(),
                                                   nk[i:i + 1].contiguous(), hd ** -0.5) for i in range(len(nk))])
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(attn_kernel.attend_rows(q, kc, vc, sl, nk, hd ** -0.5), alone)
            # the tree alone: one group, halved for two threads
            assert torch.equal(attn_kernel.attend_rows(q[:7].contiguous(), kc, vc, sl[:7].contiguous(),
                                                       nk[:7].contiguous(), hd ** -0.5), alone[:7])
    finally:
        torch.set_num_threads(threads)
    ref = torch.nn.functional.scaled_dot_product_attention(  # and the long rows are still attention
        q[4].float()[None, :, None], kc[sl[4, : nk[4]]].float().transpose(0, 1)[None],
        vc[sl[4, : nk[4]]].float().transpose(0, 1)[None], scale=hd ** -0.5, enable_gqa=True)[0, :, 0].reshape(-1)
    torch.testing.assert_close(alone[4].float(), ref.to(torch.bfloat16).float(), rtol=8e-3, atol=8e-3)


@needs_kernel
def test_attention_kernel_rejects_bad_inputs(attn_kernel) -> None:
    q, kc, vc, sl, nk = _attn_case(torch.float32)
    with pytest.raises(ValueError, match="key counts"):
        attn_kernel.attend_rows(q, kc, vc, sl, torch.zeros(5, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="dtypes"):
        attn_kernel.attend_rows(q, kc.half(), vc.half(), sl, nk, 1.0)
    with pytest.raises(ValueError, match="shapes"):
        attn_kernel.attend_rows(q[:, :, :12].contiguous(), kc[:, :, :12].contiguous(), vc[:, :, :12].contiguous(),
                                sl, nk, 1.0)


@needs_kernel
def test_attention_kernel_refuses_a_slot_outside_the_cache(attn_kernel) -> None:
    """Slots are raw offsets into the cache: one of a row's first nkeys past the cache (or negative)
    is a ValueError saying so, not a read out of bounds; past nkeys anything goes."""
    q, kc, vc, sl, nk = _attn_case(torch.float32)
    for bad in (kc.shape[0], 10**12, -1):
        s2 = sl.clone()
        s2[2, int(nk[2]) - 1] = bad
        with pytest.raises(ValueError, match="slot"):
            attn_kernel.attend_rows(q, kc, vc, s2, nk, 1.0)
    with pytest.raises(ValueError, match="cache"):
        attn_kernel.attend_rows(q, kc, vc[:10].contiguous(), sl.clamp(max=9), nk, 1.0)


# ---- per-row kernels (kernels/elementwise.cpp) ------------------------------------------------------

@needs_kernel
def test_rmsnorm_and_rope_kernels_match_torch_and_are_row_invariant() -> None:
    from augury.models import layers

    k = cpu_kernels.elementwise()
    assert k is not None, "the elementwise kernels did not build or load on a machine that can build them"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 576, generator=g) * 3
    w = (torch.rand(576, generator=g) + 0.5).to(torch.bfloat16)
    got = k.rms_norm(x, w, 1e-5)
    ref = (torch.nn.functional.rms_norm(x, (576,), None, 1e-5) * w.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()  # a bfloat16 step
    assert torch.equal(torch.cat([k.rms_norm(x[i:i + 1], w, 1e-5) for i in range(70)]), got)  # 70 > 64: threads
    norm = layers.RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data.copy_(w)
    assert torch.equal(norm(x), got)  # the module takes the kernel

    q = torch.randn(3, 30, 12, 64, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 100, (3, 30), generator=g)
    cos = torch.cos(pos[..., None] * 0.01 * torch.arange(64)).to(torch.bfloat16)[:, :, None]
    sin = torch.sin(pos[..., None] * 0.01 * torch.arange(64)).to(torch.bfloat16)[:, :, None]
    got = k.rope(q, cos, sin)
    half = torch.cat([-q.float()[..., 32:], q.float()[..., :32]], -1)
    ref = (q.float() * cos.float() + half * sin.float()).to(torch.bfloat16)  # float32, rounded once
    assert torch.equal(got, ref)
    assert torch.equal(layers.apply_rope(q, cos, sin), got)
    assert torch.equal(torch.cat([k.rope(q[i:i + 1], cos[i:i + 1], sin[i:i + 1]) for i in range(3)]), got)



@pytest.mark.parametrize("n", [1536, 13])  # whole groups of 8 lanes, and a last partial one
def test_silu_mul_kernel_matches_torch_and_is_row_invariant(n) -> None:
    """silu(gate) * up against torch's in float64: float32 within a few units in the last place, bfloat16
    within one bfloat16 step of the exact value; large, tiny and signed zeros; NaN passes; a row's bits
    do not depend on its batch (more rows than the serial threshold: threads)."""
    k = cpu_kernels.elementwise()
    assert k is not None, "the elementwise kernels did not build or load on a machine that can build them"
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(70, 2 * n, generator=g) * 4
    gu[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e4, -1e4, 88.0, -88.0])[: min(8, n)]
    exact = torch.nn.functional.silu(gu[:, :n].double()) * gu[:, n:].double()
    got = k.silu_mul(gu)
    assert got.dtype == torch.float32 and got.shape == (70, n)
    err = (got.double() - exact).abs()
    assert (err <= 4 * torch.finfo(torch.float32).eps * exact.abs() + 1e-30).all(), err.max()
    b = gu.to(torch.bfloat16)
    exact_b = torch.nn.functional.silu(b[:, :n].double()) * b[:, n:].double()
    got_b = k.silu_mul(b)
    assert got_b.dtype == torch.bfloat16
    assert ((got_b.double() - exact_b).abs() <= 2 ** -8 * exact_b.abs() + 1e-30).all()
    assert torch.equal(torch.cat([k.silu_mul(b[i:i + 1]) for i in range(70)]), got_b)
    nan = gu.clone()
    nan[3, 0] = float("nan")
    assert torch.isnan(k.silu_mul(nan)[3, 0]) and torch.equal(k.silu_mul(nan)[4:], got[4:])


@needs_kernel
@pytest.mark.parametrize("v", [6, 8, 255, 256, 257, 1000, 49152])
def test_temperature_draw_kernel_inverts_the_softmax_cdf(v) -> None:
    """Each drawn token's interval of softmax(x / t)'s float64 CDF (from torch, in float64) holds the
    uniform, to rounding; a token of probability 0 is never drawn; a row alone or among others, and
    through draw_sampled, gives the same token."""
    from augury.sampling import draw_sampled

    k = cpu_kernels.elementwise()
    assert k is not None, "the elementwise kernels did not build or load on a machine that can build them"
    g = torch.Generator().manual_seed(v)
    x = torch.randn(3, v, generator=g) * 3
    x[1, ::3] = float("-inf")  # a grammar's mask: those tokens have no mass
    for t in (0.3, 1.0, 1.7):
        us = torch.rand(150, dtype=torch.float64, generator=g).tolist() + [0.0, 1.0 - 2 ** -53]
        for r in range(3):
            p = torch.softmax(x[r].double() / t, -1).numpy()
            cdf = np.cumsum(p)
            got = _draw_t(k, x[r : r + 1].expand(len(us), v).contiguous(), [t] * len(us), us)
            for u, tok in zip(us, got):
                assert p[tok] > 0
                assert (cdf[tok - 1] if tok else 0.0) - 1e-6 <= u * cdf[-1] <= cdf[tok] + 1e-6, (u, tok)
        both = _draw_t(k, x, [t, 0.5, 2.0], us[:3])
        assert both == [_draw_t(k, x[r : r + 1], [[t, 0.5, 2.0][r]], [us[r]])[0] for r in range(3)]
        assert draw_sampled(x, [t, 0.5, 2.0], [None, 0, v], [1.0] * 3, [0.0] * 3, us[:3]) == both


def _in_cdf_interval(tok: int, u: float, q: np.ndarray) -> bool:
    """q: a row's filtered probabilities (float64): tok has mass and its CDF interval holds u, to rounding."""
    cdf = np.cumsum(q)
    return q[tok] > 0 and (cdf[tok - 1] if tok else 0.0) - 1e-5 <= u * cdf[-1] <= cdf[tok] + 1e-5


@needs_kernel
@pytest.mark.parametrize("v", [9, 257, 3000, 49152])
@pytest.mark.parametrize("t,top_k,top_p,min_p", [(1.0, None, 0.9, 0.0), (0.7, 40, 1.0, 0.0), (1.2, None, 1.0, 0.05),
                                                 (0.8, 50, 0.95, 0.02), (1.0, 3, 0.5, 0.0), (1.0, None, 0.3, 0.0)])
def test_filtered_draw_kernel_draws_from_the_filters_distribution(v, t, top_k, top_p, min_p) -> None:
    """The kernel's top-k, min-p and top-p keep what apply_sampling_filters keeps (each drawn token has
    mass there) and its draw inverts that distribution's CDF, on peaked and flat rows and masked ones."""
    k = cpu_kernels.elementwise()
    assert k is not None, "the elementwise kernels did not build or load on a machine that can build them"
    g = torch.Generator().manual_seed(v)
    for scale in (1.0, 3.0, 8.0):
        x = torch.randn(2, v, generator=g) * scale
        x[1, ::3] = float("-inf")
        us = torch.rand(60, dtype=torch.float64, generator=g).tolist()
        for r in range(2):
            q = apply_filters_f64(x[r], t, top_k, top_p, min_p)
            got = k.draw(x[r : r + 1].expand(len(us), v).contiguous(), [t] * len(us), [top_k] * len(us),
                         [top_p] * len(us), [min_p] * len(us), us)
            assert all(_in_cdf_interval(tok, u, q) for u, tok in zip(us, got)), (scale, r)


def apply_filters_f64(row: torch.Tensor, t, top_k, top_p, min_p) -> np.ndarray:
    from augury.sampling import apply_sampling_filters

    return apply_sampling_filters(row[None].double(), t, top_k, top_p, min_p)[0].numpy()


def test_draw_sampled_takes_each_row_by_its_own_filters() -> None:
    """A batch mixing temperature-only, top-k, top-p and min-p rows and a temperature-0 row gives each
    row the token it gets alone; each sampled row's token is one its filters keep, at its uniform;
    the temperature-0 row (torch's filters: the one-hot argmax) its argmax."""
    from augury.sampling import draw_sampled

    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(9)) * 2
    args = ([1.0, 0.8, 1.2, 0.0, 0.7], [None, 40, None, None, None], [1.0, 1.0, 0.9, 1.0, 1.0],
            [0.0, 0.0, 0.0, 0.0, 0.05], [0.3, 0.6, 0.9, 0.5, 0.2])
    got = draw_sampled(x, *args)
    assert got == [draw_sampled(x[r : r + 1], *([a[r]] for a in args))[0] for r in range(5)]
    for r in (0, 1, 2, 4):
        assert _in_cdf_interval(got[r], args[4][r], apply_filters_f64(x[r], *(a[r] for a in args[:4])))
    assert got[3] == int(x[3].argmax())


@needs_kernel
def test_temperature_draw_kernel_no_mass_and_bad_input() -> None:
    k = cpu_kernels.elementwise()
    assert k is not None, "the elementwise kernels did not build or load on a machine that can build them"
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[-inf] * 9, [0.0, nan] + [0.0] * 7, [0.0, inf] + [0.0] * 7,
                         [0.0, 0.0] + [-inf] * 7, [5.0] + [-inf] * 8])
    # no finite logit, a NaN, +inf (torch's softmax gives NaN): no token; u next to 1: the last token
    # with mass; one finite logit: that token
    assert _draw_t(k, rows, [1.0] * 5, [0.5, 0.5, 0.5, 1.0 - 2 ** -53, 0.999]) == [-1, -1, -1, 1, 0]
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        _draw_t(k, rows[:1], [0.0], [0.5])
    with pytest.raises(ValueError, match="float32 CPU"):
        _draw_t(k, rows[:1].double(), [1.0], [0.5])


def test_training_keeps_gradients_through_norm_and_rotary() -> None:
    """The per-row kernels do not differentiate, so a module that trains (the draft head) runs
    torch's operators: its gradients reach the norm weight and the rotated input."""
    from augury.models import layers

    norm = layers.RMSNorm(64, 1e-5)
    x = torch.randn(3, 64, requires_grad=True)
    norm(x).sum().backward()
    assert norm.weight.grad is not None and x.grad is not None and x.grad.abs().sum() > 0
    q = torch.randn(1, 2, 3, 16, requires_grad=True)
    cos, sin = torch.rand(1, 2, 1, 16), torch.rand(1, 2, 1, 16)
    layers.apply_rope(q, cos, sin).square().sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    with torch.no_grad():  # inference still takes the kernels where they run
        assert not layers._needs_grad(q, cos, sin)


@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_rotary_tables_are_the_correctly_rounded_cos_and_sin_of_their_angles(rope_type: str) -> None:
    """Every entry of the rotary tables is cos / sin of its float32 angle (position x inverse
    frequency, rounded as transformers rounds it) computed in double precision by the C library and
    rounded once to float32, on both halves of a table long enough for torch to split it over threads
    (torch's own float32 cos was 1 ulp off at angle 1.0, and a process's first call once put one
    thread's half ~3e-5 off: a table that then moved every token of that process)."""
    import math

    from augury.models.config import RopeConfig
    from augury.models.layers import Rotary, rope_inv_freq

    rope = RopeConfig(theta=100000.0) if rope_type == "default" else RopeConfig(
        theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=64)
    length, hd = 8256, 64
    table = Rotary(rope, hd, length)
    inv = rope_inv_freq(rope, hd)
    assert table.cos.dtype == table.sin.dtype == torch.float32 and table.cos.shape == (length, hd)
    assert torch.equal(table.cos[:, : hd // 2], table.cos[:, hd // 2 :])
    assert torch.equal(table.sin[:, : hd // 2], table.sin[:, hd // 2 :])
    for pos in [0, 1, 2, 3, 17, 1000, length // 2 - 1, length // 2, 6000, length - 1]:
        for j in range(hd // 2):
            angle = float(torch.tensor(float(pos), dtype=torch.float32) * inv[j])  # the float32 product
            want_cos = torch.tensor(math.cos(angle), dtype=torch.float64).float()
            want_sin = torch.tensor(math.sin(angle), dtype=torch.float64).float()
            assert table.cos[pos, j] == want_cos, (pos, j, angle)
            assert table.sin[pos, j] == want_sin, (pos, j, angle)
