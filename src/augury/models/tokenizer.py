"""A checkpoint folder's tokenizer and end-of-sequence ids, as the engine, the benchmarks and the
trainer all read them (torch-free; transformers is imported only when a tokenizer is there)."""
from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(folder: Path):
    """The folder's transformers tokenizer, or None when it ships none."""
    if not any((Path(folder) / f).exists() for f in TOKENIZER_FILES):
        return None
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
