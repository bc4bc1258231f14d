"""Load-aware speculation: the disable threshold, catch-up across it, and the adaptive decision."""
from __future__ import annotations

import pytest
import torch

from augury import LLM, SamplingParams
from augury.config import EngineConfig
from augury.speculative.adaptive import AdaptivePolicy, LinearCost
from augury.speculative.policy import StaticPolicy, TreeShape
from speculative_helpers import make_target, random_head

SHAPE = TreeShape(5, 1, 6)


# ------------------------------------------------------------------------- decision function

def test_cheap_verification_picks_the_full_tree():
    # memory-bound target: a forward costs the same for 1 or 6 tokens per request; drafting is nearly free
    policy = AdaptivePolicy(SHAPE, None, target_cost=LinearCost(0.040, 0.0, 1e-5), draft_cost=LinearCost(1e-5, 0, 0))
    assert policy.choose(1) == SHAPE


def test_expensive_verification_picks_zero():
    # compute-bound target: every verified token costs as much as the fixed overhead
    policy = AdaptivePolicy(SHAPE, None, target_cost=LinearCost(0.040, 0.0, 0.040), draft_cost=LinearCost(0.001, 0, 0))
    assert policy.choose(32) is None
    assert policy.best_depth(32) == 0


def test_crossover_moves_with_batch_size():
    # per-token cost small but growing with batch: speculate at batch 1, not at batch 64
    policy = AdaptivePolicy(SHAPE, None, target_cost=LinearCost(0.040, 0.001, 0.002), draft_cost=LinearCost(0.002, 0, 1e-4))
    assert policy.best_depth(1) > 0
    assert policy.best_depth(64) == 0
    depths = [policy.best_depth(b) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert depths == sorted(depths, reverse=True)  # never more speculation for a bigger batch


def test_low_acceptance_turns_speculation_off():
    policy = AdaptivePolicy(SHAPE, None, target_cost=LinearCost(0.040, 0.0, 0.004), draft_cost=LinearCost(0.004, 0, 0))
    assert policy.best_depth(1) > 0
    for _ in range(200):  # drafts keep being rejected
        policy.observe(1, policy.shape_for(1), 0.05, [0])
    assert policy.best_depth(1) == 0
    for _ in range(200):  # ... and then keep being accepted
        policy.observe(1, SHAPE, 0.05, [5])
    assert policy.best_depth(1) == SHAPE.num_steps


def test_measured_step_times_correct_the_cost_model():
    policy = AdaptivePolicy(SHAPE, None, target_cost=LinearCost(0.040, 0.0, 1e-5), draft_cost=LinearCost(0.001, 0, 0))
    before = policy.best_depth(8)
    assert before >= 3
    for _ in range(10):  # a speculative step really takes 10x what the model predicted
        policy.observe(8, SHAPE, 10 * policy.model_time(8, SHAPE.num_steps), [1])
        policy.observe(8, None, policy.model_time(8, 0), [])  # plain steps are as modelled
    assert policy.step_time(8, 5) == pytest.approx(10 * policy.model_time(8, 5), rel=1e-6)
    assert policy.best_depth(8) < before
    times = policy.step_times(8)
    assert times == sorted(times)  # deeper drafting never predicted cheaper


@pytest.mark.parametrize("samples", [
    [(1, 1, 0.0524), (1, 8, 0.0570)],  # one batch size (max_num_seqs=1): a and b cannot be told apart
    [(b, n, 0.040 + 0.002 * b + 0.003 * b * n) for b in (1, 4, 16) for n in (1, 8)],
])
def test_cost_fit_reproduces_its_samples(samples):
    cost = LinearCost.fit(samples)
    for b, n, t in samples:
        assert cost(b, n) == pytest.approx(t, rel=0.15)
    assert min(cost.a, cost.b, cost.c) >= 0


def test_shallower_trees_keep_their_node_budget():
    tree = AdaptivePolicy(TreeShape(5, 4, 12), None)
    # depth 1 has only topk candidates; from depth 2 on, the budget fits
    assert [tree.shape_for(d) for d in (1, 2, 3)] == [TreeShape(1, 4, 5), TreeShape(2, 4, 12), TreeShape(3, 4, 12)]
    assert tree.shape_for(5) == TreeShape(5, 4, 12)
    assert [AdaptivePolicy(SHAPE, None).shape_for(d) for d in (1, 3)] == [TreeShape(1, 1, 2), TreeShape(3, 1, 4)]


def test_exploration_remeasures_the_stalest_depth():
    """A depth that looked slow once (say, measured while the machine was busy) is measured
    again: exploring steps go to the depth seen longest ago, and a fresh fast measurement
    brings it back into use."""
    from augury.speculative.adaptive import EXPLORE_EVERY

    policy = AdaptivePolicy(TreeShape(4, 1, 5), None, target_cost=LinearCost(0.040, 0.0, 1e-5),
                            draft_cost=LinearCost(0.002, 0, 0), prior=[0.7, 0.5, 0.35, 0.25])
    for d in range(5):
        policy.observe(1, policy.shape_for(d) if d else None, 0.040 + 0.002 * d, [min(d, 2)] if d else [])
    for _ in range(3):  # depth 3 once measured at 10x its real cost
        policy.observe(1, policy.shape_for(3), 0.5, [3])
    explored = []
    for _ in range(12 * EXPLORE_EVERY):
        shape = policy.choose(1)
        depth = shape.num_steps if shape else 0
        if policy.steps % EXPLORE_EVERY == 0:
            explored.append(depth)
        policy.observe(1, shape, 0.040 + 0.002 * depth, [min(depth, 2)])
    assert 3 in explored and len(set(explored)) >= 3  # depths not in use get re-measured in turn
    assert policy.step_time(1, 3) < 0.1  # the stale slow figure was replaced


def test_a_tree_is_drafted_whole_or_not_at_all():
    tree = TreeShape(3, 4, 8)
    cheap = AdaptivePolicy(tree, None, target_cost=LinearCost(0.040, 0.0, 1e-5), draft_cost=LinearCost(0.002, 0, 0))
    dear = AdaptivePolicy(tree, None, target_cost=LinearCost(0.040, 0.0, 0.040), draft_cost=LinearCost(0.002, 0, 0))
    assert {cheap.choose(1) for _ in range(100)} == {tree}
    assert {dear.choose(32) for _ in range(100)} == {None}


@pytest.mark.parametrize("policy_cls", [StaticPolicy, AdaptivePolicy])
def test_threshold_caps_every_policy(policy_cls):
    policy = policy_cls(SHAPE, 4)
    assert policy.choose(4) is not None
    assert policy.choose(5) is None


# --------------------------------------------------------------------- threshold configuration

def test_threshold_from_argument_and_environment(monkeypatch):
    monkeypatch.setenv("AUGURY_SPEC_DISABLE_BATCH_THRESHOLD", "7")
    assert EngineConfig.create().speculative_disable_batch_threshold == 7
    assert EngineConfig.create(speculative_disable_batch_threshold=3).speculative_disable_batch_threshold == 3
    monkeypatch.delenv("AUGURY_SPEC_DISABLE_BATCH_THRESHOLD")
    assert EngineConfig.create().speculative_disable_batch_threshold is None


@pytest.mark.parametrize("raw", ["abc", "-3", "0", "2.5"])
def test_bad_threshold_environment_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("AUGURY_SPEC_DISABLE_BATCH_THRESHOLD", raw)
    with pytest.raises(ValueError, match="AUGURY_SPEC_DISABLE_BATCH_THRESHOLD"):
        EngineConfig.create()


@pytest.mark.parametrize("value", [-3, 0, "4", 2.0, True])
def test_bad_threshold_argument_names_the_argument(value):
    with pytest.raises(ValueError, match="speculative_disable_batch_threshold"):
        EngineConfig.create(speculative_disable_batch_threshold=value)


# ------------------------------------------------------------------- end to end across it

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    return make_target(root / "target"), random_head(root / "head")


@pytest.mark.parametrize("policy, window", [("static", 128), ("adaptive", 128), ("static", 2)])
def test_batch_shrinking_across_threshold_is_exact(ckpts, policy, window):
    """window 2: the head catches up on only the last 2 positions it missed (the rest zeroed)."""
    target, head = ckpts
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (5 + 3 * i,), generator=g).tolist() for i in range(8)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (4, 6, 8, 10, 12, 30, 36, 40)]
    want = [o.token_ids for o in LLM(str(target), dtype="float32", speculative_algorithm="none",
                                     log_stats_interval=0).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(target), dtype="float32", draft_model=str(head), speculative_algorithm="eagle3",
              speculative_policy=policy, speculative_disable_batch_threshold=3, speculative_num_steps=3,
              speculative_eagle_topk=1, speculative_num_draft_tokens=4, log_stats_interval=0)
    llm.engine.speculator.catch_up_window = window
    if policy == "adaptive":  # make drafting look free so that the threshold is what decides
        llm.engine.speculator.policy.target_cost = LinearCost(1.0, 0.0, 0.0)
        llm.engine.speculator.policy.draft_cost = LinearCost(0.0, 0.0, 0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    verify_steps = [o.spec_stats.num_verify_steps for o in outs]
    assert verify_steps[:4] == [0, 0, 0, 0]  # finished while more than 3 were running
    assert all(v > 0 for v in verify_steps[5:])  # speculated once the batch shrank
    assert llm.engine.stats.steps_plain > 0 and llm.engine.stats.steps_spec > 0
    a = llm.engine.allocator
    assert a.num_free == a.num_usable


def test_measured_acceptance_is_the_prior():
    costs = dict(target_cost=LinearCost(0.040, 0.0, 0.004), draft_cost=LinearCost(0.004, 0, 0))
    weak = AdaptivePolicy(SHAPE, None, prior=[0.1, 0.01], **costs)
    strong = AdaptivePolicy(SHAPE, None, prior=[0.9, 0.8, 0.7, 0.6, 0.5], **costs)
    assert weak.best_depth(1) == 0
    assert strong.best_depth(1) >= 3
    assert strong.expected_accepted(5) == pytest.approx(0.9 + 0.8 + 0.7 + 0.6 + 0.5)


def test_steps_that_catch_up_a_backlog_are_not_timed(ckpts):
    """The first speculative step after a prompt (or after plain steps) also feeds the head
    every position it missed; its time says nothing about drafting, so the policy gets its
    acceptance but not its time."""
    target, head = ckpts
    llm = LLM(str(target), draft_model=str(head), speculative_algorithm="eagle3", speculative_policy="static",
              speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, dtype="float32",
              log_stats_interval=0.0)
    seen = []
    llm.engine.speculator.policy.observe = lambda b, shape, s, acc, timed=True, **kw: seen.append(timed)
    llm.generate([[5] * 20], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert seen[0] is False  # the 20-token prompt was caught up in this step
    assert len(seen) > 1 and all(seen[1:])  # afterwards each step catches up only what it committed
