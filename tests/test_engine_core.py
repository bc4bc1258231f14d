"""Engine behaviour on tiny random checkpoints: batching, preemption, chunking, sampling, stops, errors.

Greedy references come from transformers (see test_engine_parity.py for why they are
trustworthy); every LLM made through `make_llm` is checked for leaked KV blocks afterwards.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from augury import SamplingParams
from augury.config import EngineConfig
from conftest import EOS, edit_config, hf_greedy, hf_logits, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def drain(engine, limit: int = 2000) -> dict:
    """Step until nothing is left; the final output of each request, by id."""
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return done
        done.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("the engine did not finish its requests")


# ------------------------------------------------------------------ scheduling
def test_requests_joining_a_running_batch_match_running_alone(tiny_checkpoint, hf_model, make_llm) -> None:
    folder = tiny_checkpoint("llama")
    prompts = random_prompts([9, 4, 14, 6], seed=10)
    engine = make_llm(folder).engine
    ids, done, widths = [], {}, []
    for prompt, wait in zip(prompts, [3, 5, 0, 7]):
        ids.append(engine.add_request(prompt, GREEDY))
        for _ in range(wait):
            done.update({o.request_id: o for o in engine.step() if o.finished})
            widths.append(engine.num_running)
    assert not done, "a request finished before the others joined; the test would not overlap them"
    assert max(widths) >= 3
    done.update(drain(engine))
    for rid, prompt in zip(ids, prompts):
        assert done[rid].token_ids == hf_greedy(hf_model(folder), prompt, 24)


def test_preemption_keeps_greedy_output(tiny_checkpoint, hf_model, make_llm) -> None:
    folder = tiny_checkpoint("qwen3")
    # 26 usable blocks of 4 tokens; four requests of up to 12 + 24 tokens need 8-9 blocks each
    llm = make_llm(folder, block_size=4, num_kv_blocks=27, max_num_seqs=4)
    prompts = random_prompts([5, 12, 8, 10], seed=11)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the tiny cache did not force a preemption"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model(folder), prompt, 24)


def test_preemption_keeps_seeded_samples(tiny_checkpoint, make_llm) -> None:
    folder = tiny_checkpoint("llama")
    prompts = random_prompts([5, 12, 8, 10], seed=11)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True) for s in range(4)]
    roomy = make_llm(folder).generate(prompts, params, use_tqdm=False)
    tight = make_llm(folder, block_size=4, num_kv_blocks=27, max_num_seqs=4)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_chunked_prefill_matches(tiny_checkpoint, hf_model, make_llm) -> None:
    folder = tiny_checkpoint("mistral")
    llm = make_llm(folder, max_num_batched_tokens=8)
    sched = llm.engine.scheduler
    prefill_tokens: list[int] = []
    original = sched.schedule

    def spy():
        batch = original()
        if batch is not None and batch.prefill:
            prefill_tokens.append(sum(e - r.num_computed for r, e in zip(batch.requests, batch.ends)))
        return batch

    sched.schedule = spy
    prompts = random_prompts([20, 13, 5], seed=12)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert prefill_tokens and max(prefill_tokens) <= 8
    assert sum(prefill_tokens) >= sum(map(len, prompts)), "some prompt was never prefilled"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model(folder), prompt, 24)


def test_prefill_batch_padding_past_the_context(tiny_checkpoint, hf_model, make_llm) -> None:
    """A prompt's last chunk (9 tokens at position 150) shares a prefill step with a whole 75-token prompt:
    the short row's padding would run to position 224, past the 223 the engine computes for
    max_model_len 160; padding is never computed there and every answer stays right."""
    folder = tiny_checkpoint("llama")
    llm = make_llm(folder, max_model_len=160, max_num_batched_tokens=150)
    sched = llm.engine.scheduler
    rows: list[list[tuple[int, int]]] = []
    original = sched.schedule

    def spy():
        batch = original()
        if batch is not None and batch.prefill:
            rows.append([(r.num_computed, e - r.num_computed) for r, e in zip(batch.requests, batch.ends)])
        return batch

    sched.schedule = spy
    prompts = random_prompts([159, 75], seed=31)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert any(max(n for _, n in b) + max(c for c, _ in b) - 1 > llm.engine.max_position for b in rows), rows
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model(folder), prompt, len(out.token_ids))


def test_abort_returns_blocks(tiny_checkpoint, make_llm) -> None:
    engine = make_llm(tiny_checkpoint("llama")).engine
    rids = [engine.add_request(p, GREEDY) for p in random_prompts([30, 8], seed=13)]
    engine.step(), engine.step()
    assert engine.allocator.num_free < engine.allocator.num_usable
    for rid in rids:
        engine.abort_request(rid)
    assert engine.allocator.num_free == engine.allocator.num_usable
    assert not engine.has_unfinished_requests()


# ------------------------------------------------------------------ sampling
def test_seeded_sampling_reproduces_in_any_batch(tiny_checkpoint, make_llm) -> None:
    llm = make_llm(tiny_checkpoint("qwen2"))
    prompt = random_prompts([6], seed=14)[0]
    p = SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], p, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True) for s in (1, 2)]
    mixed = llm.generate([random_prompts([11], 15)[0], prompt, random_prompts([3], 16)[0]],
                         [others[0], p, others[1]], use_tqdm=False)
    assert mixed[1].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, seed=8, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].token_ids != alone


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4)],
                         ids=["top_k=1", "tiny top_p", "tiny temperature"])
def test_degenerate_sampling_equals_greedy(params, tiny_checkpoint, make_llm) -> None:
    llm = make_llm(tiny_checkpoint("llama3"))
    prompts = random_prompts([5, 9], seed=17)
    greedy = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    kw = dict(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True) | params
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)] == greedy


def _allowed(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float) -> set[int]:
    """Tokens top-k/top-p may ever keep (a hair of slack at the top-p edge)."""
    scaled = logits / temperature
    order = scaled.argsort(descending=True)
    keep = order[:top_k] if top_k else order
    probs = torch.softmax(scaled[keep], dim=-1)
    cum = probs.cumsum(0)
    n = int((cum < top_p + 1e-4).sum()) + 1
    return set(keep[:n].tolist())


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (None, 0.5), (8, 0.6)])
def test_sampled_tokens_stay_inside_top_k_top_p(top_k, top_p, tiny_checkpoint, hf_model, make_llm) -> None:
    folder = tiny_checkpoint("llama")
    llm = make_llm(folder)
    prompt = random_prompts([7], seed=18)[0]
    params = [SamplingParams(temperature=1.5, top_k=top_k, top_p=top_p, seed=s, max_tokens=12, ignore_eos=True)
              for s in range(6)]
    outs = llm.generate([prompt] * 6, params, use_tqdm=False)
    seen: set[int] = set()
    for out in outs:
        logits = hf_logits(hf_model(folder), prompt + out.token_ids)[len(prompt) - 1 : -1]  # [12, V]
        for i, tok in enumerate(out.token_ids):
            assert tok in _allowed(logits[i], 1.5, top_k, top_p), f"step {i}: token {tok} outside the filter"
        seen.update(out.token_ids)
    assert len(seen) > 12, "samples barely vary; the filter check would prove little"


def test_temperature_shapes_the_distribution(tiny_checkpoint, hf_model, make_llm) -> None:
    """First-token frequencies over many seeds follow softmax(logits / T) (4-sigma bands)."""
    folder = tiny_checkpoint("llama")
    llm = make_llm(folder)
    prompt = random_prompts([4], seed=19)[0]
    logits = hf_logits(hf_model(folder), prompt)[-1]
    n = 400
    tops = []
    for temp in (0.5, 2.0):
        probs = torch.softmax(logits / temp, dim=-1)
        outs = llm.generate([prompt] * n, [SamplingParams(temperature=temp, seed=s, max_tokens=1) for s in range(n)],
                            use_tqdm=False)
        counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=logits.numel())
        for tok in probs.topk(3).indices.tolist():
            p = float(probs[tok])
            sigma = math.sqrt(p * (1 - p) / n)
            assert abs(counts[tok] / n - p) < 4 * sigma + 0.01, f"T={temp} token {tok}: {counts[tok] / n:.3f} vs {p:.3f}"
        tops.append(float(probs.max()))
    assert tops[0] - tops[1] > 0.1, "the two temperatures are not far enough apart to tell apart"


# ------------------------------------------------------------------ stopping
def test_stop_token_ids_and_max_tokens(tiny_checkpoint, make_llm) -> None:
    llm = make_llm(tiny_checkpoint("llama"))
    prompt = random_prompts([8], seed=20)[0]
    full = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    tok = full.token_ids[6]
    first = full.token_ids.index(tok)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tok]), use_tqdm=False)[0]
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"
    for n in (1, 5):
        short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
        assert short.token_ids == full.token_ids[:n] and short.finish_reason == "length"


def test_eos_from_the_checkpoint_stops_unless_ignored(tiny_checkpoint, tmp_path, make_llm) -> None:
    src = tiny_checkpoint("llama")
    prompt = random_prompts([8], seed=20)[0]
    full = make_llm(src).generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    eos = full[4]
    assert eos != EOS and EOS not in full[: full.index(eos) + 1]
    folder = shutil.copytree(src, tmp_path / "eos")
    edit_config(folder, lambda cfg: cfg.update(eos_token_id=eos))
    gen = folder / "generation_config.json"
    gen.write_text(json.dumps(json.loads(gen.read_text()) | {"eos_token_id": eos}))
    llm = make_llm(folder)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert out.token_ids == full[: full.index(eos) + 1] and out.finish_reason == "stop"
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == full


def test_stop_strings(tiny_checkpoint, make_llm) -> None:
    llm = make_llm(tiny_checkpoint("llama", tokenizer=True))
    prompt = "hello world ba be"
    full = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert full.text == llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    words = full.text.split(" ")
    early, late = words[5], " ".join(words[9:11])  # the second spans two tokens
    for stops in ([early], [late], [late, early]):
        cut = min(full.text.find(s) for s in stops)
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=stops), use_tqdm=False)[0]
        assert out.finish_reason == "stop", stops
        assert out.text == full.text[:cut], stops
        assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24


# ------------------------------------------------------------------ errors and edges
def test_prompt_longer_than_max_model_len(tiny_checkpoint, make_llm) -> None:
    llm = make_llm(tiny_checkpoint("llama"), max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(random_prompts([32], seed=21), GREEDY, use_tqdm=False)
    out = llm.generate(random_prompts([31], seed=21), GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(bogus=1), "unknown argument.*bogus"),
    (dict(max_num_seqs=-1), "max_num_seqs must be a positive integer"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(block_size=True), "block_size"),
    (dict(kv_cache_memory_gb=-2.0), "kv_cache_memory_gb"),
    (dict(dtype="fp8"), "dtype must be one of.*float32"),
    (dict(speculative_algorithm="medusa"), "speculative_algorithm must be one of"),
    (dict(speculative_num_steps=3), "give all of speculative_num_steps"),
    (dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=8), "exceeds"),
    (dict(speculative_policy="greedy"), "speculative_policy"),
])
def test_bad_engine_arguments(kwargs, pattern, tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match=pattern):
        EngineConfig.create(**kwargs)
    from augury import LLM

    with pytest.raises(ValueError, match=pattern):  # refused before anything loads
        LLM(str(tiny_checkpoint("llama")), **kwargs)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-3), "top_k"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed="x"), "seed"),
])
def test_bad_sampling_params(kwargs, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_bad_prompts(tiny_checkpoint, make_llm) -> None:
    llm = make_llm(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        llm.generate([[5, 256]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)


def test_chat_applies_the_template(tiny_checkpoint, make_llm) -> None:
    llm = make_llm(tiny_checkpoint("qwen3", tokenizer=True))
    tok = llm.tokenizer
    convs = [[{"role": "user", "content": "hello world"}],
             [{"role": "system", "content": "ba be"}, {"role": "user", "content": "Hello"}]]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    start, assistant = tok.convert_tokens_to_ids(["<|im_start|>", "assistant"])
    for conv, out in zip(convs, outs):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids[0] == start and out.prompt_token_ids[-2:] == [start, assistant]
        assert out.token_ids == llm.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)[0].token_ids


def test_folder_without_tokenizer(tiny_checkpoint, make_llm) -> None:
    llm = make_llm(tiny_checkpoint("qwen2"))
    assert llm.tokenizer is None
    out = llm.generate([5, 6, 7], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 24 and out.text == ""
    with pytest.raises(ValueError, match="no tokenizer.*token ids"):
        llm.generate("hello world", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)


def test_sampler_draw_follows_the_distribution() -> None:
    """The inverse-CDF draw both the plain sampler and verification use: frequencies within 5 sigma
    of the probabilities over 40000 uniforms, never a zero-probability token, a function of the row
    and its uniform alone (the same token whatever shares the call), and a uniform rounding up to
    the total takes the last token with mass."""
    from augury.sampling import draw_rows

    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.125, 0.125, 0.0])
    n = 40000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).tolist()
    draws = draw_rows(probs.expand(n, -1), u)
    counts = torch.bincount(torch.tensor(draws), minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    sigma = (n * probs.double() * (1 - probs.double())).sqrt()
    assert ((counts - n * probs.double()).abs() <= 5 * sigma + 1e-9).all(), counts
    assert [draw_rows(probs[None], [x])[0] for x in u[:50]] == draws[:50]
    assert draw_rows(torch.tensor([[0.0, 0.0, 1.0]]), [0.3]) == [2]
    assert draw_rows(torch.tensor([[0.2, 0.8, 0.0]]), [1.0]) == [1]
