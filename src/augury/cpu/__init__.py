"""augury's CPU compute: the C++ kernels (csrc/), the compiler driver that builds them per ISA level
(build.py), the CPU feature probe that picks the level (isa.py) and their Python faces (kernels.py:
ctypes bindings, self-checks, loaders). Depends on torch and augury.config only; the model's linear
modules (models/quant.py, models/dense.py), attention (attention/paged.py) and the fused layer
stack (models/fused.py) pick their kernels from here.
"""
