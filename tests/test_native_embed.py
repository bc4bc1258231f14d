"""A GGUF token embedding stays in its GGUF type (models/native_embed.py, models/native_load.py).

Tiny random GGUFs (test_gguf's writer) with token_embd in Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K,
tied and untied, converted and loaded through the real loader: the embedding is a PackedEmbedding and
its rows (ids repeated, across panels of 16, in a 2-D batch) are the dense bfloat16 embedding the same
conversion wrote, bit for bit; greedy tokens and log-probabilities equal those of the same engine with
that dense embedding put back; no step reads the whole table; and the EAGLE-3 head kernel given a packed
embedding computes the bits it computes from the dense one.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

import test_gguf
from augury.cpu import kernels as cpu_kernels
from augury.models import gguf_blocks, native, native_embed
from augury.models.native_embed import PackedEmbedding
from augury.models.quant import W8A8OutputLinear

QT = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(cpu_kernels.w4a8() is None or cpu_kernels.w8a8() is None,
                                reason="augury's CPU kernels do not run here")
CPU = torch.device("cpu")
# (token_embd type, tied): tied files keep their output layer in token_embd's type, as llama.cpp does
CASES = [(QT.Q4_0, False), (QT.Q4_1, False), (QT.Q5_0, False), (QT.Q8_0, True), (QT.Q4_K, False),
         (QT.Q5_K, False), (QT.Q6_K, True), (QT.Q4_K, True), (QT.Q5_K, True)]
TABLE = {QT.Q4_0: native.W40Linear, QT.Q4_1: native.W4FLinear, QT.Q5_0: native.W8GLinear,
         QT.Q8_0: native.W8GLinear, QT.Q4_K: native.W4KLinear, QT.Q5_K: native.W4KLinear,
         QT.Q6_K: native.W6KLinear}


def _model(tied: bool) -> LlamaForCausalLM:
    """test_gguf's wide model (hidden 256: K-quant blocks), tied or not; vocabulary 261, not whole panels."""
    torch.manual_seed(0)
    n = len(test_gguf._tokens()[0])
    config = LlamaConfig(vocab_size=n, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=n - 2, eos_token_id=n - 1,
                         initializer_range=0.1)  # layers that matter beside the embedding
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


_FOLDERS: dict = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("native-embed")


def folder_for(root, qtype: QT, tied: bool, output: QT = QT.Q6_K):
    """The conversion of a file with token_embd in `qtype` (the output layer too where tied; `output`
    where not), its layers in Q8_0 (one per case, made once)."""
    from augury.models.gguf import convert_gguf_to_hf

    key = (qtype, tied, None if tied else output)
    if key not in _FOLDERS:
        name = f"{qtype.name}-{'tied' if tied else 'untied'}" + ("" if tied or output == QT.Q6_K else f"-{output.name}")
        types = {"token_embd": qtype, "output": output}
        real = test_gguf._quantized

        def quantized(qtype, array, seed=0):  # K-quants: random blocks, scaled to the model's weights
            raw = real(qtype, array, seed)
            if qtype in test_gguf._F16_FIELDS:
                blocks = raw.reshape(array.shape[0], -1, gguf.GGML_QUANT_SIZES[qtype][1])
                for a, b in test_gguf._F16_FIELDS[qtype]:
                    f = blocks[..., a:b].copy().view(np.float16) * np.float16(0.01 if qtype == QT.Q6_K else 0.05)
                    blocks[..., a:b] = f.view(np.uint8)
            return raw

        with pytest.MonkeyPatch.context() as mp:  # Q5_K's random blocks as Q4_K's: its d, dmin first
            mp.setitem(test_gguf._F16_FIELDS, QT.Q5_K, [(0, 2), (2, 4)])
            mp.setattr(test_gguf, "_quantized", quantized)
            test_gguf._write_gguf(_model(tied), root / f"{name}.gguf", QT.Q8_0, tensor_types=types)
        _FOLDERS[key] = convert_gguf_to_hf(root / f"{name}.gguf", root / name, dtype=torch.bfloat16)
    return _FOLDERS[key]


