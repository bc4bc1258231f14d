"""The requests `augury bench --workload stress` sends (bench/stress.py): a seeded mix of well-formed
requests and hostile bodies.

Well-formed kinds, all deterministic (greedy, or seeded sampling for n > 1), so the harness can
replay each one alone after the load and compare: chat, streamed chat, a JSON schema, tools, a long
prompt, n > 1 and plain completions; streams a client drops mid-answer ("drop") and streams read
slowly ("slow"). The prompts are the held-out sets (augury.prompts.varied_prompts,
bench/json_prompts.JSON_TASKS): no training template makes them.

Hostile bodies come from a fixed corpus (`CORPUS`: malformed JSON, wrong types, oversized fields,
unknown tools, grammars no token satisfies, encodings a tokenizer chokes on, known bugs marked) and
from seeded mutation of well-formed bodies (fields replaced with junk of another type, deleted,
the JSON text truncated or its bytes flipped, random bytes). A corpus entry says what is expected:
"4xx" (certainly invalid) or "not5xx" (may be valid; it must not hurt the server). Torch-free.
"""
from __future__ import annotations

import importlib
import inspect
import json
import random
from dataclasses import dataclass, field
from typing import Any

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# share of requests of each kind; the three misbehaving kinds as the issue asks, the rest well-formed
MIX: dict[str, float] = {"drop": 0.10, "slow": 0.05, "hostile": 0.05, "chat": 0.18, "chat-stream": 0.18,
                         "json-schema": 0.12, "tools": 0.10, "long-prompt": 0.08, "n>1": 0.08, "completion": 0.06}
SYSTEMS = ("You are a concise assistant.", "Answer in one short paragraph.", "You are a careful technical writer.")
TOOLS = [
    {"type": "function", "function": {"name": "convert_currency", "description": "convert an amount of money",
                                      "parameters": {"type": "object", "required": ["amount", "source", "target"],
                                                     "properties": {"amount": {"type": "number", "minimum": 0},
                                                                    "source": {"enum": ["EUR", "USD", "JPY"]},
                                                                    "target": {"enum": ["EUR", "USD", "JPY"]}}}}},
    {"type": "function", "function": {"name": "find_train", "description": "the next train between two stations",
                                      "parameters": {"type": "object", "required": ["origin", "destination"],
                                                     "properties": {"origin": {"type": "string", "maxLength": 20},
                                                                    "destination": {"type": "string",
                                                                                    "maxLength": 20}}}}},
]
TOOL_ASKS = ("How many yen is 40 euros?", "When is the next train from Porto to Coimbra?",
             "Convert 12.5 dollars to euros, then find a train from Lyon to Nice.")


@dataclass
class Call:
    """One request to send: a JSON body, or raw bytes (hostile), and how to read the answer."""

    kind: str
    path: str
    body: dict[str, Any] | None = None
    raw: bytes | None = None  # sent as it is (with content_type) instead of body
    content_type: str = "application/json"
    case: str = ""  # a hostile case's name, or the well-formed request's prompt family
    detail: str = ""  # a mutated body's mutations
    expect: str = "ok"  # ok (well-formed: 200, or 429/503 refusals), 4xx, or not5xx
    known_bug: str | None = None  # a hostile case that hit a known server bug when written
    drop_after: int | None = None  # a stream the client closes after this many events
    read_delay: float = 0.0  # seconds a slow reader waits before each event
    deterministic: bool = False  # greedy or seeded: the same body must give the same answer

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream"))

    def key(self) -> str:
        """The body as JSON text, keys in the order sent (a schema's property order is part of the request:
        sorting them would change the grammar and the prompt): equal keys must get equal answers."""
        return json.dumps(self.body)

    def payload(self) -> bytes:
        if self.raw is not None:
            return self.raw
        # allow_nan: corpus bodies carry NaN and Infinity on purpose (Python's json reads them)
        return json.dumps(self.body, allow_nan=True).encode()


