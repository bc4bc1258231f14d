"""Draft vocabulary: the target tokens seen most often in the training responses.

Standard EAGLE-3 mapping tensors: the draft ids are the chosen target ids in ascending
order, d2t [Vd] int64 holds target_id - draft_id (so target_id = draft_id + d2t[draft_id])
and t2d [V] bool marks the target ids that have a draft id.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch


def build_draft_vocab(responses: list[list[int]], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """Sorted target ids [Vd] of the draft vocabulary (ties and unseen fill: lowest id first)."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"--draft-vocab-size must be in [1, {vocab_size}] (the target's vocabulary), got {draft_vocab_size}")
    counts = Counter(t for r in responses for t in r)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:draft_vocab_size]
    if len(ranked) < draft_vocab_size:  # fewer distinct tokens than asked: pad with unseen ids
        seen = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in seen][: draft_vocab_size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def mapping_tensors(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_ids [Vd] sorted -> (d2t [Vd] int64, t2d [V] bool)."""
    d2t = draft_ids - torch.arange(draft_ids.numel(), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def coverage(responses: list[list[int]], draft_ids: torch.Tensor) -> float:
    """Fraction of response tokens inside the draft vocabulary."""
    keep = set(draft_ids.tolist())
    total = sum(len(r) for r in responses)
    return sum(t in keep for r in responses for t in r) / max(total, 1)


def save_vocab(path: Path, draft_ids: torch.Tensor) -> None:
    torch.save({"draft_ids": draft_ids}, path)


def load_vocab(path: Path) -> torch.Tensor:
    return torch.load(path, weights_only=True)["draft_ids"]


def exported_vocab(folder: Path) -> torch.Tensor:
    """The draft vocabulary of an exported head folder: draft id i is target id i + d2t[i]."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        d2t = f.get_tensor("d2t").long()
    return torch.arange(d2t.numel()) + d2t
