"""The training loop: frozen target features per batch, TTT loss, AdamW, checkpoints, resume.

The target's part of a batch (final hidden states, aux states, argmax-in-draft-vocab flags;
about 8 bytes per target hidden unit per token) is kept in memory up to feature_cache_gb, so
epochs after the first skip the target forward, which costs about as much as the head's
training step itself on a CPU.

A checkpoint (<ckpt>/latest.pt) holds the head's trainable tensors, the optimizer, the step
and the data position (epoch, next batch); batches are a pure function of (seed, epoch),
so a resumed run continues exactly where the last checkpoint left it. <ckpt>/best.pt keeps
the head with the best held-out estimated acceptance length.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from augury.models.eagle3_head import Eagle3Head
from augury.models.llama import TargetModel
from augury.train.data import Sample, epoch_batches
from augury.train.head import head_state, trainable_parameters
from augury.train.ttt import draft_output_weight, features_from_states, target_features, target_states, ttt_loss

log = logging.getLogger("augury.train")


@dataclass(frozen=True)
class TrainSettings:
    lr: float = 5e-4
    min_lr_ratio: float = 0.05
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_length: int = 7
    ttt_fraction: float = 1.0  # share of chains unrolled past step 0 (1.0 = all, the EAGLE recipe)
    decay: float = 0.8
    batch_tokens: int = 2048
    epochs: int = 1
    max_steps: int | None = None
    save_every: int = 100
    seed: int = 0
    bf16_autocast: bool = False
    feature_cache_gb: float = 4.0  # target states kept between epochs (0 = recompute every batch)


def estimated_accept_length(acc: list[float]) -> float:
    """1 + sum_k prod_{j<k} acc_j: tokens per verification if step-j acceptances were independent."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


