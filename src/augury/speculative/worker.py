"""The speculative step: ask the policy, draft a tree, verify it in one target forward, commit.

The same verification serves every proposer (EAGLE-3 head, suffix decoding, n-gram lookup). Rejected
nodes' KV sits past each request's committed length and is overwritten next step; the
accepted path is compacted to consecutive slots, so no block leaks and nothing stale is
ever attended to.
"""
from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

import torch

from augury.config import EngineConfig
from augury.core.kv_cache import slot_of
from augury.core.request import Request
from augury.core.timing import clock
from augury.outputs import SpecStep
from augury.models.config import TargetConfig
from augury.models.eagle3_head import Eagle3Head
from augury.sampling import MASKED_AT_MOST, LogitsShaper, logits_at_allowed, token_logprobs
from augury.speculative.interface import Proposer, SpeculationPolicy, TargetHost
from augury.speculative.ngram import matched_lookup
from augury.speculative.policy import StaticPolicy, StepPlan, TreeShape, Why, reason
from augury.speculative.sources import SOURCE_NAMES, Source, Tally, tally
from augury.speculative.suffix import DEFAULT_CACHE_TOKENS, Draft, SuffixDrafter
from augury.speculative.tree import DraftTree, cap_trees, chains_of, rebuild_rows, with_root_only_rows
from augury.speculative.verifier import verify

log = logging.getLogger("augury.speculative")

# Auto tree shapes when none is configured: (num_steps, topk, num_draft_tokens).
# suffix: one arm for the adaptive policy (a tree's full depth), 7 nodes plus the proposer's extra ones
AUTO_SHAPE = {"eagle3": TreeShape(3, 4, 8), "ngram": TreeShape(4, 1, 5), "suffix": TreeShape(4, 2, 8)}
AUTO_NGRAM_BRANCH = 6  # suffix-draft nodes grafted onto each EAGLE-3 tree when none is configured
FORCED_ONLY = 16  # most free drafts (forced, prompt lookup) verified per request in a step without head drafts
# the largest batch whose steps without head drafts verify prompt lookup too (above it, forced tokens alone):
# a lookup row costs a decode row's compute, paid where decoding is compute-bound (the demo on 2 cores:
# code edits at batch 4, warm, ran at 1.84x of plain decoding with lookup to batch 16, ~0.99x without)
LOOKUP_BATCH = 16
# above batch 1, a request's suffix drafts are verified only while each one's reach (the tokens its text
# matched before it) is at least this: a copy (a code edit re-emitting its file), whose drafts the demo
# accepted 0.92-1.0 of the time after 16 or more (acceptance.REACH_FROM's comment). Shorter matches are
# guesses: with all of them (cut by free_cut alone) held-out chats at batch 4 ran at 0.90-0.95x of plain
# decoding against 0.94-1.03x with lookup at batch 1 only (alternating pairs, 5 repeats each), and
# steps with lookup chains at batch 16 at 0.52-0.76x of plain steps' tokens a second (three runs)
COPY_REACH = 16
# above batch 1, a request whose suffix search found no copy is searched again only after this many more
# tokens, doubling to the second while none is found: a search costs ~0.03-0.05 ms (its index and the
# cross-request cache's) of a ~3.3 ms step at batch 4: held-out chats there ran at 0.92-0.94x of plain
# decoding in two runs with every request searched every step, 0.96x in two with the wait (drafting on
# 0-1% of their tokens; 0.94-1.03x with lookup at batch 1 only: the VM's noise is of that size)
LOOK_WAIT = (4, 32)
# a suffix-first step's reason (outputs.SpecStep.reason; _forced_only words it as a step without proposer drafts)
SUFFIX_FIRST = "the suffix drafts' expected tokens per second beat the policy's choice: verified alone"
LOGITS_AT_ONCE = 256  # tree nodes in a batch up to which verification computes all logits at once


