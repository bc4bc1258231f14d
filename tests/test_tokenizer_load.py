"""models/tokenizer.load_tokenizer: a GGUF conversion's tokenizer (transformers' plain tokenizers
backend) taken straight from its class, the same tokenizer AutoTokenizer builds; other folders through
AutoTokenizer as before."""
from __future__ import annotations

import json

from test_gguf_kquants import kquant_folder  # noqa: F401 - the module-scoped fixture
from transformers import AutoTokenizer

from augury.models.tokenizer import load_tokenizer

TEXTS = ["Hello, world!", "  spaces\tand\nlines  ", "numbers 12345 and ünïcödé ✓", ""]


def _same(a, b) -> None:
    assert type(a) is type(b)
    for t in TEXTS:
        assert a(t).input_ids == b(t).input_ids
        assert a.decode(a(t).input_ids) == b.decode(b(t).input_ids)
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (b.bos_token_id, b.eos_token_id, b.pad_token_id)
    assert a.chat_template == b.chat_template
    assert a.all_special_ids == b.all_special_ids


def test_a_gguf_conversion_takes_its_backend_class_and_matches_autotokenizer(kquant_folder) -> None:  # noqa: F811
    config = json.loads((kquant_folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend"  # the fast path is the one taken
    _same(load_tokenizer(kquant_folder), AutoTokenizer.from_pretrained(str(kquant_folder)))


def test_another_class_goes_through_autotokenizer(kquant_folder, tmp_path) -> None:  # noqa: F811
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(kquant_folder, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    _same(load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))


def test_a_folder_without_a_tokenizer_has_none(tmp_path) -> None:
    assert load_tokenizer(tmp_path) is None
