"""`augury bench` runs every system in a worker process of its own, started with the user's
environment: a peer gets no AUGURY_* variable and no OMP_WAIT_POLICY that augury set (only the
user's own), and the table and JSON name each system's process, threads, ISA and wait policy."""
from __future__ import annotations

import json
import os
import pickle

import pytest

from augury.bench import SystemSettings
from augury.bench.worker import WorkerSystem, user_environment, worker_environment


def test_user_environment_takes_what_augury_sets_from_the_start_environment() -> None:
    now = {"PATH": "/bin", "AUGURY_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    # started without it: augury's import set it, so the user has none
    assert user_environment(now, initial={"PATH": "/bin"}) == {"PATH": "/bin", "AUGURY_THREADS": "2"}
    # the user's shell had it: theirs
    assert user_environment(now, initial={"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    # peers lose every AUGURY_* variable; augury systems keep the user's
    env = user_environment(now, initial={})
    assert worker_environment("llama.cpp", env) == {"PATH": "/bin"}
    assert worker_environment("augury-off@int8", env) == env


def _settings(folder) -> SystemSettings:
    return SystemSettings(str(folder), "float32", "cpu", 1, 32, threads=1)


@pytest.mark.parametrize("user_policy", [None, "ACTIVE"])
def test_a_peer_worker_gets_the_users_environment_not_augurys(user_policy, monkeypatch) -> None:
    """Variables augury set in this process (monkeypatched here as if augury had set them) do not
    reach a peer's worker; the user's own OMP_WAIT_POLICY does. The worker is another process."""
    monkeypatch.setenv("AUGURY_CPU_KERNELS", "0")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    user = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # the user's shell: no policy
    if user_policy:
        user["OMP_WAIT_POLICY"] = user_policy
    worker = WorkerSystem("transformers", _settings("unused"), user_env=user).start(load=False)
    try:
        env, info = worker.environ(), worker.process_info()
    finally:
        worker.close()
    assert not [k for k in env if k.startswith("AUGURY_")]
    assert env.get("OMP_WAIT_POLICY") == user_policy and info["omp_wait_policy"] == user_policy
    assert info["pid"] == worker.pid != os.getpid()


def test_a_peer_worker_by_default_drops_the_policy_augury_set(monkeypatch) -> None:
    """Without an explicit user environment the worker gets this process's environment at start,
    less what augury set: OMP_WAIT_POLICY as this process was started with it."""
    from augury.bench.worker import initial_environ

    start = initial_environ()
    if start is None:
        pytest.skip("no /proc/self/environ here")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("AUGURY_THREADS", "1")
    monkeypatch.setenv("SOME_USER_SETTING", "kept")
    worker = WorkerSystem("llama.cpp", _settings("unused")).start(load=False)
    try:
        env = worker.environ()
    finally:
        worker.close()
    assert env.get("OMP_WAIT_POLICY") == start.get("OMP_WAIT_POLICY")
    assert "AUGURY_THREADS" not in env and env["SOME_USER_SETTING"] == "kept"


def test_a_loaded_peer_runs_in_its_worker(tiny_checkpoint, monkeypatch) -> None:
    """transformers loaded in its worker: its pid, torch's thread count there, no kernels level."""
    monkeypatch.setenv("AUGURY_CPU_KERNELS", "0")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    user = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    worker = WorkerSystem("transformers", _settings(tiny_checkpoint("llama")), user_env=user).start()
    try:
        info = worker.wait_loaded()
        assert info["pid"] == worker.pid != os.getpid()
        assert info["threads"] == 1 and info["kernels_isa"] is None and info["omp_wait_policy"] is None
        out = worker.generate([[5, 6, 7]], 3)
        assert len(out) == 1 and len(out[0]) == 3
        assert worker.stats() == {"accept_length": 0.0, "spec_fraction": 0.0, "accept_by_kind": None,
                                  "mask_share": 0.0}
    finally:
        worker.close()
    assert worker.proc is None


def test_a_failing_load_is_the_workers_one_line_error(tmp_path) -> None:
    from augury.bench.worker import WorkerError

    worker = WorkerSystem("augury", _settings(tmp_path / "missing")).start()
    try:
        with pytest.raises(WorkerError, match="^augury: ") as err:
            worker.wait_loaded()
        assert "\n" not in str(err.value)
    finally:
        worker.close()


def test_bench_smoke_two_augury_systems_in_their_own_processes(tiny_checkpoint, tmp_path) -> None:
    from augury.bench.offline import BenchSettings, bench, format_table
    from augury.cpu import isa, kernels

    settings = BenchSettings(model=str(tiny_checkpoint("llama")), batch_sizes=(1,), prompt_len=4, output_len=4,
                             repeats=1, warmup=0, systems=("augury", "augury-off@int8"), out=str(tmp_path / "out"))
    rows, out = bench(settings, progress=False)
    report = json.loads((out / "offline.json").read_text())
    results = {r["system"]: r for r in report["results"]}
    assert set(results) == set(report["systems"]) == {"augury", "augury-off@int8"}
    pids = {r["pid"] for r in results.values()}
    assert len(pids) == 2 and os.getpid() not in pids
    for name, r in results.items():
        assert r["threads"] == 1  # the tests' torch threads, passed on to every system
        assert r["isa"] == isa.host_level() and r["kernels_isa"] == kernels.level()
        assert "omp_wait_policy" in r and report["systems"][name]["pid"] == r["pid"]
        assert r["output_tokens"] == 4 and len(r["seconds"]) == 1 and r["paired_ratios"]
    assert results["augury-off@int8"]["greedy_match"] <= 1.0
    table = format_table(rows)
    assert "process of" in table and str(results["augury"]["pid"]) in table


def test_bench_splits_each_run_into_first_tokens_and_decode(tiny_checkpoint, tmp_path) -> None:
    """augury (the engine's first_token_time) and transformers (a streamer) in their workers, batches of 1 and
    2: every row has a time to first tokens and a decode-only time per repeat, a decode-only rate over the
    tokens after each sequence's first, which leaves the prefill out so is at least the end-to-end rate, its
    paired ratio, a prefill share in (0, 1), all in the JSON and the table."""
    from augury.bench.offline import BenchSettings, bench, format_table

    settings = BenchSettings(model=str(tiny_checkpoint("llama")), batch_sizes=(1, 2), prompt_len=24, output_len=48,
                             repeats=2, warmup=1, systems=("augury", "transformers"), out=str(tmp_path / "out"))
    rows, out = bench(settings, progress=False)
    results = json.loads((out / "offline.json").read_text())["results"]
    assert len(results) == 4
    for r in results:
        assert len(r["first_token_seconds"]) == len(r["decode_seconds"]) == 2
        assert min(r["first_token_seconds"]) > 0 and min(r["decode_seconds"]) > 0
        # inside the run (CPython times both clocks on the one monotonic clock)
        assert all(f + d <= s for f, d, s in zip(r["first_token_seconds"], r["decode_seconds"], r["seconds"]))
        assert r["decode_tokens"] == r["output_tokens"] - r["batch_size"] == r["batch_size"] * 47
        assert r["decode_tokens_per_s"] >= r["tokens_per_s"] > 0
        assert 0 < r["prefill_share"] < 1 and r["decode_paired_ratio"] > 0
        assert len(r["decode_paired_ratios"]) == 2
    assert all(r["decode_paired_ratio"] == 1.0 for r in results if r["system"] == "augury")
    table = format_table(rows)
    head = table.splitlines()[0]
    assert all(col in head for col in ("dec tok/s", "dec paired", "prefill %"))
    assert f"{rows[0].decode_tokens_per_s:.1f}" in table.splitlines()[2]


def test_decode_only_figures_from_the_runs_splits_and_none_without_them() -> None:
    """The decode-only rate is the tokens after each sequence's first over the median decode-only seconds,
    paired against the reference's; a system that gives no split (a registered one without
    first_token_times) has none, shown as '-', and neither has its paired ratio."""
    from augury.bench.offline import BenchSettings, format_table, run_benchmark

    ref, fast, blind = _FakeWorker("a", 1.0, (0.5, 0.5)), _FakeWorker("b", 1.0, (0.75, 0.25)), _FakeWorker("c", 1.0)
    settings = BenchSettings(batch_sizes=(2,), prompt_len=3, output_len=4, repeats=3, warmup=0, systems=("a", "b", "c"))
    a, b, c = run_benchmark(settings, [ref, fast, blind], vocab_size=50, progress=False)
    assert a.decode_tokens == b.decode_tokens == 6  # 2 sequences of 4 tokens, less their first
    assert a.decode_tokens_per_s == pytest.approx(12.0) and b.decode_tokens_per_s == pytest.approx(24.0)
    assert b.decode_paired_ratio == pytest.approx(2.0) and b.paired_ratio == pytest.approx(1.0)
    assert a.prefill_share == pytest.approx(0.5) and b.prefill_share == pytest.approx(0.75)
    assert c.decode_tokens_per_s is c.decode_paired_ratio is c.prefill_share is None and c.decode_seconds is None
    assert c.to_dict()["decode_tokens_per_s"] is None
    line = format_table([a, b, c]).splitlines()[4]
    assert line.split()[-3:] == ["-", "-", "-"]
    # a reference without a split: nobody has a paired decode-only ratio, the others keep their rate
    _, b2 = run_benchmark(BenchSettings(batch_sizes=(2,), prompt_len=3, output_len=4, repeats=1, warmup=0),
                          [_FakeWorker("c", 1.0), _FakeWorker("b", 1.0, (0.75, 0.25))], vocab_size=50, progress=False)
    assert b2.decode_paired_ratio is None and b2.decode_tokens_per_s == pytest.approx(24.0)


class _FakeWorker:
    """A worker's System side, recording which timed runs reached it; split: what each timed run reports as
    its (seconds to first tokens, decode-only seconds), None for a system that does not know."""

    def __init__(self, name: str, speed: float, split: tuple[float, float] | None = None) -> None:
        self.name, self.speed, self.info, self.split = name, speed, {"pid": id(self)}, split
        self.timed: list[int] = []  # the pool's run counter at each timed run
        self.warmed = 0

    def supports(self, batch_size: int) -> bool:
        return True

    def timed_run(self, groups, output_len, stop_at_eos=False):
        self.timed.append(len(self.timed))
        out = [[1] * output_len for prompts in groups for _ in prompts]
        return out, self.speed, self.speed, self.split

    def generate(self, prompts, output_len, stop_at_eos=False):
        self.warmed += 1
        return [[1] * output_len for _ in prompts]

    def reset_counts(self) -> None:
        pass

    def stats(self, kinds=None):
        return {"accept_length": self.speed, "spec_fraction": 0.0, "mask_share": 0.0,
                "accept_by_kind": None if kinds is None else {k: self.speed for k in kinds}}

    def accept_by_kind(self, kinds):
        return self.stats(kinds)["accept_by_kind"]

    def close(self) -> None:
        self.closed = True


def test_a_system_in_several_processes_takes_turns_between_them_over_the_repeats() -> None:
    """--processes 2: each system's repeats alternate between its two processes (r % 2), every process
    is warmed up, and a process slower than its twin shows in the ratios as the mean of the two, not
    as the whole run's offset."""
    from augury.bench.offline import BenchSettings, run_benchmark
    from augury.bench.worker import WorkerPool

    ref = WorkerPool([_FakeWorker("a", 1.0), _FakeWorker("a", 1.0)])
    slow_twin = WorkerPool([_FakeWorker("b", 1.0), _FakeWorker("b", 1.1)])
    settings = BenchSettings(batch_sizes=(1, 2), prompt_len=3, output_len=4, repeats=4, warmup=1, systems=("a", "b"))
    rows = run_benchmark(settings, [ref, slow_twin], vocab_size=50, progress=False)
    for pool in (ref, slow_twin):
        assert [len(w.timed) for w in pool.workers] == [4, 4]  # 2 batch sizes x repeats 0, 2 and 1, 3
        assert [w.warmed for w in pool.workers] == [2, 2]  # a warm-up per batch size in each process
    b = next(r for r in rows if r.system == "b" and r.batch_size == 1)
    assert sorted(round(x, 3) for x in b.paired_ratios) == [0.909, 0.909, 1.0, 1.0]
    assert b.accept_length == pytest.approx(1.05) and b.pid == slow_twin.workers[0].info["pid"]
    assert slow_twin.accept_by_kind({"k": []}) == {"k": pytest.approx(1.05)}
    with pytest.raises(ValueError, match="one system"):
        WorkerPool([_FakeWorker("a", 1.0), _FakeWorker("b", 1.0)])
    slow_twin.close()
    assert all(w.closed for w in slow_twin.workers)


def test_bench_processes_option_starts_that_many_workers_per_system(tiny_checkpoint, tmp_path) -> None:
    """`augury bench --processes 2` end to end: two worker processes for the system, its two repeats one
    in each (the reported pid is the first's), a positive count required."""
    from augury.bench.offline import BenchSettings, bench, main

    settings = BenchSettings(model=str(tiny_checkpoint("llama")), batch_sizes=(1,), prompt_len=4, output_len=4,
                             repeats=2, warmup=0, systems=("augury",), out=str(tmp_path / "out"), processes=2)
    rows, out = bench(settings, progress=False)
    report = json.loads((out / "offline.json").read_text())
    assert report["settings"]["processes"] == 2 and len(rows[0].seconds) == 2
    assert rows[0].output_tokens == 4 and rows[0].pid not in (None, os.getpid())
    assert main(["--processes", "0", "--model", str(tiny_checkpoint("llama"))]) == 2


_FAKE_LLAMA_CPP = '''
class Llama:  # the little of llama-cpp-python's API the llama.cpp system uses
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_batch, verbose):
        self.n_threads = n_threads

    def reset(self):
        pass

    def set_seed(self, seed):
        pass

    def generate(self, prompt, **kwargs):
        while True:
            yield len(prompt)

    def close(self):
        pass
'''


def test_the_llama_cpp_worker_loads_no_torch(tmp_path, monkeypatch) -> None:
    """The llama.cpp system (a stand-in llama_cpp module on the user's PYTHONPATH) in its worker:
    its n_threads reported, no torch (nor its OpenMP runtime) loaded, no augury variables."""
    fake = tmp_path / "site" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(_FAKE_LLAMA_CPP)
    monkeypatch.setenv("AUGURY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    user = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    user["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fake.parent), user.get("PYTHONPATH")]))
    settings = SystemSettings(str(tmp_path), "float32", "cpu", 1, 32, gguf=str(tmp_path / "x.gguf"), threads=2,
                              eos_ids=(2,))
    worker = WorkerSystem("llama.cpp", settings, user_env=user).start()
    try:
        info = worker.wait_loaded()
        assert info["threads"] == 2 and info["kernels_isa"] is None and info["omp_wait_policy"] is None
        assert info["pid"] == worker.pid != os.getpid()
        assert worker.generate([[5, 6, 7]], 4) == [[3, 3, 3, 3]]
        out, wall, _, split = worker.timed_run([[[5, 6, 7]], [[5, 6]]], 4)  # its first token timed as it came
        assert out == [[3, 3, 3, 3], [2, 2, 2, 2]] and split is not None and min(split) >= 0 and split[0] > 0
        assert worker.supports(1) and not worker.supports(2)
        assert not worker.imported("torch")
        assert "AUGURY_CACHE_DIR" not in worker.environ()
    finally:
        worker.close()


