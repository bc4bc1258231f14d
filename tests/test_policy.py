"""Load-aware speculation: the disable threshold, catch-up across it, and the adaptive decision."""
from __future__ import annotations

import time

import pytest
import torch

from augury import LLM, SamplingParams
from augury.config import EngineConfig
from augury.core.request import Request
from augury.speculative.adaptive import EXPLORE_SHARE, AdaptivePolicy, PRIOR_RATE
from augury.speculative.arms import FREE, MIN_SEEN, WINDOW
from augury.speculative.policy import StaticPolicy, TreeShape
from policy_helpers import fake_clock, teach_times
from speculative_helpers import make_target, random_head

SHAPE = TreeShape(5, 1, 6)
TREE = TreeShape(3, 4, 8)


def _reqs(n: int) -> list[Request]:
    return [Request(str(i), [1, 2, 3], SamplingParams()) for i in range(n)]


def _accept(policy: AdaptivePolicy, shape: TreeShape, accepted: int, times: int = 30) -> None:
    for _ in range(times):
        policy.observe(1, shape, 0.05, [accepted], timed=False)


# ------------------------------------------------------------------------- decision function

def test_a_fresh_policy_decodes_plainly_until_it_has_measured_both_arms():
    """Nothing is assumed about this machine: a bucket starts plain, then probes drafting."""
    policy = AdaptivePolicy(TREE, None)
    assert policy.choose(1) is None
    assert not policy.buckets[1].arms  # nothing measured yet: plain again
    teach_times(policy, 1, 0.040, {})
    assert policy.choose(1) == TREE  # plain measured: drafting is probed
    assert policy.buckets[1].probe == TREE.num_steps


@pytest.mark.parametrize("shape", [SHAPE, TREE], ids=["chain", "tree"])
def test_measured_cheap_drafting_is_chosen_and_dear_drafting_is_not(shape):
    cheap, dear = AdaptivePolicy(shape, None), AdaptivePolicy(shape, None)
    for p in (cheap, dear):
        _accept(p, shape, shape.num_steps)  # drafts accepted: drafting pays if its time allows
    teach_times(cheap, 1, 0.040, {d: 0.042 for d in cheap.depths()})
    teach_times(dear, 1, 0.040, {d: 0.040 * (2 + d) for d in dear.depths()})
    assert {cheap.choose(1) for _ in range(MIN_SEEN)} == {shape}  # before any figure is due again
    assert {dear.choose(1) for _ in range(WINDOW)} == {None}


@pytest.mark.parametrize("ratio, stops", [(20.0, True), (3.0, False)])
def test_a_probe_of_hopeless_drafting_stops_after_one_timed_step(ratio, stops):
    """A probe step that, even were every draft accepted, pays under half of plain decoding's tokens
    per second ends the probe at once (each probe step there costs many plain steps); a dear step
    that could still pay at full acceptance goes on being measured."""
    policy = AdaptivePolicy(TREE, None)
    b = 4
    policy.choose(b)
    teach_times(policy, b, 0.040, {})
    assert policy.choose(b) == TREE  # the probe's first step
    bk = policy.buckets[b]
    policy.observe(b, TREE, 0.040 * ratio, [0] * b, sizes=[TREE.num_draft_tokens] * b)
    assert len(bk.arm(TREE.num_steps).fresh) == 1
    nxt = policy.choose(b)
    if stops:
        assert nxt is None and bk.probe is None
        assert [policy.choose(b) for _ in range(WINDOW)] == [None] * WINDOW  # no credit to re-measure it soon
    else:
        assert nxt == TREE and bk.probe == TREE.num_steps


def test_each_batch_bucket_decides_from_its_own_measurements():
    """Verification cheap at small batches and dear at large ones: the crossover is where the
    measurements put it, bucket by bucket."""
    policy = AdaptivePolicy(TREE, None)
    _accept(policy, TREE, 3)
    for b in (1, 2, 4, 8, 16, 32, 64):
        plain = 0.020 + 0.001 * b
        teach_times(policy, b, plain, {3: plain + 0.003 + 0.008 * b})  # verification grows with the batch
    chosen = {b: policy.choose(b) is not None for b in (1, 2, 4, 8, 16, 32, 64)}
    assert chosen[1] and chosen[2] and not chosen[32] and not chosen[64]
    order = [chosen[b] for b in sorted(chosen)]
    assert order == sorted(order, reverse=True)  # never more speculation for a bigger batch