class Speculator:
    """Owns a proposer and a policy; `step` runs one speculative decode step for a batch
    (the engine's `Speculator` protocol), talking to the engine only as a TargetHost."""

    def __init__(self, proposer: Proposer, policy: SpeculationPolicy, max_num_seqs: int,
                 catch_up_window: int = 128, warming: bool = False, disable_batch_threshold: int | None = None,
                 drafter: SuffixDrafter | None = None) -> None:
        self.proposer = proposer
        # suffix drafting (the request's own text and recent requests' outputs) for steps without head
        # drafts; None: prompt lookup within the request (ngram.matched_lookup)
        self.drafter = drafter
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        # above it nothing speculative is drafted (the policy drafts nothing, steps without head drafts no
        # prompt lookup); a grammar's forced tokens are verified all the same
        self.disable_batch_threshold = disable_batch_threshold
        self.catch_up_window = catch_up_window  # most target features kept per request for the head
        self.needs_aux = proposer.needs_aux
        self.aux_layers = proposer.aux_layers
        # warming up: a plain decode step, then drafting the whole tree, so the warm-up request runs
        # both paths (drafting's a few times: its first steps are slow); the policy is neither asked
        # nor told (its measurements start clean)
        self.warming = warming
        self._warm_steps = 0
        self._contexts = drafter if drafter is not None else SuffixDrafter(0)  # each request's tokens as an array
        self._thread_changes = 0  # the host's count of thread-count changes when last seen
        # this step's suffix drafts by request (its id()), (context length, limit, Draft): _suffix_first's, which
        # _forced_only reuses (a search over a 1,500-token context is ~0.1 ms, ~3% of a demo step there)
        self._drafted: dict[int, tuple[int, int, Draft]] = {}
        # above batch 1, per request whose last suffix search found no copy: (its length from which it is
        # searched again, the wait after the next search that finds none): LOOK_WAIT
        self._look_wait: weakref.WeakKeyDictionary[Request, tuple[int, int]] = weakref.WeakKeyDictionary()

    def after_warmup(self, host: TargetHost) -> None:
        """The warm-up passed: from now on the policy decides, and every step it is told of counts."""
        self.warming = False

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        if not self.warming:
            self.policy.observe_plain(batch_size, seconds)

    def step(self, host: TargetHost, reqs: list[Request]) -> bool:
        """Speculate for this decode batch; False means the caller should decode plainly.

        The policy's plan gives the tree and each request's draft budget this step (an adaptive
        policy: from the request's own acceptance; SamplingParams.max_draft_tokens caps it in any
        case). Budget 0 keeps a request out of drafting (its row in the verification is its root
        alone, which is exactly a decode step), n keeps its first n draft nodes (see
        tree.cap_trees). A request whose head has no target feature to start from (admitted with all
        but its last token from the prefix cache, which its first decode step computes) does not
        draft this step. A batch where no request may draft decodes plainly without asking the
        policy; one where the plan lets none draft decodes plainly too.

        When the kernels' chosen thread count has changed since the last step (cpu/threads.py: a
        busy process took a core, or left it), every step time measured so far ran at another speed:
        the policy and the forced-token gate measure afresh."""
        if self.drafter is not None:
            self.drafter.notice(reqs)  # the last batch's finished requests join the cross-request cache
        changes = host.thread_changes()
        if changes != self._thread_changes:
            self._thread_changes = changes
            self.policy.costs_changed()
        self._drafted.clear()
        scores = self._suffix_first(reqs)
        if scores is not None and self._forced_only(
                host, reqs, [SUFFIX_FIRST] * len(reqs) if any(r.spec_steps is not None for r in reqs) else None,
                scores):
            return True
        why: Why | None = None  # the policy's account of its plan, when it was asked for one
        if all(r.params.max_draft_tokens == 0 or not self._ready(r) for r in reqs):
            caps: list[int | None] = [0] * len(reqs)
            shape = None
        else:
            plan = self._warm_plan(reqs) if self.warming else self.policy.plan(reqs)
            why = ("warm-up", 0, 0.0, 0.0) if self.warming else self.policy.why
            shape = plan.shape
            # a request's own cap holds whatever the policy says
            caps = [_tighter(c, r.params.max_draft_tokens) if self._ready(r) else 0 for c, r in zip(plan.caps, reqs)] \
                if shape is not None else plan.caps
        drafting = [i for i, c in enumerate(caps) if c != 0] if shape is not None else []
        if not drafting:
            shape = None
        host.stats.last_draft_tokens = shape.num_drafts if shape else 0
        # nodes a proposer may add beyond the shape's: the reservation covers them
        lookahead = shape.num_draft_tokens + self.proposer.extra_nodes if shape is not None else 0
        # what each row's step is, in words, for the requests that asked (SamplingParams.return_token_sources)
        notes = self._notes(reqs, caps, why, shape is not None) if any(r.spec_steps is not None for r in reqs) \
            else None
        # (a free-drafts step _suffix_first tried above found nothing worth verifying: asked again with
        # the same requests and state, it would build the same chains and cut them the same way)
        if shape is None and not self.warming and scores is None and self._may_free(reqs) and \
                self.policy.free_allowed(len(reqs)) and self._forced_only(host, reqs, notes):
            return True
        if shape is None or not host.reserve(reqs, lookahead):
            if notes is not None:
                short = "no room in the KV cache for this step's drafts"
                for r, note in zip(reqs, notes):
                    if r.spec_steps is not None:
                        r.spec_steps.append(SpecStep("plain", 0, 0, note if shape is None else short))
            host.stats.steps_plain += 1
            return False
        sub = [reqs[i] for i in drafting]
        # a step that first feeds the head a prompt or a run of plain steps is slower than drafting
        # itself: the rows caught up past what drafting leaves, on average (what the last step accepted,
        # a prompt-lookup branch's tokens included, and one plain step between drafting ones, the
        # policy's exploration of plain decoding), are taken out of its time, that share of the
        # proposer's catch-up (Proposer.catch_up_seconds). Untimed where the proposer does not tell
        # it: its time would make speculation look dear (a probe of drafting in a batch of agentic
        # requests, each with ~1,500 tokens of history the head had not seen, took 25-44 ms against
        # plain steps of ~6 ms, and, untimed, left the arm unmeasured: due for a probe again at once)
        backlog = sum(r.num_computed - r.draft_len for r in sub) if self.needs_aux else 0
        usual = (shape.num_steps + self.proposer.extra_nodes + 2) * len(sub)
        trials = host.thread_trials()
        t0 = clock(host.device)
        drafted = self.proposer.propose(host, sub, shape)
        tree = cap_trees(drafted, [caps[i] for i in drafting])
        if len(sub) < len(reqs):
            tree = with_root_only_rows(tree, drafting, [r.last_token_id for r, c in zip(reqs, caps) if c == 0])
        tree = grammar_trees(tree, reqs, lookahead)
        verified = self.verify_and_commit(host, reqs, tree, notes)
        # the policy learns the acceptance of what its budget bought, the proposer's drafts, in the rows
        # that have any (sources.py: a grammar's forced tokens come whatever it decides, even in a row it
        # left at its root); the step's output counts them all. The row sizes tell it what share of the
        # whole shape's cost this step drafted.
        learned = [(b, t) for b, t in verified if t.depth]
        own = Source.HEAD if self.needs_aux else Source.LOOKUP  # the proposer's own drafts; a head's lookup apart
        seconds = wall = clock(host.device) - t0
        caught = getattr(self.proposer, "catch_up_seconds", None)
        if backlog > usual and caught is not None:
            seconds -= caught * (backlog - usual) / backlog
            if not self.warming:
                self.policy.observe_catch_up(backlog, caught)
        if not self.warming:
            self.policy.observe(len(reqs), shape, seconds, [t.accepted[own] for _, t in learned],
                                timed=(backlog <= usual or caught is not None)
                                and host.thread_trials() == trials,  # no thread count tried inside
                                offered=[t.depth for _, t in learned],
                                reqs=[reqs[b] for b, _ in learned], sizes=tree.row_sizes(),
                                forced=sum(t.accepted[Source.FORCED] for _, t in verified),
                                lookup=[t.accepted[Source.LOOKUP] for _, t in learned] if self.needs_aux else None,
                                wall=wall)
        host.stats.steps_spec += 1
        return True

    def _warm_plan(self, reqs: list[Request]) -> StepPlan:
        """A warm-up step: plain first, then the whole tree (each request's own cap holds)."""
        self._warm_steps += 1
        if self._warm_steps == 1:
            return StepPlan(None, tuple(0 for _ in reqs))
        return StaticPolicy(self.policy.max_shape, None).plan(reqs)

    def _notes(self, reqs: list[Request], caps: Sequence[int | None], why: Why | None, drafting: bool) -> list[str]:
        """Per request, why its step drafts what it does (outputs.SpecStep.reason): the policy's reason
        (policy.reason), or what kept the request out of drafting on its own account."""
        said = reason(why) if why is not None else ""
        out = []
        for r, cap in zip(reqs, caps):
            if r.params.max_draft_tokens == 0:
                out.append("this request does not draft (max_draft_tokens 0)")
            elif not self._ready(r):
                out.append("the head has no new target feature to draft from yet")
            elif drafting and cap == 0:
                out.append(f"left out: its own acceptance does not pay for its drafts ({said})")
            else:
                out.append(said)
        return out

    def _lookup_batch(self, reqs: list[Request]) -> bool:
        """Steps without head drafts verify text lookup (suffix drafts) for this batch (LOOKUP_BATCH)."""
        threshold = self.disable_batch_threshold
        return len(reqs) <= LOOKUP_BATCH and (threshold is None or len(reqs) <= threshold)

    def _suffix_first(self, reqs: list[Request]) -> list[float] | None:
        """A head's step whose requests' suffix drafts, verified alone (a free-drafts step), the policy
        expects to beat its own choice (policy.free_first): their scores; else None."""
        if self.drafter is None or not self.needs_aux or self.warming or len(reqs) > 1 or not self._lookup_batch(reqs):
            return None  # (above batch 1 the copies _forced_only looks for after the policy's plain decision)
        scores = []
        for r in reqs:
            own = r.params.max_draft_tokens
            if own == 0:
                return None
            limit = FORCED_ONLY if own is None else min(own, FORCED_ONLY)
            draft = self.drafter.draft_for(r, limit)
            # this step's _forced_only verifies the same draft's chain: not searched for twice
            self._drafted[id(r)] = (len(r.all_token_ids), limit, draft)
            scores.append(draft.score)
        if not any(scores) and not any(r.shaper is not None and r.shaper.has_grammar for r in reqs):
            return None  # nothing found, nothing forced: nothing to weigh (most steps of a chat; ~15 us cold)
        return scores if self.policy.free_first(reqs, scores) else None

    def _forced_only(self, host: TargetHost, reqs: list[Request], notes: list[str] | None = None,
                     scores: list[float] | None = None) -> bool:
        """No head drafts this step: verify the drafts that cost no draft model alone (free_drafts: the
        tokens a request's grammar forces, keys, punctuation, a fixed value, all but always accepted,
        and prompt lookup where the request's text repeats itself or its prompt), as chains under
        the roots (every other row a plain decode row), instead of a plain decode step. False (and
        nothing done) when no request has such drafts, or the cache is short. Prompt lookup only at
        batches up to LOOKUP_BATCH and the disable threshold; above them forced tokens alone."""
        lookup = self._lookup_batch(reqs)
        if all(r.params.max_draft_tokens == 0 for r in reqs) or not lookup and not any(
                r.shaper is not None and r.shaper.has_grammar for r in reqs):
            return False  # nothing to draft (nor to time: the clock waits for the device on CUDA)
        if lookup and all(self._found_nothing(r) for r in reqs):
            return False  # (half the steps of held-out code edits at T=1 after the rule's plain decision)
        trials, t0 = host.thread_trials(), clock(host.device)
        chains: list[tuple[list[int], list[int]]] = []  # (tokens, their sources) per request
        reaches: list[list[int]] = []  # per request, its drafts' reaches (free_chain's)
        for r in reqs:
            own = r.params.max_draft_tokens
            limit = FORCED_ONLY if own is None else min(own, FORCED_ONLY)
            context = self._contexts.context(r) if lookup and self._may_look(r, len(reqs)) else None
            chain = functools.partial(self._chain, r)
            done = self._drafted.get(id(r)) if context is not None else None
            if done is not None and done[:2] == (len(context), limit):
                chain = functools.partial(_reuse, done, chain)
            toks, srcs, probs, reach = free_chain(r.shaper, context, limit, context is not None, chain) if limit \
                else ([], [], [], [])
            if context is not None and len(reqs) > 1:  # copies only: see COPY_REACH
                k = next((j for j, (s, m) in enumerate(zip(srcs, reach)) if s == Source.LOOKUP and m < COPY_REACH),
                         len(toks))
                toks, srcs, probs, reach = toks[:k], srcs[:k], probs[:k], reach[:k]
            # as many as pay for their rows (above batch 1, a grammar's forced tokens alone are all verified)
            if context is not None and toks and not self.warming and (len(reqs) == 1 or Source.LOOKUP in srcs):
                k = self.policy.free_cut(len(reqs), probs, reach)
                toks, srcs, reach = toks[:k], srcs[:k], reach[:k]
            if context is not None and len(reqs) > 1:
                # a copy the cut leaves nothing of waits as one not found (at batch 16 over ~1,000-token
                # code edits every request found its copy each step, and each step cut them all: 16
                # searches a step, the default at 0.945-0.965x of plain decoding with 0.2% of its tokens
                # drafted, Zen 5)
                self._looked(r, Source.LOOKUP in srcs)
            chains.append((toks, srcs))
            reaches.append(reach)
        if not any(c for c, _ in chains) or not host.reserve(reqs, 1 + max(len(c) for c, _ in chains)):
            return False
        b = len(reqs)
        tree = chains_of([r.last_token_id for r in reqs], chains)
        if notes is not None:
            notes = [f"no proposer drafts ({n}); drafts that cost no draft model verified instead" for n in notes]
        verified = self.verify_and_commit(host, reqs, tree, notes, free=True)
        if not self.warming:
            # per request with suffix drafts: their places in its chain, their reaches, its drafts accepted
            # in a row (a chain's accepted drafts are its first ones)
            learned = []
            if lookup:
                got = {i: sum(t.accepted) for i, t in verified}
                for i, (_, srcs) in enumerate(chains):
                    places = [j for j, x in enumerate(srcs) if x == Source.LOOKUP]
                    if places:
                        learned.append((places, [reaches[i][j] for j in places], got.get(i, 0)))
            self.policy.observe_free(b, b + sum(sum(t.accepted) for _, t in verified), clock(host.device) - t0,
                                     timed=host.thread_trials() == trials,
                                     lookup=sum(t.accepted[Source.LOOKUP] for _, t in verified), scores=scores,
                                     rows=sum(len(c) for c, _ in chains), chains=learned)
        host.stats.steps_spec += 1
        return True

    def _may_free(self, reqs: list[Request]) -> bool:
        """Whether a free-drafts step could find a draft for any of these requests (a grammar that may
        force tokens, or a suffix search not waiting: LOOK_WAIT, _found_nothing), checked before the
        policy is asked: most plain steps of a batch of chats end here, in a few microseconds (the
        whole free-drafts path found nothing in ~30-45 us a step, ~1% of a demo step at batch 4), and
        the policy's exploration credit is not spent re-measuring a step that has nothing to verify."""
        lookup = self._lookup_batch(reqs)
        b = len(reqs)
        for r in reqs:
            if r.params.max_draft_tokens == 0:
                continue
            if r.shaper is not None and r.shaper.has_grammar:
                return True
            if lookup and self._may_look(r, b) and not self._found_nothing(r):
                return True
        return False

    def _may_look(self, r: Request, batch_size: int) -> bool:
        """Whether this free-drafts step searches r's text for a suffix draft (LOOK_WAIT)."""
        wait = self._look_wait.get(r) if batch_size > 1 else None
        return wait is None or len(r.all_token_ids) >= wait[0]

    def _looked(self, r: Request, found: bool) -> None:
        """Above batch 1, r's suffix search found a copy to verify, or not (then it waits: LOOK_WAIT)."""
        if found:
            self._look_wait.pop(r, None)
            return
        wait = self._look_wait.get(r, (0, LOOK_WAIT[0]))[1]
        self._look_wait[r] = (len(r.all_token_ids) + wait, min(2 * wait, LOOK_WAIT[1]))

    def _found_nothing(self, r: Request) -> bool:
        """No grammar shapes r, and this step's suffix search (_suffix_first's) found no draft for it."""
        if r.shaper is not None and r.shaper.has_grammar:
            return False
        done = self._drafted.get(id(r))
        return done is not None and done[0] == len(r.all_token_ids) and not done[2].tokens

    def _chain(self, r: Request, tokens: np.ndarray, limit: int) -> tuple[list[int], list[float], int]:
        """Text lookup's chain for a free-drafts step of r (tokens: r's prompt and output, then the chain's
        drafts so far): the suffix draft's likeliest path and its nodes' probabilities, from r's token
        index with the drafts after it (SuffixDrafter.draft_for), or prompt lookup (its drafts taken as
        certain)."""
        if self.drafter is None:
            return _certain(tokens, limit)
        n = len(r.all_token_ids)
        return _as_lookup(self.drafter.draft_for(r, limit, extra=tokens[n:].tolist()))

    def _ready(self, r: Request) -> bool:
        """r can draft now: a proposer reading target features has one it has not seen."""
        return not self.needs_aux or r.num_computed > r.draft_len

    def verify_and_commit(self, host: TargetHost, reqs: list[Request], tree: DraftTree,
                          notes: list[str] | None = None, free: bool = False) -> list[tuple[int, Tally]]:
        """Verify and commit every row; returns, for the rows that drafted (more than a root), the
        row's index and its drafts by source (sources.tally), which the engine's and the request's
        counters take too. A request that asked (SamplingParams.return_token_sources) is told each
        committed token's source and the step's SpecStep (notes: per row, its reason; free: the tree
        holds no proposer drafts, only those that cost no draft model)."""
        dev = host.device
        # rows a budget cut short are verified packed: padding nodes cost no target rows
        hidden, aux = host.verify_forward(reqs, tree.tokens, tree.parents, tree.depth, self.needs_aux, tree.sizes)
        logits_at, greedy_at = self._node_logits(host, hidden, tree, reqs)
        ps = [r.params for r in reqs]
        depths = tree.deepest()  # [B] deepest draft offered per request
        # a row commits at most depth + 1 tokens: the uniforms of those output positions
        uniforms = [r.uniforms(len(r.output_token_ids), d + 1) if p.temperature != 0.0 else None
                    for r, p, d in zip(reqs, ps, depths)]
        res = verify(tree, logits_at, [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                     uniforms, [p.min_p for p in ps], [r.shaper for r in reqs], greedy_at)
        committed = res.committed_tokens(tree)
        lps = self._logprobs(host, reqs, res.accepted_nodes, committed, logits_at, hidden)
        sizes = tree.row_sizes()
        src, dst = [], []
        bs = host.block_size
        for r, path in zip(reqs, res.accepted_nodes):
            for j, node in enumerate(path):
                if node != j:  # compact the accepted path into consecutive slots
                    src.append(slot_of(r.block_table, r.num_computed + node, bs))
                    dst.append(slot_of(r.block_table, r.num_computed + j, bs))
        if src:
            host.copy_kv_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        pars, srcs = tree.parents.tolist(), tree.sources().tolist()
        verified = []
        for b, (r, toks, path) in enumerate(zip(reqs, committed, res.accepted_nodes)):
            # the root and the accepted drafts are now in the cache, with their target features
            host.advance(r, len(toks), aux[b, path] if aux is not None else None)
            # toks: the accepted drafts (path[1:]), then the target's own (the bonus token)
            named = [SOURCE_NAMES[srcs[b][node]] for node in path[1:]] + ["target"] \
                if r.token_sources is not None else None
            kept = host.commit(r, toks, lps[b], named)  # fewer than len(toks) when a stop condition cut it short
            emitted = min(kept, len(path) - 1)  # drafts emitted: all kept but the bonus, or a stop came at a draft
            note = notes[b] if notes is not None else ("drafts that cost no draft model" if free else "")
            if sizes[b] == 1:  # a root-only row: a plain decode step for this request, not a verification
                if r.spec_steps is not None:
                    r.spec_steps.append(SpecStep("plain", 0, 0, note))
                continue
            t = tally(pars[b], srcs[b], sizes[b], path, emitted)
            if r.spec_steps is not None:
                r.spec_steps.append(SpecStep("draft" if t.depth and not free else "free", sizes[b] - 1, emitted, note))
            verified.append((b, t))
            host.stats.record_verification(t.depth, t.hits, t.drafted, t.accepted)  # the verifier's verdict
            # per request, count what was emitted: len(token_ids) = plain steps + verify steps + accepted
            s = r.spec_stats
            s.num_verify_steps += 1
            s.num_draft_tokens += sizes[b] - 1
            s.num_accepted_draft_tokens += sum(t.emitted)
            s.num_head_draft_tokens += t.drafted[Source.HEAD]
            s.num_head_accepted_tokens += t.emitted[Source.HEAD]
            s.num_lookup_draft_tokens += t.drafted[Source.LOOKUP]
            s.num_lookup_accepted_tokens += t.emitted[Source.LOOKUP]
            s.num_forced_draft_tokens += t.drafted[Source.FORCED]
            s.num_forced_accepted_tokens += t.emitted[Source.FORCED]
        return verified

    @classmethod
    def _node_logits(cls, host: TargetHost, hidden: torch.Tensor, tree: DraftTree, reqs: list[Request]):
        """The target's logits at the tree's nodes, for verify: a [B, N, V] tensor or a row function,
        and for grammars' greedy rows a function of the greedy tokens it tells without a whole row (else
        None).

        Small batches: every real node's logits in one product, reading the output layer once (it is
        memory-bound: one row costs nearly what 256 do); large ones: only the nodes the walk visits.
        Where a request's grammar allows few tokens at a visited node (a key, punctuation, digits: a
        forced step's every node, mostly), that node's logits are computed at those tokens alone
        (TargetHost.allowed_logits: the same bits; -inf elsewhere in a row, which the mask would set
        anyway), and the whole output layer is read only if some visited node needs it. A greedy row
        there that nothing but its grammar shapes takes its token from those logits alone
        (LogitsShaper.greedy_at), with no 49,152-wide row built, copied and argmaxed: the JSON bench's
        free-drafts steps at batch 1 (SmolLM2, AVX2 EPYC) walked in 2.24 ms a step against 2.58 ms with
        a row per node, of ~10.5 ms a step."""
        small = sum(tree.row_sizes()) <= LOGITS_AT_ONCE
        grammars = [r.shaper if r.shaper is not None and r.shaper.has_grammar else None for r in reqs]
        if not any(grammars):
            if small:
                return cls._real_node_logits(host, hidden, tree), None  # [B, N, V]
            return (lambda bs, ns: host.target_logits(hidden[bs, ns])), None  # noqa: E731  -> [A, V]
        every: list[torch.Tensor] = []  # small batches: every real node's logits, once some row needs them
        offered = [True]  # the host computes chosen tokens alone (False after its first None)
        asked: dict[tuple[int, int], np.ndarray | None] = {}  # (request, node) -> its allowed tokens

        def allowed(b: int, n: int) -> np.ndarray | None:
            # a node is visited at one state of its request's shaper (the walk pushes its token after)
            if (b, n) not in asked:
                asked[b, n] = grammars[b].allowed_ids(MASKED_AT_MOST) \
                    if offered[0] and grammars[b] is not None else None
            return asked[b, n]

        def whole(bs: list[int], ns: list[int]) -> torch.Tensor:
            if not small:
                return host.target_logits(hidden[bs, ns])
            if not every:
                every.append(cls._real_node_logits(host, hidden, tree))
            return every[0][bs, ns]

        def at(bs: list[int], ns: list[int]) -> torch.Tensor:  # -> [A, V]
            ids = [allowed(b, n) for b, n in zip(bs, ns)]
            rows, declined = logits_at_allowed(
                ids, lambda sel: host.masked_logits(hidden[[bs[a] for a in sel], [ns[a] for a in sel]],
                                                    [ids[a] for a in sel]),
                lambda sel: whole(bs, ns) if sel is None else whole([bs[a] for a in sel], [ns[a] for a in sel]))
            if declined:
                offered[0] = False
            return rows

        def greedy(bs: list[int], ns: list[int]) -> list[int | None]:
            out: list[int | None] = [None] * len(bs)
            few = [a for a, (b, n) in enumerate(zip(bs, ns)) if grammars[b] is not None
                   and not grammars[b].shapes_beyond_mask() and allowed(b, n) is not None]
            vals = host.allowed_logits(hidden[[bs[a] for a in few], [ns[a] for a in few]],
                                       [asked[bs[a], ns[a]] for a in few]) if few else None
            if few and vals is None:
                offered[0] = False
            for a, v in zip(few, vals or ()):
                out[a] = grammars[bs[a]].greedy_at(asked[bs[a], ns[a]], v.numpy())
            return out

        return at, greedy

    @staticmethod
    def _real_node_logits(host: TargetHost, hidden: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """hidden [B, N, H] -> logits [B, N, V] of every real node; padding nodes (past a row's size,
        never read by the verifier) stay zero and cost no output-layer rows."""
        n, dev = tree.num_nodes, hidden.device
        if tree.sizes is None or all(s == n for s in tree.sizes):  # no padding (a lone request's chain)
            return host.target_logits(hidden)
        real = torch.arange(n, device=dev)[None, :] < torch.tensor(tree.sizes, device=dev)[:, None]  # [B, N]
        real_logits = host.target_logits(hidden[real])  # [T, V]
        logits = real_logits.new_zeros(*real.shape, real_logits.shape[-1])
        logits[real] = real_logits
        return logits

    @staticmethod
    def _logprobs(host: TargetHost, reqs: list[Request], paths: list[list[int]], committed: list[list[int]],
                  logits_at, hidden: torch.Tensor) -> list[list[dict] | None]:
        """TokenLogprobs of each committed token, for the requests that asked: verification already ran
        the target at every node, and the logits at path node j give the distribution of the token
        committed after it (the accepted draft j+1, or the bonus after the last one), exactly as a
        decode step at that position would."""
        out: list[list[dict] | None] = [None] * len(reqs)
        for b, r in enumerate(reqs):
            k = r.params.logprobs
            if k is None:
                continue
            if isinstance(logits_at, torch.Tensor):
                rows = logits_at[b, paths[b]]
            else:
                rows = host.target_logits(hidden[b, paths[b]])
            out[b] = token_logprobs(rows, committed[b], [k] * len(committed[b]))
        return out


def grammar_trees(tree: DraftTree, reqs: list[Request], capacity: int) -> DraftTree:
    """The grammar as a pruner and a proposer: in each drafting row of a request with a grammar, drop
    the drafts it refuses (with their subtrees) before the target sees them, and draft for free the
    tokens it forces (keys, punctuation, a fixed enum value) under the kept nodes, up to `capacity`
    nodes a row (what the step reserved; a request's own max_draft_tokens holds, the policy's budget
    for it does not: forced tokens are accepted whatever the head drafts, so a row the policy left
    at its root gets them too). A request that opted out of speculation keeps its root-only row."""
    sizes = tree.row_sizes()
    rows = [b for b, r in enumerate(reqs) if r.shaper is not None and r.shaper.has_grammar
            and (sizes[b] > 1 or r.params.max_draft_tokens != 0)]
    if not rows:
        return tree
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    plans: list = [None] * len(reqs)
    for b in rows:
        own = reqs[b].params.max_draft_tokens
        room = capacity if own is None else min(capacity, own + 1)
        plans[b] = reqs[b].shaper.plan_tree(toks[b], pars[b], sizes[b], room)
    return rebuild_rows(tree, plans)


def free_drafts(shaper: LogitsShaper | None, context: Sequence[int] | np.ndarray | None, limit: int,
                lookup: bool = True) -> list[int]:
    """free_chain's tokens alone."""
    return free_chain(shaper, context, limit, lookup)[0]


# (tokens, most) -> the chain text lookup drafts after them, each draft's chance that it and every
# draft before it in the chain are accepted, and the length of the match they continue
Lookup = Callable[[np.ndarray, int], tuple[list[int], list[float], int]]


def _reuse(done: tuple, search: Lookup, tokens: np.ndarray, limit: int) -> tuple[list[int], list[float], int]:
    """A Lookup that answers a request's own context (done: its length, the limit, the Draft found for
    it this step) from that draft, and searches for anything else (a grammar's forced tokens after it)."""
    n, most, draft = done
    return _as_lookup(draft) if (len(tokens), limit) == (n, most) else search(tokens, limit)


def _as_lookup(draft: Draft) -> tuple[list[int], list[float], int]:
    """A suffix draft as a Lookup's answer: its likeliest path, the path's probabilities, its match."""
    return (*draft.chain_probs(), draft.match)


def _reaches(match: int, n: int) -> list[int]:
    """The reaches of a lookup run of n drafts continuing a match of `match` tokens."""
    return [max(match, 1) + i for i in range(n)]


def _certain(tokens: np.ndarray, limit: int) -> tuple[list[int], list[float], int]:
    """Prompt lookup (ngram.matched_lookup) as a Lookup: no estimate of its drafts' chances, taken as 1."""
    drafts, match = matched_lookup(tokens, limit)
    return drafts, [1.0] * len(drafts), match


def free_chain(shaper: LogitsShaper | None, context: Sequence[int] | np.ndarray | None, limit: int,
               lookup: bool = True, chain: Lookup | None = None
               ) -> tuple[list[int], list[int], list[float], list[int]]:
    """A chain of drafts that cost no draft model, at most `limit` tokens, for one request (its shaper,
    at its committed state, where it is left; None: nothing shapes its logits): the tokens its grammar
    forces (jump-forward), then prompt lookup's continuation of the request's tokens (`context`:
    prompt and output) and the chain so far (`chain`: the speculator's suffix drafts, or
    ngram.matched_lookup, each as far as its match makes likely),
    then the tokens forced after those, and so on; the chain ends at the first lookup token the
    grammar refuses. Without a grammar: prompt lookup alone. lookup=False: the forced tokens alone
    (context unused). JSON answers repeat what they and their
    prompt wrote (keys an array's every object has, the schema's enum values): at batch 1 on the
    demo, prompt lookup's drafts at the steps with nothing forced were accepted ~half the time.
    Returns the tokens, each one's Source (FORCED or LOOKUP), each one's chance that it and every
    draft before it are accepted (a forced token's: the chance of the drafts before it; a lookup
    draft's: theirs times the lookup's own estimate) and each one's reach (a lookup draft's: the
    tokens its text matched before it, the match it continues and the drafts before it in that run;
    a forced token's 0)."""
    chain = chain or _certain
    if shaper is None or not shaper.has_grammar:
        drafts, probs, match = chain(np.asarray(context), limit) if lookup else ([], [], 0)
        return drafts, [Source.LOOKUP] * len(drafts), probs, _reaches(match, len(drafts))
    if not lookup:
        forced = shaper.forced_tokens(limit)
        return forced, [Source.FORCED] * len(forced), [1.0] * len(forced), [0] * len(forced)
    out: list[int] = []
    src: list[int] = []
    chance: list[float] = []
    reach: list[int] = []
    sure = 1.0  # the chance that every draft so far is accepted
    try:
        while len(out) < limit:
            forced = shaper.forced_tokens(limit - len(out))
            for t in forced:
                shaper.push(t)
            out += forced
            src += [Source.FORCED] * len(forced)
            chance += [sure] * len(forced)
            reach += [0] * len(forced)
            if len(out) >= limit:
                break
            drafts, probs, match = chain(np.concatenate((context, out)) if out else np.asarray(context),
                                         limit - len(out))
            if not drafts:
                break
            n = len(drafts) + 1  # the chain under the current state: its first prefix the grammar allows
            kept = len(shaper.plan_tree([0] + drafts, [-1] + list(range(n - 1)), n, n)[0]) - 1
            for t in drafts[:kept]:
                shaper.push(t)
            out += drafts[:kept]
            src += [Source.LOOKUP] * kept
            chance += [sure * p for p in probs[:kept]]
            reach += _reaches(match, kept)
            if kept:
                sure = chance[-1]
            if kept < len(drafts):  # the earlier text went on otherwise than the grammar allows here
                break
    finally:
        shaper.pop_all()
    return out, src, chance, reach


def _tighter(a: int | None, b: int | None) -> int | None:
    """The smaller of two draft caps (None: no cap)."""
    return b if a is None else a if b is None else min(a, b)


@dataclass(frozen=True)
class DraftPlan:
    """What the "draft head" start-up stage produced: everything a Speculator needs except
    the head's KV cache, whose size the "KV cache" stage decides (see `build`)."""

    algorithm: str
    shape: TreeShape
    policy: str
    disable_batch_threshold: int | None
    head: Eagle3Head | None  # eagle3 only
    target_cfg: TargetConfig
    ngram_branch: int = 0  # eagle3: suffix-draft nodes grafted onto each tree
    suffix_cache_tokens: int = DEFAULT_CACHE_TOKENS  # the cross-request suffix cache's bound (0: none)

    def kv_bytes_per_token(self) -> int:
        if self.head is None:
            return 0
        from augury.core.kv_cache import KVCache

        return KVCache.bytes_per_token(1, self.head.nkv, self.head.hd, self.head.dtype)

    def build(self, num_blocks: int, block_size: int, max_num_seqs: int, warming: bool = False) -> Speculator:
        """warming: the engine runs a warm-up request before traffic (Speculator.after_warmup ends it)."""
        drafter = SuffixDrafter(self.suffix_cache_tokens)
        proposer: Proposer
        if self.algorithm == "ngram":
            from augury.speculative.ngram import NgramProposer

            proposer = NgramProposer()
        elif self.algorithm == "suffix":
            from augury.speculative.suffix_proposer import SuffixProposer

            proposer = SuffixProposer(drafter)
        else:
            from augury.speculative.eagle3_proposer import Eagle3Proposer

            proposer = Eagle3Proposer(self.head, self.target_cfg, num_blocks, block_size, self.ngram_branch, drafter)
        if self.policy == "adaptive":
            from augury.speculative.adaptive import AdaptivePolicy

            prior = list(self.head.cfg.acceptance or []) if self.head is not None else None
            policy = AdaptivePolicy(self.shape, self.disable_batch_threshold, prior=prior)
        else:
            policy = StaticPolicy(self.shape, self.disable_batch_threshold)
        return Speculator(proposer, policy, max_num_seqs, warming=warming,
                          disable_batch_threshold=self.disable_batch_threshold,
                          drafter=drafter if self.algorithm != "ngram" else None)


def plan_speculation(config: EngineConfig, resolved, model, tcfg: TargetConfig, dtype: torch.dtype,
                     device: torch.device, max_len: int) -> DraftPlan | None:
    """Pick the algorithm and tree, and load the head (strictly) from `resolved.draft_dir` (a
    config.ResolvedModel); None = no speculation. Without an algorithm configured, a head means eagle3."""
    algo = config.speculative_algorithm
    draft = resolved.draft_dir
    if algo is None:
        algo = "eagle3" if draft is not None else "none"
    if algo == "none":
        return None
    if config.speculative_num_steps is not None:
        shape = TreeShape(config.speculative_num_steps, config.speculative_eagle_topk,
                          config.speculative_num_draft_tokens)
    else:
        shape = AUTO_SHAPE[algo]
    head = None
    if algo == "ngram":
        if shape.topk != 1:
            raise ValueError("the n-gram proposer drafts chains: speculative_eagle_topk must be 1")
    elif algo != "suffix":
        if draft is None:
            raise ValueError("speculative_algorithm eagle3 needs an EAGLE-3 head (draft_model)")
        from augury.models.eagle3_head import load_eagle3

        # the head's linears run in the target's mode (a native-int4 GGUF target: an int4 head)
        head = load_eagle3(draft, tcfg, model.embed_tokens, dtype, device, max_len + 2 * shape.num_steps + 2,
                           quantization=model.quantization)
    log.info("speculation: %s, tree %s, policy %s", algo, shape, config.speculative_policy)
    branch = config.speculative_ngram_branch
    branch = (AUTO_NGRAM_BRANCH if branch is None else branch) if algo == "eagle3" else 0
    return DraftPlan(algo, shape, config.speculative_policy, config.speculative_disable_batch_threshold, head, tcfg,
                     branch, config.speculative_suffix_cache_tokens)