def test_a_registered_system_reaches_its_worker_by_name(monkeypatch) -> None:
    """A registered factory is imported by the worker; one that cannot be (a lambda) is refused
    in this process with a message saying so."""
    from augury import bench
    from augury.bench.worker import _portable_factory

    monkeypatch.setitem(bench.SYSTEMS, "peer-module", json.dumps)  # any importable module-level function
    monkeypatch.setitem(bench.SYSTEMS, "peer-lambda", lambda s: None)
    assert _portable_factory("augury-static:3-2-4") is None  # built in: found by name in the worker
    assert pickle.loads(_portable_factory("peer-module")) is json.dumps
    with pytest.raises(ValueError, match="module-level function"):
        _portable_factory("peer-lambda")


class _StoppingWorker(_FakeWorker):
    """A fake whose sequences end at their EOS after `lengths[i]` tokens, at most output_len."""

    def __init__(self, name: str, lengths: list[int]) -> None:
        super().__init__(name, 1.0)
        self.lengths = lengths

    def timed_run(self, groups, output_len, stop_at_eos=False):
        prompts = [p for g in groups for p in g]
        out = [[1] * min(self.lengths[i % len(self.lengths)], output_len) for i in range(len(prompts))]
        return out, self.speed, self.speed, self.split


def test_sequences_the_length_cap_cut_are_counted_and_reported() -> None:
    """--stop-at-eos: a sequence that reached --output-len ended at the cap, not at its EOS (a JSON answer
    cut short); each row counts them over the first timed repeat and the table says so; none, no line."""
    from augury.bench.offline import BenchSettings, default_output_len, format_table, run_benchmark
    from augury.bench.json_prompts import JSON_OUTPUT_LEN

    settings = BenchSettings(batch_sizes=(2,), prompt_len=3, output_len=6, repeats=1, warmup=0, systems=("a", "b"),
                             stop_at_eos=True)
    a, b = run_benchmark(settings, [_StoppingWorker("a", [3, 9]), _StoppingWorker("b", [2, 4])], vocab_size=50,
                         progress=False)
    assert (a.cut, a.sequences, b.cut, b.sequences) == (1, 2, 0, 2)
    assert "(cut short): b2 a 1/2" in format_table([a, b])
    assert "cut short" not in format_table([b])
    # the CLI's default leaves a JSON answer room to end; the other prompts keep the general default
    assert default_output_len("json") == JSON_OUTPUT_LEN > 154 and default_output_len("chat") == BenchSettings().output_len
