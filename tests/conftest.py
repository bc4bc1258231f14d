"""Shared fixtures: tiny random Hugging Face checkpoints, HF reference models, checked LLMs.

Checkpoints are built once per session with transformers' own config classes and
save_pretrained, in float32, with weights wide enough (std 0.15, perturbed norms and
biases) that logits are far from flat and greedy choices are not near-ties.
"""
from __future__ import annotations

import itertools
import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

_SRC = Path(__file__).resolve().parents[1] / "src"
if str(_SRC) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(_SRC))

# Tiny models gain nothing from threads, and on a shared CPU OpenMP spinning makes each
# forward ~30x slower when the cores are busy; one thread keeps the suite fast and steady.
torch.set_num_threads(1)

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")
VOCAB = 256
BOS, EOS = 1, 2
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3.1-style scaling squeezed to tiny lengths, so all three frequency bands occur
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _hf_config(family: str) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15, rms_norm_eps=1e-6,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0,
    )
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "llama3":
        return tf.LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE))
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=4096)
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if family == "qwen3":
        # head_dim 32 with 4 heads: attention width 128 differs from hidden 64
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, use_sliding_window=False)
    raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights N(0, 0.15); norm scales 1 + N(0, 0.1) and biases N(0, 0.1) so they matter too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def _word_list() -> list[str]:
    """251 distinct words: with the 5 special tokens the vocabulary is exactly VOCAB."""
    fixed = ["user", "assistant", "system", "hello", "Hello", "world"]
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]  # 75
    pairs = [a + b for a, b in itertools.product(syllables, syllables)]
    words = fixed + syllables + pairs[:: 7][: VOCAB - len(SPECIAL_TOKENS) - len(fixed) - len(syllables)]
    assert len(set(words)) == VOCAB - len(SPECIAL_TOKENS)
    return words


def build_tokenizer() -> Any:
    """A WordLevel tokenizer trained in-process, wrapped for transformers, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = _word_list()
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, min_frequency=1)
    tok.train_from_iterator([" ".join(words[i : i + 10]) for i in range(0, len(words), 10)], trainer)
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("</s>") == EOS
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny(out: Path, family: str, *, seed: int = 0, tokenizer: bool = False,
              max_shard_size: str | None = None) -> Path:
    """Write one tiny random checkpoint folder (config.json + safetensors [+ tokenizer])."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keeps captured stderr to what the code under test wrote
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(family)).float()
    _randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    if tokenizer:
        build_tokenizer().save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_checkpoint(family, tokenizer=False, seed=0, max_shard_size=None) -> folder (cached).

    Treat the folder as read-only; copy it (shutil.copytree) before editing files in it.
    """
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama", *, tokenizer: bool = False, seed: int = 0,
             max_shard_size: str | None = None) -> Path:
        key = (family, tokenizer, seed, max_shard_size)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}-tok{int(tokenizer)}-s{seed}")
            cache[key] = save_tiny(out, family, seed=seed, tokenizer=tokenizer, max_shard_size=max_shard_size)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], Any]:
    """hf_model(folder) -> transformers' own model for that folder, float32, eval, never stops at EOS."""
    cache: dict[Path, Any] = {}

    def load(folder: Path) -> Any:
        from transformers import AutoModelForCausalLM

        folder = Path(folder)
        if folder not in cache:
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # parity runs use ignore_eos
            cache[folder] = model
        return cache[folder]

    return load


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate, greedy, one prompt, exactly max_new_tokens new tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == max_new_tokens, "transformers stopped early; the reference is not ignoring EOS"
    return new


def hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' forward: float32 logits [len(prompt), V]."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """Prompts of the given lengths from ordinary (non-special) token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(n)] for n in lengths]


def assert_no_leaks(engine: Any) -> None:
    """Every KV block is back with the allocator and no request is left in the engine."""
    assert not engine.has_unfinished_requests(), "requests are still waiting or running"
    assert engine.allocator.num_free == engine.allocator.num_usable, (
        f"KV blocks leaked: {engine.allocator.num_usable - engine.allocator.num_free} of "
        f"{engine.allocator.num_usable} not returned"
    )


@pytest.fixture
def make_llm() -> Iterator[Callable[..., Any]]:
    """make_llm(folder, **engine kwargs) -> LLM on CPU in float32; checked for leaks after the test."""
    from augury import LLM

    built: list[Any] = []

    def make(folder: Path, **kwargs: Any) -> Any:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("log_stats_interval", 0.0)
        llm = LLM(str(folder), **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        assert_no_leaks(llm.engine)


def edit_config(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite folder/config.json through `edit(dict)`."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg, indent=2))
