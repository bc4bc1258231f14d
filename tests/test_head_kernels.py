"""The EAGLE-3 head on augury's head kernel (models/eagle3_fused.py, cpu/csrc/head.cpp): against the
torch head it stands in for, its top k against a log-softmax written out, the same bits at every ISA
level, thread count and batch, and greedy speculative output equal to plain greedy output with it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from augury import LLM, SamplingParams
from augury.cpu import build, isa
from augury.cpu import kernels as cpu_kernels
from augury.models.eagle3_fused import FusedHead
from augury.models.quant import Int4Linear, W8A8OutputLinear

from speculative_helpers import make_target, random_head

pytestmark = pytest.mark.skipif(isa.why_unsupported() is not None or build.compiler() is None,
                                reason="augury's CPU kernels do not run here")

DRAFT_VOCAB = 256  # whole panels of 16 (an int4 output layer's too)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("head-kernel")
    return make_target(root / "target"), random_head(root / "head", draft_vocab=DRAFT_VOCAB)


def _llm(ckpts, **kw) -> LLM:
    target, head = ckpts
    return LLM(str(target), draft_model=str(head), speculative_algorithm="eagle3", speculative_policy="static",
               dtype="bfloat16", quantization="int4", log_stats_interval=0, **kw)


@pytest.fixture(scope="module")
def head(ckpts):
    return _llm(ckpts).engine.speculator.proposer.head


def _rows(t: int, seed: int = 0):
    """A catch-up of t rows of one request: aux features, tokens, a fresh cache, causal slot lists."""
    g = torch.Generator().manual_seed(seed)
    aux = (torch.randn(t, 192, generator=g) * 2).to(torch.bfloat16)
    tokens = torch.randint(0, 256, (t,), generator=g)
    slots = np.tile(np.arange(t, dtype=np.int64), (t, 1))
    return aux, tokens, slots, np.arange(1, t + 1)


def _cache(head, slots: int = 64):
    return (torch.zeros(slots, head.nkv, head.hd, dtype=torch.bfloat16),
            torch.zeros(slots, head.nkv, head.hd, dtype=torch.bfloat16))


def test_the_kernel_computes_what_the_torch_head_computes(head) -> None:
    """A causal block of 9 rows from target features: the pre-norm outputs, the keys and values cached
    and the top 4 drafts with their log-probabilities, against Eagle3Head.forward / logits / log_softmax
    (bfloat16 residual stream and logits there, float32 here: close, not equal)."""
    fused = FusedHead.build(head)
    assert fused is not None
    t = 9
    aux, tokens, slots, nkeys = _rows(t)
    kc, vc = _cache(head)
    with torch.inference_mode():
        out, ids, lp = fused.run(kc, vc, tokens.numpy(), np.arange(t), np.arange(t), slots, nkeys, np.arange(t), 4,
                                 aux=aux)
        ref, k, v = head(tokens[None], head.fc(aux[None]), torch.arange(t)[None], None, None, True)
        ref_lp, ref_ids = torch.log_softmax(head.logits(ref), -1)[0].topk(4, -1)
    ref = ref[0].float()
    assert ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.02
    assert ((kc[:t].float() - k[0].float()).norm() / k.float().norm()) < 0.02
    assert ((vc[:t].float() - v[0].float()).norm() / v.float().norm()) < 0.02
    assert (ids[:, 0] == ref_ids[:, 0]).float().mean() >= 0.8
    assert (lp[:, 0] - ref_lp[:, 0]).abs().max() < 0.1


def _own_logits(head, out: torch.Tensor) -> torch.Tensor:
    """float32 logits of the head's output layer on the kernels' own row functions: the final norm of
    out rounded to bfloat16, then w8a8's general form (an int8 layer) or w4a8 (an int4 one)."""
    x = cpu_kernels.elementwise().rms_norm(out, head.norm.weight, head.norm.eps)
    lm = head.lm_head
    if isinstance(lm, W8A8OutputLinear):
        return cpu_kernels.w8a8().linear_general(x, lm.codes, lm.scale, None, None, out_dtype=torch.float32)
    return cpu_kernels.w4a8().linear(x, lm.w4a8_codes, lm.w4a8_scale, lm.w4a8_zero, out_dtype=torch.float32)


