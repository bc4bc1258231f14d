"""The built-in prompt sets moved to augury/prompts.py (the benchmarks share them); this name stays
for the training modules that import it."""
from augury.prompts import (  # noqa: F401
    EVAL_PERCENT, VALID_PERCENT, Prompt, builtin_prompts, held_out_prompts, make_splits, read_prompts_file, split_of,
    stdlib_modules,
)
