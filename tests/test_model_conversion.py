"""Converting, moving or swapping the modules of a loaded target (models/fused.py KernelModule and
Watched): a quantised or packed linear keeps its kernel tensors' dtypes through `.to(dtype)`,
`.float()`, `.half()` (it keeps computing exactly what it did), and the fused stack's table of raw
addresses is rebuilt after any move, conversion or swap, but not on every step."""
from __future__ import annotations

import pytest
import torch

from augury import LLM, SamplingParams
from augury.cpu import kernels as cpu_kernels
from augury.models import fused, quant
from augury.models.dense import HalfPackedLinear, NO_PADDING, fbgemm_half_available
from augury.models.fused import KernelModule
from augury.models.loader import load_target
from conftest import random_prompts
from test_quant import PROMPT, _hidden

CPU = torch.device("cpu")
needs_fused = pytest.mark.skipif(cpu_kernels.forward() is None or cpu_kernels.w4a8() is None,
                                 reason="augury's fused-stack / w4a8 kernels do not run here")


def _kernel_modules() -> list[tuple[str, torch.nn.Module]]:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(64, 128, generator=g) * 0.1, torch.randn(64, generator=g)
    mods = [("int8 bf16", quant.Int8Linear.from_float(w, b, torch.bfloat16)),
            ("int8 f32", quant.Int8Linear.from_float(w, b, torch.float32)),
            ("int4 torch bf16", quant.Int4Linear.from_float(w, b, torch.bfloat16, backend="torch")),
            ("int4 torch f32", quant.Int4Linear.from_float(w, b, torch.float32))]
    if cpu_kernels.w4a8() is not None:
        mods.append(("int4 w4a8", quant.Int4Linear.from_float(w, b, torch.bfloat16, backend="w4a8")))
    if (k := cpu_kernels.w8a8()) is not None:
        mods.append(("w8a8 output", quant.W8A8OutputLinear(w, k)))
    if (k := cpu_kernels.bf16()) is not None:
        from augury.models.dense import BF16PanelLinear

        mods.append(("bf16 panels", BF16PanelLinear(w, b, k)))
    if "fbgemm" in torch.backends.quantized.supported_engines:
        mods.append(("fp16 packed", HalfPackedLinear(w, b, torch.bfloat16, NO_PADDING)))
    return mods


@pytest.mark.parametrize("name,mod", _kernel_modules(), ids=lambda x: x if isinstance(x, str) else "")
def test_dtype_conversions_leave_a_kernel_modules_tensors_and_numbers(name, mod) -> None:
    """The bug: model.to(torch.float32) converted an Int4Linear's bfloat16 w4a8_scale / w4a8_zero while
    its .dtype stayed bfloat16, and its kernel (and the fused table) read float32 bytes as bfloat16."""
    assert isinstance(mod, KernelModule)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = mod(x)
    before = {n: (t.dtype, t.data_ptr()) for n, t in [*mod.named_buffers(), *mod.named_parameters()]}
    dtype = getattr(mod, "dtype", None)
    for convert in (lambda m: m.to(torch.float32), lambda m: m.float(), lambda m: m.half(), lambda m: m.double(),
                    lambda m: m.to(torch.bfloat16), lambda m: m.to(CPU, torch.float16), lambda m: m.to(CPU)):
        assert convert(mod) is mod
        assert {n: (t.dtype, t.data_ptr()) for n, t in [*mod.named_buffers(), *mod.named_parameters()]} == before
        assert getattr(mod, "dtype", None) == dtype
        assert torch.equal(mod(x), want), name


def test_a_quantised_linear_follows_its_callers_dtype_outside_and_computes_in_its_own() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    mod = quant.Int4Linear.from_float(w, None, torch.bfloat16)
    x = torch.randn(3, 128).bfloat16()
    assert mod(x).dtype == torch.bfloat16
    y = mod(x.float())  # float32 activations (a converted model): rounded in, the same values out
    assert y.dtype == torch.float32 and torch.equal(y, mod(x).float())