def test_an_int4_head_keeps_its_output_layer_at_int8(head) -> None:
    assert isinstance(head.lm_head, W8A8OutputLinear) and isinstance(head.fc, Int4Linear)


@pytest.mark.parametrize("layer", ["int8", "int4"])
def test_top_k_is_the_log_softmax_of_the_kernels_own_logits(head, layer, monkeypatch) -> None:
    """The k best ids and log-probabilities the kernel gives equal float64 log_softmax + topk over the
    logits its own row functions give, with the output layer as loaded (int8 on w8a8) and replaced by
    an int4 one after the plan was built (its table is rebuilt: the layer read is the new one)."""
    fused = FusedHead.build(head)
    t, k = 6, 8
    aux, tokens, slots, nkeys = _rows(t, seed=3)
    if layer == "int4":
        monkeypatch.setattr(head, "lm_head", Int4Linear.from_float(head.lm_head.weight, None, torch.bfloat16))
    out, ids, lp = fused.run(*_cache(head), tokens.numpy(), np.arange(t), np.arange(t), slots, nkeys, np.arange(t), k,
                             aux=aux)
    want_lp, want_ids = torch.log_softmax(_own_logits(head, out).double(), -1).topk(k, -1)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(lp.double(), want_lp, atol=1e-5, rtol=0)


def test_rows_are_the_same_bits_alone_in_a_batch_and_at_any_thread_count(head) -> None:
    """Draft-level rows (given h, each over its own slots) alone, in a batch of 5, at 1 and 2 threads."""
    fused = FusedHead.build(head)
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(64, head.nkv, head.hd, generator=g).to(torch.bfloat16)
    vc = torch.randn(64, head.nkv, head.hd, generator=g).to(torch.bfloat16)
    h = torch.randn(5, 64, generator=g)
    tokens = torch.randint(0, 256, (5,), generator=g).numpy()
    nkeys = np.array([3, 7, 1, 12, 5])
    slots = np.zeros((5, 12), dtype=np.int64)
    for r, n in enumerate(nkeys):
        slots[r, : n - 1] = np.arange(n - 1)
        slots[r, n - 1] = 40 + r  # its own key, written by the call
    pos = nkeys - 1

    def call(rows, threads):
        kk, vv = kc.clone(), vc.clone()
        return fused.run(kk, vv, tokens[rows], pos[rows], 40 + np.asarray(rows), slots[rows], nkeys[rows],
                         np.arange(len(rows)), 3, h=h[rows], threads=threads)

    batch = call(list(range(5)), 2)
    for threads in (1, 2):
        for r in range(5):
            alone = call([r], threads)
            for a, b in zip(alone, batch):
                assert torch.equal(a[0], b[r])


@pytest.mark.parametrize("level", [lv for lv in isa.LEVELS[1:] if isa.allowed_on_host(lv)] or
                         [pytest.param("none", marks=pytest.mark.skip(reason="this CPU runs only the avx2 level"))])
def test_each_isa_level_gives_the_avx2_bits(head, level) -> None:
    fused = FusedHead.build(head)
    t = 11
    aux, tokens, slots, nkeys = _rows(t, seed=7)
    outs = {}
    for lv in ("avx2", level):
        fused.kernel = cpu_kernels.HeadKernel(build.build("head", lv))
        kc, vc = _cache(head)
        outs[lv] = [*fused.run(kc, vc, tokens.numpy(), np.arange(t), np.arange(t), slots, nkeys, np.arange(t), 5,
                               aux=aux), kc, vc]
    for a, b in zip(outs["avx2"], outs[level]):
        assert torch.equal(a, b)


