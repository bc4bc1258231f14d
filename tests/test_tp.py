"""Tensor parallelism (augury/distributed, models/llama.py's shards).

The shards' arithmetic in one process (ranks as threads summing through a barrier: any rank count,
no cores needed), then real ranks: two processes over gloo, as `LLM(..., tensor_parallel_size=2)`
starts them: float32 logits against one process, greedy answers, speculative == plain, a rank that
fails to load, and the errors for numbers that do not split."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from augury import LLM, SamplingParams
from augury.attention import PagedBackend
from augury.core.kv_cache import KVCache
from augury.models.config import TargetConfig
from augury.models.llama import plan_shards
from augury.models.loader import load_target
from augury.stages import StartupError
from conftest import random_prompts
from test_quant import q4_gguf  # noqa: F401 - the fixture: a tiny GGUF in Q4_0/Q4_1 with its int4 side file

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")


def _llama(folder: Path, heads: int, kv_heads: int, hidden: int = 96, inter: int = 192, vocab: int = 256,
           seed: int = 0) -> Path:
    """A tiny random Llama with the head counts asked for (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      initializer_range=0.15, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).float().save_pretrained(str(folder))
    return folder


# ---------------------------------------------------------------------------------------- the plan

def test_plan_splits_kv_groups_evenly_where_it_can_and_names_the_numbers_where_it_cannot(tiny_checkpoint) -> None:
    cfg = TargetConfig.from_folder(tiny_checkpoint("llama"))  # 4 heads, 2 KV heads, 128 MLP columns, 256 words
    two = plan_shards(cfg, 2)
    assert [(s.heads, s.kv_heads, s.inter, s.vocab) for s in two] == [
        ((0, 2), (0, 1), (0, 64), (0, 128)), ((2, 4), (1, 2), (64, 128), (128, 256))]
    four = plan_shards(cfg, 4)  # more ranks than KV heads: each KV head on two ranks, one query head each
    assert [s.kv_heads for s in four] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.heads for s in four] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="tensor_parallel_size 3 exceeds the model's 2 KV heads"):
        plan_shards(cfg, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 exceeds the model's 2 KV heads.*4 query heads"):
        plan_shards(cfg, 8)
    # the demo's shape: 9 heads over 3 KV heads on 2 ranks is 3 + 6 (whole KV groups; rank 0, which also runs
    # the engine, the lighter share), MLP and vocab even
    demo = TargetConfig.from_dict({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                                   "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                                   "vocab_size": 49152})
    assert [(s.heads, s.inter, s.vocab) for s in plan_shards(demo, 2)] == [
        ((0, 3), (0, 768), (0, 24576)), ((3, 9), (768, 1536), (24576, 49152))]


# ------------------------------------------------------------------- shards as threads, one process

class _ThreadGroup:
    """models.llama.Collectives for ranks that are threads of one process (a barrier, sums in rank order)."""

    def __init__(self, rank: int, size: int, shared: dict) -> None:
        self.rank, self.size, self.shared = rank, size, shared

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.shared["slots"][self.rank] = t.clone()
        self.shared["barrier"].wait()
        got = list(self.shared["slots"])
        self.shared["barrier"].wait()
        return got

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return t.copy_(total)

    def gather_vocab(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=-1)

    def shared_exchange(self) -> None:
        return None

    def failed(self, what: str) -> Exception:
        return RuntimeError(what)


def _threaded_logits(folder: Path, size: int, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits of a prefill and of one decode step after it, the model split over `size` threads."""
    cfg = TargetConfig.from_folder(folder)
    shards = plan_shards(cfg, size) if size > 1 else [None]
    shared = {"slots": [None] * size, "barrier": threading.Barrier(size)}
    out: list = [None] * size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            group = _ThreadGroup(r, size, shared) if size > 1 else None
            model, _ = load_target(folder, torch.float32, torch.device("cpu"), 64, "none", shards[r], group)
            kv = KVCache(cfg.num_layers, 4, 16, model.cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
            backend, n = PagedBackend(kv.k, kv.v, 16), len(prompt)
            with torch.inference_mode():
                h, _ = model(torch.tensor([prompt]), torch.arange(n)[None], backend.prepare_prefill([[1, 2]], [0], [n]))
                first = model.logits(h[0])
                h, _ = model(torch.tensor([[prompt[-1]]]), torch.tensor([[n]]), backend.prepare_decode([[1, 2]], [n]))
                out[r] = (first, model.logits(h[:, 0]))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out[0]


@pytest.mark.parametrize("heads,kv_heads,sizes", [
    (4, 2, (2, 4)),  # even; 4 ranks: KV heads replicated
    (6, 3, (2, 3, 6)),  # 2 ranks: KV groups 2 + 1 (the demo's case); 6: each KV head on 2 ranks
])
def test_sharded_logits_equal_one_process_in_float32(tmp_path, heads, kv_heads, sizes) -> None:
    folder = _llama(tmp_path / "m", heads, kv_heads)
    prompt = random_prompts([11], seed=4)[0]
    want = _threaded_logits(folder, 1, prompt)
    for size in sizes:
        got = _threaded_logits(folder, size, prompt)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- two ranks over gloo

def _close(llm: LLM) -> None:
    llm.engine.model.close()


def _logits(engine, prompt: list[int]) -> torch.Tensor:
    """The engine's own target over a prompt in free blocks: float32 logits [len, V] (rank 0 gathers)."""
    n = len(prompt)
    attn = engine.attention.prepare_prefill([[1, 2, 3]], [0], [n])
    with torch.inference_mode():
        h, _ = engine.model(torch.tensor([prompt]), torch.arange(n)[None], attn, ())
        return engine.model.logits(h[0])


@TWO_CORES
def test_two_ranks_give_one_process_logits_and_greedy_answers(tiny_checkpoint) -> None:
    folder = tiny_checkpoint("llama")
    prompts = random_prompts([5, 17, 3, 9, 26], seed=7)  # varied lengths, one batch
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 7, 16, 9, 5)]
    common = dict(dtype="float32", device="cpu", speculative_algorithm="none", log_stats_interval=0.0)
    one = LLM(str(folder), **common)
    want_logits = [_logits(one.engine, p) for p in prompts[:2]]
    want = [o.token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM(str(folder), tensor_parallel_size=2, **common)
    try:
        for p, w in zip(prompts[:2], want_logits):
            torch.testing.assert_close(_logits(two.engine, p), w, rtol=0, atol=1e-4)
        got = [o.token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert got == want
        stats = two.engine.model.group.stats()
        assert stats["size"] == 2 and stats["backend"].startswith("gloo") and stats["calls"]["all_reduce"] > 0
    finally:
        _close(two)


@TWO_CORES
def test_two_ranks_speculative_static_tree_equals_plain(tmp_path) -> None:
    from speculative_helpers import make_target, random_head

    target, head = make_target(tmp_path / "target"), random_head(tmp_path / "head")
    llm = LLM(str(target), draft_model=str(head), speculative_algorithm="eagle3", speculative_policy="static",
              speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6, dtype="float32",
              device="cpu", log_stats_interval=0.0, tensor_parallel_size=2)
    try:
        # the replicated head reads the whole embedding (rank 0's shard holds half of its rows)
        from safetensors.torch import load_file

        embed = llm.engine.speculator.proposer.head.embed.weight
        assert torch.equal(embed, load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"])
        prompts = random_prompts([6, 9, 4], seed=5)
        lengths = (20, 13, 26)
        plain = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                      max_draft_tokens=0) for n in lengths], use_tqdm=False)
        spec = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                      for n in lengths], use_tqdm=False)
        assert sum(o.spec_stats.num_verify_steps for o in spec) > 0
        assert sum(o.spec_stats.num_verify_steps for o in plain) == 0
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    finally:
        _close(llm)


