"""The KV cache's memory: the sizing rule (core/kv_budget.py), a too-long --max-model-len refused at
start-up naming both numbers, the start-up line and /server_info's size in tokens, a cache whose
memory is taken only as it is written, and --kv-cache-dtype (exact where the cache is wider)."""
from __future__ import annotations

import gc
import re

import httpx
import pytest
import torch

from augury import LLM, SamplingParams
from augury.config import EngineConfig, one_line
from augury.core.kv_budget import DEFAULT_FLOOR_BYTES, GIB, MIB, plan_kv_cache
from augury.core.kv_cache import KVCache
from conftest import random_prompts
from helpers_server import make_tiny_checkpoint, run_serve, serve, shared_tiny_checkpoint
from speculative_helpers import checkpoints

SLACK, MIN_CONTEXT = 64, 16
# SmolLM2-135M (the demo) in bfloat16: 30 layers x 3 KV heads x 64, K and V; its head adds one layer
DEMO_TOKEN = 2 * 30 * 3 * 64 * 2 + 2 * 1 * 3 * 64 * 2


def _plan(**kw):
    args = dict(bytes_per_token=DEMO_TOKEN, block_size=16, max_num_seqs=64, model_len=8192, len_given=False,
                num_kv_blocks=None, memory_gb=None, available_bytes=16 * GIB, slack=SLACK, min_context=MIN_CONTEXT)
    args.update(kw)
    return plan_kv_cache(**args)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# ------------------------------------------------------------------ the sizing rule