def test_slots_outside_the_cache_and_ids_outside_the_vocabulary_are_refused(head) -> None:
    fused = FusedHead.build(head)
    aux, tokens, slots, nkeys = _rows(3)
    kc, vc = _cache(head, 8)
    bad = slots.copy()
    bad[2, 1] = 8
    with pytest.raises(RuntimeError, match="bad shapes, ids or slots"):
        fused.run(kc, vc, tokens.numpy(), np.arange(3), np.arange(3), bad, nkeys, np.arange(3), 2, aux=aux)
    with pytest.raises(RuntimeError, match="bad shapes, ids or slots"):
        fused.run(kc, vc, np.array([0, 1, 256]), np.arange(3), np.arange(3), slots, nkeys, np.arange(3), 2, aux=aux)
    assert not kc.any()  # refused before anything was written


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (3 + (7 * i) % 29,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("topk,rows", [(1, 256), (2, 256), (2, 7)])
def test_speculative_greedy_equals_plain_greedy_on_the_head_kernel(ckpts, topk, rows, monkeypatch) -> None:
    """Drafts from the head kernel (every draft level and catch-up through it), verified: greedy output
    is plain greedy output, in a batch of 5 and alone; with catch-up calls of 7 rows, a request's
    backlog is cut over several calls, and a call holds two pieces of one request."""
    from augury.speculative import eagle3_proposer

    monkeypatch.setattr(eagle3_proposer, "CATCH_UP_ROWS", rows)
    calls = []
    run = FusedHead.run

    def counted(self, *a, **kw):
        calls.append(len(a[2]))
        return run(self, *a, **kw)

    monkeypatch.setattr(FusedHead, "run", counted)
    target, _ = ckpts
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (24, 17, 30, 9, 20)]
    prompts = _prompts(len(params))
    plain = LLM(str(target), speculative_algorithm="none", dtype="bfloat16", quantization="int4", log_stats_interval=0)
    spec = _llm(ckpts, speculative_num_steps=3, speculative_eagle_topk=topk, speculative_num_draft_tokens=4)
    assert spec.engine.speculator.proposer.fused is not None
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == want
    assert spec.generate(prompts[:1], params[:1], use_tqdm=False)[0].token_ids == want[0]
    assert len(calls) > 10 and max(calls) > 1  # levels and catch-ups went through the kernel, batched


