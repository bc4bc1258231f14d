"""Named start-up stages: each completes, or raises StartupError naming it (torch-free).

Used by the engine builder (configuration ... warm-up) and by the server (HTTP), so every
stage fails the same way, and a test can fail any of them with AUGURY_FAULT_INJECT=<stage>.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from augury.config import injected_fault_stage

log = logging.getLogger("augury.startup")


class StartupError(RuntimeError):
    def __init__(self, stage: str, cause: BaseException) -> None:
        self.stage = stage
        self.cause = cause
        super().__init__(f"start-up failed at stage '{stage}': {cause}")


@contextmanager
def stage(name: str, notify: Callable[[str], None] | None = None, announce: bool = True) -> Iterator[None]:
    """Run one named stage: any failure inside it (an injected one included) is a StartupError."""
    if notify is not None:
        notify(name)
    if announce:
        log.info("start-up stage: %s", name)
    try:
        if injected_fault_stage() == name:
            raise RuntimeError("fault injected by AUGURY_FAULT_INJECT")
        yield
    except StartupError:
        raise
    except Exception as exc:
        raise StartupError(name, exc) from exc
