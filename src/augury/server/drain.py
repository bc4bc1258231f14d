"""Graceful drain: what a stop signal (SIGTERM, SIGINT) does to a serving process.

The first signal starts the drain: no new request is admitted (`admit` answers 503 with
Retry-After, `/health` 503 {"status": "draining"}, so a load balancer takes the replica out) while
the server keeps listening, and the requests in flight get up to --shutdown-timeout seconds to
finish. Once none is left, or the time is up (those still running are then cut: a stream ends
with an error event naming the shutdown, a non-streamed request gets a 503), uvicorn stops and
the process exits 0. A second signal cuts whatever is in flight and stops at once; the process
then exits 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), within FORCE_GRACE
seconds whatever is still running.

`on_signal` runs inside Python's signal handler, between two bytecodes of the event loop's own
thread: it only sets fields. `tick` does the work on the event loop, every 0.1 s (uvicorn's
on_tick).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

from augury.server.serving import ServerState

log = logging.getLogger("augury.server")
FORCE_GRACE = 3.0  # seconds a second signal leaves the process to stop by itself before it is ended


class Drain:
    def __init__(self, state: ServerState, timeout: float) -> None:
        self.state, self.timeout = state, timeout
        self.signal: int | None = None  # the first stop signal
        self.forced: int | None = None  # a second one
        self._since: float | None = None  # when the first one came (time.monotonic)
        self._announced = False

    def on_signal(self, sig: int) -> None:
        """The signal handler's part: fields only (nothing here may block or take a lock)."""
        if self.signal is None:
            self.signal, self._since = sig, time.monotonic()
            self.state.draining = True
            return
        if self.forced is None:
            self.forced = sig
            # the event loop normally stops within a tick; this ends the process if it does not
            backstop = threading.Timer(FORCE_GRACE, os._exit, (128 + sig,))
            backstop.daemon = True  # a process that stops in time is not held up by it
            backstop.start()

    @property
    def exit_status(self) -> int:
        return 0 if self.forced is None else 128 + self.forced

    def tick(self) -> bool:
        """On the event loop: True when the server should stop now (after cutting what must be cut)."""
        if self.signal is None or self._since is None:
            return False
        loop = self.state.loop
        if not self._announced:
            self._announced = True
            log.info("draining (%s): no new requests; %d in flight get up to %g s to finish (a second signal "
                     "stops at once)", _name(self.signal), loop.in_flight, self.timeout)
        waited = time.monotonic() - self._since
        if self.forced is not None:
            cut = loop.cut("the server was stopped (a second stop signal) before this request finished")
            log.warning("stopping now (%s): %d request(s) cut", _name(self.forced), cut)
            return True
        if loop.in_flight == 0:
            log.info("drained in %.1f s: every request in flight finished; stopping", waited)
            return True
        if waited >= self.timeout:
            cut = loop.cut(f"the server is shutting down and its --shutdown-timeout of {self.timeout:g} s ran out "
                           "before this request finished")
            log.warning("--shutdown-timeout (%g s) ran out: %d request(s) still in flight cut; stopping",
                        self.timeout, cut)
            return True
        return False


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
