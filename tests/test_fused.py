"""The whole layer stack in one C++ call (models/fused.py, kernels/forward.cpp): taken where the
model and the step allow, the same bits as the layer-by-layer forward (log-probabilities compared
exactly), speculative verification through it equal to plain decoding through the layers, and
the layer-by-layer path wherever it cannot run."""
from __future__ import annotations


import pytest
import torch

from augury import LLM, SamplingParams
from augury.cpu import kernels as cpu_kernels
from augury.models import fused, quant
from conftest import random_prompts
from speculative_helpers import make_target, random_head

needs_kernels = pytest.mark.skipif(cpu_kernels.forward() is None,
                                   reason="augury's fused-stack kernel does not run here (not x86-64 with AVX2, or no compiler)")


@pytest.fixture
def count_fused(monkeypatch):
    """Counts the forwards the fused kernel actually ran."""
    calls = {"fused": 0}
    real = fused.FusedStack.run

    def run(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["fused"] += out is not None
        return out

    monkeypatch.setattr(fused.FusedStack, "run", run)
    return calls


def _generate(llm, prompts, params, layers: bool):
    model = llm.engine.model
    model._fused = False if layers else None
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in pos.items()} for pos in o.logprobs]) for o in outs]


@needs_kernels
@pytest.mark.parametrize("family,quantization", [("llama", "int4"), ("qwen2", "int4"), ("mistral", "int4"),
                                                 ("llama", "none"), ("qwen2", "none")])  # qwen2: q|k|v biases
def test_fused_stack_equals_the_layer_by_layer_forward(family, quantization, tiny_checkpoint, count_fused) -> None:
    folder = tiny_checkpoint(family)
    llm = LLM(str(folder), dtype="bfloat16", quantization=quantization, speculative_algorithm="none",
              log_stats_interval=0)
    prompts = random_prompts([5, 11, 3, 17], seed=3)  # different key counts in one decode batch
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=4) for n in (12, 7, 15, 9)]
    before = count_fused["fused"]  # start-up's warm-up may have run it
    want = _generate(llm, prompts, params, layers=True)
    assert count_fused["fused"] == before
    got = _generate(llm, prompts, params, layers=False)
    assert isinstance(llm.engine.model._fused, fused.FusedStack)
    assert count_fused["fused"] - before >= 14  # every decode step (prefill chunks take the layers)
    assert got == want  # tokens and log-probabilities, exactly


@needs_kernels
def test_verification_through_the_fused_stack_equals_plain_decoding_through_the_layers(tmp_path, count_fused
                                                                                         ) -> None:
    target, head = make_target(tmp_path / "target"), random_head(tmp_path / "head")
    common = dict(dtype="bfloat16", quantization="int4", log_stats_interval=0)
    plain = LLM(str(target), speculative_algorithm="none", **common)
    spec = LLM(str(target), draft_model=str(head), speculative_algorithm="eagle3", speculative_policy="static",
               speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6, **common)
    prompts = random_prompts([6, 9, 4], seed=5)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (20, 13, 26)]
    want = _generate(plain, prompts, params, layers=True)
    before = count_fused["fused"]
    got = _generate(spec, prompts, params, layers=False)
    assert count_fused["fused"] > before
    assert sum(o.spec_stats.num_verify_steps for o in spec.generate(prompts, params, use_tqdm=False)) > 0
    assert got == want


@needs_kernels
def test_the_layers_run_where_the_fused_stack_cannot(tiny_checkpoint, count_fused, monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "bf16", lambda: None)  # dense bfloat16 then takes fbgemm's GEMM
    prompt = random_prompts([6], seed=1)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    before = count_fused["fused"]
    for family, kwargs in (("qwen3", dict(dtype="bfloat16", quantization="int4")),  # q/k norms
                           ("llama", dict(dtype="float32", quantization="int4")),  # float32: the reference mode
                           ("llama", dict(dtype="bfloat16", quantization="none"))):  # dense on fbgemm
        llm = LLM(str(tiny_checkpoint(family)), speculative_algorithm="none", log_stats_interval=0, **kwargs)
        assert len(llm.generate(prompt, params, use_tqdm=False)[0].token_ids) == 5
        assert llm.engine.model._fused is False, (family, kwargs)
    assert count_fused["fused"] == before


