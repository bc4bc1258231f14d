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
- a Hugging Face checkpoint folder, as given;
- `Org/Name` that is not a path here (target or head): a Hugging Face Hub repository, fetched with
  huggingface_hub's `snapshot_download` into its cache (HF_HUB_CACHE; the files augury reads: configs,
  safetensors weights, tokenizer files) at `revision` / `draft_revision` (default: main), the
  snapshot folder then used as a folder. With HF_HUB_OFFLINE set nothing is fetched: a repository
  already in the cache is used, one that is not is a one-line error saying so.

`check(config)` does the cheap part (the paths named exist, a head is there when eagle3 is
asked for, an offline Hub name is in the cache) without fetching or converting anything;
`resolve` does it too, first. Torch-free unless a GGUF file has to be converted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
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
_HINT = ("pass a Hugging Face checkpoint folder, a Hugging Face Hub name (Org/Name), a llama-architecture "
         ".gguf file, or 'demo'")
# Org/Name: a Hugging Face Hub repository id (huggingface_hub's own rules check it further)
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
# what a snapshot brings: configs, safetensors weights, tokenizer files and templates (no .bin, .gguf, ...)
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")


def check(config: EngineConfig) -> None:
    """Raise ValueError, naming the field, if a path does not exist or eagle3 has no head; fetches nothing."""
    for name, value, revision in (("model", config.model, config.revision),
                                  ("draft_model", config.draft_model, config.draft_revision)):
        if is_hub_name(value):
            if hub_offline():  # the cache alone answers: say now, before anything loads
                hub_folder(value, revision, name)
        elif revision is not None and value is not None:
            field = "revision" if name == "model" else "draft_revision"
            raise ValueError(f"{field} applies to a Hugging Face Hub name (Org/Name); {name} {value} is not one")
    if not is_hub_name(config.model):
        _target_path(config.model)
    _draft_dir(config, fetch=False)


def resolve(config: EngineConfig) -> ResolvedModel:
    """The folders `config` names, fetching the demo or a Hub repository, or converting a GGUF file, on first use."""
    check(config)
    target = hub_folder(config.model, config.revision, "model") if is_hub_name(config.model) \
        else _target_dir(config.model)
    return ResolvedModel(target, _draft_dir(config))


def is_hub_name(name: str | None) -> bool:
    """Org/Name that names no path here: a Hugging Face Hub repository."""
    return name is not None and HUB_NAME.fullmatch(name) is not None and not Path(name).expanduser().exists()


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it, read now (it reads it at import)."""
    from huggingface_hub import constants

    raw = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return constants.HF_HUB_OFFLINE or (raw or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_folder(repo: str, revision: str | None, name: str) -> Path:
    """The snapshot folder of Hub repository `repo` at `revision`, fetched into huggingface_hub's cache
    unless it is there (offline: only the cache). ValueError, one line naming the field, when it cannot be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hub

    offline, at = hub_offline(), f" at revision {revision}" if revision else ""
    try:
        folder = snapshot_download(repo, revision=revision, allow_patterns=list(HUB_FILES), local_files_only=offline,
                                   cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    except hub.GatedRepoError:
        raise ValueError(f"{name} {repo} is gated on the Hugging Face Hub: accept its terms on huggingface.co and "
                         "log in (hf auth login, or HF_TOKEN)") from None
    except hub.RepositoryNotFoundError:
        raise ValueError(f"{name} {repo} is neither a path here nor a Hugging Face Hub repository (a private one "
                         f"needs HF_TOKEN); {_HINT}") from None
    except hub.RevisionNotFoundError:
        raise ValueError(f"{name} {repo} has no revision {revision!r} on the Hugging Face Hub") from None
    except (hub.LocalEntryNotFoundError, hub.IncompleteSnapshotError):
        if offline:
            raise ValueError(f"{name} {repo}{at} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: fetch "
                             f"it where the Hub is reachable (hf download {repo}), or unset HF_HUB_OFFLINE") from None
        from huggingface_hub import constants

        endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
        raise ValueError(f"{name} {repo}{at} is not in the Hugging Face cache and the Hub ({endpoint}) cannot be "
                         "reached; check the network (or HF_TOKEN for a private repository)") from None
    except hub.HFValidationError as e:
        raise ValueError(f"{name} {repo} is not a valid Hugging Face Hub name: {e}") from None
    except OSError as e:  # the Hub's HTTP errors, the network, the disk
        raise ValueError(f"{name} {repo}{at}: fetching from the Hugging Face Hub failed: "
                         f"{' '.join(str(e).split())[:300]}") from None
    return Path(folder)


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


def _draft_dir(config: EngineConfig, fetch: bool = True) -> Path | None:
    """The head's folder; a Hub name is fetched (fetch), or stands for the folder it will be (not fetch)."""
    if is_hub_name(config.draft_model):
        if not fetch:
            return Path(config.draft_model)
        return hub_folder(config.draft_model, config.draft_revision, "draft_model")
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
