"""The step loop: schedule -> (propose -> verify | decode) -> commit -> emit.

An Engine is built from parts that are already complete (see engine/builder.py); its
constructor only assigns them, so it cannot exist half-built.
"""
from __future__ import annotations

import logging
import time
import uuid

import torch

from augury.config import EngineConfig
from augury.engine.attention import WIDTH_FREE_DTYPES, build_attn_batch
from augury.engine.detokenizer import IncrementalDetokenizer
from augury.engine.kv_cache import BlockAllocator, KVCache
from augury.engine.request import Request, Status
from augury.engine.sampler import sample
from augury.engine.scheduler import ScheduledBatch, Scheduler
from augury.engine.stats import EngineStats
from augury.models.config import TargetConfig
from augury.models.llama import TargetModel
from augury.outputs import RequestOutput
from augury.sampling_params import SamplingParams

log = logging.getLogger("augury.engine")


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model: TargetModel,
        model_cfg: TargetConfig,
        kv: KVCache,
        allocator: BlockAllocator,
        tokenizer,
        eos_token_ids: set[int],
        max_model_len: int,
        device: torch.device,
        speculator=None,
    ) -> None:
        self.config = config
        self.model = model
        self.model_cfg = model_cfg
        self.kv = kv
        self.allocator = allocator
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.speculator = speculator  # spec.worker.Speculator or None
        self.scheduler = Scheduler(allocator, config.max_num_seqs, config.max_num_batched_tokens)
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer; pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model's context (max_model_len) is {self.max_model_len}, "
                "which must also leave room for at least one generated token"
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, ids, params)
        self.requests[request_id] = req
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        if req is not None and req.status is not Status.FINISHED:
            req.finish_reason = "abort"
            self.scheduler.remove(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        if batch.prefill:
            touched = self._run_prefill(batch)
        else:
            touched = batch.requests
            if self.speculator is None or not self.speculator.step(self, batch.requests):
                t0 = time.perf_counter()
                self._run_decode(batch)
                if self.speculator is not None:
                    self.speculator.policy.observe_plain(len(batch.requests), time.perf_counter() - t0)
        self.stats.maybe_log(self)
        return self._emit(touched)

    def forward(self, reqs: list[Request], rows: list[list[int]], positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, aux: bool = False, tree_parents: torch.Tensor | None = None):
        """One target forward: request b feeds rows[b] after its num_computed cached tokens.

        positions [B, Q] default to consecutive ones; tree_parents (with tree_mask) asks for exact
        tree attention (each node computed as a decode step would); decode steps are exact too.
        Returns (hidden [B, Q, H], aux or None).
        """
        q = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), q, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        ctx = [r.num_computed for r in reqs]
        if positions is None:
            positions = torch.tensor(ctx)[:, None] + torch.arange(q)[None, :]
        batch = build_attn_batch([r.block_table for r in reqs], ctx, [len(r) for r in rows], q,
                                 self.allocator.block_size, self.device, tree_mask, tree_parents=tree_parents,
                                 exact=True, merge_widths=self.dtype in WIDTH_FREE_DTYPES)
        layers = self.speculator.aux_layers if (aux and self.speculator is not None) else ()
        return self.model(ids.to(self.device), positions.clamp(max=self.max_model_len - 1).to(self.device),
                          batch, self.kv.k, self.kv.v, layers)

    def _wants_aux(self) -> bool:
        return self.speculator is not None and self.speculator.needs_aux

    def _run_prefill(self, batch: ScheduledBatch) -> list[Request]:
        reqs = batch.requests
        rows = [r.all_token_ids[r.num_computed : end] for r, end in zip(reqs, batch.ends)]
        hidden, aux = self.forward(reqs, rows, aux=self._wants_aux())
        done = [i for i, (r, end) in enumerate(zip(reqs, batch.ends)) if end == r.num_tokens]
        for i, (r, row) in enumerate(zip(reqs, rows)):
            if aux is not None:
                r.add_pending(aux[i, : len(row)], self.speculator.catch_up_window)
            r.num_computed += len(row)
        if not done:
            return []
        last = torch.tensor([len(rows[i]) - 1 for i in done], device=self.device)
        logits = self.model.logits(hidden[done, last])  # [D, V]
        finished = [reqs[i] for i in done]
        for r, tok in zip(finished, sample(logits, finished)):
            self.commit(r, [tok])
        return finished

    def _run_decode(self, batch: ScheduledBatch) -> None:
        reqs = batch.requests
        hidden, aux = self.forward(reqs, [[r.all_token_ids[-1]] for r in reqs], aux=self._wants_aux())
        logits = self.model.logits(hidden[:, 0])  # [B, V]
        for i, (r, tok) in enumerate(zip(reqs, sample(logits, reqs))):
            if aux is not None:
                r.add_pending(aux[i, :1], self.speculator.catch_up_window)
            r.num_computed += 1
            self.commit(r, [tok])

    # ------------------------------------------------------------------ commit
    def commit(self, req: Request, tokens: list[int]) -> int:
        """Append generated tokens, stopping at the first finishing one; returns how many."""
        p = req.params
        n = 0
        for tok in tokens:
            req.output_token_ids.append(tok)
            n += 1
            self.stats.generation_tokens_total += 1
            reason = None
            if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                reason = "stop"
            elif p.stop and self._hit_stop_string(req):
                reason = "stop"
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                req.finish_reason = reason
                self.scheduler.remove(req)
                break
        return n

    def _hit_stop_string(self, req: Request) -> bool:
        detok = self._detok.get(req.request_id)
        if detok is None:
            return False
        before = len(detok.text)
        detok.step(req.output_token_ids)
        longest = max(len(s) for s in req.params.stop)
        window_start = max(0, before - longest + 1)
        hits = [i for s in req.params.stop if (i := detok.text.find(s, window_start)) >= 0]
        if hits:
            detok.text = detok.text[: min(hits)]
            req.text_frozen = True  # the stop string and anything after it are never shown
            return True
        return False

    def _emit(self, touched: list[Request]) -> list[RequestOutput]:
        outs = []
        for req in touched:
            new_ids = req.output_token_ids[req.num_emitted :]
            if not new_ids and req.finish_reason is None:
                continue
            detok = self._detok.get(req.request_id)
            new_text = ""
            if detok is not None:
                if not req.text_frozen:
                    detok.step(req.output_token_ids)
                    if req.finish_reason is not None:
                        detok.flush(req.output_token_ids)
                new_text = detok.text[req.num_emitted_chars :]
                req.num_emitted_chars = len(detok.text)
            req.num_emitted = len(req.output_token_ids)
            outs.append(RequestOutput(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                token_ids=list(req.output_token_ids), text=detok.text if detok else "",
                finish_reason=req.finish_reason, spec_stats=req.spec_stats,
                new_token_ids=new_ids, new_text=new_text,
            ))
            if req.finish_reason is not None:
                self.requests.pop(req.request_id, None)
                self._detok.pop(req.request_id, None)
        return outs
