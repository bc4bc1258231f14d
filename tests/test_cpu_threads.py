"""The kernels' thread count chosen by timing (cpu/threads.py), driven by a fake clock; and the fused
stack's numbers independent of the thread count (the choice may change speed only)."""
from __future__ import annotations

import random
import threading

import pytest

from augury import LLM, SamplingParams
from augury.cpu import kernels as cpu_kernels
from augury.cpu import threads
from augury.cpu.threads import ThreadChoice
from conftest import random_prompts


def _drive(choice: ThreadChoice, cost, calls: int, rows: int = 1, seed: int = 0, noise: float = 0.3) -> list[int]:
    """`calls` timed calls whose milliseconds are cost(threads, call) times a +-noise factor (times age
    with the seconds of calls recorded); the counts used."""
    rng = random.Random(seed)
    clock = [0.0]
    used = []
    for i in range(calls):
        def run(n: int, i=i) -> int:
            clock[0] += 1e-3 * cost(n, i) * (1 + rng.uniform(-noise, noise))
            used.append(n)
            return 0

        choice.timed(rows, run, clock=lambda: clock[0])
    return used


def test_candidates_and_buckets() -> None:
    assert threads.candidates(2) == (2, 1)
    assert threads.candidates(8) == (8, 4, 1)
    assert threads.candidates(1) == (1,)
    assert [threads.bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


@pytest.mark.parametrize("fast", [1, 2])
def test_it_settles_on_the_faster_count_and_rarely_tries_the_other(fast) -> None:
    """Idle (2 threads 1.8x faster) or shared (1 thread 4x faster), +-30% noise: after 200 calls at
    most 2% of the calls run the slower count, and overall at most 6%."""
    slow = 3 - fast
    c = ThreadChoice(max_threads=lambda: 2)
    cost = (lambda n, i: 1.0 if n == fast else 1.8) if fast == 2 else (lambda n, i: 1.0 if n == fast else 4.0)
    used = _drive(c, cost, 2000)
    assert used[200:].count(slow) / len(used[200:]) <= 0.02
    assert used.count(slow) / len(used) <= 0.06
    assert c.best(1) == fast and threads.bucket(1) == 1



@pytest.mark.parametrize("shared", [True, False])
def test_a_new_bucket_starts_as_its_measured_neighbour_stands(shared) -> None:
    """Shared core (two threads 10x one in every bucket): once one bucket has measured both counts, a
    new bucket (a drafting step's verification rows) runs one thread from its first call and tries two
    only on the exploring gaps (the first after explore_min calls), its calls of one thread no trials.
    Idle (two threads 1.6x faster, under CLEAR_LOSS): a new bucket measures both counts first."""
    c = ThreadChoice(max_threads=lambda: 2)
    fast = 1 if shared else 2
    cost = (lambda n, i: 1.0 if n == fast else 10.0) if shared else (lambda n, i: 1.0 if n == fast else 1.6)
    _drive(c, cost, 40, rows=1)
    assert c.best(1) == fast
    before = c.trials
    used = _drive(c, cost, 40, rows=16, seed=1)
    if shared:
        assert used[:15] == [1] * 15 and used.count(2) <= 2 and c.best(16) == 1
        assert c.trials - before == used.count(2)  # only the explored calls were trials
    else:
        assert set(used[:6]) == {1, 2} and c.best(16) == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_measuring_a_count_that_loses_by_far_takes_one_call(seed) -> None:
    """Measuring first, each count runs once, then the fastest so far: two threads at 10x one thread's
    time (a shared core) run once in the first 16 calls, not every other call until each has three."""
    c = ThreadChoice(max_threads=lambda: 2)
    used = _drive(c, lambda n, i: 1.0 if n == 1 else 10.0, 16, seed=seed)
    assert used.count(2) == 1 and c.best(1) == 1


def test_trials_count_the_calls_that_ran_another_count_than_the_chosen_one() -> None:
    """`trials` grows by one for every timed call whose count was not its bucket's chosen one when
    picked (measuring a count at first, exploring later), and by nothing for the others. `changes`
    grows by one each time the chosen count changes."""
    c = ThreadChoice(max_threads=lambda: 2)
    clock = [0.0]
    off = 0
    for i in range(600):
        best_before = c.best(1)
        before, changes = c.trials, c.changes

        def run(n: int) -> int:
            clock[0] += 1e-3 if n == 1 else 4e-3  # milliseconds (times age with work)
            return n

        n = c.timed(1, run, clock=lambda: clock[0])
        assert c.trials - before == (n != best_before)
        assert c.changes - changes == (c.best(1) != best_before)
        off += n != best_before
    assert 0 < off == c.trials < 60
    assert c.best(1) == 1 and c.changes == 1  # two threads lost once: one change, and none after


def test_a_lucky_fast_call_of_a_losing_count_is_retried_once_without_restarting_its_gaps() -> None:
    """On a core shared with a busy process two threads run ~10x one, but now and then fast. A fast
    call is tried again at once (a change of load shows so); when that try is slow again the count
    waits its grown gap (256 calls here), not the first one's (16 x its loss: 160 before)."""
    c = ThreadChoice(max_threads=lambda: 2)
    clock = [0.0]
    twos: list[int] = []
    lucky = [False]
    for i in range(2500):
        def run(n: int, i=i) -> int:
            if n == 2:
                twos.append(i)
                fast = i > 1200 and not lucky[0]
                lucky[0] = lucky[0] or fast
                clock[0] += 0.5e-3 if fast else 10e-3
            else:
                clock[0] += 1e-3
            return n

        c.timed(1, run, clock=lambda: clock[0])
    f = next(i for i in twos if i > 1200)
    after = [i for i in twos if i > f]
    assert after[0] == f + 1  # tried again at once
    assert after[1] - after[0] >= 250  # then its grown gap, not a fresh start

def test_a_change_of_load_is_followed_within_a_few_hundred_calls() -> None:
    """2 threads win until call 1500, then a competitor makes 1 thread win (and back at 3000): the
    choice follows within 300 calls each time."""
    c = ThreadChoice(max_threads=lambda: 2)

    def cost(n: int, i: int) -> float:
        shared = 1500 <= i < 3000
        return (1.0 if n == 1 else 4.0) if shared else (1.8 if n == 1 else 1.0)

    used = _drive(c, cost, 4500, seed=1)
    assert used[1400:1500].count(2) >= 95
    assert used[1800:3000].count(1) / 1200 >= 0.97
    assert used[3300:].count(2) / 1200 >= 0.97


def test_row_buckets_are_timed_apart() -> None:
    """One thread wins for single rows, two for 16-row calls: each bucket keeps its own choice."""
    c = ThreadChoice(max_threads=lambda: 2)
    rng = random.Random(3)
    clock = [0.0]
    for i in range(1500):
        rows = 1 if i % 2 else 16
        cost = {(1, 1): 1.0, (1, 2): 1.5, (16, 1): 8.0, (16, 2): 4.5}

        def run(n: int, rows=rows) -> int:
            clock[0] += 1e-3 * cost[(rows, n)] * (1 + rng.uniform(-0.3, 0.3))
            return 0

        c.timed(rows, run, clock=lambda: clock[0])
    assert c.best(1) == 1 and c.best(16) == 2



def test_untimed_calls_run_the_settled_count_never_an_exploring_one() -> None:
    """Between timed calls augury's other kernel calls run the count chosen for the last call's bucket,
    even right after a call that explored the other count; the untimed layers (prefill) take the
    nearest measured bucket's choice, torch's count before anything was measured."""
    c = ThreadChoice(max_threads=lambda: 2)
    assert c.settled(2048) == 2 and c.current() == 2
    clock = [0.0]
    after = []
    for i in range(600):
        rows = 1 if i % 2 else 16
        cost = {(1, 1): 1.0, (1, 2): 1.5, (16, 1): 8.0, (16, 2): 4.5}

        def run(n: int, rows=rows) -> int:
            clock[0] += 1e-3 * cost[(rows, n)]
            return 0

        c.timed(rows, run, clock=lambda: clock[0])
        after.append((rows, c.current()))
    assert c.best(1) == 1 and c.best(16) == 2
    assert all(cur == (1 if rows == 1 else 2) for rows, cur in after[100:])
    assert c.settled(2048) == 2 and c.settled(2) == 1 and c.settled(1) == 1


def test_scoped_sets_the_count_of_kernel_calls_on_this_thread_only(monkeypatch) -> None:
    monkeypatch.setattr(threads, "_choice", ThreadChoice(max_threads=lambda: 2))
    seen = []
    with threads.scoped(1):
        seen.append(threads.current())
        t = threading.Thread(target=lambda: seen.append(threads.current()))
        t.start()
        t.join()
        with threads.scoped(2):
            seen.append(threads.current())
        seen.append(threads.current())
    seen.append(threads.current())
    assert seen == [1, 2, 2, 1, 2]


def test_a_timed_call_runs_its_pick_under_scope(monkeypatch) -> None:
    c = ThreadChoice(max_threads=lambda: 2)
    monkeypatch.setattr(threads, "_choice", c)
    got = []
    for _ in range(8):
        c.timed(4, lambda n: got.append((n, threads.current())) or 0)
    assert {n for n, _ in got} == {1, 2} and all(n == cur for n, cur in got)


def test_a_single_thread_process_is_never_asked_for_more() -> None:
    c = ThreadChoice(max_threads=lambda: 1)
    assert set(_drive(c, lambda n, i: 1.0, 100)) == {1}


class _Fixed(ThreadChoice):
    """Always n threads."""

    def __init__(self, n: int) -> None:
        super().__init__(max_threads=lambda: n)
        self.n, self.seen = n, []

    def pick(self, rows: int) -> int:
        self.seen.append(self.n)
        return self.n


@pytest.mark.skipif(cpu_kernels.forward() is None, reason="augury's fused-stack kernel does not run here")
def test_the_fused_stack_gives_the_same_bits_with_any_thread_count(tiny_checkpoint, monkeypatch) -> None:
    """Decode and verification steps through the fused stack and the w8a8 output layer with 1 and with 2
    threads: tokens and log-probabilities bit for bit equal."""
    llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", quantization="int4", speculative_algorithm="ngram",
              speculative_policy="static", log_stats_interval=0)
    prompts = random_prompts([5, 13, 8], seed=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = []
    for n in (1, 2):
        fixed = _Fixed(n)
        monkeypatch.setattr(threads, "_choice", fixed)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert fixed.seen and set(fixed.seen) == {n}
        outs.append([(o.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.logprobs]) for o in got])
    assert outs[0] == outs[1]


