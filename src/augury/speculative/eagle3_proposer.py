"""EAGLE-3 drafting: catch the head up on target features, then grow an EAGLE-2 tree.

Draft position p pairs the target's hidden state h_p with token p+1. The head's KV cache
shares the target's block tables, prefix-cache hits included (see Eagle3Proposer.head_table);
tree expansion never writes the requests' blocks (tree keys live in scratch tensors, or, on the
head kernel, in a scratch region after the head's blocks), so rejected branches cannot leave
anything behind.

Two paths compute the same drafts up to rounding: the head kernel (models/eagle3_fused.py: one call
per draft level for the whole batch, and one per catch-up chunk with every request's pending rows
in it, unpadded), where it runs; the torch head otherwise (AUGURY_CPU_KERNELS=0: the reference).
"""
from __future__ import annotations

import numpy as np
import torch

from augury.attention import masked_metadata, padded_positions
from augury.core.kv_cache import KVCache, slot_of
from augury.core.request import Request
from augury.core.timing import clock
from augury.models.config import TargetConfig
from augury.models.eagle3_fused import FusedHead
from augury.models.eagle3_head import Eagle3Head, default_aux_layers
from augury.speculative.interface import TargetHost
from augury.speculative.ngram import lookup
from augury.speculative.policy import TreeShape
from augury.speculative.suffix import SuffixDrafter
from augury.speculative.tree import DraftTree, graft_chains, graft_trees, select_tree

EXTEND_CHUNK = 256  # catch-up tokens per request per draft forward (bounds mask memory)
CATCH_UP_ROWS = 256  # head kernel: catch-up rows per call, all requests' together (bounds the slot lists)
SCRATCH_SLOTS = 1024  # head kernel: draft-tree keys the scratch region holds before it first grows


