"""Suffix decoding (speculative/suffix.py): the index finds the longest match and counts how its
occurrences went on, the cross-request cache stays within its bound (least recently used request
out first), drafts are trees best-first by probability, and through the engine speculative greedy
output equals plain greedy output, within a request and across requests (a request repeating an
earlier one's answer is drafted it from the cache), with a grammar and with max_draft_tokens;
seeded sampling equals plain seeded sampling. The bench's workloads are deterministic and varied."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from augury import LLM, SamplingParams
from augury.speculative.suffix import (MIN_PROB, SEPARATOR, SuffixCache, SuffixDrafter, TokenIndex, grow, match_lengths,
                                       request_draft)
from augury.speculative.tree import graft_trees, select_tree, trees_of
from speculative_helpers import checkpoints


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


# ------------------------------------------------------------------------------------------- index
def test_match_lengths_counts_back_to_the_first_difference():
    buf = arr(9, 1, 2, 3, 4, 7, 2, 3, 4, 1, 2, 3, 4)
    query = arr(1, 2, 3, 4)
    ends = np.flatnonzero(buf[:-1] == 4)  # 4 at 4 and 8
    assert match_lengths(buf, ends, query, 24).tolist() == [4, 3]
    assert match_lengths(buf, ends, query, 2).tolist() == [2, 2]  # capped


def _lengths_by_hand(buf, ends, query, most):
    out = []
    for e in ends.tolist():
        n = 0
        while n < min(most, len(query)) and e - n >= 0 and buf[e - n] == query[len(query) - 1 - n]:
            n += 1
        out.append(n)
    return out


def test_match_lengths_equal_a_comparison_token_by_token():
    rng = np.random.default_rng(0)
    for trial in range(300):
        vocab = int(rng.integers(2, 6))  # few tokens: long matches, many occurrences
        buf = rng.integers(0, vocab, size=int(rng.integers(2, 120)))
        if trial % 3 == 0:
            buf[rng.random(len(buf)) < 0.1] = SEPARATOR
        query = rng.integers(0, vocab, size=int(rng.integers(1, 40)))
        if trial % 2:  # a query that is buf's own suffix, as a request's context is
            query = buf[len(buf) - min(len(buf), len(query)):].copy()
            query[query < 0] = 0
        ends = np.flatnonzero(buf == query[-1])
        for most in (1, 2, 5, 24):
            assert match_lengths(buf, ends, query, most).tolist() == _lengths_by_hand(buf, ends, query, most)


def test_request_draft_continues_the_longest_match_by_frequency():
    # "5 6 7" occurred twice, went on "8 9 1" and "8 9 10": 8 and 9 certain, then 1 or 10 at one half each
    toks = arr(5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8, 9, 10, 3, 5, 6, 7)
    d = request_draft(toks, 16)
    assert d.match == 3
    assert d.tokens == [8, 9, 1] and d.parents == [-1, 0, 1] and d.probs == [1.0, 1.0, 0.5]  # 3 nodes: 1 per matched
    # a longer match drafts further; the tree branches where the occurrences did, siblings best first
    toks = arr(1, 2, 3, 4, 5, 6, 20, 21, 1, 2, 3, 4, 5, 6, 20, 22, 1, 2, 3, 4, 5, 6, 20, 21, 9, 1, 2, 3, 4, 5, 6)
    d = request_draft(toks, 16)
    assert d.match == 6
    assert d.tokens[:3] == [20, 21, 22] and d.parents[:3] == [-1, 0, 0]
    assert d.probs[:3] == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert all(p >= MIN_PROB for p in d.probs)
    assert all(d.parents[i] < i for i in range(len(d)))
    assert d.chain()[:2] == [20, 21]
    assert d.score == pytest.approx(sum(d.probs))


def test_the_token_index_drafts_what_a_scan_of_the_array_drafts():
    # a list growing a few tokens at a time, as a request's does, then another list (a new request);
    # with a few more tokens after it for one call, and as it was after that call
    rng = np.random.default_rng(1)
    for vocab, size in ((3, 400), (5, 300), (40, 600), (200, 300)):  # few tokens: pairs past SCAN
        index = TokenIndex()
        for start in (0, 1):  # the second list differs from the first at once: the index starts over
            tokens = rng.integers(0, vocab, size=8).tolist()
            tokens[0] = vocab + start
            while len(tokens) < size:
                tokens += rng.integers(0, vocab, size=int(rng.integers(1, 4))).tolist()
                if rng.random() < 0.3:  # a copy of an earlier span: long matches
                    at = int(rng.integers(0, len(tokens) - 1))
                    tokens += tokens[at:at + int(rng.integers(2, 30))]
                extra = rng.integers(0, vocab, size=int(rng.integers(1, 6))).tolist()  # a chain's drafts so far
                index.draft(tokens, 1)  # up to date with tokens
                held = ({k: list(v) for k, v in index._at.items()}, {k: list(v) for k, v in index._pairs.items()})
                for limit in (1, 4, 16):
                    for more in ((), extra, ()):  # the extra tokens held for one call alone
                        got = index.draft(tokens, limit, extra=more)
                        want = request_draft(np.array(tokens + list(more)), limit)
                        assert (got.tokens, got.parents, got.match) == (want.tokens, want.parents, want.match)
                        assert got.probs == pytest.approx(want.probs)
                assert (index._at, index._pairs) == held  # the extra tokens' positions are gone again


def test_request_draft_without_a_match_is_empty_and_limits_hold():
    assert len(request_draft(arr(1, 2, 3, 4), 8)) == 0
    toks = arr(*range(30), *range(25))
    assert request_draft(toks, 8).tokens == [25, 26, 27, 28, 29, 0, 1, 2]  # a copy, cut at the limit
    assert len(request_draft(toks, 0)) == 0


def test_grow_stops_below_the_probability_threshold():
    buf = arr(*([1, 2] + [7] * 0), 1, 3, 1, 4, 1, 5, 1, 6, 1, 8, 1, 9, 1, 11, 1, 12, 1, 13, 1, 14, 1)
    ends = np.flatnonzero(buf[:-1] == 1)
    d = grow(buf, len(buf), ends, 1, 8, min_prob=0.15)
    assert len(d) == 0  # eleven continuations of "1", none followed it 15% of the time
    d = grow(buf, len(buf), ends, 1, 8, min_prob=0.05)
    assert len(d) == 1  # one node per matched token


def test_cache_drafts_across_requests_and_evicts_least_recently_used():
    cache = SuffixCache(20)
    cache.insert([1, 2, 3, 4, 5, 6])
    cache.insert([9, 3, 4, 5, 7])
    d = cache.draft(arr(0, 3, 4), 8)  # "3 4" went on "5 6" once and "5 7" once
    assert d.tokens == [5, 6] and d.probs == [1.0, 0.5] and d.match == 2
    assert cache.draft(arr(2, 3, 4), 8).tokens == [5, 6]  # the longer match: only the first request
    assert cache.draft(arr(2, 3, 4), 8).probs == [1.0, 1.0]
    cache.insert([40, 41, 42, 43, 44])  # 16 live tokens
    cache.draft(arr(1, 2, 3), 4)  # the first request is used: the second is now the least recently used
    cache.insert([60, 61, 62, 63, 64])  # over 20: the second goes
    assert cache.live_tokens <= 20 and cache.num_requests == 3
    assert cache.draft(arr(9, 3, 4), 8).tokens == [5, 6]  # "9 3 4" is gone with the second request
    assert cache.draft(arr(9, 3, 4), 8).probs == [1.0, 1.0]
    assert len(cache.draft(arr(62, 63), 4)) == 1  # match 2, one certain token per... at most 2 nodes
    for i in range(200):  # many evictions: compaction keeps the bound and the index right
        cache.insert([1000 + i, 2000 + i, 3000 + i])
    assert cache.live_tokens <= 20 and len(cache._buf) <= 4 * 20 + 1024
    assert cache.draft(arr(1199, 2199), 4).tokens == [3199]
    assert len(cache.draft(arr(1000, 2000), 4)) == 0  # evicted long ago
    with pytest.raises(ValueError, match="capacity"):
        SuffixCache(0)


def test_drafter_takes_the_better_scored_of_its_request_and_the_cache():
    drafter = SuffixDrafter(1000)
    drafter.cache.insert([7, 8, 9, 10, 11, 12, 13, 14])
    own = arr(5, 8, 2, 3, 7, 8)  # its own text matches "8" (one token: one node, "2"); the cache "7 8" (two)
    d = drafter.draft(own, 8)
    assert d.tokens == [9, 10] and d.score == 2.0
    assert SuffixDrafter(0).draft(own, 8).tokens == [2]


# ------------------------------------------------------------------------------------------- trees
def test_trees_of_and_graft_trees_share_equal_nodes():
    t = trees_of([5, 6], [([1, 2, 3], [-1, 0, 0]), ([], [])], source=1)
    assert t.sizes == [4, 1] and t.tokens[0].tolist() == [5, 1, 2, 3] and t.parents[0].tolist() == [-1, 0, 1, 1]
    assert t.depth[0].tolist() == [0, 1, 2, 2]
    head = select_tree(torch.tensor([5, 6]), torch.tensor([[1, 4], [1, 4]]), torch.tensor([[-1, 0], [-1, -1]]),
                       torch.tensor([[-0.1, -0.2], [-0.1, -0.3]]), 3)  # row 0: 5 -> 1 -> 4; row 1: 6 -> {1, 4}
    g = graft_trees(head, [([1, 2, 7], [-1, 0, 1]), ([4, 8], [-1, 0])])
    assert g.sizes == [5, 4]
    assert g.tokens[0].tolist() == [5, 1, 4, 2, 7] and g.parents[0].tolist() == [-1, 0, 1, 1, 3]  # 1 shared
    assert g.tokens[1].tolist()[:4] == [6, 1, 4, 8] and g.parents[1].tolist()[:4] == [-1, 0, 0, 2]
    assert g.sources()[0].tolist() == [0, 0, 0, 1, 1]
    assert graft_trees(head, [([1], [-1]), ([], [])]) is head  # nothing new


# ------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("suffix"))


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _loops(llm_plain: LLM, n: int, seed: int) -> list[list[int]]:
    """Prompts that already follow the bigram target's own next-token map (so its continuation repeats
    what they hold), and random ones."""
    g = torch.Generator().manual_seed(seed)
    starts = [torch.randint(3, 256, (2,), generator=g).tolist() for _ in range(n)]
    outs = llm_plain.generate(starts, [_greedy(50)] * n, use_tqdm=False)
    return [s + o.token_ids for s, o in zip(starts, outs)] + [torch.randint(3, 256, (9,), generator=g).tolist()]


@pytest.mark.parametrize("policy", ["static", "adaptive"])
def test_suffix_greedy_equals_plain_within_and_across_requests(ckpts, policy):
    plain = LLM(str(ckpts["target"]), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (4 + 5 * i,), generator=g).tolist() for i in range(5)]
    prompts.append(prompts[1] * 3)  # a prompt that repeats itself
    params = [_greedy(24), _greedy(30), _greedy(12, max_draft_tokens=2), _greedy(20), _greedy(28), _greedy(16)]
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(ckpts["target"]), dtype="float32", speculative_algorithm="suffix", speculative_policy=policy,
              log_stats_interval=0, max_num_seqs=4)
    first = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in first] == want
    # the same prompts again, one at a time: each answer is in the cache (a request leaves it when it
    # finishes), so the static policy's drafts are accepted from it
    again = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in again] == want
    assert llm.engine.speculator.drafter.cache.num_requests >= len(prompts)
    if policy == "static":
        assert all(o.spec_stats.num_lookup_accepted_tokens > 0 for o in again if o.spec_stats.num_draft_tokens)
        assert sum(o.spec_stats.num_lookup_accepted_tokens for o in again) > 2 * sum(
            o.spec_stats.num_lookup_accepted_tokens for o in first)
    for o, sp in zip(again, params):  # a request's own cap holds
        if sp.max_draft_tokens is not None:
            assert o.spec_stats.num_draft_tokens <= sp.max_draft_tokens * o.spec_stats.num_verify_steps
    a = llm.engine.allocator
    assert a.num_free == a.num_usable


def test_hybrid_grafts_suffix_drafts_onto_the_head_and_equals_plain(ckpts):
    """EAGLE-3 with suffix drafts grafted (the default algorithm with a head): greedy output is plain
    greedy output, and on the bigram target, whose answers repeat their prompts, the grafted branch
    is accepted where the random head is not."""
    plain = LLM(str(ckpts["bigram"]), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    prompts = _loops(plain, 3, seed=11)
    params = [_greedy(24 + 4 * i) for i in range(len(prompts))]
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(ckpts["bigram"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_policy="static",
              speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4,
              speculative_ngram_branch=8, log_stats_interval=0, max_num_seqs=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    lookup = sum(o.spec_stats.num_lookup_accepted_tokens for o in outs)
    head = sum(o.spec_stats.num_head_accepted_tokens for o in outs)
    assert lookup > 3 * max(head, 1)


def test_suffix_under_a_grammar_equals_plain(tiny_checkpoint):
    """Suffix drafts pruned by the grammar's mask (and its forced tokens drafted): the answers equal
    plain decoding's under the same grammar, the first time and again with the answers cached."""
    pytest.importorskip("xgrammar")
    from augury.sampling_params import StructuredOutputsParams

    folder = tiny_checkpoint("llama", tokenizer=True)
    plain = LLM(str(folder), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    so = StructuredOutputsParams(regex="(ba|de|ki|mo)[a-z]{4,60}")
    prompts = [[5, 6, 7, 5, 6, 7, 8], [9, 10, 11, 12], [20, 21, 20, 21, 20]]
    params = [SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=so, max_draft_tokens=None if i else 3)
              for i in range(len(prompts))]
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(folder), dtype="float32", speculative_algorithm="suffix", speculative_policy="static",
              log_stats_interval=0)
    for _ in range(2):  # the second time from the cache too
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0


