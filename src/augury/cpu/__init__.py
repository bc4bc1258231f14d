"""augury's CPU compute: the C++ kernels (csrc/), the compiler driver that builds them per ISA level
(build.py), the CPU feature probe that picks the level (isa.py) and their Python faces (kernels.py:
ctypes bindings, self-checks, loaders). Depends on torch and augury.config only; the model's linear
modules (models/quant.py, models/dense.py), attention (attention/paged.py) and the fused layer
stack (models/fused.py) pick their kernels from here.
"""


def status() -> dict:
    """What runs here, for the start-up log, /server_info and /metrics: the CPU's own ISA level, the
    level the kernels were built for (None where they cannot run) and each kernel loaded so far."""
    from augury.cpu import isa, kernels

    try:
        level = kernels.level()
    except ValueError as e:  # a bad AUGURY_CPU_ISA: the kernels stay off, and say why
        level = f"invalid ({e})"
    return {"host_isa": isa.host_level(), "kernels_isa": level,
            "kernels": {name: kernels._cache[name] is not None for name in kernels.NAMES if name in kernels._cache}}
