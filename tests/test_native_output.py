"""A GGUF output layer runs in its own type, exactly, and a tied vocabulary matrix is held once
(models/native_embed.py's output_layer and NativeOutputLinear, models/native_load.py, models/packed_cache.py).

The output layer of each vocabulary type (random valid blocks, test_gguf_kquants' writer; 100 and 261
rows, not whole panels of 16) gives float32 logits equal to x @ W.T of gguf-py's dequantised values
within float32 summation, for activations the kernels' int8 rounding keeps exactly (the Q8_0-rule
requantisation it replaced misses that bound); its rows are row-count invariant. Tiny GGUFs, tied and
untied, load with the output layer in its type and, tied, the embedding looking its rows up in the
output layer's own module: one set of tensors, kept as one by the packed layouts' cache. A grammar's
masked step still works where the output layer computes whole rows only.
"""
from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from test_gguf_kquants import blocks, reference
from test_native_embed import dense_embedding, folder_for, root, rows_of, same_bits, shared_table  # noqa: F401

from augury.cpu import kernels as cpu_kernels
from augury.models import gguf_blocks, native, packed_cache
from augury.models.native_embed import NativeOutputLinear, PackedEmbedding, output_layer
from augury.models.quant import PACKED_PREFIX, W8A8OutputLinear

QT = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(cpu_kernels.w4a8() is None or cpu_kernels.w8a8() is None,
                                reason="augury's CPU kernels do not run here")
CPU = torch.device("cpu")
# the module each type's output layer runs on: its panels as they are (Q8_0, Q5_0), else its native linear
INNER = {QT.Q6_K: native.W6KLinear, QT.Q4_K: native.W4KLinear, QT.Q5_K: native.W4KLinear, QT.Q5_1: native.W8GLinear}


def exact_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """x [m, k] bfloat16 the kernels' rounding to int8 per group of 32 keeps exactly: each group
    integers -127..127 (one of them +-127) times a power of two."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (m, k // 32, 32), generator=g)
    q[..., 0] = torch.where(torch.rand(m, k // 32, generator=g) < 0.5, -127, 127)
    e = torch.randint(-9, 1, (m, k // 32, 1), generator=g).float()
    return (q.float() * torch.exp2(e)).view(m, k).to(torch.bfloat16)


def check_logits(got: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> None:
    """got = x @ w.T within float32 summation of a float64 reference (a few float32 steps of the terms)."""
    wt = torch.from_numpy(w).double()
    ref = x.double() @ wt.t()
    tol = 2e-6 * (x.double().abs() @ wt.abs().t()) + 1e-6
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert ((got.double() - ref).abs() <= tol).all(), float((got.double() - ref).abs().max())


def unique_bytes(*modules: torch.nn.Module) -> int:
    """The bytes of the distinct storages the modules' tensors live in."""
    seen: dict[int, int] = {}
    for m in modules:
        for t in (*m.buffers(), *m.parameters()):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("qtype", [QT.Q6_K, QT.Q4_K, QT.Q5_K, QT.Q8_0, QT.Q5_0, QT.Q5_1], ids=lambda t: t.name)