def test_automatic_size_is_two_full_requests_for_the_demo() -> None:
    p = _plan()
    seq_blocks = -(-(8192 + SLACK) // 16)
    assert p.num_blocks == 2 * seq_blocks + 1 and p.tokens == 2 * seq_blocks * 16
    assert p.max_model_len == 8192 and not p.lowered
    assert 300 * MIB < p.nbytes < 400 * MIB  # the demo's cache: a few hundred MiB, not 2 GiB
    one = _plan(max_num_seqs=1)  # one request at a time needs one context's room
    assert one.num_blocks == seq_blocks + 1 and one.max_model_len == 8192


def test_automatic_size_floor_and_what_the_requests_can_use() -> None:
    # a large token (100 KB) and a short context: two requests need less than the floor, the floor wins
    p = _plan(bytes_per_token=100_000, model_len=1024)
    assert p.num_blocks == -(-DEFAULT_FLOOR_BYTES // (100_000 * 16)) and "256 MiB" in p.sizing
    # a tiny model: every request at the full context needs less than the floor, and that is all it gets
    tiny = _plan(bytes_per_token=512, model_len=256)
    assert tiny.num_blocks == 64 * -(-(256 + SLACK) // 16) + 1 and "64 request(s)" in tiny.sizing


def test_machine_memory_caps_the_automatic_size_and_lowers_an_automatic_length() -> None:
    # an 8B-like model (128 KiB a token) at 128k: two contexts would be 32 GiB; 4 GiB are available
    p = _plan(bytes_per_token=131072, model_len=131072, available_bytes=4 * GIB)
    assert p.nbytes <= 2 * GIB and p.num_blocks == 2 * GIB // (131072 * 16)
    assert p.lowered and p.max_model_len == p.tokens - SLACK and p.model_len == 131072
    line = p.line("bfloat16")
    assert f"{p.tokens:,} tokens" in line and "131,072 lowered" in line and "50% of the 4.0 GiB" in line


def test_a_given_length_the_cache_cannot_hold_is_an_error_naming_both() -> None:
    with pytest.raises(ValueError) as e:
        _plan(bytes_per_token=131072, model_len=131072, len_given=True, available_bytes=4 * GIB)
    holds = (2 * GIB // (131072 * 16) - 1) * 16 - SLACK
    assert "max_model_len 131072 does not fit" in str(e.value) and f"at most {holds}" in str(e.value)
    # the explicit budget wins over what the machine has, and then it fits
    p = _plan(bytes_per_token=131072, model_len=131072, len_given=True, available_bytes=4 * GIB, memory_gb=20.0)
    assert p.max_model_len == 131072 and p.num_blocks == 20 * GIB // (131072 * 16)
    assert "more than the 4.0 GiB available" in p.sizing


def test_explicit_sizes_win() -> None:
    assert _plan(num_kv_blocks=100).num_blocks == 100
    assert _plan(memory_gb=0.1).num_blocks == int(0.1 * GIB) // (DEMO_TOKEN * 16)
    # a budget beyond what every request at the full context needs is not taken
    assert _plan(memory_gb=100.0, max_num_seqs=2).num_blocks == 2 * -(-(8192 + SLACK) // 16) + 1
    with pytest.raises(ValueError, match="leaves a context of 0 tokens"):
        _plan(num_kv_blocks=4)


def test_kv_options_are_validated() -> None:
    assert EngineConfig.create().kv_cache_memory_gb is None
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float16, float32"):
        EngineConfig.create(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_memory_gb must be a positive number"):
        EngineConfig.create(kv_cache_memory_gb=0)


# ------------------------------------------------------------------ start-up, as a user sees it
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return shared_tiny_checkpoint(tmp_path_factory)


def test_start_up_line_and_server_info_give_the_size_in_tokens(tiny) -> None:
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "4"]) as sp:
        info = httpx.get(f"{sp.base_url}/server_info").json()["engine"]
        line = re.search(r"KV cache: ([\d,]+) tokens \(([\d,]+) blocks of (\d+), float32", sp.log)
    assert line, sp.log
    tokens, blocks = int(line.group(1).replace(",", "")), int(line.group(2).replace(",", ""))
    kv = info["kv_cache"]
    assert kv["tokens"] == tokens == (info["num_kv_blocks"] - 1) * info["block_size"]
    assert kv["num_blocks"] == blocks and kv["dtype"] == "float32"
    # 4 requests of the tiny model's full context (256 positions + 64 of draft slack)
    assert tokens == 4 * 320 and info["max_model_len"] == 256 and kv["max_model_len_lowered_from"] is None


def test_too_long_max_model_len_stops_start_up_naming_both_numbers(tiny) -> None:
    proc = run_serve(["--model", str(tiny), "--dtype", "float32", "--max-model-len", "250", "--num-kv-blocks", "10"])
    err = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and err, proc.stderr
    assert err[-1].startswith("augury: error: start-up failed at stage 'KV cache': --max-model-len 250 does not fit")
    assert "at most 80" in err[-1] and "--kv-cache-memory-gb" in err[-1]


def test_an_automatic_length_is_lowered_and_said(tiny, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="augury.startup"):
        llm = LLM(str(tiny), dtype="float32", device="cpu", num_kv_blocks=10, log_stats_interval=0)
    assert llm.engine.max_model_len == 9 * 16 - SLACK
    assert "max_model_len 80 (the model's 256 lowered to what the cache holds" in caplog.text
    with pytest.raises(Exception) as e:
        LLM(str(tiny), dtype="float32", device="cpu", num_kv_blocks=10, max_model_len=81)
    assert "--max-model-len 81 does not fit" in one_line(e.value) and "at most 80" in one_line(e.value)


# ------------------------------------------------------------------ memory taken as written
def test_cache_memory_is_taken_as_slots_are_written() -> None:
    layers, blocks, bs, nkv, hd = 8, 4096, 16, 8, 128  # 8 x 65536 slots x 1024 values x 2 tensors x 4 B: 4 GiB
    gc.collect()
    before = _rss_kib()
    kv = KVCache(layers, blocks, bs, nkv, hd, torch.float32, torch.device("cpu"))
    assert kv.k.nbytes + kv.v.nbytes == 4 * GIB
    assert _rss_kib() - before < 32 * 1024, "the cache's nominal size became resident at start"
    # never-written slots read as zeros (attention reads padding slots with zero weight: 0 * NaN is NaN)
    assert kv.k[:, : 64 * bs].abs().max().item() == 0.0 and kv.v[-1, -bs:].abs().max().item() == 0.0
    written = slice(bs, 65 * bs)  # 64 blocks of every layer: 8 x 1024 slots x 4 KiB x 2 = 64 MiB
    kv.k[:, written] = 1.0
    kv.v[:, written] = 2.0
    grew = _rss_kib() - before
    assert 60 * 1024 < grew < 128 * 1024, grew  # (transparent huge pages may round each run up to 2 MiB)
    kv.copy_slots(torch.arange(bs, 2 * bs), torch.arange(2 * bs, 3 * bs))
    assert kv.v[3, 2 * bs].max().item() == 2.0


def test_engine_start_up_does_not_make_the_cache_resident(tmp_path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "long", max_positions=65536)
    LLM(str(folder), dtype="float32", device="cpu", num_kv_blocks=64, log_stats_interval=0)  # kernels loaded
    gc.collect()
    before = _rss_kib()
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory_gb=2.0, log_stats_interval=0)
    kv = llm.engine.kv
    assert kv.k.nbytes + kv.v.nbytes > 1.9 * GIB
    out = llm.generate(random_prompts([20, 30], seed=3), SamplingParams(max_tokens=8, temperature=0.0),
                       use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in out)
    grew = _rss_kib() - before
    assert grew < 256 * 1024, f"RSS grew {grew // 1024} MiB with a 2 GiB cache"


# ------------------------------------------------------------------ --kv-cache-dtype
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_float32_cache_gives_a_bfloat16_model_the_same_greedy_answers(tiny_checkpoint) -> None:
    folder = tiny_checkpoint("llama")
    prompts = random_prompts([9, 4, 14, 6, 30], seed=21)
    runs = {}
    for kv_dtype in ("auto", "float32"):
        llm = LLM(str(folder), dtype="bfloat16", device="cpu", kv_cache_dtype=kv_dtype, log_stats_interval=0)
        assert llm.engine.kv.k.dtype == (torch.bfloat16 if kv_dtype == "auto" else torch.float32)
        assert llm.dtype == torch.bfloat16
        runs[kv_dtype] = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert runs["auto"] == runs["float32"]


def test_a_narrower_cache_keeps_speculation_exact(tmp_path_factory) -> None:
    """A float32 model over a bfloat16 cache: every path reads keys as stored, so greedy EAGLE-3
    still equals greedy plain decoding token for token (the cache's rounding changes both alike)."""
    ck = checkpoints(tmp_path_factory.mktemp("kvspec"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    outs = {}
    for name, kw in {"plain": dict(speculative_algorithm="none"),
                     "eagle3": dict(draft_model=str(ck["bigram_head"]), speculative_algorithm="eagle3",
                                    speculative_policy="static", speculative_num_steps=3,
                                    speculative_eagle_topk=2, speculative_num_draft_tokens=6)}.items():
        llm = LLM(str(ck["bigram"]), dtype="float32", device="cpu", kv_cache_dtype="bfloat16",
                  log_stats_interval=0, **kw)
        assert llm.engine.kv.k.dtype == torch.bfloat16
        outs[name] = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert outs["eagle3"] == outs["plain"]
