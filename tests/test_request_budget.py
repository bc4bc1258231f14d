"""Per-request draft budgets chosen by the adaptive policy: each request's own running acceptance,
one step's goodput maximised over every request's budget (AdaptivePolicy.plan)."""
from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from augury import LLM, SamplingParams
from augury.core.request import Request
from augury.speculative.adaptive import EXPLORE_SHARE, AdaptivePolicy
from augury.speculative.policy import StaticPolicy, TreeShape
from policy_helpers import fake_clock, teach_times
from speculative_helpers import checkpoints, make_target

CHAIN, TREE = TreeShape(5, 1, 6), TreeShape(3, 4, 8)


def _req(i: int, cap: int | None = None) -> Request:
    return Request(str(i), [1, 2, 3], SamplingParams(max_draft_tokens=cap))


def _policy(shape: TreeShape, threshold: int | None = None, batches=(1, 2, 3, 4, 8), per_node: float = 0.002
            ) -> AdaptivePolicy:
    """A policy that measured, at these batch sizes, 40 ms a plain step and drafting at 2 ms a node a
    row (a memory-bound target: a rejected draft does not pay, an accepted one does)."""
    policy = AdaptivePolicy(shape, threshold)
    for b in batches:
        teach_times(policy, b, 0.040, {d: 0.040 + 0.002 + per_node * b * policy.shape_for(d).num_drafts
                                       for d in policy.depths()})
    return policy


def _teach(policy: AdaptivePolicy, shape: TreeShape, reqs: list[Request], accepted: list[int], times: int = 10):
    for _ in range(times):
        policy.plan(reqs)  # (planning is where the spread of acceptance between requests is learned)
        policy.observe(len(reqs), shape, 0.05, list(accepted), timed=False, reqs=reqs)
    for r in reqs:  # judged just now (the exploration rule tries it again once its draws are as old as many)
        policy._own(r).last = policy.steps


def _plan(policy: AdaptivePolicy, reqs: list[Request]):
    """The rule's own plan: every figure fresh (each arm's timed steps and each request's draws as of
    this step), so nothing is due for exploration (plain decoding or an arm re-measured, a request tried)."""
    bk = policy._bucket(len(reqs))
    bk.probe = None
    for a in bk.arms.values():
        a.last = bk.steps + 1
    for r in reqs:
        policy._own(r).last = policy.steps + 1
    return policy.plan(reqs)


# ------------------------------------------------------------------------------ the rule

@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_low_acceptance_request_gets_nothing_while_a_high_one_drafts_the_whole_tree(shape):
    policy = _policy(shape)
    high, low = _req(0), _req(1)
    _teach(policy, shape, [high, low], [shape.num_steps, 0])
    plan = _plan(policy, [high, low])
    assert plan.shape == shape and plan.caps == (None, 0)  # the whole tree (None: no cut) and nothing
    assert policy.request_expected(high)[-1] > 2 and policy.request_expected(low)[-1] < 0.25 * policy.request_expected(high)[-1]
    # the batch-level estimate is the mixture of the two
    assert policy.request_expected(low)[-1] < policy.expected_accepted(shape.num_steps) < policy.request_expected(high)[-1]


def test_a_chain_gives_each_request_its_own_depth():
    """Accepts its first draft, never a second: not the whole chain where nodes are dear (4 ms a node a
    row), beside a request that drafts all of it and one that drafts nothing."""
    policy = AdaptivePolicy(CHAIN, None)
    teach_times(policy, 3, 0.040, {d: 0.040 + 0.004 * 3 * d for d in policy.depths()})
    high, mid, low = _req(0), _req(1), _req(2)
    _teach(policy, CHAIN, [high, mid, low], [5, 1, 0])
    assert policy.request_rates(mid)[0] > 0.8 and policy.request_rates(mid)[1] < 0.3
    plan = _plan(policy, [high, mid, low])
    assert plan.shape == CHAIN
    assert plan.caps[0] is None and plan.caps[2] == 0
    assert plan.caps[1] is not None and plan.caps[1] <= 2


