"""Helpers for the server tests: a tiny random Llama checkpoint with a tokenizer built offline,
and a real `python -m augury.server` subprocess on loopback."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import augury

SRC = str(Path(augury.__file__).resolve().parents[1])
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and verifies them in one forward pass",
    "a server that starts half way is worse than one that does not start",
    "hello world, this is augury speaking; numbers 0 1 2 3 4 5 6 7 8 9",
    "Once upon a time there was a tiny model with random weights.",
]


def make_tiny_checkpoint(folder: Path, seed: int = 0, max_positions: int = 256) -> Path:
    """A 2-layer random Llama (float32) plus a byte-level BPE tokenizer with a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(folder))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(folder))
    return folder


_SHARED: dict[str, Path] = {}


def shared_tiny_checkpoint(tmp_path_factory) -> Path:
    """make_tiny_checkpoint, built once per test session (read-only: copy before editing)."""
    if "tiny" not in _SHARED:
        _SHARED["tiny"] = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-server") / "model")
    return _SHARED["tiny"]


def server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUGURY_")}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny models gain nothing from threads on a shared CPU
    env.update(extra)
    return env


def run_serve(args: list[str], timeout: float = 120.0, **env: str) -> subprocess.CompletedProcess:
    """Run `python -m augury.server ARGS` to completion (for start-up failures)."""
    return subprocess.run([sys.executable, "-m", "augury.server", *args], env=server_env(**env),
                          capture_output=True, text=True, timeout=timeout)


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int = 0
    lines: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return "".join(self.lines)


@contextmanager
def serve(args: list[str], ready_timeout: float = 180.0, **env: str) -> Iterator[ServerProcess]:
    """Start a server on a free port (--port 0), wait for its ready line, stop it afterwards."""
    proc = subprocess.Popen([sys.executable, "-m", "augury.server", "--port", "0", *args], env=server_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sp = ServerProcess(proc)
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sp.lines.append(line)
            m = re.search(r"ready: serving .* on http://127\.0\.0\.1:(\d+)", line)
            if m:
                sp.port = int(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + ready_timeout
        while not ready.wait(0.2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready in {ready_timeout} s:\n{sp.log}")
        if not sp.port:
            raise RuntimeError(f"server exited before it was ready (rc={proc.wait()}):\n{sp.log}")
        yield sp
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
