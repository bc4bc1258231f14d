"""Sampling filters shared by the engine's sampler and speculative verification.

temperature, top-k and top-p turn raw logits into the target's sampling distribution; one
implementation, so that a token sampled plainly and a draft verified against the target see
exactly the same probabilities; and one draw (inverse CDF at a given uniform), so that the token
verification samples at a position is the token plain decoding samples there with that uniform.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch


MASKED_AT_MOST = 256  # tokens a grammar allows up to which a row's logits are computed at those alone
# What a row with no valid choice yields instead of a token: every logit -inf (a request's logit bias,
# bad words or grammar left nothing), or a NaN or infinity in it. The engine ends that request alone
# with finish_reason "error" (Engine.commit); the rest of its batch goes on untouched.
NO_TOKEN = -1


def logits_at_allowed(allowed: Sequence[np.ndarray | None],
                      masked: Callable[[list[int]], torch.Tensor | None],
                      whole: Callable[[list[int] | None], torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """Logits [n, V] for n rows, those with allowed[i] (a row's few allowed token ids, else None)
    computed at those tokens alone: masked(rows) -> [len(rows), V] (-inf elsewhere), or None where the
    output layer cannot; whole(rows) -> the rows' whole logits (rows None: all n). Returns the logits
    and whether masked declined (every row then came from whole)."""
    few = [i for i, ids in enumerate(allowed) if ids is not None]
    part = masked(few) if few else None
    if part is None:
        return whole(None), bool(few)
    if len(few) == len(allowed):
        return part, False
    rest = [i for i, ids in enumerate(allowed) if ids is None]
    out = part.new_empty(len(allowed), part.shape[-1])
    out[few] = part
    out[rest] = whole(rest)
    return out, False


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """logits [..., V] -> each row's greedy token: the index of its largest value, the first one on a
    tie, as torch.argmax gives it, or NO_TOKEN where that value is not finite (the row is all -inf,
    or holds a NaN: both argmaxes take a NaN as the largest, or +inf). A float32 tensor on the CPU goes
    through numpy's argmax (same answer; ~4 us a 49,152-token row against ~62 us for torch 2.13's, 94
    against 497 us for 16 rows, on an AMX Xeon: 2% of a demo decode step at batch 1), anything else
    through torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        arr = logits.detach().numpy()
        idx = np.argmax(arr, axis=-1)
        best = np.take_along_axis(arr, idx[..., None], axis=-1)[..., 0]
        return np.where(np.isfinite(best), idx, NO_TOKEN).tolist()
    idx = logits.argmax(dim=-1, keepdim=True)
    best = logits.gather(-1, idx)
    return torch.where(torch.isfinite(best), idx, NO_TOKEN)[..., 0].tolist()


def greedy_ids(logits: torch.Tensor, shapers: Sequence[LogitsShaper | None]) -> list[int]:
    """logits [B, V] -> each row's greedy token: argmax_ids of the raw row, or, where the row has a
    shaper, its LogitsShaper.greedy on a float32 copy of the row (logits stay raw)."""
    own = [i for i, s in enumerate(shapers) if s is not None]
    out = argmax_ids(logits) if len(own) < len(shapers) else [0] * len(shapers)
    for i in own:
        out[i] = shapers[i].greedy(logits[i].to(torch.float32, copy=True))
    return out


class LogitsShaper(Protocol):
    """What reshapes one request's logits before the filters below (augury.structured.RequestShaper:
    penalties, logit bias, bad words, a grammar's mask). Its state is the request's committed output
    plus any tokens a verification walk pushed on top; the engine commits, a verifier pushes and
    pops. Request.shaper holds one, or None when nothing shapes the request's logits."""

    has_grammar: bool

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] float32 at the current state -> the shaped logits (in place; pass a copy)."""
        ...

    def greedy(self, logits: torch.Tensor) -> int:
        """argmax_ids of apply(logits) (in place; pass a copy), the first index on ties: the greedy
        token at the current state."""
        ...

    def allowed_ids(self, limit: int) -> np.ndarray | None:
        """The sorted token ids a grammar's mask allows next, where it allows at most `limit` (a row whose
        logits may then be computed at those alone, -inf elsewhere: shaping makes the same row of it);
        None where no mask applies or it allows more."""
        ...

    def shapes_beyond_mask(self) -> bool:
        """Whether anything but a grammar's mask (penalties, bias, bad words, min_tokens) shapes the next
        token at the current state."""
        ...

    def greedy_at(self, ids: np.ndarray, values: np.ndarray) -> int:
        """greedy() of a row that is `values` at allowed_ids' `ids` and -inf elsewhere, from the values
        alone (where shapes_beyond_mask() is False)."""
        ...

    def push(self, token: int) -> None:
        """A verification walk accepted `token` past the current state (undone by pop_all)."""
        ...

    def pop_all(self) -> None:
        """Back to the committed state."""
        ...

    def commit(self, token: int) -> bool:
        """`token` is now part of the output; True when it completed the grammar (it was the stop)."""
        ...

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens a grammar forces from the current state (jump-forward), at most `limit`."""
        ...

    def plan_tree(self, tokens: Sequence[int], parents: Sequence[int], size: int,
                  capacity: int) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """For one draft tree (node 0 the root at the current state): the nodes the grammar allows
        (an ancestor-closed list in index order), and forced continuations to hang under kept nodes
        (parent node, tokens), at most `capacity` nodes in all."""
        ...



