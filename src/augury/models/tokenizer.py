"""A checkpoint folder's tokenizer and end-of-sequence ids, as the engine, the benchmarks and the
trainer all read them (torch-free; transformers is imported only when a tokenizer is there)."""
from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


# the class transformers 5 saves a tokenizer.json-only tokenizer as (every GGUF conversion's)
_BACKEND_CLASS = "TokenizersBackend"


def load_tokenizer(folder: Path):
    """The folder's transformers tokenizer, or None when it ships none. A folder whose tokenizer class
    is transformers' plain tokenizers backend gets that class straight away: AutoTokenizer's config
    lookup imports transformers' model configuration modules first, 1.2 of its 2.3 s on a 1B GGUF
    conversion's start (the class it would pick is the same)."""
    folder = Path(folder)
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        cls = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        cls = None
    if cls == _BACKEND_CLASS and (folder / "tokenizer.json").is_file():
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # another transformers: its own lookup
            pass
        else:
            return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def eos_ids(folder: Path, cfg_eos: tuple[int, ...], tokenizer) -> set[int]:
    """Every id that ends a sequence: config.json's, generation_config.json's and the tokenizer's."""
    ids = set(cfg_eos)
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [e] if isinstance(e, int) else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
