"""Prefix caching: shared, reference-counted KV blocks keyed by their token prefix.

Greedy output must be the same with and without the cache (plain and speculative, prefixes
ending mid-block), a hit must be taken where one exists, speculation must never write a
shared block, an EAGLE-3 head must read the head KV a hit was offered (else zeros), and eviction,
preemption, aborts and many sharers must neither leak blocks nor serve a stale one.
"""
from __future__ import annotations

import argparse

import pytest
import torch

from augury import LLM, SamplingParams
from augury.config import EngineConfig, add_flags
from augury.core.kv_cache import BlockAllocator, block_key
from conftest import assert_no_leaks
from speculative_helpers import checkpoints

BS = 16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("prefix"))


def _greedy(n: int, max_tokens: int = 12) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for _ in range(n)]


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _shared(prefix_len: int, suffix_lens: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts that share their first prefix_len tokens and then differ."""
    prefix = _tokens(prefix_len, seed)
    return [prefix + _tokens(s, seed + 100 + i) for i, s in enumerate(suffix_lens)]


def _llm(folder, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("log_stats_interval", 0)
    return LLM(str(folder), **kw)


def _one_by_one(llm: LLM, prompts, params):
    """Each request alone, in order: every later one can hit what the earlier ones left."""
    return [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]


# ------------------------------------------------------------------ the allocator


def test_allocator_caches_takes_and_evicts_least_recently_used():
    a = BlockAllocator(6, 4, enable_caching=True)
    blocks = a.allocate(3)
    keys, parent = [], None
    for i, b in enumerate(blocks):
        parent = block_key(parent, [i] * 4)
        keys.append(parent)
        a.register(b, parent, [i] * 4)
    assert a.num_cached == 3 and a.num_free == 2
    a.free(blocks)  # idle but cached: still counted free, still found
    assert a.num_free == a.num_usable
    assert [a.lookup(k, [i] * 4) for i, k in enumerate(keys)] == blocks
    assert a.lookup(keys[0], [9] * 4) is None  # a key whose tokens differ is never served
    a.take(blocks[0])
    assert a.num_free == 4
    # two free blocks go first, then idle cached ones, the tail of the released table first
    got = a.allocate(3)
    assert set(got[:2]).isdisjoint(blocks) and got[2] == blocks[2]
    assert a.lookup(keys[2], [2] * 4) is None and a.num_evicted == 1
    assert a.lookup(keys[1], [1] * 4) == blocks[1]
    a.register(got[0], keys[1], [1] * 4)  # a key already cached keeps its block
    assert a.lookup(keys[1], [1] * 4) == blocks[1]
    a.free(got)
    a.free([blocks[0]])
    with pytest.raises(RuntimeError, match="freed more often"):
        a.free([blocks[0]])
    a.reset_cache()
    assert a.num_cached == 0 and a.num_free == a.num_usable and a.lookup(keys[1], [1] * 4) is None


def test_block_key_chains_the_whole_prefix():
    a, b = block_key(None, [1, 2]), block_key(None, [1, 3])
    assert a != b and block_key(a, [5, 6]) != block_key(b, [5, 6]) and block_key(a, [5, 6]) == block_key(a, [5, 6])


# ------------------------------------------------------------------ the engine, plain decoding


@pytest.mark.parametrize("prefix_len", [5, 16, 37, 64, 100])
def test_plain_greedy_same_with_and_without_cache(ckpts, prefix_len):
    prompts = _shared(prefix_len, [1, 9, 16, 30, 2], seed=prefix_len)
    params = _greedy(len(prompts))
    ref = _llm(ckpts["target"], speculative_algorithm="none", enable_prefix_caching=False)
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = _llm(ckpts["target"], speculative_algorithm="none")
    outs = _one_by_one(llm, prompts, params)
    assert [o.token_ids for o in outs] == want
    # the first computes everything; each later one is served the shared prefix's full blocks
    assert outs[0].num_cached_tokens == 0
    for p, o in zip(prompts[1:], outs[1:]):
        assert o.num_cached_tokens == min(prefix_len // BS * BS, (len(p) - 1) // BS * BS)
    # concurrently too (the cache now also holds every earlier prompt's blocks)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert_no_leaks(llm.engine)
    assert all(o.num_cached_tokens == 0 for o in ref.generate(prompts, params, use_tqdm=False))


def test_a_whole_repeated_prompt_computes_its_last_token(ckpts):
    """A prompt entirely in the cache still computes one token (its logits give the next)."""
    prompt = _tokens(48, seed=7)  # exactly three blocks
    ref = _llm(ckpts["target"], speculative_algorithm="none", enable_prefix_caching=False)
    llm = _llm(ckpts["target"], speculative_algorithm="none")
    want = ref.generate([prompt], _greedy(1), use_tqdm=False)[0].token_ids
    first, second = (llm.generate([prompt], _greedy(1), use_tqdm=False)[0] for _ in range(2))
    assert first.token_ids == second.token_ids == want
    assert second.num_cached_tokens == 32
    # the generated tokens' blocks were cached too: the prompt plus its answer hits past the prompt
    third = llm.generate([prompt + want], _greedy(1), use_tqdm=False)[0]
    assert third.num_cached_tokens == 48
    assert third.token_ids == ref.generate([prompt + want], _greedy(1), use_tqdm=False)[0].token_ids


def test_prompt_logprobs_compute_the_whole_prompt(ckpts):
    prompts = _shared(64, [3, 5])
    sp = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, logprobs=1)
    ref = _llm(ckpts["target"], speculative_algorithm="none", enable_prefix_caching=False)
    want = ref.generate(prompts, [sp, sp], use_tqdm=False)
    llm = _llm(ckpts["target"], speculative_algorithm="none")
    outs = _one_by_one(llm, prompts, [sp, sp])
    assert outs[1].num_cached_tokens == 0
    for o, w in zip(outs, want):
        assert o.token_ids == w.token_ids
        for a, b in zip(o.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


# ------------------------------------------------------------------ speculation


@pytest.mark.parametrize("algo", ["eagle3", "ngram"])
def test_speculative_greedy_and_acceptance_same_with_and_without_cache(ckpts, algo):
    target, head = (ckpts["bigram"], ckpts["bigram_head"]) if algo == "eagle3" else (ckpts["target"], None)
    kw = dict(speculative_algorithm=algo, speculative_policy="static")
    if head is not None:
        kw.update(draft_model=str(head), speculative_ngram_branch=0)
    prompts = _shared(250, [3, 20, 41, 7], seed=3)  # one ends mid-block
    params = _greedy(len(prompts), max_tokens=24)
    plain = _llm(target, speculative_algorithm="none", enable_prefix_caching=False)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    off = _one_by_one(_llm(target, enable_prefix_caching=False, **kw), prompts, params)
    llm = _llm(target, **kw)
    on = _one_by_one(llm, prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off] == want
    for p, o in zip(prompts[1:], on[1:]):  # a hit stops short of the last token only, head or not
        assert o.num_cached_tokens == min(250 // BS * BS, (len(p) - 1) // BS * BS) > 0
    assert all(o.spec_stats.num_verify_steps > 0 for o in on)
    if algo == "ngram":  # drafts from the tokens alone: the same trees, the same acceptance
        assert [o.spec_stats for o in on] == [o.spec_stats for o in off]
    assert_no_leaks(llm.engine)


def _recording(llm: LLM) -> list[list[list[int]]]:
    """Record the draft trees (token ids per request) the proposer makes from now on."""
    proposer, seen = llm.engine.speculator.proposer, []
    propose = proposer.propose

    def wrapped(host, reqs, shape):
        tree = propose(host, reqs, shape)
        seen.append(tree.tokens.tolist())
        return tree

    proposer.propose = wrapped
    return seen


def _head_reads(llm: LLM, upto: int) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    """From now on, per request id at each drafting step: the head table over the request's cache hit
    and the head keys it reads at positions 0..upto-1 once caught up."""
    proposer, seen = llm.engine.speculator.proposer, {}
    propose = proposer.propose

    def wrapped(host, reqs, shape):
        tree = propose(host, reqs, shape)
        for r in reqs:
            table = proposer.head_table(r)
            slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(upto)])
            seen.setdefault(r.request_id, []).append((table[: r.num_cached_blocks], proposer.cache.k[0, slots].clone()))
        return tree

    proposer.propose = wrapped
    return seen


def test_eagle3_head_reads_the_head_kv_a_cache_hit_was_offered(ckpts):
    """A second turn hits the first turn's blocks, whose head KV the first request's head wrote and
    offered under their prefix: the hit request reads it there rather than zeros, and it is the
    head KV the request computes itself without the cache (the conversation fits the catch-up
    window, so without the cache its head covers every position)."""
    kw = dict(draft_model=str(ckpts["head"]), speculative_algorithm="eagle3", speculative_policy="static",
              speculative_ngram_branch=0)
    first = _tokens(40, seed=11)
    runs = {}
    for caching in (False, True):
        llm = _llm(ckpts["target"], enable_prefix_caching=caching, **kw)
        turn1 = llm.generate([first], _greedy(1, 60), use_tqdm=False)[0]
        # diverges past the hit (the head KV of a block's last position reads the token after it)
        second = first + turn1.token_ids[:44] + _tokens(12, seed=12)
        reads = _head_reads(llm, 80)
        turn2 = llm.generate([second], _greedy(1, 20), use_tqdm=False)[0]
        runs[caching] = (turn1.token_ids, turn2, next(iter(reads.values())))
        assert_no_leaks(llm.engine)
    (t1_off, off, reads_off), (t1_on, on, reads_on) = runs[False], runs[True]
    assert t1_on == t1_off and on.token_ids == off.token_ids
    assert on.num_cached_tokens == 80 and off.num_cached_tokens == 0
    zero = llm.engine.speculator.proposer.zero_block
    assert reads_on and all(len(t) == 5 and zero not in t for t, _ in reads_on)
    k_off, k_on = reads_off[0][1], reads_on[0][1]
    assert k_on.abs().amin(dim=(1, 2)).gt(0).all()  # real keys at every position, not zeros
    torch.testing.assert_close(k_on, k_off, rtol=1e-4, atol=1e-4)


def test_eagle3_hit_on_blocks_no_head_covered_reads_zeros(ckpts):
    """Blocks whose first request never drafted (max_draft_tokens=0: its head never caught up) hold no
    head KV: a request that hits them reads the zero block there, and its output stays exact."""
    kw = dict(draft_model=str(ckpts["head"]), speculative_algorithm="eagle3", speculative_policy="static")
    prompts = _shared(70, [9, 13], seed=21)
    want = [o.token_ids for o in _llm(ckpts["target"], speculative_algorithm="none",
                                      enable_prefix_caching=False).generate(prompts, _greedy(2, 16), use_tqdm=False)]
    llm = _llm(ckpts["target"], **kw)
    quiet = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, max_draft_tokens=0)
    first = llm.generate([prompts[0]], quiet, use_tqdm=False)[0]
    assert first.spec_stats.num_verify_steps == 0 and not llm.engine.speculator.proposer.offered
    reads = _head_reads(llm, 64)
    second = llm.generate([prompts[1]], _greedy(1, 16), use_tqdm=False)[0]
    assert [first.token_ids, second.token_ids] == want
    assert second.num_cached_tokens == 64 and second.spec_stats.num_verify_steps > 0
    zero = llm.engine.speculator.proposer.zero_block
    assert all(t == [zero] * 4 and not k.any() for t, k in next(iter(reads.values())))
    assert_no_leaks(llm.engine)


def test_eagle3_offers_follow_a_block_to_its_new_tokens(ckpts):
    """The head KV of a block is offered under the prefix (and next token) whose head KV it holds:
    evicted and handed to a request with other tokens, the block's offer is withdrawn before that
    request's head writes it, and once covered it is offered under the new prefix."""
    kw = dict(draft_model=str(ckpts["head"]), speculative_algorithm="eagle3", speculative_policy="static")
    llm = _llm(ckpts["target"], num_kv_blocks=24, **kw)
    eng, proposer = llm.engine, llm.engine.speculator.proposer
    reoffered = 0
    for seed in range(4):  # each prompt evicts the last one's blocks
        before = dict(proposer.offered)
        rid = eng.add_request(_tokens(150, seed=40 + seed), _greedy(1, 40)[0])
        while eng.has_unfinished_requests():
            eng.step()
            for r in eng.scheduler.running:
                covered = r.draft_len // BS
                keys, ids = r.prefix_keys(covered, BS), r.all_token_ids
                assert r.draft_blocks_offered == covered
                for i in range(r.num_cached_blocks, covered):
                    b = r.block_table[i]
                    assert proposer.offered[b] == (keys[i], ids[(i + 1) * BS])
                    reoffered += before.get(b, proposer.offered[b]) != proposer.offered[b]
        assert eng.stats.num_verify_steps > 0 and rid not in eng.requests
    assert reoffered > 0 and eng.allocator.num_evicted > 0
    assert_no_leaks(eng)


def test_speculation_never_writes_a_shared_block(ckpts):
    llm = _llm(ckpts["bigram"], draft_model=str(ckpts["bigram_head"]), speculative_algorithm="eagle3",
               speculative_policy="static")
    eng = llm.engine
    prompts = _shared(260, [4, 9, 30], seed=5)
    llm.generate([prompts[0]], _greedy(1, 8), use_tqdm=False)  # leaves the prefix in the cache
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts[1:], _greedy(2, 40))]
    eng.step()  # admits both with their hits
    shared = sorted({b for rid in ids for b in eng.requests[rid].block_table[: eng.requests[rid].num_cached_blocks]})
    assert shared
    slots = torch.tensor([b * BS + i for b in shared for i in range(BS)])
    before = (eng.kv.k[:, slots].clone(), eng.kv.v[:, slots].clone())
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats.num_verify_steps > 0
    assert torch.equal(eng.kv.k[:, slots], before[0]) and torch.equal(eng.kv.v[:, slots], before[1])
    assert_no_leaks(eng)