def shared_table(model) -> torch.nn.Module:
    """The module a tied model's output layer holds its vocabulary matrix in."""
    head = model.lm_head
    return head if isinstance(head, W8A8OutputLinear) else head.inner


def dense_embedding(folder) -> torch.Tensor:
    """The bfloat16 embedding the conversion wrote (what the loader copied before)."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape and \
        torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def rows_of(part: dict[str, torch.Tensor]):
    """build()'s reader over parts in memory."""
    return lambda a, b: {k: v[a:b] for k, v in part.items()}


def ids_2d(vocab: int) -> torch.Tensor:
    """A [3, 9] batch of ids: repeats, both ends of the vocabulary, both sides of panel boundaries."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (3, 9), generator=g)
    ids[0, :6] = torch.tensor([0, 15, 16, 17, vocab - 1, 15])
    ids[1, 3] = ids[2, 5] = ids[0, 7]
    return ids


@pytest.mark.parametrize("qtype,tied", CASES, ids=lambda c: getattr(c, "name", {True: "tied", False: "untied"}.get(c)))
def test_the_embedding_loads_packed_and_its_rows_are_the_dense_ones(root, qtype, tied) -> None:
    from augury.models import packed_cache
    from augury.models.loader import load_target

    folder = folder_for(root, qtype, tied)
    for old in folder.glob(f"{packed_cache.PREFIX}*"):
        old.unlink()  # packed afresh by swap_in; a second load reads it back from the cache (below)
    model, cfg = load_target(folder, torch.bfloat16, CPU, 64, quantization="auto")
    emb = model.embed_tokens
    # tied: the output layer's own module (a Q8_0 output layer's w8a8 panels), one copy of the matrix
    assert isinstance(emb, PackedEmbedding) and (not tied or emb.table is shared_table(model))
    assert isinstance(emb.table, W8A8OutputLinear if (qtype, tied) == (QT.Q8_0, True) else TABLE[qtype])
    assert (emb.num_embeddings, emb.embedding_dim) == (cfg.vocab_size, cfg.hidden_size) == (261, 256)
    assert model.lm_head is not None  # tied: the output layer is built natively
    want = dense_embedding(folder)
    assert want.unique().numel() > 1000  # not degenerate
    ids = ids_2d(cfg.vocab_size)
    got = emb(ids)
    assert got.shape == (3, 9, 256) and got.dtype == torch.bfloat16
    expect = want[ids]
    assert same_bits(got, expect)
    assert same_bits(emb.weight, want)  # the whole table, a chunk of panels at a time
    assert same_bits(emb(ids[1]), expect[1]) and same_bits(emb(ids[2, 4]), expect[2, 4])  # 1-D, a lone id
    with pytest.raises(IndexError):
        emb(torch.tensor([cfg.vocab_size]))
    assert any(folder.glob(f"{packed_cache.PREFIX}*"))
    reloaded = load_target(folder, torch.bfloat16, CPU, 64, quantization="auto")[0]
    again = reloaded.embed_tokens
    assert isinstance(again, PackedEmbedding) and same_bits(again(ids), expect)
    assert not tied or again.table is shared_table(reloaded)
    # the packed table holds fewer bytes than the dense one's 2 a weight
    packed = sum(t.numel() * t.element_size() for t in emb.buffers())
    assert packed < 0.7 * want.numel() * 2


def test_ids_over_many_panels_take_several_chunks(root, monkeypatch) -> None:
    """More panels than one chunk's: each chunk's rows land where their ids are."""
    from augury.models import native_embed
    from augury.models.loader import load_target

    folder = folder_for(root, QT.Q6_K, True)
    model, _ = load_target(folder, torch.bfloat16, CPU, 64, quantization="auto")
    monkeypatch.setattr(native_embed, "PANELS_AT_ONCE", 3)
    ids = torch.randperm(261, generator=torch.Generator().manual_seed(1))[:120].repeat(2)
    assert same_bits(model.embed_tokens(ids), dense_embedding(folder)[ids])


def test_looked_up_rows_are_kept_and_the_oldest_dropped(root, monkeypatch) -> None:
    """Rows looked up are kept (KEPT_ROWS_BYTES; 5 rows here): a kept id is not dequantised again, the
    least recently used is dropped first, never one the lookup itself wants, and every lookup's rows
    are the dense table's; a lookup of more distinct ids than are kept is computed whole."""
    from augury.models.loader import load_target

    folder = folder_for(root, QT.Q6_K, True)
    emb = load_target(folder, torch.bfloat16, CPU, 64, quantization="auto")[0].embed_tokens
    want = dense_embedding(folder)
    computed: list[list[int]] = []
    rows = emb._rows
    monkeypatch.setattr(emb, "_rows", lambda ids: (computed.append(ids.tolist()), rows(ids))[1])
    emb._most = 5
    for ids, fresh in [([3, 40, 3], [3, 40]), ([40, 200], [200]), ([7, 8, 3], [7, 8]),
                       ([40, 9], [9]),  # oldest first 200, 3, 7, 8, 40: 200 dropped
                       ([3, 200], [200]),  # 3 still kept; 200 again (7 dropped)
                       ([1, 2, 4, 5, 6, 10], [1, 2, 4, 5, 6, 10])]:  # six distinct: computed whole
        computed.clear()
        got = emb(torch.tensor(ids))
        assert computed == [fresh] and same_bits(got, want[torch.tensor(ids)])
    assert list(emb._kept) == [8, 40, 9, 3, 200]