def test_the_step_keeps_a_shallower_chain_when_no_request_drafts_deeper():
    policy = _policy(CHAIN)
    mid, low = _req(0), _req(1)
    _teach(policy, CHAIN, [mid, low], [1, 0], times=30)
    plan = _plan(policy, [mid, low])
    assert plan.shape is not None and plan.shape.num_steps <= 2  # no draft forward beyond what is used
    assert plan.caps[1] == 0


@pytest.mark.parametrize("shape", [CHAIN, TREE, TreeShape(4, 1, 5), TreeShape(2, 2, 4)])
@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_uniform_acceptance_matches_the_batch_level_choice(shape, accepted):
    """With one acceptance for all, goodput is monotonic in the number of drafting rows: every
    request drafts the batch-level choice, or none does."""
    for batch in (1, 2, 4, 8):
        one, other = _policy(shape), _policy(shape)
        reqs = [_req(i) for i in range(batch)]
        for p in (one, other):
            _teach(p, shape, [_req(-1)], [min(accepted, shape.num_steps)], times=5 * batch)
        for r in reqs:  # each request's own rates are the batch's (nothing of its own yet), judged just now
            other._own(r).last = other.steps
        want = one.choose(batch)
        plan = other.plan(reqs)
        assert plan.shape == want, (batch, accepted)
        assert plan.caps == ((None,) * batch if want else (0,) * batch)


def test_own_caps_hold_and_zero_never_drafts():
    rng = random.Random(0)
    for shape in (CHAIN, TREE):
        policy = _policy(shape, batches=range(1, 9))
        for _ in range(200):
            caps = [rng.choice([None, None, 0, 1, 2, 3, 9]) for _ in range(rng.randint(1, 8))]
            reqs = [_req(i, c) for i, c in enumerate(caps)]
            plan = policy.plan(reqs)
            for cap, got in zip(caps, plan.caps):
                if cap == 0 or plan.shape is None:
                    assert got == 0
                elif cap is not None:
                    assert got is not None and got <= cap
            accepted = [rng.randint(0, shape.num_steps) for _ in plan.drafting]
            policy.observe(len(reqs), plan.shape, 0.05, accepted, timed=False,
                           reqs=[reqs[i] for i in plan.drafting])


def test_the_threshold_caps_the_per_request_rule():
    policy = _policy(CHAIN, 2)
    high = _req(0)
    _teach(policy, CHAIN, [high], [5])
    assert _plan(policy, [high, _req(1)]).shape is not None
    assert policy.plan([high, _req(1), _req(2)]).shape is None


def test_static_policy_plans_the_tree_with_each_requests_own_cap():
    policy = StaticPolicy(TREE, 3)
    plan = policy.plan([_req(0), _req(1, 0), _req(2, 2)])
    assert plan.shape == TREE and plan.caps == (None, 0, 2) and plan.drafting == [0, 2]
    assert policy.plan([_req(i) for i in range(4)]).shape is None


@pytest.mark.parametrize("shape", [TreeShape(4, 1, 5), TreeShape(3, 2, 6)], ids=["chain", "tree"])
def test_temperature_one_requests_that_accept_little_stay_out(shape):
    """Sampled drafts: half the batch accepts each level with probability 0.85 (text that copies),
    half with 0.15 (free text at temperature 1). The step keeps speculating, the first half drafts
    every step but for exploration, the second is left out but for a rare retry."""
    rng = random.Random(0)
    policy = _policy(shape, per_node=0.0005)
    reqs = [_req(i) for i in range(8)]
    rate = [0.85 if i % 2 == 0 else 0.15 for i in range(8)]
    drafted, speculated, steps = [0] * 8, 0, 600
    for step in range(steps):
        plan = policy.plan(reqs)
        accepted, offered = [], []
        for i in plan.drafting:
            depth = plan.shape.num_steps if plan.caps[i] is None else min(plan.caps[i], plan.shape.num_steps)
            a = 0
            while a < depth and rng.random() < rate[i]:
                a += 1
            accepted.append(a)
            offered.append(depth)
            drafted[i] += step >= 50
        speculated += bool(plan.drafting) and step >= 50
        policy.observe(8, plan.shape, 0.05, accepted, timed=False, offered=offered,
                       reqs=[reqs[i] for i in plan.drafting])
    n = steps - 50
    assert speculated >= 0.95 * n  # the decision to speculate holds (plain steps are exploration)
    assert min(drafted[0::2]) >= 0.93 * n
    assert max(drafted[1::2]) < 0.1 * n
    assert sum(drafted[1::2]) > 0  # a request left out is tried again now and then


