"""EAGLE-3 head training (training-time test) for augury targets: `augury train-draft`."""
from __future__ import annotations


def train_main(argv: list[str] | None = None) -> int:
    """Run `augury train-draft` with these arguments (sys.argv[1:] when None); returns an exit code."""
    from augury.train.cli import train_main as main

    return main(argv)


__all__ = ["train_main"]