@dataclass
class Workload:
    """What the well-formed requests draw from; built once per run."""

    model: str
    prompts: list[str]
    long_text: str
    max_tokens: int = 48
    n_prompts: int = 24  # distinct prompts per kind: repeats under load must agree with each other too
    schemas: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    @staticmethod
    def build(model: str, long_chars: int, max_tokens: int = 48) -> "Workload":
        from augury.bench.json_prompts import JSON_TASKS
        from augury.prompts import varied_prompts

        return Workload(model=model, prompts=[t for _, t in varied_prompts()], long_text=long_document(long_chars),
                        max_tokens=max_tokens, schemas=list(JSON_TASKS))

    def _chat(self, rng: random.Random, content: str | None = None, **extra: Any) -> dict[str, Any]:
        messages = [{"role": "user", "content": content or rng.choice(self.prompts[: self.n_prompts])}]
        if rng.random() < 0.3:  # a shared system prompt: prefix-cache hits under load
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        return {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "temperature": 0, **extra}

    def call(self, kind: str, rng: random.Random) -> Call:
        """One request of a well-formed kind (or drop / slow), drawn with rng."""
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        if kind == "chat":
            return Call(kind, CHAT, self._chat(rng), case="varied", deterministic=True)
        if kind == "chat-stream":
            return Call(kind, CHAT, self._chat(rng, **stream), case="varied", deterministic=True)
        if kind == "drop":
            return Call(kind, CHAT, self._chat(rng, **stream), case="varied", drop_after=rng.randint(1, 6))
        if kind == "slow":
            return Call(kind, CHAT, self._chat(rng, **stream), case="varied", read_delay=rng.uniform(0.05, 0.3),
                        deterministic=True)
        if kind == "json-schema":
            ask, schema = rng.choice(self.schemas)
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
            return Call(kind, CHAT, self._chat(rng, ask, response_format=fmt), case="json", deterministic=True)
        if kind == "tools":
            choice = rng.choice(["auto", "required", {"type": "function", "function": {"name": "find_train"}}])
            body = self._chat(rng, rng.choice(TOOL_ASKS), tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
            return Call(kind, CHAT, body, case=f"tools-{choice if isinstance(choice, str) else 'named'}",
                        deterministic=True)
        if kind == "long-prompt":
            question = rng.choice(self.prompts[: self.n_prompts])
            return Call(kind, CHAT, self._chat(rng, f"{self.long_text}\n\n{question}", max_tokens=16), case="long",
                        deterministic=True)
        if kind == "n>1":  # seeded sampling: each choice's tokens are fixed by its seed, whatever the batch
            body = self._chat(rng, n=rng.choice([2, 3]), temperature=0.8, seed=rng.randrange(1000))
            return Call(kind, CHAT, body, case="seeded", deterministic=True)
        if kind == "completion":
            body = {"model": self.model, "prompt": rng.choice(self.prompts[: self.n_prompts]),
                    "max_tokens": self.max_tokens, "temperature": 0}
            return Call(kind, COMPLETIONS, body, case="varied", deterministic=True)
        raise ValueError(f"unknown request kind {kind!r}")

    def hostile(self, rng: random.Random) -> Call:
        """Half corpus entries, half mutated well-formed bodies or random bytes."""
        if rng.random() < 0.5:
            return corpus_call(rng.choice(CORPUS), self.model)
        if rng.random() < 0.1:
            return Call("hostile", rng.choice([CHAT, COMPLETIONS]), raw=rng.randbytes(rng.randint(1, 4096)),
                        case="random-bytes", expect="not5xx")
        base = self.call(rng.choice(["chat", "chat-stream", "json-schema", "tools", "completion"]), rng)
        return mutate(base, rng)


def long_document(chars: int) -> str:
    """About `chars` characters of English prose: standard-library documentation (no download)."""
    parts: list[str] = []
    for name in ("argparse", "json", "logging", "collections", "itertools", "functools", "pathlib", "unittest",
                 "subprocess", "datetime", "re", "dataclasses", "typing", "asyncio", "sqlite3", "csv"):
        parts.append((inspect.getdoc(importlib.import_module(name)) or "").strip())
        if sum(map(len, parts)) >= chars:
            break
    text = "\n\n".join(parts)
    while len(text) < chars:  # short documentation on some Pythons: repeat it
        text = f"{text}\n\n{text}"
    return text[:chars]


# ---------------------------------------------------------------------------- hostile bodies
_MSG = [{"role": "user", "content": "hello"}]
_BUGS = {  # found by this harness or reported with it; kept so a fix can be seen
    "choice-vs-bad-words": "guided_choice whose only answer bad_words forbids: every request in flight got 500",
    "logit-bias-superscript": "a logit_bias key '²' (isdigit() but not int()) gave 500",
    "tool-choice-function-string": "tool_choice {'function': 'f'} (a string, not an object) gave 500",
}


def _chat_body(**fields: Any) -> dict[str, Any]:
    return {"messages": _MSG, "max_tokens": 8, "temperature": 0, **fields}


# (name, path, body dict or raw bytes, expected): certainly invalid -> 4xx; may be valid -> not5xx
CORPUS: list[tuple[str, str, dict[str, Any] | bytes, str]] = [
    ("truncated-json", CHAT, b'{"messages": [{"role": "user", "content": "hi"', "4xx"),
    ("trailing-comma", CHAT, b'{"messages": [{"role": "user", "content": "hi"},], }', "4xx"),
    ("not-json", CHAT, b"hello there", "4xx"),
    ("empty-body", CHAT, b"", "4xx"),
    ("json-array", CHAT, b"[]", "4xx"),
    ("json-null", COMPLETIONS, b"null", "4xx"),
    ("deep-nesting", CHAT, b'{"messages": ' + b"[" * 50000 + b"]" * 50000 + b"}", "4xx"),
    ("body-over-limit", COMPLETIONS, b"", "4xx"),  # 17 MiB, built when sent (corpus_call)
    ("text-plain-json", CHAT, _chat_body(), "not5xx"),  # a valid body sent as text/plain (corpus_call)
    ("form-encoded", COMPLETIONS, b"prompt=hi&max_tokens=4", "4xx"),  # sent as a form (corpus_call)
    ("messages-string", CHAT, {"messages": "hello"}, "4xx"),
    ("messages-empty", CHAT, {"messages": []}, "4xx"),
    ("role-unknown", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "4xx"),
    ("content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, "4xx"),
    ("content-image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "4xx"),
    ("content-null", CHAT, _chat_body(messages=[{"role": "user", "content": None}]), "not5xx"),
    ("content-lone-surrogate", CHAT, _chat_body(messages=[{"role": "user", "content": "\ud800 ok \udfff"}]), "not5xx"),
    ("content-nul-bytes", CHAT, _chat_body(messages=[{"role": "user", "content": "\u0000" * 64}]), "not5xx"),
    ("content-huge", CHAT, _chat_body(messages=[{"role": "user", "content": "lorem ipsum " * 40000}]), "4xx"),
    ("assistant-only", CHAT, _chat_body(messages=[{"role": "assistant", "content": "hi"}]), "not5xx"),
    ("tool-call-name-number", CHAT, _chat_body(messages=[
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": 5, "arguments": "{}"}}]}]), "4xx"),
    ("temperature-string", CHAT, _chat_body(temperature="hot"), "4xx"),
    ("temperature-nan", CHAT, _chat_body(temperature=float("nan")), "4xx"),
    ("temperature-infinity", CHAT, _chat_body(temperature=float("inf")), "not5xx"),
    ("top-p-zero", CHAT, _chat_body(top_p=0), "4xx"),
    ("top-k-huge", CHAT, _chat_body(top_k=2**40), "4xx"),
    ("max-tokens-huge", CHAT, _chat_body(max_tokens=10**12), "4xx"),
    ("max-tokens-negative", CHAT, _chat_body(max_tokens=-1), "4xx"),
    ("max-tokens-bigint", COMPLETIONS, {"prompt": "hi", "max_tokens": 10**30}, "4xx"),
    ("max-tokens-float", COMPLETIONS, {"prompt": "hi", "max_tokens": 4.5}, "4xx"),
    ("n-huge", CHAT, _chat_body(n=10**6), "4xx"),
    ("n-zero", CHAT, _chat_body(n=0), "4xx"),
    ("seed-huge", CHAT, _chat_body(seed=2**70), "4xx"),
    ("stop-many", CHAT, _chat_body(stop=[f"s{i}" for i in range(100)]), "4xx"),
    ("stop-number", CHAT, _chat_body(stop=5), "4xx"),
    ("stop-empty-string", CHAT, _chat_body(stop=[""]), "not5xx"),
    ("stop-token-ids-out-of-range", CHAT, _chat_body(stop_token_ids=[10**9]), "4xx"),
    ("logit-bias-list", CHAT, _chat_body(logit_bias=[1]), "4xx"),
    ("logit-bias-superscript", CHAT, _chat_body(logit_bias={"²": 1}), "4xx"),
    ("logit-bias-huge-id", CHAT, _chat_body(logit_bias={"99999999": 5}), "4xx"),
    ("logit-bias-negative-id", CHAT, _chat_body(logit_bias={"-1": 5}), "4xx"),
    ("logit-bias-nan", CHAT, _chat_body(logit_bias={"1": float("nan")}), "not5xx"),
    ("logit-bias-many", COMPLETIONS, {"prompt": "hi", "max_tokens": 4,
                                      "logit_bias": {str(i): -100 for i in range(300)}}, "not5xx"),
    ("penalty-nan", CHAT, _chat_body(presence_penalty=float("nan")), "4xx"),
    ("repetition-penalty-zero", CHAT, _chat_body(repetition_penalty=0), "4xx"),
    ("logprobs-string", CHAT, _chat_body(logprobs="yes"), "4xx"),
    ("top-logprobs-huge", CHAT, _chat_body(logprobs=True, top_logprobs=1000), "4xx"),
    ("completion-logprobs-huge", COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "logprobs": 10**6}, "4xx"),
    ("max-draft-tokens-negative", CHAT, _chat_body(max_draft_tokens=-5), "4xx"),
    ("best-of", COMPLETIONS, {"prompt": "hi", "best_of": 3}, "4xx"),
    ("stream-options-string", CHAT, _chat_body(stream=True, stream_options="yes"), "4xx"),
    ("model-unknown", CHAT, _chat_body(model="no-such-model"), "4xx"),
    ("prompt-ids-out-of-range", COMPLETIONS, {"prompt": [10**9], "max_tokens": 4}, "4xx"),
    ("prompt-ids-negative", COMPLETIONS, {"prompt": [-3, 1], "max_tokens": 4}, "4xx"),
    ("prompt-empty-list", COMPLETIONS, {"prompt": []}, "4xx"),
    ("prompt-empty-string", COMPLETIONS, {"prompt": ""}, "4xx"),
    ("prompt-mixed-list", COMPLETIONS, {"prompt": [[1, 2], "a"]}, "4xx"),
    ("prompt-bool-ids", COMPLETIONS, {"prompt": [True, False]}, "4xx"),
    ("response-format-yaml", CHAT, _chat_body(response_format={"type": "yaml"}), "4xx"),
    ("response-format-no-schema", CHAT, _chat_body(response_format={"type": "json_schema"}), "4xx"),
    ("response-format-string", CHAT, _chat_body(response_format="json"), "4xx"),
    ("schema-false", CHAT, _chat_body(response_format={"type": "json_schema", "json_schema": {"schema": False}}),
     "not5xx"),
    ("schema-unsatisfiable", CHAT, _chat_body(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "minLength": 5, "maxLength": 2}}}), "not5xx"),
    ("schema-bad-type", CHAT, _chat_body(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "objectx"}}}), "4xx"),
    ("two-constraints", CHAT, _chat_body(response_format={"type": "json_object"}, guided_regex="a+"), "4xx"),
    ("regex-invalid", CHAT, _chat_body(guided_regex="(a"), "4xx"),
    ("regex-no-string", CHAT, _chat_body(guided_regex="[^\\s\\S]"), "not5xx"),
    ("grammar-invalid", CHAT, _chat_body(guided_grammar="root ::= "), "4xx"),
    ("grammar-no-token", CHAT, _chat_body(structured_outputs={"grammar": 'root ::= [^\\x00-\\U0010FFFF]'}), "not5xx"),
    ("choice-empty-list", CHAT, _chat_body(guided_choice=[]), "not5xx"),
    ("choice-empty-string", CHAT, _chat_body(guided_choice=[""]), "not5xx"),
    ("choice-vs-bad-words", CHAT, _chat_body(guided_choice=["a"], bad_words=["a"]), "not5xx"),
    ("bad-words-many", CHAT, _chat_body(bad_words=[f"w{i}" for i in range(5000)]), "not5xx"),
    ("bad-words-empty-string", CHAT, _chat_body(bad_words=[""]), "not5xx"),
    ("tools-not-list", CHAT, _chat_body(tools={"a": 1}), "4xx"),
    ("tools-bad-name", CHAT, _chat_body(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "4xx"),
    ("tools-duplicate", CHAT, _chat_body(tools=[TOOLS[0], TOOLS[0]]), "4xx"),
    ("tools-bad-schema", CHAT, _chat_body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objectx"}}}], tool_choice="required"), "4xx"),
    ("tool-choice-unknown", CHAT, _chat_body(tools=TOOLS, tool_choice={"type": "function",
                                                                       "function": {"name": "nope"}}), "4xx"),
    ("tool-choice-function-string", CHAT, _chat_body(tools=TOOLS, tool_choice={"type": "function",
                                                                               "function": "f"}), "4xx"),
    ("tool-choice-number", CHAT, _chat_body(tools=TOOLS, tool_choice=7), "4xx"),
    ("tool-choice-without-tools", CHAT, _chat_body(tool_choice="required"), "4xx"),
    ("tools-with-json-format", CHAT, _chat_body(tools=TOOLS, tool_choice="required",
                                                response_format={"type": "json_object"}), "4xx"),
]


def corpus_call(entry: tuple[str, str, dict[str, Any] | bytes, str], model: str) -> Call:
    name, path, body, expect = entry
    if name == "body-over-limit":  # over the server's 16 MiB limit: 413
        body = b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}'
    content_type = {"text-plain-json": "text/plain", "form-encoded": "application/x-www-form-urlencoded"}.get(
        name, "application/json")
    if isinstance(body, bytes):
        return Call("hostile", path, raw=body, content_type=content_type, case=name, expect=expect,
                    known_bug=_BUGS.get(name))
    body = dict(body)
    body.setdefault("model", model)
    return Call("hostile", path, body, content_type=content_type, case=name, expect=expect, known_bug=_BUGS.get(name))