class _Pinned(_Fixed):
    """Always n threads, the untimed layers (prefill) included."""

    def settled(self, rows: int) -> int:
        return self.n

    def current(self) -> int:
        return self.n


@pytest.mark.skipif(cpu_kernels.forward() is None, reason="augury's fused-stack kernel does not run here")
def test_steps_run_torchs_operators_at_the_chosen_count_in_their_thread_only(tiny_checkpoint, monkeypatch) -> None:
    """Where the fused stack runs a model, the torch operators of its steps (prefill's attention, decode's
    sampling) run the count the kernels chose, in the engine's thread only, and give the same bits as at
    torch's own count; torch's count is back after each step and another thread's never moves."""
    import torch
    import torch.nn.functional as F

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", quantization="int4", speculative_algorithm="none",
                  enable_prefix_caching=False, log_stats_interval=0)
        prompts = random_prompts([40, 71, 23], seed=5)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
        sdpa = F.scaled_dot_product_attention
        seen: list[tuple[int, int]] = []

        def spy(*args, **kwargs):
            other = []
            t = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
            t.start()
            t.join()
            seen.append((torch.get_num_threads(), other[0]))
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
        from augury.engine import engine as engine_mod

        sample, sampled = engine_mod.sample, []
        monkeypatch.setattr(engine_mod, "sample", lambda *a, **k: sampled.append(torch.get_num_threads()) or sample(*a, **k))
        outs = []
        for n in (1, 2):
            monkeypatch.setattr(threads, "_choice", _Pinned(n))
            seen.clear()
            sampled.clear()
            got = llm.generate(prompts, params, use_tqdm=False)
            assert seen and set(seen) == {(n, 2)}, seen[:4]
            assert len(sampled) >= 6 and set(sampled) == {n}  # prefill's and the decode steps' sampling
            assert torch.get_num_threads() == 2
            outs.append([(o.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.logprobs],
                          [p and {t: lp.logprob for t, lp in p.items()} for p in o.prompt_logprobs]) for o in got])
        assert outs[0] == outs[1]
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_dear_count_is_learnt_from_one_call_and_tried_rarely(seed) -> None:
    """On a core shared with a busy process 2 threads ran ~7x slower than 1: one call of them is enough to
    know (not min_samples), and the tries after it come less often, so the first 250 calls spend at most
    5 on 2 threads and about a tenth over the best count's time (before: 7 calls, 17%); later ones
    still at most one in explore_max."""
    c = ThreadChoice(max_threads=lambda: 2)
    used = _drive(c, lambda n, i: 1.0 if n == 1 else 7.0, 2000, seed=seed)
    first = used[:250]
    assert first.count(2) <= 5
    assert sum(7.0 if n == 2 else 1.0 for n in first) / 250 <= 1.11
    assert used[500:].count(2) <= 1500 / 256 + 1


