"""`augury bench --workload scale` (bench/scale.py, scale_gguf.py, scale_worker.py) on the tiny shape.

References: gguf-py (dequantised values, its unpacking of K-quant scales, its reader), transformers'
own GGUF loading (greedy tokens of the written file in float32), published llama.cpp file sizes, and
llama.cpp itself loading and decoding the file.
"""
from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from augury.bench import scale_gguf as sg

QT = gguf.GGMLQuantizationType
VOCAB = 1024
has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda t: t.name)
def test_random_blocks_are_weights_of_a_sane_spread(qtype) -> None:
    raw = sg.random_blocks(qtype, 32, 4096, np.random.default_rng(int(qtype)))
    values = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float64).reshape(32, 4096)
    assert np.isfinite(values).all()
    assert 0.85 * sg.SIGMA < values.std() < 1.15 * sg.SIGMA
    assert abs(values.mean()) < 0.15 * sg.SIGMA
    rows = values.std(axis=1)  # every row alike, no row of zeros or of huge values
    assert rows.min() > 0.7 * sg.SIGMA and rows.max() < 1.3 * sg.SIGMA
    assert np.unique(values).size > 1000


def test_k_scales_pack_as_gguf_py_unpacks_them() -> None:
    rng = np.random.default_rng(5)
    sc, m = rng.integers(0, 64, (100, 8), dtype=np.uint8), rng.integers(0, 64, (100, 8), dtype=np.uint8)
    got_sc, got_m = gguf.quants.Q4_K.get_scale_min(sg._pack_k_scales(sc, m))
    assert np.array_equal(got_sc, sc) and np.array_equal(got_m, m)


# llama.cpp's own files as Hugging Face lists them, GB (bartowski's Meta-Llama-3.1-8B-Instruct-GGUF,
# Llama-3.2-3B-Instruct-GGUF, Llama-3.2-1B-Instruct-GGUF): what llama-quantize writes for these shapes and types
# (their headers hold 280k merges more than ours, a few MB)
PUBLISHED = {("8b", "q4_k_m"): 4.92, ("8b", "q5_k_m"): 5.73, ("8b", "q6_k"): 6.60, ("8b", "q8_0"): 8.54,
             ("3b", "q4_k_m"): 2.02, ("3b", "q8_0"): 3.42, ("1b", "q4_k_m"): 0.81, ("1b", "q8_0"): 1.32}


@pytest.mark.parametrize("key", PUBLISHED, ids=lambda k: "-".join(k))
def test_the_type_mix_gives_llama_cpps_file_sizes(key) -> None:
    size, ftype = key
    assert abs(sg.file_bytes(size, ftype) / 1e9 / PUBLISHED[key] - 1) < 0.015


def test_q4_k_m_keeps_v_and_down_in_q6_k_in_about_half_the_layers() -> None:
    types = {name: qt for name, _, qt in sg.plan(sg.SHAPES["8b"], "q4_k_m", sg.LLAMA3_VOCAB)}
    for role in ("attn_v", "ffn_down"):
        six = [i for i in range(32) if types[f"blk.{i}.{role}.weight"] == QT.Q6_K]
        assert 12 <= len(six) <= 20 and {0, 31} <= set(six)
        assert all(types[f"blk.{i}.{role}.weight"] == QT.Q4_K for i in set(range(32)) - set(six))
    assert types["output.weight"] == QT.Q6_K and types["token_embd.weight"] == QT.Q4_K
    assert types["blk.5.attn_q.weight"] == QT.Q4_K and types["blk.5.attn_norm.weight"] == QT.F32
    tied = {name: qt for name, _, qt in sg.plan(sg.SHAPES["1b"], "q4_k_m", sg.LLAMA3_VOCAB)}
    assert "output.weight" not in tied and tied["token_embd.weight"] == QT.Q6_K


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    path, written = sg.ensure_gguf(tmp_path_factory.mktemp("scale"), "tiny", "q4_k_m", VOCAB, seed=3)
    assert written and sg.ensure_gguf(path.parent, "tiny", "q4_k_m", VOCAB, seed=3) == (path, False)  # reused
    return path


def test_the_file_holds_the_plan(tiny_file) -> None:
    reader = gguf.GGUFReader(tiny_file)
    got = {t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type) for t in reader.tensors}
    want = {name: (dims, qt) for name, dims, qt in sg.plan(sg.SHAPES["tiny"], "q4_k_m", VOCAB)}
    assert got == want
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == VOCAB
    assert QT.Q6_K in {qt for _, qt in got.values()} and QT.Q4_K in {qt for _, qt in got.values()}


