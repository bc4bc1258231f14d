"""`augury bench --history warm`: a workload conversation's earlier turns prefilled, untimed, before its
timed request (bench/workloads.workload_histories, AugurySystem.prepare, worker.run_groups)."""
from __future__ import annotations

import time

import pytest
from conftest import build_tokenizer


@pytest.mark.parametrize("kind", ["code_edit", "agentic"])
def test_a_conversations_history_begins_its_prompt(kind) -> None:
    from augury.bench.workloads import workload_histories, workload_prompts

    tok = build_tokenizer()
    prompts = workload_prompts(tok, kind, 4, seed=2)
    histories = workload_histories(tok, kind, 4, seed=2)
    assert len(histories) == 4
    for prompt, history in zip(prompts, histories):
        assert 0 < len(history) < len(prompt) and prompt[:len(history)] == history
        # what is left is the last message and the assistant's header: far less than the earlier turns
        assert len(prompt) - len(history) < len(history)


@pytest.mark.parametrize("kind", ["summarise", "extract"])
def test_one_message_workloads_have_no_history(kind) -> None:
    from augury.bench.workloads import workload_histories

    assert workload_histories(build_tokenizer(), kind, 3) == [[], [], []]


def test_run_groups_times_generate_and_not_prepare() -> None:
    from augury.bench.worker import run_groups

    class Slow:
        name = "slow-prepare"

        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []

        def prepare(self, prompts):
            self.calls.append(("prepare", len(prompts)))
            time.sleep(0.4)

        def generate(self, prompts, output_len, stop_at_eos=False):
            self.calls.append(("generate", len(prompts)))
            return [[7] * output_len for _ in prompts]

    system = Slow()
    out, wall, cpu, split = run_groups(system, [[[1, 2]], [[3, 4], [5, 6]]], 3)
    assert system.calls == [("prepare", 1), ("generate", 1), ("prepare", 2), ("generate", 2)]
    assert out == [[7, 7, 7]] * 3
    assert wall < 0.3  # the two prepares slept 0.8 s


def test_warm_history_is_found_in_the_prefix_cache_and_cold_is_not(tiny_checkpoint) -> None:
    import torch

    from augury.bench import AugurySystem, SystemSettings

    folder = tiny_checkpoint("llama", tokenizer=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 200, (n,), generator=g).tolist() for n in (90, 120)]
    histories = [prompts[0][:70], prompts[1][:101]]
    settings = SystemSettings(str(folder), "float32", "cpu", 2, 160, threads=1,
                              histories=tuple((tuple(p), tuple(h)) for p, h in zip(prompts, histories)))
    system = AugurySystem(settings, "augury-off", speculative_algorithm="none")
    sched, bs = system.llm.engine.scheduler, system.llm.engine.allocator.block_size
    cold = [system.generate([p], 6)[0] for p in prompts]  # generate alone empties the cache first
    for prompt, history, want in zip(prompts, histories, cold):
        system.prepare([prompt])
        hits = sched.prefix_hits
        assert system.generate([prompt], 6) == [want]  # the same greedy answer
        assert sched.prefix_hits - hits == len(history) // bs * bs  # every whole block of the history
        hits = sched.prefix_hits
        system.generate([prompt], 6)  # not prepared: the previous run's blocks are gone
        assert sched.prefix_hits == hits
    assert system.steps == 0 and system.decoded == 5 * 6  # prepare's answers are not counted
