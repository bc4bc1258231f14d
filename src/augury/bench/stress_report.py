"""The stress harness's report (bench/stress.py): its results summed up per kind and per hostile case,
what breaks a criterion (each with the server's own words), the criteria themselves, and the table.
Torch-free."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from augury.bench.stress_client import Result

REFUSED = (429, 503)  # a clean refusal of a well-formed request


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))]


def by_kind(results: list[Result]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for kind in sorted({r.kind for r in results}):
        rs = [r for r in results if r.kind == kind]
        ok = [r for r in rs if r.status == 200 and r.error is None and not r.dropped]
        ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
        table[kind] = {
            "sent": len(rs), "status": dict(sorted(Counter(str(r.status) for r in rs).items())),
            "errors": dict(Counter(r.error for r in rs if r.error and not r.dropped)),
            "dropped": sum(r.dropped for r in rs), "server_errors": sum(r.server_error for r in rs),
            "p50_ms": _round(_percentile([r.seconds * 1000 for r in ok], 50)),
            "p99_ms": _round(_percentile([r.seconds * 1000 for r in ok], 99)),
            "ttft_p50_ms": _round(_percentile(ttfts, 50)), "ttft_p99_ms": _round(_percentile(ttfts, 99))}
    return table


def hostile_cases(results: list[Result]) -> dict[str, dict[str, int]]:
    """Per corpus entry (mutations pooled by the kind they mutated): what came back, status or error."""
    out: dict[str, Counter] = {}
    for r in results:
        if r.kind == "hostile":
            out.setdefault(r.case, Counter())[str(r.status) if r.error is None else f"{r.status}/{r.error}"] += 1
    return {case: dict(c) for case, c in sorted(out.items())}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def failures(results: list[Result]) -> dict[str, list[dict[str, Any]]]:
    """What breaks a criterion, each with what the server said."""
    def row(r: Result) -> dict[str, Any]:
        return {k: v for k, v in asdict(r).items() if k not in ("answer", "started") and v not in (None, "")}

    wf_bad = [r for r in results if r.kind != "hostile" and not r.server_error
              and not (r.status in REFUSED or (r.status == 200 and (r.error is None or r.dropped)))]
    hostile = [r for r in results if r.kind == "hostile"]
    return {
        "server_errors": [row(r) for r in results if r.server_error],
        "well_formed_not_answered": [row(r) for r in wf_bad],
        "hostile_connection_errors": [row(r) for r in hostile if r.status is None],
        "hostile_4xx_expected_got_2xx": [row(r) for r in hostile if r.expect == "4xx" and r.status == 200],
    }


def criteria(rep: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's bar: each True, False, or None where this run could not tell."""
    f, kv, rss = rep["failures"], rep["kv_blocks_in_use"], rep["rss"]
    growth = None
    if rss["first_sample_bytes"] and rss["after_load_bytes"]:
        rss["growth"] = round(rss["after_load_bytes"] / rss["first_sample_bytes"] - 1, 4)
        # the KV cache takes its reserved memory as traffic first writes each block (core/kv_cache.py), so
        # its part of RSS grows until the traffic has written it all: a leak is growth besides it
        first, end = _besides_kv(rss, "first_sample"), _besides_kv(rss, "after_load")
        growth = end / first - 1
        rss["growth_besides_kv_cache"] = round(growth, 4)
    mismatches = rep["replay"]["mismatches"]
    return {"no_5xx": not f["server_errors"] and not rep.get("sigterm", {}).get("server_errors"),
            "well_formed_answered_or_refused": not f["well_formed_not_answered"],
            "hostile_never_dropped": not f["hostile_connection_errors"],
            "greedy_answers_equal_alone": not mismatches["greedy"],
            "seeded_answers_equal_alone": not mismatches["seeded"],
            "kv_blocks_free_after": kv["after_load"] == 0 and kv["after_replay"] == 0,
            "rss_besides_kv_within_5_percent": None if growth is None else abs(growth) <= 0.05,
            "drain_exit_0_within_timeout": _drained(rep)}


def _drained(rep: dict[str, Any]) -> bool | None:
    """SIGTERM under load: exit status 0 within the server's --shutdown-timeout (None: no SIGTERM phase)."""
    sig, timeout = rep.get("sigterm"), rep.get("shutdown_timeout")
    if not sig or sig.get("idle") or timeout is None:
        return None
    return sig["exit_status"] == 0 and sig["seconds_to_exit"] <= timeout


def _besides_kv(rss: dict[str, Any], when: str) -> float:
    """RSS less the KV cache blocks written by then (all of RSS when the server did not say)."""
    blocks, block_bytes = rss.get(f"{when}_kv_written_blocks"), rss.get("kv_block_bytes")
    return rss[f"{when}_bytes"] - (blocks * block_bytes if blocks and block_bytes else 0)


