"""Target features and the training-time-test (TTT) loss of an EAGLE-3 head.

Notation: a row holds tokens x_0 .. x_{n-1}. The target at position q sees x_0..x_q, gives
aux features f_q (three layer outputs) and the distribution P_q over x_{q+1}.

Step 0 (what catch-up does at inference): index p takes h = fc(f_p) and token x_{p+1} at
position p, and predicts x_{p+2}, so its label is P_{p+1}.
Step j: index p takes the head's own pre-norm step-(j-1) output at p with token x_{p+1+j}
at position p+j and predicts x_{p+2+j}: label P_{p+1+j}. This is how a depth-(j+1) draft
is made at inference, where the head's inputs are its own guesses, not target features.

TTT attention mask of step j at index p (the same keys a depth-(j+1) draft sees):
  step-0 keys at indices 0..p (the cached context: causal),
  step-i keys (1 <= i <= j) at index p only (its own ancestors, and itself: the diagonal).
Everything else is hidden, e.g. step-1 keys of other indices belong to other draft chains.

Loss of step j: soft cross-entropy  -sum_v Q_{p+1+j}(v) log D_j,p(v)  over the draft
vocabulary, where Q is softmax of the target's logits restricted to the draft vocabulary
and D the head's softmax; averaged over indices whose label position p+1+j is a response
prediction (p+1+j >= prompt_len-1, x_{p+2+j} exists) with the target's argmax inside the
draft vocabulary; the steps are summed with weights 0.8^j.

Chains: each index p starts its own draft chain, which past step 0 reads only step-0 keys
and its own keys. Steps >= 1 may therefore run on a random fraction of the chains: an
unbiased estimate of those steps' mean loss for a fraction of their cost (step 0 always
runs on every index, since its keys are everyone's context).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from augury.models.eagle3_head import Eagle3Head
from augury.models.layers import apply_rope
from augury.attention import CausalNoCache
from augury.models.llama import TargetModel


@dataclass
class Features:
    aux: torch.Tensor  # [B, L, 3Ht] target layer outputs (the target's dtype)
    probs: torch.Tensor  # [B, L, Vd] float32: Q_q, target distribution at q over the draft vocab
    label_ok: torch.Tensor  # [B, L] bool: P_q is a response prediction with argmax in the draft vocab


@torch.no_grad()
def target_states(model: TargetModel, ids: torch.Tensor, aux_layers: tuple[int, ...],
                  t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One frozen target forward over right-padded rows ids [B, L] -> (final hidden states
    [B, L, Ht] (after the last norm), aux layer outputs [B, L, 3Ht], whether the target's argmax
    at each position is in the draft vocabulary [B, L]). Everything a training step needs from
    the target, in a form small enough to keep between epochs (the full logits are not)."""
    b, n = ids.shape
    dev = ids.device
    # a prefill with no context: causal attention among the row's tokens, no cache kept
    pos = torch.arange(n, device=dev)[None, :].expand(b, n)
    hidden, aux = model(ids, pos, CausalNoCache(), aux_layers)
    logits = F.linear(hidden, _output_weight(model))  # [B, L, V] in the target's dtype
    return hidden, aux, t2d.to(dev)[logits.argmax(-1)]


def _output_weight(model: TargetModel) -> torch.Tensor:
    return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight


def draft_output_weight(model: TargetModel, draft_ids: torch.Tensor) -> torch.Tensor:
    """The target output layer's rows for the draft vocabulary [Vd, Ht] (a copy: make it once)."""
    weight = _output_weight(model)
    return weight[draft_ids.to(weight.device)]


