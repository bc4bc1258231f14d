"""Benchmarks. A benchmark compares named *systems* on the same checkpoint, prompts and dtype.

A system is anything with `name`, `generate(prompts, output_len, stop_at_eos=False) -> token ids
per prompt` (exactly output_len new tokens each, or with stop_at_eos up to and including the
first end-of-sequence token, at most output_len) and `close()`; after each call a system may hold
`first_token_times`, per prompt the time.monotonic() at which its first token was generated (the
benchmark's decode-only rate needs it: a system without it has none). Two are built in: augury's
engine and transformers' `generate`. More rows (speculation on/off, policies) are added by
registering a factory, a module-level function or class of an importable module: `def eagle3(s):
return AugurySystem(s, "augury-eagle3", speculative_algorithm="eagle3", ...)`, `register_system(
"augury-eagle3", eagle3)`, then `bench(BenchSettings(systems=("transformers", "augury-eagle3")))`.
The benchmark builds each system in a worker process of its own (bench/worker.py), which imports
a registered factory by name (so not a lambda).
Heavy imports (torch, transformers) happen inside functions, so importing this is cheap.
"""
from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class SystemSettings:
    """What every system of one benchmark run shares."""

    model: str  # checkpoint folder (resolved by the benchmark: never a name such as "demo")
    dtype: str  # float32 / bfloat16 / float16: one concrete dtype for all systems
    device: str
    max_batch_size: int
    max_len: int  # prompt + output tokens of the longest request
    draft_model: str | None = None  # EAGLE-3 head folder for the speculative systems
    temperature: float = 0.0  # 0 = greedy; otherwise seeded sampling at this temperature
    quantization: str = "auto"  # augury's weight mode (EngineConfig.quantization)
    gguf: str | None = None  # the GGUF file the peer systems (llama.cpp) load: the same weights
    threads: int | None = None  # CPU threads of every system (torch's intra-op threads, llama.cpp's n_threads)
    eos_ids: tuple[int, ...] | None = None  # the checkpoint's end-of-sequence ids (None: each system reads them)
    tensor_parallel_size: int = 1  # augury systems: ranks (each cores / N threads, pinned; augury/distributed)
    # --prompts json: per prompt (its token ids), the JSON schema augury's systems constrain its answer to
    # (peers answer unconstrained)
    json_schemas: tuple[tuple[tuple[int, ...], str], ...] = ()
    # --history warm: per prompt (its token ids), the conversation before its last message (a prefix of
    # the prompt), which augury's systems prefill untimed before each timed run (AugurySystem.prepare)
    histories: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    top_p: float = 1.0  # sampled runs: every system keeps this nucleus (1: no top-p)


class System(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], output_len: int, stop_at_eos: bool = False) -> list[list[int]]: ...

    def close(self) -> None: ...


