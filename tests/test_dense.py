"""Dense 16-bit linears (models/dense.py): augury's bf16 kernel where it builds, else fbgemm's
float16 GEMM (the fbgemm tests turn augury's kernel off with the `no_bf16_kernel` fixture).

The torch facts first (padding to the kernel height makes rows independent of their batch;
without it they are not, which is why the target pads), then the module against a float32
product, then whole bfloat16 models: packed where the CPU lacks native bfloat16, logits close
to transformers' float32 forward, speculative greedy equal to plain greedy bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from augury import LLM, SamplingParams
from augury.cpu import kernels as cpu_kernels
from augury.models.dense import (NO_PADDING, PROBE_ROWS, BF16PanelLinear, HalfPackedLinear, fbgemm_half_available,
                                 pack_half_linears, row_padding)
from augury.models.loader import load_target
from conftest import hf_logits

CPU = torch.device("cpu")
needs_fbgemm = pytest.mark.skipif(not fbgemm_half_available(torch.bfloat16, CPU),
                                  reason="fbgemm's float16 GEMM is not what this CPU uses for bfloat16")


@pytest.fixture
def no_bf16_kernel(monkeypatch):
    """augury's dense bfloat16 kernel unavailable: the fbgemm path, as on machines without a compiler."""
    monkeypatch.setattr(cpu_kernels, "bf16", lambda: None)