# ------------------------------------------------------------------ under pressure


def test_eviction_while_requests_run_serves_nothing_stale(ckpts):
    """A cache too small for every prefix: idle cached blocks are evicted and reused for other
    tokens while requests run; later requests for evicted prefixes recompute them."""
    groups = [_shared(70, [5, 12, 20], seed=s) for s in range(6)]
    prompts = [p for g in groups for p in g]
    params = _greedy(len(prompts), max_tokens=10)
    ref = _llm(ckpts["target"], speculative_algorithm="none", enable_prefix_caching=False)
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = _llm(ckpts["target"], speculative_algorithm="none", num_kv_blocks=40, max_num_seqs=4)
    for _ in range(2):  # the second round finds some prefixes cached and some evicted
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        assert_no_leaks(llm.engine)
    assert llm.engine.allocator.num_evicted > 0
    assert any(o.num_cached_tokens > 0 for o in outs)


def test_preempting_a_request_that_holds_shared_blocks(ckpts):
    prompts = _shared(60, [4, 8, 12, 16, 3, 7], seed=21)
    params = _greedy(len(prompts), max_tokens=48)
    ref = _llm(ckpts["target"], speculative_algorithm="none", enable_prefix_caching=False)
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = _llm(ckpts["target"], speculative_algorithm="none", num_kv_blocks=24)
    llm.generate([prompts[0]], [params[0]], use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in outs)
    assert [o.token_ids for o in outs] == want
    assert_no_leaks(llm.engine)


