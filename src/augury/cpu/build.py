"""The compiler driver: each kernel's C++ source (cpu/csrc/NAME.cpp with the shared headers) built
once per ISA level by the system's C++ compiler into the user cache, keyed by source, headers,
flags and compiler, and reused from there.

Where the cache folder cannot be written (read-only, full), the build goes to a per-user folder
under the system's temporary directory instead. A build killed half-way leaves a temporary file
(`.NAME-*.so`); stale ones are removed by the next build in that folder. `CXX` may carry a wrapper
and arguments (`CXX="ccache g++"`), split as a shell would.
"""
from __future__ import annotations

import getpass
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from augury.config import cache_root
from augury.cpu import isa

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
# -ffp-contract=off: scalar code follows its source (no fused multiply-adds the source did not write)
COMMON_FLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300
STALE_TEMP_S = 2 * BUILD_TIMEOUT_S  # a temporary older than any build could run is a killed build's


class KernelUnavailable(RuntimeError):
    """A kernel could not be built or loaded here (the message says why)."""


def compiler() -> list[str] | None:
    """The C++ compiler's command line ($CXX split as a shell would, else c++ or g++), or None."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        argv = shlex.split(cxx)
        path = shutil.which(argv[0])
        return [path, *argv[1:]] if path else None
    path = shutil.which("c++") or shutil.which("g++")
    return [path] if path else None


def flags(level: str) -> tuple[str, ...]:
    return (*COMMON_FLAGS, *isa.FLAGS[level])


def _folders() -> list[Path]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return [cache_root() / "kernels", Path(tempfile.gettempdir()) / f"augury-kernels-{user}"]


def _remove_stale_temporaries(folder: Path) -> None:
    now = time.time()
    for tmp in folder.glob(".*-*.so"):
        try:
            if now - tmp.stat().st_mtime > STALE_TEMP_S:
                tmp.unlink()
        except OSError:
            pass


def build(name: str, level: str) -> Path:
    """Compile csrc/<name>.cpp for ISA `level` (once; reused while source, flags and compiler stay the
    same) and return the shared library's path. Raises KernelUnavailable."""
    src = SOURCE_DIR / f"{name}.cpp"
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable(f"no C++ compiler found (CXX={os.environ.get('CXX', '')!r}; set CXX or install g++)")
    try:
        probe = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C++ compiler {' '.join(cxx)} does not run ({e})") from e
    if probe.returncode != 0:  # not a compiler (CXX=false): the same message for every kernel, warned once
        raise KernelUnavailable(f"the C++ compiler {' '.join(cxx)} does not run (--version exited {probe.returncode})")
    version = probe.stdout
    headers = [h.read_text() for h in sorted(SOURCE_DIR.glob("*.h"))]  # included by every source
    fl = flags(level)
    key = hashlib.sha256("\0".join([src.read_text(), *headers, *fl, version]).encode()).hexdigest()[:16]
    lib_name = f"{name}-{level}-{key}.so"
    folders = _folders()
    for folder in folders:
        if (folder / lib_name).is_file():
            return folder / lib_name
    errors = []
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _remove_stale_temporaries(folder)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=folder)
            os.close(fd)
        except OSError as e:  # read-only or full: try the next folder
            errors.append(f"{folder}: {e.strerror or e}")
            continue
        try:
            done = subprocess.run([*cxx, *fl, str(src), "-o", tmp], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                # no kernel name here (the loader adds it): one cause failing every kernel reads the same
                raise KernelUnavailable(f"{' '.join(cxx)} failed ({level}, exit {done.returncode}): {' / '.join(tail)}")
            os.replace(tmp, folder / lib_name)  # atomic: a concurrent build of the same key writes the same bytes
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"building for {level} failed: {e}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if errors:
            log.info("kernel cache not writable (%s); built into %s", "; ".join(errors), folder)
        log.info("built augury CPU kernel %s (%s)", lib_name, " ".join(cxx))
        return folder / lib_name
    raise KernelUnavailable(f"no writable folder for the kernels ({'; '.join(errors)})")
