"""Model names -> folders on this machine, resolved once, at the entry points.

`LLM`, `augury generate`, `augury serve`, `augury bench` and `augury train-draft` call
`resolve(config)` and hand the engine a `ResolvedModel` (config.py): the target's Hugging Face
folder and the EAGLE-3 head folder to draft with, if any. What a name means is decided here
and nowhere else:

- "demo": SmolLM2-135M-Instruct, fetched and converted once into the user cache (demo.py),
  drafting with the EAGLE-3 head shipped in augury unless another head is given or the
  algorithm is "ngram" or "none";
- a `.gguf` file (llama architecture): converted once into `<cache>/gguf/<name>-<key>`, the
  key made of the file's absolute path, size and modification time and CONVERSION_FORMAT (a
  changed file is converted again, and its older conversion removed), with the demo's cache discipline
  (`demo.build_once`: staging folder, marker written last, one rename, a lock);
- anything else: a Hugging Face checkpoint folder, as given.

`check(config)` does the cheap part (the paths named exist, a head is there when eagle3 is
asked for) without fetching or converting anything; `resolve` does it too, first.
Torch-free unless a GGUF file has to be converted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

from augury.config import EngineConfig, ResolvedModel

__all__ = ["DEMO", "ResolvedModel", "check", "gguf_cache_dir", "resolve"]
log = logging.getLogger("augury.resolve")
DEMO = "demo"
GGUF_MAGIC = b"GGUF"
GGUF_MARKER = ".augury-complete"
CONVERSION_FORMAT = 3  # in the cache key; bump when the converter's output changes (2: Q4 blocks also kept as int4; 3: K-quants, Q8_0, Q5_* too)
_HINT = "pass a Hugging Face checkpoint folder, a llama-architecture .gguf file, or 'demo'"


def check(config: EngineConfig) -> None:
    """Raise ValueError, naming the field, if a path does not exist or eagle3 has no head; fetches nothing."""
    _target_path(config.model)
    _draft_dir(config)


def resolve(config: EngineConfig) -> ResolvedModel:
    """The folders `config` names, fetching the demo or converting a GGUF file on first use."""
    check(config)
    return ResolvedModel(_target_dir(config.model), _draft_dir(config))


def _target_path(model: str) -> Path | None:
    """The path `model` names (None for the demo); it must exist."""
    if model == DEMO:
        return None
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model {model} does not exist; {_HINT}")
    if path.is_file() and not _is_gguf(path):
        raise ValueError(f"model {model} is a file but not a GGUF file; {_HINT}")
    return path


def _target_dir(model: str) -> Path:
    path = _target_path(model)
    if path is None:
        from augury.demo import ensure_demo_target

        return ensure_demo_target()
    if path.is_file():
        return gguf_folder(path)
    return path


def _draft_dir(config: EngineConfig) -> Path | None:
    if config.draft_model is not None:
        path = Path(config.draft_model).expanduser()
        if not path.exists():
            raise ValueError(f"draft_model {config.draft_model} does not exist; pass an EAGLE-3 head folder")
        return path
    algo = config.speculative_algorithm
    head = None
    if config.model == DEMO and algo in (None, "eagle3"):
        from augury.heads import demo_head_dir

        head = demo_head_dir()
    if algo == "eagle3" and head is None:
        raise ValueError("speculative_algorithm eagle3 needs an EAGLE-3 head (draft_model)")
    return head


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_cache_dir(path: Path) -> Path:
    """Where the conversion of this GGUF file (as it is now) lives in the cache; nothing is built."""
    from augury.config import cache_root

    path = Path(path).expanduser().resolve()
    st = path.stat()
    key = hashlib.sha256(f"{CONVERSION_FORMAT}\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^\w.-]", "_", path.stem)[:64] or "model"
    return cache_root() / "gguf" / f"{stem}-{key}"


def gguf_folder(path: Path) -> Path:
    """The Hugging Face folder converted from a GGUF file, converting it on first use."""
    from augury.demo import build_once

    path = Path(path).expanduser().resolve()
    st = path.stat()
    target = gguf_cache_dir(path)
    marker = {"source": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def convert(work: Path, staging: Path) -> None:
        from augury.models import gguf as gguf_convert  # torch + gguf: only when converting

        log.info("converting %s to a Hugging Face folder in %s (once)", path, target)
        gguf_convert.convert_gguf_to_hf(path, staging)

    built = not (target / GGUF_MARKER).is_file()
    folder = build_once(target, convert, marker, "GGUF", marker_name=GGUF_MARKER)
    if built:
        _remove_older_conversions(path, folder)
    return folder


def _remove_older_conversions(path: Path, keep: Path) -> None:
    """Conversions of the same file from before it changed are dead weight in the cache."""
    for other in keep.parent.iterdir():
        if other == keep or not (other / GGUF_MARKER).is_file():
            continue
        try:
            source = json.loads((other / GGUF_MARKER).read_text()).get("source")
        except (OSError, ValueError):
            continue
        if source == str(path):
            shutil.rmtree(other, ignore_errors=True)