@TWO_CORES
def test_a_rank_that_fails_to_load_stops_start_up_and_leaves_nothing_running(tiny_checkpoint, monkeypatch) -> None:
    from augury.distributed import launch

    started: list = []
    real = launch.spawn_local

    def spawn(*args, **kwargs):
        children = real(*args, **kwargs)
        started.extend(children.values())
        return children

    monkeypatch.setattr(launch, "spawn_local", spawn)
    monkeypatch.setenv("AUGURY_FAULT_INJECT", "target@rank1")
    with pytest.raises(StartupError) as info:
        LLM(str(tiny_checkpoint("llama")), dtype="float32", device="cpu", speculative_algorithm="none",
            tensor_parallel_size=2)
    assert info.value.stage == "target"
    assert "tensor-parallel rank 1 failed to load its shard: fault injected" in str(info.value.cause)
    assert started and all(p.poll() is not None for p in started)
    assert not torch.distributed.is_initialized()
    assert launch.status() == {"size": 1, "backend": None}


def test_numbers_that_do_not_split_are_refused_before_anything_starts(tiny_checkpoint) -> None:
    folder = str(tiny_checkpoint("llama"))
    with pytest.raises(StartupError, match="tensor_parallel_size 3 exceeds the model's 2 KV heads"):
        LLM(folder, dtype="float32", device="cpu", tensor_parallel_size=3)
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(StartupError, match=f"more than its {cores} CPU cores"):
        LLM(folder, dtype="float32", device="cpu", tensor_parallel_size=2 * cores, nnodes=1)
    with pytest.raises(ValueError, match="nnodes > 1 needs dist_init_addr"):
        LLM(folder, tensor_parallel_size=2, nnodes=2)


