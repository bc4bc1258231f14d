"""The target family (Llama, Mistral, Qwen2, Qwen3) as one PyTorch module over a paged KV cache.

Projections are fused (q|k|v and gate|up) to cut per-layer operator count; the loader
splits Hugging Face tensors into them. The forward returns the final-norm hidden states
and, in the same pass, the raw outputs of chosen layers that EAGLE-3 conditions on.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from augury.cpu import threads as cpu_threads
from augury.models.config import TargetConfig
from augury.models import fused
from augury.models.fused import FusedStack, Watched
from augury.attention.base import PagedAttention
from augury.models.quant import W8A8OutputLinear
from augury.models.layers import RMSNorm, Rotary, TransposedLinear, apply_rope, prefer_transposed, silu_mul


class Collectives(Protocol):
    """What a tensor-parallel shard of the target asks of its process group (augury.distributed
    implements it; the builder passes one in, models/ never imports it)."""

    rank: int
    size: int

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a float32 tensor over the ranks in place (every rank gets the same bits); returns it."""
        ...

    def gather_vocab(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Each rank's logits [..., sizes[rank]] -> the whole vocabulary [..., sum(sizes)], in rank
        order, on rank 0 (None where a rank does not need them)."""
        ...

    def shared_exchange(self) -> SharedExchange | None:
        """The ranks' shared-memory exchange where they all run on one machine (the fused stack sums
        its partials there without returning to Python), else None."""
        ...

    def failed(self, what: str) -> Exception:
        """The error to raise when `what` failed: it names the rank found dead or silent, if any."""
        ...


@dataclass(frozen=True)
class SharedExchange:
    """Where the ranks of one machine meet in shared memory (models/fused.py, cpu/csrc/forward.cpp)."""

    address: int  # the mapping's first byte, in this process
    rank: int
    size: int
    cap: int  # floats per rank's slot: the most rows x hidden size one exchange carries
    counter: torch.Tensor  # int64 [1]: this rank's exchanges so far
    timeout_ms: int


@dataclass(frozen=True)
class Shard:
    """One rank's part of the target under tensor parallelism: query heads [heads), the KV heads they
    read [kv_heads), MLP columns [inter) and vocabulary rows [vocab), each a half-open range."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]
    vocab_sizes: tuple[int, ...]  # every rank's vocabulary rows, in rank order

    def local_config(self, cfg: TargetConfig) -> TargetConfig:
        """The shapes this rank's modules have (hidden size, layers and the rest unchanged)."""
        span = lambda r: r[1] - r[0]  # noqa: E731
        return dataclasses.replace(cfg, num_heads=span(self.heads), num_kv_heads=span(self.kv_heads),
                                   intermediate_size=span(self.inter), vocab_size=span(self.vocab))


