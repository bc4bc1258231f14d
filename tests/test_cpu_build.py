"""The kernels' compiler driver (augury/cpu/build.py) and the loaders' failure handling
(augury/cpu/kernels.py): a read-only cache falls back to the temporary folder, a wrapper in CXX is
run, a killed build's temporary is cleaned up, and a kernel that cannot build or check warns once.

Each test builds a tiny source (build.SOURCE_DIR pointed at tmp_path) into a fresh AUGURY_CACHE_DIR
and a private temporary folder, so no real kernel is compiled and no shared cache is touched."""
from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import pytest

from augury.cpu import build, isa
from augury.cpu import kernels as cpu_kernels

HAS_CXX = build.compiler() is not None
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="needs a C++ compiler")
CAN_BUILD = isa.why_unsupported() is None and HAS_CXX


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """A one-function source as csrc/tiny.cpp, a fresh cache and a private temporary folder; returns
    (cache folder of the kernels, temporary folder)."""
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "tiny.cpp").write_text('extern "C" int augury_tiny() { return 42; }\n')
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    monkeypatch.setenv("AUGURY_CACHE_DIR", str(tmp_path / "cache"))
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    cpu_kernels.reset()
    try:
        yield tmp_path / "cache" / "kernels", systmp
    finally:
        cpu_kernels.reset()


def _calls(lib: Path) -> int:
    import ctypes

    return ctypes.CDLL(str(lib)).augury_tiny()


@needs_cxx
def test_read_only_cache_falls_back_to_the_temporary_folder(tiny, monkeypatch) -> None:
    cache, systmp = tiny
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*a, dir=None, **kw):  # the cache refuses files (as chmod 0o555 would for a non-root user)
        if dir is not None and Path(dir) == cache:
            raise PermissionError(13, "Permission denied", str(dir))
        return real_mkstemp(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    lib = build.build("tiny", "avx2")
    assert lib.parent.parent == systmp and lib.parent.name.startswith("augury-kernels-")
    assert _calls(lib) == 42
    assert not list(cache.glob("*.so"))
    # found there next time, without building again
    monkeypatch.setattr(build.subprocess, "run", _no_compiler_run(build.subprocess.run))
    assert build.build("tiny", "avx2") == lib


def _no_compiler_run(real):
    def run(argv, *a, **kw):
        if "-o" in argv:
            raise AssertionError(f"built again: {argv}")
        return real(argv, *a, **kw)
    return run


@needs_cxx
def test_cache_under_a_regular_file_falls_back_to_the_temporary_folder(tiny, monkeypatch, tmp_path) -> None:
    _, systmp = tiny
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AUGURY_CACHE_DIR", str(blocker / "cache"))
    lib = build.build("tiny", "avx2")
    assert lib.parent.parent == systmp and _calls(lib) == 42


@needs_cxx
def test_no_writable_folder_at_all_is_kernel_unavailable(tiny, monkeypatch, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AUGURY_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(blocker / "tmp"))
    with pytest.raises(build.KernelUnavailable, match="no writable folder"):
        build.build("tiny", "avx2")


@needs_cxx
@pytest.mark.parametrize("how", ["env", "script"])
def test_cxx_with_a_wrapper_and_arguments_is_honoured(tiny, monkeypatch, tmp_path, how) -> None:
    """CXX="ccache g++"-style: the wrapper runs, with the compiler as its argument."""
    cache, _ = tiny
    cxx = build.compiler()[0]
    log_file = tmp_path / "calls.txt"
    script = tmp_path / "wrap.sh"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{log_file}"\nexec "$@"\n')
    script.chmod(0o755)
    if how == "env":  # env's own argument: a variable the wrapped compiler sees
        monkeypatch.setenv("CXX", f"env AUGURY_TEST_WRAPPED=1 {script} {cxx}")
    else:
        monkeypatch.setenv("CXX", f"{script} {cxx}")
    assert build.compiler()[1:] == (["AUGURY_TEST_WRAPPED=1", str(script), cxx] if how == "env" else [cxx])
    lib = build.build("tiny", "avx2")
    assert lib.parent == cache and _calls(lib) == 42
    calls = log_file.read_text().splitlines()
    assert any(c.startswith(cxx) and "-o" in c.split() for c in calls), calls
    assert any("--version" in c for c in calls), calls
    # the key is the compiler's version, not how it is reached: plain CXX finds the same library
    monkeypatch.setenv("CXX", cxx)
    assert build.build("tiny", "avx2") == lib


@needs_cxx
def test_a_killed_builds_stale_temporary_is_removed_by_the_next_build(tiny) -> None:
    cache, _ = tiny
    cache.mkdir(parents=True)
    stale = cache / ".tiny-killed01.so"
    stale.write_bytes(b"half a library")
    old = time.time() - build.STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    other_stale = cache / ".w4a8-killed02.so"  # another kernel's, as stale
    other_stale.write_bytes(b"")
    os.utime(other_stale, (old, old))
    fresh = cache / ".tiny-running03.so"  # a build in progress elsewhere: left alone
    fresh.write_bytes(b"")
    keep = cache / "notes-1.so"  # not a temporary
    keep.write_bytes(b"")
    os.utime(keep, (old, old))
    lib = build.build("tiny", "avx2")
    assert lib.parent == cache
    assert not stale.exists() and not other_stale.exists()
    assert fresh.exists() and keep.exists()
    assert sorted(p.name for p in cache.iterdir()) == sorted([lib.name, fresh.name, keep.name])


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and a C++ compiler")
def test_every_kernel_failing_to_build_warns_once(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("AUGURY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systmp"))
    monkeypatch.setenv("CXX", "false")
    cpu_kernels.reset()
    try:
        with caplog.at_level(logging.INFO, logger="augury.cpu.kernels"):
            found = cpu_kernels.load_all()
        assert found == {name: False for name in cpu_kernels.NAMES}
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "false" in warnings[0].getMessage()
        # each kernel still says, at INFO, that it is off
        infos = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
        assert all(name in infos for name in cpu_kernels.NAMES[1:]), infos
        assert not list(tmp_path.rglob("*.so"))
    finally:
        cpu_kernels.reset()


def test_a_self_check_raising_while_loading_lazily_is_caught(monkeypatch, tmp_path, caplog) -> None:
    """A self-check that raises (a RuntimeError from a kernel's rc, or anything else) leaves the kernel
    off with one warning; the caller gets None, not the exception."""
    monkeypatch.setattr(cpu_kernels.isa, "why_unsupported", lambda: None)
    monkeypatch.setattr(cpu_kernels.isa, "selected_level", lambda: "avx2")
    monkeypatch.setenv("AUGURY_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu_kernels, "build", lambda name, level: tmp_path / f"{name}.so")

    class Fake:
        def __init__(self, path):
            self.path = path

    def failing(k):
        raise RuntimeError("w4a8 kernel failed (code 1: bad shapes)")

    monkeypatch.setattr(cpu_kernels, "W4A8", Fake)
    monkeypatch.setattr(cpu_kernels, "W8A8", Fake)
    monkeypatch.setattr(cpu_kernels, "_rounding_self_check", failing)
    cpu_kernels.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="augury.cpu.kernels"):
            assert cpu_kernels.w4a8() is None
            assert cpu_kernels.w4a8() is None  # remembered: not loaded again
        assert len(caplog.records) == 1 and "bad shapes" in caplog.records[0].getMessage()
        # any exception, not only the ones a kernel is expected to raise
        monkeypatch.setattr(cpu_kernels, "_rounding_self_check", lambda k: 1 / 0)
        assert cpu_kernels.w8a8() is None
    finally:
        cpu_kernels.reset()
