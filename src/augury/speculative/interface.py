"""The typed seams of speculation: what a speculative step may ask of the engine (TargetHost),
what drafts (Proposer) and what decides how much to draft (SpeculationPolicy). Protocols: the
engine, the EAGLE-3 and n-gram proposers and the static and adaptive policies satisfy them
structurally, and nothing probes them with getattr/hasattr."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from augury.core.request import Request
from augury.core.stats import EngineStats
from augury.speculative.policy import StepPlan, TreeShape, Why
from augury.speculative.tree import DraftTree


class TargetHost(Protocol):
    """The engine as a speculative step sees it: run the target over trees, reserve and compact
    cache slots, advance and commit requests. (augury.engine.Engine implements it.)"""

    device: torch.device
    stats: EngineStats
    max_model_len: int

    @property
    def block_size(self) -> int: ...

    def verify_forward(self, reqs: list[Request], tokens: torch.Tensor, parents: torch.Tensor,
                       depth: torch.Tensor, aux: bool, sizes: list[int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def allowed_logits(self, hidden: torch.Tensor, allowed: list[np.ndarray]) -> list[torch.Tensor] | None:
        """Per row of hidden [A, H], target_logits at its allowed token ids alone (same bits, [len(ids)]),
        or None where the output layer cannot compute chosen tokens alone."""
        ...

    def masked_logits(self, hidden: torch.Tensor, allowed: list[np.ndarray]) -> torch.Tensor | None:
        """target_logits of hidden [A, H] at each row's allowed token ids alone, -inf elsewhere (same
        bits), or None where the output layer cannot compute chosen tokens alone."""
        ...

    def reserve(self, reqs: list[Request], lookahead: int) -> bool: ...

    def copy_kv_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...

    def advance(self, req: Request, n: int, features: torch.Tensor | None) -> None: ...

    def take_features(self, req: Request) -> tuple[int, torch.Tensor]:
        """(positions dropped past the window, the target features [n, A] of req's last n computed
        positions that no one has read), forgotten by the host."""
        ...

    def commit(self, req: Request, tokens: list[int], logprobs: list[dict] | None = None,
               sources: list[str] | None = None) -> int: ...

    def thread_trials(self) -> int:
        """A counter that grows when a kernel call tries a thread count other than the chosen one
        (cpu/threads.py): a step whose time includes such a try measured the try as well."""
        ...

    def thread_changes(self) -> int:
        """A counter that grows when the kernels' chosen thread count changes (cpu/threads.py): steps
        timed before it ran at another speed."""
        ...


class Proposer(Protocol):
    needs_aux: bool  # reads the target's aux-layer features (EAGLE-3)
    aux_layers: tuple[int, ...]
    extra_nodes: int  # nodes it may add to a tree beyond the shape's (a prompt-lookup branch)

    def propose(self, host: TargetHost, reqs: list[Request], shape: TreeShape) -> DraftTree:
        """One draft tree per request, node 0 the last committed token."""
        ...


class SpeculationPolicy(Protocol):
    max_shape: TreeShape  # the configured tree: the most it drafts
    why: Why  # what decided its last plan (policy.reason words it)

    def choose(self, batch_size: int) -> TreeShape | None:
        """The tree to draft this step if every request drafted all of it, or None: decode plainly
        (the batch-level rule)."""
        ...

    def plan(self, reqs: list[Request]) -> StepPlan:
        """This step's tree and, per request, how many of its draft nodes it keeps (0: a root-only
        row, verified as a plain decode step). Never more than a request's own max_draft_tokens."""
        ...

    def observe(self, batch_size: int, shape: TreeShape | None, seconds: float, accepted: list[int],
                timed: bool = True, offered: list[int] | None = None, reqs: list[Request] | None = None,
                sizes: list[int] | None = None, forced: int = 0, lookup: list[int] | None = None,
                wall: float | None = None) -> None:
        """After a step: its time (timed=False: not representative; wall: the step's whole time where
        `seconds` leaves out the head's catch-up over a backlog, None: `seconds`) and, per request whose proposer
        drafted, its accepted drafts and the deepest draft depth it was offered (None: the shape's
        depth; a request's budget may cut its tree shorter), both counting the proposer's own drafts
        alone (the EAGLE-3 head's, or the n-gram or suffix proposer's), never a grammar's forced tokens
        (speculative/sources.py). reqs: those requests, in the same order (None: unknown); sizes: every
        row's real node count in the verification, the root included (None: every row verified the
        whole shape); forced: the forced drafts the step accepted, in any row (part of what it emitted,
        in no request's acceptance); lookup: per such row, the drafts of the lookup branch grafted onto
        a head's tree that it accepted (None: no branch)."""
        ...

    def free_first(self, reqs: list[Request], scores: list[float]) -> bool:
        """Verify the requests' suffix drafts alone this step (scores: the drafter's, per request),
        without asking `plan`."""
        ...

    def free_allowed(self, batch_size: int) -> bool:
        """`plan` chose plain decoding: verify the drafts that cost no draft model instead (a grammar's
        forced tokens, suffix drafts)?"""
        ...

    def free_cut(self, batch_size: int, probs: list[float], reaches: list[int] | None = None) -> int:
        """How many of a lone request's drafts that cost no draft model to verify (probs: per draft, the
        chance that it and every draft before it are accepted; reaches: a suffix draft's reach, the tokens
        its text matched before it, 0 for a grammar's forced token); 0: decode plainly instead."""
        ...

    def observe_free(self, batch_size: int, tokens: int, seconds: float, timed: bool = True, lookup: int = 0,
                     scores: list[float] | None = None, rows: int | None = None,
                     chains: Sequence[tuple[Sequence[int], Sequence[int], int]] = ()) -> None:
        """After a step of drafts that cost no draft model: the tokens it emitted, its time, the lookup
        drafts among them, (a `free_first` step) the drafts' scores, the rows it verified, and per request
        with suffix drafts its chain (their places and reaches, the drafts accepted in a row)."""
        ...

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        """The time a plain decode step of this batch size took (the engine times it)."""
        ...

    def costs_changed(self) -> None:
        """Every step timed so far ran at another speed (the kernels' thread count changed): what was
        measured of step times is to be measured afresh (acceptance stands)."""
        ...
