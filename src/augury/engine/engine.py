"""The step loop: schedule -> (propose -> verify | decode) -> commit -> emit.

An Engine is built from parts that are already complete (see engine/builder.py); its
constructor only assigns them, so it cannot exist half-built.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Protocol

import numpy as np
import torch

from augury.attention import AttentionBackend, padded_positions
from augury.config import EngineConfig
from augury.cpu import kernels as cpu_kernels
from augury.cpu import threads as cpu_threads
from augury.engine.detokenizer import IncrementalDetokenizer
from augury.core.features import FeatureStore
from augury.core.kv_budget import KVPlan
from augury.core.kv_cache import BlockAllocator, KVCache
from augury.core.request import Request, Status
from augury.engine.sampler import sample
from augury.engine.scheduler import ScheduledBatch, Scheduler
from augury.core.stats import EngineStats
from augury.core.timing import clock
from augury.models.config import TargetConfig
from augury.attention.base import PagedAttention
from augury.models.llama import TargetModel
from augury.outputs import RequestOutput, SpecStep
from augury.sampling import MASKED_AT_MOST, NO_TOKEN, logits_at_allowed, token_logprobs
from augury.sampling_params import OutputKind, SamplingParams
from augury.structured import GrammarBackend, make_shaper

log = logging.getLogger("augury.engine")
# Engine.fail's reasons for a row with no valid token (sampling.NO_TOKEN): the request's own shaping
# (a client's doing), or logits that are not finite without any (the model's)
SHAPED_EMPTY = ("this request's logit_bias, bad_words, penalties or structured output leave every token "
                "masked, or its logits are not finite")
NONFINITE = "the model's logits for this request are not finite"


class Speculator(Protocol):
    """What the engine asks of speculation (speculative.worker.Speculator implements it)."""

    needs_aux: bool  # the proposer reads target features (EAGLE-3): forwards return them
    aux_layers: tuple[int, ...]  # which layers' outputs those features are
    catch_up_window: int  # most features kept per request for the proposer

    def step(self, host: "Engine", reqs: list[Request]) -> bool:
        """Speculate for this decode batch; False: the engine decodes plainly instead."""
        ...

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        """The time a plain decode step of this batch size took."""
        ...

    def after_warmup(self, host: "Engine") -> None:
        """The engine has passed its warm-up request: from now on steps are measured (nothing is profiled)."""
        ...


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
        max_position: int,
        device: torch.device,
        attention: AttentionBackend,
        speculator: Speculator | None = None,
        dtype: torch.dtype | None = None,
        kv_plan: KVPlan | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.model_cfg = model_cfg
        self.kv = kv
        self.allocator = allocator
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_position = max_position  # largest position the model computes (drafts may pass max_model_len)
        self.device = device
        self.dtype = dtype or kv.k.dtype  # the model's (the cache's may differ: --kv-cache-dtype)
        self.kv_plan = kv_plan  # how the builder sized the cache (/server_info)
        self.attention = attention
        self.speculator = speculator
        self.scheduler = Scheduler(allocator, config.max_num_seqs, config.max_num_batched_tokens)
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}
        self.features = FeatureStore()  # target features the proposer has not read yet (EAGLE-3)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._grammar = None  # structured.GrammarBackend, made at the first request with a grammar
        self._masked_logits = True  # decode rows under a grammar may take TargetModel.masked_logits (False: it said None)
        self._grammar_lock = threading.Lock()

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
        req.shaper = make_shaper(params, ids, vocab_size=vocab, device=self.device, tokenizer=self.tokenizer,
                                 backend=self.grammar, eos_token_ids=self.eos_token_ids)
        self.requests[request_id] = req
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                             params.spaces_between_special_tokens)
        self.scheduler.add(req)
        return request_id

    def grammar(self) -> GrammarBackend:
        """The xgrammar backend over this engine's tokenizer (made once, on first use; thread-safe: the
        server compiles a request's constraint on its tokenizer thread before admitting it)."""
        with self._grammar_lock:
            if self._grammar is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs a tokenizer, and this model folder has none")
                self._grammar = GrammarBackend(self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids)
            return self._grammar

    def shaping_stats(self):
        """The grammar backend's counters (structured.ShapingStats), None before the first constrained request."""
        return self._grammar.stats if self._grammar is not None else None

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        if req is None:
            return
        self.features.release(req)  # its slot serves the next request
        if req.status is not Status.FINISHED:
            req.finish_reason = "abort"
            self.scheduler.remove(req)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks that running requests hold stay theirs, and are offered
        to the cache again as they run: Scheduler.reset_prefix_cache)."""
        self.scheduler.reset_prefix_cache()

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
        # where the fused stack runs the target, a step's torch operators (prefill's attention, sampling,
        # the draft head's) run the kernels' chosen count in this thread only (cpu/threads.py): on a core
        # shared with a busy process two threads cost several times one, and leave libgomp's idle
        # worker spinning against it
        rows = sum(e - r.num_computed for r, e in zip(batch.requests, batch.ends)) if batch.prefill \
            else len(batch.requests)
        n = cpu_threads.settled(rows) if self.device.type == "cpu" and self.model.runs_fused else 0
        with cpu_kernels.torch_threads(n):
            if batch.prefill:
                touched = self._run_prefill(batch)
            else:
                touched = batch.requests
                if self.speculator is None:
                    note_plain(batch.requests, "speculation is off on this server")
                if self.speculator is None or not self.speculator.step(self, batch.requests):
                    trials, t0 = self.thread_trials(), clock(self.device)
                    self._run_decode(batch)
                    # a step that tried another thread count (cpu/threads.py) timed that try too: on a
                    # shared core ~10x a step, which would make plain decoding look dear to the policy
                    if self.speculator is not None and self.thread_trials() == trials:
                        self.speculator.observe_plain(len(batch.requests), clock(self.device) - t0)
        self.stats.maybe_log(self)
        return self._emit(touched)

    # ---------------------------------------------------------- target forwards
    def run_target(self, reqs: list[Request], rows: list[list[int]], positions: torch.Tensor,
                   attn: PagedAttention, aux: bool, aux_into: tuple[torch.Tensor, torch.Tensor] | None = None,
                   most: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward: request b feeds rows[b] at positions[b] ([B, Q], on the CPU), attention as
        prepared by the backend. Returns (hidden [B, Q, H], aux features [B, Q, A] or None); with
        aux_into (FeatureStore.step_rows) the features are written there and None comes back. most: the
        largest of the positions where the caller knows it."""
        top = int(positions.max()) if most is None else most
        if top > self.max_position:
            raise ValueError(f"position {top} is past the largest this engine computes "
                             f"({self.max_position}): a caller let a request grow past its context")
        q = max(len(r) for r in rows)
        if all(len(r) == q for r in rows):  # one tensor call (each is dear right after a forward)
            ids = torch.tensor(rows, dtype=torch.long)
        else:
            ids = torch.zeros(len(rows), q, dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, : len(r)] = torch.tensor(r)
        layers = self.speculator.aux_layers if (aux and self.speculator is not None) else ()
        if aux_into is not None and layers:
            return self.model(ids.to(self.device), positions.to(self.device), attn, layers, aux_into)
        return self.model(ids.to(self.device), positions.to(self.device), attn, layers)

    def verify_forward(self, reqs: list[Request], tokens: torch.Tensor, parents: torch.Tensor,
                       depth: torch.Tensor, aux: bool, sizes: list[int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over one draft tree per request (tokens/parents/depth [B, N]): node i sits at
        position num_computed + depth[i] and is written to cache position num_computed + i. With
        sizes (each row's real nodes) the forward runs the real nodes only, packed into one row, and
        the padding nodes of the returned [B, N, ...] tensors are zeros."""
        ctx = [r.num_computed for r in reqs]
        tables = [r.block_table for r in reqs]
        at = [[c + d for d in row] for c, row in zip(ctx, depth.tolist())]
        positions = torch.tensor(at, dtype=torch.long)  # [B, N]
        most = max(max(row) for row in at)
        b, n = tokens.shape
        if sizes is not None and sum(sizes) < b * n:
            attn = self.attention.prepare_packed_tree(tables, ctx, parents.cpu(), sizes)
            if attn is not None:
                real = torch.arange(n)[None, :] < torch.tensor(sizes)[:, None]  # [B, N]
                hidden, feats = self.run_target(reqs, [tokens.cpu()[real].tolist()], positions[real][None], attn, aux)
                real = real.to(self.device)
                full = hidden.new_zeros(b, n, hidden.shape[-1])
                full[real] = hidden[0]
                if feats is not None:
                    packed_feats, feats = feats, feats.new_zeros(b, n, feats.shape[-1])
                    feats[real] = packed_feats[0]
                return full, feats
        attn = self.attention.prepare_tree(tables, ctx, parents.cpu())
        return self.run_target(reqs, tokens.tolist(), positions, attn, aux, most=most)

    def advance(self, req: Request, n: int, features: torch.Tensor | None) -> None:
        """The next n tokens of req are in the cache; features [n, A] are their target features."""
        if features is not None:
            self.features.add(req, features, self.speculator.catch_up_window)
        req.num_computed += n

    def take_features(self, req: Request) -> tuple[int, torch.Tensor]:
        """(positions dropped past the window, the target features [n, A] held for req's positions
        num_computed - n .. num_computed - 1), forgotten here."""
        return self.features.take(req)

    # ------------------------------------------- what speculation may do (speculative.interface.TargetHost)
    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., V]."""
        return self.model.logits(hidden)

    def allowed_logits(self, hidden: torch.Tensor, allowed: list[np.ndarray]) -> list[torch.Tensor] | None:
        """hidden [A, H] -> per row a, float32 logits at its allowed tokens alone (the bits target_logits
        gives them), or None where the output layer cannot (TargetModel.allowed_logits)."""
        return self.model.allowed_logits(hidden, allowed)

    def masked_logits(self, hidden: torch.Tensor, allowed: list[np.ndarray]) -> torch.Tensor | None:
        """hidden [A, H] -> float32 logits [A, V] at each row's allowed tokens only (-inf elsewhere, the
        bits target_logits gives them), or None where the output layer cannot (TargetModel.masked_logits)."""
        return self.model.masked_logits(hidden, allowed)

    def thread_trials(self) -> int:
        """cpu/threads.py's count of calls that tried a thread count other than the chosen one."""
        return cpu_threads.trials() if self.device.type == "cpu" else 0

    def thread_changes(self) -> int:
        """cpu/threads.py's count of changes of the chosen thread count."""
        return cpu_threads.changes() if self.device.type == "cpu" else 0

    def reserve(self, reqs: list[Request], lookahead: int) -> bool:
        """Cache room for `lookahead` tokens past each request's num_computed, within the positions
        the model computes; False (nothing preempted, nothing reserved) when it is short."""
        if any(r.num_computed + lookahead - 1 > self.max_position for r in reqs):
            return False
        return self.scheduler.try_reserve(reqs, lookahead)

    def copy_kv_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.kv.copy_slots(src, dst)

    def _wants_aux(self, reqs: list[Request]) -> bool:
        """Whether this forward collects the target features a proposer reads: not when every request
        in it opted out of speculation (max_draft_tokens=0), which then never drafts."""
        return (self.speculator is not None and self.speculator.needs_aux
                and any(r.params.max_draft_tokens != 0 for r in reqs))

    def _run_prefill(self, batch: ScheduledBatch) -> list[Request]:
        reqs = batch.requests
        rows = [r.all_token_ids[r.num_computed : end] for r, end in zip(reqs, batch.ends)]
        ctx = [r.num_computed for r in reqs]
        attn = self.attention.prepare_prefill([r.block_table for r in reqs], ctx, [len(r) for r in rows])
        q = max(len(r) for r in rows)
        positions = padded_positions(ctx, [len(r) for r in rows], q)  # padding repeats a row's last position
        hidden, aux = self.run_target(reqs, rows, positions, attn, self._wants_aux(reqs))
        done = [i for i, (r, end) in enumerate(zip(reqs, batch.ends)) if end == r.num_tokens]
        for i, (r, row, c) in enumerate(zip(reqs, rows, ctx)):
            if r.params.prompt_logprobs is not None:
                self._prompt_logprobs(r, hidden[i], c, len(row))
            self.advance(r, len(row), aux[i, : len(row)] if aux is not None else None)
        if not done:
            return []
        last = torch.tensor([len(rows[i]) - 1 for i in done], device=self.device)
        logits = self.model.logits(hidden[done, last])  # [D, V]
        finished = [reqs[i] for i in done]
        toks = sample(logits, finished)
        lps = self._logprobs(logits, finished, toks)
        for j, (r, tok) in enumerate(zip(finished, toks)):
            self.commit(r, [tok], [lps[j]] if lps[j] is not None else None)
        return finished

    def _decode_logits(self, hidden: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """hidden [B, H] -> the logits [B, V] a decode step samples from: a row whose grammar allows few
        tokens next (a key's, punctuation, digits) at those tokens alone, -inf elsewhere
        (TargetModel.masked_logits: the same bits, and the mask sets the rest to -inf anyway), unless
        the request wants logprobs (read from its whole raw row); the whole output layer is read for
        the other rows only."""
        allowed = [r.shaper.allowed_ids(MASKED_AT_MOST)
                   if self._masked_logits and r.shaper is not None and r.shaper.has_grammar
                   and r.params.logprobs is None else None for r in reqs]
        logits, declined = logits_at_allowed(
            allowed, lambda rows: self.model.masked_logits(hidden[rows], [allowed[i] for i in rows]),
            lambda rows: self.model.logits(hidden if rows is None else hidden[rows]))
        if declined:
            self._masked_logits = False  # this output layer computes whole rows only
        return logits

    def _logprobs(self, logits: torch.Tensor, reqs: list[Request], toks: list[int]) -> list[dict | None]:
        """Per request, the chosen token's TokenLogprobs from its row of logits [B, V] (None where
        the request did not ask for logprobs)."""
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        out: list[dict | None] = [None] * len(reqs)
        if want:
            got = token_logprobs(logits[want], [toks[i] for i in want], [reqs[i].params.logprobs for i in want])
            for i, d in zip(want, got):
                out[i] = d
        return out

    def _prompt_logprobs(self, req: Request, hidden: torch.Tensor, start: int, n: int) -> None:
        """This chunk fed positions start..start+n-1; the logits at position p give the prompt token at
        p + 1. Fills the entries not yet known (a recompute after preemption adds nothing)."""
        prompt_len = len(req.prompt_token_ids)
        first = len(req.prompt_logprobs) - 1  # position whose logits give the next missing entry
        last = min(start + n, prompt_len - 1)  # positions first..last-1
        if last <= max(first, start):
            return
        first = max(first, start)
        logits = self.model.logits(hidden[first - start : last - start])
        targets = req.prompt_token_ids[first + 1 : last + 1]
        req.prompt_logprobs.extend(token_logprobs(logits, targets, [req.params.prompt_logprobs] * len(targets)))

    def _run_decode(self, batch: ScheduledBatch) -> None:
        reqs = batch.requests
        ctx = [r.num_computed for r in reqs]
        attn = self.attention.prepare_decode([r.block_table for r in reqs], ctx)
        wants = self._wants_aux(reqs)
        # the forward writes the batch's features straight into the store's rows where it can (the fused
        # kernel, at no cost of its own); else they come back and are stored in one indexed copy
        into = self.features.step_rows(reqs, len(self.speculator.aux_layers) * self.model.cfg.hidden_size,
                                       self.speculator.catch_up_window) if wants else None
        hidden, aux = self.run_target(reqs, [[r.last_token_id] for r in reqs], torch.tensor([[c] for c in ctx]),
                                      attn, wants, into, most=max(ctx))
        logits = self._decode_logits(hidden[:, 0], reqs)  # [B, V]
        toks = sample(logits, reqs)
        lps = self._logprobs(logits, reqs, toks)
        if into is not None:
            self.features.kept_step(reqs, self.speculator.catch_up_window)
        elif aux is not None:  # the whole batch's features in one copy
            self.features.add_step(reqs, aux[:, 0], self.speculator.catch_up_window)
        for i, (r, tok) in enumerate(zip(reqs, toks)):
            self.advance(r, 1, None)
            self.commit(r, [tok], [lps[i]] if lps[i] is not None else None)

    # ------------------------------------------------------------------ commit
    def commit(self, req: Request, tokens: list[int], logprobs: list[dict] | None = None,
               sources: list[str] | None = None) -> int:
        """Append generated tokens (and their TokenLogprobs, when the request asked for them), stopping
        at the first finishing one; returns how many it took (a NO_TOKEN, which ends the request with
        finish_reason "error", counts). sources: each token's outputs.TOKEN_SOURCES name, kept when the
        request asked (SamplingParams.return_token_sources); None: all the target's own."""
        n = 0
        for tok in tokens:
            if tok == NO_TOKEN:  # this request's row had no valid choice: it ends here, alone
                self.fail(req, f"no valid next token at output position {len(req.output_token_ids)}: "
                          + (SHAPED_EMPTY if req.shaper is not None else NONFINITE))
                return n + 1
            req.output_token_ids.append(tok)
            if logprobs is not None:
                req.logprobs.append(logprobs[n])
            if req.token_sources is not None:
                req.token_sources.append("target" if sources is None else sources[n])
            n += 1
            self.stats.generation_tokens_total += 1
            try:
                reason = self._finish_reason(req, tok)
            except Exception as exc:  # its grammar refused the token, its text failed: its fault alone
                self.fail(req, f"{type(exc).__name__}: {exc}")
                return n
            if reason is not None:
                req.finish_reason = reason
                self.scheduler.remove(req)
                break
        return n

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        """Why req ends now that `tok` is committed (its grammar told of it): "stop", "length" or None."""
        p = req.params
        done = req.shaper is not None and req.shaper.commit(tok)  # the grammar took its stop token
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids or done:
            if p.stop:  # the stop token's text may also complete a stop string: cut it there
                self._hit_stop_string(req)
            return "stop"
        # min_tokens: no stop string ends the output before its min_tokens-th token (EOS and stop
        # token ids cannot come that early: the shaper masks them)
        if p.stop and len(req.output_token_ids) >= p.min_tokens and self._hit_stop_string(req):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def fail(self, req: Request, reason: str) -> None:
        """End one request with finish_reason "error" (its output so far stays; the rest of the batch
        goes on). For faults that belong to this request alone: its row had no valid token, its grammar
        refused a committed token, its text could not be detokenized."""
        log.warning("request %s failed: %s", req.request_id, reason)
        req.finish_reason, req.error = "error", reason
        if req.status is not Status.FINISHED:
            self.scheduler.remove(req)

    def _hit_stop_string(self, req: Request) -> bool:
        detok = self._detok.get(req.request_id)
        if detok is None:
            return False
        before = detok.length
        ids = req.output_token_ids
        # a token ending inside a character leaves its whole characters unreleased: they count too,
        # so the stop string ends at the token that completes it, never one token later
        extra = "" if detok.step(ids) else detok.pending(ids)
        longest = max(len(s) for s in req.params.stop)
        window_start = max(0, before - longest + 1)  # a stop string may begin this far back, no further
        window = detok.tail(detok.length - window_start) + extra
        hits = [(i, len(s)) for s in req.params.stop if (i := window.find(s)) >= 0]
        if hits:
            at, size = min(hits)  # the first to begin (of two beginning there, the shorter: it ends first)
            # include_stop_str_in_output: the text ends with the stop string, else just before it
            detok.cut(window_start, window[: at + size if req.params.include_stop_str_in_output else at])
            req.text_frozen = True  # the stop string and anything after it are never shown
            return True
        return False

    def _emit(self, touched: list[Request]) -> list[RequestOutput]:
        """The outputs of this step's requests, each of its request's SamplingParams.output_kind: a
        delta output holds only what the step added and a final_only request is silent until it
        finishes, so neither copies the request's history per step (a cumulative output does)."""
        outs = []
        now = time.monotonic()
        for req in touched:
            finished = req.finish_reason is not None
            n = len(req.output_token_ids)
            if n == req.num_emitted and not finished:
                continue
            if req.first_token_time is None and n:
                req.first_token_time = now
            detok = self._detok.get(req.request_id)
            if detok is not None and not req.text_frozen:
                try:  # every step, whatever the kind: the text comes out the same
                    detok.step(req.output_token_ids)
                    if finished:
                        detok.flush(req.output_token_ids)
                except Exception as exc:  # e.g. a tokenizer that cannot decode these ids: this request's fault
                    self.fail(req, f"the output could not be detokenized ({type(exc).__name__}: {exc})")
                    finished = True
            kind = req.params.output_kind
            if kind is OutputKind.FINAL_ONLY and not finished:
                continue
            outs.append(self._output(req, detok, kind))
            if finished:
                self.requests.pop(req.request_id, None)
                self._detok.pop(req.request_id, None)
                self.features.release(req)
        return outs

    def _output(self, req: Request, detok: IncrementalDetokenizer | None, kind: OutputKind) -> RequestOutput:
        """req's output since its last one (num_emitted tokens, num_emitted_chars characters ago)."""
        start = req.num_emitted
        new_ids = req.output_token_ids[start:]
        new_text = ""
        if detok is not None:
            shown = detok.length
            if req.finish_reason is None and req.params.stop:  # the start of a stop string may
                shown -= detok.stop_prefix_len(req.params.stop)  # be completed later: hold it
            shown = max(shown, req.num_emitted_chars)
            new_text = detok.tail(detok.length - req.num_emitted_chars)[: shown - req.num_emitted_chars]
            req.num_emitted_chars = shown
        req.num_emitted = len(req.output_token_ids)
        lps = req.params.logprobs is not None
        plps = req.params.prompt_logprobs is not None
        srcs, steps, first_step = req.token_sources, req.spec_steps, req.num_emitted_steps
        if steps is not None:
            req.num_emitted_steps = len(steps)
        if kind is OutputKind.DELTA:
            token_ids, text = new_ids, new_text
            logprobs = req.logprobs[start:] if lps else None
            # every prompt entry is known once a token is emitted (prefill is over): all in the first output
            prompt_logprobs = (list(req.prompt_logprobs) if start == 0 else []) if plps else None
            srcs = srcs[start:] if srcs is not None else None
            steps = steps[first_step:] if steps is not None else None
        else:
            token_ids = list(req.output_token_ids)
            text = detok.text[: req.num_emitted_chars] if detok is not None else ""
            logprobs = list(req.logprobs) if lps else None
            prompt_logprobs = list(req.prompt_logprobs) if plps else None
            srcs = list(srcs) if srcs is not None else None
            steps = list(steps) if steps is not None else None
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=token_ids, text=text,
            finish_reason=req.finish_reason, spec_stats=dataclasses.replace(req.spec_stats),
            new_token_ids=new_ids, new_text=new_text, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            num_cached_tokens=req.num_cached_tokens, first_token_time=req.first_token_time, error=req.error,
            token_sources=srcs, spec_steps=steps,
        )


def note_plain(reqs: list[Request], reason: str) -> None:
    """A plain decode step for reqs, and why: a SpecStep for those that asked (return_token_sources)."""
    for r in reqs:
        if r.spec_steps is not None:
            r.spec_steps.append(SpecStep("plain", 0, 0, reason))