@torch.no_grad()
def features_from_states(hidden: torch.Tensor, aux: torch.Tensor, in_draft: torch.Tensor, lengths: torch.Tensor,
                         prompt_lens: torch.Tensor, draft_weight: torch.Tensor) -> Features:
    """Features from target_states' outputs: the label distributions are the target's logits
    at the draft vocabulary's rows (draft_output_weight; the same numbers as slicing the full logits)."""
    n, dev = hidden.shape[1], hidden.device
    logits = F.linear(hidden, draft_weight)  # [B, L, Vd]
    probs = torch.softmax(logits.float(), dim=-1)
    q = torch.arange(n, device=dev)[None, :]
    # P_q predicts x_{q+1}: a response token (q+1 >= prompt_len) that exists (q+1 <= len-1)
    label_ok = (q >= prompt_lens[:, None] - 1) & (q <= lengths[:, None] - 2) & in_draft
    return Features(aux, probs, label_ok)


@torch.no_grad()
def target_features(model: TargetModel, ids: torch.Tensor, lengths: torch.Tensor, prompt_lens: torch.Tensor,
                    aux_layers: tuple[int, ...], draft_ids: torch.Tensor, t2d: torch.Tensor) -> Features:
    """One frozen target forward over right-padded rows ids [B, L] (lengths, prompt_lens [B])."""
    hidden, aux, in_draft = target_states(model, ids, aux_layers, t2d)
    return features_from_states(hidden, aux, in_draft, lengths, prompt_lens, draft_output_weight(model, draft_ids))


def _kv_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    # [B, L, nkv, hd] -> [B, nh, L, hd]
    return x.repeat_interleave(rep, dim=2).transpose(1, 2) if rep > 1 else x.transpose(1, 2)