def _per_row(value, n: int, dtype: torch.dtype, device: torch.device, none_as: float) -> torch.Tensor:
    """Scalar or length-n sequence/tensor -> [n] tensor; None entries become none_as."""
    if isinstance(value, torch.Tensor):
        t = value.to(device=device, dtype=dtype).flatten()
        return t.expand(n) if t.numel() == 1 else t
    if value is None or isinstance(value, (int, float)):
        return torch.full((n,), none_as if value is None else value, dtype=dtype, device=device)
    return torch.tensor([none_as if x is None else x for x in value], dtype=dtype, device=device)


_TOP_P_PREFIX = 1024  # top-p tries the 1024 most probable tokens before sorting a whole row


def _nucleus_edge(srt: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """srt [..., K] the K largest probabilities, descending; top_p broadcastable to [..., 1] ->
    [..., 1] the smallest probability in the nucleus (tokens whose mass strictly above them is
    < top_p), or -1 where the nucleus may reach past these K entries."""
    csum = srt.cumsum(dim=-1)
    keep_n = (csum - srt < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    edge = srt.gather(-1, keep_n - 1)
    return torch.where(csum[..., -1:] < top_p, torch.full_like(edge, -1.0), edge)


def apply_sampling_filters(logits: torch.Tensor, temperature, top_k=None, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """logits [R, ..., V] -> probs [R, ..., V] float32 (rows sum to 1, filtered tokens exactly 0).

    temperature / top_k / top_p / min_p: a scalar, or one value per leading row R (list or tensor).
    Order as in vLLM and SGLang: divide by temperature, keep the top_k logits (ties at the k-th
    kept), softmax, drop tokens under min_p x the largest probability, keep the smallest
    most-probable set with mass >= top_p (ties at its edge kept), renormalise. top_k None or <= 0,
    min_p 0 and top_p 1 are exact no-ops. Temperature 0 gives the one-hot argmax (the greedy
    limit), so a normal sampler may pass greedy rows through too. Logits of -inf (a grammar's mask)
    get probability 0; a row must keep at least one finite logit.
    """
    v = logits.shape[-1]
    r = logits.shape[0] if logits.dim() > 1 else 1
    flat = logits.reshape(r, -1, v).to(torch.float32)                   # [R, X, V]
    dev = flat.device
    temp = _per_row(temperature, r, torch.float32, dev, 1.0)
    kk = _per_row(top_k, r, torch.long, dev, 0)
    kk = torch.where((kk <= 0) | (kk > v), torch.full_like(kk, v), kk)
    pp = _per_row(top_p, r, torch.float32, dev, 1.0)
    greedy = temp <= 0
    flat = flat / torch.where(greedy, torch.ones_like(temp), temp).view(r, 1, 1)
    need_k = kk < v
    if bool(need_k.any()):
        sub = flat[need_k]                                              # [Rk, X, V]
        k_sub = kk[need_k]
        top = sub.topk(int(k_sub.max()), dim=-1).values                  # [Rk, X, kmax] descending
        kth = top.gather(-1, (k_sub - 1).view(-1, 1, 1).expand(-1, sub.shape[1], 1))
        flat[need_k] = sub.masked_fill(sub < kth, float("-inf"))
    probs = torch.softmax(flat, dim=-1)
    mm = _per_row(min_p, r, torch.float32, dev, 0.0)
    need_m = (mm > 0.0) & ~greedy
    if bool(need_m.any()):
        sub = probs[need_m]                                             # [Rm, X, V]
        sub = sub.masked_fill(sub < sub.amax(dim=-1, keepdim=True) * mm[need_m].view(-1, 1, 1), 0.0)
        probs[need_m] = sub / sub.sum(dim=-1, keepdim=True)
    need_p = (pp < 1.0) & ~greedy
    if bool(need_p.any()):
        sub = probs[need_p]                                             # [Rp, X, V]
        top_p = pp[need_p].view(-1, 1, 1)
        # Only the largest entries can survive: with top-k on every such row its k largest; else a
        # prefix, with a full sort for the rows whose nucleus reaches past it.
        kmax = int(kk[need_p].max())
        cap = kmax if kmax < v else min(v, _TOP_P_PREFIX)
        edge = _nucleus_edge(sub.topk(cap, dim=-1).values if cap < v else sub.sort(dim=-1, descending=True).values, top_p)
        far = (edge < 0).squeeze(-1)                                    # [Rp, X]
        if bool(far.any()):
            edge[far] = _nucleus_edge(sub[far].sort(dim=-1, descending=True).values, top_p.expand_as(edge)[far])
        sub = sub.masked_fill(sub < edge, 0.0)
        probs[need_p] = sub / sub.sum(dim=-1, keepdim=True)
    if bool(greedy.any()):
        g = flat[greedy]
        best = g.argmax(dim=-1, keepdim=True)
        hot = torch.nn.functional.one_hot(best[..., 0], v).to(probs.dtype)
        probs[greedy] = hot * torch.isfinite(g.gather(-1, best))  # no mass (NO_TOKEN) where the best is not finite
    return probs.reshape(logits.shape)


def _draw_kernel():
    """augury's CPU kernel for sampled draws (csrc/elementwise.cpp), or None where kernels cannot run
    (AUGURY_CPU_KERNELS=0, no AVX2): every row then goes through torch."""
    from augury.cpu import kernels as cpu_kernels

    return cpu_kernels.elementwise()


def draw_sampled(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int | None],
                 top_p: Sequence[float], min_p: Sequence[float], uniforms: Sequence[float]) -> list[int]:
    """One token per row of logits [A, V] (raw, or shaped by the row's request) at that row's
    uniform, each row with its own temperature (> 0), top_k, top_p and min_p: the one draw of a
    sampled position, for plain decoding (engine/sampler.py) and verification (speculative/
    verifier.py) alike, so both draw the same token from the same row and uniform. Float32 CPU rows
    go through augury's kernel where it runs (Elementwise.draw: the filters of
    apply_sampling_filters, in its order, by the kernel's own exp, float64 block sums and top-p edge,
    a few passes over the row and no sort of it); other rows (another device or dtype, kernels off)
    are draw_rows of apply_sampling_filters' probabilities. NO_TOKEN where a row has no mass."""
    n = logits.shape[0]
    fast = [i for i in range(n) if temperature[i] > 0.0]
    kernel = _draw_kernel() if fast and logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    out = [NO_TOKEN] * n
    if kernel is not None:
        rows = logits if len(fast) == n else logits[fast]
        drawn = kernel.draw(rows, [temperature[i] for i in fast], [top_k[i] for i in fast], [top_p[i] for i in fast],
                            [min_p[i] for i in fast], [uniforms[i] for i in fast])
        for i, tok in zip(fast, drawn):
            out[i] = tok if tok >= 0 else NO_TOKEN
        kept = set(fast)
        rest = [i for i in range(n) if i not in kept]
    else:
        rest = list(range(n))
    if rest:
        rows = logits if len(rest) == n else logits[rest]
        probs = apply_sampling_filters(rows, [temperature[i] for i in rest], [top_k[i] for i in rest],
                                       [top_p[i] for i in rest], [min_p[i] for i in rest]).cpu()
        for i, tok in zip(rest, draw_rows(probs, [uniforms[i] for i in rest])):
            out[i] = tok
    return out


def token_logprobs(logits: torch.Tensor, chosen: list[int], ks: list[int]):
    """logits [R, V] (raw, the target's) -> per row {chosen: Logprob, then the ks[r] most likely}.

    The distribution is the raw one: log_softmax of the float32 logits, before temperature,
    top-k and top-p (vLLM's default "raw logprobs"), so a token's log-probability is the same
    however it was sampled. A rank is 1 + the number of tokens strictly more likely."""
    from augury.outputs import Logprob

    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)                # [R, V]
    idx = torch.tensor([max(t, 0) for t in chosen], device=lp.device)[:, None]  # NO_TOKEN: no entry is kept
    got = lp.gather(1, idx)                                                 # [R, 1]
    ranks = ((lp > got).sum(dim=1) + 1).tolist()
    kmax = max(ks, default=0)
    got = got[:, 0].tolist()
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (None, None)
    top_v = top_v.tolist() if kmax else []
    top_i = top_i.tolist() if kmax else []
    out = []
    for r, tok in enumerate(chosen):
        d = {tok: Logprob(got[r], ranks[r])}
        for j in range(ks[r]):
            d.setdefault(top_i[r][j], Logprob(top_v[r][j], j + 1))
        out.append(d)
    return out


def draw_rows(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """One token per row of probs [A, V] (non-negative, each row summing to ~1) by inverting its
    float64 CDF at that row's uniform in [0, 1): exact up to float64 rounding, ~0.1 ms a row on a 49k
    vocabulary against torch.multinomial's ~1.5 ms (CPU, measured), and a function of the row and
    the uniform alone. Rows are scanned independently, so a row's token does not depend on the
    others. A token of probability 0 is never drawn (the first index whose cumulative mass exceeds
    u * total has positive mass; u rounding up to the total takes the last token with mass). A row
    with no mass, or a NaN (the softmax of a row shaping left all -inf, or of non-finite logits),
    draws NO_TOKEN."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [A, V]
    total = cdf[:, -1:]
    u = torch.tensor(uniforms, dtype=torch.float64, device=probs.device).view(-1, 1) * total
    picked = torch.searchsorted(cdf, u, right=True).view(-1).tolist()
    valid = (torch.isfinite(total) & (total > 0)).view(-1).tolist()
    v = cdf.shape[-1]
    for i, idx in enumerate(picked):
        if not valid[i]:
            picked[i] = NO_TOKEN
        elif idx >= v:
            picked[i] = int(torch.nonzero(probs[i] > 0)[-1].item())
    return picked
