"""The stress harness (bench/stress.py), short: ~25 s of load and faults against a real server on the
tiny random checkpoint (float32, 8 sequences a batch, 16 clients plus the corpus sweep), then SIGTERM
under load. One request must not hurt another: no 5xx (a stream's internal-error event included),
every well-formed request answered or cleanly refused, no hostile body answered by a dropped
connection, every deterministic answer under load equal to the same request sent alone afterwards,
and no KV block in use once the load is over."""
from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from augury.bench.stress import StressSettings, format_report, run_stress
from augury.bench.stress_bodies import CORPUS, MIX
from helpers_server import make_tiny_checkpoint


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # room for the tools' system prompt (~800 tokens with this tokenizer) and the long prompts
    tiny = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-stress") / "model", max_positions=2048)
    out = tmp_path_factory.mktemp("stress")
    saved = dict(os.environ)
    for k in [k for k in os.environ if k.startswith("AUGURY_")]:
        del os.environ[k]
    os.environ["OMP_NUM_THREADS"] = "1"  # the server inherits this process's environment
    try:
        settings = StressSettings(model=str(tiny), server_args=("--dtype", "float32", "--max-num-seqs", "8"),
                                  clients=16, duration=25.0, max_tokens=24, first_sample=8.0, sample_every=1.0,
                                  request_timeout=120.0, replay_max=150, sigterm=True, sigterm_after=2.0,
                                  drain_timeout=60.0, ready_timeout=180.0, out=str(out))
        rep = asyncio.run(run_stress(settings, log=lambda _: None))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    (out / "stress.json").write_text(json.dumps(rep, indent=2, default=str))
    print("\n" + format_report(rep))
    return rep


def test_every_kind_ran(report: dict[str, Any]) -> None:
    """The mix really happened: every kind sent and (well-formed) answered, streams dropped, the whole corpus tried."""
    kinds = report["by_kind"]
    assert set(kinds) == set(MIX), kinds.keys()
    for kind, k in kinds.items():
        assert k["sent"] > 0 and (kind == "hostile" or k["status"].get("200", 0) > 0), (kind, k)
    assert kinds["drop"]["dropped"] > 0
    assert set(report["hostile_cases"]) >= {name for name, *_ in CORPUS}
    assert report["max_num_seqs"] == 8 and report["batch_full_share"] > 0  # the batch was full at times


def test_no_server_errors(report: dict[str, Any]) -> None:
    """0 responses with status 500 (and no internal-error stream event), under load and at SIGTERM."""
    errors = report["failures"]["server_errors"] + report["sigterm"].get("server_errors", [])
    assert not errors, "\n".join(f"{e['case']} ({e.get('known_bug') or 'new'}): {e.get('body')}" for e in errors)
    assert report["engine_step_errors"] == 0


def test_well_formed_requests_answered_or_refused(report: dict[str, Any]) -> None:
    assert not report["failures"]["well_formed_not_answered"], report["failures"]["well_formed_not_answered"]


def test_hostile_bodies_never_drop_the_connection(report: dict[str, Any]) -> None:
    dropped = report["failures"]["hostile_connection_errors"]
    assert not dropped, [(r["case"], r.get("error")) for r in dropped]


def test_answers_under_load_equal_answers_alone(report: dict[str, Any]) -> None:
    rp = report["replay"]
    assert rp["compared"].get("greedy", 0) >= 50 and rp["compared"].get("seeded", 0) >= 3, rp["compared"]
    assert not rp["replay_failures"], rp["replay_failures"]
    for family in ("greedy", "seeded"):
        assert not rp["mismatches"][family], rp["mismatches"][family][:3]


def test_no_kv_block_in_use_after(report: dict[str, Any]) -> None:
    kv = report["kv_blocks_in_use"]
    assert report["clean_after_load"] and report["clean_after_replay"], kv
    assert kv["after_load"] == 0 and kv["after_replay"] == 0, kv
    assert report["aborted"] >= report["by_kind"]["drop"]["dropped"] * 0.5  # the drops reached the engine


def test_sigterm_under_load_exits(report: dict[str, Any]) -> None:
    sig = report["sigterm"]
    assert not sig.get("idle") and sig["exit_status"] is not None, sig  # exited within the drain timeout
    assert sum(sig["in_flight_at_sigterm"].values()) > 0, sig