def test_low_acceptance_turns_speculation_off_and_high_brings_it_back():
    policy = AdaptivePolicy(SHAPE, None)
    teach_times(policy, 1, 0.040, {d: 0.040 + 0.004 * d for d in policy.depths()})
    _accept(policy, SHAPE, 5)
    assert policy.choose(1) is not None
    _accept(policy, SHAPE, 0, 200)  # drafts keep being rejected
    assert policy.choose(1) is None
    _accept(policy, SHAPE, 5, 200)  # ... and then keep being accepted
    assert policy.choose(1) == SHAPE


def test_plain_decoding_is_measured_while_speculating():
    """No speculation is an arm the policy explores: while drafting wins it still decodes plainly now
    and then (its figures as many steps old as the steps they rest on, the credit covering what a
    plain step loses), so plain decoding's time cannot go stale; and no more than EXPLORE_SHARE of the
    time is lost to it."""
    policy = AdaptivePolicy(TREE, None)
    _accept(policy, TREE, 3)
    teach_times(policy, 4, 0.040, {3: 0.045})
    lost, spent = 0.0, 0.0
    got = []
    for _ in range(2000):
        shape = policy.choose(4)
        got.append(shape)
        seconds = 0.040 if shape is None else 0.045
        policy.observe(4, shape, seconds, [3] * 4 if shape else [])
        spent += seconds
        lost += seconds - (4 if shape is None else 16) / (16 / 0.045)
    plain = [i for i, s in enumerate(got) if s is None]
    assert len(plain) >= 5 and max(b - a for a, b in zip(plain, plain[1:])) < 600
    assert lost <= EXPLORE_SHARE * spent + 0.040


def test_a_plain_arm_that_got_slower_turns_speculation_on():
    """Both arms are medians of their own steps: plain decoding measured slower (say, the machine's
    other load moved) is what makes drafting pay, with no model in between."""
    policy = AdaptivePolicy(TREE, None)
    _accept(policy, TREE, 1)
    teach_times(policy, 8, 0.040, {3: 0.090})
    assert {policy.choose(8) for _ in range(WINDOW)} == {None}
    teach_times(policy, 8, 0.080, {}, n=WINDOW)
    assert [policy.choose(8) for _ in range(3)].count(TREE) >= 2  # (one may be a plain exploration step)


def test_the_guard_turns_a_losing_bucket_off_and_keeps_its_retries_within_the_credit():
    """Predicted to pay (the books say every draft is accepted) but the steps emit only their roots:
    realized 2 tokens per 50 ms against plain's 2 per 40. The guard turns drafting off for the bucket
    whatever the prediction says, and its re-measurements cost no more than the exploration credit."""
    policy = AdaptivePolicy(TREE, None)
    _accept(policy, TREE, 3)
    teach_times(policy, 2, 0.040, {3: 0.050})
    drafted, lost, spent = 0, 0.0, 0.0
    for _ in range(4000):
        shape = policy.choose(2)
        if shape is None:
            policy.observe(2, None, 0.040, [])
            spent += 0.040
            continue
        drafted += 1
        policy.observe(2, shape, 0.050, [0, 0], timed=True)
        policy.acc = list(policy.off)  # the books keep saying everything is accepted
        spent += 0.050
        lost += 0.010
    assert drafted < 0.05 * 4000 and lost <= EXPLORE_SHARE * spent + 2 * MIN_SEEN * 0.010


def test_re_measurements_are_charged_their_whole_wall_time():
    """A drafting step's arm time leaves out the head's catch-up over a backlog (the worker passes the
    rest as `seconds`, the whole step as `wall`); the exploration credit pays the whole: steps timed
    at 50 ms that took 90 ms (plain 40 ms, nothing accepted) lose, in wall time, no more than the
    exploration share of the time and a re-measurement's steps."""
    policy = AdaptivePolicy(TREE, None)
    _accept(policy, TREE, 3)
    teach_times(policy, 2, 0.040, {3: 0.050})
    lost, spent = 0.0, 0.0
    for _ in range(4000):
        shape = policy.choose(2)
        if shape is None:
            policy.observe(2, None, 0.040, [])
            spent += 0.040
            continue
        policy.observe(2, shape, 0.050, [0, 0], timed=True, wall=0.090)
        policy.acc = list(policy.off)  # the books keep saying everything is accepted
        spent += 0.090
        lost += 0.050
    assert lost <= EXPLORE_SHARE * spent + 2 * MIN_SEEN * 0.050


def _first_probe(policy: AdaptivePolicy, behind: int, steps: int = 5000) -> tuple[int, float, int, int] | None:
    """A batch of 4 requests `behind` positions ahead of the head (one more each plain step) decoding
    plainly until the policy first drafts: (that step, the bucket's credit before it, how many rows
    draft, how far ahead of the head they then were); None if it never drafts within `steps`."""
    reqs = _reqs(4)
    for r in reqs:
        r.num_computed, r.draft_len = behind + 3, 0
    for step in range(steps):
        credit = policy._bucket(4).credit
        plan = policy.plan(reqs)
        if plan.shape is not None:
            return step, credit, sum(c != 0 for c in plan.caps), reqs[0].num_computed
        policy.observe(4, None, 0.040, [])
        for r in reqs:
            r.num_computed += 1
    return None


