"""`augury bench --prompts json`: held-out JSON prompts whose answers augury's systems constrain to their
schemas (and augury-off-unconstrained does not), on a tiny random Llama with a byte-level tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from helpers_server import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bench-json") / "model", max_positions=2048)


def test_json_prompts_are_answered_under_their_schemas(tiny) -> None:
    from transformers import AutoTokenizer

    from augury.bench import AugurySystem, SystemSettings
    from augury.bench.json_prompts import JSON_TASKS, json_chat_prompts

    tok = AutoTokenizer.from_pretrained(str(tiny))
    prompts, schemas = json_chat_prompts(tok, 3)
    assert [json.loads(s) for s in schemas] == [schema for _, schema in JSON_TASKS[:3]]
    settings = SystemSettings(str(tiny), "float32", "cpu", 3, 2048, eos_ids=(tok.eos_token_id,),
                              json_schemas=tuple((tuple(p), s) for p, s in zip(prompts, schemas)))
    system = AugurySystem(settings, "augury-ngram", speculative_algorithm="ngram", speculative_policy="static")
    free = AugurySystem(settings, "augury-off-unconstrained", constrained=False, speculative_algorithm="none")
    outs = system.generate(prompts, 400, stop_at_eos=True)
    for ids, schema in zip(outs, schemas):
        text = tok.decode(ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), json.loads(schema))
    assert system.steps > 0  # the grammar's forced tokens were verified
    # masks were filled for every answer: a share of the wall time, and none without the schemas
    assert 0.0 < system.mask_share < 1.0 and system.mask_seconds < system.seconds
    assert free.generate(prompts[:1], 8, stop_at_eos=False) != outs[:1]
    assert free.mask_share == 0.0
    system.close()
    free.close()


def test_bench_json_needs_stop_at_eos_and_runs(tiny, tmp_path) -> None:
    from augury.bench.offline import BenchSettings, bench, format_table

    kw = dict(model=str(tiny), batch_sizes=(1,), output_len=300, repeats=1, warmup=0, prompts="json", num_prompts=1,
              systems=("augury-off", "augury-off-unconstrained"), out=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="--stop-at-eos"):
        bench(BenchSettings(**kw), progress=False)
    rows, out = bench(BenchSettings(**kw, stop_at_eos=True), progress=False)
    assert {r.system for r in rows} == {"augury-off", "augury-off-unconstrained"}
    assert all(r.output_tokens > 0 for r in rows)
    share = {r.system: r.mask_share for r in rows}
    assert share["augury-off-unconstrained"] == 0.0 and 0.0 < share["augury-off"] < 1.0
    assert "grammar masks, share of the timed wall time: b1 augury-off " in format_table(rows)
