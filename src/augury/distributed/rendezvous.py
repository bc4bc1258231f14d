"""What every rank shares to meet: the store's keys, the start-up timeouts, a rank's device, and how a
machine's ranks are started (fresh interpreters running worker.py). Used by launch.py (rank 0) and
worker.py (the others)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from augury.distributed.topology import Topology

SPEC_KEY = "augury/spec"  # what every rank loads, as rank 0 decided it (launch.ModelSpec, JSON)
HELLO = "augury/hello/{}"  # a rank has reached the store (its pid)
STATUS = "augury/status/{}"  # a rank's load: "ok" or "error: <the one line>"


def start_timeout(spec_timeout: float, nnodes: int) -> float:
    """How long to wait for ranks to join and load: another machine's command may be started by hand."""
    return max(600.0 if nnodes > 1 else 300.0, spec_timeout)


def rank_device(device: torch.device, local: int) -> torch.device:
    return torch.device("cuda", local) if device.type == "cuda" else device


def _package_root() -> str:
    import augury

    return str(Path(augury.__file__).resolve().parents[1])


def spawn_local(topo: Topology, folder: Path, skip_first: bool) -> dict[int, subprocess.Popen]:
    """Start this machine's ranks (all but this process's own) as fresh interpreters, each pinned to its
    cores with its thread count, killed if the thread that started them dies (Linux), deaf to SIGINT
    and SIGTERM (this process stops them: a Ctrl-C or a stop signal to the whole process group must
    not end them while it drains), their output on this process's stderr."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    children: dict[int, subprocess.Popen] = {}
    main_thread = __import__("threading").current_thread() is __import__("threading").main_thread()
    for local, rank in enumerate(topo.local_ranks()):
        if skip_first and local == 0:
            continue
        args = {"rank": rank, "size": topo.size, "nnodes": topo.nnodes, "per_node": topo.per_node,
                "host": topo.host, "port": topo.port, "cores": list(topo.cores[rank % topo.per_node]),
                "threads": topo.threads_of(rank % topo.per_node), "folder": str(folder)}
        env["OMP_NUM_THREADS"] = str(args["threads"])
        children[rank] = subprocess.Popen(
            [sys.executable, "-m", "augury.distributed.worker", json.dumps(args)], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent if main_thread else None)
    return children


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent goes (prctl PR_SET_PDEATHSIG; Linux only), and
    SIGINT and SIGTERM ignored (ignoring survives exec, and Python keeps an ignored SIGINT ignored)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - elsewhere the watchdog's lost store ends the child
        pass
