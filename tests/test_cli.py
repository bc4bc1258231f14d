"""The `augury` command: generate prints what LLM generates, errors are one line, serve and
bench are delegated, and a tiny benchmark run writes its table, JSON and plot."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from augury import SamplingParams
from augury.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY_RANDOM = ("hidden_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
               "intermediate_size=128,vocab_size=300")


def one_line_error(capsys, code: int, *words: str) -> str:
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("augury"), err
    assert "error:" in lines[0] and "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def test_generate_prints_the_greedy_text(tiny_checkpoint, make_llm, capsys) -> None:
    folder = tiny_checkpoint("llama", tokenizer=True)
    expected = make_llm(folder).generate("hello world ba", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert main(["generate", "--raw", "--model", str(folder), "--max-tokens", "12", "--dtype", "float32",
                 "--device", "cpu", "hello world ba"]) == 0
    assert capsys.readouterr().out == expected[0].text + "\n" and expected[0].text


def test_generate_chat(tiny_checkpoint, make_llm, capsys) -> None:
    folder = tiny_checkpoint("qwen3", tokenizer=True)
    expected = make_llm(folder).chat([{"role": "user", "content": "hello"}],
                                     SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].text
    assert main(["generate", "--chat", "--model", str(folder), "--max-tokens", "10", "--device", "cpu", "hello"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    # a model with a chat template is chatted with by default (an instruct model asked a question
    # in plain completion mode often ends its answer at once)
    assert main(["generate", "--model", str(folder), "--max-tokens", "10", "--device", "cpu", "hello"]) == 0
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("argv,words", [
    (["generate", "--bogus", "x"], ["unrecognized arguments: --bogus"]),
    (["generate", "--chat", "--raw", "x"], ["not allowed with argument"]),
    (["generate", "--max-tokens", "0", "hi"], ["--max-tokens must be a positive integer"]),
    (["generate", "--temperature", "-1", "hi"], ["--temperature"]),
    (["generate", "--speculative-num-steps", "3", "hi"], ["--speculative-eagle-topk", "--speculative-num-draft-tokens"]),
    (["generate", "--dtype", "int4", "hi"], ["--dtype must be one of"]),
    (["generate", "--model", "/no/such/folder", "hi"], ["/no/such/folder", "does not exist"]),
    (["generate", "--max-tokens", "many", "hi"], ["--max-tokens", "invalid int value"]),
    ([], ["choose a command"]),
])
def test_errors_are_one_line(argv, words, capsys) -> None:
    one_line_error(capsys, main(argv), *words)


def test_string_prompt_without_tokenizer(tiny_checkpoint, capsys) -> None:
    folder = tiny_checkpoint("qwen2")
    capsys.readouterr()
    code = main(["generate", "--model", str(folder), "--device", "cpu", "hello"])
    one_line_error(capsys, code, "no tokenizer")


def test_debug_shows_the_traceback() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        main(["generate", "--debug", "--model", "/no/such/folder", "hi"])


def test_serve_hands_over_all_its_arguments(monkeypatch) -> None:
    seen: list[list[str]] = []

    def fake_serve_main(argv: list[str]) -> int:
        seen.append(argv)
        return 3

    monkeypatch.setitem(sys.modules, "augury.server", types.SimpleNamespace(serve_main=fake_serve_main))
    argv = ["--model", "m", "--port", "0", "--help", "--speculative-policy", "static"]
    assert main(["serve", *argv]) == 3
    assert seen == [argv]


def test_importing_the_cli_loads_neither_torch_nor_the_server() -> None:
    code = "import sys, augury.cli; print(sorted(m for m in ('torch', 'augury.server') if m in sys.modules))"
    env = os.environ | {"PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_real_process_error_has_no_traceback() -> None:
    env = os.environ | {"PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-m", "augury.cli", "generate", "--model", "/no/such/folder", "hi"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("augury: error: ")


def _bench(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "bench"
    code = main(["bench", "--batch-sizes", "1,3", "--prompt-len", "5", "--output-len", "6", "--repeats", "2",
                 "--no-progress", "--out", str(out), *extra])
    assert code == 0
    assert (out / "offline.png").stat().st_size > 1000
    return json.loads((out / "offline.json").read_text())


def test_bench_random_model_side_by_side(tmp_path, capsys) -> None:
    report = _bench(tmp_path, "--random-config", TINY_RANDOM)
    table = capsys.readouterr().out
    rows = report["results"]
    assert [(r["batch_size"], r["system"]) for r in rows] == [
        (1, "transformers"), (1, "augury"), (3, "transformers"), (3, "augury")]
    for r in rows:
        assert len(r["seconds"]) == 2 and r["tokens_per_s"] > 0
        assert r["output_tokens"] == r["batch_size"] * 6
        assert r["greedy_match"] == 1.0  # float32: augury and transformers agree token for token
        assert r["ratio"] == pytest.approx(rows[0 if r["batch_size"] == 1 else 2]["median_s"] / r["median_s"])
        ref = rows[0 if r["batch_size"] == 1 else 2]
        assert r["paired_ratios"] == pytest.approx([a / b for a, b in zip(ref["seconds"], r["seconds"])])
        assert r["paired_ratio"] == pytest.approx(sorted(r["paired_ratios"])[0] / 2 + sorted(r["paired_ratios"])[1] / 2)
        assert r["system"] in table
    assert report["model"]["vocab_size"] == 300 and report["model"]["layers"] == 2
    assert report["environment"]["torch"]


def test_bench_on_a_checkpoint_folder(tiny_checkpoint, tmp_path) -> None:
    report = _bench(tmp_path, "--model", str(tiny_checkpoint("qwen2")), "--systems", "augury,transformers")
    assert report["model"]["family"] == "qwen2"
    assert report["model"]["parameters"] == 64 * 256 + 2 * (2 * 64 + (64 * 64 + 64 + 2 * (32 * 64 + 32))
                                                           + 64 * 64 + 3 * 64 * 128) + 64
    assert {r["system"] for r in report["results"]} == {"augury", "transformers"}
    assert all(r["greedy_match"] == 1.0 for r in report["results"])


def test_bench_chat_prompts_average_over_prompts(tiny_checkpoint, tmp_path) -> None:
    """--prompts chat: a run goes through --num-prompts held-out prompts in batches of the batch
    size, so batch 1 measures several prompts, and every system sees the same ones."""
    report = _bench(tmp_path, "--model", str(tiny_checkpoint("llama", tokenizer=True)), "--prompts", "chat",
                    "--num-prompts", "4", "--systems", "augury,transformers")
    rows = {(r["batch_size"], r["system"]): r for r in report["results"]}
    assert rows[(1, "augury")]["output_tokens"] == 4 * 6  # four batches of one
    assert rows[(3, "augury")]["output_tokens"] == 2 * 3 * 6  # two batches of three, the prompts cycled
    assert all(r["greedy_match"] == 1.0 for r in rows.values())


def test_bench_speculative_rows_with_tree_shapes(tmp_path) -> None:
    """The speculative systems, a tree shape given in the system name, against plain decoding:
    lossless (greedy output equal to the reference's) and reporting tokens per verification."""
    from speculative_helpers import bigram_head, make_target

    target = make_target(tmp_path / "target", bigram=True)
    head = bigram_head(tmp_path / "head", target)
    report = _bench(tmp_path, "--model", str(target), "--draft-model", str(head), "--output-len", "25",
                    "--systems", "augury-off,augury-static:4-1-5,augury-adaptive:3-2-5,augury-ngram,augury-static:2-2-3+4")
    rows = {(r["batch_size"], r["system"]): r for r in report["results"]}
    assert set(rows) == {(b, s) for b in (1, 3) for s in
                         ("augury-off", "augury-static:4-1-5", "augury-adaptive:3-2-5", "augury-ngram",
                          "augury-static:2-2-3+4")}
    for (b, system), r in rows.items():
        assert r["greedy_match"] == 1.0, system
        assert r["output_tokens"] == b * 25
        assert r["spec_fraction"] > 0 or system in ("augury-off", "augury-adaptive:3-2-5")  # adaptive may stay off
        if system == "augury-off":
            assert r["accept_length"] == 0.0
    # the faithful head predicts the bigram target, so its drafts are taken
    assert rows[(1, "augury-static:4-1-5")]["accept_length"] > 3.5


@pytest.mark.parametrize("argv,words", [
    (["bench", "--batch-sizes", "0,2"], ["positive integers"]),
    (["bench", "--systems", "augury,augury-static:5-4", "--out", "{tmp}"], ["STEPS-TOPK-TOKENS", "augury-static:5-4"]),
    (["bench", "--systems", "augury,augury-static:3-4-8+x", "--out", "{tmp}"], ["+BRANCH", "augury-static:3-4-8+x"]),
    (["bench", "--systems", "augury,augury-ngram:5-1-6", "--out", "{tmp}"], ["unknown system", "augury-ngram:5-1-6"]),
    (["bench", "--systems", "augury,augury-static:5-1-9", "--out", "{tmp}"], ["speculative_num_draft_tokens"]),
    (["bench", "--systems", "transformers,vllm", "--out", "{tmp}"], ["unknown system", "vllm"]),
    (["bench", "--systems", "augury,transformers@int8", "--out", "{tmp}"], ["@MODE", "transformers@int8"]),
    (["bench", "--systems", "augury,augury@int3", "--out", "{tmp}"], ["@MODE", "augury@int3"]),
    (["bench", "--output-len", "0"], ["--output-len"]),
    (["bench", "--num-prompts", "0"], ["--num-prompts"]),
    (["bench", "--temperature", "0.8", "--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["bench", "--top-p", "0.9"], ["--top-p", "--temperature"]),
])
def test_bench_errors_are_one_line(argv, words, tmp_path, capsys) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    one_line_error(capsys, main(argv), *words)


def test_bench_stop_at_eos_counts_the_tokens_generated(tiny_checkpoint, tmp_path) -> None:
    """--stop-at-eos: sequences end at their end-of-sequence token as in a chat; every system is
    measured in the tokens it generated, and augury and transformers stop at the same token."""
    import shutil

    from augury import LLM, SamplingParams
    from augury.bench import chat_prompts

    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama", tokenizer=True), folder)
    llm = LLM(str(folder), dtype="float32")
    prompts = chat_prompts(llm.tokenizer, 4)
    full = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                              use_tqdm=False)]
    eos = full[0][2]  # make the third token of the first answer the end-of-sequence token
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((folder / name).read_text())
        cfg["eos_token_id"] = eos
        (folder / name).write_text(json.dumps(cfg))
    want = sum(next((i + 1 for i, t in enumerate(ids) if t == eos), len(ids)) for ids in full)
    assert want < 4 * 6
    report = _bench(tmp_path, "--model", str(folder), "--prompts", "chat", "--num-prompts", "4", "--batch-sizes", "1",
                    "--systems", "augury,transformers", "--stop-at-eos")
    rows = {r["system"]: r for r in report["results"]}
    assert rows["augury"]["output_tokens"] == rows["transformers"]["output_tokens"] == want
    assert rows["transformers"]["greedy_match"] == 1.0
    assert rows["transformers"]["ratio"] == pytest.approx(rows["transformers"]["tokens_per_s"] / rows["augury"]["tokens_per_s"])


# ------------------------------------------------------------------ the one option table

def _option_actions(parser) -> list:
    import argparse

    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _parsers() -> dict:
    from augury.bench.offline import build_parser as bench_parser
    from augury.cli import build_parser
    from augury.server.args import build_parser as serve_parser
    from augury.train.cli import build_parser as train_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {"generate": sub.choices["generate"], "serve": serve_parser(), "bench": bench_parser(),
            "train-draft": train_parser()}


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "train-draft"])
def test_every_flag_says_what_it_does(command: str) -> None:
    actions = _option_actions(_parsers()[command])
    assert len(actions) > 5
    for action in actions:
        text = " ".join((action.help or "").split())
        words = re.sub(r"\(default[^)]*\)", "", text).split()  # what it does, without the default
        assert len(words) >= 3 and "EngineConfig" not in text, (command, action.option_strings, text)


