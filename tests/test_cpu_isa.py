"""The CPU kernels' ISA levels: the probe reads the CPU's feature bits, AUGURY_CPU_ISA forces a lower
level, every level's variant of every kernel compiles on any x86-64 host, and each variant this CPU
runs computes the same bits as the AVX2 one."""
from __future__ import annotations

import pytest
import torch

from augury.cpu import build, isa
from augury.cpu import kernels as cpu_kernels

X86 = isa.why_unsupported() is None and build.compiler() is not None
needs_x86 = pytest.mark.skipif(not X86, reason="needs x86-64 with AVX2 and a C++ compiler")


AVX2 = {"avx2", "fma", "f16c", "sse4_2"}
ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}  # no AVX-VNNI


@pytest.mark.parametrize("flags, level", [
    (set(), None),
    ({"avx2", "fma"}, None),  # no F16C
    (AVX2, "avx2"),
    (AVX2 | {"avx_vnni"}, "avx_vnni"),
    (AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2"),  # Skylake-X: AVX-512 without VNNI
    (ZEN4 - {"avx512_bf16"}, "avx512_vnni"),
    (ZEN4, "avx512_bf16"),
    (ZEN4 | {"avx_vnni", "amx_tile"}, "avx512_bf16"),
])
def test_level_of_flags(flags, level) -> None:
    assert isa.level_of(frozenset(flags)) == level


def test_forcing_a_level(monkeypatch) -> None:
    monkeypatch.setattr(isa, "_cpuinfo_flags", lambda: frozenset(ZEN4))
    monkeypatch.setattr(isa, "host_level", lambda: "avx512_bf16")
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("AUGURY_CPU_ISA", raising=False)
    assert isa.selected_level() == "avx512_bf16"
    monkeypatch.setenv("AUGURY_CPU_ISA", "AVX2")
    assert isa.selected_level() == "avx2"
    monkeypatch.setenv("AUGURY_CPU_ISA", "avx_vnni")  # this CPU lacks the VEX form
    with pytest.raises(ValueError, match="AUGURY_CPU_ISA=avx_vnni needs CPU features this CPU lacks"):
        isa.selected_level()
    monkeypatch.setenv("AUGURY_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="not a level; use one of avx2, avx_vnni, avx512_vnni, avx512_bf16"):
        isa.selected_level()


def test_a_bad_forced_level_turns_the_kernels_off_with_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setenv("AUGURY_CPU_ISA", "sse2")
    cpu_kernels.reset()
    try:
        with caplog.at_level("WARNING", logger="augury.cpu.kernels"):
            assert cpu_kernels.w4a8() is None
        assert any("AUGURY_CPU_ISA" in r.getMessage() for r in caplog.records) or not X86
    finally:
        cpu_kernels.reset()


@needs_x86
@pytest.mark.parametrize("level", isa.LEVELS)
def test_every_variant_compiles_on_any_x86_host(level) -> None:
    for name in cpu_kernels.NAMES:
        path = build.build(name, level)
        assert path.is_file() and f"-{level}-" in path.name


@needs_x86
@pytest.mark.parametrize("level", [lv for lv in isa.LEVELS[1:] if isa.allowed_on_host(lv)] or
                         [pytest.param("none", marks=pytest.mark.skip(reason="this CPU runs only the avx2 level"))])
def test_each_variant_this_cpu_runs_equals_the_avx2_one(level) -> None:
    """w4a8, w8a8, bf16, attention and the sampler's draw at `level` give the AVX2 variant's bits (rows
    of several counts)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(13, 256, generator=g) * 3).to(torch.bfloat16)
    codes = torch.randint(0, 16, (64, 256), generator=g)
    scale, zero = torch.rand(64, 8, generator=g) / 10 + 0.01, torch.randn(64, 8, generator=g) / 10
    w = torch.randn(72, 256, generator=g)
    q = torch.randn(5, 4, 32, generator=g)
    kc, vc = torch.randn(40, 2, 32, generator=g), torch.randn(40, 2, 32, generator=g)
    slots = torch.randint(0, 40, (5, 12), generator=g)
    nkeys = torch.tensor([1, 5, 12, 7, 3], dtype=torch.int32)
    # attention's AVX-512 paths by head size (64 and 128 unrolled, other multiples of 16, and 24, which
    # takes the 8-lane path everywhere), bfloat16 caches, 3 query heads per key-value head, 1..37 keys
    heads = []
    for hd in (64, 128, 48, 24):
        qh = torch.randn(4, 6, hd, generator=g).to(torch.bfloat16)
        kh, vh = (torch.randn(50, 2, hd, generator=g).to(torch.bfloat16) for _ in range(2))
        heads.append((qh, kh, vh, torch.randint(0, 50, (4, 37), generator=g),
                      torch.tensor([1, 9, 37, 16], dtype=torch.int32), hd ** -0.5))
    draw_rows = torch.randn(1, 5000, generator=g) * 4
    draw_us = torch.rand(64, dtype=torch.float64, generator=g).tolist()
    outs = {}
    for lv in ("avx2", level):
        w4 = cpu_kernels.W4A8(build.build("w4a8", lv))
        w8 = cpu_kernels.W8A8(build.build("w8a8", lv))
        bf = cpu_kernels.BF16(build.build("bf16", lv))
        at = cpu_kernels.AttentionKernel(build.build("attention", lv))
        outs[lv] = [w4.linear(x, *w4.pack(codes, scale, zero)), w8.linear(x.float(), *w8.pack(w)),
                    bf.linear(x.float(), bf.pack(w), 72), at.attend_rows(q, kc, vc, slots, nkeys, 0.2)]
        outs[lv] += [at.attend_rows(*case) for case in heads]
        ew = cpu_kernels.Elementwise(build.build("elementwise", lv))  # the sampler's draw: its exp and sums
        outs[lv].append(torch.tensor(ew.draw(draw_rows.expand(64, -1).contiguous(), [0.7] * 64, [None] * 64,
                                             [1.0] * 64, [0.0] * 64, draw_us)))
        outs[lv].append(torch.tensor(ew.draw(draw_rows.expand(64, -1).contiguous(), [0.9] * 64, [None, 50] * 32,
                                             [0.9, 0.95] * 32, [0.0, 0.01] * 32, draw_us)))
    for a, b in zip(outs["avx2"], outs[level]):
        assert torch.equal(a, b)