@pytest.mark.parametrize("loss", [12.0, 30.0])
def test_tries_of_a_very_dear_count_cost_at_most_try_share_of_the_time(loss) -> None:
    """2 threads `loss` x slower than 1 (a shared core: ~12x on an AMX Xeon): once settled, its tries
    cost at most TRY_SHARE of the time (every explore_max calls they cost (loss - 1) / 256: 4.3% at
    12x), and the gaps stay bounded (a change of load is still seen)."""
    c = ThreadChoice(max_threads=lambda: 2)
    used = _drive(c, lambda n, i: 1.0 if n == 1 else loss, 20000, seed=2, noise=0.1)
    late = used[5000:]
    extra = late.count(2) * (loss - 1.0) / len(late)
    assert 0 < late.count(2) and extra <= threads.TRY_SHARE * 1.1
    where = [i for i, n in enumerate(used) if n == 2]
    assert max(b - a for a, b in zip(where, where[1:])) <= (loss * 1.1 / 0.9 - 1.0) / threads.TRY_SHARE + 2


def test_torchs_exact_rows_attention_is_the_decode_steps_at_two_threads(monkeypatch) -> None:
    """Kernels off, torch's attention for exact rows: each node of a 14-node chain, verified at once,
    equals a decode step at its position bit for bit with torch at 2 threads (torch's CPU attention gave
    the query where its second thread starts other bits: greedy speculative output then left plain
    output on 1 of 8 held-out chats with AUGURY_CPU_KERNELS=0)."""
    import torch

    from augury.attention import paged

    monkeypatch.setattr(paged, "_attention_kernel", lambda k_cache: None)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        bs, ctx, n, nh, nkv, hd = 16, 40, 14, 9, 3, 64
        k_cache, v_cache = (torch.randn(1, 8 * bs, nkv, hd, generator=g) for _ in range(2))
        backend = paged.PagedBackend(k_cache, v_cache, bs)
        table = list(range(1, 8))
        q = torch.randn(1, n, nh, hd, generator=g)
        k, v = torch.randn(1, n, nkv, hd, generator=g), torch.randn(1, n, nkv, hd, generator=g)
        chain = (torch.arange(n) - 1)[None]
        tree = backend.prepare_tree([table], [ctx], chain)(0, q, k, v)  # [1, n, nh * hd]
        for j in range(n):
            one = backend.prepare_decode([table], [ctx + j])(0, q[:, j:j + 1], k[:, j:j + 1], v[:, j:j + 1])
            assert torch.equal(one[0, 0], tree[0, j]), f"node {j}"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)


