"""The device chooses the int4 kernel (models/quant.py, models/loader.py): on the CPU augury's w4a8
or torch's CPU kernel, on CUDA torch's CUDA kernel (bfloat16, sm80+) or, where that does not run,
dense bfloat16 for quantization="auto". Checked without a GPU: the decision is a function of
(dtype, device), CUDA's availability is a function this test can stand in for, and the CUDA layout
is built on the meta device; the tests marked needs_cuda run only where the CUDA kernel does."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from augury.cpu import kernels as cpu_kernels
from augury.models import quant
from augury.models.loader import resolve_quantization
from augury.models.quant import Int4Linear, default_int4_backend
from test_quant import q4_gguf  # noqa: F401  (a fixture: a tiny GGUF with Q4_0 / Q4_1 blocks)

CPU, CUDA, META = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
G = quant.INT4_GROUP

needs_cuda = pytest.mark.skipif(not quant.cuda_int4_available(CUDA),
                                reason="torch's CUDA int4 kernel does not run here (no sm80+ GPU or no CUDA build)")


@pytest.fixture
def cuda_kernel(monkeypatch):
    """Stand in for a CUDA build on an sm80+ GPU: torch's CUDA int4 kernel is available."""
    monkeypatch.setattr(quant, "cuda_int4_available", lambda device: True)