def pad_batch(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> ids [B, L] right-padded with 0, lengths [B], prompt_lens [B]."""
    n = max(len(s.ids) for s in samples)
    ids = torch.zeros(len(samples), n, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
    return ids, torch.tensor([len(s.ids) for s in samples]), torch.tensor([s.prompt_len for s in samples])


class Trainer:
    def __init__(self, target: TargetModel, head: Eagle3Head, draft_ids: torch.Tensor, t2d: torch.Tensor,
                 aux_layers: tuple[int, ...], train: list[Sample], valid: list[Sample], settings: TrainSettings,
                 ckpt_dir: Path) -> None:
        self.target, self.head, self.settings = target, head, settings
        self.draft_ids, self.t2d, self.aux_layers = draft_ids, t2d, aux_layers
        self.train, self.valid, self.ckpt_dir = train, valid, ckpt_dir
        s = settings
        self.epoch_sizes = [len(epoch_batches(train, e, s.seed, s.batch_tokens)) for e in range(s.epochs)]
        self.total_steps = sum(self.epoch_sizes) if s.max_steps is None else min(s.max_steps, sum(self.epoch_sizes))
        if self.total_steps < 1:
            raise ValueError("no training batches: generate more data or lower --max-seq-len")
        params = [p for _, p in trainable_parameters(head)]
        self.opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
        self.step, self.epoch, self.batch_index, self.best = 0, 0, 0, 0.0
        self.history: list[dict] = []
        # (split, sample index) -> (hidden [n, Ht], aux [n, 3Ht], in_draft [n]) for the sample's n tokens
        self.cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.cache_bytes = 0
        self.draft_weight = draft_output_weight(target, draft_ids)  # [Vd, Ht]: label logits come from these rows
        self.aux_scale = self.measure_aux_scale(valid or train)  # [3Ht] float32

    @torch.no_grad()
    def measure_aux_scale(self, samples: list[Sample], max_batches: int = 4) -> torch.Tensor:
        """Per-feature RMS of the target's aux states over a few batches (positions >= 1: position 0
        is usually an attention sink with huge activations). The head's fc is trained on
        aux / scale and exported with the scale folded into its weight (fc.weight / scale),
        so the few massive feature dimensions of LLM hidden states do not drown the others
        during training, while the exported head reads raw features as usual."""
        s = self.settings
        total, count = None, 0
        for batch in epoch_batches(samples, 0, s.seed, s.batch_tokens)[:max_batches]:
            ids, lengths, prompt_lens = pad_batch([samples[i] for i in batch])
            dev = self.head.fc.weight.device
            feats = target_features(self.target, ids.to(dev), lengths.to(dev), prompt_lens.to(dev), self.aux_layers,
                                    self.draft_ids, self.t2d)
            real = torch.arange(ids.shape[1], device=dev)[None, :] < lengths.to(dev)[:, None]
            real[:, 0] = False
            sq = feats.aux.float()[real].pow(2).sum(0)  # [3Ht]
            total = sq if total is None else total + sq
            count += int(real.sum())
        rms = (total / max(count, 1)).sqrt()
        return rms.clamp(min=1e-2 * float(rms.mean()))

    # ----------------------------------------------------------------- schedule
    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine from lr down to min_lr_ratio * lr at the last step."""
        s = self.settings
        warm = max(1, int(s.warmup_ratio * self.total_steps))
        if step < warm:
            return s.lr * (step + 1) / warm
        t = (step - warm) / max(1, self.total_steps - warm)
        return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    def _autocast(self):
        if self.settings.bf16_autocast:
            return torch.autocast("cpu" if self.head.fc.weight.device.type == "cpu" else "cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _samples(self, split: str) -> list[Sample]:
        return self.train if split == "train" else self.valid

    def _states(self, split: str, indices: list[int], ids: torch.Tensor):
        """Target states for the padded batch ids [B, L] of samples `indices` of `split`:
        from the cache when every sample is there, else one target forward (whose rows are
        then cached while the budget lasts)."""
        dev = ids.device
        keys = [(split, i) for i in indices]
        if all(k in self.cache for k in keys):
            rows = [self.cache[k] for k in keys]
            b, n = ids.shape
            hidden = torch.zeros(b, n, rows[0][0].shape[-1], dtype=rows[0][0].dtype, device=dev)
            aux = torch.zeros(b, n, rows[0][1].shape[-1], dtype=rows[0][1].dtype, device=dev)
            in_draft = torch.zeros(b, n, dtype=torch.bool, device=dev)
            for j, (h, a, d) in enumerate(rows):
                hidden[j, : h.shape[0]], aux[j, : a.shape[0]], in_draft[j, : d.shape[0]] = h, a, d
            return hidden, aux, in_draft
        hidden, aux, in_draft = target_states(self.target, ids, self.aux_layers, self.t2d)
        budget = self.settings.feature_cache_gb * 2**30
        data = self._samples(split)
        for j, k in enumerate(keys):
            n = len(data[k[1]].ids)
            size = n * (hidden.shape[-1] * hidden.element_size() + aux.shape[-1] * aux.element_size() + 1)
            if k not in self.cache and self.cache_bytes + size <= budget:
                self.cache[k] = (hidden[j, :n].clone(), aux[j, :n].clone(), in_draft[j, :n].clone())
                self.cache_bytes += size
        return hidden, aux, in_draft

    def _loss(self, split: str, indices: list[int], fraction: float = 1.0):
        samples = [self._samples(split)[i] for i in indices]
        ids, lengths, prompt_lens = pad_batch(samples)
        dev = self.head.fc.weight.device
        ids = ids.to(dev)
        hidden, aux, in_draft = self._states(split, indices, ids)
        feats = features_from_states(hidden, aux, in_draft, lengths.to(dev), prompt_lens.to(dev), self.draft_weight)
        feats.aux = feats.aux.float() / self.aux_scale.to(dev)  # see measure_aux_scale
        with self._autocast():
            gen = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + self.step)  # replayed on resume
            res = ttt_loss(self.head, ids, feats, self.settings.ttt_length, self.settings.decay, fraction, gen)
            return res, ids.numel()

    # --------------------------------------------------------------- checkpoints
    def save(self, name: str = "latest.pt") -> None:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        state = {"head": head_state(self.head), "aux_scale": self.aux_scale, "optim": self.opt.state_dict(),
                 "step": self.step,
                 "epoch": self.epoch, "batch_index": self.batch_index, "best": self.best,
                 "history": self.history, "settings": asdict(self.settings)}
        tmp = self.ckpt_dir / (name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.ckpt_dir / name)  # never a half-written checkpoint

    def load_weights(self, path: Path) -> None:
        """Warm start: the head's tensors from a checkpoint; optimizer, step and data start afresh."""
        state = torch.load(path, weights_only=False)
        params = dict(trainable_parameters(self.head))
        with torch.no_grad():
            for name, t in state["head"].items():
                params[name].copy_(t)
        self.aux_scale = state["aux_scale"]
        log.info("initialised the head from %s (its step %d)", path, state["step"])

    def load_exported(self, folder: Path) -> None:
        """Warm start from an exported head folder (config.json + model.safetensors, as
        export_head writes and augury ships): its tensors, with fc re-expressed for this
        trainer's normalised features (fc(aux / s) must equal the export's W aux, so W' = W s)."""
        from augury.models.eagle3_head import load_eagle3

        head = self.head
        loaded = load_eagle3(folder, self.target.cfg, self.target.embed_tokens, torch.float32,
                             torch.device("cpu"), 16)
        if not torch.equal(loaded.d2t.cpu(), head.d2t.cpu()):
            raise ValueError(f"{folder}: its draft vocabulary differs from this run's (vocab.pt)")
        params = dict(trainable_parameters(head))
        src = dict(trainable_parameters(loaded))
        if set(src) != set(params):
            raise ValueError(f"{folder}: tensors {sorted(set(src) ^ set(params))} do not match the trainable head")
        with torch.no_grad():
            for name, t in src.items():
                params[name].copy_(t.float())
            params["fc.weight"].mul_(self.aux_scale.float().to(params["fc.weight"].device)[None, :])
        log.info("initialised the head from the exported folder %s", folder)

    def load(self, path: Path) -> None:
        state = torch.load(path, weights_only=False)
        if state["settings"] != asdict(self.settings):
            log.warning("resuming with changed settings: %s -> %s", state["settings"], asdict(self.settings))
        params = dict(trainable_parameters(self.head))
        with torch.no_grad():
            for name, t in state["head"].items():
                params[name].copy_(t)
        self.aux_scale = state["aux_scale"]
        self.opt.load_state_dict(state["optim"])
        self.step, self.epoch, self.batch_index = state["step"], state["epoch"], state["batch_index"]
        self.best, self.history = state["best"], state["history"]
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, self.step, self.epoch, self.batch_index)

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def validate(self) -> dict:
        """Per-step top-1 accuracy on held-out generated sequences, and the acceptance estimate."""
        correct = [0] * self.settings.ttt_length
        counted = [0] * self.settings.ttt_length
        for batch in epoch_batches(self.valid, 0, self.settings.seed, self.settings.batch_tokens):
            res, _ = self._loss("valid", batch)
            correct = [a + b for a, b in zip(correct, res.correct)]
            counted = [a + b for a, b in zip(counted, res.counted)]
        acc = [c / max(n, 1) for c, n in zip(correct, counted)]
        return {"step": self.step, "valid_acc": [round(a, 4) for a in acc],
                "valid_tau": round(estimated_accept_length(acc), 4)}

    def _checkpoint(self, log_path: Path) -> None:
        metrics = self.validate() if self.valid else {"step": self.step}
        self.history.append(metrics)
        with open(log_path, "a") as f:
            f.write(json.dumps({"event": "valid", **metrics}) + "\n")
        tau = metrics.get("valid_tau", 0.0)
        if tau >= self.best:
            self.best = tau
            self.save("best.pt")
        self.save()
        log.info("step %d: held-out acc per step %s, estimated acceptance length %.3f (best %.3f)",
                 self.step, metrics.get("valid_acc"), tau, self.best)

    # ---------------------------------------------------------------------- loop
    def run(self, log_path: Path, show_progress: bool = True, time_limit: float | None = None,
            stop_at_step: int | None = None) -> bool:
        """Train to the end, or until `time_limit` seconds have passed or `stop_at_step` is reached
        (then a checkpoint is saved and False returned: resume later with `load`)."""
        s = self.settings
        start = time.perf_counter()
        self.head.train()
        ema: list[float] | None = None
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", disable=not show_progress,
                   dynamic_ncols=True)
        try:
            while self.step < self.total_steps and self.epoch < s.epochs:
                batches = epoch_batches(self.train, self.epoch, s.seed, s.batch_tokens)
                while self.batch_index < len(batches) and self.step < self.total_steps:
                    t0 = time.perf_counter()
                    for g in self.opt.param_groups:
                        g["lr"] = self.lr_at(self.step)
                    res, ntok = self._loss("train", batches[self.batch_index], s.ttt_fraction)
                    self.opt.zero_grad(set_to_none=True)
                    res.loss.backward()
                    gnorm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), s.grad_clip)
                    self.opt.step()
                    self.step += 1
                    self.batch_index += 1
                    acc = [c / n if n else 0.0 for c, n in zip(res.correct, res.counted)]
                    ema = acc if ema is None else [0.95 * e + 0.05 * a for e, a in zip(ema, acc)]
                    dt = time.perf_counter() - t0
                    bar.update(1)
                    bar.set_postfix_str(f"loss {float(res.loss.detach()):.3f} acc {'/'.join(f'{a:.2f}' for a in ema)} "
                                        f"tau~{estimated_accept_length(ema):.2f} {ntok / dt:.0f} tok/s")
                    with open(log_path, "a") as f:
                        f.write(json.dumps({"event": "step", "step": self.step, "epoch": self.epoch,
                                            "loss": round(float(res.loss.detach()), 4),
                                            "step_loss": [round(x, 4) for x in res.step_loss],
                                            "acc": [round(a, 4) for a in acc], "grad_norm": round(float(gnorm), 4),
                                            "lr": self.lr_at(self.step - 1), "tokens": ntok,
                                            "seconds": round(dt, 3)}) + "\n")
                    if self.step % s.save_every == 0 or self.step == self.total_steps:
                        self._checkpoint(log_path)
                    out_of_time = time_limit is not None and time.perf_counter() - start > time_limit
                    if (out_of_time or self.step == stop_at_step) and self.step < self.total_steps:
                        if self.batch_index >= len(batches):
                            self.epoch, self.batch_index = self.epoch + 1, 0
                        if self.step % s.save_every:
                            self._checkpoint(log_path)
                        log.info("stopped at step %d of %d; --resume continues", self.step, self.total_steps)
                        return False
                if self.batch_index >= len(batches):
                    self.epoch += 1
                    self.batch_index = 0
        except KeyboardInterrupt:
            self.save()  # keep the work done since the last periodic checkpoint
            log.warning("interrupted at step %d; checkpoint saved, rerun with --resume", self.step)
            raise
        finally:
            bar.close()
            self.head.eval()
        return True