def ttt_step(head: Eagle3Head, tokens: torch.Tensor, h: torch.Tensor, index: torch.Tensor, step: int,
             ctx: tuple[torch.Tensor, torch.Tensor] | None,
             chain: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TTT step for queries at indices index [B, Q] (positions index + step).

    tokens [B, Q], h [B, Q, H]. ctx: step-0 keys/values [B, L, nkv, hd]; None at step 0, where
    this step's own keys are the context (then Q = L and index = 0..L-1). chain: keys/values
    [B, Q, nkv, hd] of steps 1..step-1 of the same chains. Returns (pre-norm output [B, Q, H],
    new keys, new values [B, Q, nkv, hd]).

    Same maths as Eagle3Head.forward with the TTT mask, but the diagonal blocks are row-wise
    dot products instead of L x L matrices that are all masked but one entry, and steps >= 1
    may run on a subset of chains (each chain p only reads step-0 keys and its own keys).
    """
    b, qn, _ = h.shape
    nh, nkv, hd = head.nh, head.nkv, head.hd
    emb = head.embed(tokens).to(h.dtype)  # the target's embedding may be in another dtype
    x = torch.cat([head.input_layernorm(emb), head.hidden_norm(h)], dim=-1)  # [B, Q, 2H]
    q, k, v = head.qkv_proj(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    cos, sin = head.rotary(index + step, x.dtype)
    q = apply_rope(q.view(b, qn, nh, hd), cos, sin)
    k = apply_rope(k.view(b, qn, nkv, hd), cos, sin)
    v = v.view(b, qn, nkv, hd)
    k0, v0 = (k, v) if ctx is None else ctx
    own = chain + [(k, v)] if step > 0 else []  # diagonal keys: steps 1..step of this chain
    rep, scale = nh // nkv, 1.0 / math.sqrt(hd)
    qt = q.transpose(1, 2)  # [B, nh, Q, hd]
    visible = torch.arange(k0.shape[1], device=h.device)[None, None, :] <= index[:, :, None]  # [B, Q, L]
    scores = [torch.matmul(qt, _kv_heads(k0, rep).transpose(-1, -2)) * scale]  # [B, nh, Q, L]
    scores[0] = scores[0].masked_fill(~visible[:, None], float("-inf"))
    for kk, _ in own:  # a chain's step-i key: one [B, nh, Q, 1] column
        scores.append((qt * _kv_heads(kk, rep)).sum(-1, keepdim=True) * scale)
    probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(qt.dtype)  # [B, nh, Q, L+step]
    n0 = k0.shape[1]
    out = torch.matmul(probs[..., :n0], _kv_heads(v0, rep))  # [B, nh, Q, hd]
    for i, (_, vv) in enumerate(own):
        out = out + probs[..., n0 + i : n0 + i + 1] * _kv_heads(vv, rep)
    attn = out.transpose(1, 2).reshape(b, qn, nh * hd)
    residual = h + head.o_proj(attn)
    return residual + head.mlp(head.post_attention_layernorm(residual)), k, v


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar: sum_j decay^j * loss_j
    step_loss: list[float]  # loss_j
    correct: list[int]  # top-1 matches with the target's argmax per step
    counted: list[int]  # scored indices per step


def pick_chains(ok_later: torch.Tensor, fraction: float, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain starts for steps >= 1: of each row's indices with a scored later step (ok_later
    [B, L]), a random `fraction` (all when 1.0). -> index [B, Q], real [B, Q] (False = padding)."""
    b, n = ok_later.shape
    keys = torch.rand(b, n, generator=gen).to(ok_later.device)
    keys = torch.where(ok_later, keys, 2.0)  # invalid indices sort last
    count = ok_later.sum(1)
    take = torch.ceil(count.float() * fraction).long().clamp(max=count)  # [B]
    qn = max(int(take.max()), 1)
    order = keys.argsort(dim=1)[:, :qn]  # [B, Q]: the chosen indices first, in random order
    real = torch.arange(qn, device=ok_later.device)[None, :] < take[:, None]
    index = torch.where(real, order, 0)
    return index, real


def _score(head: Eagle3Head, out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """out [M, H] head outputs, target [M, Vd] label distributions -> (mean soft CE, top-1 matches)."""
    logp = torch.log_softmax(head.logits(out), dim=-1)  # [M, Vd]
    loss = -(target * logp).sum(-1).mean()
    return loss, int((logp.argmax(-1) == target.argmax(-1)).sum())


def ttt_loss(head: Eagle3Head, ids: torch.Tensor, feats: Features, length: int, decay: float = 0.8,
             fraction: float = 1.0, gen: torch.Generator | None = None) -> TTTResult:
    """Unroll the head `length` steps over ids [B, L] and score every step (see module doc).
    Steps >= 1 run on a random `fraction` of the chains that have something to score."""
    b, n = ids.shape
    dev = ids.device
    pad = torch.zeros(b, length + 1, dtype=ids.dtype, device=dev)
    ids_ext = torch.cat([ids, pad], dim=1)  # x_{p+1+j} exists for every p < L
    ok_ext = torch.cat([feats.label_ok, pad.bool()], dim=1)  # [B, L+T+1]: P_q is scored
    probs_flat = feats.probs.reshape(b * n, -1)
    rows = torch.arange(b, device=dev)[:, None]
    total = torch.zeros((), device=dev)
    step_loss, correct, counted = [], [], []
    index = torch.arange(n, device=dev)[None, :].expand(b, n)
    h = head.fc(feats.aux.to(head.fc.weight.dtype))  # [B, L, H]
    ctx, chain, real = None, [], torch.ones(b, n, dtype=torch.bool, device=dev)
    for j in range(length):
        if j == 1:  # from here on, only the chosen chains
            ok_later = torch.stack([ok_ext[:, 1 + i : 1 + i + n] for i in range(1, length)]).any(0)
            index, real = pick_chains(ok_later, fraction, gen)
            h = h[rows, index]
        h, k, v = ttt_step(head, ids_ext[rows, index + 1 + j], h, index, j, ctx, chain)
        if j == 0:
            ctx = (k, v)
        else:
            chain.append((k, v))
        mask = ok_ext[rows, index + 1 + j] & real  # [B, Q]: label P_{p+1+j} is scored
        m = int(mask.sum())
        counted.append(m)
        if m == 0:
            step_loss.append(0.0)
            correct.append(0)
            continue
        label_at = (rows * n + index + 1 + j)[mask]  # flat row of P_{p+1+j} (< n where scored)
        loss_j, hits = _score(head, h[mask], probs_flat[label_at])
        total = total + decay**j * loss_j
        step_loss.append(float(loss_j.detach()))
        correct.append(hits)
    return TTTResult(total, step_loss, correct, counted)