@TWO_CORES
@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_two_ranks_fused_stack_speculative_equals_plain(tmp_path, monkeypatch, shared_memory) -> None:
    """bfloat16 int4: every rank's fused stack, summing in shared memory (one call per forward) or through
    gloo between half-layers (AUGURY_TP_SHM=0); verified trees give plain decoding's tokens either way."""
    from augury.cpu import kernels as cpu_kernels
    from augury.models import fused
    from speculative_helpers import make_target, random_head

    if cpu_kernels.forward() is None:
        pytest.skip("augury's fused-stack kernel does not run here")
    monkeypatch.setenv("AUGURY_TP_SHM", shared_memory)
    runs = {"fused": 0}
    real = fused.FusedStack.run

    def run(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        runs["fused"] += out is not None
        return out

    monkeypatch.setattr(fused.FusedStack, "run", run)
    target, head = make_target(tmp_path / "target"), random_head(tmp_path / "head")
    llm = LLM(str(target), draft_model=str(head), speculative_algorithm="eagle3", speculative_policy="static",
              speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6, dtype="bfloat16",
              quantization="int4", device="cpu", log_stats_interval=0.0, tensor_parallel_size=2,
              speculative_suffix_cache_tokens=0)  # else the plain run's answers would draft all of the spec run's
    try:
        group = llm.engine.model.group
        assert (group.shared_exchange() is not None) == (shared_memory == "1")
        prompts = random_prompts([6, 9, 4], seed=5)
        lengths = (20, 13, 26)
        plain = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                      max_draft_tokens=0) for n in lengths], use_tqdm=False)
        before, sums = runs["fused"], group.calls["all_reduce"]
        spec = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                      for n in lengths], use_tqdm=False)
        assert runs["fused"] - before >= 10 and sum(o.spec_stats.num_verify_steps for o in spec) > 0
        # per fused forward: the embedding's sum, plus 2 per layer through gloo without shared memory
        per_forward = (group.calls["all_reduce"] - sums) / (runs["fused"] - before)
        assert per_forward < 2 if shared_memory == "1" else per_forward >= 2 * 6
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    finally:
        _close(llm)


# ------------------------------------------------------------------------------ serving and faults

