"""EAGLE-3 drafting: catch the head up on target features, then grow an EAGLE-2 tree.

Draft position p pairs the target's hidden state h_p with token p+1. The head's KV cache
shares the target's block tables, prefix-cache hits included (see Eagle3Proposer.head_table);
tree expansion never writes it (tree keys live in scratch tensors), so rejected branches cannot
leave anything behind.
"""
from __future__ import annotations

import torch

from augury.attention import masked_metadata, padded_positions
from augury.core.kv_cache import KVCache, slot_of
from augury.core.request import Request
from augury.models.config import TargetConfig
from augury.models.eagle3_head import Eagle3Head, default_aux_layers
from augury.speculative.interface import TargetHost
from augury.speculative.ngram import lookup
from augury.speculative.policy import TreeShape
from augury.speculative.suffix import SuffixDrafter
from augury.speculative.tree import DraftTree, graft_chains, graft_trees, select_tree

EXTEND_CHUNK = 256  # catch-up tokens per request per draft forward (bounds mask memory)


class Eagle3Proposer:
    """The EAGLE-3 head as a speculative.interface.Proposer."""

    needs_aux = True

    def __init__(self, head: Eagle3Head, tcfg: TargetConfig, num_blocks: int, block_size: int,
                 ngram_branch: int = 0, drafter: SuffixDrafter | None = None) -> None:
        self.head = head
        # text lookup adds up to this many nodes to each tree (what the head may not see: the request's
        # own text and, with a drafter, recent requests' outputs, as a suffix draft; without one a
        # prompt-lookup chain)
        self.ngram_branch = ngram_branch
        self.drafter = drafter
        self.extra_nodes = ngram_branch
        self.aux_layers = head.cfg.aux_layer_ids or default_aux_layers(tcfg.num_layers)
        self.dtype = head.dtype
        self.device = head.device
        # the head's own one-layer cache, addressed through the target's block tables, plus one block
        # of zeros that stands for the blocks a request took from the prefix cache (see head_table)
        self.cache = KVCache(1, num_blocks + 1, block_size, head.nkv, head.hd, self.dtype, self.device)
        self.zero_block = num_blocks
        self.block_size = block_size
        # block -> (prefix-cache key of the full block whose head KV it holds, complete, and the token
        # after it: the head's input at the block's last position): offered by the request that wrote
        # it, for requests that take the block from the prefix cache
        self.offered: dict[int, tuple[bytes, int]] = {}

    def head_table(self, r: Request) -> list[int]:
        """Where the head's KV of r lives: the target's block table. r's blocks from the prefix cache
        (computed by another request; r starts its head past them, draft_len) are read as they are
        where their head KV was offered for r's own prefix and next token (see offer), else as the zero
        block, as if the catch-up window had dropped those positions."""
        n = r.num_cached_blocks
        if not n:
            return r.block_table
        table, keys, ids, offered, bs = r.block_table, r.block_keys, r.all_token_ids, self.offered, self.block_size
        return [b if offered.get(b) == (keys[i], ids[(i + 1) * bs]) else self.zero_block
                for i, b in enumerate(table[:n])] + table[n:]

    def _withdraw(self, r: Request, end: int) -> None:
        """r's head is about to write positions draft_len .. end-1: blocks there hold no offer (a block
        offered under one prefix may come back to a request holding other tokens)."""
        bs = self.block_size
        for i in range(r.draft_len // bs, -(-end // bs)):
            self.offered.pop(r.block_table[i], None)

    def offer(self, r: Request) -> None:
        """Offer the head KV of r's full blocks the head has now covered, keyed by r's prefix and the
        token after the block (the head's KV at position p reads token p+1): a request that takes one
        of them from the prefix cache with the same next token reads it (head_table) instead of zeros.
        Only r's own blocks (past its cache hit); the head never writes a block below draft_len again."""
        bs = self.block_size
        full = r.draft_len // bs
        if full <= r.draft_blocks_offered:
            return
        keys, ids = r.prefix_keys(full, bs), r.all_token_ids
        for i in range(r.draft_blocks_offered, full):
            self.offered[r.block_table[i]] = (keys[i], ids[(i + 1) * bs])
        r.draft_blocks_offered = full

    # ------------------------------------------------------------------ catch-up
    def catch_up(self, host: TargetHost, reqs: list[Request]) -> torch.Tensor:
        """Feed every pending (h_p, token_{p+1}) pair; returns the head output at each
        request's last committed position [B, H] (the parent state of depth-1 drafts)."""
        head, cache, bs = self.head, self.cache, host.block_size
        feats, skipped = [], []
        for r in reqs:
            self._withdraw(r, r.num_computed)
            skip, f = host.take_features(r)
            if skip:  # positions dropped past the window: the head attends to zeros there
                table = self.head_table(r)
                skipped.extend(slot_of(table, p, bs) for p in range(r.draft_len, r.draft_len + skip))
                r.draft_len += skip
            if f.shape[0] != r.num_computed - r.draft_len:
                raise RuntimeError(f"draft catch-up out of step with the target: {f.shape[0]} features for "
                                   f"positions {r.draft_len}..{r.num_computed - 1}")
            feats.append(f)
        if skipped:
            idx = torch.tensor(skipped, device=self.device)
            cache.k[0].index_fill_(0, idx, 0.0)
            cache.v[0].index_fill_(0, idx, 0.0)
        last = torch.empty(len(reqs), head.cfg.hidden_size, dtype=self.dtype, device=self.device)
        done = [0] * len(reqs)
        while True:
            rows = [i for i, f in enumerate(feats) if done[i] < f.shape[0]]
            if not rows:
                for r in reqs:
                    self.offer(r)
                return last
            sub = [reqs[i] for i in rows]
            q_lens = [min(EXTEND_CHUNK, feats[i].shape[0] - done[i]) for i in rows]
            q = max(q_lens)
            h_in = torch.zeros(len(rows), q, feats[rows[0]].shape[1], dtype=self.dtype, device=self.device)
            toks = torch.zeros(len(rows), q, dtype=torch.long)
            for j, i in enumerate(rows):
                r, n, start = reqs[i], q_lens[j], reqs[i].draft_len
                h_in[j, :n] = feats[i][done[i] : done[i] + n]
                toks[j, :n] = torch.tensor(r.all_token_ids[start + 1 : start + 1 + n])
            ctx = [r.draft_len for r in sub]
            # a shorter row's padding repeats its last position, as in the engine's prefill (past a request
            # near the context's end it lay past the head's rope table: IndexError at batch 48)
            pos = padded_positions(ctx, q_lens, q).to(self.device)
            batch = masked_metadata([self.head_table(r) for r in sub], ctx, q_lens, q, bs, self.device)
            out, k, v = self._forward(toks.to(self.device), head.fc(h_in), pos, batch)
            for j, i in enumerate(rows):
                done[i] += q_lens[j]
                reqs[i].draft_len += q_lens[j]
                last[i] = out[j, q_lens[j] - 1]

    def _forward(self, toks, h, pos, batch):
        """Head forward that caches the new keys/values at the batch's slots."""
        cache = self.cache
        kv_ctx = None
        if batch.kv_index is not None:
            kv_ctx = _gather(cache, batch.kv_index[:, : batch.kv_index.shape[1] - toks.shape[1]])
        out, k, v = self.head(toks, h, pos, kv_ctx, batch.mask, batch.causal)
        b, q = toks.shape
        cache.k[0].index_copy_(0, batch.slot_mapping, k.reshape(b * q, self.head.nkv, self.head.hd))
        cache.v[0].index_copy_(0, batch.slot_mapping, v.reshape(b * q, self.head.nkv, self.head.hd))
        return out, k, v

    # ------------------------------------------------------------------- drafting
    def propose(self, host: TargetHost, reqs: list[Request], shape: TreeShape) -> DraftTree:
        head, dev = self.head, self.device
        b, k, steps = len(reqs), shape.topk, shape.num_steps
        parent_h = self.catch_up(host, reqs)  # [B, H]
        nc = torch.tensor([r.num_computed for r in reqs], device=dev)
        roots = torch.tensor([r.last_token_id for r in reqs])

        logp = torch.log_softmax(head.logits(parent_h), dim=-1)  # [B, Vd]
        top_lp, top_id = logp.topk(k, dim=-1)  # [B, k]
        cand_tok, cand_par, cand_score = [head.to_target_ids(top_id)], [torch.full((b, k), -1, device=dev)], [top_lp]
        frontier_tok, frontier_score = cand_tok[0], top_lp  # [B, k]
        frontier_cand = torch.arange(k, device=dev).expand(b, k)  # candidate index of each frontier node
        frontier_h = parent_h[:, None, :].expand(b, k, parent_h.shape[-1])  # [B, k, H]
        if steps > 1:
            # context keys of the head's cache (positions < nc), read once for all steps
            ctxb = masked_metadata([self.head_table(r) for r in reqs], nc.tolist(), [0] * b, 1, host.block_size, dev)
            c = ctxb.kv_index.shape[1] - 1
            ctx_k, ctx_v = _gather(self.cache, ctxb.kv_index[:, :c])  # [B, C, nkv, hd]
            ctx_ok = torch.arange(c, device=dev)[None, :] < nc[:, None]  # [B, C]
            fed = k * (steps - 1)
            anc = torch.zeros(b, fed, fed, dtype=torch.bool, device=dev)  # ancestor-or-self among fed nodes
            fed_k, fed_v = [], []
            frontier_fed_parent = None  # fed index of each frontier node's parent (None: the root)
        n_cand = k
        for s in range(1, steps):
            lo = (s - 1) * k  # fed indices of this frontier: lo .. lo+k-1
            rows = torch.arange(b, device=dev)[:, None]
            if frontier_fed_parent is not None:
                anc[:, lo : lo + k] = anc[rows, frontier_fed_parent]
            anc[:, lo : lo + k, lo : lo + k] |= torch.eye(k, dtype=torch.bool, device=dev)
            pos = (nc - 1 + s)[:, None].expand(b, k)
            mask = torch.cat([ctx_ok[:, None, :].expand(b, k, c), anc[:, lo : lo + k, : lo + k]], dim=-1)[:, None]
            kk = torch.cat([ctx_k] + fed_k, dim=1)
            vv = torch.cat([ctx_v] + fed_v, dim=1)
            out, k_new, v_new = head(frontier_tok, frontier_h, pos, (kk, vv), mask, False)
            fed_k.append(k_new)
            fed_v.append(v_new)
            lp = torch.log_softmax(head.logits(out), dim=-1)  # [B, k, Vd]
            c_lp, c_id = lp.topk(k, dim=-1)  # [B, k, k]
            scores = (frontier_score[:, :, None] + c_lp).reshape(b, k * k)
            toks = head.to_target_ids(c_id).reshape(b, k * k)
            par = frontier_cand[:, :, None].expand(b, k, k).reshape(b, k * k)
            cand_tok.append(toks)
            cand_par.append(par)
            cand_score.append(scores)
            # the best k children become the next frontier
            best_score, best = scores.topk(k, dim=-1)  # [B, k]
            parent_slot = best // k  # which frontier node each came from
            frontier_tok = toks.gather(1, best)
            frontier_score = best_score
            frontier_cand = n_cand + best
            frontier_h = out.gather(1, parent_slot[:, :, None].expand(b, k, out.shape[-1]))
            frontier_fed_parent = lo + parent_slot
            n_cand += k * k
        tree = select_tree(roots, torch.cat(cand_tok, 1).cpu(), torch.cat(cand_par, 1).cpu(),
                           torch.cat(cand_score, 1).float().cpu(), shape.num_draft_tokens)
        if self.ngram_branch and self.drafter is not None:
            drafts = [self.drafter.draft(self.drafter.context(r), self.ngram_branch) for r in reqs]
            tree = graft_trees(tree, [(d.tokens, d.parents) for d in drafts])
        elif self.ngram_branch:
            tree = graft_chains(tree, [lookup(r.all_token_ids, self.ngram_branch) for r in reqs])
        return tree


def _gather(cache: KVCache, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, C, nkv, hd] of the head's cache at slots index [B, C]."""
    b, c = index.shape
    flat = index.reshape(-1)
    k = cache.k[0].index_select(0, flat).view(b, c, *cache.k.shape[2:])
    v = cache.v[0].index_select(0, flat).view(b, c, *cache.v.shape[2:])
    return k, v
