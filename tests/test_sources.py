"""Each draft node's source (the EAGLE-3 head, prompt lookup, a grammar's forced tokens) through the
tree functions, and a verified row counted by source (speculative/sources.tally)."""
from __future__ import annotations

import pytest
import torch

from augury.speculative.sources import Source, tally
from augury.speculative.tree import (DraftTree, cap_trees, chain_tree, depth_from_parents, graft_chains,
                                     rebuild_rows, with_root_only_rows)

H, L, F = int(Source.HEAD), int(Source.LOOKUP), int(Source.FORCED)


def _tree(tokens, parents) -> DraftTree:
    p = torch.tensor(parents)
    return DraftTree(tokens=torch.tensor(tokens), parents=p, depth=depth_from_parents(p))


def test_a_tree_without_sources_is_the_heads_and_a_chain_is_its_drafters():
    tree = _tree([[9, 1, 2]], [[-1, 0, 1]])
    assert tree.sources().tolist() == [[H, H, H]]
    assert chain_tree(torch.tensor([9]), torch.tensor([[1, 2]]), Source.LOOKUP).sources()[0, 1:].tolist() == [L, L]
    with pytest.raises(ValueError, match="source"):
        DraftTree(tokens=tree.tokens, parents=tree.parents, depth=tree.depth,
                  source=torch.zeros(1, 2, dtype=torch.int8))


def test_sources_follow_grafting_capping_root_rows_and_rebuilding():
    # row 0: head tree root -> 11 -> 12, root -> 13; a lookup chain 11, 12, 7, 8 follows the tree, then branches
    tree = _tree([[10, 11, 13, 12], [20, 21, 22, 23]], [[-1, 0, 0, 1], [-1, 0, 1, 2]])
    grafted = graft_chains(tree, [[11, 12, 7, 8], []])
    assert grafted.tokens[0].tolist() == [10, 11, 13, 12, 7, 8]
    # the shared nodes stay the head's; the new ones (and row 1's padding copies) are lookup's
    assert grafted.sources().tolist() == [[H, H, H, H, L, L], [H, H, H, H, L, L]]
    capped = cap_trees(grafted, [4, 2])
    assert capped.sources().tolist() == [[H, H, H, H, L], [H, H, H, H, L]] and capped.sizes == [5, 3]
    rows = with_root_only_rows(capped, [0, 2], [99])
    assert rows.sources()[0].tolist() == capped.sources()[0].tolist()
    assert rows.sources()[2].tolist() == capped.sources()[1].tolist()
    # a grammar keeps the root and node 1, hangs a forced chain under node 1; row 1 untouched
    rebuilt = rebuild_rows(rows, [([0, 1], [(1, [5, 6])]), None, None])
    assert rebuilt.sources()[0, :4].tolist() == [H, H, F, F] and rebuilt.sizes[0] == 4
    # chains given their own sources (a step without head drafts: forced tokens, then lookup)
    roots = DraftTree(torch.tensor([[1], [2]]), torch.full((2, 1), -1), torch.zeros(2, 1, dtype=torch.long))
    mixed = rebuild_rows(roots, [([0], [(0, [3, 4, 5])]), None], [[[F, L, L]], None])
    assert mixed.sources()[0].tolist() == [H, F, L, L] and mixed.sizes == [4, 1]
    with pytest.raises(ValueError, match="chain sources"):
        rebuild_rows(roots, [([0], [(0, [3, 4])]), None], [[[F]], None])


def test_tally_counts_by_source_and_levels_of_the_proposers_own_drafts():
    """root -> h1 -> f1 -> f2 (a forced chain under a head node), root -> h2 -> h3, root -> l1; the path
    root, h1, f1, f2 accepted, a stop condition emitting two of its drafts."""
    parents = [-1, 0, 1, 2, 0, 4, 0]
    sources = [H, H, F, F, H, H, L]
    t = tally(parents, sources, 7, [0, 1, 2, 3], emitted=2)
    assert t.drafted == [3, 1, 2]
    assert t.accepted == [1, 0, 2] and t.emitted == [1, 0, 1]
    assert t.depth == 2  # h2 -> h3: the forced chain adds no level
    assert t.hits == 1  # h1 alone: forced tokens are not the head's acceptance
    # padding past the row's size is not counted; a forced-only row offers the proposer nothing
    forced_only = tally([-1, 0, 1, 0], [H, F, F, H], 3, [0, 1, 2], emitted=2)
    assert forced_only.drafted == [0, 0, 2] and forced_only.depth == 0 and forced_only.hits == 0


# ------------------------------------------------------------------------------------ engine