def _kv_blocks_for(settings: SystemSettings) -> int:
    """Room for the whole batch at the longest request (a draft tree past it included): a throughput
    measurement must never preempt (the automatic size is 2 requests of the full context,
    core/kv_budget.py). Its pages are taken as they are written, so the rows that run are what it costs."""
    from augury.builder import DRAFT_SLACK
    from augury.config import EngineConfig

    size = EngineConfig().block_size  # the default: the benchmark never sets another
    return settings.max_batch_size * -(-(settings.max_len + DRAFT_SLACK) // size) + 1


WARM_TOKENS = 4  # tokens AugurySystem.prepare answers to a history: past the first decode step


class AugurySystem:
    """augury's LLM at the benchmark's temperature; extra keyword arguments go to LLM (EngineConfig fields)."""

    def __init__(self, settings: SystemSettings, name: str = "augury", constrained: bool = True,
                 **engine_kwargs: Any) -> None:
        """constrained=False: answer --prompts json unconstrained (the reference of the grammar's cost)."""
        from augury.llm import LLM

        self.name = name
        kwargs: dict[str, Any] = dict(dtype=settings.dtype, device=settings.device,
                                      max_num_seqs=settings.max_batch_size, max_model_len=settings.max_len,
                                      log_stats_interval=0.0, quantization=settings.quantization,
                                      num_kv_blocks=_kv_blocks_for(settings))
        if settings.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = settings.tensor_parallel_size
        kwargs.update(engine_kwargs)
        self.llm = LLM(settings.model, **kwargs)
        self.temperature = settings.temperature
        self.top_p = settings.top_p
        self.first_token_times: list[float | None] = []  # the last generate call's, per prompt (the engine's)
        self.schemas = dict(settings.json_schemas) if constrained else {}
        self._answered: set[tuple[int, ...]] = set()  # prompts answered since the suffix cache was emptied
        self.histories = {p: list(h) for p, h in settings.histories if h}
        self._prepared: set[tuple[int, ...]] | None = None  # prompts prepare() readied for the next generate
        self.reset_counts()

    def _fresh(self, keys: set[tuple[int, ...]]) -> None:
        # every repeat computes its prompts: a run must not find the previous repeat's prompts in the
        # prefix cache (an engine with an EAGLE-3 head reuses less of a short prompt than one without,
        # so the repeats would compare different work; `--workload document` measures the cache)
        self.llm.engine.reset_prefix_cache()
        # nor their answers in the cross-request suffix cache (the same greedy answer would be drafted
        # whole): it is emptied when a prompt comes again, so a run's requests draft from earlier ones of
        # the same run only (extraction to one schema across documents), never from their own last answer
        if keys & self._answered:
            self._answered.clear()
            drafter = self.llm.engine.speculator.drafter if self.llm.engine.speculator is not None else None
            if drafter is not None:
                drafter.clear()
        self._answered |= keys

    def prepare(self, prompts: list[list[int]]) -> None:
        """Before a timed generate of these prompts (worker.run_groups, untimed): the caches emptied as
        generate would, then each prompt's history (--history warm) prefilled and a few tokens answered
        and dropped, so the timed request finds its earlier turns in the prefix cache. An EAGLE-3 head
        catches up (and offers its KV over the history's full blocks) on the first of those decode steps
        its policy drafts: always under the static policy; the adaptive one may decode them plainly, and
        the timed request's head then reads zeros over the history, where a live session whose earlier
        answer was speculated would have the head's KV (so warm figures can understate the head). With one
        token answered the head never ran. Nothing is counted."""
        from augury.sampling_params import SamplingParams

        keys = {tuple(p) for p in prompts}
        self._fresh(keys)
        warm = [self.histories[k] for k in dict.fromkeys(tuple(p) for p in prompts) if k in self.histories]
        if warm:
            self.llm.generate(warm, [SamplingParams(temperature=0.0, max_tokens=WARM_TOKENS, ignore_eos=True)]
                              * len(warm), use_tqdm=False)
        self._prepared = keys

    def reset_counts(self) -> None:
        """Start counting verification steps, accepted drafts and decoded tokens afresh."""
        self.steps = self.accepted = self.decoded = 0
        self.mask_seconds = self.seconds = 0.0  # grammar masks' time and the generate calls' wall time
        self.per_prompt: dict[tuple[int, ...], list[int]] = {}  # prompt -> [verify steps, accepted drafts]

    def accept_length_of(self, prompts: list[list[int]]) -> float:
        """Tokens per verification step over these prompts since reset_counts (0 when none)."""
        steps = accepted = 0
        for p in {tuple(p) for p in prompts}:
            s, a = self.per_prompt.get(p, (0, 0))
            steps, accepted = steps + s, accepted + a
        return (steps + accepted) / steps if steps else 0.0

    @property
    def accept_length(self) -> float:
        """Tokens per verification step since reset_counts (0 when nothing was speculated)."""
        return (self.steps + self.accepted) / self.steps if self.steps else 0.0

    @property
    def spec_fraction(self) -> float:
        """Share of the decoded tokens (all but each request's first) that came from verification steps."""
        return (self.steps + self.accepted) / max(1, self.decoded)

    @property
    def mask_share(self) -> float:
        """Share of the generate calls' wall time since reset_counts spent on grammar masks (filling xgrammar's
        bitmask and applying it to the logits, structured/shaper.py), 0 when nothing was constrained."""
        return self.mask_seconds / self.seconds if self.seconds else 0.0

    def _mask_seconds(self) -> float:
        stats = self.llm.engine.shaping_stats()
        return stats.mask_seconds if stats is not None else 0.0

    def generate(self, prompts: list[list[int]], output_len: int, stop_at_eos: bool = False) -> list[list[int]]:
        import json

        from augury.sampling_params import SamplingParams, StructuredOutputsParams

        t = self.temperature
        params = [SamplingParams(temperature=t, top_p=self.top_p if t else 1.0, max_tokens=output_len,
                                 ignore_eos=not stop_at_eos, seed=i if t else None)
                  for i in range(len(prompts))]
        for p, prompt in zip(params, prompts):
            schema = self.schemas.get(tuple(prompt))
            if schema is not None:
                p.structured_outputs = StructuredOutputsParams(json=json.loads(schema))
        keys = {tuple(p) for p in prompts}
        if self._prepared != keys:
            self._fresh(keys)
        self._prepared = None
        mask0, t0 = self._mask_seconds(), time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        self.seconds += time.perf_counter() - t0
        self.mask_seconds += self._mask_seconds() - mask0
        self.steps += sum(o.spec_stats.num_verify_steps for o in outs)
        self.accepted += sum(o.spec_stats.num_accepted_draft_tokens for o in outs)
        self.decoded += sum(len(o.token_ids) - 1 for o in outs)
        for p, o in zip(prompts, outs):
            rec = self.per_prompt.setdefault(tuple(p), [0, 0])
            rec[0] += o.spec_stats.num_verify_steps
            rec[1] += o.spec_stats.num_accepted_draft_tokens
        self.first_token_times = [o.first_token_time for o in outs]
        return [o.token_ids for o in outs]

    def close(self) -> None:
        del self.llm


class TransformersSystem:
    """transformers' model class and `generate` at the benchmark's temperature, same dtype and device.

    Prompts of different lengths are left-padded with an attention mask. `generate_kwargs`
    select a decoding variant (e.g. prompt_lookup_num_tokens=10 for prompt lookup decoding).
    """

    def __init__(self, settings: SystemSettings, name: str = "transformers", max_batch: int | None = None,
                 **generate_kwargs: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.name = name
        self.torch = torch
        self.device = torch.device(settings.device)
        folder = Path(settings.model)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, settings.dtype))
        self.model = model.to(self.device).eval()
        gen = self.model.generation_config
        self.eos_ids = _eos_ids(folder, settings.eos_ids)  # the same set augury stops at
        gen.eos_token_id = None  # fixed output length, like ignore_eos, unless a call asks to stop
        gen.temperature = gen.top_p = gen.top_k = None  # checkpoints may ship sampling defaults
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else 0
        self.max_batch = max_batch
        self.generate_kwargs = generate_kwargs
        self.first_token_times: list[float | None] = []  # the last generate call's, one stamp for the batch
        if settings.temperature > 0:
            self.generate_kwargs.update(do_sample=True, temperature=settings.temperature)
            if settings.top_p < 1.0:
                self.generate_kwargs.update(top_p=settings.top_p)

    def supports(self, batch_size: int) -> bool:
        return self.max_batch is None or batch_size <= self.max_batch

    def generate(self, prompts: list[list[int]], output_len: int, stop_at_eos: bool = False) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)  # [B, L]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        clock = _FirstTokenClock()
        with torch.inference_mode():
            kwargs = {"do_sample": False, "streamer": clock, **self.generate_kwargs}
            if stop_at_eos:
                kwargs["eos_token_id"] = sorted(self.eos_ids)
            else:
                kwargs["min_new_tokens"] = output_len
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=output_len,
                                      pad_token_id=self.pad_id, **kwargs)
        rows = out[:, width:].tolist()
        if stop_at_eos:  # rows that finished early are padded after their end-of-sequence token
            rows = [_through_first(row, self.eos_ids) for row in rows]
        self.first_token_times = [clock.first] * len(rows)
        return rows

    def close(self) -> None:
        del self.model