@needs_kernels
def test_moving_or_requantising_the_model_drops_the_fused_table(tiny_checkpoint, count_fused) -> None:
    llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", quantization="int4", speculative_algorithm="none",
              log_stats_interval=0)
    llm.generate(random_prompts([4]), SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    model = llm.engine.model
    assert isinstance(model._fused, fused.FusedStack)
    model.to("cpu")  # any _apply: the table's addresses may be stale
    assert model._fused is None


def test_a_failed_cpu_kernels_stage_warns_and_runs_torch(tiny_checkpoint, monkeypatch, caplog) -> None:
    """The "CPU kernels" start-up stage is optional: when it fails, the engine warns once, comes up on
    torch's kernels (none of augury's, not some) and still decodes."""
    import logging

    monkeypatch.setenv("AUGURY_FAULT_INJECT", "CPU kernels")
    monkeypatch.setattr(cpu_kernels, "_cache", {})
    with caplog.at_level(logging.WARNING, logger="augury.startup"):
        llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", quantization="int4",
                  speculative_algorithm="none", log_stats_interval=0)
    assert any("CPU kernels" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    model = llm.engine.model
    assert all(m.backend == "torch" for m in model.modules() if isinstance(m, quant.Int4Linear))
    out = llm.generate(random_prompts([5]), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 4 and model._fused is False


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_short_prompt_prefills_on_kernel_rows_with_the_bits_of_decoding_it(family, tiny_checkpoint, monkeypatch,
                                                                             count_fused) -> None:
    """A lone prompt chunk ending within PREFILL_ROWS_MAX positions, or of at most PREFILL_CHUNK_ROWS
    tokens, within PREFILL_SLOTS_MAX slots, is exact rows on augury's attention
    kernel (through the fused stack, untimed): every token's hidden state and cached key and value are
    bit for bit what decoding the prompt one token at a time gives, and what prefilling it in two chunks
    gives. A longer chunk, or a batch of prompts of different lengths, takes torch's attention."""
    from augury.attention import paged

    llm = LLM(str(tiny_checkpoint(family)), dtype="bfloat16", quantization="int4", speculative_algorithm="none",
              log_stats_interval=0)
    eng, model, bs = llm.engine, llm.engine.model, llm.engine.allocator.block_size
    backend = paged.PagedBackend(eng.kv.k, eng.kv.v, bs)
    n = 37
    prompt = torch.randint(3, 200, (1, n), generator=torch.Generator().manual_seed(1))
    per = -(-n // bs)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(3)]  # free blocks: nothing runs

    def forward(attn, ids, start):
        with torch.inference_mode():
            return model(ids, (start + torch.arange(ids.shape[1]))[None], attn)[0][0]

    def cached(table):  # every layer's key and value rows of positions 0 .. n - 1
        at = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        return eng.kv.k[:, at].clone(), eng.kv.v[:, at].clone()

    attn = backend.prepare_prefill([tables[0]], [0], [n])
    assert attn.kernel_calls and attn.timed is False
    before = count_fused["fused"]
    whole = forward(attn, prompt, 0)
    assert count_fused["fused"] == before + 1  # one call of the stack for the whole prompt
    decoded = [forward(backend.prepare_prefill([tables[1]], [0], [1]), prompt[:, :1], 0)]
    decoded += [forward(backend.prepare_decode([tables[1]], [j]), prompt[:, j : j + 1], j) for j in range(1, n)]
    assert torch.equal(whole, torch.cat(decoded))
    first = forward(backend.prepare_prefill([tables[2]], [0], [20]), prompt[:, :20], 0)
    rest = forward(backend.prepare_prefill([tables[2]], [20], [n - 20]), prompt[:, 20:], 20)
    assert torch.equal(whole, torch.cat([first, rest]))
    for a, b in zip(cached(tables[0]), cached(tables[1])):
        assert torch.equal(a, b)
    for a, b in zip(cached(tables[0]), cached(tables[2])):
        assert torch.equal(a, b)
    assert not backend.prepare_prefill([tables[0], tables[1]], [0, 0], [n, n - 1]).kernel_calls  # lengths differ
    monkeypatch.setattr(paged, "PREFILL_ROWS_MAX", n - 1)
    assert backend.prepare_prefill([tables[0]], [0], [n]).kernel_calls  # a short chunk still
    monkeypatch.setattr(paged, "PREFILL_CHUNK_ROWS", n - 1)
    assert not backend.prepare_prefill([tables[0]], [0], [n]).kernel_calls  # past both bounds
    assert backend.prepare_prefill([tables[0]], [0], [n - 1]).kernel_calls
    assert backend.prepare_prefill([tables[0]], [n - 2], [2]).kernel_calls  # a short chunk after context
    monkeypatch.setattr(paged, "PREFILL_CHUNK_ROWS", n)
    monkeypatch.setattr(paged, "PREFILL_SLOTS_MAX", n * n - 1)
    assert not backend.prepare_prefill([tables[0]], [0], [n]).kernel_calls  # past the slot table's bound


@needs_kernels
def test_decode_rows_read_the_keys_exact_rows_gives_them() -> None:
    """prepare_decode's direct slot lists (augury's attention kernel) against the generic exact rows:
    the same slot mapping, key counts and, up to each row's count, the same slots in the same order."""
    from augury.attention.paged import PagedBackend

    cache = torch.zeros(2, 64, 2, 16, dtype=torch.bfloat16)
    backend = PagedBackend(cache, cache.clone(), block_size=4)
    tables = [[3, 7, 1], [9, 2], [5, 6, 8, 10, 11]]
    ctx = [9, 4, 17]
    fast = backend.prepare_decode(tables, ctx)
    generic = backend._prepare(tables, ctx, [1, 1, 1], torch.full((3, 1), -1))
    k_fast, k_gen = fast.fused_rows(), generic.fused_rows()
    assert torch.equal(k_fast[2], k_gen[2])  # slot mapping
    assert torch.equal(k_fast[4], k_gen[4])  # key counts
    for r, n in enumerate(k_fast[4].tolist()):
        assert torch.equal(k_fast[3][r, :n], k_gen[3][r, :n])
    assert k_fast[3][1, :5].tolist() == [36, 37, 38, 39, 8]  # block 9's four slots, then block 2's first


@needs_kernels
@pytest.mark.parametrize("packed", [False, True])
def test_tree_rows_read_the_keys_exact_rows_gives_them(packed: bool) -> None:
    """prepare_tree's and prepare_packed_tree's direct slot lists (augury's attention kernel) against
    the generic exact rows, on random trees (parents before children), contexts and block tables: the
    same slot mapping, key counts and, up to each row's count, the same slots in the same order."""
    from augury.attention import paged

    g = torch.Generator().manual_seed(5)
    cache = torch.zeros(2, 512, 2, 16, dtype=torch.bfloat16)
    bs = 4
    backend = paged.PagedBackend(cache, cache.clone(), block_size=bs)
    # chains in every row (a lone request's free drafts, any batch's prompt-like rows) take a shortcut
    for b, n, chains in ((1, 1, False), (1, 9, False), (3, 15, False), (6, 7, False), (1, 12, True), (3, 5, True)):
        parents = torch.tensor([[-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, n)]
                                for _ in range(b)])
        if chains:
            parents[:] = torch.arange(n) - 1
        if b > 1:
            parents[1] = torch.arange(n) - 1  # a chain among the trees
        ctx = [int(x) for x in torch.randint(1, 40, (b,), generator=g)]
        blocks = torch.randperm(127, generator=g)[: b * 15] + 1
        tables = [blocks[i * 15 : i * 15 + -(-(ctx[i] + n) // bs)].tolist() for i in range(b)]
        sizes = [int(x) for x in torch.randint(1, n + 1, (b,), generator=g)] if packed else [n] * b
        keep = [i * n + j for i in range(b) for j in range(sizes[i])]
        bt = paged._block_table(tables, paged._width(ctx, n, bs), backend.device)
        new_slots = paged._new_slots(bt, ctx, [n] * b, n, bs)
        rows = paged.exact_rows(parents, bt, bs, ctx, new_slots.view(b, n), backend.merge_widths, keep)
        generic = paged.StepAttention(cache, cache, new_slots[torch.tensor(keep)], None, rows)
        fast = backend.prepare_packed_tree(tables, ctx, parents, sizes) if packed \
            else backend.prepare_tree(tables, ctx, parents)
        assert not fast.exact.groups  # the direct slot lists, not exact_rows' groups
        assert fast.timed  # a verification's call is timed for the thread choice, as every step's
        k_fast, k_gen = fast.fused_rows(), generic.fused_rows()
        assert torch.equal(k_fast[2], k_gen[2]), (b, n)  # slot mapping
        assert torch.equal(k_fast[4], k_gen[4]), (b, n)  # key counts
        for r, count in enumerate(k_fast[4].tolist()):
            assert torch.equal(k_fast[3][r, :count], k_gen[3][r, :count]), (b, n, r)


@needs_kernels
def test_a_slot_outside_the_cache_is_refused(tiny_checkpoint) -> None:
    """The kernel writes keys and values through raw addresses: a slot past the cache is an error,
    not a write out of bounds."""
    llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", quantization="int4", speculative_algorithm="none",
              log_stats_interval=0)
    model, backend = llm.engine.model, llm.engine.attention
    model._fused = fused.FusedStack.build(model)
    attn = backend.prepare_decode([[1, 2]], [5])
    k, v, mapping, slots, nkeys = attn.fused_rows()
    cfg = model.cfg
    h = torch.zeros(1, 1, cfg.hidden_size)
    cos = sin = torch.zeros(1, 1, 1, cfg.head_dim, dtype=torch.bfloat16)
    for bad in ((mapping.clone().fill_(k.shape[1]), slots), (mapping, slots.clone().fill_(-1))):
        attn._fused_rows = (k, v, *bad, nkeys)
        with pytest.raises(RuntimeError, match="bad shapes"):
            model._fused.run(h, cos, sin, attn, ())


@needs_kernels
@pytest.mark.parametrize("layers", [False, True])
def test_features_written_into_given_rows_equal_the_returned_ones(tiny_checkpoint, layers) -> None:
    """aux_into (a FeatureStore's rows and an index per token): the fused kernel writes each token's
    aux features to its row, the same bits it returns otherwise, and nothing else; the layer-by-layer
    path copies them there; an index outside the rows is refused."""
    llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", quantization="int4", speculative_algorithm="none",
              log_stats_interval=0)
    model, backend = llm.engine.model, llm.engine.attention
    model._fused = False if layers else fused.FusedStack.build(model)
    aux_layers = (0, 1, 1)
    width = len(aux_layers) * model.cfg.hidden_size
    ids, pos = torch.tensor([[5], [9]]), torch.tensor([[3], [6]])

    def forward(into=None):
        attn = backend.prepare_decode([[1, 2], [3, 4]], [3, 6])
        with torch.inference_mode():
            return model(ids, pos, attn, aux_layers, into)

    hidden, aux = forward()
    assert aux.shape == (2, 1, width) and aux.dtype == torch.bfloat16
    rows = torch.zeros(10, width, dtype=torch.bfloat16)
    hidden2, none = forward((rows, torch.tensor([7, 2])))
    assert none is None and torch.equal(hidden2, hidden)
    assert torch.equal(rows[7], aux[0, 0]) and torch.equal(rows[2], aux[1, 0])
    assert not rows[[0, 1, 3, 4, 5, 6, 8, 9]].any()
    if not layers:
        with pytest.raises(RuntimeError, match="bad shapes"):
            forward((rows, torch.tensor([7, 10])))
