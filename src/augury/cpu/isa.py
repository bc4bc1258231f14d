"""Which instruction-set level augury's CPU kernels are built for, from the CPU's own feature bits.

The levels, each a superset of the one before (a variant of every kernel is compiled per level;
the sources pick their instructions with the compiler's feature macros):
- avx2:         AVX2 + FMA + F16C (every x86-64 CPU augury's kernels run on)
- avx_vnni:     + AVX-VNNI (`vpdpbusd` on 256-bit registers: int8 dot products in one instruction)
- avx512_vnni:  + AVX-512 F/BW/VL/DQ and AVX512-VNNI
- avx512_bf16:  + AVX512-BF16 (`vdpbf16ps`, `vcvtne2ps2bf16`)

The feature bits are the CPU's cpuid bits as the operating system reports them (Linux: the
`flags` line of /proc/cpuinfo, which also leaves out what the kernel has not enabled, e.g.
AVX-512 state). AUGURY_CPU_ISA forces a lower level (for comparisons and tests); asking for
one the CPU lacks is an error naming both.
"""
from __future__ import annotations

import functools
import platform
from pathlib import Path

from augury.config import CPU_ISA_VAR, cpu_isa_override

LEVELS: tuple[str, ...] = ("avx2", "avx_vnni", "avx512_vnni", "avx512_bf16")

_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = _AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
# the cpuid flags (as /proc/cpuinfo names them) each level needs; the AVX-512 levels do not need
# AVX-VNNI (the VEX form), which some AVX-512 CPUs lack
REQUIRES: dict[str, frozenset[str]] = {
    "avx2": frozenset(_AVX2),
    "avx_vnni": frozenset(_AVX2 + ("avx_vnni",)),
    "avx512_vnni": frozenset(_AVX512),
    "avx512_bf16": frozenset(_AVX512 + ("avx512_bf16",)),
}

# compiler flags per level (the feature macros __AVXVNNI__, __AVX512VNNI__, __AVX512BF16__ follow)
FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx_vnni": ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
    "avx512_vnni": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512vnni"),
    "avx512_bf16": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512vnni", "-mavx512bf16"),
}


@functools.cache
def _cpuinfo_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def level_of(flags: frozenset[str] | set[str]) -> str | None:
    """The highest level whose required flags are all in `flags`, or None."""
    return next((lv for lv in reversed(LEVELS) if REQUIRES[lv] <= flags), None)


@functools.cache
def host_level() -> str | None:
    """The CPU's own level, or None where augury's kernels cannot run (not x86-64, or no AVX2/FMA)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return level_of(_cpuinfo_flags())


def why_unsupported() -> str | None:
    """Why this CPU cannot run the kernels, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU (this is {platform.machine()})"
    if host_level() is None:
        return "needs AVX2, FMA and F16C (not in this CPU's flags)"
    return None


def selected_level() -> str | None:
    """The level the kernels run at: AUGURY_CPU_ISA where set (at most the host's), else the host's.
    Raises ValueError for an unknown level or one above the host's."""
    host = host_level()
    forced = cpu_isa_override()
    if forced is None:
        return host
    if forced not in LEVELS:
        raise ValueError(f"{CPU_ISA_VAR}={forced!r} is not a level; use one of {', '.join(LEVELS)}")
    if host is None or not allowed_on_host(forced):
        raise ValueError(f"{CPU_ISA_VAR}={forced} needs CPU features this CPU lacks (its level: {host})")
    return forced


def allowed_on_host(level: str) -> bool:
    """Whether kernels built for `level` can run on this CPU."""
    return host_level() is not None and REQUIRES[level] <= _cpuinfo_flags()


def native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): oneDNN's bfloat16 GEMMs
    and attention are then fast, and torch need not emulate bfloat16 arithmetic."""
    flags = _cpuinfo_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags
