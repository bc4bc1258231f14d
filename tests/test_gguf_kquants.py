"""GGUF K-quants, Q8_0 and Q5_0/Q5_1 run natively (models/gguf_blocks.py, models/native.py).

Each type's blocks (gguf-py's quantiser for the legacy types, Q4_0 among them; random valid blocks, random bytes
with sane float16 super-block scales, for the K-quants gguf-py cannot quantise) decode to exactly
gguf-py's dequantised values, the kernels multiply those values (against activations rounded to
int8 per group of 32, as every augury kernel) within float32 summation of a float64 reference,
rows are row-count invariant and every ISA level this CPU has gives the AVX2 level's bits; a tiny
model written as a Q4_K_M-like mix loads with every linear native and greedy speculative output
equals plain greedy output.
"""
from __future__ import annotations


import gguf
import numpy as np
import pytest
import torch

from augury.cpu import build, isa
from augury.cpu import kernels as cpu_kernels
from augury.models import gguf_blocks, native
from augury.models.quant import Int4Linear

QT = gguf.GGMLQuantizationType
TYPES = [QT.Q8_0, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K]
# byte ranges of the float16 super-block scales (the rest of a K-quant block is valid whatever its bits)
F16_FIELDS = {QT.Q4_K: [(0, 2), (2, 4)], QT.Q5_K: [(0, 2), (2, 4)], QT.Q6_K: [(208, 210)]}

needs_kernels = pytest.mark.skipif(cpu_kernels.w4a8() is None or cpu_kernels.w8a8() is None,
                                   reason="augury's CPU kernels do not run here")


def blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A [rows, cols] tensor of `qtype` as GGUF blocks, uint8 [rows, cols / block, block bytes]."""
    rng = np.random.default_rng(seed)
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype not in F16_FIELDS:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype).reshape(
            rows, cols // per, size)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for a, b in F16_FIELDS[qtype]:
        raw[..., a:b] = rng.uniform(-0.05, 0.05, (rows, cols // per)).astype(np.float16)[..., None].view(np.uint8)
    return raw


def reference(raw: np.ndarray, qtype: QT) -> np.ndarray:
    rows = raw.shape[0]
    return np.asarray(gguf.quants.dequantize(raw.reshape(rows, -1), qtype), dtype=np.float32).reshape(rows, -1)


def module(raw: np.ndarray, qtype: QT) -> torch.nn.Module:
    if qtype == QT.Q4_0:  # the legacy 4-bit types' side-file parts (models/gguf.py)
        from augury.models.gguf import _repack_q4
        from augury.models.quant import unpack_codes

        p = {k: torch.from_numpy(v) for k, v in _repack_q4(qtype, raw.reshape(raw.shape[0], -1)).items()}
        m = native.build(["int4"], [{**p, "codes": unpack_codes(p["codes"])}], None, torch.bfloat16,
                         torch.device("cpu"))
        assert m is not None
        return m
    kind, parts = gguf_blocks.decode(raw, qtype)
    m = native.build([kind], [{k: torch.from_numpy(v) for k, v in parts.items()}], None, torch.bfloat16,
                     torch.device("cpu"))
    assert m is not None
    return m


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it, float64: rounded to int8 per row and group of 32 (scale max|x| / 127)."""
    m, k = x.shape
    xf = x.float().view(m, k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # a true division
    return (torch.round(xf * inv).double() * (amax / 127.0).double()).view(m, k)


def kernel_out(m: torch.nn.Module, x: torch.Tensor, kernels=None) -> torch.Tensor:
    """The module's kernel in float32 (no output rounding), optionally another build's kernels (w4, w8)."""
    w4, w8 = kernels or (cpu_kernels.w4a8(), cpu_kernels.w8a8())
    if isinstance(m, native.W4KLinear):
        return w4.linear_k(x, m.codes, m.sm, m.dd, m.high, out_dtype=torch.float32)
    if isinstance(m, native.W6KLinear):
        return w8.linear6(x, m.codes, m.d, m.sub, out_dtype=torch.float32)
    if isinstance(m, native.W4FLinear):
        return w4.linear(x, m.codes, m.scale, m.zero, out_dtype=torch.float32)
    if isinstance(m, native.W40Linear):
        return w4.linear40(x, m.codes, m.d, out_dtype=torch.float32)
    return w8.linear_general(x, m.codes, m.scale, m.zero, m.sub, out_dtype=torch.float32)


def same_bits(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> bool:
    a, b = torch.as_tensor(a).float().contiguous(), torch.as_tensor(b).float().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decoded_values_are_gguf_py_dequantize_to_the_bit(qtype) -> None:
    raw = blocks(qtype, 5, 512, seed=int(qtype))
    want = reference(raw, qtype)
    assert np.isfinite(want).all() and np.unique(want).size > 512  # not degenerate
    kind, parts = gguf_blocks.decode(raw, qtype)
    assert kind == {QT.Q4_K: "q4k", QT.Q5_K: "q5k", QT.Q6_K: "q6k"}.get(qtype, "q8g")
    assert same_bits(gguf_blocks.values(parts), want)


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_native_linear_holds_the_values_and_its_kernel_multiplies_them(qtype) -> None:
    raw = blocks(qtype, 48, 512, seed=3 + int(qtype))
    want = reference(raw, qtype)
    m = module(raw, qtype)
    assert isinstance(m, {QT.Q4_K: native.W4KLinear, QT.Q5_K: native.W4KLinear,
                          QT.Q6_K: native.W6KLinear}.get(qtype, native.W8GLinear))
    assert same_bits(m.dequantize(), want)  # packed and unpacked: the format's values exactly
    x = (torch.randn(9, 512, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    x[2, :32] = 0.0  # an all-zero group
    got = kernel_out(m, x).double()
    xt = rounded_activations(x)
    ref = xt @ torch.from_numpy(want).double().t()
    # float32 sums of exact integer dot products, scaled: a few float32 steps of the terms' magnitude
    tol = 2e-6 * (xt.abs() @ torch.from_numpy(want).double().abs().t()) + 1e-6
    assert ((got - ref).abs() <= tol).all(), float((got - ref).abs().max())
    # rows are row-count invariant: each alone, and in other groupings, gives the same bits
    alone = torch.cat([kernel_out(m, x[i:i + 1]) for i in range(9)])
    assert torch.equal(alone, got.float())
    assert torch.equal(torch.cat([kernel_out(m, x[:5]), kernel_out(m, x[5:])]), got.float())
    # the module's forward: the kernel's sum rounded once to bfloat16
    assert torch.equal(m(x), got.float().to(torch.bfloat16))


@needs_kernels
def test_q4_0_runs_in_its_own_float16_scales() -> None:
    """A Q4_0 tensor on W40Linear: d float16 per 32 and no zero (4.5 bits a weight, as the file: the
    bfloat16 int4 linear took 5 and rounded d), gguf-py's values to the bit, the kernel multiplying them,
    rows row-count invariant, the module's forward the kernel's sum rounded once."""
    raw = blocks(QT.Q4_0, 48, 512, seed=21)
    want = reference(raw, QT.Q4_0)
    m = module(raw, QT.Q4_0)
    assert isinstance(m, native.W40Linear)
    assert sum(t.numel() * t.element_size() for t in m.buffers()) * 8 / (48 * 512) == 4.5
    assert same_bits(m.dequantize(), want)
    # d with more significant bits than bfloat16 holds: the bfloat16 form could not give these values
    d = m.d.float()
    assert not torch.equal(d.to(torch.bfloat16).float(), d)
    x = (torch.randn(9, 512, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    x[3, 32:64] = 0.0
    got = kernel_out(m, x).double()
    xt = rounded_activations(x)
    ref = xt @ torch.from_numpy(want).double().t()
    tol = 2e-6 * (xt.abs() @ torch.from_numpy(want).double().abs().t()) + 1e-6
    assert ((got - ref).abs() <= tol).all(), float((got - ref).abs().max())
    assert torch.equal(torch.cat([kernel_out(m, x[i:i + 1]) for i in range(9)]), got.float())
    assert torch.equal(m(x), got.float().to(torch.bfloat16))


@needs_kernels
def test_mixed_parts_take_the_narrowest_exact_kind() -> None:
    """q|k|v with q, k in Q4_K and v in Q6_K (a Q4_K_M layer): one W8GLinear holding every part's
    values exactly; Q4_K with Q4_0 one W4FLinear; Q4_0 with Q4_1 the int4 linear as before."""
    def parts(qtype: QT, rows: int, seed: int):
        if qtype in (QT.Q4_0, QT.Q4_1):
            from augury.models.gguf import _repack_q4

            data = gguf.quants.quantize(np.random.default_rng(seed).standard_normal((rows, 256)).astype(np.float32),
                                        qtype)  # [rows, row bytes], as a reader's tensor holds them
            p = {k: torch.from_numpy(v) for k, v in _repack_q4(qtype, data).items()}
            from augury.models.quant import unpack_codes
            return "int4", {**p, "codes": unpack_codes(p["codes"])}, reference(data.reshape(rows, 8, -1), qtype)
        raw = blocks(qtype, rows, 256, seed)
        kind, p = gguf_blocks.decode(raw, qtype)
        p = {k: torch.from_numpy(v) for k, v in p.items()}
        return kind, p, reference(raw, qtype)

    cpu = torch.device("cpu")
    mix = [parts(QT.Q4_K, 32, 1), parts(QT.Q4_K, 16, 2), parts(QT.Q6_K, 16, 3)]
    m = native.build([k for k, _, _ in mix], [p for _, p, _ in mix], None, torch.bfloat16, cpu)
    # each run of one kind on its own kernel: q|k (48 rows) Q4_K, v (16) Q6_K
    assert isinstance(m, native.SegmentedLinear) and [type(p) for p in m.parts] == [native.W4KLinear,
                                                                                    native.W6KLinear]
    assert same_bits(m.dequantize(), np.concatenate([r for _, _, r in mix]))
    x = (torch.randn(5, 256, generator=torch.Generator().manual_seed(4)) * 2).to(torch.bfloat16)
    assert torch.equal(m(x), torch.cat([kernel_out(p, x) for p in m.parts], 1).to(torch.bfloat16))
    # where a run is not whole panels of 16 rows, the narrowest single kind holding every value
    mix = [parts(QT.Q4_K, 24, 1), parts(QT.Q6_K, 8, 3)]
    m = native.build([k for k, _, _ in mix], [p for _, p, _ in mix], None, torch.bfloat16, cpu)
    assert isinstance(m, native.W8GLinear) and m.sub is not None and m.zero is not None
    # equal values (Q6_K's -0.0 becomes 0.0 once a zero of 0 is added: the same number to the kernel)
    assert torch.equal(m.dequantize(), torch.from_numpy(np.concatenate([r for _, _, r in mix])))
    mix = [parts(QT.Q4_K, 32, 4), parts(QT.Q4_K, 16, 8)]
    m = native.build([k for k, _, _ in mix], [p for _, p, _ in mix], None, torch.bfloat16, cpu)
    assert isinstance(m, native.W4KLinear)
    assert same_bits(m.dequantize(), np.concatenate([r for _, _, r in mix]))
    mix = [parts(QT.Q4_K, 24, 4), parts(QT.Q4_0, 8, 5)]
    m = native.build([k for k, _, _ in mix], [p for _, p, _ in mix], None, torch.bfloat16, cpu)
    assert isinstance(m, native.W4FLinear)
    assert torch.equal(m.dequantize(), torch.from_numpy(np.concatenate([r for _, _, r in mix])))
    mix = [parts(QT.Q4_0, 16, 6), parts(QT.Q4_1, 16, 7)]
    assert isinstance(native.build([k for k, _, _ in mix], [p for _, p, _ in mix], None, torch.bfloat16, cpu),
                      Int4Linear)
    both = [mix[0], parts(QT.Q4_0, 32, 9)]  # Q4_0 alone: its own float16 d, exactly
    m = native.build([k for k, _, _ in both], [p for _, p, _ in both], None, torch.bfloat16, cpu)
    assert isinstance(m, native.W40Linear)
    assert same_bits(m.dequantize(), np.concatenate([r for _, _, r in both]))
    assert native.build(["int4", "dense"], [mix[0][1], mix[1][1]], None, torch.bfloat16, cpu) is None


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda t: t.name)
def test_k_quants_in_their_own_scales_give_the_float_forms_bits(qtype) -> None:
    """W4KLinear computes d sc and -dmin m in the kernel, W6KLinear rebuilds Q6_K's six-bit codes in
    registers; W4FLinear (Q4_K) and W8GLinear (Q5_K, Q6_K as int8 codes) read them precomputed: the same
    numbers and integer sums, so the same bits, at 4.625 (Q4_K), 5.625 (Q5_K) or 6.5625 (Q6_K) bits a
    weight against 6, 10 and 9.5."""
    kind, p = gguf_blocks.decode(blocks(qtype, 64, 768, seed=11), qtype)
    p = {k: torch.from_numpy(v) for k, v in p.items()}
    k4 = native.build([kind], [p], None, torch.bfloat16, torch.device("cpu"))
    if qtype == QT.Q4_K:
        q = native._as_q4f(kind, p)
        wide = native.W4FLinear(q["codes"], q["scale"], q["zero"], None)
    else:
        q = native._as_q8g(kind, p)
        wide = native.W8GLinear(q["codes"], q["scale"], q.get("zero"), q.get("sub"), None)
    if qtype == QT.Q6_K:
        assert isinstance(k4, native.W6KLinear)
    else:
        assert isinstance(k4, native.W4KLinear) and (k4.high is None) == (qtype == QT.Q4_K)
    bits = sum(t.numel() * t.element_size() for t in k4.buffers()) * 8 / (64 * 768)
    assert bits == {QT.Q4_K: 4.625, QT.Q5_K: 5.625, QT.Q6_K: 6.5625}[qtype]
    x = (torch.randn(7, 768, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    assert torch.equal(kernel_out(k4, x), kernel_out(wide, x))


_LEVELS = [lv for lv in isa.LEVELS[1:] if isa.allowed_on_host(lv)]


@needs_kernels
@pytest.mark.skipif(not _LEVELS, reason="this CPU runs only the avx2 level")
def test_every_isa_level_gives_the_avx2_bits() -> None:
    mods = [module(blocks(qt, 48, 512, seed=7 + i), qt) for i, qt in enumerate([*TYPES, QT.Q4_0])]
    x = (torch.randn(13, 512, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    outs = {}
    for lv in ("avx2", *_LEVELS):
        ks = (cpu_kernels.W4A8(build.build("w4a8", lv)), cpu_kernels.W8A8(build.build("w8a8", lv)))
        outs[lv] = [kernel_out(m, x[a:b], ks) for m in mods for a, b in ((0, 13), (0, 1), (1, 6))]
    for lv in _LEVELS:
        for a, b in zip(outs["avx2"], outs[lv]):
            assert torch.equal(a, b), lv


# ---- a whole model in a Q4_K_M-like mix --------------------------------------------------------


@pytest.fixture(scope="module")
def kquant_folder(tmp_path_factory):
    """A tiny llama (hidden 256: K-quant blocks are 256 wide) as a Q4_K_M file mixes types: Q4_K
    everywhere, Q6_K for attn_v and ffn_down in layer 0 and for the output layer, Q5_K and Q8_0 and
    Q5_0 / Q5_1 for layer 1's v, down, gate and up, so every kind and every mixed q|k|v occurs."""
    import test_gguf

    from augury.models.gguf import convert_gguf_to_hf

    root = tmp_path_factory.mktemp("kquant")
    model = test_gguf._wide_model()
    with torch.no_grad():  # small weights: the random blocks' values replace them anyway
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    types = {"blk.0.attn_v": QT.Q6_K, "blk.0.ffn_down": QT.Q6_K, "output": QT.Q6_K, "token_embd": QT.Q8_0,
             "blk.1.attn_v": QT.Q5_K, "blk.1.ffn_down": QT.Q8_0, "blk.1.ffn_gate": QT.Q5_0, "blk.1.ffn_up": QT.Q5_1}
    real_add = gguf.GGUFWriter.add_tensor
    count = [0]

    def add_tensor(self, name, array, *args, raw_dtype=None, **kwargs):
        if raw_dtype is None and array.ndim == 2 and array.dtype == np.float32:
            qt = types.get(name.removesuffix(".weight"), QT.Q4_K)
            count[0] += 1
            raw = blocks(qt, *array.shape, seed=count[0])
            if qt in F16_FIELDS:  # keep the random model's scale: d about 0.02 / 32 per step
                for a, b in F16_FIELDS[qt]:
                    f = raw[..., a:b].copy().view(np.float16) * np.float16(0.02)
                    raw[..., a:b] = f.view(np.uint8)
            else:
                raw = gguf.quants.quantize(array * 0.5, qt).reshape(raw.shape)
            return real_add(self, name, raw.reshape(array.shape[0], -1), raw_dtype=qt)
        return real_add(self, name, array, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    try:
        test_gguf._write_gguf(model, root / "mix.gguf", QT.F32)
    finally:
        mp.undo()
    return convert_gguf_to_hf(root / "mix.gguf", root / "hf", dtype=torch.bfloat16)


@needs_kernels
def test_a_q4_k_m_like_file_runs_every_linear_natively_and_fused(kquant_folder, caplog) -> None:
    from augury.models.fused import FusedStack
    from augury.models.loader import load_target
    from augury.models.native_embed import NativeOutputLinear

    with caplog.at_level("WARNING"):
        model, _ = load_target(kquant_folder, torch.bfloat16, torch.device("cpu"), 64, quantization="auto")
    assert not any("running dense" in r.getMessage() for r in caplog.records)
    l0, l1 = model.layers
    qkv = l0.self_attn.qkv_proj  # q|k in Q4_K, v in Q6_K: each on its own kernel
    assert isinstance(qkv, native.SegmentedLinear) and [type(p) for p in qkv.parts] == [native.W4KLinear,
                                                                                        native.W6KLinear]
    assert isinstance(l1.self_attn.qkv_proj, native.W4KLinear) and l1.self_attn.qkv_proj.high is not None  # Q4_K + Q5_K
    assert isinstance(l0.mlp.gate_up_proj, native.W4KLinear) and isinstance(l0.self_attn.o_proj, native.W4KLinear)
    assert isinstance(l1.mlp.gate_up_proj, native.W8GLinear) and l1.mlp.gate_up_proj.zero is not None  # Q5_0 + Q5_1
    assert isinstance(l0.mlp.down_proj, native.W6KLinear) and isinstance(l1.mlp.down_proj, native.W8GLinear)
    assert isinstance(model.lm_head, NativeOutputLinear) and isinstance(model.lm_head.inner, native.W6KLinear)  # exact
    assert FusedStack.build(model) is not None  # the whole stack in one call, every kind in its table


@needs_kernels
def test_unsupported_types_run_dense_with_one_line(kquant_folder, tmp_path, caplog) -> None:
    import json
    import shutil

    from augury.models.loader import load_target

    folder = tmp_path / "hf"
    shutil.copytree(kquant_folder, folder)
    index = json.loads((folder / "augury-quant.json").read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    del index["kinds"][name]  # as an IQ type would be: no native kind
    index["source_types"][name] = "IQ4_XS"
    (folder / "augury-quant.json").write_text(json.dumps(index))
    with caplog.at_level("WARNING"):
        model, _ = load_target(folder, torch.bfloat16, torch.device("cpu"), 64, quantization="auto")
    lines = [r.getMessage() for r in caplog.records if "running dense" in r.getMessage()]
    assert len(lines) == 1 and "layers.1.mlp.down_proj (IQ4_XS)" in lines[0]
    assert not isinstance(model.layers[1].mlp.down_proj, (native.W8GLinear, native.W4FLinear))


@needs_kernels
def test_the_fused_stack_gives_the_layers_bits_on_the_mix(kquant_folder) -> None:
    """Every kind in forward.cpp's table (segments included): tokens and log-probabilities equal the
    layer-by-layer forward's exactly."""
    from augury import LLM, SamplingParams
    from augury.models import fused

    llm = LLM(str(kquant_folder), dtype="bfloat16", quantization="auto", speculative_algorithm="none",
              log_stats_interval=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (3 + 4 * i,), generator=g).tolist() for i in range(3)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in (9, 6, 11)]

    def generate(layers: bool):
        llm.engine.model._fused = False if layers else None
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.logprobs]) for o in outs]

    want = generate(layers=True)
    got = generate(layers=False)
    assert isinstance(llm.engine.model._fused, fused.FusedStack)
    assert got == want


@needs_kernels
def test_greedy_speculative_equals_plain_on_the_mix(kquant_folder) -> None:
    from augury import LLM, SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (24, 17, 30)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (4 + 5 * i,), generator=g).tolist() for i in range(3)]
    common = dict(dtype="bfloat16", quantization="auto", log_stats_interval=0)
    plain = LLM(str(kquant_folder), speculative_algorithm="none", **common)
    assert isinstance(plain.engine.model.layers[0].mlp.gate_up_proj, native.W4KLinear)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(str(kquant_folder), speculative_algorithm="ngram", **common)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == want
    assert len({t for ids in want for t in ids}) > 3  # not a constant answer