def test_a_re_measurement_waits_until_the_credit_covers_the_heads_catch_up():
    """Exploring drafting also pays the head's catch-up over every position its rows have not shown it
    (the worker times it apart: Proposer.catch_up_seconds): at the measured price of a caught-up row
    (0.1 ms) a request 1,000 positions ahead costs ~0.1 s more than its steps, and the first drafting
    step waits until the credit covers that too; before any catch-up is measured it costs nothing
    extra, and drafting is explored over 10x sooner, as early as for requests with no backlog."""
    def losing() -> AdaptivePolicy:
        policy = AdaptivePolicy(TREE, None)
        _accept(policy, TREE, 1)
        teach_times(policy, 4, 0.040, {3: 0.120})  # 8 tokens in 120 ms against plain's 4 in 40: it loses
        return policy

    price = 1e-4
    priced = losing()
    priced.observe_catch_up(1000, 1000 * price)
    late, soon = _first_probe(priced, 1000), _first_probe(losing(), 1000)
    assert late is not None and soon is not None
    step, credit, rows, ahead = late
    cost = rows * (ahead - TREE.num_steps - 2) * price  # the catch-up beyond a drafting step's own rows
    assert credit >= cost >= 0.1 and step > 10 * soon[0]
    assert _first_probe(losing(), 0)[0] == soon[0]


def test_a_new_bucket_above_a_losing_one_does_not_probe_at_once():
    """A batch draining through bucket after bucket must not probe drafting in each: above a bucket
    where drafting was measured and lost, a new bucket borrows that bucket's measured extra (scaled up
    by batch size), predicts drafting losing too, and re-measures it only when its credit covers a
    re-measurement's loss; a fresh policy with nothing measured probes at once."""
    policy = AdaptivePolicy(TREE, None)
    _accept(policy, TREE, 1)
    teach_times(policy, 4, 0.040, {3: 0.200})  # drafting dear at batch 4: it loses
    for _ in range(3):
        assert policy.choose(4) is None
    shapes = []
    for _ in range(200):
        shape = policy.choose(8)
        shapes.append(shape)
        policy.observe(8, shape, 0.050 if shape is None else 0.300, [0] * 8 if shape else [])
    assert shapes == [None] * 200
    fresh = AdaptivePolicy(TREE, None)
    teach_times(fresh, 2, 0.040, {})
    assert fresh.choose(2) == TREE  # nothing measured anywhere: a new bucket probes at once


def test_a_probe_stopped_at_its_first_step_gives_the_arm_its_estimate():
    """A first probe of drafting whose one timed step shows it cannot win (a batch of new requests: the
    head catching up their histories) gives the arm that step as its estimate: the bucket does not take
    it for unmeasured, and a new bucket below it borrows it instead of probing at once."""
    policy = AdaptivePolicy(TREE, None)
    _accept(policy, TREE, 1)
    policy.choose(4)
    teach_times(policy, 4, 0.040, {})
    assert policy.choose(4) == TREE  # nothing measured anywhere: probed at once
    policy.observe(4, TREE, 0.040 * 20, [0] * 4, sizes=[TREE.num_draft_tokens] * 4)
    assert policy.choose(4) is None and policy.buckets[4].probe is None
    arm = policy.buckets[4].arm(TREE.num_steps)
    assert arm.seconds() == pytest.approx(0.8)
    teach_times(policy, 3, 0.035, {})
    assert policy._times(policy.buckets[3], 3)[TREE.num_steps] == pytest.approx(0.035 + 0.76 * 3 / 4)
    assert [policy.choose(3) for _ in range(WINDOW)] == [None] * WINDOW


@pytest.mark.parametrize("dear, waits", [(0.480, True), (0.180, True), (0.080, False)])
def test_a_new_bucket_below_a_losing_one_waits_only_where_drafting_could_not_pay(dear, waits):
    """A batch draining from 4 to 3: bucket 3 borrows bucket 4's measured extra scaled down to 3 rows.
    Where a tree at batch 4 cost 12 or 4.5 plain steps, drafting cannot pay at the batch's acceptance
    even so, and bucket 3 decodes plainly (re-measuring drafting when its credit allows); at 2 plain
    steps it pays, and bucket 3 drafts at once."""
    policy = AdaptivePolicy(TREE, None)
    _accept(policy, TREE, 1)
    teach_times(policy, 4, 0.040, {3: dear})
    assert policy.choose(4) is None or not waits
    teach_times(policy, 3, 0.035, {})
    first = [policy.choose(3) for _ in range(WINDOW)]
    assert (first == [None] * WINDOW) == waits


