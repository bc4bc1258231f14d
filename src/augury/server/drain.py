"""Graceful drain: what a stop signal (SIGTERM, SIGINT) does to a serving process.

The first signal starts the drain: no new request is admitted (`admit` answers 503 with
Retry-After, `/health` 503 {"status": "draining"}, so a load balancer takes the replica out) while
the server keeps listening, and the requests in flight get up to --shutdown-timeout seconds to
finish. Once none is left, or the time is up (those still running are then cut: a stream ends
with an error event naming the shutdown, a non-streamed request gets a 503), uvicorn stops and
the process exits 0, within --shutdown-timeout of the first signal: the cut comes TEARDOWN_SHARE
of the timeout (at most TEARDOWN_MAX seconds) before the end, so that the cut requests' last
events reach their clients and the connections close in the time left; at the deadline a backstop
ends the process (status 0) even if the engine thread is still inside a step or a worker thread
still tokenizes or compiles a grammar (a step of 64 rows on a loaded machine can outlast what is
left). A second signal cuts whatever is in flight and stops at once; the process
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
# The share of --shutdown-timeout kept for stopping after the cut (closing connections, joining the engine
# thread), and its cap: closing connections takes well under a second; 2 s covers a slow event loop too,
# and a long timeout is then nearly all the requests'.
TEARDOWN_SHARE, TEARDOWN_MAX = 0.2, 2.0
# What the backstop leaves after it ends the process: the kernel unmapping a multi-GB process (0.1-0.3 s
# measured on the demo under load) and the signal's delivery, so that the parent sees the exit in time.
EXIT_SLACK = 0.5
# The least time stopping gets after the cut, whatever the timeout: the cut requests' last events and 503s
# need the event loop for a moment (so a --shutdown-timeout under ~1 s may be exceeded by up to this).
MIN_STOP = 0.5


class Drain:
    def __init__(self, state: ServerState, timeout: float) -> None:
        self.state, self.timeout = state, timeout
        self.signal: int | None = None  # the first stop signal
        self.forced: int | None = None  # a second one
        self._since: float | None = None  # when the first one came (time.monotonic)
        self._announced = False
        self._stop_by: float | None = None  # when stopping must be done (time.monotonic), once it began

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
    def deadline(self) -> float | None:
        """When the process must be gone (time.monotonic), once a first signal came."""
        return None if self._since is None else self._since + self.timeout

    def remaining(self) -> float:
        """Seconds left for stopping: until the deadline less EXIT_SLACK, and at least MIN_STOP after
        stopping began (0 when past it; the whole timeout before any signal)."""
        if self.deadline is None:
            return self.timeout
        stop_by = self.deadline - EXIT_SLACK if self._stop_by is None else self._stop_by
        return max(0.0, stop_by - time.monotonic())

    def _stopping(self) -> bool:
        """tick's True: the time stopping has from now on is fixed."""
        assert self.deadline is not None
        self._stop_by = max(self.deadline - EXIT_SLACK, time.monotonic() + MIN_STOP)
        return True

    def arm_backstop(self) -> None:
        """Once the server stops (drained or cut): end the process at the deadline if it has not ended
        by then (a daemon timer: a process that stops in time is not held up by it)."""
        if self.deadline is None or self.forced is not None:
            return
        backstop = threading.Timer(max(self.remaining(), 0.05), self._stop_now)
        backstop.daemon = True
        backstop.start()

    def _stop_now(self) -> None:
        log.warning("--shutdown-timeout (%g s) reached while stopping (the engine thread or a worker thread was "
                    "still busy): exiting now", self.timeout)
        logging.shutdown()  # flush what the handlers hold
        os._exit(self.exit_status)

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
            return self._stopping()
        if waited >= self.timeout - min(TEARDOWN_MAX, TEARDOWN_SHARE * self.timeout):
            cut = loop.cut(f"the server is shutting down and its --shutdown-timeout of {self.timeout:g} s ran out "
                           "before this request finished")
            log.warning("--shutdown-timeout (%g s) ran out: %d request(s) still in flight cut after %.1f s; "
                        "stopping within the %.1f s left", self.timeout, cut, waited, self.remaining() + EXIT_SLACK)
            return self._stopping()
        return False


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
