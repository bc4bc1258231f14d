"""Rank 0 runs the engine; the other ranks run the same target forwards, told what to run.

Why this split: everything that decides (the scheduler, the sampler and its uniforms, the EAGLE-3
head and its drafts, the speculation policy, whose adaptive choice depends on measured step times)
runs once, on rank 0, so the ranks cannot diverge: a rank other than 0 never decides anything, it
replays rank 0's target work on its own shard. What it replays is each call the engine makes on its
target, model-level: the attention backend's `prepare_*` call with its arguments (block tables,
cached lengths, draft-tree parents, packed sizes), the forward's token ids and positions, the hidden
rows whose logits are wanted, and KV slot copies after verification. That is the whole per-step plan:
the batch, positions, slots and draft tree are in it; the sampling uniforms and the policy's decision
never need to leave rank 0, because they only act on the logits rank 0 gathers.

Rank 0 hands the engine three stand-ins with the interfaces it already uses (`ShardedTarget` for the
model, `ReplayedBackend` for the attention backend, `ShardedKV` for the cache), each sending the
command before running its own shard's part; `serve_commands` is the loop on the other ranks.
"""
from __future__ import annotations

import logging
import weakref
from pathlib import Path

import torch
from torch import nn

from augury.distributed.comm import Group

log = logging.getLogger("augury.distributed")

_PREPARE = ("prepare_prefill", "prepare_decode", "prepare_tree", "prepare_packed_tree")


class _Replayed:
    """A prepared step's attention on rank 0, remembering the call that made it (for the other ranks)."""

    __slots__ = ("inner", "call")

    def __init__(self, inner, call: tuple) -> None:
        self.inner, self.call = inner, call

    def __call__(self, layer: int, q, k, v):
        return self.inner(layer, q, k, v)

    def fused_rows(self):
        return self.inner.fused_rows()


class ReplayedBackend:
    """Rank 0's attention backend: prepares as the wrapped one does and remembers each call."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in _PREPARE:
            return attr

        def prepare(*args):
            out = attr(*args)
            return None if out is None else _Replayed(out, (name, args))

        return prepare


class ShardedKV:
    """Rank 0's KV cache (its own KV heads); slot copies are made on every rank."""

    def __init__(self, inner, group: Group) -> None:
        self.inner, self.group = inner, group
        self.k, self.v = inner.k, inner.v

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.group.send(("copy", src, dst))
        self.inner.copy_slots(src, dst)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class ShardedTarget(nn.Module):
    """Rank 0's target: its own shard (`local`, a TargetModel), every call also sent to the other ranks.

    `embed_tokens` is the whole embedding, read from the checkpoint on first use (only a replicated
    EAGLE-3 head needs it: the shard itself holds its own vocabulary rows)."""

    def __init__(self, local: nn.Module, group: Group, folder: Path, closer) -> None:
        super().__init__()
        self.local = local
        self.group = group
        self.cfg, self.full_cfg = local.cfg, local.full_cfg
        self._folder = folder
        self._embed: nn.Embedding | None = None
        self._closer = weakref.finalize(self, closer)  # the ranks stop when this goes (or at exit)

    @property
    def quantization(self) -> str:
        return self.local.quantization

    @property
    def runs_fused(self) -> bool:
        """False: a tensor-parallel rank runs its pinned share of threads (launch.py), never the kernels'
        measured choice, so Engine.step leaves torch's count alone."""
        return False

    @property
    def _fused(self):
        return self.local._fused

    @_fused.setter
    def _fused(self, value) -> None:
        self.local._fused = value

    @property
    def embed_tokens(self) -> nn.Embedding:
        if self._embed is None:
            from augury.models.loader import load_embedding

            w = self.local.embed_tokens.weight
            self._embed = load_embedding(self._folder, w.dtype, w.device)
        return self._embed

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, aux_layers: tuple[int, ...] = (),
                aux_into: tuple[torch.Tensor, torch.Tensor] | None = None):
        if not isinstance(attn, _Replayed):
            raise TypeError("a tensor-parallel target runs attention its ReplayedBackend prepared")
        self.group.send(("forward", attn.call, input_ids.cpu(), positions.cpu()))
        return self.local(input_ids, positions, attn.inner, aux_layers, aux_into)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., V]: every rank its vocabulary rows, gathered here."""
        hidden = hidden.contiguous()
        self.group.send(("logits", hidden))
        return self.local.logits(hidden)

    def allowed_logits(self, hidden: torch.Tensor, allowed: list) -> None:
        """None: the vocabulary is split over the ranks (see masked_logits)."""
        return None

    def masked_logits(self, hidden: torch.Tensor, allowed: list) -> None:
        """None: the vocabulary is split over the ranks, so chosen tokens alone are not offered (every
        row takes logits(), the gathered whole)."""
        return None

    def close(self) -> None:
        """Stop the other ranks now (also done when this object is collected, and at exit)."""
        self._closer()


def serve_commands(group: Group, model: nn.Module, make_cache) -> None:
    """Ranks other than 0: run rank 0's commands on this shard until it says stop.

    make_cache(num_blocks, block_size, kv_dtype) -> (kv cache, attention backend), once rank 0 has sized them."""
    kv = backend = None
    device = model.embed_tokens.weight.device
    with torch.inference_mode():
        while True:
            command = group.receive()
            kind = command[0]
            if kind == "forward":
                (method, args), ids, positions = command[1], command[2], command[3]
                attn = getattr(backend, method)(*args)
                model(ids.to(device), positions.to(device), attn, ())
            elif kind == "logits":
                model.logits(command[1].to(device))
            elif kind == "copy":
                kv.copy_slots(command[1].to(device), command[2].to(device))
            elif kind == "setup":
                kv, backend = make_cache(command[1], command[2], command[3])
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel command {kind!r}")