def test_a_tree_is_drafted_whole_or_not_at_all():
    policy = AdaptivePolicy(TREE, None)
    assert policy.depths() == [TREE.num_steps]
    _accept(policy, TREE, 3)
    teach_times(policy, 1, 0.040, {3: 0.045})
    assert {policy.choose(1) for _ in range(WINDOW)} == {TREE}


def test_shallower_trees_keep_their_node_budget():
    tree = AdaptivePolicy(TreeShape(5, 4, 12), None)
    # depth 1 has only topk candidates; from depth 2 on, the budget fits
    assert [tree.shape_for(d) for d in (1, 2, 3)] == [TreeShape(1, 4, 5), TreeShape(2, 4, 12), TreeShape(3, 4, 12)]
    assert tree.shape_for(5) == TreeShape(5, 4, 12)
    assert [AdaptivePolicy(SHAPE, None).shape_for(d) for d in (1, 3)] == [TreeShape(1, 1, 2), TreeShape(3, 1, 4)]


def test_a_chains_stale_depths_are_measured_afresh():
    """A depth that looked slow once (measured while the machine was busy) is measured again from
    scratch (a probe replaces its window), and the fresh fast figure brings it into use."""
    policy = AdaptivePolicy(TreeShape(4, 1, 5), None)
    _accept(policy, TreeShape(4, 1, 5), 4)
    teach_times(policy, 1, 0.040, {1: 0.042, 2: 0.044, 3: 0.12, 4: 0.12})  # 3 and 4 once measured at 3x
    seen = set()
    for _ in range(8 * 40 * 4):
        shape = policy.choose(1)
        d = shape.num_steps if shape else 0
        seen.add(d)
        policy.observe(1, shape, 0.040 + 0.002 * d, [d] if d else [], sizes=[d + 1] if d else None)
    assert {3, 4} <= seen
    assert policy.buckets[1].times(policy.depths(), 4)[4] < 0.1  # the stale slow figure was replaced


@pytest.mark.parametrize("policy_cls", [StaticPolicy, AdaptivePolicy])
def test_threshold_caps_every_policy(policy_cls):
    policy = policy_cls(TREE, 4)
    if isinstance(policy, AdaptivePolicy):
        _accept(policy, TREE, 3)
        teach_times(policy, 4, 0.040, {3: 0.041})
    assert policy.choose(4) is not None
    assert policy.choose(5) is None
    assert policy.plan(_reqs(5)).shape is None


def test_the_heads_prior_can_only_lower_the_conservative_default():
    """The shipped head's recorded acceptance was measured on a chain over its training templates;
    the policy starts from PRIOR_RATE per level, or lower where the record says lower, and learns."""
    strong = AdaptivePolicy(SHAPE, None, prior=[0.9, 0.8, 0.7, 0.6, 0.5])
    weak = AdaptivePolicy(SHAPE, None, prior=[0.1, 0.01])
    assert strong.rates() == pytest.approx([PRIOR_RATE] * 5)
    assert weak.rates()[:2] == pytest.approx([0.1, 0.1]) and weak.rates()[2:] == pytest.approx([PRIOR_RATE] * 3)


