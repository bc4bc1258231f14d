"""Each system of `augury bench` in a process of its own, started as its users would start it.

A system measured inside augury's process would inherit what augury's process did to itself:
the OMP_WAIT_POLICY that `import augury` may set, AUGURY_* variables, the OpenMP runtime and
thread pool torch loaded, torch's thread count. A peer (llama.cpp, transformers) is therefore run
by a persistent worker: a fresh interpreter (subprocess: exec, the "spawn" way, nothing of the
parent's interpreter state inherited) whose environment is the user's (`user_environment`: the
parent's os.environ at bench start, but the variables augury's import sets as the process
started with them), less every AUGURY_* variable for peers. An augury system's worker gets the
user's environment with its AUGURY_* variables, and imports augury as any augury user does.

The parent drives a worker with pickled messages over the worker's stdin and stdout (the
worker's own prints and C libraries' output go to its stderr): load the system once, then run
a prompt set (timed in the worker: wall-clock, the worker's CPU time and, where the system notes
its first tokens, the split into prefill and decode: `run_groups`), read its speculation
counts, close. `WorkerSystem` is the parent's handle; it is a benchmark System.
"""
from __future__ import annotations

import os
import pickle
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# what `import augury` may set in os.environ of its own process (augury/__init__.py); a peer gets
# these only as the user's shell had them
AUGURY_SETS = ("OMP_WAIT_POLICY",)
AUGURY_PREFIX = "AUGURY_"  # every variable augury reads
# systems whose worker must not load torch (its OpenMP runtime and thread pool): the peers that
# are not torch programs
TORCH_FREE = ("llama.cpp",)

# the worker's first lines: note the environment before anything of augury is imported
_BOOT = ("import os, sys; start = dict(os.environ); sys.path.insert(0, sys.argv[1]); "
         "from augury.bench.worker import serve; serve(start, sys.argv[2] == 'peer')")


def initial_environ() -> dict[str, str] | None:
    """The environment this process was started with (Linux: /proc/self/environ, which changes to
    os.environ leave alone), or None where it cannot be read."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[os.fsdecode(key)] = os.fsdecode(value)
    return env


def user_environment(current: Mapping[str, str] | None = None,
                     initial: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a user of a system has: `current` (default os.environ now, i.e. at bench
    start, with whatever the caller set), except the variables augury's import sets (AUGURY_SETS),
    which are as the process started with them (`initial`, default initial_environ()). Where the
    start environment cannot be read, an OMP_WAIT_POLICY of PASSIVE (augury's own) is taken for
    augury's and dropped."""
    env = dict(os.environ if current is None else current)
    first = initial_environ() if initial is None else initial
    for var in AUGURY_SETS:
        if first is None:
            if env.get(var) == "PASSIVE":
                env.pop(var)
        elif var in first:
            env[var] = first[var]
        else:
            env.pop(var, None)
    return env


def is_peer(name: str) -> bool:
    """Whether a system is another project's (its name does not start with "augury")."""
    return not name.startswith("augury")


def worker_environment(name: str, user_env: Mapping[str, str]) -> dict[str, str]:
    """The environment system `name`'s worker starts with: the user's, and for a peer without any
    AUGURY_* variable (augury reads them; a user of the peer has no reason to set them)."""
    if not is_peer(name):
        return dict(user_env)
    return {k: v for k, v in user_env.items() if not k.startswith(AUGURY_PREFIX)}


class WorkerError(ValueError):
    """A worker's command failed; the message is the worker's one-line error, already written for
    users (a ValueError, so the command prints it as it is)."""