def test_engine_flags_come_from_the_one_table() -> None:
    from augury.config import OPTIONS

    parsers = _parsers()
    for command in ("generate", "serve"):
        flags = {s for a in _option_actions(parsers[command]) for s in a.option_strings}
        assert {o.flag for o in OPTIONS} <= flags, command
    for option in OPTIONS:  # one help text for a flag, wherever it appears
        helps = {command: a.help for command, p in parsers.items() for a in _option_actions(p)
                 if option.flag in a.option_strings}
        assert helps["generate"] == helps["serve"]
    serve_help = subprocess.run([sys.executable, "-m", "augury.cli", "serve", "--help"], capture_output=True,
                                text=True, env=os.environ | {"PYTHONPATH": SRC}, timeout=120)
    assert serve_help.returncode == 0 and "--quantization" in serve_help.stdout
    assert "EngineConfig." not in serve_help.stdout
    assert "weights and compute dtype: auto (the checkpoint's own;" in " ".join(serve_help.stdout.split())


def test_environment_fills_a_field_and_a_flag_wins(monkeypatch) -> None:
    from augury.config import ENV_VARS, OPTIONS, EngineConfig
    from augury.server.args import build_parser, settings_from_args

    assert ENV_VARS == {o.env: o.name for o in OPTIONS if o.env}
    assert {"AUGURY_THREADS", "AUGURY_DEVICE", "AUGURY_KV_CACHE_GB", "AUGURY_SPEC_DISABLE_BATCH_THRESHOLD"} <= set(ENV_VARS)
    monkeypatch.setenv("AUGURY_THREADS", "3")
    monkeypatch.setenv("AUGURY_KV_CACHE_GB", "0.5")
    assert EngineConfig.create().threads == 3
    settings = settings_from_args(build_parser().parse_args(["--threads", "2"]))
    assert settings.engine.threads == 2 and settings.engine.kv_cache_memory_gb == 0.5
    monkeypatch.setenv("AUGURY_KV_CACHE_GB", "-1")
    with pytest.raises(ValueError, match=r"^AUGURY_KV_CACHE_GB must be a positive number"):
        EngineConfig.create()