def _split(n: int, parts: int, align: int) -> list[tuple[int, int]]:
    """[0, n) in `parts` contiguous ranges as even as whole units of `align` allow (align must divide n)."""
    units = n // align
    bounds = [r * units // parts * align for r in range(parts)] + [n]
    return list(zip(bounds[:-1], bounds[1:]))


def plan_shards(cfg: TargetConfig, size: int) -> list[Shard]:
    """Split the target among `size` ranks: attention by KV-head groups (each rank takes whole groups,
    as evenly as they go: the demo's 3 KV heads on 2 ranks are 2 + 1; when ranks outnumber the KV heads,
    each KV head is replicated on size / kv ranks that split its query heads), the MLP's columns and
    the vocabulary in even ranges (whole groups of 32, and of 64 rows, where the sizes allow).
    A ValueError names the numbers that cannot be split."""
    nh, nkv, inter, vocab = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    group = nh // nkv  # query heads per KV head
    if size <= nkv:
        kv = _split(nkv, size, 1)
        heads = [(a * group, b * group) for a, b in kv]
    else:
        rep = size // nkv
        if size % nkv or group % rep:
            raise ValueError(
                f"tensor_parallel_size {size} exceeds the model's {nkv} KV heads: it must then be a multiple of "
                f"them ({nkv}, {2 * nkv}, ...) whose share of each KV head's {group} query heads is whole "
                f"({nh} query heads); choose at most {nkv} or such a multiple")
        per = group // rep
        kv = [(r // rep, r // rep + 1) for r in range(size)]
        heads = [((r // rep) * group + (r % rep) * per, (r // rep) * group + (r % rep + 1) * per) for r in range(size)]
    align = 32 if inter % 32 == 0 else 1  # whole int4 groups of the row-parallel down_proj
    if inter < size:
        raise ValueError(f"intermediate_size {inter} cannot be split among {size} tensor-parallel ranks")
    mlp = _split(inter, size, align)
    valign = next((a for a in (64, 16, 1) if vocab % (a * size) == 0 or a == 1), 1)
    if vocab < size:
        raise ValueError(f"vocab_size {vocab} cannot be split among {size} tensor-parallel ranks")
    vocab_parts = _split(vocab, size, valign)
    sizes = tuple(b - a for a, b in vocab_parts)
    return [Shard(r, size, heads[r], kv[r], mlp[r], vocab_parts[r], sizes) for r in range(size)]


class VocabShardEmbedding(nn.Embedding):
    """This rank's rows [start, start + num_embeddings) of the embedding: a token outside them looks up
    zeros, so the sum over ranks (TargetModel.forward) is the full lookup, exactly."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, _weight: torch.Tensor | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, _weight=_weight)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = super().forward(torch.where(inside, local, torch.zeros_like(local)))
        return out * inside.unsqueeze(-1).to(out.dtype)


def _embedding(vocab: int, hidden: int, shard: Shard | None) -> nn.Embedding:
    """The embedding, its weight drawn from N(0, 1) as nn.Embedding's own unless it is on the meta
    device (a model about to be loaded): torch's meta normal_ is a Python reference whose first call
    imports torch._dynamo (1.6 s and ~150 MB of a start)."""
    weight = torch.empty(vocab, hidden)
    if not weight.is_meta:
        nn.init.normal_(weight)
    weight = nn.Parameter(weight)
    return VocabShardEmbedding(vocab, hidden, shard.vocab[0], _weight=weight) if shard else \
        nn.Embedding(vocab, hidden, _weight=weight)


class Norm(Watched, RMSNorm):
    """The target's RMSNorm, watched for the fused table (models/fused.py)."""


class LayerList(Watched, nn.ModuleList):
    """The target's layer stack, watched for the fused table (`model.layers[i] = ...`)."""


class Attention(Watched, nn.Module):
    def __init__(self, cfg: TargetConfig, sharded: bool = False) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        # row-parallel under tensor parallelism: o_proj's bias is added once, after the sum over ranks
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_proj_bias and not sharded)
        self.o_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.o_proj_bias and sharded else None
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = Norm(self.hd, cfg.rms_norm_eps)
            self.k_norm = Norm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn: PagedAttention, layer: int):
        b, ql, _ = x.shape
        qkv = self.qkv_proj(x).view(b, ql, self.nh + 2 * self.nkv, self.hd)  # [B, Q, heads, hd]
        qk, v = qkv[:, :, : self.nh + self.nkv], qkv[:, :, self.nh + self.nkv :]  # views (cheaper than split)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :, : self.nh]), self.k_norm(qk[:, :, self.nh :])], dim=2)
        # one rotation for the query and key heads together (elementwise per head: the same numbers)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :, : self.nh], qk[:, :, self.nh :]
        return self.o_proj(attn(layer, q, k, v))  # the backend writes k, v to the cache and attends


class MLP(Watched, nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False, sharded: bool = False) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        # row-parallel under tensor parallelism: the bias is added once, after the sum over ranks
        self.down_proj = nn.Linear(inter, hidden, bias=bias and not sharded)
        self.down_bias = nn.Parameter(torch.zeros(hidden)) if bias and sharded else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(Watched, nn.Module):
    def __init__(self, cfg: TargetConfig, tp: Collectives | None = None) -> None:
        super().__init__()
        self.tp = tp  # tensor parallelism: this rank's heads and MLP columns, summed over ranks
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, sharded=tp is not None)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, sharded=tp is not None)

    def forward(self, h, cos, sin, attn: PagedAttention, layer: int):
        # h is the float32 residual stream; the norms hand the projections the weights' dtype
        a = self.self_attn(self.input_layernorm(h), cos, sin, attn, layer)
        if self.tp is not None:
            a = self._summed(a, self.self_attn.o_bias)
        h = h + a
        m = self.mlp(self.post_attention_layernorm(h))
        if self.tp is not None:
            m = self._summed(m, self.mlp.down_bias)
        return h + m

    def _summed(self, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel projection's partial output [..., H] summed over the ranks in float32, then
        rounded to its dtype and given the bias once, as one projection's output would be."""
        s = self.tp.all_reduce_(y.float().contiguous()).to(y.dtype)
        return s if bias is None else s + bias


def _write_rows(aux_into: tuple[torch.Tensor, torch.Tensor], aux: torch.Tensor) -> None:
    """aux [B, Q, A] into aux_into's rows [R, A] at its index [B*Q] (TargetModel.forward's aux_into)."""
    rows, index = aux_into
    rows.index_copy_(0, index.to(rows.device), aux.reshape(-1, aux.shape[-1]).to(rows.dtype))


class TargetModel(Watched, nn.Module):
    """Llama-family causal LM. ``forward`` -> (normed hidden [B,Q,H], aux [B,Q,len(aux)*H] or None).

    Its layers, norms and kernel linears are `fused.Watched`: moving, converting or swapping any of
    them after a forward makes the fused table (`_fused`) stale, and the next forward builds it again."""

    def __init__(self, cfg: TargetConfig, max_len: int, shard: Shard | None = None,
                 tp: Collectives | None = None) -> None:
        super().__init__()
        if (shard is None) != (tp is None):
            raise ValueError("a tensor-parallel shard needs its process group, and a group its shard")
        self.full_cfg = cfg  # the whole model's shapes
        self.shard, self.tp = shard, tp  # tensor parallelism: this rank's part, and its group
        cfg = shard.local_config(cfg) if shard is not None else cfg
        self.cfg = cfg  # this process's shapes (the whole model's without tensor parallelism)
        self.quantization = "none"  # the linears' mode once loaded: "none", "int8" or "int4" (models/quant.py)
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size, shard)
        self.layers = LayerList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, max_len)
        self._fused: FusedStack | None | bool = None  # models/fused.py: None until tried, False if it cannot

    def _apply(self, fn, *args, **kwargs):
        self._fused = None  # tensors moved or converted: the fused kernel's addresses are stale
        return super()._apply(fn, *args, **kwargs)

    @property
    def runs_fused(self) -> bool:
        """The fused stack (models/fused.py) runs this model's steps: every layer-stack linear is one of
        augury's kernels, so the torch operators left in a step give the same bits at any thread count."""
        return bool(self._fused)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: PagedAttention,
        aux_layers: tuple[int, ...] = (),
        aux_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # input_ids, positions [B, Q]; attn: this step's attention (an attention backend prepared it).
        # Returns (final-norm hidden, the aux layers' outputs side by side [B, Q, n*H] or None). With
        # aux_into = (rows [R, n*H], index [B*Q] int64) token t's features are written to rows[index[t]]
        # (a FeatureStore's rows: the fused kernel writes them there, no copy) and None comes back.
        h = self.embed_tokens(input_ids)
        dtype = h.dtype
        cos, sin = self.rotary(positions, dtype)
        # The residual stream stays in float32 under 16-bit weights: each layer's output is added
        # unrounded (bfloat16 demo, 8 chat answers: mean |logit error| against float32 0.064,
        # 0.105 with a bfloat16 stream, transformers' 0.110). Elementwise, so rows stay independent.
        h = h.float()
        if self.tp is not None:  # each rank looked up its own vocabulary rows (zeros elsewhere): exact
            h = self.tp.all_reduce_(h.contiguous())
        if self._fused is not False:  # the whole stack in one C++ call where model and step allow
            if self._fused is None or self._fused.epoch != fused.epoch():  # none yet, or stale
                self._fused = FusedStack.build(self) or False
            direct = aux_into if aux_into is not None and aux_into[0].dtype == torch.bfloat16 else None
            if self._fused and (done := self._fused.run(h, cos, sin, attn, aux_layers, direct)) is not None:
                hidden, aux_out = done
                if aux_into is not None and direct is None and aux_out is not None:
                    _write_rows(aux_into, aux_out)
                    aux_out = None
                return hidden, aux_out
        captured: dict[int, torch.Tensor] = {}
        # augury's kernels in these layers run the thread count the fused stack's timed calls settled
        # on (cpu/threads.py), not whatever count its last call explored (torch's operators take it from
        # Engine.step, where runs_fused)
        threads = cpu_threads.settled(input_ids.numel()) if h.device.type == "cpu" and self.tp is None else 0
        with cpu_threads.scoped(threads):
            for i, layer in enumerate(self.layers):
                h = layer(h, cos, sin, attn, i)
                if i in aux_layers:
                    captured[i] = h.to(dtype)
        # in the order asked for (a layer may be named twice on very shallow targets)
        aux_out = torch.cat([captured[i] for i in aux_layers], dim=-1) if aux_layers else None
        if aux_into is not None and aux_out is not None:
            _write_rows(aux_into, aux_out)
            aux_out = None
        return self.norm(h), aux_out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [..., H] -> float32 logits [..., V]. Under tensor parallelism each rank computes its
        vocabulary rows and rank 0 gets the whole (`Collectives.gather_vocab`; None on the others)."""
        if self.lm_head is None:
            out = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            out = self.lm_head(hidden).float()
        if self.tp is not None:
            return self.tp.gather_vocab(out.contiguous(), list(self.shard.vocab_sizes))
        return out

    def allowed_logits(self, hidden: torch.Tensor, allowed: list[np.ndarray]) -> list[torch.Tensor] | None:
        """hidden [A, H] -> per row a, float32 [len(allowed[a])]: its logits at the tokens allowed[a] (int64
        ids) alone, the bits logits() gives them, without a pass over the whole output layer; None where
        the output layer cannot compute chosen columns alone (any but augury's w8a8 one, or under tensor
        parallelism)."""
        head = self.lm_head
        if self.tp is not None or not isinstance(head, W8A8OutputLinear):
            return None
        return head.columns(hidden, allowed)

    def masked_logits(self, hidden: torch.Tensor, allowed: list[np.ndarray]) -> torch.Tensor | None:
        """hidden [A, H] -> float32 [A, V]: allowed_logits at the tokens allowed[a], -inf at every other
        token (what a grammar's mask leaves of logits()); None where allowed_logits is."""
        vals = self.allowed_logits(hidden, allowed)
        if vals is None:
            return None
        out = torch.full((hidden.shape[0], self.lm_head.out_features), float("-inf"), dtype=torch.float32)
        for a, (ids, v) in enumerate(zip(allowed, vals)):
            out[a, torch.from_numpy(np.asarray(ids, dtype=np.int64))] = v
        return out

    def prepare_for_inference(self) -> None:
        """Pick the fastest weight layout for this device and dtype (after loading)."""
        self._fused = None  # weights may have moved: rebuild the fused kernel's table on the next forward
        if prefer_transposed(self.layers):
            # tied output layer: a transposed copy of the embedding (float32 only)
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.lm_head = TransposedLinear(weight)