def _cut(text: Any, width: int = 200) -> str:
    text = str(text).replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def format_report(rep: dict[str, Any]) -> str:
    lines = [f"stress: {rep['requests']} requests, {rep['settings']['clients']} clients, {rep['load_seconds']} s, "
             f"model {rep['model']!r} (max_num_seqs {rep['max_num_seqs']}, max_model_len {rep['max_model_len']})",
             f"{'kind':<12} {'sent':>6} {'200':>6} {'4xx':>6} {'429/503':>7} {'5xx':>5} {'conn/timeout':>12} "
             f"{'dropped':>7} {'p50 ms':>9} {'p99 ms':>9} {'ttft p50':>9}"]
    for kind, k in rep["by_kind"].items():
        st = {int(c) if c != "None" else 0: n for c, n in k["status"].items()}
        lines.append(f"{kind:<12} {k['sent']:>6} {st.get(200, 0):>6} "
                     f"{sum(n for c, n in st.items() if 400 <= c < 500 and c not in REFUSED):>6} "
                     f"{sum(st.get(c, 0) for c in REFUSED):>7} {k['server_errors']:>5} "
                     f"{sum(n for e, n in k['errors'].items() if e not in ('stream-error',)):>12} {k['dropped']:>7} "
                     f"{_num(k['p50_ms']):>9} {_num(k['p99_ms']):>9} {_num(k['ttft_p50_ms']):>9}")
    rp, kv, rss = rep["replay"], rep["kv_blocks_in_use"], rep["rss"]
    lines.append(f"replayed alone: {rp['replayed']} of {rp['distinct_bodies']} distinct bodies; answers under load "
                 f"unequal to the one alone: greedy {len(rp['mismatches']['greedy'])} of {rp['compared'].get('greedy', 0)}, "
                 f"seeded (n > 1) {len(rp['mismatches']['seeded'])} of {rp['compared'].get('seeded', 0)}"
                 + ("" if rp.get("alone_twice_unequal") is None else
                    f"; bodies whose two answers alone differ: {rp['alone_twice_unequal']}"))
    lines.append(f"batch full (running = max_num_seqs) in {rep['batch_full_share']:.0%} of {len(rep['samples'])} "
                 f"samples")
    lines.append(f"KV blocks in use: first sample {kv['first_sample']}, after load {kv['after_load']}, after replay "
                 f"{kv['after_replay']} (of {kv['usable']}); engine step errors {rep['engine_step_errors']:.0f}")
    if rss["first_sample_bytes"] and rss["after_load_bytes"]:
        kv_mib = [(rss.get(f"{w}_kv_written_blocks") or 0) * (rss.get("kv_block_bytes") or 0) / 2**20
                  for w in ("first_sample", "after_load")]
        lines.append(f"RSS: {rss['first_sample_bytes'] / 2**20:.0f} MiB at {rss['first_sample_t']} s, "
                     f"{rss['after_load_bytes'] / 2**20:.0f} MiB after the load ({rss.get('growth', 0):+.1%}); "
                     f"KV cache written {kv_mib[0]:.0f} -> {kv_mib[1]:.0f} MiB; besides it "
                     f"{rss.get('growth_besides_kv_cache', 0):+.1%}")
    sig = rep.get("sigterm")
    if sig:
        lines.append(f"SIGTERM: exit status {sig['exit_status']} after {sig['seconds_to_exit']} s"
                     + ("" if sig.get("idle") else f"; in flight: {sig['in_flight_at_sigterm']}, sent after: "
                        f"{sig['sent_after_sigterm']}"))
    for name, rows in rep["failures"].items():
        for r in rows[:20]:
            lines.append(f"  {name}: {r.get('kind')} {r.get('case')} -> {r.get('status')} {r.get('error') or ''} "
                         f"{_cut(r.get('body', ''))}")
    for fam, rows in rp["mismatches"].items():
        for m in rows[:10]:
            lines.append(f"  mismatch ({fam}, {m['kind']}): under load {_cut(m['under_load'], 120)} | alone "
                         f"{_cut(m['alone'], 120)}")
    if rep.get("server_log_problems"):
        lines.append(f"server log: {len(rep['server_log_problems'])} problem lines, first: "
                     f"{_cut(rep['server_log_problems'][0])}")
    lines.append("criteria: " + ", ".join(f"{k} {'ok' if v else 'n/a' if v is None else 'FAILED'}"
                                          for k, v in rep["criteria"].items()))
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"