class Eagle3Proposer:
    """The EAGLE-3 head as a speculative.interface.Proposer."""

    needs_aux = True
    catch_up_seconds = 0.0  # the last propose call's catch-up (the head over the positions it had not seen)

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
        self.fused = FusedHead.build(head)  # None: the torch head drafts
        scratch = -(-SCRATCH_SLOTS // block_size) if self.fused is not None else 0
        self.cache = KVCache(1, num_blocks + 1 + scratch, block_size, head.nkv, head.hd, self.dtype, self.device)
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
    def _take(self, host: TargetHost, reqs: list[Request]) -> list[torch.Tensor]:
        """Every request's pending target features [n, A] (positions draft_len .. num_computed - 1, past
        the positions the window dropped, which read as zeros from here on)."""
        cache, bs = self.cache, host.block_size
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
        return feats

    def catch_up(self, host: TargetHost, reqs: list[Request]) -> torch.Tensor:
        """Feed every pending (h_p, token_{p+1}) pair; returns the head output at each
        request's last committed position [B, H] (the parent state of depth-1 drafts)."""
        head, bs = self.head, host.block_size
        feats = self._take(host, reqs)
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

    def _slots(self, r: Request, n: int) -> np.ndarray:
        """The head's cache slots of r's positions 0 .. n - 1 (head_table's)."""
        table, bs = np.asarray(self.head_table(r), dtype=np.int64), self.block_size
        pos = np.arange(n)
        return table[pos // bs] * bs + pos % bs

    def catch_up_fused(self, host: TargetHost, reqs: list[Request], k: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[np.ndarray | None]]:
        """catch_up on the head kernel: every request's pending rows, unpadded, in calls of up to
        CATCH_UP_ROWS rows together; the draft vocabulary's top k at each request's last position
        in the same call. Returns (the head output there [B, H] float32, top ids [B, k], their
        log-probabilities [B, k], each request's slots of its positions 0 .. num_computed - 1 where
        a call computed them, else None: the draft levels', _KernelLevels)."""
        fused, cache = self.fused, self.cache
        feats = self._take(host, reqs)
        start = [r.draft_len for r in reqs]  # feats[i]'s row j is position start[i] + j
        b = len(reqs)
        last = torch.empty(b, self.head.cfg.hidden_size, dtype=torch.float32)
        top_id = torch.empty(b, k, dtype=torch.int64)
        top_lp = torch.empty(b, k, dtype=torch.float32)
        whole = list(range(b))
        context: list[np.ndarray | None] = [None] * b
        todo = [(i, j0, min(j0 + CATCH_UP_ROWS, f.shape[0])) for i, f in enumerate(feats)
                for j0 in range(0, f.shape[0], CATCH_UP_ROWS)]
        while todo:
            call, rows = [], 0  # pieces (request, first row, end) of this call
            while todo and rows < CATCH_UP_ROWS:
                i, j0, j1 = todo.pop(0)
                take = min(j1 - j0, CATCH_UP_ROWS - rows)
                if take < j1 - j0:
                    todo.insert(0, (i, j0 + take, j1))
                call.append((i, j0, j0 + take))
                rows += take
            # (a call may hold two pieces of one request, the later reading the earlier's keys)
            width = max(start[i] + j1 for i, _, j1 in call)
            slots = np.zeros((rows, width), dtype=np.int64)
            tokens, positions, mapping, nkeys, aux, logit_rows, owners = [], [], [], [], [], [], []
            t = 0
            for i, j0, j1 in call:
                r, n, p0 = reqs[i], j1 - j0, start[i] + j0
                pos = np.arange(p0, p0 + n)
                sl = self._slots(r, p0 + n)
                slots[t : t + n, : len(sl)] = sl
                tokens.append(np.asarray(r.all_token_ids[p0 + 1 : p0 + 1 + n], dtype=np.int64))
                positions.append(pos)
                mapping.append(sl[pos])
                nkeys.append(pos + 1)
                aux.append(feats[i][j0:j1])
                if j1 == feats[i].shape[0]:
                    logit_rows.append(t + n - 1)
                    owners.append(i)
                    context[i] = sl
                r.draft_len = p0 + n
                t += n
            if len(call) == 1:  # a lone piece's arrays as they are
                joined = tokens[0], positions[0], mapping[0], nkeys[0], aux[0]
            else:
                joined = (*(np.concatenate(x) for x in (tokens, positions, mapping, nkeys)), torch.cat(aux))
            out, ids, lp = fused.run(cache.k[0], cache.v[0], *joined[:3], slots, joined[3], np.asarray(logit_rows), k,
                                     aux=joined[4])
            if owners == whole:  # every request's last row in this one call, in order (a decode step's)
                last, top_id, top_lp = out[logit_rows] if len(logit_rows) < len(out) else out, ids, lp
            elif owners:
                idx = torch.tensor(owners)
                last[idx] = out[torch.tensor(logit_rows)]
                top_id[idx], top_lp[idx] = ids, lp
        for r in reqs:
            self.offer(r)
        return last, top_id, top_lp, context

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

    def scratch(self, n: int) -> int:
        """The first of n slots after the head's blocks for draft-tree keys (the region grows when short)."""
        bs, base = self.block_size, (self.zero_block + 1) * self.block_size
        if self.cache.k.shape[1] - base < n:
            old = self.cache
            self.cache = KVCache(1, self.zero_block + 1 + -(-n // bs), bs, self.head.nkv, self.head.hd, self.dtype,
                                 self.device)
            self.cache.k[:, :base] = old.k[:, :base]
            self.cache.v[:, :base] = old.v[:, :base]
        return base

    # ------------------------------------------------------------------- drafting
    def propose(self, host: TargetHost, reqs: list[Request], shape: TreeShape) -> DraftTree:
        head, dev = self.head, self.device
        b, k, steps = len(reqs), shape.topk, shape.num_steps
        # timed only where the worker reads it (a backlog past a drafting step's usual rows): on CUDA the
        # clock waits for the device, which a step otherwise never does here
        timing = sum(r.num_computed - r.draft_len for r in reqs) > (steps + self.extra_nodes + 2) * b
        t0 = clock(dev) if timing else 0.0
        if self.fused is not None:
            parent_h, top_id, top_lp, context = self.catch_up_fused(host, reqs, k)
        else:
            parent_h = self.catch_up(host, reqs)  # [B, H]
            logp = torch.log_softmax(head.logits(parent_h), dim=-1)  # [B, Vd]
            top_lp, top_id = logp.topk(k, dim=-1)  # [B, k]
        self.catch_up_seconds = clock(dev) - t0 if timing else 0.0
        nc = [r.num_computed for r in reqs]
        roots = torch.tensor([r.last_token_id for r in reqs])
        if self.fused is not None:
            levels = _KernelLevels(self, reqs, nc, k, steps, context)
            toks, pars, scores = levels.grow(top_id, top_lp, parent_h)
            tree = select_tree(roots, toks, pars, scores, shape.num_draft_tokens)
        else:
            tree = self._torch_levels(host, reqs, nc, k, steps, roots, parent_h, top_id, top_lp,
                                      shape.num_draft_tokens)
        if self.ngram_branch and self.drafter is not None:
            drafts = [self.drafter.draft_for(r, self.ngram_branch) for r in reqs]
            tree = graft_trees(tree, [(d.tokens, d.parents) for d in drafts])
        elif self.ngram_branch:
            tree = graft_chains(tree, [lookup(r.all_token_ids, self.ngram_branch) for r in reqs])
        return tree

    def _torch_levels(self, host: TargetHost, reqs: list[Request], nc: list[int], k: int, steps: int,
                      roots: torch.Tensor, parent_h: torch.Tensor, top_id: torch.Tensor, top_lp: torch.Tensor,
                      num_nodes: int) -> DraftTree:
        """The draft levels after the first on the torch head (any device), and the tree they give."""
        head, dev, b = self.head, self.device, len(reqs)
        cand_tok, cand_par, cand_score = [head.to_target_ids(top_id)], [torch.full((b, k), -1, device=dev)], [top_lp]
        frontier_tok, frontier_score = cand_tok[0], top_lp  # [B, k]
        frontier_cand = torch.arange(k, device=dev).expand(b, k)  # candidate index of each frontier node
        frontier_h = parent_h[:, None, :].expand(b, k, parent_h.shape[-1])  # [B, k, H]
        parent_slot = None  # which node of the previous frontier each frontier node grew from (None: the root)
        if steps > 1:
            levels = _TorchLevels(self, reqs, nc, k, steps, host.block_size)
        n_cand = k
        for s in range(1, steps):
            out, c_lp, c_id = levels.step(s, frontier_tok, frontier_h, parent_slot)  # [B, k, H], [B, k, k] twice
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
            n_cand += k * k
        return select_tree(roots, torch.cat(cand_tok, 1).cpu(), torch.cat(cand_par, 1).cpu(),
                           torch.cat(cand_score, 1).float().cpu(), num_nodes)


class _TorchLevels:
    """Draft levels 1 .. steps - 1 on the torch head: the context keys read once, the tree's own keys
    kept in tensors, a mask of ancestors-or-self among the fed nodes."""

    def __init__(self, prop: Eagle3Proposer, reqs: list[Request], nc: list[int], k: int, steps: int,
                 block_size: int) -> None:
        dev, b = prop.device, len(reqs)
        self.head, self.k, self.b = prop.head, k, b
        self.nc = torch.tensor(nc, device=dev)
        # context keys of the head's cache (positions < nc), read once for all steps
        ctxb = masked_metadata([prop.head_table(r) for r in reqs], nc, [0] * b, 1, block_size, dev)
        self.c = c = ctxb.kv_index.shape[1] - 1
        self.ctx_k, self.ctx_v = _gather(prop.cache, ctxb.kv_index[:, :c])  # [B, C, nkv, hd]
        self.ctx_ok = torch.arange(c, device=dev)[None, :] < self.nc[:, None]  # [B, C]
        fed = k * (steps - 1)
        self.anc = torch.zeros(b, fed, fed, dtype=torch.bool, device=dev)  # ancestor-or-self among fed nodes
        self.fed_k: list[torch.Tensor] = []
        self.fed_v: list[torch.Tensor] = []

    def step(self, s: int, tok: torch.Tensor, h: torch.Tensor, parent_slot: torch.Tensor | None):
        b, k, c, anc, dev = self.b, self.k, self.c, self.anc, self.nc.device
        lo = (s - 1) * k  # fed indices of this frontier: lo .. lo+k-1
        if parent_slot is not None:
            anc[:, lo : lo + k] = anc[torch.arange(b, device=dev)[:, None], lo - k + parent_slot]
        anc[:, lo : lo + k, lo : lo + k] |= torch.eye(k, dtype=torch.bool, device=dev)
        pos = (self.nc - 1 + s)[:, None].expand(b, k)
        mask = torch.cat([self.ctx_ok[:, None, :].expand(b, k, c), anc[:, lo : lo + k, : lo + k]], dim=-1)[:, None]
        kk = torch.cat([self.ctx_k] + self.fed_k, dim=1)
        vv = torch.cat([self.ctx_v] + self.fed_v, dim=1)
        out, k_new, v_new = self.head(tok, h, pos, (kk, vv), mask, False)
        self.fed_k.append(k_new)
        self.fed_v.append(v_new)
        lp = torch.log_softmax(self.head.logits(out), dim=-1)  # [B, k, Vd]
        c_lp, c_id = lp.topk(k, dim=-1)  # [B, k, k]
        return out, c_lp, c_id


class _KernelLevels:
    """Draft levels 1 .. steps - 1 on the head kernel, one call each for the whole batch: node (b, i) of
    level s keeps its key at a scratch slot of its own and attends to its request's context slots,
    then its ancestors' slots and its own (the path from the root). The frontier's bookkeeping in
    numpy: the torch operators of _torch_levels on these few numbers cost ~3-5 us each, ~0.3 ms of a
    ~2.3 ms proposer call over a chain of 3 on the demo (AVX2 EPYC), numpy's ~1 us."""

    def __init__(self, prop: Eagle3Proposer, reqs: list[Request], nc: list[int], k: int, steps: int,
                 context: list[np.ndarray | None]) -> None:
        """context: per request, its slots of positions 0 .. nc - 1 where the catch-up just computed them
        (catch_up_fused's), else None (computed here)."""
        b, fed = len(reqs), k * max(steps - 1, 0)
        self.fused, self.k, self.b, self.fed, self.steps = prop.fused, k, b, fed, steps
        self.d2t = prop.head.d2t.numpy()
        self.base = prop.scratch(b * fed) if fed else 0
        self.cache = prop.cache
        self.nc = np.asarray(nc, dtype=np.int64)
        self.ctx = [c if c is not None and len(c) == n else prop._slots(r, n) for c, r, n in zip(context, reqs, nc)]

    def grow(self, top_id: torch.Tensor, top_lp: torch.Tensor, parent_h: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the first level's top k (ids in the draft vocabulary, log-probabilities [B, k]) and the
        head's output at each request's last position [B, H]: every level's candidates, as select_tree
        takes them (target ids, parents, cumulative log-probabilities [B, M])."""
        b, k, nc, d2t = self.b, self.k, self.nc, self.d2t
        ids, score = top_id.numpy(), top_lp.numpy()
        frontier_tok = ids + d2t[ids]  # [B, k] target ids
        cand_tok, cand_par, cand_score = [frontier_tok], [np.full((b, k), -1, dtype=np.int64)], [score]
        frontier_cand = np.broadcast_to(np.arange(k, dtype=np.int64), (b, k))  # each frontier node's candidate
        h = parent_h.float().repeat_interleave(k, 0) if k > 1 else parent_h.float()  # [B k, H]
        path = np.zeros((b, k, 0), dtype=np.int64)  # each frontier node's fed slots, root side first
        n_cand = k
        for s in range(1, self.steps):
            own = self.base + np.arange(b)[:, None] * self.fed + (s - 1) * k + np.arange(k)[None, :]  # [B, k]
            path = np.concatenate([path, own[:, :, None]], axis=2)  # [B, k, s]
            out, c_id, c_lp = self.step(s, frontier_tok, h, path)
            scores = (score[:, :, None] + c_lp).reshape(b, k * k)
            toks = (c_id + d2t[c_id]).reshape(b, k * k)
            cand_tok.append(toks)
            cand_par.append(np.repeat(frontier_cand, k, axis=1))
            cand_score.append(scores)
            # the best k children become the next frontier (ties: the earlier child)
            best = np.argsort(-scores, axis=1, kind="stable")[:, :k] if k > 1 else np.zeros((b, 1), dtype=np.int64)
            parent = best // k  # which frontier node each came from
            frontier_tok = np.take_along_axis(toks, best, 1)
            score = np.take_along_axis(scores, best, 1)
            frontier_cand = n_cand + best
            path = np.take_along_axis(path, parent[:, :, None], axis=1)
            # the next level's input: each new frontier node's parent's output (the kernel wrote `out` in h)
            h = out if k == 1 else \
                out.view(b, k, -1)[torch.arange(b)[:, None], torch.from_numpy(parent)].reshape(b * k, -1)
            n_cand += k * k
        cat = np.concatenate
        return (torch.from_numpy(cat(cand_tok, 1)), torch.from_numpy(cat(cand_par, 1)),
                torch.from_numpy(cat(cand_score, 1).astype(np.float32, copy=False)))

    def step(self, s: int, tok: np.ndarray, h: torch.Tensor, path: np.ndarray
             ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Draft level s, one kernel call: the frontier's tokens [B, k] (target ids), input states [B k, H]
        and key-slot paths from the root [B, k, s] (each node's own slot last) -> the head's outputs [B k, H]
        (written over h) and each node's k children, draft ids and log-probabilities [B, k, k]."""
        b, k, nc = self.b, self.k, self.nc
        slots = np.zeros((b, k, int(nc.max()) + s), dtype=np.int64)
        for i in range(b):
            slots[i, :, : nc[i]] = self.ctx[i]
            slots[i, :, nc[i]: nc[i] + s] = path[i]
        rows = b * k
        out, ids, lp = self.fused.run(self.cache.k[0], self.cache.v[0], tok.reshape(rows), np.repeat(nc - 1 + s, k),
                                      path[:, :, -1].reshape(rows), slots.reshape(rows, -1), np.repeat(nc + s, k),
                                      np.arange(rows), k, h=h)
        return out, ids.numpy().reshape(b, k, k), lp.numpy().reshape(b, k, k)


def _gather(cache: KVCache, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, C, nkv, hd] of the head's cache at slots index [B, C]."""
    b, c = index.shape
    flat = index.reshape(-1)
    k = cache.k[0].index_select(0, flat).view(b, c, *cache.k.shape[2:])
    v = cache.v[0].index_select(0, flat).view(b, c, *cache.v.shape[2:])
    return k, v
