"""One request's state as it moves through waiting -> running -> finished."""
from __future__ import annotations

import enum
import itertools

import torch

from augury.core.kv_cache import block_key
from augury.outputs import SpecStats, SpecStep
from augury.sampling import LogitsShaper
from augury.sampling_params import SamplingParams

UNIFORM_CHUNK = 64  # uniforms a sampled request draws from its generator at a time

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Token ids, cache blocks and progress of one generation.

    The KV of all_token_ids[:num_computed] is in the cache. A step feeds the tokens
    [num_computed, end) and, when end reaches num_tokens, samples the next one; decoding
    is the case num_computed == num_tokens - 1 (one token in), prefill any longer run.
    The draft head has seen (hidden_p, token_{p+1}) pairs for p < draft_len; the target
    features of positions draft_len .. num_computed-1 wait in the engine's feature store
    (core/features.py) until the next drafting pass consumes them (catch-up after steps
    without speculation), bar the oldest draft_skip ones when more than a window piled up.

    A prefix-cache hit at admission starts num_computed (and draft_len) at the hit: the head
    reads, at those positions, the head KV whoever computed the blocks wrote there if they
    offered it (speculative.eagle3.Eagle3Proposer.head_table), else zeros, as after the
    catch-up window dropped them.

    Who writes what: the engine appends output tokens (`commit`) and advances num_computed
    (`advance`); the scheduler owns status, block_table and the prefix-cache fields (and
    `reset_for_recompute` on preemption, `start_from_cache` on a hit); the EAGLE-3 proposer
    owns draft_len and consumes the pending features the engine
    adds; the engine's emit step owns num_emitted, num_emitted_chars, first_token_time and
    text_frozen.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.output_token_ids: list[int] = []
        self._all = list(self.prompt_token_ids)  # see all_token_ids
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it failed, with finish_reason "error" (Engine.fail)
        self.block_table: list[int] = []
        self.num_computed = 0
        # prefix caching (the scheduler's): keys of the leading full blocks (from the tokens alone, so
        # kept across a preemption), how many leading table blocks are offered to the cache, and how
        # many came from it at admission (their tokens were never computed for this request)
        self.block_keys: list[bytes] = []
        self.num_registered = 0
        self.num_cached_blocks = 0
        self.num_cached_tokens = 0
        self.arrival = next(_arrival)
        # the uniforms that sample this request's output tokens, one per output position (see uniforms)
        self.generator: torch.Generator | None = None
        if params.temperature != 0.0:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
            self.generator = torch.Generator().manual_seed(seed)
        self._uniforms: list[float] = []
        self.spec_stats = SpecStats()
        self.draft_len = 0
        # target features of the positions draft_len + draft_skip .. num_computed - 1 wait in the engine's
        # core.features.FeatureStore, in slot feat_slot (feat_epoch: the store's buffer they were written to)
        self.num_pending = 0  # positions whose features are held
        self.draft_skip = 0  # oldest pending positions dropped (beyond the window): the head never sees them
        self.feat_slot: int | None = None
        self.feat_epoch = 0
        self.draft_blocks_offered = 0  # leading full blocks whose head KV the proposer has offered to others
        self.num_emitted = 0  # output tokens already reported to the caller
        self.num_emitted_chars = 0  # output text already reported to the caller
        self.text_frozen = False  # a stop string ended the text
        self.first_token_time: float | None = None  # time.monotonic() when the first output token was emitted
        # SamplingParams.logprobs / prompt_logprobs: one entry per output token (commit appends), and per
        # prompt token (prefill appends; position 0 has none); kept across a preemption's recompute
        self.logprobs: list[dict] = []
        self.prompt_logprobs: list[dict | None] = [None]
        # penalties, logit bias, bad words, a grammar (set by the engine at admission when the params
        # ask for any): shapes this request's logits wherever a token is chosen, kept across preemption
        self.shaper: LogitsShaper | None = None
        # SamplingParams.return_token_sources: per output token how it came (outputs.TOKEN_SOURCES; commit
        # appends), per decode step what speculation did (the speculator appends); None when not asked
        # for, so a request that does not ask costs one attribute test where they would be appended
        asked = params.return_token_sources
        self.token_sources: list[str] | None = [] if asked else None
        self.spec_steps: list[SpecStep] | None = [] if asked else None
        self.num_emitted_steps = 0  # spec_steps already reported to the caller

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output ids, one list kept up to date as outputs are appended (not rebuilt per
        call: the hot path reads it every step). Read-only for callers."""
        n = len(self._all) - len(self.prompt_token_ids)
        if n < len(self.output_token_ids):
            self._all.extend(self.output_token_ids[n:])
        return self._all

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        # a step always feeds tokens [num_computed, num_tokens); decoding feeds exactly one
        return self.num_computed < self.num_tokens - 1

    def uniforms(self, start: int, n: int) -> list[float]:
        """The uniforms of output positions start .. start+n-1: output token j of a sampled request is
        drawn at uniform j, whether plain decoding or verification (any tree, any batch, any cache
        state) samples it, so a seeded request gives the same tokens with or without speculation.
        Drawn from the request's generator in chunks as positions are first asked for, then kept
        (a recompute after preemption, or a rejected draft's retry, reads the same values)."""
        while len(self._uniforms) < start + n:
            self._uniforms.extend(torch.rand(UNIFORM_CHUNK, dtype=torch.float64, generator=self.generator).tolist())
        return self._uniforms[start : start + n]

    def prefix_keys(self, n: int, block_size: int) -> list[bytes]:
        """The prefix-cache keys of this request's first n full blocks (n * block_size <= num_tokens),
        computed once and kept (they depend on the tokens alone)."""
        keys, ids = self.block_keys, self.all_token_ids
        while len(keys) < n:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else None, ids[i * block_size : (i + 1) * block_size]))
        return keys

    def start_from_cache(self, table: list[int], cached: int, block_size: int) -> None:
        """Admitted with block table `table`, whose first `cached` blocks came from the prefix cache:
        their KV is this request's first cached * block_size positions, computed by another request."""
        n = cached * block_size
        self.block_table = table
        self.num_computed = self.draft_len = self.num_cached_tokens = n
        self.num_cached_blocks = self.num_registered = self.draft_blocks_offered = cached

    def reset_for_recompute(self) -> None:
        """Preempted: the cache is gone; recompute everything (outputs are kept)."""
        self.block_table = []
        self.num_computed = 0
        self.num_registered = 0
        self.num_cached_blocks = 0
        self.draft_len = 0
        self.num_pending = 0  # its features slot stays; what it held is stale
        self.draft_skip = 0
        self.draft_blocks_offered = 0
        self.status = Status.WAITING