def _parts(n: int = 64, k: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    return codes, torch.rand(n, k // G, generator=g) * 0.05 + 0.005, torch.randn(n, k // G, generator=g) * 0.1


def test_the_device_chooses_the_int4_backend(cuda_kernel) -> None:
    cpu_bf16 = "w4a8" if cpu_kernels.w4a8() is not None else "torch"
    assert default_int4_backend(torch.bfloat16, CPU) == default_int4_backend(torch.bfloat16) == cpu_bf16
    assert default_int4_backend(torch.float32, CPU) == "torch"
    # CUDA: torch's CUDA kernel in bfloat16, never a CPU-only one; no int4 kernel for other dtypes
    assert default_int4_backend(torch.bfloat16, CUDA) == default_int4_backend(torch.bfloat16, "cuda:0") == "cuda"
    assert default_int4_backend(torch.float16, CUDA) is None
    assert default_int4_backend(torch.float32, CUDA) is None
    assert default_int4_backend(torch.bfloat16, META) is None


def test_without_the_cuda_kernel_cuda_has_no_int4_backend(monkeypatch) -> None:
    monkeypatch.setattr(quant, "cuda_int4_available", lambda device: False)  # an older GPU, or ROCm
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert default_int4_backend(dtype, CUDA) is None
        assert not quant.mode_available("int4", dtype, CUDA)


def _native_folder(tmp_path: Path) -> Path:
    (tmp_path / quant.INT4_INDEX).write_text(json.dumps({"format": quant.INT4_FORMAT, "group_size": G}))
    return tmp_path


def test_auto_on_cuda_is_native_int4_only_where_the_cuda_kernel_runs(tmp_path, monkeypatch) -> None:
    """The bug: "auto" chose the CPU-only int4 kernel for a GGUF's Q4 blocks on CUDA, so
    LLM("demo", device="cuda") failed at warm-up. Now "auto" is native int4 on CUDA where torch's
    CUDA kernel runs (bfloat16, sm80+) and dense elsewhere; an explicit "int4" there is an error."""
    folder = _native_folder(tmp_path)
    monkeypatch.setattr(quant, "cuda_int4_available", lambda device: False)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert resolve_quantization(folder, "auto", dtype, CUDA) == "none"
    with pytest.raises(ValueError, match="no int4 kernel runs"):
        resolve_quantization(folder, "int4", torch.bfloat16, CUDA)
    monkeypatch.setattr(quant, "cuda_int4_available", lambda device: True)
    assert resolve_quantization(folder, "auto", torch.bfloat16, CUDA) == "gguf-int4"
    assert resolve_quantization(folder, "int4", torch.bfloat16, CUDA) == "gguf-int4"
    assert resolve_quantization(folder, "auto", torch.float16, CUDA) == "none"  # the CUDA kernel is bfloat16-only
    # the CPU as before
    assert resolve_quantization(folder, "auto", torch.bfloat16, CPU) == "gguf-int4"
    assert resolve_quantization(folder, "auto", torch.float32, CPU) == "none"
    assert resolve_quantization(tmp_path / "nowhere", "auto", torch.bfloat16, CPU) == "none"


def test_cpu_int4_backends_refuse_cuda(cuda_kernel) -> None:
    """The "torch" backend's ops (_convert_weight_to_int4pack_for_cpu, _weight_int4pack_mm_for_cpu)
    and w4a8 are CPU-only: neither is ever built for, nor moved to, another device."""
    codes, scale, zero = _parts()
    for backend in ("torch", "w4a8"):
        with pytest.raises(ValueError, match="runs on cpu"):
            Int4Linear(codes, scale, zero, None, torch.bfloat16, backend=backend, device=CUDA)
    mod = Int4Linear(codes, scale, zero, None, torch.float32)  # "torch", packed for the CPU
    with pytest.raises(ValueError, match="packed for a kernel that runs on cpu"):
        mod.to(META)
    with pytest.raises(ValueError, match="cuda"):
        Int4Linear(codes, scale, zero, None, torch.float32, backend="cuda", device=META)  # bfloat16 only


def test_the_cuda_backend_packs_and_runs_with_torchs_cuda_ops(cuda_kernel, monkeypatch) -> None:
    """On CUDA (here the meta device, shapes only): packed by `_convert_weight_to_int4pack` and run by
    `_weight_int4pack_mm` with bfloat16 scales and zeros [K/32, N, 2]; the CPU-only ops are never called."""
    def cpu_only(*args, **kwargs):
        raise AssertionError("a CPU-only int4 op was called for CUDA weights")

    monkeypatch.setattr(torch, "_convert_weight_to_int4pack_for_cpu", cpu_only)
    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", cpu_only)
    n, k = 64, 256
    codes, scale, zero = _parts(n, k)
    bias = torch.randn(n)
    mod = Int4Linear(codes, scale, zero, bias, torch.bfloat16, backend="cuda", device=META)
    assert mod.backend == "cuda" and mod.kernel_devices == ("cuda", "meta")
    assert mod.packed.device == META and mod.packed.dtype == torch.int32
    assert tuple(mod.packed.shape) == (n // 8, k // (8 * 16), 32, 4)  # 8 inner k-tiles (K % 128 == 0)
    assert mod.scales_and_zeros.dtype == torch.bfloat16 and tuple(mod.scales_and_zeros.shape) == (k // G, n, 2)
    assert mod.bias.device == META and mod.bias.dtype == torch.bfloat16
    calls = []

    def fake_mm(x, packed, group, sz):
        calls.append((x.dtype, packed is mod.packed, group, sz is mod.scales_and_zeros))
        return x.new_zeros(x.shape[0], n)

    monkeypatch.setattr(torch, "_weight_int4pack_mm", fake_mm)
    y = mod(torch.randn(2, 3, k, dtype=torch.float32, device=META))  # rounded to bfloat16 for the kernel
    assert calls == [(torch.bfloat16, True, G, True)]
    assert y.shape == (2, 3, n) and y.dtype == torch.float32  # and back to the caller's dtype
    # K = 32 * odd: two inner k-tiles
    assert tuple(Int4Linear(*_parts(16, 96), None, torch.bfloat16, "cuda", META).packed.shape) == (2, 3, 32, 1)


def test_cuda_layout_puts_even_columns_in_the_high_nibble() -> None:
    """torch._convert_weight_to_int4pack (CUDA) takes [N, K/2] uint8, column 2i high, 2i+1 low (torch's
    own tests build it so: torch.testing._internal.common_quantization._group_quantize_tensor)."""
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 0, 15]])
    assert quant.cuda_int4_layout(codes).tolist() == [[0x12, 0xF0], [0x78, 0x0F]]


def test_quantize_linear_on_a_device_without_the_kernel_stays_dense(monkeypatch, caplog) -> None:
    monkeypatch.setattr(quant, "cuda_int4_available", lambda device: False)
    w = torch.randn(64, 128)
    with caplog.at_level("WARNING", logger="augury.models.quant"):
        assert quant.quantize_linear(w, None, "int4", torch.bfloat16, "x", device=CUDA) is None
    assert any("no int4 kernel runs" in r.message for r in caplog.records)


@needs_cuda
def test_cuda_int4_linear_computes_the_reference_values() -> None:
    codes, scale, zero = _parts(96, 256)
    mod = Int4Linear(codes, scale, zero, None, torch.bfloat16, device=CUDA)
    assert mod.backend == "cuda"
    ref = quant.int4_values(codes, scale.bfloat16(), zero.bfloat16()).bfloat16().float()
    got = mod.dequantize().float().cpu()
    assert ((got - ref).abs() <= 2**-7 * (ref.abs() + ref.abs().amax(-1, keepdim=True))).all()
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    y = mod(x.to(CUDA)).float().cpu()
    want = x.float() @ ref.t()
    assert (y - want).abs().max() <= 0.02 * want.abs().max()


@needs_cuda
def test_a_gguf_q4_model_runs_on_cuda_with_auto(q4_gguf) -> None:
    """The symptom: LLM(<a GGUF with Q4 blocks>, device="cuda") with quantization="auto" failed at warm-up."""
    from augury import LLM, SamplingParams
    from augury.models.loader import load_target

    _, folder, _ = q4_gguf
    model, _ = load_target(folder, torch.bfloat16, CUDA, 64, quantization="auto")
    assert model.quantization == "int4"
    mods = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert mods and all(m.backend == "cuda" and m.packed.device.type == "cuda" for m in mods)
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", quantization="auto", speculative_algorithm="none",
              log_stats_interval=0)
    out = llm.generate([[5, 70, 33, 100]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 4