def test_request_aborted_mid_prefill_leaves_valid_blocks(ckpts):
    prompt = _tokens(200, seed=31)
    ref = _llm(ckpts["target"], speculative_algorithm="none", enable_prefix_caching=False)
    want = ref.generate([prompt], _greedy(1), use_tqdm=False)[0].token_ids
    llm = _llm(ckpts["target"], speculative_algorithm="none", max_num_batched_tokens=64)
    eng = llm.engine
    rid = eng.add_request(prompt, _greedy(1)[0])
    eng.step()
    eng.step()  # two 64-token chunks of the prompt are in the cache
    eng.abort_request(rid)
    assert_no_leaks(eng)
    out = llm.generate([prompt], _greedy(1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 128 and out.token_ids == want
    assert_no_leaks(eng)


def test_reset_prefix_cache_mid_generation_registers_the_running_blocks_again(ckpts):
    """reset_prefix_cache() while a request runs forgets every key; the request's committed blocks
    are offered again (it used to keep its registered count, so they never were), and a later
    request with the same prefix hits them."""
    prompt = _tokens(40, seed=41)  # two full blocks and 8 tokens
    ref = _llm(ckpts["target"], speculative_algorithm="none", enable_prefix_caching=False)
    want = ref.generate([prompt], _greedy(1, max_tokens=20), use_tqdm=False)[0].token_ids
    llm = _llm(ckpts["target"], speculative_algorithm="none")
    eng = llm.engine
    rid = eng.add_request(prompt, _greedy(1, max_tokens=20)[0])
    for _ in range(3):  # prefill, then decode steps: the two full prompt blocks are registered
        eng.step()
    req = eng.requests[rid]
    assert eng.allocator.num_cached == 2 and req.num_registered == 2
    eng.reset_prefix_cache()
    assert eng.allocator.num_cached == 0 and req.num_registered == 0
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out = o
    assert out.token_ids == want
    assert eng.allocator.num_cached == (40 + 20 - 1) // BS  # every full committed block, the prompt's too
    again = llm.generate([prompt], _greedy(1, max_tokens=20), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == want
    assert_no_leaks(eng)


def test_many_requests_share_one_prefix_at_once(ckpts):
    prompts = _shared(90, [1 + 3 * i for i in range(12)], seed=41)
    params = _greedy(len(prompts), max_tokens=16)
    ref = _llm(ckpts["target"], speculative_algorithm="none", enable_prefix_caching=False)
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = _llm(ckpts["target"], speculative_algorithm="ngram", max_num_seqs=8)
    for wave in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        assert_no_leaks(llm.engine)
    # the second wave finds each whole prompt cached (the first left them), bar the last token
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // BS * BS for p in prompts]
    sched = llm.engine.scheduler
    assert 0 < sched.prefix_hits <= sched.prefix_queries


# ------------------------------------------------------------------ configuration


def test_prefix_caching_flag_and_validation():
    p = argparse.ArgumentParser()
    add_flags(p)
    assert p.parse_args([]).enable_prefix_caching is None
    assert p.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert p.parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True
    assert EngineConfig.create().enable_prefix_caching is True
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        EngineConfig.create(enable_prefix_caching="yes")


# ------------------------------------------------------------------ the benchmark workloads


@pytest.mark.parametrize("workload,extra", [("document", ["--doc-tokens", "150", "--questions", "2"]),
                                            ("multi-turn", ["--turns", "3"])])
def test_bench_prefix_workloads(tiny_checkpoint, tmp_path, workload, extra, capsys):
    import json

    from augury.cli import main

    folder = tiny_checkpoint("llama", tokenizer=True)
    code = main(["bench", "--workload", workload, "--model", str(folder), "--repeats", "2", "--output-len", "4",
                 "--out", str(tmp_path), "--no-progress", *extra])
    assert code == 0
    printed = capsys.readouterr().out
    assert "paired speed-up median" in printed and "greedy answers equal: 3/3" in printed
    sm = json.loads((tmp_path / "prefix.json").read_text())["summary"]
    assert sm["cached_tokens"]["no-cache"] == [0, 0, 0]
    cached = sm["cached_tokens"]["cache"]
    assert cached[0] == 0 and all(c > 0 and c % BS == 0 for c in cached[1:])
    assert len(sm["paired_speedup"]) == 2 and sm["same_answers"] == 3


def test_bench_prefix_workload_needs_a_chat_model(tmp_path, capsys):
    from augury.cli import main

    assert main(["bench", "--workload", "document", "--out", str(tmp_path)]) == 2
    assert "need a model with a chat template" in capsys.readouterr().err


def test_bench_throughput_repeats_compute_their_prompts(ckpts):
    """A throughput repeat must not find the previous repeat's prompts in the prefix cache: an engine
    with a head reuses less of a short prompt than one without, so the systems would do different work."""
    from augury.bench import AugurySystem, SystemSettings

    system = AugurySystem(SystemSettings(str(ckpts["target"]), "float32", "cpu", 2, 120), "augury",
                          speculative_algorithm="none")
    prompts = [_tokens(60, seed=1), _tokens(70, seed=2)]
    first = system.generate(prompts, 5)
    assert system.generate(prompts, 5) == first
    assert system.llm.engine.scheduler.prefix_hits == 0
    system.close()



@pytest.mark.parametrize("caching", [False, True])
def test_written_blocks_count_every_block_ever_handed_out_and_no_other(caching: bool) -> None:
    """num_written is what the lazily taken cache memory follows (the stress harness's RSS besides the cache):
    every block ever handed out, and without caching no more than the most ever held at once."""
    import random

    rng = random.Random(0)
    alloc = BlockAllocator(64, 4, enable_caching=caching)
    ever, held, peak = set(), [], 0
    for step in range(400):
        if held and rng.random() < 0.5:
            alloc.free(held.pop(rng.randrange(len(held))))
        elif alloc.num_free and sum(map(len, held)) < 20:
            blocks = alloc.allocate(rng.randint(1, min(5, alloc.num_free)))
            if caching and step % 3 == 0:  # some stay cached (idle after their free, evicted later)
                alloc.register(blocks[0], f"k{step}".encode(), [step])
            ever.update(blocks)
            held.append(blocks)
        peak = max(peak, sum(map(len, held)))
        assert alloc.num_written == max(ever, default=0) == len(ever)  # blocks 1..num_written, each written
    if not caching:  # freed blocks went out again before fresh ones
        assert alloc.num_written == peak < 63


def test_bench_warm_history_leaves_the_heads_kv_over_the_history(ckpts):
    """`augury bench --history warm`: AugurySystem.prepare answers the history past its first decode
    step, so the head catches up and offers the history's full blocks, as a live session's earlier
    answer leaves them; the timed request then reads them (no zero block) and answers exactly."""
    from augury.bench import AugurySystem, SystemSettings

    prompt = _shared(90, [12], seed=6)[0]
    history = prompt[:85]
    settings = SystemSettings(str(ckpts["target"]), "float32", "cpu", 1, 160, threads=1,
                              histories=((tuple(prompt), tuple(history)),))
    system = AugurySystem(settings, "augury-static", speculative_algorithm="eagle3", speculative_policy="static",
                          draft_model=str(ckpts["head"]))
    proposer, bs = system.llm.engine.speculator.proposer, system.llm.engine.allocator.block_size
    system.prepare([prompt])
    assert len(proposer.offered) >= len(history) // bs
    reads = _head_reads(system.llm, len(history) // bs * bs)
    got = system.generate([prompt], 12)
    want = _llm(ckpts["target"], speculative_algorithm="none", enable_prefix_caching=False).generate(
        [prompt], _greedy(1, 12), use_tqdm=False)[0].token_ids
    assert got == [want]
    table, keys = next(iter(reads.values()))[0]
    assert proposer.zero_block not in table and keys.abs().amin(dim=(1, 2)).gt(0).all()