def test_suffix_seeded_sampling_equals_plain(ckpts):
    plain = LLM(str(ckpts["bigram"]), dtype="float32", speculative_algorithm="none", log_stats_interval=0)
    prompts = _loops(plain, 2, seed=3)
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=40 + i, ignore_eos=True) for i in range(len(prompts))]
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(ckpts["bigram"]), dtype="float32", speculative_algorithm="suffix", speculative_policy="static",
              log_stats_interval=0)
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


def test_config_refuses_a_bad_cache_bound():
    from augury.config import EngineConfig

    with pytest.raises(ValueError, match="speculative_suffix_cache_tokens"):
        EngineConfig(model="x", speculative_suffix_cache_tokens=-1).validate()


# ------------------------------------------------------------------------------------------- workloads
@pytest.mark.parametrize("kind", ["code_edit", "agentic", "summarise", "extract"])
def test_workloads_are_deterministic_and_varied(kind):
    from augury.bench.workloads import workload_messages

    a = workload_messages(kind, 6, seed=0)
    assert a == workload_messages(kind, 6, seed=0)
    assert a != workload_messages(kind, 6, seed=1)
    texts = ["\n".join(m["content"] for m in conv) for conv in a]
    assert len(set(texts)) == 6  # every prompt its own
    if kind == "code_edit":  # the prompt holds a 40-80 line module, re-emitted once already
        code = a[0][0]["content"].split("```python\n")[1].split("```")[0]
        assert 40 <= code.count("\n") <= 90
        assert a[0][1]["content"].count("def ") == code.count("def ")
    if kind == "extract":  # one schema across the run's documents
        schemas = {conv[0]["content"].split("Document:")[0] for conv in a}
        assert len(schemas) == 1
    if kind == "agentic":
        calls = [m["content"] for m in a[0] if m["role"] == "assistant"]
        assert len(calls) >= 3 and all(c.startswith('{"name": ') for c in calls)
