"""OpenAI-compatible HTTP server: `augury serve` (see startup.py for the start-up stages).

`serve_main(argv)` parses the serve flags, starts up, serves until stopped, and returns the
process exit status. Importing this package is cheap: nothing heavy loads until it runs.
"""
from __future__ import annotations


def serve_main(argv: list[str] | None = None) -> int:
    from augury.server.startup import serve_main as _serve_main

    return _serve_main(argv)


__all__ = ["serve_main"]
