"""The speculative step: ask the policy, draft a tree, verify it in one target forward, commit.

The same verification serves every proposer (EAGLE-3 head, n-gram lookup). Rejected
nodes' KV sits past each request's committed length and is overwritten next step; the
accepted path is compacted to consecutive slots, so no block leaks and nothing stale is
ever attended to.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from augury.config import EngineConfig
from augury.engine.request import Request
from augury.models.config import TargetConfig
from augury.spec.policy import StaticPolicy, TreeShape
from augury.spec.tree import tree_attention_mask
from augury.spec.verifier import verify

log = logging.getLogger("augury.spec")

# Auto tree shapes when none is configured: (num_steps, topk, num_draft_tokens).
AUTO_SHAPE = {"eagle3": TreeShape(5, 1, 6), "ngram": TreeShape(4, 1, 5)}


class Speculator:
    """Owns a proposer and a policy; `step` runs one speculative decode step for a batch."""

    def __init__(self, proposer, policy, max_shape: TreeShape) -> None:
        self.proposer = proposer
        self.policy = policy
        self.max_shape = max_shape

    @property
    def needs_aux(self) -> bool:
        return self.proposer.needs_aux

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.proposer.aux_layers

    def kv_bytes_per_token(self) -> int:
        return getattr(self.proposer, "kv_bytes_per_token", lambda: 0)()

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        if hasattr(self.proposer, "allocate_cache"):
            self.proposer.allocate_cache(num_blocks, block_size)

    def after_warmup(self, engine) -> None:
        if hasattr(self.policy, "calibrate"):
            self.policy.calibrate(engine, self)

    def step(self, engine, reqs: list[Request]) -> bool:
        """Speculate for this decode batch; False means the caller should decode plainly."""
        shape = self.policy.choose(len(reqs))
        engine.stats.last_draft_tokens = shape.num_drafts if shape else 0
        if shape is None or not engine.scheduler.try_reserve(reqs, shape.num_draft_tokens):
            engine.stats.steps_plain += 1
            return False
        t0 = time.perf_counter()
        tree = self.proposer.propose(engine, reqs, shape)
        accepted = self.verify_and_commit(engine, reqs, tree)
        self.policy.observe(len(reqs), shape, time.perf_counter() - t0, accepted)
        engine.stats.steps_spec += 1
        return True

    def verify_and_commit(self, engine, reqs: list[Request], tree) -> list[int]:
        dev = engine.device
        n = tree.num_nodes
        mask = tree_attention_mask(tree.parents).to(dev)  # [B, N, N]
        ctx = torch.tensor([r.num_computed for r in reqs])
        positions = ctx[:, None] + tree.depth.cpu()  # [B, N]: the tree sits at seq_len + depth
        hidden, aux = engine.forward(reqs, tree.tokens.tolist(), positions, mask, aux=self.needs_aux)
        # logits only at the nodes the acceptance walk visits (lm_head is costly on CPUs)
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
                    src.append(_slot(base, r.num_computed + node, engine.allocator.block_size))
                    dst.append(_slot(base, r.num_computed + j, engine.allocator.block_size))
            m = len(path) - 1
            accepted.append(m)
            if aux is not None:
                r.pending_aux.append(aux[b, path])  # target features of the committed positions
            r.spec_stats.num_verify_steps += 1
            r.spec_stats.num_draft_tokens += n - 1
            r.spec_stats.num_accepted_draft_tokens += m
            engine.stats.record_verification(depths[b], m, n - 1)
        if src:
            engine.kv.copy_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        for r, toks in zip(reqs, committed):
            r.num_computed += len(toks)  # the root and the accepted drafts are now in the cache
            engine.commit(r, toks)
        return accepted


def _slot(table: list[int], pos: int, block_size: int) -> int:
    return table[pos // block_size] * block_size + pos % block_size


def build_speculator(config: EngineConfig, model, tcfg: TargetConfig, folder: Path,
                     dtype: torch.dtype, device: torch.device, max_len: int) -> Speculator | None:
    algo = config.speculative_algorithm
    draft = config.draft_model
    if algo is None:
        if draft is None and config.model == "demo":
            from augury.heads import demo_head_dir

            draft = demo_head_dir()
        algo = "eagle3" if draft is not None else "none"
    if algo == "none":
        return None
    if config.speculative_num_steps is not None:
        shape = TreeShape(config.speculative_num_steps, config.speculative_eagle_topk,
                          config.speculative_num_draft_tokens)
    else:
        shape = AUTO_SHAPE[algo]
    if algo == "ngram":
        from augury.spec.ngram import NgramProposer

        if shape.topk != 1:
            raise ValueError("the n-gram proposer drafts chains: speculative_eagle_topk must be 1")
        proposer = NgramProposer()
    else:
        if draft is None:
            from augury.heads import demo_head_dir

            draft = demo_head_dir() if config.model == "demo" else None
            if draft is None:
                raise ValueError("speculative_algorithm eagle3 needs --speculative-draft-model-path")
        from augury.models.eagle3 import load_eagle3
        from augury.spec.eagle3 import Eagle3Proposer

        head = load_eagle3(draft, tcfg, model.embed_tokens, dtype, device, max_len + 2 * shape.num_steps + 2)
        proposer = Eagle3Proposer(head, tcfg)
    if config.speculative_policy == "adaptive":
        from augury.spec.adaptive import AdaptivePolicy

        policy = AdaptivePolicy(shape, config.speculative_disable_batch_threshold)
    else:
        policy = StaticPolicy(shape, config.speculative_disable_batch_threshold)
    log.info("speculation: %s, tree %s, policy %s", algo, shape, config.speculative_policy)
    return Speculator(proposer, policy, shape)
