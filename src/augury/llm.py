"""The offline Python API (vLLM-like): LLM(...).generate / .chat."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from augury.config import EngineConfig
from augury.builder import build_engine
from augury.outputs import RequestOutput
from augury.resolve import resolve
from augury.sampling_params import OutputKind, SamplingParams


class LLM:
    """Load a model (a Hugging Face folder, a .gguf file, or "demo") and generate with continuous batching.

    Keyword arguments are EngineConfig fields (dtype, device, max_num_seqs, draft_model,
    speculative_algorithm, speculative_num_steps, ...). `model="demo"` is SmolLM2-135M-Instruct
    with the EAGLE-3 head shipped in augury.
    """

    def __init__(self, model: str = "demo", **kwargs: Any) -> None:
        self.config = EngineConfig.create(model=str(model), **kwargs)
        self.resolved = resolve(self.config)  # the demo is fetched, a .gguf file converted, once
        self.engine = build_engine(self.config, self.resolved)

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order, each holding the whole answer
        (SamplingParams.output_kind does not apply here: it shapes Engine.step's outputs)."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.tokenizer.apply_chat_template(list(conv), tokenize=False, add_generation_prompt=True)
            for conv in conversations
        ]
        # the template already holds the special tokens; tokenize without adding more
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(ids, sampling_params, use_tqdm)

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        # only final outputs are kept: the engine builds nothing before a request ends, whatever
        # output_kind the caller gave (each result holds the whole answer)
        final = OutputKind.FINAL_ONLY
        params = [p if p.output_kind is final else dataclasses.replace(p, output_kind=final) for p in params]
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(prompt if isinstance(prompt, str) else list(prompt), p))
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2)
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]
