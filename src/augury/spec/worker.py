"""Placeholder until the speculative worker lands."""
from __future__ import annotations


def build_speculator(config, model, tcfg, folder, dtype, device):
    if config.speculative_algorithm in (None, "none"):
        return None
    raise ValueError(f"speculative_algorithm {config.speculative_algorithm} is not available yet")