def test_prefix_cache_hits_read_the_offered_head_kv_on_the_head_kernel(ckpts) -> None:
    """Requests that share a 40-token prefix with an earlier one take its blocks (and the head KV it
    offered) from the cache; their drafts come from the kernel reading those slots: greedy output is
    still plain greedy output."""
    target, _ = ckpts
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, 256, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 5, 8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(str(target), speculative_algorithm="none", dtype="bfloat16", quantization="int4", log_stats_interval=0)
    spec = _llm(ckpts, speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    first = spec.generate(prompts[:1], params, use_tqdm=False)
    later = spec.generate(prompts[1:], params, use_tqdm=False)
    assert [o.token_ids for o in first + later] == want
    assert all(o.num_cached_tokens >= 32 for o in later)


def test_the_scratch_region_grows_keeping_the_heads_cache(ckpts) -> None:
    """A batch whose tree needs more scratch slots than the region holds grows it; the head's own
    blocks keep what they held."""
    proposer = _llm(ckpts).engine.speculator.proposer
    base = (proposer.zero_block + 1) * proposer.block_size
    proposer.cache.k[0, 5].fill_(1.5)
    have = proposer.cache.k.shape[1] - base
    assert proposer.scratch(have) == base and proposer.cache.k.shape[1] == base + have  # enough: unchanged
    assert proposer.scratch(have + 1) == base and proposer.cache.k.shape[1] >= base + have + 1
    assert (proposer.cache.k[0, 5] == 1.5).all() and not proposer.cache.k[0, 6].any()


def test_without_the_kernels_the_torch_head_drafts(ckpts, monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "head", lambda: None)
    assert _llm(ckpts).engine.speculator.proposer.fused is None


class _ScriptedHead:
    """A stand-in for FusedHead.run whose answers follow from each row's input alone: a row fed token x
    with state h gives out = 31 h + x + 1, and children ids (3 x + 7 j + h) mod 50 with log-probabilities
    falling in j; it records each row's key slot by its output and checks the row's slot list: the
    request's context, then its ancestors' key slots from the root, then its own."""

    def __init__(self, context: list[int]) -> None:
        self.context, self.paths, self.calls = context, {}, 0

    def run(self, cache_k, cache_v, tokens, positions, slot_mapping, slots, nkeys, logit_rows, k, h=None):
        self.calls += 1
        out = torch.empty(len(tokens), h.shape[1])
        ids, lp = torch.empty(len(tokens), k, dtype=torch.int64), torch.empty(len(tokens), k)
        for t, (x, own) in enumerate(zip(tokens.tolist(), slot_mapping.tolist())):
            state = float(h[t, 0])
            path = self.paths.get(state, []) + [own]  # (a level-0 row's state is the catch-up's: no path)
            assert slots[t, : nkeys[t]].tolist() == self.context + path
            out[t] = 31 * state + x + 1
            self.paths[float(out[t, 0])] = path
            ids[t] = torch.tensor([(3 * x + 7 * j + int(state)) % 50 for j in range(k)])
            lp[t] = torch.tensor([-(j + 1) - 0.01 * ((x + j) % 5) for j in range(k)])
        h.copy_(out)  # the kernel writes its output over its input state
        return h, ids, lp


def _scripted_tree(first: list[tuple[int, float]], state: float, k: int, steps: int):
    """The candidates the levels should give, level by level in plain Python: every frontier node
    fed, its k children scored by their path's log-probabilities, the best k (the earlier on ties)
    the next frontier, each carrying its parent's output as its state."""
    toks, pars, scores = [t for t, _ in first], [-1] * k, [s for _, s in first]
    frontier = [(j, t, s, state) for j, (t, s) in enumerate(first)]  # (candidate, token, score, state)
    for _ in range(1, steps):
        level = []
        for cand, x, score, st in frontier:
            out = 31 * st + x + 1
            for j in range(k):
                level.append((len(toks) + len(level), (3 * x + 7 * j + int(st)) % 50,
                              score + (-(j + 1) - 0.01 * ((x + j) % 5)), out, cand))
        for c, x, s, _, parent in level:
            toks.append(x)
            pars.append(parent)
            scores.append(s)
        best = sorted(level, key=lambda n: -n[2])[:k]
        frontier = [(c, x, s, st) for c, x, s, st, _ in best]
    return toks, pars, scores


@pytest.mark.parametrize("k,steps", [(1, 3), (2, 3), (3, 4)])
def test_the_kernel_levels_grow_each_frontier_from_its_own_parent(k, steps) -> None:
    """The kernel path's draft levels (numpy bookkeeping): each candidate's token, parent and path score,
    each fed row's state (its parent's output) and key slots (its ancestors'), against the same tree
    grown in plain Python from the same scripted head answers; two requests of different contexts."""
    from types import SimpleNamespace

    from augury.speculative.eagle3_proposer import _KernelLevels

    heads = [_ScriptedHead(list(range(100, 100 + n))) for n in (5, 9)]

    class Both:  # each request's rows to its own scripted head (their contexts differ)
        def run(self, ck, cv, tokens, positions, mapping, slots, nkeys, rows, k, h=None):
            b = len(heads)
            per = len(tokens) // b
            outs = [hd.run(ck, cv, tokens[i * per:(i + 1) * per], positions, mapping[i * per:(i + 1) * per],
                           slots[i * per:(i + 1) * per], nkeys[i * per:(i + 1) * per], rows, k,
                           h=h[i * per:(i + 1) * per].clone()) for i, hd in enumerate(heads)]
            h.copy_(torch.cat([o[0] for o in outs]))
            return h, torch.cat([o[1] for o in outs]), torch.cat([o[2] for o in outs])

    prop = SimpleNamespace(fused=Both(), head=SimpleNamespace(d2t=torch.zeros(50, dtype=torch.int64)),
                           scratch=lambda n: 1000, cache=SimpleNamespace(k=[None], v=[None]), _slots=None)
    levels = _KernelLevels(prop, [None, None], [5, 9], k, steps, [np.arange(100, 105), np.arange(100, 109)])
    first_ids = torch.tensor([[(4 + 9 * j) % 50 for j in range(k)], [(11 + 5 * j) % 50 for j in range(k)]])
    first_lp = torch.tensor([[-0.5 - j for j in range(k)], [-0.25 - 1.5 * j for j in range(k)]])
    parent_h = torch.tensor([[2.0] * 8, [3.0] * 8])
    toks, pars, scores = levels.grow(first_ids, first_lp, parent_h)
    for b, st in enumerate((2.0, 3.0)):
        want = _scripted_tree(list(zip(first_ids[b].tolist(), first_lp[b].tolist())), st, k, steps)
        assert toks[b].tolist() == want[0] and pars[b].tolist() == want[1]
        assert scores[b].tolist() == pytest.approx(want[2], abs=1e-5)
        assert heads[b].calls == steps - 1
