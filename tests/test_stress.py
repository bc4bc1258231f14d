"""The stress harness (bench/stress.py), short: ~25 s of load and faults against a real server on the
tiny random checkpoint (float32, 8 sequences a batch, 24 clients plus the corpus sweep), then SIGTERM
under load. One request must not hurt another: no 5xx (a stream's internal-error event included),
every well-formed request answered or cleanly refused, no hostile body answered by a dropped
connection, every deterministic answer under load equal to the same request sent alone afterwards,
and no KV block in use once the load is over."""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
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
        # 24 clients of 48-token answers keep the batch full at times: 16 of 24 tokens were served faster
        # than the clients sent them once (CI, 2026-12-05: the batch full in 0 of 28 samples)
        settings = StressSettings(model=str(tiny), server_args=("--dtype", "float32", "--max-num-seqs", "8"),
                                  clients=24, duration=25.0, max_tokens=48, first_sample=8.0, sample_every=1.0,
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


# ------------------------------------------------------------------ property: no body is a 5xx
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FIELDS = ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
           "stream", "stream_options", "logit_bias", "logprobs", "top_logprobs", "presence_penalty", "min_p",
           "repetition_penalty", "bad_words", "response_format", "structured_outputs", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar", "tools", "tool_choice", "parallel_tool_calls", "ignore_eos",
           "stop_token_ids", "max_draft_tokens", "model", "user"]
_SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
            | st.text(max_size=12) | st.sampled_from(["", "²", "\x00", "<|im_end|>", "json_schema", "function",
                                                      "required", "auto", "root ::= \"a\"", "[^\\s\\S]"]))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["type", "function", "name", "schema", "json_schema", "role",
                                                        "content", "choice", "regex", "0", "1"]), inner, max_size=3),
                     max_leaves=10)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory):
    from helpers_server import serve

    tiny = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-fuzz") / "model", max_positions=2048)
    with serve(["--model", str(tiny), "--dtype", "float32", "--max-num-seqs", "4", "--served-model-name", "tiny"]) as sp:
        yield sp


def _bounded(body: dict[str, Any]) -> dict[str, Any]:
    """A generated body that happens to be valid must still answer quickly: short answers, few choices."""
    for name, cap in (("max_tokens", 8), ("max_completion_tokens", 8), ("n", 2)):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and cap < v < 10**6:
            body[name] = cap
    return body


def test_no_generated_body_gets_a_5xx(fuzz_server) -> None:
    """Property (hypothesis, shrinking to the smallest failing body): a chat body with up to four fields
    replaced by any JSON gets a status below 500 over a connection that stays up; afterwards the server is
    healthy and holds no KV block."""
    import httpx

    from augury.server.loadtest import is_clean, read_metrics

    url = f"{fuzz_server.base_url}/v1/chat/completions"
    http = httpx.Client(timeout=60)
    seen: Counter = Counter()  # status classes: the property must meet valid bodies and invalid ones

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=4))
    def check(fields: dict[str, Any]) -> None:
        body = _bounded({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                         "temperature": 0, **fields})
        r = http.post(url, content=json.dumps(body), headers={"content-type": "application/json",
                                                               "connection": "close"})
        seen[r.status_code // 100] += 1
        assert r.status_code < 500 or r.status_code == 503, (r.status_code, r.text, body)
        assert '"internal_error"' not in r.text, (r.text, body)  # a 200 stream's error event included

    try:
        check()
    finally:
        http.close()
    assert seen[2] >= 5 and seen[4] >= 50, seen
    assert httpx.get(f"{fuzz_server.base_url}/health").status_code == 200
    metrics = read_metrics(fuzz_server.base_url)
    for _ in range(60):
        if is_clean(metrics):
            break
        time.sleep(0.5)
        metrics = read_metrics(fuzz_server.base_url)
    assert is_clean(metrics), metrics
    assert "Traceback" not in fuzz_server.log, fuzz_server.log[-3000:]