SCHEMA = {"type": "object", "required": ["description_of_item", "category_name"], "properties": {
    "description_of_item": {"enum": ["a very long fixed value", "another fixed value entirely"]},
    "category_name": {"enum": ["first category", "second category"]}}}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [30, 40], [50, 60, 70, 80, 90]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A 2-layer random target with the server tests' byte-level tokenizer, and a random EAGLE-3 head
    (its drafts all but never accepted: what is accepted came from elsewhere)."""
    from speculative_helpers import tokenized_checkpoints

    return tokenized_checkpoints(tmp_path_factory.mktemp("sources"))


def _json(max_tokens: int = 80):
    from augury import SamplingParams
    from augury.sampling_params import StructuredOutputsParams as SO

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=SO(json=SCHEMA))


def test_forced_tokens_count_as_forced_and_head_drafts_as_the_heads(ckpts):
    """A static EAGLE-3 tree (5 head drafts a step) with a prompt-lookup branch: a JSON schema answer's
    accepted drafts are mostly the grammar's forced tokens, counted as forced; a free-text answer's drafts
    are the head's (5 a verification) and the lookup branch's, nothing forced. Per request and engine-wide
    the sources sum to the totals."""
    from augury import LLM, SamplingParams

    llm = LLM(str(ckpts["target"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
              speculative_policy="static", speculative_num_steps=3, speculative_eagle_topk=2,
              speculative_num_draft_tokens=6, speculative_ngram_branch=4, log_stats_interval=0, max_num_seqs=4)
    chat = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    js, free = llm.generate(PROMPTS[:2], [_json(), chat], use_tqdm=False)
    for o in (js, free):
        s = o.spec_stats
        assert s.num_verify_steps > 0
        assert s.num_draft_tokens == s.num_head_draft_tokens + s.num_lookup_draft_tokens + s.num_forced_draft_tokens
        assert s.num_accepted_draft_tokens == (s.num_head_accepted_tokens + s.num_lookup_accepted_tokens
                                               + s.num_forced_accepted_tokens)
        assert len(o.token_ids) >= 1 + s.num_verify_steps + s.num_accepted_draft_tokens  # (+ plain steps)
    s = js.spec_stats
    assert s.num_forced_accepted_tokens >= len(js.token_ids) // 2, s  # most of the answer was forced
    assert s.num_forced_accepted_tokens > 2 * s.num_head_accepted_tokens, s
    f = free.spec_stats
    assert f.num_forced_draft_tokens == 0 and f.num_head_draft_tokens == 5 * f.num_verify_steps, f
    st = llm.engine.stats
    assert st.drafted_by_source == [sum(getattr(o.spec_stats, f"num_{k}_draft_tokens") for o in (js, free))
                                    for k in ("head", "lookup", "forced")]
    assert sum(st.accepted_by_source) == st.num_accepted_tokens and sum(st.drafted_by_source) == st.num_draft_tokens
    assert st.accepted_by_source[int(Source.FORCED)] >= s.num_forced_accepted_tokens  # (a stop may cut the emitted)


def test_the_policy_learns_the_heads_acceptance_not_the_forced_tokens(ckpts):
    """A mixed batch, JSON answers and free text, under the adaptive policy with a clock where drafting
    pays if the head's drafts are accepted (40 ms a step, 2 ms a draft node a row). The random head's
    drafts never are, the grammar's forced tokens nearly always: the policy learns an acceptance ~0 and
    drafts with the head only when a request is tried again (on a back-off that doubles), instead of
    drafting the JSON rows every step on the strength of the forced tokens grafted under them."""
    from augury import LLM, SamplingParams
    from policy_helpers import fake_clock, teach_times

    llm = LLM(str(ckpts["target"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
              speculative_policy="adaptive", speculative_num_steps=3, speculative_eagle_topk=1,
              speculative_num_draft_tokens=4, speculative_ngram_branch=0, log_stats_interval=0, max_num_seqs=8)
    policy = llm.engine.speculator.policy
    for b in range(1, 9):  # as if measured already, at every batch size the run passes through
        teach_times(policy, b, 0.040, {d: 0.040 + 0.002 * b * policy.shape_for(d).num_drafts for d in policy.depths()})
    fake_clock(policy, 0.040, 0.002)
    plan, drafting = policy.plan, []

    def spy(reqs):
        p = plan(reqs)
        drafting.append(len(p.drafting))
        return p

    policy.plan = spy
    chat = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS * 2, [_json(), _json(), chat, chat] * 2, use_tqdm=False)
    forced = sum(o.spec_stats.num_forced_accepted_tokens for o in outs)
    head = sum(o.spec_stats.num_head_accepted_tokens for o in outs)
    assert forced > 10 * max(head, 1)  # the forced tokens were accepted, the head's drafts (all but) not
    assert policy.rates()[0] < 0.2, policy.rates()  # (counting forced tokens it learned ~0.7 here)
    steps = sum(1 for n in drafting if n)
    assert steps * 4 < len(drafting), drafting  # (... and drafted the JSON rows every step while they ran)


def test_padded_rows_take_the_depths_their_parents_give_them() -> None:
    """_padded finds small batches' depths in Python, large ones' by depth_from_parents: the same."""
    from augury.speculative import tree as T

    g = torch.Generator().manual_seed(3)
    for b, n in ((1, 1), (1, 17), (4, 9), (40, 20)):  # the last past SMALL_TREES
        rows = []
        for _ in range(b):
            size = int(torch.randint(1, n + 1, (1,), generator=g))
            par = [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, size)]
            rows.append(([7] * size, par, [int(Source.LOOKUP)] * size))
        tree = T._padded(rows, torch.device("cpu"))
        assert torch.equal(tree.depth, depth_from_parents(tree.parents)), (b, n)
    assert 40 * 20 > T.SMALL_TREES >= 4 * 9
