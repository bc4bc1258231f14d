"""Weight-only int8/int4 (models/quant.py) and GGUF Q4 weights run natively as int4.

First the torch facts the modules stand on (value convention, dtype rule, row-count
invariance of both kernels), then the modules against reference dequantisations, whole tiny
models against their dense selves, a tiny GGUF with Q4_0 and Q4_1 tensors against gguf's own
dequantisation, and speculative greedy output against plain greedy output in each mode.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from augury import LLM, SamplingParams
from augury.attention import PagedBackend
from augury.core.kv_cache import KVCache
from augury.cpu import kernels as cpu_kernels
from augury.models import quant
from augury.models.dense import HalfPackedLinear, fbgemm_half_available
from augury.models.eagle3_head import load_eagle3
from augury.models.gguf import INT4_FILE, INT4_INDEX, convert_gguf_to_hf
from augury.models.loader import load_target
from augury.models.native import W40Linear
from augury.models.native_embed import PackedEmbedding
from augury.models.quant import Int4Linear, Int8Linear, int4_values, quantize_head
from speculative_helpers import make_target, random_head

G = quant.INT4_GROUP
DTYPES = [torch.float32, torch.bfloat16]


def _within(got: torch.Tensor, ref: torch.Tensor, rel: float) -> bool:
    """|got - ref| <= rel * (|ref| + max |ref| of its row): the kernel may form (q - 8) * s + z in
    another order (q * s + (z - 8 s)), so values near zero carry the rounding of the terms."""
    return bool(((got - ref).abs() <= rel * (ref.abs() + ref.abs().amax(-1, keepdim=True))).all())


def _int4_parts(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(n, k // G, generator=g) * 0.05 + 0.005
    zero = torch.randn(n, k // G, generator=g) * 0.1
    return codes, scale, zero


# ---- torch facts ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_kernel_convention_is_q_minus_8_times_scale_plus_zero(dtype) -> None:
    """_weight_int4pack_mm_for_cpu reads scales_and_zeros [K/32, N, 2] as w = (q - 8) * s + z."""
    codes, scale, zero = _int4_parts(64, 128)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    sz = torch.stack([scale.t(), zero.t()], -1).to(dtype).contiguous()
    got = torch._weight_int4pack_mm_for_cpu(torch.eye(128, dtype=dtype), packed, G, sz).t().float()
    ref = int4_values(codes, scale.to(dtype), zero.to(dtype)).to(dtype).float()
    # float32: within float32 rounding; bfloat16: the kernel's output rounds to bfloat16 once
    assert _within(got, ref, 2**-22 if dtype == torch.float32 else 2**-8)
    wrong = int4_values(codes, scale, zero) + 8 * scale.repeat_interleave(G, 1)  # q * s + z
    assert (got - wrong).abs().max() > 1e-2


def test_kernels_want_scales_in_the_activation_dtype() -> None:
    codes, scale, zero = _int4_parts(32, 64)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    sz = torch.stack([scale.t(), zero.t()], -1).contiguous()  # float32
    with pytest.raises(RuntimeError):
        torch._weight_int4pack_mm_for_cpu(torch.randn(2, 64, dtype=torch.bfloat16), packed, G, sz)
    with pytest.raises(RuntimeError):
        torch._weight_int8pack_mm(torch.randn(2, 64, dtype=torch.bfloat16),
                                  torch.zeros(32, 64, dtype=torch.int8), torch.ones(32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_kernel_rows_are_row_count_invariant(kind, dtype) -> None:
    """A row's output is bit for bit the same alone or inside 8, 12 or 64 rows: what lets a
    verification row equal a decode row (at this test's thread count, 1)."""
    n, k = 96, 192
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.1
    mod = Int8Linear.from_float(w, None, dtype) if kind == "int8" else Int4Linear.from_float(w, None, dtype)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    full = mod(x)
    for m in (8, 12, 64):
        assert torch.equal(mod(x[:m]), full[:m])
    for i in (0, 5, 11, 63):
        assert torch.equal(mod(x[i : i + 1])[0], full[i])


# ---- modules -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_linear_dequantises_to_the_reference(dtype) -> None:
    codes, scale, zero = _int4_parts(48, 96)
    mod = Int4Linear(codes, scale, zero, None, dtype)
    # the reference: scale and zero rounded to the kernel's dtype, the value rounded once
    ref = int4_values(codes, scale.to(dtype), zero.to(dtype)).to(dtype).float()
    got = mod.dequantize().float()
    assert got.dtype == torch.float32 and got.shape == (48, 96)
    assert _within(got, ref, 2**-22 if dtype == torch.float32 else 2**-8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantised_linears_are_close_to_dense_and_keep_the_bias(dtype) -> None:
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(64, 128, generator=g) * 0.1, torch.randn(64, generator=g)
    x = torch.randn(2, 3, 128, generator=g)
    ref = torch.nn.functional.linear(x, w, b)
    for mod, step in ((Int8Linear.from_float(w, b, dtype), w.abs().amax(1, keepdim=True) / 127),
                      (Int4Linear.from_float(w, b, dtype), None)):
        # each weight within half a step (int8: amax / 254 per row) plus the dtype's rounding
        err = (mod.weight.float() - w).abs()
        if step is not None:
            assert (err <= step / 2 * 1.01 + 1e-2 * w.abs()).all()
        y = mod(x.to(dtype))
        assert y.shape == (2, 3, 64) and y.dtype == dtype
        assert (y.float() - ref).abs().mean() < 0.1 * ref.abs().mean()
    assert torch.equal(Int8Linear.from_float(w, b, dtype).bias, b.to(dtype))


def test_one_kernel_at_every_row_count_and_no_dense_copy() -> None:
    """No switch to a dense copy at some row count: each row is the kernel's at 1 row and at 64."""
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(6))
    for mod in (Int8Linear.from_float(w, None, torch.bfloat16), Int4Linear.from_float(w, None, torch.bfloat16)):
        assert not [n for n, _ in mod.named_buffers() if n == "dense"]
        x = torch.randn(64, 64).to(torch.bfloat16)
        rows = mod(x)
        for i in (0, 5, 63):
            assert torch.equal(rows[i], mod(x[i:i + 1])[0])


# ---- whole models ------------------------------------------------------------------------------

def _hidden(model, cfg, prompt: list[int], dtype) -> torch.Tensor:
    """One prefill over an empty paged cache: final-norm hidden states [len(prompt), H]."""
    bs, n = 16, len(prompt)
    blocks = -(-n // bs)
    kv = KVCache(cfg.num_layers, blocks + 1, bs, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
    attn = PagedBackend(kv.k, kv.v, bs).prepare_prefill([list(range(1, blocks + 1))], [0], [n])
    with torch.no_grad():
        return model(torch.tensor([prompt]), torch.arange(n)[None], attn)[0][0]


def _logits(model, cfg, prompt: list[int], dtype) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(_hidden(model, cfg, prompt, dtype))


PROMPT = [5, 70, 33, 100, 12, 200, 44, 9, 3, 150, 77, 8]


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied with no bias; tied with q/k/v bias
def test_quantised_model_logits_close_to_dense(family, tiny_checkpoint) -> None:
    """Two checks, float32. Exact: the quantised model computes what a dense model holding its
    dequantised weights computes (float32 rounding: 1e-4). Close: relative mean |logit error|
    against the original dense model, int8 under 3% and int4 under 40% (measured 0.3-0.5% and
    ~28%): these random checkpoints have wide N(0, 0.15) Gaussian weights, so a group-32 int4
    step (range / 15, ~0.27 sigma) is a large part of each weight, and two chaotic layers
    amplify it; a wrong value convention gives errors over 100%."""
    folder = tiny_checkpoint(family)
    dense, cfg = load_target(folder, torch.float32, torch.device("cpu"), 64)
    ref = _logits(dense, cfg, PROMPT, torch.float32)
    for mode, bound, agree in (("int8", 0.03, 0.9), ("int4", 0.4, 0.3)):
        model, _ = load_target(folder, torch.float32, torch.device("cpu"), 64, quantization=mode)
        assert model.quantization == mode
        kinds = {type(m).__name__ for m in model.modules()}
        assert ("Int8Linear" if mode == "int8" else "Int4Linear") in kinds
        assert "Linear" not in kinds and "TransposedLinear" not in kinds  # every linear swapped
        got = _logits(model, cfg, PROMPT, torch.float32)
        rel = ((got - ref).abs().mean() / ref.abs().mean()).item()
        assert rel < bound, f"{mode}: relative logit error {rel:.3f}"
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= agree
        for name, mod in list(model.named_modules()):
            if isinstance(mod, (Int8Linear, Int4Linear)):  # back to dense, on the dequantised weights
                lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
                lin.weight.data, lin.bias = mod.dequantize(), mod.bias
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, lin)
        torch.testing.assert_close(_logits(model, cfg, PROMPT, torch.float32), got, rtol=1e-4, atol=1e-4)


def test_quantize_head_is_close_to_the_dense_head(tmp_path: Path, caplog) -> None:
    target = make_target(tmp_path / "t")
    head_dir = random_head(tmp_path / "h")
    model, cfg = load_target(target, torch.float32, torch.device("cpu"), 64)
    dense = load_eagle3(head_dir, cfg, model.embed_tokens, torch.float32, torch.device("cpu"), 64)
    out = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
    ref = dense.logits(out)
    for mode in ("int8", "int4"):
        with caplog.at_level("WARNING", logger="augury.models.quant"):
            head = load_eagle3(head_dir, cfg, model.embed_tokens, torch.float32, torch.device("cpu"), 64,
                               quantization=mode)
        assert isinstance(head.fc, Int8Linear if mode == "int8" else Int4Linear)
        assert head.embed is model.embed_tokens  # the lookup stays shared and dense
        got = head.logits(out)
        assert ((got - ref).abs().mean() / ref.abs().mean()) < (0.03 if mode == "int8" else 0.25)
    # the draft vocabulary (200 rows) does not suit the int4 kernel (rows % 16): dense, said once
    assert isinstance(head.lm_head, torch.nn.Linear)
    assert sum("lm_head" in r.message and "stays dense" in r.message for r in caplog.records) == 1
    assert quantize_head(dense, "none") is dense and isinstance(dense.fc, torch.nn.Linear)


# ---- speculative == plain, per mode -------------------------------------------------------------

def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (3 + (7 * i) % 29,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def spec_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-spec")
    return make_target(root / "target"), random_head(root / "head")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_speculative_greedy_equals_plain_greedy_per_mode(mode, dtype, spec_ckpts, monkeypatch) -> None:
    """The kernels are row-count invariant, so a verified node computes what a decode step
    computes: exact in float32 and in bfloat16, on every CPU (no dense switch at any row count)."""
    target, head = spec_ckpts
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (24, 17, 30, 9, 20)]
    prompts = _prompts(len(params))
    common = dict(dtype=dtype, quantization=mode, log_stats_interval=0)
    plain = LLM(str(target), speculative_algorithm="none", **common)
    spec = LLM(str(target), draft_model=str(head), speculative_algorithm="eagle3", speculative_policy="static",
               speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6, **common)
    assert plain.engine.model.quantization == mode
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    one = spec.generate(prompts[:1], params[:1], use_tqdm=False)[0].token_ids  # batch 1
    assert one == want[0]


# ---- GGUF Q4 natively --------------------------------------------------------------------------

Q40, Q41, Q80 = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                 gguf.GGMLQuantizationType.Q8_0)


def _qtype(name: str) -> gguf.GGMLQuantizationType:
    """Layer 0 in Q4_0, layer 1 in Q4_1, the (tied) embedding in Q8_0: the demo's mix."""
    if name == "token_embd.weight":
        return Q80
    return Q40 if name.startswith("blk.0.") else Q41


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    import test_gguf

    root = tmp_path_factory.mktemp("q4gguf")
    model = test_gguf._tiny_model(tied=True)  # the demo's layout: a tied Q8_0 embedding
    real_add = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, array, *args, raw_dtype=None, **kwargs):  # per-tensor quant types
        if raw_dtype is None and array.ndim == 2 and array.dtype == np.float32:
            qt = _qtype(name)
            return real_add(self, name, gguf.quants.quantize(array, qt), raw_dtype=qt)
        return real_add(self, name, array, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    try:
        test_gguf._write_gguf(model, root / "tiny.gguf", gguf.GGMLQuantizationType.F32)
    finally:
        mp.undo()
    out = convert_gguf_to_hf(root / "tiny.gguf", root / "hf", dtype=torch.float32)
    return root / "tiny.gguf", out, model.config


def _gguf_weight(reader, name: str, heads: int | None) -> torch.Tensor:
    t = next(t for t in reader.tensors if t.name == name)
    w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
    w = torch.from_numpy(w.reshape(tuple(int(d) for d in reversed(t.shape.tolist()))))
    if heads is not None:  # undo llama.cpp's Q/K row permutation, as the dense conversion does
        rows, cols = w.shape
        w = w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    return w


def test_gguf_conversion_writes_the_int4_side_file(q4_gguf) -> None:
    _, folder, cfg = q4_gguf
    index = json.loads((folder / INT4_INDEX).read_text())
    assert (folder / INT4_FILE).is_file() and index["group_size"] == 32
    assert "model.layers.0.self_attn.q_proj.weight" in index["int4"]
    assert index["source_types"]["model.layers.0.mlp.up_proj.weight"] == "Q4_0"
    assert index["source_types"]["model.layers.1.mlp.up_proj.weight"] == "Q4_1"
    assert "model.embed_tokens.weight" not in index["int4"]  # Q8_0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gguf_q4_runs_natively_with_gguf_values(q4_gguf, dtype) -> None:
    """Each int4 module's dequantised weights equal gguf's dequantisation of the GGUF tensors
    (Q/K rows unpermuted, q|k|v and gate|up rows concatenated): within float32 rounding in
    float32; in bfloat16 layer 0's Q4_0 runs on its own float16 d (W40Linear, augury's w4a8 kernel
    built): exactly; Q4_1 (and Q4_0 elsewhere) takes its scales in bfloat16, so d (float16 in the
    file) and the zero round to bfloat16 first: within a few bfloat16 steps."""
    path, folder, cfg = q4_gguf
    model, _ = load_target(folder, dtype, torch.device("cpu"), 64, quantization="int4")
    assert model.quantization == "int4"
    reader = gguf.GGUFReader(path)
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        layer = model.layers[i]
        parts = {
            layer.self_attn.qkv_proj: [(f"blk.{i}.attn_q.weight", nh), (f"blk.{i}.attn_k.weight", nkv),
                                       (f"blk.{i}.attn_v.weight", None)],
            layer.self_attn.o_proj: [(f"blk.{i}.attn_output.weight", None)],
            layer.mlp.gate_up_proj: [(f"blk.{i}.ffn_gate.weight", None), (f"blk.{i}.ffn_up.weight", None)],
            layer.mlp.down_proj: [(f"blk.{i}.ffn_down.weight", None)],
        }
        for mod, names in parts.items():
            ref = torch.cat([_gguf_weight(reader, n, h) for n, h in names])
            got = mod.dequantize().float()
            if i == 0 and dtype == torch.bfloat16 and cpu_kernels.w4a8() is not None:
                assert isinstance(mod, W40Linear) and torch.equal(got, ref)  # Q4_0's own values
                continue
            assert isinstance(mod, Int4Linear)
            if dtype == torch.float32:
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
            else:
                # d and z each off by <= 2^-9 relative, |q - 8| d and |z| both <= max |w| of the row,
                # and the value itself rounds to bfloat16: <= 2^-8 (|w| + 2 max |w|)
                assert _within(got, ref, 2**-7)
    # the tied output layer comes from the Q8_0 embedding, its own copy: in bfloat16 on augury's w8a8
    # kernel (Q8_0's layout and rule) where it builds; else packed for fbgemm's float16 GEMM in 16-bit
    # dtypes where that serves (models/dense.py), else int8 per channel
    if dtype == torch.bfloat16 and cpu_kernels.w8a8() is not None:
        assert isinstance(model.lm_head, quant.W8A8OutputLinear)
        emb = model.embed_tokens.weight.float()
        groups = emb.view(emb.shape[0], -1, 32).abs().amax(-1, keepdim=True)
        err = (model.lm_head.weight - emb).view(emb.shape[0], -1, 32).abs()
        assert (err <= groups / 254 * 1.001).all()  # half a step of max |w| / 127 per group
        # the embedding beside it stays in Q8_0 (models/native_embed.py)
        assert isinstance(model.embed_tokens, PackedEmbedding)
    else:
        packed = dtype != torch.float32 and fbgemm_half_available(dtype, torch.device("cpu"))
        assert isinstance(model.lm_head, HalfPackedLinear if packed else Int8Linear)
        assert isinstance(model.embed_tokens, torch.nn.Embedding)


def test_gguf_auto_is_native_int4_in_16_bit_and_dense_in_float32(q4_gguf) -> None:
    """auto runs a GGUF's Q4 blocks natively where that is the fast path (16-bit activations); float32,
    the reference mode, runs dense."""
    _, folder, _ = q4_gguf
    for dtype, mode in ((torch.bfloat16, "int4"), (torch.float16, "int4"), (torch.float32, "none")):
        model, _ = load_target(folder, dtype, torch.device("cpu"), 64, quantization="auto")
        assert model.quantization == mode, dtype
        assert any(isinstance(m, Int4Linear) for m in model.modules()) == (mode == "int4")


def test_gguf_quantization_none_gives_the_dense_path(q4_gguf) -> None:
    _, folder, cfg = q4_gguf
    model, _ = load_target(folder, torch.float32, torch.device("cpu"), 64, quantization="none")
    assert model.quantization == "none"
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules())
    native, _ = load_target(folder, torch.float32, torch.device("cpu"), 64, quantization="int4")
    # the dense folder holds the same Q4 values: through the layer stack only float32 rounding differs
    a, b = _hidden(model, model.cfg, PROMPT, torch.float32), _hidden(native, native.cfg, PROMPT, torch.float32)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the output layer: Q8_0 blocks (dense) against int8 per channel (native): close, not equal
    a, b = model.logits(a), native.logits(b)
    assert (a - b).abs().mean() < 0.01 * a.abs().mean()


def test_gguf_q8_0_tensors_run_natively_in_bfloat16_and_dense_in_float32(tmp_path: Path) -> None:
    import test_gguf

    model = test_gguf._tiny_model(tied=True)
    test_gguf._write_gguf(model, tmp_path / "t.gguf", Q80)
    folder = convert_gguf_to_hf(tmp_path / "t.gguf", tmp_path / "hf", dtype=torch.float32)
    index = json.loads((folder / INT4_INDEX).read_text())
    assert set(index["kinds"].values()) == {"q8g"} and not index["int4"]  # Q8_0: the w8a8 kernel's general form
    dense, _ = load_target(folder, torch.float32, torch.device("cpu"), 64, quantization="auto")
    assert dense.quantization == "none"  # float32, the reference mode: dense