def test_choose_and_plan_are_one_rule():
    """Requests with the batch's acceptance and no caps: plan decides what choose does, step by step."""
    a, b = AdaptivePolicy(TREE, None), AdaptivePolicy(TREE, None)
    reqs = _reqs(4)
    for p in (a, b):
        _accept(p, TREE, 2)
        teach_times(p, 4, 0.040, {3: 0.050})
    for _ in range(120):
        want = a.choose(4)
        plan = b.plan(reqs)
        assert plan.shape == want and plan.caps == ((None,) * 4 if want else (0,) * 4)


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
    if policy == "adaptive":  # a clock where drafting is free, so that the threshold is what decides
        fake_clock(llm.engine.speculator.policy, 0.040, 0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    verify_steps = [o.spec_stats.num_verify_steps for o in outs]
    assert verify_steps[:4] == [0, 0, 0, 0]  # finished while more than 3 were running
    assert all(v > 0 for v in verify_steps[5:])  # speculated once the batch shrank
    assert llm.engine.stats.steps_plain > 0 and llm.engine.stats.steps_spec > 0
    a = llm.engine.allocator
    assert a.num_free == a.num_usable


def test_the_warm_up_runs_both_paths_and_teaches_the_policy_nothing(ckpts):
    """Start-up profiles nothing; the warm-up request decodes plainly and drafts (both paths run
    before traffic), and the adaptive policy starts with no measurement and no acceptance learned."""
    target, head = ckpts
    llm = LLM(str(target), dtype="float32", draft_model=str(head), speculative_algorithm="eagle3",
              speculative_policy="adaptive", log_stats_interval=0)
    spec = llm.engine.speculator
    policy = spec.policy
    assert not spec.warming and spec._warm_steps >= 2
    fresh = AdaptivePolicy(policy.max_shape, None)
    assert policy.buckets == {} and policy.steps == 0 and len(policy.own) == 0
    assert policy.acc == fresh.acc and policy.off == fresh.off


def test_steps_that_catch_up_a_backlog_are_timed_without_it(ckpts):
    """The first speculative step after a prompt (or after plain steps) also feeds the head every
    position it missed; the policy gets its time without the share of the head's catch-up beyond
    what a drafting step catches up (Proposer.catch_up_seconds), so that drafting is measured, not
    left unmeasured (and due for a probe again at once)."""
    from augury.speculative import worker as W

    target, head = ckpts
    llm = LLM(str(target), draft_model=str(head), speculative_algorithm="eagle3", speculative_policy="static",
              speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, dtype="float32",
              log_stats_interval=0.0)
    spec = llm.engine.speculator
    seen, walls = [], []
    spec.policy.observe = lambda b, shape, s, acc, timed=True, **kw: seen.append((timed, s, spec.proposer.catch_up_seconds))
    told = []  # the catch-ups the policy is told of, the price of a row its explorations pay
    spec.policy.observe_catch_up = lambda rows, s: told.append((rows, s))
    step = W.Speculator.step

    def timed_step(self, host, reqs):
        t0 = time.perf_counter()
        out = step(self, host, reqs)
        walls.append(time.perf_counter() - t0)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(W.Speculator, "step", timed_step)
        llm.generate([[5] * 20], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(seen) > 1 and all(t for t, _, _ in seen)
    usual = 3 + spec.proposer.extra_nodes + 2
    first, caught = seen[0][1], seen[0][2]
    assert caught > 0 and first <= walls[0] - caught * (20 - usual) / 20  # the 20-token prompt's excess taken out
    assert told and told[0] == (20, caught)
    assert all(s <= w for (_, s, _), w in zip(seen[1:], walls[1:]))


def test_a_probe_cut_short_is_not_outvoted_by_its_arms_old_window():
    """Drafting was measured dear (a full window at 0.2 s a step); the kernels change and a
    re-measurement gets only three timed steps (the others caught up a backlog) at 0.02 s: the arm's
    estimate follows the fresh steps, not the fifteen stale ones."""
    from augury.speculative.arms import Arm

    a = Arm()
    for i in range(WINDOW):
        a.add(0.2, 0.0, i)
    a.refresh()
    for i in range(MIN_SEEN - 2):
        a.add(0.02, 0.0, WINDOW + i)
    a.settle()
    assert a.seconds() == pytest.approx(0.02)
    assert len(a.recent) == MIN_SEEN - 2


def test_a_stale_shallow_depth_does_not_make_a_fresh_deeper_one_look_dear():
    """A chain measured depth 2 at 0.14 s long ago (another regime) and depth 4 at 0.06 s just now:
    depth 4 is estimated at its own time, and depth 2 at no more (more drafting cannot be cheaper, and
    the fresher figure holds). Raising depth 4 to the stale 0.14 s made a chain draft depth 1 for
    hundreds of steps in the simulator."""
    from augury.speculative.arms import Bucket

    bk = Bucket()
    for i in range(5):
        bk.arm(0).add(0.05, 0.0, 100 + i)
        bk.arm(2).add(0.14, 0.0, i)
        bk.arm(4).add(0.06, 0.0, 100 + i)
    times = bk.times([1, 2, 3, 4], 4)
    assert times[4] == pytest.approx(0.06) and times[2] == pytest.approx(0.06)
    assert times[0] == pytest.approx(0.05) and times[3] == pytest.approx(0.06)
    bk.arm(2).add(0.14, 0.0, 200)  # now depth 2 is the fresher: it holds
    assert bk.times([1, 2, 3, 4], 4)[4] == pytest.approx(0.14)


def test_a_plain_batch_skips_the_rule_but_not_its_explorations():
    """Drafting lost at batch 1: while the same request decodes plainly the rule runs only when an
    exploration may come due (the credit covering one, or figures coming due: AdaptivePolicy._wake),
    not every step (it costs ~0.2 ms a step in Python); a new request brings the rule back at once.
    (tests/test_policy_sim.py: the same simulation with the rule run every step takes the same steps.)"""
    policy = AdaptivePolicy(TREE, None)
    _accept(policy, TREE, 1)
    teach_times(policy, 1, 0.040, {3: 0.400})
    reqs = _reqs(1)
    calls = []
    decide = policy._decide
    policy._decide = lambda *a: calls.append(policy.steps) or decide(*a)
    for r in reqs:
        policy._own(r).last, policy._own(r).off[0] = 0, 50.0  # judged on many draws, lately
    drafted = 0
    for _ in range(600):
        plan = policy.plan(reqs)
        if plan.drafting:
            drafted += 1
            policy.observe(1, plan.shape, 0.400, [0], reqs=reqs)
        else:
            policy.observe_plain(1, 0.040)
    assert len(calls) < 600 // 3 and drafted < 20
    n = len(calls)
    policy.plan(_reqs(2)[1:])  # another request: the rule runs
    assert len(calls) == n + 1


def _free_asks(policy: AdaptivePolicy, batch: int, plain: float, tokens: int, seconds: float,
               choose: bool = False, steps: int = 3000) -> list[bool]:
    """`steps` plain steps at `batch` (plain seconds each; the rule asked first where choose), each
    followed by the free-drafts ask; an allowed one runs a free step of `tokens` in `seconds`."""
    allowed = []
    for _ in range(steps):
        if choose:
            policy.choose(batch)
        policy.observe_plain(batch, plain)
        allowed.append(policy.free_allowed(batch))
        if allowed[-1]:
            policy.observe_free(batch, tokens, seconds)
    return allowed


def test_free_drafts_run_where_they_pay_and_are_re_measured_where_they_do_not() -> None:
    """Steps of drafts that cost no draft model (forced tokens, suffix drafts) after the rule chose
    plain decoding: allowed once plain decoding is measured, kept while their realized tokens per
    second holds up to plain decoding's (batch 1: 10 tokens in 8 ms against 1 in 3 ms, one stalled
    step or not), turned off once MIN_SEEN of them fall below it (batch 16: 28 tokens in 30 ms against
    16 in 15 ms), and re-measured later within the exploration credit; one bucket's verdict leaves
    another's alone."""
    policy = AdaptivePolicy(TREE, None)
    assert not policy.free_allowed(1)  # plain decoding not timed here yet
    teach_times(policy, 1, 0.003, {})
    for i in range(30):
        assert policy.free_allowed(1)
        policy.observe_free(1, 10, 0.5 if i == 20 else 0.008)
    teach_times(policy, 16, 0.015, {})
    for _ in range(MIN_SEEN):
        assert policy.free_allowed(16)
        policy.observe_free(16, 28, 0.030)
    assert not policy.free_allowed(16) and policy.free_allowed(1)
    allowed = _free_asks(policy, 16, 0.015, 28, 0.030, choose=True)
    lost = sum(allowed) * (0.030 - 28 * 0.015 / 16)
    assert 0 < sum(allowed) and lost <= EXPLORE_SHARE * 0.015 * 3000 + MIN_SEEN * 0.030


def test_a_free_drafts_verdict_stands_through_a_re_measurement() -> None:
    """Free steps at batch 48 that lose (90 tokens in 150 ms against plain decoding's 48 in 60 ms) are
    turned off there, not in another bucket (batch 32), and after a thread-count change (every bucket
    re-measured) batch 48 still does not run them; the exploration rule still re-measures them within
    its credit. Steps that fall short by less than a window's noise (0.95 of plain decoding's rate)
    run on until they fill a window, then stop."""
    policy = AdaptivePolicy(TREE, None)
    teach_times(policy, 48, 0.060, {})
    for _ in range(MIN_SEEN):
        assert policy.free_allowed(48)
        policy.observe_free(48, 90, 0.150)
    assert not policy.free_allowed(48)
    teach_times(policy, 32, 0.040, {})
    assert policy.free_allowed(32)  # another bucket measures its own
    policy.costs_changed()
    assert not policy.free_allowed(48)  # plain decoding not re-measured yet
    teach_times(policy, 48, 0.060, {})
    assert not policy.free_allowed(48)
    allowed = _free_asks(policy, 48, 0.060, 90, 0.150)
    lost = sum(allowed) * (0.150 - 90 * 0.060 / 48)
    assert 0 < sum(allowed) and lost <= EXPLORE_SHARE * 0.060 * 3000 + MIN_SEEN * 0.150
    teach_times(policy, 16, 0.020, {})
    for _ in range(WINDOW):
        assert policy.free_allowed(16)
        policy.observe_free(16, 16 * 0.95 * 1.5, 0.030)
    assert not policy.free_allowed(16)


def test_free_steps_that_tried_a_thread_count_count_whole_in_what_they_realize() -> None:
    """Free steps at batch 4, two in ten of which tried another thread count for their row count
    (untimed: 8 tokens in 100 ms), the others 8 tokens in 25 ms, against plain decoding's 4 tokens in
    15 ms: the tries are the free steps' own cost, so what the arm realizes counts them whole (trimmed
    as a busy neighbour's spikes, the arm would read 320 tok/s) and, below plain decoding's rate, the
    steps stop; a stalled timed step among fast ones is still trimmed."""
    policy = AdaptivePolicy(TREE, None)
    teach_times(policy, 4, 0.015, {})
    assert policy.free_allowed(4)
    for i in range(10):
        policy.observe_free(4, 8, 0.100 if i % 5 == 4 else 0.025, timed=i % 5 != 4)
    assert policy.buckets[4].arm(FREE).realized() == pytest.approx(8 / 0.040)
    assert not policy.free_allowed(4)
    teach_times(policy, 1, 0.003, {})
    for i in range(MIN_SEEN + 1):
        assert policy.free_allowed(1)
        policy.observe_free(1, 4, 0.5 if i == 3 else 0.004)
    assert policy.free_allowed(1)


def test_free_steps_verify_as_many_drafts_as_pay_for_their_rows() -> None:
    """A lone request's drafts that cost no draft model are cut to the prefix with the most expected
    tokens per second at the measured step costs: a free step of k drafts took 3 + 1 + 0.4 k ms
    against a plain step's 3 ms (one step stalled at 40 ms, which the fit leaves out). Every draft
    until those steps are measured (at batch 1; one above it, where no bucket within NEAR_ROWS has them); certain drafts kept whole; a 0.11 guess not verified at all;
    a copy that turns to a guess (0.2) cut where it does; costs measured again after a change of
    thread count."""
    policy = AdaptivePolicy(TREE, None)
    guess = [0.11]
    copy_then_guess = [1.0] * 6 + [0.2] * 10
    assert policy.free_cut(1, guess) == 1  # nothing measured: every draft
    teach_times(policy, 1, 0.003, {})
    assert policy.free_cut(1, guess) == 1  # plain measured, free steps not yet
    for i, k in enumerate([2, 16, 5, 9, 1, 12, 7, 16, 3, 8]):
        policy.observe_free(1, 1 + k, 0.040 if i == 4 else 0.003 + 0.001 + 0.0004 * k, rows=k)
    f, c = policy.buckets[1].row_cost(0.003)
    assert f == pytest.approx(0.001, abs=1e-6) and c == pytest.approx(0.0004, abs=1e-7)
    assert policy.free_cut(1, [1.0] * 16) == 16
    assert policy.free_cut(1, guess) == 0
    assert policy.free_cut(1, copy_then_guess) == 6
    assert policy.free_cut(1, [1.0, 0.9, 0.81, 0.73]) == 4
    assert StaticPolicy(TREE, None).free_cut(1, guess) == 1  # the static policy verifies them all
    # a bucket with no free steps of its own cuts at its nearest neighbour's row costs, within NEAR_ROWS
    # of its batch size; further off, one draft a request until its own are measured
    teach_times(policy, 2, 0.0033, {})
    assert policy.buckets[2].row_cost(0.0033) is None
    assert policy.free_cut(2, guess) == 0 and policy.free_cut(2, copy_then_guess) == 6
    teach_times(policy, 4, 0.0036, {})
    assert policy.free_cut(4, guess) == 1 and policy.free_cut(4, copy_then_guess) == 1
    policy.costs_changed()
    teach_times(policy, 1, 0.003, {})
    assert policy.buckets[1].row_cost(0.003) is None and policy.free_cut(1, guess) == 1


def test_free_chains_are_cut_at_their_measured_acceptance_by_reach() -> None:
    """The drafter calls a one-occurrence match certain whatever its length; where chains after a
    one-token match had their first draft accepted once in ten (sampled answers leaving what they
    copy) and chains after long matches every draft, free_cut takes the measured chance at each
    draft's reach: none of a chain after a one-token match, the whole of one after an eight-token match.
    A grammar's forced token between suffix drafts has no reach; drafts past the first rejection are
    not counted."""
    from augury.speculative.acceptance import REACH_FROM, reach_class

    policy = AdaptivePolicy(TREE, None)
    teach_times(policy, 1, 0.003, {})
    for i, k in enumerate([2, 16, 5, 9, 1, 12, 7, 16, 3, 8]):
        policy.observe_free(1, 1 + k, 0.003 + 0.001 + 0.0004 * k, rows=k)
    sure = [1.0] * 4
    short, long = [1, 2, 3, 4], [8, 9, 10, 11]
    assert policy.free_cut(1, sure, short) == 4  # nothing learned yet: the prior's rate 1
    for i in range(60):
        policy.observe_free(1, 1, 0.005, timed=False, chains=[([0, 1, 2, 3], short, 1 if i % 10 == 0 else 0)])
        policy.observe_free(1, 5, 0.005, timed=False, chains=[([0, 1, 2, 3], long, 4)])
    assert policy.chain_chances(short[:2])[0] < 0.2 and policy.free_cut(1, sure, short) == 0
    assert policy.chain_chances(long) == pytest.approx([1.0] * 4)
    assert policy.free_cut(1, sure, long) == 4
    assert policy.free_cut(1, sure, [0] * 4) == 4  # forced tokens: the drafter's chances stand
    assert policy.free_cut(1, sure, [0, 0, 1, 2]) == 2  # two forced tokens, then a guess
    fresh = AdaptivePolicy(TREE, None)
    for _ in range(60):
        fresh.learn_chain([0, 2, 3], [5, 6, 7], 4)  # a forced token at place 1: suffix drafts 0, 2, 3, all accepted
    assert fresh.chain_chances([5, 6, 7]) == pytest.approx([1.0, 1.0, 1.0])
    assert fresh.chain_off[reach_class(24)] == fresh.chain_off[reach_class(100)]  # never reached
    assert reach_class(1) == 0 and reach_class(7) == REACH_FROM.index(6) and reach_class(24) == len(REACH_FROM) - 1
    seventh = fresh.chain_off[reach_class(7)]
    fresh.learn_chain([0, 1, 2], [1, 2, 7], 1)  # the second rejected: the third not tried
    assert fresh.chain_acc[reach_class(2)] < fresh.chain_off[reach_class(2)]
    assert fresh.chain_off[reach_class(7)] == seventh


@pytest.mark.parametrize("told", [True, False])
def test_a_change_of_thread_count_has_plain_decoding_measured_afresh(told) -> None:
    """Plain steps timed while the kernels still ran two threads on a core shared with a busy process
    (12 ms) make drafting (11.6 ms a step, one draft accepted) look good; the kernels then settle on
    one thread, where a plain step takes 4 ms and drafting loses. Told of the change (costs_changed),
    the policy times plain decoding again before deciding: it drafts for no more than a probe's
    steps. Not told, it drafts on for most of the run (plain decoding is timed now and then while
    speculating, and the slow steps outvote those)."""
    policy = AdaptivePolicy(TREE, None)
    _accept(policy, TREE, 1)
    teach_times(policy, 1, 0.012, {})
    if told:
        policy.costs_changed()
    drafted = 0
    for _ in range(400):
        shape = policy.choose(1)
        if shape is None:
            policy.observe(1, None, 0.004, [])
        else:
            drafted += 1
            policy.observe(1, shape, 0.0116, [1], sizes=[shape.num_draft_tokens])
    if told:
        assert drafted <= 8 and policy.choose(1) is None
    else:
        assert drafted > 100


def test_an_arms_figures_follow_every_change_of_its_steps():
    """Arm.seconds / forced / realized are kept between calls (asked many times a step) and recomputed
    whenever the steps they rest on change: a step added (the window full or not), a refresh's steps
    replacing the window, the window cleared."""
    from augury.speculative.arms import Arm, trimmed_mean

    a = Arm()
    for i in range(MIN_SEEN):
        a.add(0.010 + 0.001 * i, float(i), i)
        a.ran(2.0, 0.010)
    first = a.seconds()
    assert first == pytest.approx(trimmed_mean([0.010 + 0.001 * i for i in range(MIN_SEEN)]))
    assert a.forced() == pytest.approx(sum(range(MIN_SEEN)) / MIN_SEEN)
    assert a.realized() == pytest.approx(200.0)
    for i in range(WINDOW + 3):  # past the window's length: its length stays, its newest step changes
        a.add(0.050, 1.0, MIN_SEEN + i)
        assert a.seconds() == trimmed_mean([s for s, _ in a.recent]) > first
        assert a.forced() == pytest.approx(sum(f for _, f in a.recent) / len(a.recent))
    assert a.seconds() == pytest.approx(0.050) and a.forced() == pytest.approx(1.0)
    a.ran(8.0, 0.010)
    assert a.realized() > 200.0
    a.refresh()
    assert a.realized() is None
    for i in range(MIN_SEEN):
        a.add(0.020, 0.0, 100 + i)
    assert a.seconds() == pytest.approx(0.020) and a.forced() == 0.0
    a.recent.clear()
    assert a.seconds() is None and a.forced() == 0.0