def test_a_tied_q8_0_tables_rows_come_in_parts(root, monkeypatch) -> None:
    """A tied Q8_0 output layer's rows are taken W8A8_ROWS_AT_ONCE at a time (the whole table for
    `weight`): the dense rows, bit for bit, across the parts' edges."""
    from augury.models.loader import load_target

    folder = folder_for(root, QT.Q8_0, True)
    emb = load_target(folder, torch.bfloat16, CPU, 64, quantization="auto")[0].embed_tokens
    assert isinstance(emb.table, W8A8OutputLinear)
    monkeypatch.setattr(native_embed, "W8A8_ROWS_AT_ONCE", 7)
    assert same_bits(emb.weight, dense_embedding(folder))


def test_kept_rows_serve_lookups_inside_and_outside_inference_mode(root) -> None:
    """The kept rows are first written inside torch.inference_mode (as the engine's steps run) and
    then outside it (a host application's own call), and the other way round: both write them."""
    from augury.models.loader import load_target

    folder = folder_for(root, QT.Q6_K, True)
    want = dense_embedding(folder)
    for first_inside in (True, False):
        emb = load_target(folder, torch.bfloat16, CPU, 64, quantization="auto")[0].embed_tokens
        for inside in (first_inside, not first_inside, first_inside):
            ids = torch.tensor([3, 40] if inside else [5, 41])
            with torch.inference_mode(inside):
                assert same_bits(emb(ids), want[ids])


def test_where_the_embedding_stays_dense(root) -> None:
    """float32, no kernel-side quantisation ("none"), and a tied Q4_0 output layer the int4 kernel cannot
    take (261 rows, not whole panels: it reads the embedding) keep the dense embedding."""
    from augury.models.loader import load_target

    folder = folder_for(root, QT.Q8_0, True)
    for dtype, mode in ((torch.float32, "int4"), (torch.bfloat16, "none")):
        model, _ = load_target(folder, dtype, CPU, 64, quantization=mode)
        assert type(model.embed_tokens) is torch.nn.Embedding
    model, _ = load_target(folder_for(root, QT.Q4_0, True), torch.bfloat16, CPU, 64, quantization="auto")
    assert type(model.embed_tokens) is torch.nn.Embedding and model.lm_head is None
    assert same_bits(model.embed_tokens.weight, dense_embedding(folder_for(root, QT.Q4_0, True)))