@pytest.mark.parametrize("argv, line", [
    (["generate", "--max-model-len", "0", "hi"], "augury: error: --max-model-len must be a positive integer, got 0"),
    (["generate", "--quantization", "int3", "hi"], "augury: error: --quantization must be one of"),
    (["generate", "--threads", "0", "hi"], "augury: error: --threads must be a positive integer, got 0"),
    (["generate", "--top-p", "0", "hi"], "augury: error: --top-p must be in (0, 1], got 0.0"),
    (["generate", "--speculative-algorithm", "eagle3", "--model", "{tmp}", "hi"],
     "augury: error: --speculative-algorithm eagle3 needs an EAGLE-3 head (--speculative-draft-model-path)"),
])
def test_an_error_names_the_flag_typed(argv, line, tmp_path, capsys) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert one_line_error(capsys, main(argv)).startswith(line)


def test_serve_settings_name_the_flag_typed() -> None:
    from augury.server.args import build_parser, settings_from_args

    with pytest.raises(ValueError, match="--speculative-eagle-topk and --speculative-num-draft-tokens"):
        settings_from_args(build_parser().parse_args(["--speculative-num-steps", "3"]))


def test_serve_flags_and_model_check_import_no_torch() -> None:
    code = ("import sys; from augury.server.args import build_parser, settings_from_args; from augury import resolve; "
            "s = settings_from_args(build_parser().parse_args(['--model', 'demo', '--dtype', 'float32'])); "
            "resolve.check(s.engine); print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ | {"PYTHONPATH": SRC}, check=True)
    assert out.stdout.strip() == "[]"


def _tiny_gguf(tmp_path: Path) -> Path:
    import gguf
    from test_gguf import _tiny_model, _write_gguf

    path = tmp_path / "tiny.gguf"
    _write_gguf(_tiny_model(tied=True), path, gguf.GGMLQuantizationType.F32)
    return path


def test_bench_llama_cpp_row_without_the_peers_extra_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("AUGURY_CACHE_DIR", str(tmp_path / "cache"))
    # as if llama-cpp-python were not installed, in the llama.cpp worker (the user's PYTHONPATH reaches it)
    fake = tmp_path / "site" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no llama_cpp here')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")])))
    code = main(["bench", "--model", str(_tiny_gguf(tmp_path)), "--systems", "augury,llama.cpp",
                 "--batch-sizes", "1", "--output-len", "4", "--repeats", "1", "--no-progress",
                 "--out", str(tmp_path / "out")])
    one_line_error(capsys, code, "llama-cpp-python", "augury[peers]")


def test_bench_llama_cpp_row_runs_the_same_gguf(tmp_path, monkeypatch) -> None:
    """The peer row loads the very GGUF augury converts: float32 weights, greedy, the same tokens."""
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("AUGURY_CACHE_DIR", str(tmp_path / "cache"))
    report = _bench(tmp_path, "--model", str(_tiny_gguf(tmp_path)), "--systems", "augury,llama.cpp",
                    "--batch-sizes", "1", "--quantization", "none")
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == {"augury", "llama.cpp"}
    assert rows["llama.cpp"]["output_tokens"] == 6 and rows["llama.cpp"]["tokens_per_s"] > 0
    assert rows["llama.cpp"]["greedy_match"] == 1.0
    # each in its own process; llama.cpp with the tests' thread count as n_threads, without augury's
    # OMP_WAIT_POLICY (only a policy this test process was started with reaches it)
    from augury.bench.worker import initial_environ

    peer = rows["llama.cpp"]
    assert len({peer["pid"], rows["augury"]["pid"], os.getpid()}) == 3
    assert peer["threads"] == 1 and peer["kernels_isa"] is None and peer["isa"] == rows["augury"]["isa"]
    assert peer["omp_wait_policy"] == (initial_environ() or {}).get("OMP_WAIT_POLICY")


def test_bench_systems_take_a_quantisation_mode(tiny_checkpoint, tmp_path) -> None:
    """augury-off@int8 runs int8 weights beside the dense reference in one run (the name says so)."""
    report = _bench(tmp_path, "--model", str(tiny_checkpoint("llama")), "--systems", "augury@none,augury-off@int8",
                    "--batch-sizes", "1")
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == {"augury@none", "augury-off@int8"}
    assert all(r["output_tokens"] == 6 for r in rows.values())
    from augury.bench import SystemSettings, system_factory

    settings = SystemSettings(str(tiny_checkpoint("llama")), "float32", "cpu", 1, 64)
    system = system_factory("augury-off@int8")(settings)
    assert system.name == "augury-off@int8" and system.llm.engine.model.quantization == "int8"
    assert system_factory("augury-off")(settings).llm.engine.model.quantization == "none"  # dense checkpoint


def test_bench_top_p_reaches_every_sampled_request(tiny_checkpoint) -> None:
    """--top-p: augury's systems sample each request with that nucleus (seeded), as the peers do."""
    from augury.bench import SystemSettings, system_factory

    settings = SystemSettings(str(tiny_checkpoint("llama")), "float32", "cpu", 1, 64, temperature=0.8, top_p=0.5)
    system = system_factory("augury-off")(settings)
    seen = []
    generate = system.llm.generate

    def spy(prompts, params, **kw):
        seen.extend(params)
        return generate(prompts, params, **kw)

    system.llm.generate = spy
    rows = system.generate([[5, 6, 7], [8, 9]], 4)
    assert [len(r) for r in rows] == [4, 4]
    assert [(p.temperature, p.top_p, p.seed) for p in seen] == [(0.8, 0.5, 0), (0.8, 0.5, 1)]


def test_bench_mixed_prompts_and_the_comparison_systems(tiny_checkpoint, tmp_path) -> None:
    """--prompts mixed alternates held-out chat prompts with copy prompts (which quote a paragraph);
    augury-adaptive-step (one draft size per step) and augury-threshold8 are lossless like the rest."""
    from augury.bench import mixed_prompts
    from augury.models.tokenizer import load_tokenizer
    from helpers_server import make_tiny_checkpoint
    from speculative_helpers import checkpoints

    folder = make_tiny_checkpoint(tmp_path / "bpe")  # byte-level BPE: any text round-trips
    tok = load_tokenizer(folder)
    texts = [tok.decode(p) for p in mixed_prompts(tok, 4)]
    assert [("Repeat" in t or "Copy" in t or "write out" in t) for t in texts] == [False, True, False, True]
    report = _bench(tmp_path / "mixed", "--model", str(folder), "--prompts", "mixed", "--num-prompts", "4",
                    "--systems", "augury-off,augury-threshold8")
    assert all(r["greedy_match"] == 1.0 for r in report["results"])
    ck = checkpoints(tmp_path / "ck")
    report = _bench(tmp_path / "step", "--model", str(ck["target"]), "--draft-model", str(ck["head"]),
                    "--systems", "augury-off,augury-adaptive-step,augury-adaptive")
    assert {r["system"] for r in report["results"]} == {"augury-off", "augury-adaptive-step", "augury-adaptive"}
    assert all(r["greedy_match"] == 1.0 for r in report["results"])


def test_import_and_building_an_engine_set_nothing_process_wide(tiny_checkpoint) -> None:
    """`import augury` and an LLM built in a host process leave the environment (OMP_WAIT_POLICY and
    the rest) and torch's thread count as the host had them: a host application and any peer in its
    process keep their own defaults. Checked in a fresh interpreter."""
    import os
    import subprocess
    import sys

    folder = tiny_checkpoint("llama")
    code = ("import os, sys, torch; torch.set_num_threads(1); before = dict(os.environ); import augury; "
            "assert 'torch' in sys.modules; "
            f"llm = augury.LLM({str(folder)!r}, speculative_algorithm='none', log_stats_interval=0); "
            "llm.generate([[1, 2, 3]], augury.SamplingParams(max_tokens=2), use_tqdm=False); "
            "print(sorted(set(os.environ.items()) ^ set(before.items())), torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "1"]


def test_bench_varied_prompts_report_acceptance_per_kind(tmp_path, capsys) -> None:
    """--prompts varied: the varied held-out set (no training template makes these), kinds taken in
    turn; speculative rows carry their acceptance length per kind, in the JSON and the table."""
    from augury.prompts import VARIED_PROMPTS, builtin_prompts, varied_prompts
    from helpers_server import make_tiny_checkpoint

    pairs = varied_prompts()
    assert len(pairs) == sum(len(v) for v in VARIED_PROMPTS.values())
    assert [k for k, _ in pairs[:len(VARIED_PROMPTS)]] == list(VARIED_PROMPTS)
    assert not set(t for _, t in pairs) & set(builtin_prompts())
    folder = make_tiny_checkpoint(tmp_path / "bpe")
    report = _bench(tmp_path, "--model", str(folder), "--prompts", "varied", "--num-prompts", "4",
                    "--output-len", "12", "--systems", "augury-off,augury-ngram")
    table = capsys.readouterr().out
    rows = {(r["batch_size"], r["system"]): r for r in report["results"]}
    assert rows[(1, "augury-off")]["accept_by_kind"] == {k: 0.0 for k in list(VARIED_PROMPTS)[:4]}
    ngram = rows[(1, "augury-ngram")]
    assert list(ngram["accept_by_kind"]) == list(VARIED_PROMPTS)[:4]
    assert all(r["greedy_match"] == 1.0 for r in rows.values())
    assert "acceptance length by kind" in table and "sql-shell" in table


def test_bench_acceptance_per_kind_splits_each_prompts_own_counts() -> None:
    """The per-kind figure is (verify steps + accepted drafts) / verify steps over that kind's
    prompts only, whatever batches they ran in."""
    from augury.bench import AugurySystem
    from augury.bench.offline import BenchSettings, run_benchmark

    class Fake(AugurySystem):
        def __init__(self) -> None:
            self.name = "fake"
            self.reset_counts()

        def prepare(self, prompts):  # no engine whose caches to empty, no histories
            pass

        def generate(self, prompts, output_len, stop_at_eos=False):
            for p in prompts:  # prompt p: 2 verify steps accepting p[0] drafts in all
                rec = self.per_prompt.setdefault(tuple(p), [0, 0])
                rec[0] += 2
                rec[1] += p[0]
            return [[7] * output_len for _ in prompts]

    chat = [[4, 1], [0, 2], [2, 3], [2, 4]]
    kinds = ["a", "b", "a", "b"]
    settings = BenchSettings(batch_sizes=(1, 3), output_len=3, repeats=2, warmup=0)
    rows = {r.batch_size: r for r in run_benchmark(settings, [Fake()], 100, progress=False, chat=chat, kinds=kinds)}
    # batch 1: each prompt once per repeat, 2 repeats. a: 8 steps, 2 * (4 + 2) accepted; b: 8, 2 * (0 + 2)
    assert rows[1].accept_by_kind == pytest.approx({"a": (8 + 12) / 8, "b": (8 + 4) / 8})
    # batch 3: groups [c0 c1 c2] [c3 c0 c1] (cycled): c0 and c1 twice a repeat. a: 12 steps, 2 * (8 + 2)
    # accepted; b: 12, 2 * (0 + 2)
    assert rows[3].accept_by_kind == pytest.approx({"a": (12 + 20) / 12, "b": (12 + 4) / 12})
