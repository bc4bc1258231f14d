"""Hugging Face Hub names (`--model Org/Name`, `--speculative-draft-model-path Org/Name`) resolved by
augury/resolve.py through huggingface_hub, against a local stand-in for the Hub: a cache folder laid out as
huggingface_hub lays it out (models--Org--Name/snapshots/<commit>/..., refs/<branch>), with HF_HUB_OFFLINE
set, or with HF_ENDPOINT on a closed loopback port. Nothing here touches the network."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from augury import resolve as res
from augury.config import EngineConfig, ResolvedModel
from helpers_server import run_serve, serve, shared_tiny_checkpoint

MAIN, V1 = "a" * 40, "b" * 40  # commit hashes


def put(cache: Path, repo: str, commit: str, files: dict[str, str] | Path, ref: str | None = "main") -> Path:
    """One snapshot of `repo` in the cache (a folder's files, or named texts), `ref` pointing at it."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    if isinstance(files, Path):
        shutil.copytree(files, snap)
    else:
        snap.mkdir(parents=True)
        for name, text in files.items():
            (snap / name).write_text(text)
    if ref is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline cache: HF_HUB_CACHE here, HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_name_is_its_cached_snapshot(hub: Path) -> None:
    main = put(hub, "Org/Tiny", MAIN, {"config.json": "{}"})
    v1 = put(hub, "Org/Tiny", V1, {"config.json": '{"v": 1}'}, ref="v1")
    head = put(hub, "Org/Head", MAIN, {"config.json": "{}"})
    assert res.resolve(EngineConfig(model="Org/Tiny", speculative_algorithm="none")) == ResolvedModel(main, None)
    assert res.resolve(EngineConfig(model="Org/Tiny", revision="v1")).target_dir == v1  # a branch or tag
    assert res.resolve(EngineConfig(model="Org/Tiny", revision=V1)).target_dir == v1  # a commit
    both = res.resolve(EngineConfig(model="Org/Tiny", draft_model="Org/Head", speculative_algorithm="eagle3"))
    assert both == ResolvedModel(main, head)


def test_offline_misses_are_one_line_naming_the_field(hub: Path, tmp_path: Path) -> None:
    put(hub, "Org/Tiny", MAIN, {"config.json": "{}"})
    cases = [(EngineConfig(model="Org/Missing"), r"^model Org/Missing is not in the Hugging Face cache and "
                                                 r"HF_HUB_OFFLINE is set: fetch it .*hf download Org/Missing"),
             (EngineConfig(model="Org/Tiny", revision="v9"), r"^model Org/Tiny at revision v9 is not in the Hugging "
                                                             r"Face cache"),
             (EngineConfig(model="Org/Tiny", draft_model="Org/NoHead"), r"^draft_model Org/NoHead is not in the")]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            res.check(cfg)  # offline, the cache alone answers: before anything loads
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="revision applies to a Hugging Face Hub name"):
        res.check(EngineConfig(model=str(tmp_path), revision="v1"))
    with pytest.raises(ValueError, match="model /no/such/model does not exist"):  # a path stays a path
        res.check(EngineConfig(model="/no/such/model"))


def test_an_unreachable_hub_is_one_line(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"^model Org/Missing is not in the Hugging Face cache and the Hub "
                                         r"\(http://127\.0\.0\.1:9\) cannot be reached"):
        res.resolve(EngineConfig(model="Org/Missing"))
    res.check(EngineConfig(model="Org/Missing"))  # online, check fetches nothing: resolve says it


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("hub-serve")
    put(cache, "Org/Tiny", MAIN, shared_tiny_checkpoint(tmp_path_factory))
    return cache


@pytest.fixture(scope="module")
def served(hub_cache: Path) -> Iterator[str]:
    with serve(["--model", "Org/Tiny", "--dtype", "float32", "--max-num-seqs", "2"],
               HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1") as sp:
        yield sp.base_url


def test_serve_a_hub_name_from_the_cache(served: str, hub_cache: Path) -> None:
    assert [m["id"] for m in httpx.get(f"{served}/v1/models").json()["data"]] == ["Org/Tiny"]
    r = httpx.post(f"{served}/v1/completions", json={"model": "Org/Tiny", "prompt": "the quick", "max_tokens": 4,
                                                     "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    info = httpx.get(f"{served}/server_info").json()
    assert info["server"]["model_folder"] == str((hub_cache / "models--Org--Tiny" / "snapshots" / MAIN).resolve())


def test_serve_an_uncached_hub_name_offline_fails_in_one_line(hub_cache: Path) -> None:
    out = run_serve(["--model", "Org/Missing", "--speculative-draft-model-path", "Org/Head"],
                    HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "augury: error: start-up failed at stage 'configuration': --model Org/Missing is not in the Hugging Face "
        "cache and HF_HUB_OFFLINE is set: fetch it where the Hub is reachable (hf download Org/Missing), or unset "
        "HF_HUB_OFFLINE")