def test_augury_decodes_the_file_as_transformers_does(tiny_file) -> None:
    """augury's greedy tokens (float32, weights dense: the file's exact values), scored by transformers' own
    GGUF loading (gguf-py's dequantisation, its own un-permuting of Q and K) on the same prefix: each is the
    reference's argmax or within 0.01 of it (a random model's near-ties; a wrong layout misses by ~0.1-0.5)."""
    from transformers import AutoModelForCausalLM

    from augury import LLM, SamplingParams

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_file.parent), gguf_file=tiny_file.name,
                                               dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB - 256, (5 + 3 * i,), generator=g).tolist() for i in range(3)]
    llm = LLM(str(tiny_file), dtype="float32", quantization="none", speculative_algorithm="none",
              log_stats_interval=0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    exact = 0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]  # [12, V]
        chosen = logits[torch.arange(12), torch.tensor(out.token_ids)]
        gap = logits.max(-1).values - chosen
        assert (gap <= 0.01).all(), gap
        exact += int((gap == 0).sum())
        top2 = logits.topk(2, -1).values
        assert float((top2[:, 0] - top2[:, 1]).median()) > 0.02  # the scores separate tokens: a real check
    assert exact >= 33  # of 36
    assert len({t for o in outs for t in o.token_ids}) > 3  # not a constant answer


def test_the_head_is_the_sglang_layout_over_a_random_draft_vocabulary(tmp_path) -> None:
    from safetensors.torch import load_file

    folder = sg.write_eagle3_head(tmp_path / "head", sg.SHAPES["tiny"], VOCAB, 300, seed=1)
    t = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 300
    assert t["fc.weight"].shape == (256, 3 * 256) and t["midlayer.self_attn.q_proj.weight"].shape == (256, 512)
    assert t["lm_head.weight"].shape == (300, 256) and t["t2d"].shape == (VOCAB,)
    ids = torch.arange(300) + t["d2t"]
    assert bool(t["t2d"][ids].all()) and int(t["t2d"].sum()) == 300 and len(set(ids.tolist())) == 300
    assert 0.015 < float(t["midlayer.mlp.down_proj.weight"].float().std()) < 0.025
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert sg.write_eagle3_head(folder, sg.SHAPES["tiny"], VOCAB, 300, seed=1) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not written again


def test_the_bench_measures_both_systems_and_the_speculative_step(tiny_file, tmp_path, capsys) -> None:
    from augury.bench.offline import main
    from augury.resolve import gguf_cache_dir

    systems = "augury,llama.cpp" if has_llama_cpp else "augury"
    conversion = gguf_cache_dir(tiny_file)
    rc = main(["--workload", "scale", "--sizes", "tiny", "--types", "q4_k_m", "--vocab", str(VOCAB), "--seed", "3",
               "--work-dir", str(tiny_file.parent), "--out", str(tmp_path / "out"), "--systems", systems,
               "--output-len", "6", "--repeats", "1", "--prefill-len", "48", "--context", "32", "--rows", "1,2,4",
               "--row-repeats", "1", "--spec-sizes", "tiny", "--spec-shape", "2-2-3", "--threads", "2", "--delete",
               "--rounds", "2"])
    text = capsys.readouterr().out
    assert rc == 0, text
    run = json.loads((tmp_path / "out" / "scale.json").read_text())["runs"][0]
    a = run["augury"]
    assert "error" not in a, a
    assert run["convert"]["first_load_s"] > 0
    assert all(a["decode"][b] > 0 for b in ("1", "8")) and a["prefill"] > 0 and a["load_rss_gb"] > 0
    assert a["rows"]["ratio"]["1"] == 1.0 and set(a["rows"]["ratio"]) == {"1", "2", "4"}
    s = run["spec"]
    assert "error" not in s, s
    assert len(s["levels_ms"]) == 2 and s["steps_timed"] > 0 and s["step_ms"] > s["draft_ms"] > 0
    assert sum(s["levels_ms"]) <= s["draft_ms"] * 1.5  # medians of parts of it
    if has_llama_cpp:
        c = run["llama.cpp"]
        assert "error" not in c, c
        assert all(c["decode"][b] > 0 for b in ("1", "8")) and c["prefill"] > 0 and len(c["tokens"]) == 8
        assert all(0 <= t < VOCAB for t in c["tokens"])
        q = run["ratios"]  # each round's pair, the systems' order alternating
        assert q["rounds"] == 2 and [len(run["rounds"][s]) for s in ("augury", "llama.cpp")] == [2, 2]
        pairs = [a["decode"]["1"] / b["decode"]["1"] for a, b in zip(run["rounds"]["augury"], run["rounds"]["llama.cpp"])]
        assert q["decode"]["1"] == statistics.median(pairs) and "| tiny | q4_k_m | 2 |" in text
    assert [("rows" in r) for r in run["rounds"]["augury"]] == [True, False]  # the rows table in the first round
    assert a["rounds_run"] == 2 and a["prefill"] == statistics.median(r["prefill"] for r in run["rounds"]["augury"])
    assert "| tiny | q4_k_m |" in text and "rows (a chain)" in text and "EAGLE-3 head" in text
    assert not tiny_file.exists() and not conversion.exists()  # --delete: the file and augury's conversion