def test_the_output_layer_multiplies_the_formats_own_values(qtype) -> None:
    n, k = 100, 512
    raw = blocks(qtype, n, k, seed=20 + int(qtype))
    want = reference(raw, qtype)  # gguf-py's dequantised values
    kind, parts = gguf_blocks.decode(raw, qtype)
    out = output_layer(kind, rows_of({key: torch.from_numpy(v) for key, v in parts.items()}), n, torch.bfloat16, CPU)
    if qtype in INNER:
        assert isinstance(out, NativeOutputLinear) and isinstance(out.inner, INNER[qtype])
        assert out.inner.out_features == 112 and not hasattr(out, "columns")
    else:
        assert isinstance(out, W8A8OutputLinear)
    assert (out.out_features, out.in_features) == (n, k)
    assert torch.equal(out.weight, torch.from_numpy(want))  # the format's values, float32, exactly
    x = exact_activations(9, k, seed=int(qtype))
    got = out(x)
    check_logits(got, x, want)
    # rows are row-count invariant: each alone and other groupings give the same bits; any leading shape
    assert torch.equal(torch.cat([out(x[i:i + 1]) for i in range(9)]), got)
    assert torch.equal(torch.cat([out(x[:4]), out(x[4:])]), got)
    assert torch.equal(out(x[:8].view(2, 4, k)), got[:8].view(2, 4, n))
    if qtype in (QT.Q6_K, QT.Q4_K):  # what it replaced, Q8_0's rule over these values, misses the bound
        old = W8A8OutputLinear(torch.from_numpy(want), cpu_kernels.w8a8())
        with pytest.raises(AssertionError):
            check_logits(old(x), x, want)


# (vocabulary type, tied, the untied output layer's type)
LOADS = [(QT.Q6_K, True, None), (QT.Q4_K, True, None), (QT.Q5_K, True, None), (QT.Q8_0, True, None),
         (QT.Q8_0, False, QT.Q6_K), (QT.Q4_K, False, QT.Q5_K), (QT.Q6_K, False, QT.Q4_K), (QT.Q4_K, False, QT.Q8_0)]


def gguf_values(folder, name: str) -> np.ndarray:
    """gguf-py's dequantised values of tensor `name` in the GGUF file `folder` was converted from."""
    reader = gguf.GGUFReader(str(folder.parent / f"{folder.name}.gguf"))
    t = next(t for t in reader.tensors if t.name == name)
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


@pytest.mark.parametrize("qtype,tied,output", LOADS,
                         ids=lambda c: getattr(c, "name", {True: "tied", False: "untied", None: "-"}.get(c)))
def test_a_load_runs_the_output_layer_in_its_type_and_a_tied_matrix_once(root, qtype, tied, output) -> None:
    from augury.models.loader import load_target

    folder = folder_for(root, qtype, tied, output or QT.Q6_K)
    for old in folder.glob(f"{PACKED_PREFIX}*"):
        old.unlink()
    head_type = qtype if tied else output
    want = gguf_values(folder, "token_embd.weight" if tied else "output.weight")
    assert want.shape == (261, 256) and np.unique(want).size > 1000

    def check(model) -> torch.Tensor:
        head, emb = model.lm_head, model.embed_tokens
        if head_type in INNER:
            assert isinstance(head, NativeOutputLinear) and isinstance(head.inner, INNER[head_type])
        else:
            assert isinstance(head, W8A8OutputLinear)
        assert isinstance(emb, PackedEmbedding)
        x = exact_activations(5, 256, seed=3)
        logits = model.logits(x)
        check_logits(logits, x, want)
        assert torch.equal(torch.cat([model.logits(x[i:i + 1]) for i in range(5)]), logits)
        table = shared_table(model)
        if tied:  # the embedding's rows come from the output layer's own tensors: nothing of its own
            assert emb.table is table
            assert unique_bytes(emb, head) == unique_bytes(head) == unique_bytes(table)
            assert unique_bytes(head) < 0.6 * want.size * 2  # packed: under the dense bfloat16's 2 bytes a weight
        else:
            assert emb.table is not table
            assert unique_bytes(emb, head) == unique_bytes(emb) + unique_bytes(head)
        assert same_bits(emb(torch.arange(261)), dense_embedding(folder))
        return logits

    first = check(load_target(folder, torch.bfloat16, CPU, 64, quantization="auto")[0])
    (kept,) = folder.glob(f"{PACKED_PREFIX}*.safetensors")
    with safe_open(str(kept), framework="pt") as f:
        names = list(f.keys())
    # the cache holds the shared tensors once, under the path it met them first
    assert any(n.startswith("embed_tokens.") for n in names)
    assert any(n.startswith("lm_head.") for n in names) != tied
    second = check(load_target(folder, torch.bfloat16, CPU, 64, quantization="auto")[0])  # from the cache
    assert torch.equal(first, second)