def test_the_loader_reads_no_dense_copy_of_a_packed_embedding(root, monkeypatch) -> None:
    """swap_in counts the embedding as covered: the loader copies nothing into it."""
    from augury.models import checkpoint
    from augury.models.loader import load_target

    read: list[str] = []
    real = checkpoint.Checkpoint.read_into

    def read_into(self, name, dest):
        read.append(name)
        return real(self, name, dest)

    monkeypatch.setattr(checkpoint.Checkpoint, "read_into", read_into)
    whole: list[int] = []
    monkeypatch.setattr(PackedEmbedding, "weight", property(lambda self: whole.append(1) or
                                                            self._rows(torch.arange(self.num_embeddings))))
    model, _ = load_target(folder_for(root, QT.Q5_K, False), torch.bfloat16, CPU, 64, quantization="auto")
    assert isinstance(model.embed_tokens, PackedEmbedding)
    assert "model.norm.weight" in read and "model.embed_tokens.weight" not in read
    assert not whole  # nor dequantised the whole table


@pytest.mark.parametrize("qtype,tied", [(QT.Q6_K, True), (QT.Q4_0, False)], ids=["q6_k-tied", "q4_0-untied"])
def test_generation_equals_the_dense_embeddings(root, qtype, tied, monkeypatch) -> None:
    """Greedy tokens and top log-probabilities, fused stack and layer by layer, packed against the dense
    embedding put back in the same engine; no step dequantises the whole table."""
    from augury import LLM, SamplingParams

    folder = folder_for(root, qtype, tied)
    llm = LLM(str(folder), dtype="bfloat16", quantization="auto", speculative_algorithm="none",
              enable_prefix_caching=False, log_stats_interval=0)
    model = llm.engine.model
    packed = model.embed_tokens
    assert isinstance(packed, PackedEmbedding)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 255, (3 + 7 * i,), generator=g).tolist() for i in range(3)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in (8, 5, 10)]

    def generate(fused: bool):
        model._fused = None if fused else False
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.logprobs]) for o in outs]

    def whole_table(self):
        raise AssertionError("a step read the whole packed embedding")

    with monkeypatch.context() as m:
        m.setattr(PackedEmbedding, "weight", property(whole_table))
        got = [generate(True), generate(False)]
    model.embed_tokens = torch.nn.Embedding.from_pretrained(dense_embedding(folder), freeze=True)
    with monkeypatch.context() as m:  # the engine looks its tokens up in the model's embedding of the moment
        m.setattr(PackedEmbedding, "forward", whole_table)
        want = [generate(True), generate(False)]
    assert got == want
    assert len({t for ids, _ in want[0] for t in ids}) > 3  # not a constant answer


