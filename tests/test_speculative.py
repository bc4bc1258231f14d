"""EAGLE-3 / n-gram speculation inside continuous batching: exact greedy output, lossless
sampling, faithful reading of the head format, no KV leak, clear errors for bad heads."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from augury import LLM, SamplingParams
from speculative_helpers import checkpoints, make_target, random_head


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("spec"))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3 + (7 * i) % 29 for i in range(n)]
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in lens]


def _greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]


def _static_eagle3(target, head, shape: tuple[int, int, int], **kwargs) -> LLM:
    """float32 LLM drafting the same EAGLE-3 tree (num_steps, topk, num_draft_tokens) every step."""
    return LLM(str(target), dtype="float32", draft_model=str(head), speculative_algorithm="eagle3",
               speculative_policy="static", speculative_num_steps=shape[0], speculative_eagle_topk=shape[1],
               speculative_num_draft_tokens=shape[2], log_stats_interval=0, **kwargs)


def _assert_no_leak(llm: LLM) -> None:
    a = llm.engine.allocator
    assert a.num_free == a.num_usable, f"{a.num_usable - a.num_free} KV blocks leaked"
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def plain(ckpts):
    return LLM(str(ckpts["target"]), dtype="float32", speculative_algorithm="none", log_stats_interval=0)


SHAPES = [(1, 1, 2), (4, 1, 5), (3, 2, 6), (4, 3, 10)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "steps%d-topk%d-n%d" % s)
@pytest.mark.parametrize("batch", [1, 5, 16])
def test_eagle3_greedy_equals_plain(ckpts, plain, shape, batch):
    prompts = _prompts(batch, seed=batch)
    params = _greedy([8 + (5 * i) % 23 for i in range(batch)])
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _static_eagle3(ckpts["target"], ckpts["head"], shape, speculative_ngram_branch=0, max_num_seqs=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert all(o.spec_stats.num_verify_steps > 0 for o in outs if len(o.token_ids) > 1)
    assert all(o.spec_stats.num_draft_tokens == o.spec_stats.num_verify_steps * (shape[2] - 1) for o in outs)
    # every token after the prefill's came out of a verification (static policy, room to spare)
    assert all(len(o.token_ids) == 1 + o.spec_stats.num_verify_steps + o.spec_stats.num_accepted_draft_tokens
               for o in outs)
    _assert_no_leak(llm)


def test_ngram_greedy_equals_plain(ckpts, plain):
    prompts = _prompts(9, seed=3)
    params = _greedy([20] * 9)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(ckpts["target"]), dtype="float32", speculative_algorithm="ngram", speculative_policy="static",
              log_stats_interval=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0  # random targets loop: lookup hits
    _assert_no_leak(llm)


@pytest.mark.parametrize("shape", [(5, 1, 6), (3, 2, 7)])
def test_faithful_head_is_accepted(ckpts, shape):
    """A head built to predict the bigram target exactly: nearly every draft is accepted,
    which holds only if the pairing (h_p, token p+1), d2t, the shared embedding and the
    tree attention are all read as SGLang/vLLM define them."""
    target = str(ckpts["bigram"])
    prompts = _prompts(4, seed=7)
    params = _greedy([30] * 4)
    want = [o.token_ids for o in LLM(target, dtype="float32", speculative_algorithm="none",
                                     log_stats_interval=0).generate(prompts, params, use_tqdm=False)]
    llm = _static_eagle3(target, ckpts["bigram_head"], shape)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.stats
    rates = stats.acceptance_rates()
    assert rates[0] > 0.97 and rates[1] > 0.9, rates  # the first drafts are right whenever offered
    if shape[1] == 1:  # a chain is all best guesses: ~depth + 1 tokens per step
        assert stats.accept_length > shape[0] + 0.5, stats.accept_length
    else:  # a tree spends nodes on siblings too; its best path is still accepted
        assert stats.accept_length > 2.5, stats.accept_length
    _assert_no_leak(llm)


def test_joins_and_leaves_mid_speculation(ckpts, plain):
    """Requests added while others are speculating get the same tokens as alone."""
    prompts = _prompts(6, seed=11)
    params = _greedy([25, 5, 17, 9, 30, 12])
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _static_eagle3(ckpts["target"], ckpts["head"], (3, 2, 5))
    eng = llm.engine
    ids, got = [], {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        ids.append(eng.add_request(p, sp))
        for _ in range(3):  # a few steps between arrivals
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o.token_ids
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.token_ids
    assert [got[i] for i in ids] == want
    _assert_no_leak(llm)


def test_preemption_under_speculation(ckpts, plain):
    prompts = _prompts(8, seed=5)
    params = _greedy([40] * 8)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _static_eagle3(ckpts["target"], ckpts["head"], (3, 1, 4), num_kv_blocks=24, block_size=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_no_leak(llm)


def test_mixed_sampling_batch_keeps_greedy_rows_exact(ckpts, plain):
    """Greedy rows are plain greedy decoding; seeded sampled rows are plain seeded sampling, token for
    token (each output position is drawn at its own uniform, whatever the trees), also on a second
    run whose prompts hit the prefix cache."""
    prompts = _prompts(6, seed=9)
    mixed = [SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
             SamplingParams(max_tokens=15, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True) for i in range(6)]
    want = [o.token_ids for o in plain.generate(prompts, mixed, use_tqdm=False)]
    llm = _static_eagle3(ckpts["target"], ckpts["head"], (3, 2, 6))
    for _ in range(2):
        outs = llm.generate(prompts, mixed, use_tqdm=False)
        assert [o.token_ids for o in outs] == want and all(len(t) == 15 for t in want)
    _assert_no_leak(llm)


def test_seeded_sampling_with_speculation_is_plain_seeded_sampling(ckpts):
    """A head that drafts well (a bigram target): at temperature 0.8 drafts are accepted (~0.3 a step), and the
    tokens are still exactly those plain sampling draws with the same seeds, alone or in a batch,
    with or without prefix-cache hits; unseeded requests sample too (different draws)."""
    prompts = _prompts(5, seed=13)
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_k=[None, 20][i % 2], top_p=[1.0, 0.9][i % 2],
                             seed=100 + i, ignore_eos=True) for i in range(5)]
    plain_llm = LLM(str(ckpts["bigram"]), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    want = [o.token_ids for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    llm = _static_eagle3(ckpts["bigram"], ckpts["bigram_head"], (4, 1, 5))
    batch = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone] == want
    accepted = sum(o.spec_stats.num_accepted_draft_tokens for o in batch + alone)
    assert accepted > 0.2 * sum(o.spec_stats.num_verify_steps for o in batch + alone)
    free = SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True)
    a, b = (llm.generate(prompts[:1], free, use_tqdm=False)[0].token_ids for _ in range(2))
    assert a != b and len(a) == len(b) == 24
    _assert_no_leak(llm)


# ---------------------------------------------------------------------------------- bad heads

def _broken_head(ckpts, tmp_path, edit) -> str:
    src = ckpts["head"]
    cfg = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    cfg, tensors = edit(cfg, tensors)
    out = tmp_path / "broken"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


@pytest.mark.parametrize("edit, message", [
    (lambda c, t: (c, {k: v for k, v in t.items() if k != "midlayer.self_attn.k_proj.weight"}),
     "missing tensor midlayer.self_attn.k_proj.weight"),
    (lambda c, t: (c, {**t, "fc.weight": t["fc.weight"][:, :-1].contiguous()}), "tensor fc.weight has shape"),
    (lambda c, t: (c, {**t, "extra.weight": torch.zeros(2)}), "unexpected tensor extra.weight"),
    (lambda c, t: ({**c, "vocab_size": 999}, t), "vocab_size 999 does not match"),
    (lambda c, t: ({**c, "target_hidden_size": 32}, t), "target_hidden_size 32 does not match"),
    (lambda c, t: ({**c, "architectures": ["LlamaForCausalLM"]}, t), "is not an EAGLE-3 head"),
    (lambda c, t: (c, {k: v for k, v in t.items() if k != "d2t"}), "needs a d2t tensor"),
    (lambda c, t: ({**c, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, t),
     "eagle_aux_hidden_state_layer_ids"),
])
def test_bad_head_is_a_clear_error(ckpts, tmp_path, edit, message):
    head = _broken_head(ckpts, tmp_path, edit)
    with pytest.raises(Exception) as info:
        LLM(str(ckpts["target"]), dtype="float32", draft_model=head, speculative_algorithm="eagle3",
            log_stats_interval=0)
    assert message in str(info.value)
    assert "draft head" in str(info.value)


def test_aux_layer_convention(ckpts):
    """eagle_aux_hidden_state_layer_ids name layers whose OUTPUT is captured (SGLang's reading)."""
    llm = LLM(str(ckpts["target"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
              log_stats_interval=0)
    assert llm.engine.speculator.aux_layers == (0, 2, 3)
    from augury.models.eagle3_head import default_aux_layers

    assert default_aux_layers(32) == (1, 15, 28)
    # the captured feature of layer i equals transformers' hidden_states[i + 1] (output of layer i)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(ckpts["target"]), dtype=torch.float32)
    ids = _prompts(1, seed=1)[0]
    with torch.no_grad():
        hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[1], hs[3], hs[4]], dim=-1)[0]
    eng = llm.engine
    rid = eng.add_request(ids, SamplingParams(max_tokens=2, temperature=0.0))
    req = eng.requests[rid]
    eng.step()  # the prefill captures the features (the request stays: one token still to come)
    skip, got = eng.take_features(req)
    assert skip == 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("ctx", [5, 61])
def test_tree_verification_is_exactly_decoding_in_bfloat16(ckpts, ctx, merge):
    """Every node of a verified tree gets bit for bit the hidden state plain decoding computes
    for that token after its path, in bfloat16 too, where one masked attention over the whole
    tree would sum the keys in another order (and flip near-tie greedy choices). At ctx 61 the
    nodes' key counts straddle a multiple of KEY_ALIGN: one call per padded width, or (merge)
    all padded to the widest."""
    from augury.attention import PagedBackend
    from augury.speculative.tree import depth_from_parents

    llm = LLM(str(ckpts["target"]), dtype="bfloat16", speculative_algorithm="none", log_stats_interval=0)
    eng, model, bs = llm.engine, llm.engine.model, llm.engine.allocator.block_size
    g = torch.Generator().manual_seed(ctx)
    prompt = torch.randint(3, 256, (1, ctx), generator=g)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3, 5, 8, 8, 9]])
    n = parents.shape[1]
    tokens = torch.randint(3, 256, (1, n), generator=g)
    depth = depth_from_parents(parents)
    per = -(-(ctx + n) // bs)
    tables = [list(range(1, 1 + per)), list(range(1 + per, 1 + 2 * per))]  # free blocks: nothing runs

    backend = PagedBackend(eng.kv.k, eng.kv.v, bs, merge_widths=merge)

    def run(table, ids, pos, c, tree_parents=None):
        if tree_parents is not None:
            attn = backend.prepare_tree([table], [c], tree_parents)
        else:
            attn = backend.prepare_prefill([table], [c], [ids.shape[1]])
        with torch.inference_mode():
            return model(ids, pos, attn)[0][0]

    for table in tables:
        run(table, prompt, torch.arange(ctx)[None], 0)
    got = run(tables[1], tokens, ctx + depth, ctx, parents)
    assert got.dtype == torch.bfloat16
    for i in range(n):
        path = [i]
        while parents[0, path[-1]] >= 0:
            path.append(int(parents[0, path[-1]]))
        for k, node in enumerate(reversed(path)):  # decode the path one token at a time
            want = run(tables[0], tokens[:, node : node + 1], torch.tensor([[ctx + k]]), ctx + k)
        assert torch.equal(got[i], want[0]), f"node {i} (depth {len(path) - 1}) differs from decoding"


@pytest.mark.parametrize("heads", [(6, 2, 32), (9, 3, 64)], ids=["6-2-32", "demo-9-3-64"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_aligned_single_query_attention_ignores_batch_and_extra_padding(dtype, heads):
    """The torch fact exact attention stands on: a single query over L keys padded with masked
    keys to a multiple of KEY_ALIGN gets bit for bit the same output as one row of a batched call
    whose keys are padded further (so a whole tree, and a batch, takes one call), and alone when
    run as two identical rows: at more than one thread torch computes a lone row another way (the
    demo's 9/3 heads of 64 differ in the last bits at 2 threads; StepAttention doubles it)."""
    import torch.nn.functional as F

    from augury.attention.paged import KEY_ALIGN, WIDTH_FREE_DTYPES, _align

    assert dtype in WIDTH_FREE_DTYPES
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, hd = heads
    lens = [1, 7, 16, 17, 40, 63, 64, 65, 200, 531, 600]
    width = _align(max(lens)) + KEY_ALIGN
    k, v = (torch.randn(len(lens), kv_heads, width, hd, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(lens), heads, 1, hd, generator=g).to(dtype)
    valid = torch.arange(width)[None, :] < torch.tensor(lens)[:, None]
    batched = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None], enable_gqa=True)
    for i, n in enumerate(lens):
        w = _align(n)
        two = [x.expand(2, *x.shape[1:]).contiguous() for x in (q[i : i + 1], k[i : i + 1, :, :w], v[i : i + 1, :, :w])]
        alone = F.scaled_dot_product_attention(*two, attn_mask=valid[i, :w][None, None, None].expand(2, 1, 1, w),
                                               enable_gqa=True)
        assert torch.equal(batched[i], alone[0]), f"{n} keys"


def test_batched_exact_verification_matches_each_request_alone(ckpts, monkeypatch):
    """Two requests' trees verified in one forward (bfloat16): each node's hidden state is bit
    for bit the one its request gets verified alone, on augury's attention kernel (each row's slot
    list built directly) and on torch's exact rows, whether the rows share one attention call or the
    gather budget splits them into many."""
    from augury.attention import paged as torch_paged
    from augury.speculative.tree import depth_from_parents

    llm = LLM(str(ckpts["target"]), dtype="bfloat16", speculative_algorithm="none", log_stats_interval=0)
    eng, model, bs = llm.engine, llm.engine.model, llm.engine.allocator.block_size
    g = torch.Generator().manual_seed(11)
    ctxs = [9, 47]
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3, 3, 6]] * 2)
    n = parents.shape[1]
    tokens = torch.randint(3, 256, (2, n), generator=g)
    contexts = [torch.randint(3, 256, (1, c), generator=g) for c in ctxs]
    per = -(-(max(ctxs) + n) // bs)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(2)]

    backend = torch_paged.PagedBackend(eng.kv.k, eng.kv.v, bs, merge_widths=True)

    def run(which, ids, pos, tree=True):
        c, tbl = [ctxs[i] for i in which], [tables[i] for i in which]
        if tree:
            attn = backend.prepare_tree(tbl, c, parents[which])
        else:
            attn = backend.prepare_prefill(tbl, c, [ids.shape[1]] * len(which))
        with torch.inference_mode():
            return model(ids, pos, attn)[0]

    pos = torch.tensor(ctxs)[:, None] + depth_from_parents(parents)
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(torch_paged, "_attention_kernel", lambda k_cache: None)
        for i, c in enumerate(ctxs):
            run([i], contexts[i], torch.arange(c)[None], tree=False)
        alone = [run([i], tokens[i : i + 1], pos[i : i + 1])[0] for i in range(2)]
        together = run([0, 1], tokens, pos)
        for i in range(2):
            assert torch.equal(together[i], alone[i]), f"request {i} changed by its batch (kernel {kernel})"
    monkeypatch.setattr(torch_paged, "EXACT_CALL_SLOTS", 3 * torch_paged.KEY_ALIGN)
    one = backend.prepare_tree([tables[1]], [ctxs[1]], parents[:1])
    assert len(one.exact.groups) == n  # one row a call
    split = run([0, 1], tokens, pos)
    for i in range(2):
        assert torch.equal(split[i], alone[i]), f"request {i} changed by splitting the calls"


@pytest.mark.parametrize("batch", [1, 5])
def test_ngram_branch_on_eagle3_trees(ckpts, batch):
    """Prompt-lookup tokens grafted onto the head's tree: greedy output stays plain greedy, and on
    a bigram target (whose next token any earlier occurrence of the current one predicts) the
    branch is accepted deeper than the head's own tree reaches."""
    plain_bigram = LLM(str(ckpts["bigram"]), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    # prompts that already follow the target's own next-token map (and so, on 256 tokens, have
    # run into its cycle): lookups in them predict the continuation
    starts = [p[:2] for p in _prompts(batch, seed=7)]
    prompts = [p + o.token_ids for p, o in zip(starts, plain_bigram.generate(starts, _greedy([60] * batch), use_tqdm=False))]
    params = _greedy([20 + 3 * i for i in range(batch)])
    want = [o.token_ids for o in plain_bigram.generate(prompts, params, use_tqdm=False)]
    llm = _static_eagle3(ckpts["bigram"], ckpts["head"], (2, 2, 4), speculative_ngram_branch=6, max_num_seqs=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    steps = sum(o.spec_stats.num_verify_steps for o in outs)
    accepted = sum(o.spec_stats.num_accepted_draft_tokens for o in outs)
    assert accepted / steps > 2  # more than the head's tree depth: the random head alone gets ~0
    assert all(o.spec_stats.num_draft_tokens >= o.spec_stats.num_verify_steps * 3 for o in outs)
    _assert_no_leak(llm)


@pytest.mark.parametrize("layers", [1, 2, 4])
def test_shallow_target_with_default_aux_layers_decodes_as_plain(tmp_path, layers):
    """A head without eagle_aux_hidden_state_layer_ids on a target under 5 layers reads three
    layers (repeating one where there are fewer), so fc [H, 3H] fits and greedy output is plain's."""
    from augury.models.eagle3_head import default_aux_layers

    assert len(default_aux_layers(layers)) == 3
    target = make_target(tmp_path / "target", layers=layers)
    head = random_head(tmp_path / "head", aux=None)
    prompts, params = _prompts(3, seed=layers), _greedy([12, 9, 15])
    plain = LLM(str(target), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    outs = _static_eagle3(target, head, (3, 2, 6)).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert all(o.spec_stats.num_verify_steps > 0 for o in outs)


def test_head_whose_fc_does_not_fit_the_aux_layers_is_refused_naming_fc(tmp_path):
    from augury.stages import StartupError

    target = make_target(tmp_path / "target", layers=2)
    head = random_head(tmp_path / "head", aux=None, fc_inputs=2)
    with pytest.raises(StartupError, match=r"draft head.*fc\.weight"):
        _static_eagle3(target, head, (3, 2, 6))


def test_drafts_near_the_end_of_the_context_stay_exact(ckpts):
    """Requests that run into max_model_len: trees verified at the context's end use positions past
    it (never committed), within the rope table; output equals plain decoding up to 'length'."""
    prompts = _prompts(4, seed=21)
    params = _greedy([200] * 4)  # more than fits: every request ends at the context length
    plain = LLM(str(ckpts["target"]), dtype="float32", speculative_algorithm="none", max_model_len=48,
                log_stats_interval=0)
    want = plain.generate(prompts, params, use_tqdm=False)
    llm = _static_eagle3(ckpts["target"], ckpts["head"], (4, 3, 10), max_model_len=48)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert all(o.finish_reason == "length" and len(p) + len(o.token_ids) == 48 for p, o in zip(prompts, outs))
    assert all(o.spec_stats.num_verify_steps > 0 for o in outs)
    _assert_no_leak(llm)


def test_a_position_past_the_rope_table_is_an_error_not_clamped(plain):
    eng = plain.engine
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    req = eng.requests[rid]
    eng.step()  # prefill: the request is in the cache
    attn = eng.attention.prepare_decode([req.block_table], [req.num_computed])
    with pytest.raises(ValueError, match="past the largest"):
        eng.run_target([req], [[1]], torch.tensor([[eng.max_position + 1]]), attn, aux=False)
    eng.abort_request(rid)


def test_masked_fallback_for_trees_stays_greedy_exact(ckpts, monkeypatch):
    """Where torch attends (no attention kernel: another device, or no compiler) and exact attention
    would take too many calls, the backend falls back to one masked call with the tree's ancestor mask
    (built only then); float32 greedy output is still plain's. (augury's kernel takes any batch's
    rows in one call: it never falls back.)"""
    from augury.attention import paged as torch_paged

    monkeypatch.setattr(torch_paged, "_attention_kernel", lambda k_cache: None)
    monkeypatch.setattr(torch_paged, "MAX_EXACT_GROUPS", 0)  # every step takes the masked path
    built = []
    real = torch_paged.tree_attention_mask
    monkeypatch.setattr(torch_paged, "tree_attention_mask", lambda p: built.append(p.shape) or real(p))
    prompts, params = _prompts(5, seed=31), _greedy([14, 9, 17, 6, 12])
    plain = LLM(str(ckpts["target"]), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _static_eagle3(ckpts["target"], ckpts["head"], (3, 2, 6), max_num_seqs=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert built and all(len(s) == 2 for s in built)  # the masked path really ran, with tree masks
    _assert_no_leak(llm)


@pytest.mark.parametrize("policy", ["adaptive", "static"])
def test_a_step_that_tried_another_thread_count_does_not_time_either_arm(ckpts, policy):
    """A step during which a kernel call tried a thread count other than the chosen one (cpu/threads.py:
    on a shared core two threads cost ~10x one) timed that try too: the policy is told of a plain step
    only when no try happened inside it, and of a drafting step as untimed (its acceptance still counts)."""
    from augury.cpu import threads as cpu_threads

    llm = LLM(str(ckpts["target"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
              speculative_policy=policy, log_stats_interval=0)
    eng, spec = llm.engine, llm.engine.speculator
    step = {"n": 0, "tried": False}
    seen: list[tuple[str, bool, bool]] = []  # (arm, a try inside the step, timed)

    def tries(fn):
        def run(*a, **k):
            step["n"] += 1
            if step["n"] % 2:  # every other target forward tries another count
                cpu_threads.choice().trials += 1
                step["tried"] = True
            return fn(*a, **k)
        return run

    eng._run_decode = tries(eng._run_decode)
    eng.verify_forward = tries(eng.verify_forward)
    observe, observe_plain = spec.policy.observe, spec.policy.observe_plain

    def on_plain(batch, seconds):
        seen.append(("plain", step["tried"], True))
        return observe_plain(batch, seconds)

    def on_spec(*a, timed=True, **k):
        seen.append(("spec", step["tried"], timed))
        return observe(*a, timed=timed, **k)

    spec.policy.observe_plain, spec.policy.observe = on_plain, on_spec
    orig_step = eng.step

    def each_step():
        step["tried"] = False
        return orig_step()

    eng.step = each_step
    llm.generate(_prompts(4), _greedy([24] * 4))
    assert seen, "the policy was told of no step"
    assert not [s for s in seen if s[0] == "plain" and s[1]], "a plain step that tried a thread count was timed"
    assert not [s for s in seen if s[0] == "spec" and s[1] and s[2]], "a drafting step with a try counted as timed"
    if policy == "static":
        assert any(s[0] == "spec" and not s[1] and s[2] for s in seen)  # the others still count


def test_a_change_of_the_thread_count_has_the_policy_measure_afresh(ckpts):
    """When the kernels' chosen thread count changes (cpu/threads.py), every step time measured so far
    ran at another speed: the speculator tells the policy once, before its next step, and the policy's
    buckets time plain decoding again (their plain windows start empty); output is unchanged."""
    from augury.cpu import threads as cpu_threads

    llm = LLM(str(ckpts["target"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
              log_stats_interval=0)
    eng, spec = llm.engine, llm.engine.speculator
    want = [o.token_ids for o in llm.generate(_prompts(3), _greedy([20] * 3))]
    told: list[int] = []
    costs_changed = spec.policy.costs_changed

    def on_change():
        told.append(eng.stats.steps_plain + eng.stats.steps_spec)
        plain = [bk.arm(0) for bk in spec.policy.buckets.values()]
        assert plain and any(a.recent for a in plain)  # measured before ...
        costs_changed()
        assert all(not a.recent and a.seconds() is None for a in plain)  # ... and afresh after

    spec.policy.costs_changed = on_change
    cpu_threads.choice().changes += 1
    orig_step, n = eng.step, {"steps": 0}

    def each_step():
        n["steps"] += 1
        if n["steps"] == 12:
            cpu_threads.choice().changes += 1
        return orig_step()

    eng.step = each_step
    got = [o.token_ids for o in llm.generate(_prompts(3), _greedy([20] * 3))]
    assert got == want
    assert len(told) == 2 and told[0] < told[1]


def test_steps_without_head_drafts_verify_prompt_lookup_exactly(ckpts):
    """Where the policy drafts nothing (here: a policy that never does), a lone request's step
    verifies prompt lookup's continuation instead (Speculator._forced_only): greedy output is plain
    greedy output, seeded sampling plain seeded sampling, and on a bigram target (prompts already in
    its cycle) the lookups are accepted; at a batch of two, only copies are (a draft's match at least
    COPY_REACH long): the same output, and the cycle's long matches verified and accepted."""
    from augury.speculative.policy import StepPlan

    plain = LLM(str(ckpts["bigram"]), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    llm = LLM(str(ckpts["bigram"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
              speculative_policy="adaptive", log_stats_interval=0, max_num_seqs=2)
    llm.engine.speculator.policy.plan = lambda reqs: StepPlan(None, tuple(0 for _ in reqs))
    starts = [p[:2] for p in _prompts(3, seed=7)]
    prompts = [p + o.token_ids for p, o in zip(starts, plain.generate(starts, _greedy([40] * 3), use_tqdm=False))]
    for params in (SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)):
        want = [plain.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one at a time: batch 1
        assert [o.token_ids for o in outs] == want
        if params.temperature == 0.0:
            s = [o.spec_stats for o in outs]
            assert sum(x.num_accepted_draft_tokens for x in s) > sum(x.num_verify_steps for x in s) > 0
    params = _greedy([30, 30])
    two = llm.generate(prompts[:2], params, use_tqdm=False)
    assert [o.token_ids for o in two] == [o.token_ids for o in plain.generate(prompts[:2], params, use_tqdm=False)]
    s = [o.spec_stats for o in two]
    assert sum(x.num_accepted_draft_tokens for x in s) > sum(x.num_verify_steps for x in s) > 0
    _assert_no_leak(llm)


def test_a_copy_the_cut_leaves_nothing_of_waits_like_none_found(ckpts):
    """Above batch 1 a request whose copy the policy's cut (free_cut) leaves nothing of waits before its
    next suffix search as one that found none (LOOK_WAIT): on a bigram target whose prompts are in its
    cycle every search finds a long copy; with a cut that never pays, two requests of 30 tokens search
    a handful of times, not every step, and decode plainly, as plain greedy decoding does."""
    from augury.speculative.policy import StepPlan

    plain = LLM(str(ckpts["bigram"]), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    llm = LLM(str(ckpts["bigram"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
              speculative_policy="adaptive", log_stats_interval=0, max_num_seqs=2)
    spec = llm.engine.speculator
    spec.policy.plan = lambda reqs: StepPlan(None, tuple(0 for _ in reqs))
    spec.policy.free_cut = lambda batch, probs, reaches=None: 0
    searches = []
    draft_for = spec.drafter.draft_for
    spec.drafter.draft_for = lambda r, *a, **k: searches.append(r) or draft_for(r, *a, **k)
    starts = [p[:2] for p in _prompts(2, seed=7)]
    prompts = [p + o.token_ids for p, o in zip(starts, plain.generate(starts, _greedy([40] * 2), use_tqdm=False))]
    params = _greedy([30, 30])
    two = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in two] == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert sum(o.spec_stats.num_verify_steps for o in two) == 0
    assert 2 <= len(searches) <= 12  # (searched every step: 48)
    _assert_no_leak(llm)


def test_a_request_without_a_copy_waits_before_its_next_suffix_search_above_batch_one(ckpts):
    """Above batch 1 (LOOK_WAIT): a request whose search found no copy is searched again only after
    4 more tokens, then 8, 16, at most 32; one that found a copy is searched every step; at batch 1
    every step searches."""
    from augury.speculative.worker import LOOK_WAIT

    llm = LLM(str(ckpts["bigram"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
              speculative_policy="adaptive", log_stats_interval=0, max_num_seqs=2)
    spec = llm.engine.speculator

    class Req:  # the part of a Request the back-off reads
        all_token_ids = list(range(10))

    r = Req()
    assert spec._may_look(r, 2) and spec._may_look(r, 1)
    waits = []
    for _ in range(6):
        spec._looked(r, False)
        start = len(r.all_token_ids)
        while not spec._may_look(r, 2):
            assert spec._may_look(r, 1)  # a lone request always searches
            r.all_token_ids = r.all_token_ids + [0]
        waits.append(len(r.all_token_ids) - start)
    assert waits == [4, 8, 16, 32, 32, 32] and LOOK_WAIT == (4, 32)
    spec._looked(r, True)
    assert spec._may_look(r, 2)
    spec._looked(r, False)  # after a copy the wait starts again from the first
    r.all_token_ids = r.all_token_ids + [0] * 4
    assert spec._may_look(r, 2)