def _on_f_linear(model, cls):
    """`model` with every `cls` module swapped for a bfloat16 nn.Linear of the same weights (F.linear)."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, cls):
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None).bfloat16()
            lin.weight.data = mod.weight
            if mod.bias is not None:
                lin.bias.data = mod.bias.bfloat16()
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, lin)
    return model


def _assert_as_close_as_f_linear(model, cfg, folder, hf_model, cls) -> None:
    """model's logits (its linears on `cls`) as close to transformers' float32 forward as the same
    checkpoint on F.linear, and mostly the same top-1."""
    import test_quant

    prompt = test_quant.PROMPT
    ref = hf_logits(hf_model(folder), prompt)
    got = test_quant._logits(model, cfg, prompt, torch.bfloat16)
    plain = _on_f_linear(load_target(folder, torch.bfloat16, CPU, 64)[0], cls)
    base = test_quant._logits(plain, cfg, prompt, torch.bfloat16)
    err, base_err = (got - ref).abs().mean().item(), (base - ref).abs().mean().item()
    assert err <= 1.5 * base_err + 1e-3, (err, base_err)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def _bf16(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


@needs_fbgemm
def test_padded_rows_are_computed_as_if_alone() -> None:
    """A demo-shaped layer (another weight than the probe's): every row of calls of 1-40 rows and of
    row counts past the probed table, at several offsets, equals the row computed alone."""
    padding = row_padding()
    assert padding is not None and padding.block > 1
    assert all(m <= padding(m) <= -(-m // padding.block) * padding.block for m in range(1, 300))
    lin = HalfPackedLinear(_bf16(576, 1536, seed=1, scale=0.03), None, torch.bfloat16, padding)
    x = _bf16(300, 1536, seed=2)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(300)])
    for m in [*range(1, 41), PROBE_ROWS + 1, PROBE_ROWS + 7, 250]:
        for start in (0, 7, 300 - m):
            assert torch.equal(lin(x[start : start + m]), alone[start : start + m]), (m, start)


@needs_fbgemm
def test_unpadded_rows_depend_on_their_batch() -> None:
    """Why the target pads: without it some row of some batch comes out different (if fbgemm ever
    stops doing this, the padding can go)."""
    lin = HalfPackedLinear(_bf16(576, 1536, seed=1, scale=0.03), None, torch.bfloat16, NO_PADDING)
    x = _bf16(16, 1536, seed=2)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(16)])
    assert any(not torch.equal(lin(x[:m]), alone[:m]) for m in range(2, 16))


@needs_fbgemm
@pytest.mark.parametrize("bias", [False, True])
def test_half_packed_linear_is_a_float32_product_rounded_once(bias) -> None:
    w = _bf16(96, 320, seed=3, scale=0.05)
    b = _bf16(96, seed=4) if bias else None
    x = _bf16(7, 320, seed=5)
    lin = HalfPackedLinear(w, b, torch.bfloat16, row_padding())
    ref = x.float() @ w.float().t() + (b.float() if bias else 0)
    got = lin(x.view(1, 7, 320))
    assert got.dtype == torch.bfloat16 and got.shape == (1, 7, 96)
    # float32 sums in another order, then one rounding: within one bfloat16 step of the product
    assert ((got[0].float() - ref).abs() <= ref.abs() * 2**-7 + 1e-5).all()
    normal = w.float().abs() >= 2**-14  # float16 holds these bfloat16 values exactly
    assert torch.equal(lin.weight.float()[normal], w.float()[normal])


@needs_fbgemm
def test_bfloat16_target_packs_and_matches_transformers(tiny_checkpoint, hf_model, no_bf16_kernel) -> None:
    """bfloat16, quantization none: every target linear and the (tied) output layer are packed and
    padded; logits stay close to transformers' float32 forward (as close as the F.linear path)."""
    folder = tiny_checkpoint("qwen2")  # tied output layer, q/k/v bias
    model, cfg = load_target(folder, torch.bfloat16, CPU, 64)
    packed = [m for m in model.modules() if isinstance(m, HalfPackedLinear)]
    assert len(packed) == 2 * cfg.num_layers * 2 + 1  # qkv, o, gate_up, down per layer; lm_head
    assert all(m.padding is row_padding() for m in packed)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    _assert_as_close_as_f_linear(model, cfg, folder, hf_model, HalfPackedLinear)


@needs_fbgemm
def test_head_is_packed_without_padding(tmp_path) -> None:
    from augury.models.eagle3_head import load_eagle3
    from speculative_helpers import make_target, random_head

    target, head_dir = make_target(tmp_path / "t"), random_head(tmp_path / "h")
    model, cfg = load_target(target, torch.bfloat16, CPU, 64)
    head = load_eagle3(head_dir, cfg, model.embed_tokens, torch.bfloat16, CPU, 64)
    packed = [m for m in head.modules() if isinstance(m, HalfPackedLinear)]
    assert packed and all(m.padding is NO_PADDING for m in packed)


def test_not_used_where_it_does_not_apply(monkeypatch) -> None:
    assert not fbgemm_half_available(torch.float32, CPU)
    monkeypatch.setattr("augury.cpu.isa.native_bf16", lambda: True)
    assert not fbgemm_half_available(torch.bfloat16, CPU)


def test_weights_past_float16_range_keep_f_linear() -> None:
    root = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with torch.no_grad():
        root[1].weight[0, 0] = 1e6
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("no fbgemm")
    assert pack_half_linears(root, torch.bfloat16, 6) == 1
    assert isinstance(root[0], HalfPackedLinear) and type(root[1]) is torch.nn.Linear


@needs_fbgemm
@pytest.mark.parametrize("kernel", ["fbgemm", "augury-bf16"])
def test_speculative_greedy_equals_plain_greedy_bf16_dense(monkeypatch, tmp_path, kernel) -> None:
    """Batched and alone, bit for bit: fbgemm's padding makes verified rows decode rows (without it the
    comparison is not guaranteed: unpadded rows differ, see above; tests/test_draft_budget.py's
    bfloat16 run fails with the target unpadded); augury's bf16 kernel is row-count invariant as it is
    (and its steps run through the fused layer stack, models/fused.py)."""
    if kernel == "fbgemm":
        monkeypatch.setattr(cpu_kernels, "bf16", lambda: None)
    elif cpu_kernels.bf16() is None:
        pytest.skip("augury's bf16 kernel does not build here")
    from speculative_helpers import make_target, random_head
    from test_quant import _prompts

    target, head = make_target(tmp_path / "t"), random_head(tmp_path / "h")
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (24, 17, 30, 9, 20)]
    prompts = _prompts(len(params))
    common = dict(dtype="bfloat16", quantization="none", log_stats_interval=0)
    plain = LLM(str(target), speculative_algorithm="none", **common)
    spec = LLM(str(target), draft_model=str(head), speculative_algorithm="eagle3", speculative_policy="static",
               speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6, **common)
    assert isinstance(spec.engine.model.layers[0].mlp.down_proj,
                      HalfPackedLinear if kernel == "fbgemm" else BF16PanelLinear)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    alone = [spec.generate([p], [sp], use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    assert alone == want
    assert spec.engine.stats.steps_spec > 0


@needs_fbgemm
def test_an_untied_output_layer_past_float16_range_stays(tiny_checkpoint, tmp_path, no_bf16_kernel) -> None:
    """The output layer is only replaced when it can be packed: one weight past float16's range
    keeps the untied model's own lm_head (it must not fall back to the embedding)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "big"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    files = sorted(folder.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    if "lm_head.weight" not in tensors:
        pytest.skip("the tiny llama ties its output layer")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].clone()
    tensors["lm_head.weight"][0, 0] = 2.0**20  # exact in bfloat16, past float16
    for f in files:
        f.unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    model, _ = load_target(folder, torch.bfloat16, CPU, 64)
    assert type(model.lm_head) is torch.nn.Linear
    assert model.lm_head.weight[0, 0].item() == 2.0**20


needs_bf16_kernel = pytest.mark.skipif(cpu_kernels.bf16() is None,
                                       reason="augury's bf16 kernel does not serve or build here")


@needs_bf16_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panel_linear_is_a_float32_product_rounded_once_and_row_invariant(bias) -> None:
    """Against float64: the float32 sum of exact products, rounded once to bfloat16 (+ the bias,
    rounded again); a row alone, among 1-70 rows and at 1 or 2 threads comes out the same bits."""
    w, x = _bf16(50, 200, seed=3, scale=0.05), _bf16(70, 200, seed=4)  # 50: a last panel of 2 columns
    b = _bf16(50, seed=5) if bias else None
    lin = BF16PanelLinear(w, b, cpu_kernels.bf16())
    assert torch.equal(lin.weight, w)
    got = lin(x)
    exact = x.double() @ w.double().t()
    raw = cpu_kernels.bf16().linear(x, lin.panels, 50, out_dtype=torch.float32)
    assert (raw.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    want = raw.bfloat16() if b is None else (raw.bfloat16().float() + b.float()).bfloat16()
    assert torch.equal(got, want)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in (0, 5, 33, 69):
                assert torch.equal(lin(x[r : r + 1]), got[r : r + 1])
            assert torch.equal(lin(x[:7]), got[:7])
    finally:
        torch.set_num_threads(threads)


@needs_bf16_kernel
def test_bfloat16_target_on_the_bf16_kernel_matches_transformers(tiny_checkpoint, hf_model) -> None:
    """bfloat16, quantization none, where augury's kernel builds: every target linear and the (tied)
    output layer (float32 logits) on it; logits as close to transformers' float32 forward as the
    F.linear path; a weight past float16's range is no concern (bfloat16 throughout)."""
    folder = tiny_checkpoint("qwen2")  # tied output layer, q/k/v bias
    model, cfg = load_target(folder, torch.bfloat16, CPU, 64)
    panels = [m for m in model.modules() if isinstance(m, BF16PanelLinear)]
    assert len(panels) == 4 * cfg.num_layers + 1 and model.lm_head.out_dtype == torch.float32
    assert not any(isinstance(m, (torch.nn.Linear, HalfPackedLinear)) for m in model.modules())
    _assert_as_close_as_f_linear(model, cfg, folder, hf_model, BF16PanelLinear)
