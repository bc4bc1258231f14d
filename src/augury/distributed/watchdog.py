"""The watchdog: a thread per rank that notices a dead or silent rank within a bounded time.

Every rank bumps its own heartbeat counter in the rendezvous store once a second (a thread of its
own: a rank busy in a forward still beats, a stopped or wedged process does not). Rank 0 watches
every other rank's counter and the worker processes it started itself; the other ranks watch rank
0's counter (and the store, which rank 0 or the launcher hosts: losing it means rank 0 is gone).
A counter that has not moved for `timeout` seconds, a child that exited, or a store that stopped
answering is a failure, reported once through `on_failure(line)` with a line naming the rank.
What happens then is the launcher's policy (launch.py): kill the local workers so that any
collective waiting on them fails at once, then raise in the caller or end the process.
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import timedelta

HEARTBEAT = "augury/hb/{}"
INTERVAL = 1.0  # seconds between heartbeats


def exit_description(code: int) -> str:
    """`exited with code 3` / `was killed by SIGKILL`."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Watchdog(threading.Thread):
    def __init__(self, host: str, port: int, rank: int, watched: list[int], timeout: float,
                 children: dict[int, subprocess.Popen], on_failure: Callable[[str], None]) -> None:
        super().__init__(name=f"augury-watchdog-{rank}", daemon=True)
        self.host, self.port, self.rank = host, port, rank
        self.watched, self.timeout, self.children = watched, timeout, children
        self.on_failure = on_failure
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._failed = False
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it last moved)

    def run(self) -> None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(self.host, self.port, None, False, timeout=timedelta(seconds=max(5.0, self.timeout)))
        except Exception as e:  # noqa: BLE001
            self._fail(f"tensor-parallel rank {self.rank} cannot reach the rendezvous store at "
                       f"{self.host}:{self.port} ({' '.join(str(e).split())})")
            return
        while not self._stop_event.is_set():
            now = time.monotonic()
            try:
                store.add(HEARTBEAT.format(self.rank), 1)
                counts = {r: store.add(HEARTBEAT.format(r), 0) for r in self.watched}
            except Exception as e:  # noqa: BLE001 - the store lives with rank 0 (or its launcher)
                if self._stop_event.is_set():
                    return
                self._fail(f"tensor-parallel rank {self.rank} lost contact with rank 0 (its rendezvous store at "
                           f"{self.host}:{self.port} stopped answering: {' '.join(str(e).split())})")
                return
            for r, count in counts.items():
                last = self._seen.get(r)
                if last is None or count != last[0]:
                    self._seen[r] = (count, now)
                elif now - last[1] > self.timeout:
                    self._fail(f"tensor-parallel rank {r} stopped responding (no heartbeat for "
                               f"{now - last[1]:.0f} s; --dist-timeout {self.timeout:g})")
                    return
            if self.check_now():
                return
            self._stop_event.wait(INTERVAL)

    def stale(self, min_age: float) -> list[tuple[int, float]]:
        """Watched ranks whose heartbeat has not moved for at least min_age seconds: (rank, seconds)."""
        now = time.monotonic()
        return sorted(((r, now - seen) for r, (_, seen) in self._seen.items() if now - seen >= min_age),
                      key=lambda x: -x[1])

    def blame(self) -> None:
        """A collective has just failed: report the rank to blame now, if the heartbeats show one (a rank
        silent for over two heartbeats, or a local worker that exited)."""
        if self.check_now():
            return
        silent = self.stale(2.5 * INTERVAL)
        if silent:
            r, age = silent[0]
            self._fail(f"tensor-parallel rank {r} stopped responding (no heartbeat for {age:.0f} s; "
                       f"--dist-timeout {self.timeout:g})")

    def check_now(self) -> bool:
        """Look at the local worker processes now; True if one has exited (then reported)."""
        for r, proc in list(self.children.items()):
            code = proc.poll()
            if code is not None:
                self._fail(f"tensor-parallel rank {r} (pid {proc.pid}) {exit_description(code)}")
                return True
        return False

    def _fail(self, line: str) -> None:
        with self._lock:
            if self._failed or self._stop_event.is_set():
                return
            self._failed = True
        self.on_failure(line)

    def stop(self) -> None:
        """No more reports (a clean shutdown: the ranks are leaving on purpose)."""
        self._stop_event.set()