def test_a_request_starts_from_the_batch_estimate_and_moves_to_its_own():
    policy = AdaptivePolicy(CHAIN, None)
    old, new = _req(0), _req(1)
    _teach(policy, CHAIN, [old], [5], times=40)
    assert policy.request_rates(new) == pytest.approx(policy.rates())
    first = policy.request_rates(new)[0]
    for n in range(6):
        policy.observe(1, CHAIN, 0.05, [0], timed=False, reqs=[new])
    assert policy.request_rates(new)[0] < 0.5 * first  # its rejections weigh more than the prior
    assert policy.request_rates(old)[0] > 0.9


def test_requests_that_accept_alike_keep_the_batchs_rate():
    """Empirical Bayes: among requests whose acceptance is the same, a request's own few draws are
    mostly noise, and its estimate stays near the batch's; where requests differ, each gets its own."""
    rng = random.Random(1)
    alike, mixed = AdaptivePolicy(TREE, None), AdaptivePolicy(TREE, None)
    for policy, rates in ((alike, [0.6] * 16), (mixed, [0.95, 0.1] * 8)):
        reqs = [_req(i) for i in range(16)]
        for _ in range(200):
            policy.plan(reqs)
            acc = []
            for r in rates:
                a = 0
                while a < 3 and rng.random() < r:
                    a += 1
                acc.append(a)
            policy.observe(16, TREE, 0.05, acc, timed=False, reqs=reqs)
        own = [policy.request_rates(r)[0] for r in reqs]
        if policy is alike:
            assert max(own) - min(own) < 0.15, own
        else:
            assert min(own[0::2]) > 0.8 and max(own[1::2]) < 0.3, own


def test_alone_a_request_whose_last_drafts_failed_is_tried_again_within_the_credit():
    """Batch 1: a request whose own drafts failed stops drafting, and is tried again now and then
    (nothing else would bring it back: no other request drafts), its tries costing no more than the
    exploration credit (EXPLORE_SHARE of the time); a try that succeeds brings it back for good."""
    policy = _policy(CHAIN)
    req = _req(1)
    _teach(policy, CHAIN, [req], [0], times=12)
    tries, spent, lost = 0, 0.0, 0.0
    for _ in range(3000):
        plan = policy.plan([req])
        if plan.drafting:
            tries += 1
            seconds = 0.042 + 0.002 * plan.shape.num_drafts
            policy.observe(1, plan.shape, seconds, [0], reqs=[req])
            lost += seconds - 0.040
        else:
            seconds = 0.040
            policy.observe_plain(1, seconds)
        spent += seconds
    assert tries >= 3 and lost <= EXPLORE_SHARE * spent + 0.052, (tries, lost, spent)
    # now it copies: one good try and it drafts every step
    for _ in range(3000):
        plan = policy.plan([req])
        if plan.drafting:
            break
        policy.observe_plain(1, 0.040)
    assert plan.drafting
    for _ in range(3):
        policy.observe(1, CHAIN, 0.05, [5], timed=False, reqs=[req])
    assert all(_plan(policy, [req]).drafting for _ in range(10))


def test_a_requests_state_goes_with_it():
    policy = AdaptivePolicy(CHAIN, None)
    reqs = [_req(i) for i in range(3)]
    _teach(policy, CHAIN, reqs, [1, 2, 3], times=1)
    assert len(policy.own) == 3
    del reqs
    gc.collect()
    assert len(policy.own) == 0