class _FirstTokenClock:
    """A streamer for transformers' generate that notes when the first generated tokens came out:
    generate puts the prompt first, then each step's new tokens (the whole batch's at once)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None  # time.monotonic() at the first put after the prompt's

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.monotonic()

    def end(self) -> None:
        pass


class LlamaCppSystem:
    """llama.cpp (llama-cpp-python, the optional `augury[peers]` extra) on the benchmark's GGUF
    file: the same weights augury converts, in their own quantisation. One sequence at a time
    (its Python API decodes one), greedy or seeded sampling, settings.threads threads (default: as
    many as torch uses). It needs no torch when the settings give threads and eos_ids (as the
    benchmark's do), so its worker process never loads torch's OpenMP runtime."""

    def __init__(self, settings: SystemSettings, name: str = "llama.cpp") -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise ValueError("the llama.cpp system needs llama-cpp-python: pip install 'augury[peers]'") from None
        if settings.gguf is None:
            raise ValueError("the llama.cpp system needs a GGUF file: --model FILE.gguf, --model demo, or --gguf FILE")
        if settings.device != "cpu":
            raise ValueError("the llama.cpp system runs on the CPU only here (--device cpu)")
        self.name = name
        threads = settings.threads
        if not threads:
            import torch

            threads = torch.get_num_threads()
        self.threads = threads
        self.llm = Llama(model_path=settings.gguf, n_ctx=settings.max_len + 8, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, verbose=False)
        self.eos_ids = _eos_ids(settings.model, settings.eos_ids)  # the same set augury stops at
        self.temperature = settings.temperature
        self.top_p = settings.top_p
        self.first_token_times: list[float | None] = []  # the last generate call's, per prompt

    def supports(self, batch_size: int) -> bool:
        return batch_size == 1

    def generate(self, prompts: list[list[int]], output_len: int, stop_at_eos: bool = False) -> list[list[int]]:
        rows = []
        self.first_token_times = []
        for i, prompt in enumerate(prompts):
            self.llm.reset()
            if self.temperature > 0:
                self.llm.set_seed(i)
                stream = self.llm.generate(prompt, temp=self.temperature, top_k=0, top_p=self.top_p, min_p=0.0,
                                           repeat_penalty=1.0)
            else:
                stream = self.llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0)
            row: list[int] = []
            for tok in stream:
                if not row:  # the prompt evaluated and its first token sampled
                    self.first_token_times.append(time.monotonic())
                row.append(int(tok))
                if len(row) >= output_len or (stop_at_eos and tok in self.eos_ids):
                    break
            rows.append(row)
        return rows

    def close(self) -> None:
        self.llm.close()


def _eos_ids(folder, known: tuple[int, ...] | None = None) -> set[int]:
    """The checkpoint's end-of-sequence ids (`known` when the caller has them already)."""
    if known is not None:
        return set(known)
    from augury.models.config import TargetConfig
    from augury.models.tokenizer import eos_ids, load_tokenizer

    return eos_ids(Path(folder), TargetConfig.from_folder(Path(folder)).eos_token_ids, load_tokenizer(Path(folder)))


def _through_first(row: list[int], stops: set[int]) -> list[int]:
    """row up to and including its first token in stops (all of it when there is none)."""
    for i, tok in enumerate(row):
        if tok in stops:
            return row[: i + 1]
    return row


# paragraphs a "copy" prompt asks the model to repeat: standard-library documentation (no download)
_COPY_SOURCES = ("json", "argparse", "logging", "csv", "pathlib", "datetime", "sqlite3", "unittest", "subprocess",
                 "itertools", "functools", "collections", "re", "typing", "dataclasses", "asyncio")
_COPY_ASKS = ("Repeat the following text exactly, word for word:", "Copy this paragraph without changing anything:",
              "Please write out the following text again, exactly as it is:")


def varied_chat_prompts(tokenizer, count: int) -> tuple[list[list[int]], list[str]]:
    """The varied held-out set (prompts.VARIED_PROMPTS, kinds in turn) in the chat template, and
    each prompt's kind."""
    from augury.prompts import varied_prompts

    pairs = varied_prompts(count)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                          add_generation_prompt=True), add_special_tokens=False)
           for _, t in pairs]
    return ids, [k for k, _ in pairs]