def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@TWO_CORES
def test_a_two_rank_server_answers_the_openai_client_and_exits_when_a_rank_is_killed(tmp_path_factory) -> None:
    import signal
    import time

    import httpx
    import openai

    from helpers_server import serve, shared_tiny_checkpoint

    folder = shared_tiny_checkpoint(tmp_path_factory)
    with serve(["--model", str(folder), "--dtype", "float32", "--tensor-parallel-size", "2",
                "--speculative-algorithm", "none"]) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        card = client.models.list().data[0]
        assert card.model_extra["tensor_parallel_size"] == 2
        assert card.model_extra["tensor_parallel_backend"].startswith("gloo")
        answer = client.completions.create(model=card.id, prompt="hello world", max_tokens=8, temperature=0.0)
        assert answer.usage.completion_tokens == 8
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert 'augury:tensor_parallel_info{backend="gloo + shared memory",model_name=' in metrics
        workers = _children(server.proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        code = server.proc.wait(timeout=60)
        assert time.monotonic() - start < 60 and code != 0
        time.sleep(0.5)  # the pump thread's last lines
        assert f"tensor-parallel rank 1 (pid {workers[0]}) was killed by SIGKILL" in server.log
        assert not any(_alive(p) for p in workers)


@TWO_CORES
def test_a_hung_rank_is_named_and_stopped_within_the_timeout(tiny_checkpoint, monkeypatch) -> None:
    import signal
    import time

    from augury.distributed import launch

    # in-process, the call raises; an earlier test that ran the CLI's main() in this process (which
    # makes a failed rank end the process, as `augury generate` should) must not make it exit here
    monkeypatch.setattr(launch, "_exit_on_failure", False)

    before = set(_children(os.getpid()))  # earlier tests' ranks may still be alive: not this LLM's
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", device="cpu", speculative_algorithm="none",
              log_stats_interval=0.0, tensor_parallel_size=2, dist_timeout=3.0)
    try:
        workers = [p for p in _children(os.getpid()) if p not in before]
        worker = [p for p in workers if _alive(p)][-1]
        os.kill(worker, signal.SIGSTOP)  # alive, silent: no heartbeat, never at the next collective
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 stopped responding"):
            llm.generate(random_prompts([5], seed=1), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - start < 20
        time.sleep(0.2)
        assert not _alive(worker)
    finally:
        _close(llm)
    assert not torch.distributed.is_initialized()


_RANK_SCRIPT = """
import os, sys
import torch
torch.set_num_threads(1)
from augury import LLM, SamplingParams
kwargs = dict(tensor_parallel_size=2, nnodes=2, node_rank=int(sys.argv[2]), dist_init_addr=sys.argv[3]) \\
    if len(sys.argv) > 2 else {}
llm = LLM(sys.argv[1], dtype="float32", device="cpu", speculative_algorithm="none", log_stats_interval=0.0, **kwargs)
out = llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                   use_tqdm=False)
print("tokens", [o.token_ids for o in out], llm.engine.model.group.stats()["backend"], flush=True)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _want_tokens(folder: Path) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float32", device="cpu", speculative_algorithm="none", log_stats_interval=0.0)
    out = llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    return [o.token_ids for o in out]


@TWO_CORES
def test_ranks_started_by_torchrun(tiny_checkpoint, tmp_path) -> None:
    import shutil
    import subprocess
    import sys

    from helpers_server import server_env

    if shutil.which("torchrun") is None:
        pytest.skip("no torchrun")
    folder = tiny_checkpoint("llama")
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(_free_port()), str(script), str(folder)], env=server_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("tokens")]
    assert len(lines) == 1  # rank 0 answers; torchrun's rank 1 served it and left when it was done
    assert lines[0] == f"tokens {_want_tokens(folder)} gloo + shared memory"


@TWO_CORES
def test_two_machines_meet_at_dist_init_addr(tiny_checkpoint, tmp_path) -> None:
    """--nnodes 2 with one rank per "machine", both on this host (loopback, gloo, no shared memory)."""
    import subprocess
    import sys

    from helpers_server import server_env

    folder = tiny_checkpoint("llama")
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    addr = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), str(folder), str(k), addr], env=server_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in (1, 0)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[1][1][-2000:] + outs[0][1][-2000:]
    assert outs[0][0] == ""  # machine 1 computes and prints nothing
    assert outs[1][0].strip() == f"tokens {_want_tokens(folder)} gloo"  # across machines: gloo alone


@TWO_CORES
def test_two_ranks_read_their_slices_of_a_gguf_native_int4_file(q4_gguf) -> None:
    """The int4 side file of a GGUF conversion sliced per rank (rows, or whole groups of 32 columns, of its
    codes, scales and zeros; the MLP's 96 columns split 32 + 64): float32 logits as one process's."""
    from augury.models import quant

    _, folder, _ = q4_gguf
    prompt = [5, 70, 256, 257, 33, 100, 12]
    common = dict(dtype="float32", quantization="int4", device="cpu", speculative_algorithm="none",
                  log_stats_interval=0.0)
    want = _logits(LLM(str(folder), **common).engine, prompt)
    two = LLM(str(folder), tensor_parallel_size=2, **common)
    try:
        local = two.engine.model.local
        assert local.quantization == "int4" and isinstance(local.layers[0].mlp.down_proj, quant.Int4Linear)
        assert local.layers[0].mlp.down_proj.in_features == 32
        torch.testing.assert_close(_logits(two.engine, prompt), want, rtol=0, atol=1e-4)
    finally:
        _close(two)