def test_times_age_so_a_rarely_called_bucket_measures_again() -> None:
    """A drafting bucket (16 rows) measured while a busy process shared a core chose one thread; the
    load passed and plain decoding (1 row) measured two threads faster. While bucket 16's times are
    fresh (taken less than max_age seconds of timed calls ago), a prompt (untimed, 256 rows: the nearest
    measured bucket's count) runs one thread; once they are older the prompt follows the bucket
    measured since, and bucket 16's next calls measure both counts again and choose two."""
    c = ThreadChoice(max_threads=lambda: 2, max_age=1.0)
    _drive(c, lambda n, i: 1.0 if n == 1 else 10.0, 40, rows=16)  # shared: one thread wins
    assert c.best(16) == 1 and c.settled(256) == 1
    _drive(c, lambda n, i: 1.0 if n == 2 else 1.8, 500, rows=1)  # ~0.55 s of plain decoding (two threads win)
    assert c.best(1) == 2 and c.settled(256) == 1  # bucket 16's times are ~0.55 s of work old: they still count
    _drive(c, lambda n, i: 1.0 if n == 2 else 1.8, 600, rows=1)  # past max_age; bucket 1 keeps its times fresh
    assert c.settled(256) == 2 and c.best(16) == 1  # bucket 16 keeps its choice until measured again
    used = _drive(c, lambda n, i: 1.0 if n == 2 else 1.8, 12, rows=16)
    assert 2 in used[:3] and c.best(16) == 2 and c.settled(256) == 2