def test_device_moves_still_carry_a_kernel_modules_tensors() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    mod = quant.Int8Linear.from_float(w, None, torch.bfloat16).to(torch.device("meta"))
    assert mod.qweight.device.type == "meta" and mod.scales.dtype == torch.bfloat16
    mod = quant.Int8Linear.from_float(w, None, torch.bfloat16).to_empty(device=torch.device("meta"))
    assert mod.scales.device.type == "meta" and mod.scales.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_converted_quantised_model_computes_what_a_fresh_one_does(mode, tiny_checkpoint) -> None:
    """model.to(torch.float32) on a bfloat16 quantised target: its quantised linears keep computing
    in bfloat16 exactly as loaded; everything else widens exactly to float32. The outputs equal a
    fresh model's whose non-kernel tensors were widened by hand (before the fix: float32 scale bytes
    read as bfloat16, far off)."""
    folder = tiny_checkpoint("llama")
    model, cfg = load_target(folder, torch.bfloat16, CPU, 64, quantization=mode)
    _hidden(model, cfg, PROMPT, torch.bfloat16)  # a first forward (builds the fused table where it runs)
    model.to(torch.float32)
    got = _hidden(model, cfg, PROMPT, torch.float32)
    fresh, _ = load_target(folder, torch.bfloat16, CPU, 64, quantization=mode)
    kernel_tensors = {id(t) for m in fresh.modules() if isinstance(m, KernelModule)
                      for t in (*m.buffers(recurse=False), *m.parameters(recurse=False))}
    with torch.no_grad():
        for t in (*fresh.parameters(), *fresh.buffers()):
            if id(t) not in kernel_tensors and t.is_floating_point():
                t.data = t.data.float()
    want = _hidden(fresh, cfg, PROMPT, torch.float32)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want)
    # and back: bfloat16 again computes what the model computed as loaded
    model.to(torch.bfloat16)
    again, _ = load_target(folder, torch.bfloat16, CPU, 64, quantization=mode)
    assert torch.equal(_hidden(model, cfg, PROMPT, torch.bfloat16), _hidden(again, cfg, PROMPT, torch.bfloat16))


# ---- the fused table ---------------------------------------------------------------------------

def _run(llm, layers: bool = False):
    prompts = random_prompts([5, 11, 3], seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in (9, 6, 11)]
    if layers:
        llm.engine.model._fused = False
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in pos.items()} for pos in o.logprobs]) for o in outs]


@pytest.fixture
def count_builds(monkeypatch):
    calls = {"build": 0}
    real = fused.FusedStack.build

    def build(model):
        calls["build"] += 1
        return real(model)

    monkeypatch.setattr(fused.FusedStack, "build", staticmethod(build))
    return calls


def _llm(folder) -> LLM:
    return LLM(str(folder), dtype="bfloat16", quantization="int4", speculative_algorithm="none", log_stats_interval=0)


@needs_fused
def test_swapping_a_linear_after_the_first_forward_rebuilds_the_fused_table(tiny_checkpoint, count_builds) -> None:
    """The bug: the table of raw addresses was built once, so after `model.layers[0].mlp.down_proj =
    new_linear` the decode steps still ran the old linear (its tensors kept alive by the table)."""
    folder = tiny_checkpoint("llama")
    llm = _llm(folder)
    before = _run(llm)
    model = llm.engine.model
    assert isinstance(model._fused, fused.FusedStack)
    old = model.layers[0].mlp.down_proj
    w = torch.randn(old.out_features, old.in_features, generator=torch.Generator().manual_seed(9)) * 0.3
    model.layers[0].mlp.down_proj = quant.Int4Linear.from_float(w, None, torch.bfloat16)
    builds = count_builds["build"]
    got = _run(llm)
    assert count_builds["build"] == builds + 1  # rebuilt once, not on every step
    assert isinstance(model._fused, fused.FusedStack)
    fresh = _llm(folder)
    fresh.engine.model.layers[0].mlp.down_proj = quant.Int4Linear.from_float(w, None, torch.bfloat16)
    want = _run(fresh, layers=True)  # the layer-by-layer forward reads the modules themselves
    assert got == want and got != before
    # a whole layer swapped into the list
    model.layers[1] = fresh.engine.model.layers[1]
    fresh_layers = _llm(folder)
    fresh_layers.engine.model.layers[0].mlp.down_proj = quant.Int4Linear.from_float(w, None, torch.bfloat16)
    fresh_layers.engine.model.layers[1] = fresh.engine.model.layers[1]
    assert _run(llm) == _run(fresh_layers, layers=True)


@needs_fused
def test_moving_or_converting_a_submodule_rebuilds_the_fused_table(tiny_checkpoint, count_builds) -> None:
    folder = tiny_checkpoint("llama")
    llm = _llm(folder)
    want = _run(llm)
    model = llm.engine.model
    table = model._fused
    for convert in (lambda: model.layers[0].mlp.down_proj.to(torch.float32),  # kernel tensors stay: same numbers
                    lambda: model.layers[1].to(CPU),
                    lambda: model.layers[0].input_layernorm.to(CPU)):
        builds = count_builds["build"]
        convert()
        assert _run(llm) == want
        assert count_builds["build"] == builds + 1 and model._fused is not table
        table = model._fused
    builds = count_builds["build"]
    assert _run(llm) == want and count_builds["build"] == builds  # nothing changed: no rebuild
    model._fused = None  # asked again: built again
    assert _run(llm) == want and count_builds["build"] == builds + 1
