"""Per-request draft budgets (SamplingParams.max_draft_tokens): trees cut per row, root-only rows
that are plain decode steps, padding nodes that can never be accepted, greedy output unchanged."""
from __future__ import annotations

import pytest
import torch

from augury import LLM, SamplingParams
from augury.speculative.tree import DraftTree, cap_trees, depth_from_parents, with_root_only_rows
from augury.speculative.verifier import verify
from speculative_helpers import checkpoints, verify_greedy, verify_sampling


def _tree(tokens, parents) -> DraftTree:
    p = torch.tensor(parents)
    return DraftTree(tokens=torch.tensor(tokens), parents=p, depth=depth_from_parents(p))


# ------------------------------------------------------------------------------------- trees

def test_sampling_params_validates_max_draft_tokens():
    assert SamplingParams().max_draft_tokens is None
    assert SamplingParams(max_draft_tokens=0).max_draft_tokens == 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="^max_draft_tokens"):
            SamplingParams(max_draft_tokens=bad)


def test_cap_trees_keeps_each_rows_first_nodes_and_cuts_unused_columns():
    tree = _tree([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]], [[-1, 0, 0, 1, 3], [-1, 0, 1, 2, 3]])
    assert cap_trees(tree, [None, None]) is tree
    capped = cap_trees(tree, [2, 1])
    assert capped.num_nodes == 3 and capped.sizes == [3, 2]
    assert capped.tokens.tolist() == [[10, 11, 12], [20, 21, 22]]
    assert capped.deepest() == [1, 1]
    assert cap_trees(tree, [0, 3]).sizes == [1, 4] and cap_trees(tree, [0, 3]).deepest() == [0, 3]
    with pytest.raises(ValueError):
        DraftTree(tokens=tree.tokens, parents=tree.parents, depth=tree.depth, sizes=[0, 5])


def test_root_only_rows_sit_between_the_drafted_ones():
    tree = cap_trees(_tree([[10, 11, 12], [20, 21, 22]], [[-1, 0, 1], [-1, 0, 0]]), [None, 1])
    full = with_root_only_rows(tree, [1, 3], [7, 8])
    assert full.sizes == [1, 3, 1, 2]
    assert full.tokens[:, 0].tolist() == [7, 10, 8, 20]
    assert full.parents[0].tolist() == [-1, 0, 0] and full.depth[0].tolist() == [0, 1, 1]
    assert full.deepest() == [0, 2, 0, 1]


def test_padding_nodes_are_never_accepted_greedy_or_sampled():
    """Row 0 offers node 1 only; node 2 (padding) holds exactly the target's choice, and node 1 does not."""
    v = 6
    tree = DraftTree(tokens=torch.tensor([[0, 4, 3], [0, 4, 3]]), parents=torch.tensor([[-1, 0, 0], [-1, 0, 0]]),
                     depth=torch.tensor([[0, 1, 1], [0, 1, 1]]), sizes=[2, 3])
    logits = torch.full((2, 3, v), -10.0)
    logits[:, 0, 3] = 10.0  # at the root the target wants token 3
    res = verify_greedy(tree, logits)
    assert res.accepted_nodes == [[0], [0, 2]]
    assert res.bonus_tokens[0] == 3  # row 0 emits 3 as its bonus: same token, not through padding
    probs = torch.zeros(2, 3, v)
    probs[:, :, 3] = 1.0
    for seed in range(5):
        out = verify_sampling(tree, probs, torch.rand(2, 2, generator=torch.Generator().manual_seed(seed)).tolist())
        assert out.accepted_nodes[0] == [0] and out.accepted_nodes[1] == [0, 2]
    # a root-only row verifies exactly as a decode step: its bonus is the argmax at the root
    one = DraftTree(tokens=tree.tokens, parents=tree.parents, depth=tree.depth, sizes=[1, 1])
    got = verify(one, logits, [0.0, 0.0], [None, None], [1.0, 1.0], None)
    assert got.accepted_nodes == [[0], [0]] and got.bonus_tokens == [3, 3]


# ------------------------------------------------------------------------------------ engine

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("budget"))


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (3 + (7 * i) % 23,), generator=g).tolist() for i in range(n)]


def _eagle3(target, head, shape=(3, 2, 6), **kw) -> LLM:
    return LLM(str(target), dtype="float32", draft_model=str(head), speculative_algorithm="eagle3",
               speculative_policy="static", speculative_num_steps=shape[0], speculative_eagle_topk=shape[1],
               speculative_num_draft_tokens=shape[2], log_stats_interval=0, **kw)


def _run_staggered(llm: LLM, prompts, params) -> list:
    """Requests join a few steps apart and finish at different lengths: the batch grows and shrinks."""
    eng, ids, got = llm.engine, [], {}
    for p, sp in zip(prompts, params):
        ids.append(eng.add_request(p, sp))
        for _ in range(2):
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o
    assert eng.allocator.num_free == eng.allocator.num_usable
    return [got[i] for i in ids]


