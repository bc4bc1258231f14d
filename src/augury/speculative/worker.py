"""The speculative step: ask the policy, draft a tree, verify it in one target forward, commit.

The same verification serves every proposer (EAGLE-3 head, n-gram lookup). Rejected
nodes' KV sits past each request's committed length and is overwritten next step; the
accepted path is compacted to consecutive slots, so no block leaks and nothing stale is
ever attended to.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from augury.config import EngineConfig
from augury.engine.kv_cache import slot_of
from augury.engine.request import Request
from augury.models.config import TargetConfig
from augury.speculative.policy import StaticPolicy, TreeShape
from augury.speculative.tree import tree_attention_mask
from augury.speculative.verifier import verify

log = logging.getLogger("augury.speculative")

# Auto tree shapes when none is configured: (num_steps, topk, num_draft_tokens).
AUTO_SHAPE = {"eagle3": TreeShape(3, 4, 8), "ngram": TreeShape(4, 1, 5)}
AUTO_NGRAM_BRANCH = 6  # prompt-lookup tokens grafted onto each EAGLE-3 tree when none is configured
LOGITS_AT_ONCE = 256  # tree nodes in a batch up to which verification computes all logits at once


class Speculator:
    """Owns a proposer and a policy; `step` runs one speculative decode step for a batch."""

    def __init__(self, proposer, policy, catch_up_window: int = 128) -> None:
        self.proposer = proposer
        self.policy = policy
        self.catch_up_window = catch_up_window  # most target features kept per request for the head

    @property
    def needs_aux(self) -> bool:
        return self.proposer.needs_aux

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.proposer.aux_layers

    def after_warmup(self, engine) -> None:
        if hasattr(self.policy, "calibrate"):
            self.policy.calibrate(engine, self)

    def step(self, engine, reqs: list[Request]) -> bool:
        """Speculate for this decode batch; False means the caller should decode plainly."""
        shape = self.policy.choose(len(reqs))
        engine.stats.last_draft_tokens = shape.num_drafts if shape else 0
        extra = getattr(self.proposer, "extra_nodes", 0)  # nodes a proposer may add beyond the shape's
        if shape is None or not engine.scheduler.try_reserve(reqs, shape.num_draft_tokens + extra):
            engine.stats.steps_plain += 1
            return False
        # a step that first feeds the head a prompt or a run of plain steps is slower than drafting
        # itself; its time would make speculation look dear, so the policy only learns its acceptance
        backlog = max((r.num_computed - r.draft_len for r in reqs), default=0) if self.needs_aux else 0
        t0 = time.perf_counter()
        tree = self.proposer.propose(engine, reqs, shape)
        accepted = self.verify_and_commit(engine, reqs, tree)
        self.policy.observe(len(reqs), shape, time.perf_counter() - t0, accepted,
                            timed=backlog <= shape.num_steps + 1)
        engine.stats.steps_spec += 1
        return True

    def verify_and_commit(self, engine, reqs: list[Request], tree) -> list[int]:
        dev = engine.device
        n = tree.num_nodes
        mask = tree_attention_mask(tree.parents).to(dev)  # [B, N, N]
        ctx = torch.tensor([r.num_computed for r in reqs])
        positions = ctx[:, None] + tree.depth.cpu()  # [B, N]: the tree sits at seq_len + depth
        hidden, aux = engine.forward(reqs, tree.tokens.tolist(), positions, mask, aux=self.needs_aux,
                                     tree_parents=tree.parents.cpu())
        # Small batches: every node's logits in one product, reading the output layer once (it is
        # memory-bound: one row costs nearly what 256 do). Large ones: only the nodes the walk visits.
        if hidden.shape[0] * n <= LOGITS_AT_ONCE:
            logits_at = engine.model.logits(hidden)  # [B, N, V]
        else:
            logits_at = lambda bs, ns: engine.model.logits(hidden[bs, ns])  # noqa: E731  -> [A, V]
        ps = [r.params for r in reqs]
        res = verify(tree, logits_at, [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                     [r.generator for r in reqs])
        committed = res.committed_tokens(tree)
        depths = tree.depth.max(dim=1).values.tolist()  # [B] deepest draft offered per request
        src, dst = [], []
        accepted = []
        for b, (r, path) in enumerate(zip(reqs, res.accepted_nodes)):
            base = r.block_table
            for j, node in enumerate(path):
                if node != j:  # compact the accepted path into consecutive slots
                    src.append(slot_of(base, r.num_computed + node, engine.allocator.block_size))
                    dst.append(slot_of(base, r.num_computed + j, engine.allocator.block_size))
            m = len(path) - 1
            accepted.append(m)
            if aux is not None:
                r.add_pending(aux[b, path], self.catch_up_window)  # features of the committed positions
            engine.stats.record_verification(depths[b], m, n - 1)  # the verifier's verdict
        if src:
            engine.kv.copy_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        for r, toks, m in zip(reqs, committed, accepted):
            r.num_computed += len(toks)  # the root and the accepted drafts are now in the cache
            kept = engine.commit(r, toks)  # fewer than len(toks) when a stop condition cut it short
            # per request, count what was emitted: len(token_ids) = plain steps + verify steps + accepted
            r.spec_stats.num_verify_steps += 1
            r.spec_stats.num_draft_tokens += n - 1
            r.spec_stats.num_accepted_draft_tokens += min(m, kept - 1)
        return accepted


@dataclass(frozen=True)
class DraftPlan:
    """What the "draft head" start-up stage produced: everything a Speculator needs except
    the head's KV cache, whose size the "KV cache" stage decides (see `build`)."""

    algorithm: str
    shape: TreeShape
    policy: str
    disable_batch_threshold: int | None
    head: object | None  # models.eagle3.Eagle3Head for eagle3
    target_cfg: TargetConfig
    ngram_branch: int = 0  # eagle3: prompt-lookup tokens grafted onto each tree

    def kv_bytes_per_token(self) -> int:
        if self.head is None:
            return 0
        from augury.engine.kv_cache import KVCache

        return KVCache.bytes_per_token(1, self.head.nkv, self.head.hd, self.head.fc.weight.dtype)

    def build(self, num_blocks: int, block_size: int) -> Speculator:
        if self.algorithm == "ngram":
            from augury.speculative.ngram import NgramProposer

            proposer = NgramProposer()
        else:
            from augury.speculative.eagle3 import Eagle3Proposer

            proposer = Eagle3Proposer(self.head, self.target_cfg, num_blocks, block_size, self.ngram_branch)
        if self.policy == "adaptive":
            from augury.speculative.adaptive import AdaptivePolicy

            prior = list(self.head.cfg.acceptance or []) if self.head is not None else None
            policy = AdaptivePolicy(self.shape, self.disable_batch_threshold, prior=prior)
        else:
            policy = StaticPolicy(self.shape, self.disable_batch_threshold)
        return Speculator(proposer, policy)


def plan_speculation(config: EngineConfig, model, tcfg: TargetConfig, dtype: torch.dtype, device: torch.device,
                     max_len: int) -> DraftPlan | None:
    """Resolve the algorithm and tree, and load the head (strictly); None = no speculation."""
    algo = config.speculative_algorithm
    draft = config.draft_model
    if draft is None and config.model == "demo" and algo in (None, "eagle3"):
        from augury.heads import demo_head_dir

        draft = demo_head_dir()
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
    else:
        if draft is None:
            raise ValueError("speculative_algorithm eagle3 needs --speculative-draft-model-path")
        from augury.models.eagle3 import load_eagle3

        head = load_eagle3(draft, tcfg, model.embed_tokens, dtype, device, max_len + 2 * shape.num_steps + 2)
    log.info("speculation: %s, tree %s, policy %s", algo, shape, config.speculative_policy)
    branch = config.speculative_ngram_branch
    branch = (AUTO_NGRAM_BRANCH if branch is None else branch) if algo == "eagle3" else 0
    return DraftPlan(algo, shape, config.speculative_policy, config.speculative_disable_batch_threshold, head, tcfg,
                     branch)
