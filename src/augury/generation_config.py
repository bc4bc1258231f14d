"""The model's sampling defaults: `generation_config.json`'s, applied to a request's unset fields.

`--generation-config` takes vLLM's values: `auto` (default) reads the file in the model's folder (no
file: no defaults), `vllm` reads none (the server's own defaults: temperature 1, top_p 1, no top_k,
min_p or repetition penalty, max_tokens as each route says), a folder reads that folder's file
(which must exist). `none` is taken for `vllm` too. The fields read are vLLM's: temperature, top_p,
top_k, min_p, repetition_penalty and max_new_tokens (the default max_tokens); a request's own value
always wins. Like vLLM, `do_sample: false` is not read: a model whose file gives a temperature samples
at it unless the request says otherwise.

A value of the wrong type or out of range stops start-up with a line naming the file and the key.
Torch-free: read at start-up, once.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

FILE = "generation_config.json"
MODES = ("auto", "vllm", "none")
# the file's key -> the request field it is the default of
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_setting(value: str) -> str:
    """--generation-config, validated (ValueError naming the flag): a mode, or a folder that exists."""
    if value in MODES:
        return "vllm" if value == "none" else value
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise ValueError(f"--generation-config must be auto, vllm, none or a folder holding {FILE}; "
                         f"{value!r} is none of them")
    if not (folder / FILE).is_file():
        raise ValueError(f"--generation-config folder {value} has no {FILE}")
    return str(folder)


def load_defaults(setting: str, model_dir: Path | None) -> tuple[dict[str, Any], Path | None]:
    """(the sampling defaults as request fields, the file they came from); ({}, None) when there is none."""
    if setting == "vllm":
        return {}, None
    path = (model_dir / FILE if model_dir is not None else None) if setting == "auto" else Path(setting) / FILE
    if path is None or not path.is_file():
        return {}, None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    out = {}
    for key, name in KEYS.items():
        value = raw.get(key)
        if value is not None:
            out[name] = _checked(path, key, value)
    return out, path


def _checked(path: Path, key: str, value: Any) -> Any:
    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: {key} must be {what}, got {value!r}")

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad("a number")
    if key in ("top_k", "max_new_tokens"):
        if value != int(value):
            raise bad("an integer")
        value = int(value)
        if key == "top_k" and value < -1:
            raise bad("-1, 0 (off) or a positive integer")
        if key == "max_new_tokens" and value < 1:
            raise bad("a positive integer")
        return value
    value = float(value)
    if key == "temperature" and value < 0:
        raise bad("at least 0")
    if key == "top_p" and not 0 < value <= 1:
        raise bad("in (0, 1]")
    if key == "min_p" and not 0 <= value <= 1:
        raise bad("in [0, 1]")
    if key == "repetition_penalty" and value <= 0:
        raise bad("positive")
    return value


def describe(defaults: dict[str, Any], path: Path | None) -> str:
    """The start-up line's words for them."""
    if not defaults:
        return "none"
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in defaults.items()) + f" ({path})"