BUDGETS = [0, None, 2, 1, 0, 3, None, 5]


def _check_budgets(outs, budgets, drafts_per_step: int) -> None:
    for o, cap in zip(outs, budgets):
        s = o.spec_stats
        if cap == 0:
            assert s.num_verify_steps == 0 and s.num_draft_tokens == 0 and s.num_accepted_draft_tokens == 0
        else:
            assert s.num_verify_steps > 0, cap
            limit = drafts_per_step if cap is None else min(cap, drafts_per_step)
            assert s.num_draft_tokens == limit * s.num_verify_steps, (cap, s)
            assert s.num_accepted_draft_tokens <= s.num_draft_tokens


@pytest.mark.parametrize("which", ["random-head", "bigram-head"])
def test_mixed_budgets_greedy_equals_plain(ckpts, which):
    target, head = (ckpts["target"], ckpts["head"]) if which == "random-head" else (ckpts["bigram"], ckpts["bigram_head"])
    prompts = _prompts(len(BUDGETS), seed=4)
    lens = [20, 9, 26, 14, 31, 7, 18, 24]
    plain = LLM(str(target), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    want = [o.token_ids for o in plain.generate(
        prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens], use_tqdm=False)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, max_draft_tokens=c)
              for m, c in zip(lens, BUDGETS)]
    llm = _eagle3(target, head, speculative_ngram_branch=0, max_num_seqs=8)
    outs = _run_staggered(llm, prompts, params)
    assert [o.token_ids for o in outs] == want
    _check_budgets(outs, BUDGETS, 5)
    if which == "bigram-head":  # high acceptance: uncapped requests take more than a capped-at-1 one can
        per_step = [o.spec_stats.accept_length for o in outs]
        assert per_step[1] > 2.5 and per_step[3] <= 2.0


def test_budget_caps_the_grafted_branch_and_mixed_acceptance(ckpts):
    """Bigram target, random head, prompt-lookup branch: prompts already in the target's cycle get
    long accepted branches, random ones little; caps cut the branch (it sits after the head's nodes)."""
    bigram = ckpts["bigram"]
    plain = LLM(str(bigram), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    starts = [p[:2] for p in _prompts(3, seed=7)]
    cyc = [p + o.token_ids for p, o in zip(starts, plain.generate(
        starts, [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)] * 3, use_tqdm=False))]
    prompts = [cyc[0], _prompts(1, seed=1)[0], cyc[1], _prompts(1, seed=2)[0], cyc[2]]
    budgets = [None, None, 2, 0, 6]
    lens = [22, 15, 19, 12, 25]
    want = [o.token_ids for o in plain.generate(
        prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens], use_tqdm=False)]
    llm = _eagle3(bigram, ckpts["head"], shape=(2, 2, 4), speculative_ngram_branch=6, max_num_seqs=8)
    outs = _run_staggered(llm, prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                                        max_draft_tokens=c) for m, c in zip(lens, budgets)])
    assert [o.token_ids for o in outs] == want
    for o, cap in zip(outs, budgets):
        s = o.spec_stats
        if cap == 0:
            assert s.num_verify_steps == 0
        elif cap is not None:
            assert 0 < s.num_draft_tokens <= cap * s.num_verify_steps
    assert outs[0].spec_stats.accept_length > 3  # the branch is accepted deep when uncapped
    assert outs[2].spec_stats.accept_length <= 3  # at most 2 drafts + the bonus per step


def test_all_budgets_zero_decodes_plainly(ckpts):
    llm = _eagle3(ckpts["target"], ckpts["head"])
    outs = llm.generate(_prompts(3, seed=9), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                            max_draft_tokens=0), use_tqdm=False)
    assert all(o.spec_stats.num_verify_steps == 0 for o in outs)
    assert llm.engine.stats.steps_spec == 0 and llm.engine.stats.num_verify_steps == 0