def test_a_mixed_steps_time_is_scaled_to_the_whole_shape():
    """Half the rows left out: the drafting part of the measured time is scaled up by their share,
    so the measurement stands for the whole shape at this batch size; a sliver is not timed."""
    from augury.speculative.arms import MIN_SEEN

    policy = AdaptivePolicy(CHAIN, None)
    teach_times(policy, 8, 0.040, {})
    share = policy.drafting_share(8, 5, [5, 5, 5, 5, 0, 0, 0, 0])
    assert 0.4 < share < 0.6
    t5 = 0.080
    for _ in range(MIN_SEEN):
        # half the rows drafted: the step took the plain time plus that share of the extra
        policy.observe(8, CHAIN, 0.040 + share * (t5 - 0.040), [1, 1, 1, 1], sizes=[6, 6, 6, 6, 1, 1, 1, 1])
    bk = policy.buckets[8]
    assert bk.arm(5).seconds() == pytest.approx(t5, rel=1e-6)
    policy.observe(8, CHAIN, 99.0, [1], sizes=[2] + [1] * 7)  # a sliver of the shape: not timed
    assert bk.arm(5).seconds() == pytest.approx(t5, rel=1e-6)


# -------------------------------------------------------------------------------- engine

def cyclic_target(root: Path, layers_scale: float = 0.02, seed: int = 5) -> Path:
    """A tiny float32 Llama whose greedy next token is, bar a few percent of positions where the
    context tips it, a fixed cycle through the whole vocabulary: the output layer holds each token's
    normed embedding at its successor's row, and the layers (scaled down) only nudge the residual
    stream. A prompt that already holds the walk ahead is continued by copying it (prompt lookup
    accepts long drafts); a random prompt is not (the walk is nowhere in it)."""
    base = make_target(root / "cyclic")
    w = load_file(str(base / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    vocab = emb.shape[0]
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    prev = torch.empty(vocab, dtype=torch.long)
    prev[order.roll(-1)] = order  # prev[v]: the token whose successor is v
    w["lm_head.weight"] = (emb / emb.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())[prev].clone()
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = w[k] * layers_scale
    save_file({k: v.contiguous() for k, v in w.items()}, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("request_budget")
    return {**checkpoints(root), "cyclic": cyclic_target(root)}


def _run_staggered(llm: LLM, prompts, params) -> list:
    """Requests join a few steps apart and finish at different lengths: the batch grows and shrinks."""
    eng, ids, got = llm.engine, [], {}

    def step():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o

    for p, sp in zip(prompts, params):
        ids.append(eng.add_request(p, sp))
        step()
        step()
    while eng.has_unfinished_requests():
        step()
    assert eng.allocator.num_free == eng.allocator.num_usable
    return [got[i] for i in ids]


def _fixed_costs_and_spy(policy: AdaptivePolicy, per_node: float) -> list:
    """Give the policy a fake clock (40 ms a step plus per_node a verified node, whatever the wall
    clock said), so its decisions depend on acceptance alone; returns the list its plans are recorded
    in, as (each request's own max_draft_tokens, the StepPlan)."""
    for b in range(1, 9):  # as if measured already, at every batch size these tests run
        teach_times(policy, b, 0.040, {d: 0.040 + per_node * b * policy.shape_for(d).num_drafts for d in policy.depths()})
    fake_clock(policy, 0.040, per_node)
    plan = policy.plan
    plans = []

    def spy(reqs):
        plans.append(([r.params.max_draft_tokens for r in reqs], plan(reqs)))
        return plans[-1][1]

    policy.plan = spy
    return plans


@pytest.mark.parametrize("algorithm", ["ngram", "eagle3"])
def test_per_request_budgets_greedy_equal_plain(ckpts, algorithm):
    """Half the prompts hold the walk their answer takes (prompt lookup accepts long drafts), half
    are random (drafts fail); the batch grows and shrinks; some requests carry their own caps. The
    adaptive policy, with a cost model where a rejected draft does not pay, leaves the random ones
    out while the copying ones draft deep, and the greedy output is plain decoding's token for token."""
    target = ckpts["cyclic"]
    plain = LLM(str(target), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    g = torch.Generator().manual_seed(11)
    starts = [torch.randint(3, 256, (1,), generator=g).tolist() for _ in range(4)]
    walks = [s + o.token_ids for s, o in zip(starts, plain.generate(
        starts, [SamplingParams(max_tokens=59, temperature=0.0, ignore_eos=True)] * 4, use_tqdm=False))]
    copy = [w + w[:12] for w in walks]  # the answer walks on from w[11]: prompt lookup copies w[12:]
    rand = [torch.randint(3, 256, (8 + 3 * i,), generator=g).tolist() for i in range(4)]
    prompts = [copy[0], rand[0], copy[1], rand[1], copy[2], rand[2], copy[3], rand[3]]
    caps = [None, None, None, 0, 3, None, None, 1]
    lens = [34, 28, 40, 14, 21, 36, 16, 30]
    want = [o.token_ids for o in plain.generate(
        prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens], use_tqdm=False)]

    if algorithm == "ngram":
        llm = LLM(str(target), dtype="float32", speculative_algorithm="ngram", speculative_policy="adaptive",
                  speculative_num_steps=4, speculative_eagle_topk=1, speculative_num_draft_tokens=5,
                  log_stats_interval=0, max_num_seqs=8)
    else:  # a random head (its drafts fail) and a prompt-lookup branch (copies succeed); no cache across
        # requests: the random prompts' answers join the cycle the copying ones already wrote, and drafts
        # from those would be accepted (tests/test_suffix.py checks that)
        llm = LLM(str(target), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
                  speculative_policy="adaptive", speculative_num_steps=2, speculative_eagle_topk=2,
                  speculative_num_draft_tokens=4, speculative_ngram_branch=6, log_stats_interval=0,
                  max_num_seqs=8, speculative_suffix_cache_tokens=0)
    policy = llm.engine.speculator.policy
    assert isinstance(policy, AdaptivePolicy)
    plans = _fixed_costs_and_spy(policy, 0.003)
    outs = _run_staggered(llm, prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                                        max_draft_tokens=c) for m, c in zip(lens, caps)])
    assert [o.token_ids for o in outs] == want

    for o, cap in zip(outs, caps):
        s = o.spec_stats
        if cap == 0:
            assert s.num_verify_steps == 0 and s.num_draft_tokens == 0
        elif cap is not None:
            assert s.num_draft_tokens <= cap * s.num_verify_steps
    # steps where an uncapped request got nothing while another drafted
    assert sum(bool(p.drafting) and any(u is None and c == 0 for u, c in zip(user, p.caps)) for user, p in plans) >= 3
    # the copying requests drafted in most of their steps and were accepted deep; the random ones seldom
    # (a request's steps: its tokens less those accepted from drafts)
    drafted = [o.spec_stats.num_verify_steps / (len(o.token_ids) - o.spec_stats.num_accepted_draft_tokens)
               for o in outs]
    assert min(outs[i].spec_stats.accept_length for i in (0, 2)) > 3
    assert min(drafted[i] for i in (0, 2)) > 0.6
    assert max(drafted[i] for i in (1, 5)) < 0.35
    assert policy.rows_drafted < policy.rows_planned


def test_per_request_budgets_on_a_random_target_greedy_equal_plain(ckpts):
    """A random target and head (every draft a guess), a tree with a prompt-lookup branch: requests
    drop out of drafting one by one as their own acceptance shows, the batch grows and shrinks,
    and every token is plain decoding's (any slip in the rows' caches or the packed verification
    changes the random target's choices)."""
    target = ckpts["target"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (4 + 5 * i,), generator=g).tolist() for i in range(7)]
    caps = [None, 2, None, 0, None, 5, None]
    lens = [18, 25, 12, 20, 30, 16, 22]
    plain = LLM(str(target), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    want = [o.token_ids for o in plain.generate(
        prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens], use_tqdm=False)]
    llm = LLM(str(target), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
              speculative_policy="adaptive", speculative_num_steps=3, speculative_eagle_topk=2,
              speculative_num_draft_tokens=6, speculative_ngram_branch=3, log_stats_interval=0, max_num_seqs=8)
    plans = _fixed_costs_and_spy(llm.engine.speculator.policy, 2e-4)
    outs = _run_staggered(llm, prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                                        max_draft_tokens=c) for m, c in zip(lens, caps)])
    assert [o.token_ids for o in outs] == want
    assert outs[3].spec_stats.num_verify_steps == 0
    assert outs[1].spec_stats.num_draft_tokens <= 2 * outs[1].spec_stats.num_verify_steps
    # the policy left out a request with no cap of its own while others drafted
    assert any(p.drafting and any(u is None and c == 0 for u, c in zip(user, p.caps)) for user, p in plans)
    assert sum(o.spec_stats.num_verify_steps for o in outs) >= 10
