"""The target features a draft head has not seen yet, for every request of an engine, in one buffer.

EAGLE-3 drafts from the target's hidden states (its features): every forward that a proposer may
later need writes each new position's features here, and the proposer's next drafting pass reads
those of a request since it last drafted (its catch-up), at most `window` of them, the newest (a
request that waited longer drafts with the older ones zeroed: Request.draft_skip counts them).

One preallocated ring per request slot, [slots, window, dim]: position p of a request sits at row
p % window of its slot, so a decode step's forward writes the whole batch's features straight into
their rows (step_rows, then kept_step; or, before the buffer exists, add_step's one indexed copy)
and keeps no tensor of the step alive. (Kept as a list of per-step views per request, each step's
feature tensor stayed alive until its request finished: with nothing drafting, the default engine
ran at 0.96-0.98x of one that captured nothing, against 1.00x when the features were captured and
dropped; `augury bench` batch 16, 2026-12-03, AVX-512 Xeon.) A slot is taken at a request's first
features and given back when the engine lets the request go (`release`); slots grow by doubling.
"""
from __future__ import annotations

import torch

from augury.core.request import Request


class FeatureStore:
    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None  # [slots, window, dim]
        self.flat: torch.Tensor | None = None  # buf as [slots * window, dim]: row slot * window + p % window
        self.free: list[int] = []
        self._epoch = 0  # bumped when the buffer is rebuilt: what requests held in it is gone

    @property
    def window(self) -> int:
        return self.buf.shape[1] if self.buf is not None else 0

    def _prepare(self, like: torch.Tensor, window: int) -> torch.Tensor:
        """A buffer for features like `like` ([..., dim]) holding `window` positions per request; returns
        `like` in the buffer's dtype. A wider window or another dim or device than the buffer's builds it
        anew (slots kept, what they held dropped: see _slot)."""
        buf = self.buf
        if buf is None or buf.shape[1] < window or buf.shape[2] != like.shape[-1] or buf.device != like.device:
            slots = buf.shape[0] if buf is not None else 0
            self._use(like.new_empty(slots, window, like.shape[-1]))
            self._epoch += 1
        return like if like.dtype == self.buf.dtype else like.to(self.buf.dtype)

    def _use(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.flat = buf.view(-1, buf.shape[2])

    def _slot(self, req: Request) -> int:
        if req.feat_slot is not None and req.feat_epoch != self._epoch:  # the buffer was rebuilt
            req.draft_skip += req.num_pending
            req.num_pending = 0
            req.feat_epoch = self._epoch
        if req.feat_slot is None:
            if not self.free:
                old = self.buf.shape[0]
                grown = self.buf.new_empty(max(4, 2 * old), *self.buf.shape[1:])
                grown[:old] = self.buf
                self._use(grown)
                self.free = list(range(grown.shape[0] - 1, old - 1, -1))
            req.feat_slot = self.free.pop()
            req.feat_epoch = self._epoch
        return req.feat_slot

    def _keep(self, req: Request, n: int, window: int) -> None:
        """n more positions are held for req; the oldest beyond `window` are dropped."""
        req.num_pending += n
        if req.num_pending > window:
            req.draft_skip += req.num_pending - window
            req.num_pending = window

    def add(self, req: Request, feats: torch.Tensor, window: int) -> None:
        """feats [n, dim]: req's features of positions num_computed .. num_computed + n - 1 (called
        before num_computed moves past them)."""
        n = feats.shape[0]
        if n == 0:
            return
        feats = self._prepare(feats, window)
        slot = self._slot(req)
        w = self.window
        keep = min(n, window)
        # the kept positions' rows are one run of the ring, or two where it wraps: slice copies, not an
        # index tensor (after a forward each torch operator costs several times its warm time; see
        # add_step): 2 against 4 for a verification's accepted run
        first = (req.num_computed + n - keep) % w
        head = min(keep, w - first)
        src = feats[n - keep :]
        self.buf[slot, first : first + head].copy_(src[:head])
        if head < keep:
            self.buf[slot, : keep - head].copy_(src[head:])
        self._keep(req, n, window)

    def add_step(self, reqs: list[Request], feats: torch.Tensor, window: int) -> None:
        """feats [B, dim]: each request's features of its position num_computed (a decode step), in
        one indexed copy. (Every step pays for what it does here, and right after a forward that
        streamed the weights through every cache level each torch call costs several times its
        isolated time: at batch 4 on an AVX2 EPYC, two index tensors and an index_put_ took ~150 us of
        an 11 ms step, ~1.4%; one index tensor and an index_copy_ into the flat view ~110 us. The
        engine has the forward write them itself where it can: step_rows.)"""
        feats = self._prepare(feats, window)
        w = self.window
        rows = [self._slot(r) * w + r.num_computed % w for r in reqs]
        self.flat.index_copy_(0, torch.tensor(rows, device=self.buf.device), feats)
        for r in reqs:
            self._keep(r, 1, window)

    def step_rows(self, reqs: list[Request], dim: int, window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a decode step's features go, for the forward to write them itself (models/llama.py's
        aux_into): (rows [slots * window, dim], index [B] int64: request b's row for its position
        num_computed), then kept_step once written. None while the buffer holds no features of width
        dim and at least `window` positions (add_step builds it)."""
        buf = self.buf
        if buf is None or buf.shape[1] < window or buf.shape[2] != dim:
            return None
        w = buf.shape[1]
        index = [self._slot(r) * w + r.num_computed % w for r in reqs]  # _slot may grow the buffer: flat after
        return self.flat, torch.tensor(index, dtype=torch.int64)

    def kept_step(self, reqs: list[Request], window: int) -> None:
        """The rows step_rows gave for reqs were written: each request holds one more position."""
        for r in reqs:
            self._keep(r, 1, window)

    def take(self, req: Request) -> tuple[int, torch.Tensor]:
        """(positions dropped past the window, the features held [num_pending, dim] in position order),
        and forget them."""
        if req.feat_slot is not None and req.feat_epoch != self._epoch:
            self._slot(req)  # the buffer was rebuilt since: what it held is dropped
        skip, n = req.draft_skip, req.num_pending
        if self.buf is None:
            feats = torch.empty(0, 0)
        elif n == 0:
            feats = self.buf.new_empty(0, self.buf.shape[2])
        else:
            first = (req.num_computed - n) % self.window
            if first + n <= self.window:  # a slice of the slot's ring (a copy all the same: the ring moves on)
                feats = self.buf[req.feat_slot, first: first + n].clone()
            else:
                rows = torch.arange(req.num_computed - n, req.num_computed) % self.window
                feats = self.buf[req.feat_slot, rows.to(self.buf.device)]
        req.num_pending = req.draft_skip = 0
        return skip, feats

    def release(self, req: Request) -> None:
        """req is gone: its slot serves another."""
        if req.feat_slot is not None:
            self.free.append(req.feat_slot)
            req.feat_slot = None
        req.num_pending = req.draft_skip = 0