def mixed_prompts(tokenizer, count: int) -> list[list[int]]:
    """Half prompts whose answer copies them (repeat a paragraph of standard-library documentation),
    half held-out chat prompts (free text), alternating; each in the tokenizer's chat template."""
    import importlib
    import inspect

    free = iter(chat_prompts(tokenizer, count - count // 2))
    out = []
    for i in range(count):
        if i % 2:
            name = _COPY_SOURCES[(i // 2) % len(_COPY_SOURCES)]
            doc = (inspect.getdoc(importlib.import_module(name)) or name).split("\n\n")[0]
            text = f"{_COPY_ASKS[(i // 2) % len(_COPY_ASKS)]}\n\n{' '.join(doc.split()[:80])}"
            out.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        tokenize=False, add_generation_prompt=True), add_special_tokens=False))
        else:
            out.append(next(free))
    return out


class StepBudgetSystem(AugurySystem):
    """augury's adaptive policy deciding one draft size for the whole batch each step, as before
    per-request budgets (for comparison only: the policy's per-request plan is replaced by its
    batch-level choice, every request drafting that tree unless its own max_draft_tokens says less)."""

    def __init__(self, settings: SystemSettings, name: str = "augury-adaptive-step", **engine_kwargs: Any) -> None:
        super().__init__(settings, name, speculative_algorithm="eagle3", speculative_policy="adaptive",
                         **_head(settings), **engine_kwargs)
        from augury.speculative.policy import StepPlan

        policy = self.llm.engine.speculator.policy

        def one_budget(reqs):
            shape = policy.choose(len(reqs))
            return StepPlan(shape, tuple(r.params.max_draft_tokens if shape else 0 for r in reqs))

        policy.plan = one_budget


def _head(settings: SystemSettings) -> dict[str, Any]:
    """The EAGLE-3 head the benchmark was given, as LLM keyword arguments (none: the model's own)."""
    return {"draft_model": settings.draft_model} if settings.draft_model else {}


def _speculative(name: str, **kwargs: Any) -> Callable[[SystemSettings], System]:
    def make(settings: SystemSettings) -> System:
        return AugurySystem(settings, name, **_head(settings), **kwargs)

    return make


SystemFactory = Callable[[SystemSettings], System]
SYSTEMS: dict[str, SystemFactory] = {
    "transformers": TransformersSystem,
    # prompt lookup decoding in transformers runs one sequence at a time
    "transformers-pld": lambda s: TransformersSystem(s, "transformers-pld", max_batch=1, prompt_lookup_num_tokens=10),
    "augury": lambda s: AugurySystem(s, "augury", speculative_algorithm="none"),
    "augury-off": lambda s: AugurySystem(s, "augury-off", speculative_algorithm="none"),
    # --prompts json: the same without the schemas (what constraining the answers costs: mask overhead)
    "augury-off-unconstrained": lambda s: AugurySystem(s, "augury-off-unconstrained", constrained=False,
                                                       speculative_algorithm="none"),
    "augury-static": _speculative("augury-static", speculative_algorithm="eagle3", speculative_policy="static"),
    "augury-adaptive": _speculative("augury-adaptive", speculative_algorithm="eagle3", speculative_policy="adaptive"),
    "augury-ngram": lambda s: AugurySystem(s, "augury-ngram", speculative_algorithm="ngram", speculative_policy="static"),
    # suffix decoding alone (no head: the request's own text and earlier requests' outputs), adaptive / static
    "augury-suffix": lambda s: AugurySystem(s, "augury-suffix", speculative_algorithm="suffix"),
    "augury-suffix-static": lambda s: AugurySystem(s, "augury-suffix-static", speculative_algorithm="suffix",
                                                   speculative_policy="static"),
    # the default without the cross-request suffix cache (each request's own text only)
    "augury-default-nocache": lambda s: AugurySystem(s, "augury-default-nocache", speculative_suffix_cache_tokens=0,
                                                     **_head(s)),
    # the default LLM(model): speculation as configured by default (the demo: its head, adaptive)
    "augury-default": lambda s: AugurySystem(s, "augury-default", **_head(s)),
    "llama.cpp": LlamaCppSystem,
    # one draft size per step for the whole batch (the adaptive policy before per-request budgets)
    "augury-adaptive-step": StepBudgetSystem,
    # the default with speculation off above 8 running requests (speculative_disable_batch_threshold=8)
    "augury-threshold8": lambda s: AugurySystem(s, "augury-threshold8", speculative_disable_batch_threshold=8,
                                                 **_head(s)),
}


# speculative systems take a tree shape after a colon: augury-static:5-4-12 drafts num_steps=5,
# topk=4, num_draft_tokens=12 (for the adaptive policy, the largest tree it may choose from);
# "+K" after it sets the prompt-lookup branch grafted onto each tree (augury-static:3-4-8+0: none)
SHAPED = ("augury-static", "augury-adaptive")


def system_factory(name: str) -> SystemFactory:
    """The factory for a system name: a registered one, or a speculative one with a tree shape;
    an augury system may end in @MODE to run its weights in that quantisation mode (augury-off@none:
    dense), whatever --quantization says for the others, and in @tpN to run on N tensor-parallel ranks
    (augury-off@tp2; each rank cores / N threads, whatever --threads says)."""
    base_name, at, tp = name.rpartition("@")
    if at and tp.startswith("tp") and tp[2:].isdigit():
        if not base_name.startswith("augury") or int(tp[2:]) < 1:
            raise ValueError(f"system {name!r}: only augury systems take @tpN, N a positive integer")
        inner_tp = system_factory(base_name)

        def with_ranks(settings: SystemSettings) -> System:
            from dataclasses import replace

            system = inner_tp(replace(settings, tensor_parallel_size=int(tp[2:])))
            system.name = name
            return system

        return with_ranks
    base_name, at, mode = name.partition("@")
    if at:
        from augury.config import QUANTIZATIONS

        if not base_name.startswith("augury") or mode not in QUANTIZATIONS:
            raise ValueError(f"system {name!r}: only augury systems take @MODE, MODE one of {', '.join(QUANTIZATIONS)}")
        inner = system_factory(base_name)

        def with_mode(settings: SystemSettings) -> System:
            from dataclasses import replace

            system = inner(replace(settings, quantization=mode))
            system.name = name
            return system

        return with_mode
    if name in SYSTEMS:
        return SYSTEMS[name]
    base, sep, shape = name.partition(":")
    if not sep or base not in SHAPED:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)} "
                         f"(and {', '.join(s + ':STEPS-TOPK-TOKENS[+BRANCH]' for s in SHAPED)})")
    shape, plus, branch = shape.partition("+")
    try:
        steps, topk, tokens = (int(x) for x in shape.split("-"))
        extra = {"speculative_ngram_branch": int(branch)} if plus else {}
    except ValueError:
        raise ValueError(f"system {name!r}: the tree shape after ':' must be STEPS-TOPK-TOKENS, optionally with "
                         f"+BRANCH, e.g. {base}:5-4-12 or {base}:3-4-8+6") from None
    policy = base.rpartition("-")[2]
    return _speculative(name, speculative_algorithm="eagle3", speculative_policy=policy, speculative_num_steps=steps,
                        speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens, **extra)