class WorkerSystem:
    """The parent's handle on one system's worker process (a benchmark System).

    `start()` starts the process and asks it to load the system without waiting; `wait_loaded()`
    waits for it (so several systems load side by side). `user_env`: the user's environment
    (default: user_environment()). `start(load=False)` starts the bare process only (its
    environ() and process_info() answer; nothing else does).
    """

    def __init__(self, name: str, settings: Any, user_env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.settings = settings
        self.env = worker_environment(name, user_environment() if user_env is None else user_env)
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None  # the worker's process id (kept after close)
        self.info: dict[str, Any] = {}  # the worker's pid, threads, ISA levels and OMP_WAIT_POLICY
        self._supports: dict[int, bool] = {}

    # ------------------------------------------------------------------ process
    def start(self, load: bool = True) -> WorkerSystem:
        import augury

        src = str(Path(augury.__file__).resolve().parents[1])  # this very augury, wherever it is installed
        factory = _portable_factory(self.name) if load else None  # before starting: it may refuse the name
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, src, "peer" if is_peer(self.name) else "augury"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env)
        self.pid = self.proc.pid
        if load:
            self._send("load", self.name, self.settings, factory)
        return self

    def wait_loaded(self) -> dict[str, Any]:
        self.info = self._receive("load")
        return self.info

    def _send(self, *message: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            pickle.dump(message, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died(message[0]) from None

    def _receive(self, command: str) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            reply = pickle.load(self.proc.stdout)
        except (EOFError, pickle.UnpicklingError, OSError):
            raise self._died(command) from None
        if reply[0] == "ok":
            return reply[1]
        error = WorkerError(f"{self.name}: {reply[1]}")
        error.add_note(f"in {self.name}'s worker (pid {self.pid}):\n{reply[2]}")
        raise error

    def _died(self, command: str) -> WorkerError:
        try:
            code = self.proc.wait(timeout=30) if self.proc else None
        except subprocess.TimeoutExpired:
            code = "running, not answering"
        return WorkerError(f"{self.name}: its worker process exited (status {code}) during {command!r}; "
                           f"see its messages above")

    def environ(self) -> dict[str, str]:
        """The worker's os.environ now."""
        return self.call("environ")

    def process_info(self) -> dict[str, Any]:
        """The worker's pid, threads, ISA levels and OMP_WAIT_POLICY (as `info` after loading)."""
        return self.call("info")

    def imported(self, module: str) -> bool:
        """Whether the worker has imported `module` (a llama.cpp worker never imports torch)."""
        return self.call("imported", module)

    def call(self, command: str, *args: Any) -> Any:
        self._send(command, *args)
        return self._receive(command)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                pickle.dump(("close",), proc.stdin)
                proc.stdin.close()
                proc.wait(timeout=10)  # a worker busy generating (the parent interrupted) is killed
        except (OSError, subprocess.TimeoutExpired, ValueError):
            proc.kill()
            proc.wait()
        finally:
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass

    # ------------------------------------------------------------------ System
    def supports(self, batch_size: int) -> bool:
        if batch_size not in self._supports:
            self._supports[batch_size] = self.call("supports", batch_size)
        return self._supports[batch_size]

    def timed_run(self, groups: list[list[list[int]]], output_len: int,
                  stop_at_eos: bool = False) -> tuple[list[list[int]], float, float, tuple[float, float] | None]:
        """Every group generated in turn, timed in the worker: `run_groups`'s (outputs, wall seconds, CPU
        seconds, (seconds to first tokens, decode-only seconds) or None)."""
        return self.call("run", groups, output_len, stop_at_eos)

    def generate(self, prompts: list[list[int]], output_len: int, stop_at_eos: bool = False) -> list[list[int]]:
        return self.timed_run([prompts], output_len, stop_at_eos)[0]

    def reset_counts(self) -> None:
        self.call("reset_counts")

    def stats(self, kinds: dict[str, list[list[int]]] | None = None) -> dict[str, Any]:
        """accept_length, spec_fraction and (given prompts per kind) accept_by_kind (None for a
        system that counts no speculation)."""
        return self.call("stats", kinds)

    @property
    def accept_length(self) -> float:
        return self.stats()["accept_length"]

    @property
    def spec_fraction(self) -> float:
        return self.stats()["spec_fraction"]

    @property
    def mask_share(self) -> float:
        return self.stats()["mask_share"]

    def accept_by_kind(self, kinds: dict[str, list[list[int]]]) -> dict[str, float] | None:
        return self.stats(kinds)["accept_by_kind"]


class WorkerPool:
    """One system in several worker processes (`augury bench --processes N`): its r-th timed run of a
    batch size goes to process r % N, so whatever sets one process apart from another (two identical
    systems, each in one worker, paired at 0.94-0.99 over five runs on an AMX Xeon) is spread over its
    repeats instead of carried by every one of them. Warm-ups run in every process; the statistics
    are the processes' mean; `info` is the first process's."""

    def __init__(self, workers: list[WorkerSystem]) -> None:
        if not workers or len({w.name for w in workers}) != 1:
            raise ValueError("a worker pool needs one or more workers of one system")
        self.workers = workers
        self.name = workers[0].name
        self.info = workers[0].info
        self._runs = 0  # timed runs since the counts were last reset (a batch size's repeats)

    def supports(self, batch_size: int) -> bool:
        return self.workers[0].supports(batch_size)

    def timed_run(self, groups: list[list[list[int]]], output_len: int,
                  stop_at_eos: bool = False) -> tuple[list[list[int]], float, float, tuple[float, float] | None]:
        worker = self.workers[self._runs % len(self.workers)]
        self._runs += 1
        return worker.timed_run(groups, output_len, stop_at_eos)

    def generate(self, prompts: list[list[int]], output_len: int, stop_at_eos: bool = False) -> list[list[int]]:
        """Every process generates (a warm-up warms them all); the first one's answer."""
        return [w.generate(prompts, output_len, stop_at_eos) for w in self.workers][0]

    def reset_counts(self) -> None:
        for w in self.workers:
            w.reset_counts()
        self._runs = 0

    def _mean(self, key: str) -> float:
        return statistics.fmean(w.stats()[key] for w in self.workers)

    @property
    def accept_length(self) -> float:
        return self._mean("accept_length")

    @property
    def spec_fraction(self) -> float:
        return self._mean("spec_fraction")

    @property
    def mask_share(self) -> float:
        return self._mean("mask_share")

    def accept_by_kind(self, kinds: dict[str, list[list[int]]]) -> dict[str, float] | None:
        got = [d for d in (w.accept_by_kind(kinds) for w in self.workers) if d is not None]
        if not got:
            return None
        return {k: statistics.fmean(d.get(k, 0.0) for d in got) for k in kinds}

    def close(self) -> None:
        for w in self.workers:
            w.close()


def start_workers(names: list[str], settings: Any, user_env: Mapping[str, str] | None = None) -> list[WorkerSystem]:
    """One loaded worker per system, loading side by side; on any failure every one is closed."""
    env = user_environment() if user_env is None else user_env
    workers: list[WorkerSystem] = []
    try:
        for name in names:
            workers.append(WorkerSystem(name, settings, env).start())
        for w in workers:
            w.wait_loaded()
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def _portable_factory(name: str) -> bytes | None:
    """The system's factory pickled, when it pickles (a registered module-level function or class,
    which the worker imports by name); None when the worker finds it by name itself (the built-in
    ones, shaped and @MODE names)."""
    from augury.bench import system_factory

    factory = system_factory(name)
    if getattr(factory, "__module__", "").startswith("augury."):
        return None
    try:
        return pickle.dumps(factory)
    except (pickle.PicklingError, AttributeError, TypeError):
        raise ValueError(f"system {name!r}: its worker process cannot import its factory {factory!r}; register "
                         f"a module-level function or class of an importable module") from None


# ---------------------------------------------------------------------- the worker's side
def process_info(system: Any = None, name: str = "", omp_wait_policy: str | None = None) -> dict[str, Any]:
    """This process's id, its thread count (the system's own `threads` where it has one, e.g.
    llama.cpp's n_threads; else torch's where torch is loaded), the CPU's ISA level, the level
    augury's kernels run at (augury systems) and OMP_WAIT_POLICY as the process saw it."""
    from augury.cpu.isa import host_level

    threads = getattr(system, "threads", None)
    if threads is None and "torch" in sys.modules:
        threads = sys.modules["torch"].get_num_threads()
    kernels = None
    if name.startswith("augury"):
        try:
            from augury.cpu import kernels as cpu_kernels

            kernels = cpu_kernels.level()
        except ValueError as exc:  # a bad AUGURY_CPU_ISA
            kernels = f"error: {exc}"
    return {"pid": os.getpid(), "threads": threads, "isa": host_level(), "kernels_isa": kernels,
            "omp_wait_policy": omp_wait_policy}


def run_groups(system: Any, groups: list[list[list[int]]], output_len: int, stop_at_eos: bool = False
               ) -> tuple[list[list[int]], float, float, tuple[float, float] | None]:
    """Every group through the system in turn: (outputs, wall seconds, CPU seconds, split), split being
    (seconds to first tokens, decode-only seconds) summed over the groups, or None when the system did not
    say when a group's first tokens came (its `first_token_times`, time.monotonic() per prompt).

    A group's time to first tokens runs from its start to its last prompt's first token (prefill and first
    token of every prompt in it), its decode-only time from there to its end: the decode-only rate is the
    tokens after each sequence's first over the summed decode-only times. That counts every decoded token
    inside that window only because no sequence decodes before the group's last first token: augury's
    scheduler prefills every waiting request before any decodes, transformers prefills a batch in one step,
    llama.cpp takes one prompt a group.

    A system with `prepare(prompts)` (augury's: the caches emptied, --history warm's earlier turns
    prefilled) has it called before each group, outside the timed spans (its wall and CPU time taken out)."""
    out: list[list[int]] = []
    to_first = decode = untimed = untimed_cpu = 0.0
    split = True
    prepare = getattr(system, "prepare", None)
    start, start_cpu = time.perf_counter(), time.process_time()
    for prompts in groups:
        if prepare is not None:
            p0, c0 = time.perf_counter(), time.process_time()
            prepare(prompts)
            untimed, untimed_cpu = untimed + time.perf_counter() - p0, untimed_cpu + time.process_time() - c0
        t0 = time.monotonic()
        rows = system.generate(prompts, output_len, stop_at_eos)
        t1 = time.monotonic()
        stamps = getattr(system, "first_token_times", None) if split else None
        # stamps of this call only: one per prompt, inside it (an earlier call's would fall before t0)
        if stamps is not None and len(stamps) == len(rows) and all(s is not None and t0 <= s <= t1 for s in stamps):
            to_first += max(stamps) - t0
            decode += t1 - max(stamps)
        else:
            split = False
        out += rows
    wall, cpu = time.perf_counter() - start - untimed, time.process_time() - start_cpu - untimed_cpu
    return out, wall, cpu, (to_first, decode) if split else None


def serve(start_env: dict[str, str], peer: bool) -> None:
    """The worker's loop (run by _BOOT in a fresh interpreter): answer the parent's messages
    until it closes the pipe. start_env: the environment before augury was imported."""
    if peer:  # undo whatever importing augury did to the environment, before any library reads it
        for key in set(os.environ) - set(start_env):
            del os.environ[key]
        os.environ.update(start_env)
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes its workers
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # print() and C libraries write to stderr: stdout carries only replies
    requests = sys.stdin.buffer
    from augury.config import one_line

    # OMP_WAIT_POLICY as the OpenMP runtimes loaded from here on read it (after augury's import,
    # before torch's or llama.cpp's)
    state: dict[str, Any] = {"omp": os.environ.get("OMP_WAIT_POLICY")}
    while True:
        try:
            message = pickle.load(requests)
        except EOFError:
            break
        command, *args = message
        if command == "close":
            break
        try:
            reply: tuple = ("ok", _handle(state, command, args))
        except BaseException as exc:  # every failure goes back to the parent as one line
            import traceback

            reply = ("error", one_line(exc, {}), traceback.format_exc())  # fields named by the parent
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()
    system = state.get("system")
    if system is not None:
        system.close()


def _handle(state: dict[str, Any], command: str, args: list[Any]) -> Any:
    if command == "load":
        name, settings, factory = args
        if factory is None:
            from augury.bench import system_factory

            factory = system_factory(name)
        else:  # a registered system: its module is imported here
            factory = pickle.loads(factory)
        if name.partition("@")[0] not in TORCH_FREE:
            import torch
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            if settings.threads:
                torch.set_num_threads(settings.threads)
        state["system"] = system = factory(settings)
        state["name"] = name
        return process_info(system, name, state["omp"])
    if command == "environ":
        return dict(os.environ)
    if command == "imported":
        return args[0] in sys.modules
    if command == "info":
        return process_info(state.get("system"), state.get("name", ""), state["omp"])
    system = state["system"]
    if command == "supports":
        return getattr(system, "supports", lambda n: True)(args[0])
    if command == "run":
        return run_groups(system, *args)
    if command == "reset_counts":
        getattr(system, "reset_counts", lambda: None)()
        return None
    if command == "stats":
        kinds = args[0]
        by_kind = None
        if kinds is not None and hasattr(system, "accept_length_of"):
            by_kind = {k: system.accept_length_of(prompts) for k, prompts in kinds.items()}
        return {"accept_length": getattr(system, "accept_length", 0.0),
                "spec_fraction": getattr(system, "spec_fraction", 0.0), "accept_by_kind": by_kind,
                "mask_share": getattr(system, "mask_share", 0.0)}
    raise ValueError(f"unknown worker command {command!r}")