def test_the_head_kernel_reads_a_packed_embeddings_rows(tmp_path) -> None:
    """The EAGLE-3 head kernel over a packed embedding (the rows looked up handed over as its table)
    gives the bits it gives over the same table dense."""
    from augury import LLM
    from augury.models.eagle3_fused import FusedHead
    from speculative_helpers import VOCAB, make_target, random_head

    llm = LLM(str(make_target(tmp_path / "target")), draft_model=str(random_head(tmp_path / "head", draft_vocab=256)),
              speculative_algorithm="eagle3", speculative_policy="static", dtype="bfloat16", quantization="int4",
              log_stats_interval=0)
    head = llm.engine.speculator.proposer.head
    dense_w = head.embed.weight.detach().float().numpy()  # [VOCAB, 64]
    raw = gguf.quants.quantize(dense_w, QT.Q8_0).reshape(VOCAB, 2, -1)
    kind, parts = gguf_blocks.decode(raw, QT.Q8_0)
    packed = PackedEmbedding.build(kind, rows_of({k: torch.from_numpy(v) for k, v in parts.items()}), VOCAB,
                                   torch.bfloat16, CPU)
    dense = torch.nn.Embedding.from_pretrained(packed.weight, freeze=True)
    g = torch.Generator().manual_seed(4)
    t = 7
    aux = (torch.randn(t, 192, generator=g) * 2).to(torch.bfloat16)
    tokens = torch.tensor([5, 5, 200, 17, 16, 255, 5]).numpy()
    slots = np.tile(np.arange(t, dtype=np.int64), (t, 1))
    outs = []
    for emb in (packed, dense):
        head.embed = emb
        fused = FusedHead.build(head)
        assert fused is not None
        kc = torch.zeros(32, head.nkv, head.hd, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        outs.append([*fused.run(kc, vc, tokens, np.arange(t), np.arange(t), slots, np.arange(1, t + 1), np.arange(t), 4,
                                aux=aux), kc, vc])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_q4_1_zero_that_hides_its_m_keeps_the_embedding_dense() -> None:
    """Q4_1's side file holds z = fl32(m + 8 d) (models/gguf.py): packed as q d + m, exact where m is the
    one float16 giving z; where two give it, build() declines (the loader then keeps the embedding dense)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=g)
    d = (torch.rand(32, 2, generator=g) * 0.02 + 0.001).to(torch.float16)
    m = (-torch.rand(32, 2, generator=g) * 0.2).to(torch.float16)
    zero = (m.double() + 8.0 * d.double()).float()  # as the conversion writes it
    emb = PackedEmbedding.build("int4", rows_of({"codes": codes, "scale": d, "zero": zero}), 32, torch.bfloat16, CPU)
    assert emb is not None
    want = codes.float().view(32, 2, 32) * d.float()[..., None] + m.float()[..., None]  # gguf-py's d q + m
    assert same_bits(emb(torch.arange(32)), want.view(32, 64).to(torch.bfloat16))
    d[5, 1] = 1024.0  # 8 d = 8192, where float32's step (2^-10) is 1024 float16 steps of an m near 2^-10
    zero[5, 1] = 8192.0 + 2.0 ** -10
    assert PackedEmbedding.build("int4", rows_of({"codes": codes, "scale": d, "zero": zero}), 32, torch.bfloat16,
                                 CPU) is None


def test_the_table_packed_a_chunk_of_rows_at_a_time_is_packed_whole(monkeypatch) -> None:
    """Chunks of 32 rows (the last a part, padded), the first chunk's Q5_K codes without a fifth bit
    set (its W4KLinear has no `high`, the later ones have): the same buffers as one packing of the whole
    table, and rows of gguf-py's values."""
    from augury.models import native_embed

    from test_gguf_kquants import blocks

    kind, p = gguf_blocks.decode(blocks(QT.Q5_K, 100, 512, seed=5), QT.Q5_K)
    p["codes"][:32] &= 15
    part = {k: torch.from_numpy(v) for k, v in p.items()}
    monkeypatch.setattr(native_embed, "BUILD_ROWS", 32)
    emb = PackedEmbedding.build(kind, rows_of(part), 100, torch.bfloat16, CPU)
    whole = native.build([kind], [native_embed._padded(part, 112)], None, torch.bfloat16, CPU)
    assert native.build([kind], [{k: v[:32] for k, v in part.items()}], None, torch.bfloat16, CPU).high is None
    assert emb.table.out_features == 112 and emb.table.high is not None
    for (name, a), (_, b) in zip(emb.table.named_buffers(), whole.named_buffers()):
        assert torch.equal(a, b), name
    assert same_bits(emb.weight, torch.from_numpy(gguf_blocks.values(p)).to(torch.bfloat16))
