"""--generation-config: generation_config.json's sampling defaults applied to the fields a request leaves
unset (auto), ignored (vllm), read from another folder; a bad file or flag stops start-up naming it."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from augury.generation_config import check_setting, load_defaults
from helpers_server import ServerProcess, run_serve, serve, shared_tiny_checkpoint

FILE = {"temperature": 0.0, "max_new_tokens": 5, "top_p": 0.5, "do_sample": True, "bos_token_id": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("genconfig") / "model"
    shutil.copytree(shared_tiny_checkpoint(tmp_path_factory), folder)
    (folder / "generation_config.json").write_text(json.dumps(FILE))
    return folder


@pytest.fixture(scope="module")
def auto(tiny: Path) -> Iterator[ServerProcess]:
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "2"]) as sp:
        yield sp


def _post(sp: ServerProcess, route: str, **body: Any) -> dict[str, Any]:
    body = {"ignore_eos": True, **body}
    if route == "chat":
        body.setdefault("messages", [{"role": "user", "content": "hello world"}])
    else:
        body.setdefault("prompt", "the quick brown fox")
    r = httpx.post(f"{sp.base_url}/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body,
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_the_models_defaults_apply_unless_the_request_sets_them(auto: ServerProcess, route: str) -> None:
    unset = _post(auto, route)  # the file: temperature 0 (greedy), at most 5 new tokens
    greedy = _post(auto, route, temperature=0, max_tokens=5)
    assert unset["usage"]["completion_tokens"] == 5 and _text(unset) == _text(greedy)
    assert _post(auto, route, max_tokens=9)["usage"]["completion_tokens"] == 9  # the request's own wins
    sampled = [_text(_post(auto, route, temperature=1.0, top_p=1.0, seed=s)) for s in range(3)]
    assert any(t != _text(greedy) for t in sampled)  # temperature 1 given: the file's 0 does not apply
    assert "sampling defaults from the model's generation config: temperature=0, top_p=0.5, max_tokens=5" in auto.log
    info = httpx.get(f"{auto.base_url}/server_info", timeout=10).json()
    assert info["server"]["sampling_defaults"] == {"temperature": 0.0, "top_p": 0.5, "max_tokens": 5}
    assert info["server"]["generation_config"] == "auto"


def test_vllm_ignores_the_file(tiny: Path) -> None:
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "2",
                "--generation-config", "vllm"]) as sp:
        plain = _post(sp, "completions")
        assert plain["usage"]["completion_tokens"] == 16  # completions' own default max_tokens
        greedy = _text(_post(sp, "completions", temperature=0, max_tokens=16))
        assert any(_text(_post(sp, "completions", seed=s)) != greedy for s in range(3))  # temperature 1
        assert "generation config" not in sp.log


def test_load_defaults_modes(tmp_path: Path) -> None:
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    assert load_defaults("auto", model) == ({}, None)  # no file: no defaults
    (model / "generation_config.json").write_text(json.dumps(FILE))
    (other / "generation_config.json").write_text(json.dumps({"top_k": 20, "min_p": 0.05,
                                                              "repetition_penalty": 1.1}))
    assert load_defaults("auto", model)[0] == {"temperature": 0.0, "top_p": 0.5, "max_tokens": 5}
    assert load_defaults("vllm", model) == ({}, None)
    assert load_defaults(check_setting(str(other)), model)[0] == {"top_k": 20, "min_p": 0.05,
                                                                  "repetition_penalty": 1.1}
    assert check_setting("none") == "vllm"
    with pytest.raises(ValueError, match="--generation-config must be auto, vllm, none or a folder"):
        check_setting(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="has no generation_config.json"):
        check_setting(str(tmp_path))
    for bad, key in [({"top_p": 0}, "top_p"), ({"temperature": "hot"}, "temperature"),
                     ({"max_new_tokens": 2.5}, "max_new_tokens"), ({"top_k": -2}, "top_k")]:
        (other / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=rf"generation_config.json: {key} must be"):
            load_defaults(str(other), model)


def test_a_bad_flag_or_file_stops_start_up_naming_it(tiny: Path, tmp_path: Path) -> None:
    flag = run_serve(["--model", str(tiny), "--generation-config", str(tmp_path / "nowhere")])
    assert flag.returncode != 0 and "--generation-config must be auto, vllm, none or a folder" in flag.stderr
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    bad = run_serve(["--model", str(tiny), "--dtype", "float32", "--generation-config", str(tmp_path)])
    assert bad.returncode == 1 and "generation_config.json: temperature must be at least 0" in bad.stderr