def test_an_idle_spell_ages_nothing_and_tries_the_other_count_once() -> None:
    """Times age with work, not the clock: after a pause longer than max_age the choice and its times
    still stand (an idle server's next request does not measure every count again: three calls of a
    count that loses by less than CLEAR_LOSS), and each bucket's next call tries its other count once,
    in case the load changed meanwhile. A shorter pause tries nothing."""
    now = [0.0]
    c = ThreadChoice(max_threads=lambda: 2, now=lambda: now[0])
    cost = lambda n, i: 1.0 if n == 1 else 1.5  # noqa: E731
    _drive(c, cost, 200, rows=1)
    _drive(c, cost, 200, rows=16)
    assert c.best(1) == 1 and c.best(16) == 1
    now[0] += 5.0  # a short pause
    assert _drive(c, cost, 10, rows=1).count(2) == 0
    now[0] += 10 * threads.MAX_AGE
    assert c.settled(64) == 1 and c.best(1) == 1
    used = _drive(c, cost, 10, rows=1)
    assert used[0] == 2 and used.count(2) == 1 and c.best(1) == 1  # one try; the times still counted
    used = _drive(c, cost, 10, rows=16)  # bucket 16 tries once too
    assert used[0] == 2 and used.count(2) == 1 and c.best(16) == 1
    now[0] += 10 * threads.MAX_AGE  # the busy process left while idle: two threads now run at ~half
    used = _drive(c, lambda n, i: 0.55 if n == 2 else 1.0, 20, rows=1)  # one's time: the try wins, the choice follows
    assert used[0] == 2 and c.best(1) == 2


def test_forgotten_times_leave_the_choices_standing_until_measured_again() -> None:
    c = ThreadChoice(max_threads=lambda: 2)
    _drive(c, lambda n, i: 1.0 if n == 1 else 10.0, 40, rows=16)  # busy while loading: one thread
    c.forget_times()
    assert c.best(16) == 1 and c.settled(256) == 1  # nothing measured since: the choice stands
    _drive(c, lambda n, i: 1.0 if n == 2 else 1.8, 30, rows=1)  # the first requests, on an idle machine
    assert c.best(1) == 2 and c.settled(256) == 2 and c.best(16) == 1  # prompts follow what was measured


@pytest.mark.skipif(cpu_kernels.forward() is None, reason="augury's fused-stack kernel does not run here")
def test_the_warm_up_requests_times_are_forgotten(tiny_checkpoint, monkeypatch) -> None:
    """Building an engine runs a warm-up request through the fused stack (drafting included); once it is
    done its times count no more, while the counts it chose stand until requests measure them."""
    c = ThreadChoice()
    monkeypatch.setattr(threads, "_choice", c)
    llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", quantization="int4", speculative_algorithm="ngram",
              speculative_policy="static", log_stats_interval=0)
    assert c._buckets and all(not t for b in c._buckets.values() for t in b.times.values())
    llm.generate(random_prompts([9], seed=1), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    assert any(t for b in c._buckets.values() for t in b.times.values())
