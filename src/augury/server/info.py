"""/server_info: the effective configuration, versions, and what code is really running.

At start-up every loaded augury module's source file is hashed; each /server_info call
hashes the files again, so `changed_on_disk: true` says the file was edited (or replaced)
after this process loaded it, and the code that runs is not the code on disk.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from augury import cpu, distributed

_PACKAGES = ("torch", "transformers", "tokenizers", "fastapi", "uvicorn", "pydantic", "prometheus-client")


def _sha256(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def loaded_module_files(prefix: str = "augury") -> dict[str, str]:
    out = {}
    for name, module in list(sys.modules.items()):
        if name == prefix or name.startswith(prefix + "."):
            path = getattr(module, "__file__", None)
            if path:
                out[name] = os.path.realpath(path)
    return dict(sorted(out.items()))


@dataclass
class ServerInfo:
    """Facts fixed at start-up; `render` adds what can change (the files on disk, uptime)."""

    settings: dict[str, Any]
    engine: dict[str, Any]
    stage_seconds: dict[str, float]
    started_at: float = field(default_factory=time.time)
    modules: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    listening: str | None = None  # set once uvicorn listens

    @staticmethod
    def capture(settings: dict[str, Any], engine, stage_seconds: dict[str, float]) -> "ServerInfo":
        cfg = engine.config
        described = {
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "max_model_len": engine.max_model_len,
            "num_kv_blocks": engine.allocator.num_blocks,
            # its size in tokens, bytes and dtype, and what sized it (core/kv_budget.py)
            "kv_cache": None if engine.kv_plan is None else engine.kv_plan.describe(
                str(engine.kv.k.dtype).removeprefix("torch.")),
            "block_size": engine.allocator.block_size,
            "vocab_size": engine.model_cfg.vocab_size,
            "model_family": engine.model_cfg.family,
            "num_layers": engine.model_cfg.num_layers,
            "eos_token_ids": sorted(engine.eos_token_ids),
            "speculator": None if engine.speculator is None else type(engine.speculator).__name__,
            "tokenizer": None if engine.tokenizer is None else type(engine.tokenizer).__name__,
            "engine_config": cfg.to_dict(),
            "cpu": cpu.status(),
        }
        modules = {name: (path, _sha256(path)) for name, path in loaded_module_files().items()}
        return ServerInfo(settings, described, stage_seconds, modules=modules)  # live: HTTP lands later

    def render(self) -> dict[str, Any]:
        import augury

        files = []
        for name, (path, digest) in self.modules.items():
            now = _sha256(path)
            files.append({"module": name, "path": path, "sha256_at_start": digest,
                          "changed_on_disk": now != digest})
        return {
            "version": augury.__version__,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "uptime_seconds": round(time.time() - self.started_at, 3),
            "start_up_stage_seconds": self.stage_seconds,
            "listening_on": self.listening,
            "server": self.settings,
            "engine": self.engine,
            "versions": {"python": platform.python_version(), **{p: _version(p) for p in _PACKAGES}},
            "python_executable": sys.executable,
            "modules": files,
            "modules_changed_on_disk": [f["module"] for f in files if f["changed_on_disk"]],
            # ranks, backend and the seconds spent in collectives so far (augury/distributed)
            "tensor_parallel": distributed.status(),
        }