def register_system(name: str, factory: SystemFactory) -> None:
    """Add a named system (e.g. augury with speculation and a given policy) to the benchmarks."""
    if name in SYSTEMS:
        raise ValueError(f"a benchmark system named {name!r} is already registered")
    SYSTEMS[name] = factory


# ---------------------------------------------------------------- random checkpoints
# ~30M parameters: the layer shape of a small Llama (hidden 512, 8 layers x 3.16M) with an
# 8192-token vocabulary tied to the output (4.19M): 29.5M. A 32000 vocabulary would add
# 12.2M tied or 28.6M untied, dwarfing the layers whose per-layer overhead we measure.
RANDOM_LLAMA: dict[str, Any] = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
    intermediate_size=1376, vocab_size=8192, tie_word_embeddings=True, max_position_embeddings=2048,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def random_llama(out_dir: str | Path, overrides: dict[str, Any] | None = None, seed: int = 0) -> tuple[Path, int]:
    """Write a random-weight Llama checkpoint (float32) unless an identical one is there.

    Returns (folder, parameter count).
    """
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = {**RANDOM_LLAMA, **(overrides or {})}
    out = Path(out_dir)
    stamp = out / "augury-random.json"
    wanted = {"config": spec, "seed": seed}
    if stamp.is_file() and json.loads(stamp.read_text()).get("spec") == wanted:
        return out, int(json.loads(stamp.read_text())["params"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**spec)).float()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(out))
    stamp.write_text(json.dumps({"spec": wanted, "params": params}))
    return out, params


def count_parameters(folder: str | Path) -> int:
    """Parameters stored in a checkpoint folder's safetensors files."""
    from safetensors import safe_open

    total = 0
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                total += _numel(f.get_slice(name).get_shape())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """Held-out chat prompts (the 'eval' split of augury's built-in prompt set, which training
    never sees), each wrapped in the tokenizer's chat template."""
    from augury.prompts import held_out_prompts

    texts = held_out_prompts(count)
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)
            for t in texts]


def make_prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random ordinary token ids (the low ids, often special tokens, are skipped)."""
    rng = random.Random(seed * 1000 + batch_size)
    low = min(16, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(prompt_len)] for _ in range(batch_size)]


def int_list(text: str) -> tuple[int, ...]:
    """argparse type of a comma-separated list of positive integers (--batch-sizes 1,8)."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