_JUNK_STRINGS = ("", " ", "null", "\u0000", "\ud83d", "é" * 3, "<|im_end|>", "{{ messages }}", "1e309", "-0",
                 "a" * 5000, "\\u0000", "NaN")
_JUNK_NUMBERS = (0, -1, 1, 2**31, 2**63, 2**64 + 1, 10**30, -(10**30), 0.5, -0.5, 1e308, -1e308, 5e-324,
                 float("nan"), float("inf"), float("-inf"))


def junk(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value, often of the wrong type for wherever it lands."""
    r = rng.random()
    if r < 0.1:
        return None
    if r < 0.2:
        return rng.random() < 0.5
    if r < 0.45:
        return rng.choice(_JUNK_NUMBERS)
    if r < 0.7 or depth > 3:
        return rng.choice(_JUNK_STRINGS)
    if r < 0.85:
        return [junk(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["type", "function", "name", "schema", "role", "content", "", "x"]): junk(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON value a mutation may land (dict keys and list indices)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


def mutate(call: Call, rng: random.Random) -> Call:
    """A hostile variant of a well-formed call: 1-3 structural mutations, then sometimes a textual one."""
    body = json.loads(json.dumps(call.body))
    ops = []
    for _ in range(rng.randint(1, 3)):
        places = _paths(body)
        path = rng.choice(places)
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        op = rng.choice(["replace", "replace", "delete", "add"])
        if op == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif op == "add" and isinstance(parent, dict):
            parent[rng.choice(["n", "logit_bias", "stop", "tools", "guided_choice", "bad_words", "seed", "top_k",
                               "response_format", "tool_choice", "max_tokens", "stream", "x"])] = junk(rng)
        else:
            parent[path[-1]] = junk(rng)
        ops.append(f"{op}:{'.'.join(map(str, path))}")
    mutated = Call("hostile", call.path, body, case=f"mutated-{call.kind}", expect="not5xx")
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 64)  # junk may make a valid request; keep it short
    r = rng.random()
    if r < 0.15:  # the JSON text cut short
        text = mutated.payload()
        mutated.raw, mutated.case = text[: rng.randrange(len(text))], f"truncated-{call.kind}"
    elif r < 0.3:  # a few bytes flipped
        text = bytearray(mutated.payload())
        for _ in range(rng.randint(1, 4)):
            text[rng.randrange(len(text))] = rng.randrange(256)
        mutated.raw, mutated.case = bytes(text), f"byteflip-{call.kind}"
    mutated.detail = ", ".join(ops)
    return mutated
