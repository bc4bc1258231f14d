"""Fake clocks for the adaptive policy: it learns step times only from what it is told, so tests tell
it times instead of letting a shared machine's wall clock decide."""
from __future__ import annotations

from augury.speculative.adaptive import AdaptivePolicy
from augury.speculative.arms import MIN_SEEN


def teach_times(policy: AdaptivePolicy, batch: int, plain: float, spec: dict[int, float], n: int = MIN_SEEN) -> None:
    """n timed steps of plain decoding (plain seconds) and of each drafting depth d (spec[d] seconds,
    every row drafting the whole shape) in batch's bucket, as if measured; acceptance untouched, and
    nothing realized (the steps' tokens are not told: the guard judges the steps that follow)."""
    for _ in range(n):
        policy.observe(batch, None, plain, [])
        for d, t in spec.items():
            policy.observe(batch, policy.shape_for(d), t, [], sizes=[policy.shape_for(d).num_draft_tokens] * batch)
    for d, arm in policy._bucket(batch).arms.items():
        if d:
            arm.real.clear()


def fake_clock(policy, plain: float, per_node: float) -> None:
    """Every step the engine reports to the policy takes `plain` seconds plus `per_node` a verified draft
    node, whatever the wall clock said (the engine's timing hooks still run; their figures are replaced)."""
    observe, observe_plain = policy.observe, policy.observe_plain

    def spec(batch, shape, seconds, accepted, timed=True, offered=None, reqs=None, sizes=None, forced=0, lookup=None,
             wall=None):  # (the fake time is the whole step's: the wall clock's is dropped with `seconds`)
        nodes = sum(s - 1 for s in sizes) if sizes is not None else batch * (shape.num_drafts if shape else 0)
        observe(batch, shape, plain + per_node * nodes, accepted, timed=timed, offered=offered, reqs=reqs,
                sizes=sizes, forced=forced, lookup=lookup)

    policy.observe = spec
    policy.observe_plain = lambda batch, seconds: observe_plain(batch, plain)