def test_opted_out_requests_alone_collect_no_target_features(ckpts):
    """A forward whose requests all set max_draft_tokens=0 does not collect the head's features (they
    never draft); one that also runs a request that may draft collects them for every row."""
    llm = _eagle3(ckpts["target"], ckpts["head"])
    eng, model = llm.engine, llm.engine.model
    asked = []
    forward = model.forward

    def spy(ids, positions, attn, layers=()):
        asked.append((ids.shape[0], tuple(layers)))
        return forward(ids, positions, attn, layers)

    model.forward = spy
    quiet = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, max_draft_tokens=0)
    rid = eng.add_request(_prompts(1, seed=4)[0], quiet)
    for _ in range(4):
        eng.step()
    assert asked and all(layers == () for _, layers in asked)
    assert eng.requests[rid].num_pending == 0
    asked.clear()
    eng.add_request(_prompts(1, seed=5)[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert asked and all(layers for _, layers in asked)
    assert eng.stats.num_verify_steps > 0


def test_sampled_rows_with_budgets_stay_reproducible(ckpts):
    llm = _eagle3(ckpts["target"], ckpts["head"])
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True, max_draft_tokens=c)
              for i, c in enumerate([0, 1, None])]
    a = [o.token_ids for o in llm.generate(_prompts(3, seed=3), params, use_tqdm=False)]
    b = [o.token_ids for o in llm.generate(_prompts(3, seed=3), params, use_tqdm=False)]
    assert a == b and all(len(t) == 10 for t in a)


def test_adaptive_policy_learns_acceptance_only_as_deep_as_a_request_was_offered():
    """A request capped at depth 1 that accepted its one draft says nothing about depth 2 or 3."""
    from augury.speculative.adaptive import AdaptivePolicy
    from augury.speculative.policy import TreeShape

    shape = TreeShape(3, 1, 4)
    capped, full = AdaptivePolicy(shape, None), AdaptivePolicy(shape, None)
    for _ in range(20):
        capped.observe(1, shape, 0.01, [1], offered=[1])
        full.observe(1, shape, 0.01, [1])
    fresh = AdaptivePolicy(shape, None)
    assert capped.off[1:] == fresh.off[1:] and capped.acc[1:] == fresh.acc[1:]
    assert capped.acc[0] / capped.off[0] > fresh.acc[0] / fresh.off[0]  # depth 1 was learned
    assert full.acc[1] / full.off[1] < fresh.acc[1] / fresh.off[1]  # uncapped: depth 2 offered and rejected


def test_budget_cut_trees_are_verified_packed(ckpts, monkeypatch):
    """Rows cut short by a budget cost no target rows: the verification forward runs only the real
    nodes, packed into one row (sum of the rows' sizes), and greedy output stays plain's. The
    bfloat16 run checks it bit for bit against plain decoding (row-independent kernels)."""
    for dtype in ("float32", "bfloat16"):
        target, head = ckpts["target"], ckpts["head"]
        budgets = [0, 2, None, 1]
        prompts = _prompts(len(budgets), seed=8)
        lens = [12, 15, 10, 13]
        plain = LLM(str(target), dtype=dtype, speculative_algorithm="none", log_stats_interval=0)
        want = [o.token_ids for o in plain.generate(
            prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens], use_tqdm=False)]
        llm = LLM(str(target), dtype=dtype, draft_model=str(head), speculative_algorithm="eagle3",
                  speculative_policy="static", speculative_num_steps=3, speculative_eagle_topk=2,
                  speculative_num_draft_tokens=6, speculative_ngram_branch=0, log_stats_interval=0)
        shapes = []
        forward = llm.engine.model.forward
        monkeypatch.setattr(llm.engine.model, "forward", lambda ids, *a, **k: shapes.append(tuple(ids.shape))
                            or forward(ids, *a, **k))
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, max_draft_tokens=c)
                  for m, c in zip(lens, budgets)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == want, dtype
        # while all four run, a step verifies 1 + 3 + 6 + 2 real nodes packed, not 4 x 6 padded
        assert (1, 1 + 3 + 6 + 2) in shapes, shapes
        assert (4, 6) not in shapes


def test_a_long_backlog_beside_a_request_near_the_context_end(ckpts):
    """The head catches up a batch's rows padded to the longest backlog: a new request's prompt (40
    positions) beside one a few positions from the end of the context. The short row's padding must
    stay inside the head's rope table (it ran past it: IndexError in augury bench at batch 48); greedy
    output equals plain decoding's."""
    target, head = ckpts["target"], ckpts["head"]
    first, other = _prompts(2, seed=9)
    first, long_prompt = (first * 4)[:10], (other * 8)[:40]
    params = [SamplingParams(max_tokens=52, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    plain = LLM(str(target), dtype="float32", speculative_algorithm="none", log_stats_interval=0, max_model_len=64)
    want = [plain.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip([first, long_prompt], params)]
    llm = _eagle3(target, head, speculative_ngram_branch=0, max_num_seqs=4, max_model_len=64)
    eng, got = llm.engine, {}
    a = eng.add_request(first, params[0])
    for _ in range(200):  # until the first request is within a few positions of the context's end
        for o in eng.step():
            got[o.request_id] = o
        if eng.scheduler.running[0].num_computed >= 56:
            break
    assert a not in got or not got[a].finished
    b = eng.add_request(long_prompt, params[1])
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] = o
    assert [got[a].token_ids, got[b].token_ids] == want