def test_a_cache_file_that_names_a_module_not_read_yet_is_dropped(root, caplog) -> None:
    """A "same_as" entry must point at a module already rebuilt: otherwise the file is unreadable (dropped,
    packed afresh), never half-restored."""
    import json

    from augury.models.checkpoint import TensorFile, TensorWriter
    from augury.models.loader import load_target

    folder = folder_for(root, QT.Q6_K, True)
    for old in folder.glob(f"{PACKED_PREFIX}*"):
        old.unlink()
    load_target(folder, torch.bfloat16, CPU, 64, quantization="auto")
    (kept,) = folder.glob(f"{PACKED_PREFIX}*.safetensors")
    key = kept.name.removeprefix(PACKED_PREFIX).split(".")[0]
    modules, _ = packed_cache.load(folder, key)
    assert modules["lm_head"].inner is modules["embed_tokens"].table
    with TensorFile(kept) as f:
        meta = dict(f.metadata)
        tensors = {n: f.get_tensor(n).clone() for n in f.keys()}
    desc = json.loads(meta["modules"])
    desc = {"lm_head": {**desc["lm_head"], "children": {"inner": {"same_as": "nowhere"}}},
            **{k: v for k, v in desc.items() if k != "lm_head"}}
    meta["modules"] = json.dumps(desc)
    writer = TensorWriter(kept, list(tensors), meta)
    for n, t in tensors.items():
        writer.add(n, t)
    writer.close()
    with caplog.at_level("WARNING"):
        assert packed_cache.load(folder, key) is None
    assert any("unreadable" in r.getMessage() for r in caplog.records) and not kept.exists()


def test_a_grammar_step_takes_whole_rows_from_a_native_output_layer(root) -> None:
    """masked_logits declines for a NativeOutputLinear (no chosen-columns kernel for Q6_K): the engine
    then masks whole rows; the text follows the grammar and greedy speculation gives plain's tokens. A
    tied Q8_0 output layer, shared with the embedding, still computes chosen columns, the bits of its
    whole rows."""
    from augury import LLM, SamplingParams
    from augury.sampling_params import StructuredOutputsParams as SO

    pattern = r"[a-e]{3,8}-[0-9]{2}"
    params = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=SO(regex=pattern))
    common = dict(dtype="bfloat16", quantization="auto", log_stats_interval=0)
    folder = folder_for(root, QT.Q6_K, True)
    plain = LLM(str(folder), speculative_algorithm="none", **common)
    model = plain.engine.model
    assert isinstance(model.lm_head, NativeOutputLinear)
    assert model.masked_logits(torch.zeros(1, 256, dtype=torch.bfloat16), [np.array([3, 4])]) is None
    prompts = [[5, 17, 33, 40], [9, 9, 9]]
    want = plain.generate(prompts, params, use_tqdm=False)
    assert plain.engine._masked_logits is False  # declined once, whole rows since
    for o in want:
        assert re.fullmatch(pattern, o.text), o.text
    spec = LLM(str(folder), speculative_algorithm="ngram", **common)
    assert [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == [o.token_ids for o in want]

    q8 = LLM(str(folder_for(root, QT.Q8_0, True)), speculative_algorithm="none", **common).engine.model
    assert isinstance(q8.lm_head, W8A8OutputLinear) and q8.embed_tokens.table is q8.lm_head
    h = exact_activations(2, 256, seed=5)
    allowed = [np.array([0, 15, 16, 260]), np.array([7])]
    masked = q8.masked_logits(h, allowed)
    whole = q8.logits(h)
    for a, ids in enumerate(allowed):
        assert torch.equal(masked[a, ids], whole[a, ids])
        assert torch.isinf(masked[a]).sum() == 261 - len(ids)
