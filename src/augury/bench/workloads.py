"""`augury bench --prompts code_edit|agentic|summarise|extract`: the workloads people speculate on.

Each is generated here, deterministically from a seed, with variety (names, code, documents, numbers
drawn afresh per prompt), so no training template holds them:

- code_edit: a multi-turn edit of a 40-80 line Python module the prompt holds (an earlier turn's
  answer re-emitted it whole), and the user asks for one more small change and the whole file again:
  the answer copies most of the prompt.
- agentic: a tool-using loop (the tools described as JSON, then turns of tool calls and their
  results, the same call shapes each turn), ending at a tool result: the answer is the next call.
- summarise: a report of a few paragraphs, and a summary asked for that quotes its key sentences.
- extract: one document (an invoice, an order, a support ticket) and one JSON schema for every prompt of
  a run: each answer fills the schema's keys, the same across prompts (across requests, not within one).

code_edit and agentic prompts are conversations; with `--history warm` the bench prefills each one's
earlier turns (workload_histories) untimed before the timed request, as a live session's earlier
requests would have left them in the prefix cache: the timed request prefills only its last message.
"""
from __future__ import annotations

import json
import random

WORKLOADS = ("code_edit", "agentic", "summarise", "extract")

_NOUNS = ("order", "invoice", "record", "sensor", "ticket", "account", "packet", "sample", "batch", "route",
          "vertex", "token", "frame", "module", "channel", "report", "widget", "parcel", "station", "lease")
_VERBS = ("load", "parse", "merge", "score", "filter", "render", "check", "count", "group", "index", "clean",
          "split", "scale", "sort", "send", "store", "fetch", "match", "build", "trim")
_ADJ = ("total", "active", "pending", "valid", "recent", "average", "raw", "final", "missing", "unique")
_FIRST = ("Amara", "Bruno", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana", "Idris", "Jonas", "Kaia",
          "Luis", "Mira", "Nils", "Oona", "Pavel", "Quinn", "Rosa", "Sami", "Tove", "Uma", "Viktor", "Wen", "Yusuf")
_LAST = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Novak", "Haddad", "Ferreira", "Kowalski", "Nakamura",
         "Oyelaran", "Brennan", "Castillo", "Dimitrov", "Eriksen", "Fontaine", "Grewal", "Horvat", "Ibarra")
_CITIES = ("Tromsø", "Valparaíso", "Kraków", "Nagoya", "Accra", "Porto", "Tartu", "Windhoek", "Cusco", "Ghent",
           "Da Nang", "Aarhus", "Mombasa", "Ljubljana", "Hobart", "Quito")
_ITEMS = ("steel bracket", "oak shelf", "copper wire (10 m)", "LED panel", "ceramic mug", "wool blanket",
          "router", "solar lamp", "desk fan", "paper ream", "bike pump", "tea kettle", "hinge set", "USB hub")


def workload_prompts(tokenizer, kind: str, count: int, seed: int = 0) -> list[list[int]]:
    """count prompts of a workload through the tokenizer's chat template (token ids)."""
    return [tokenizer.encode(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False) for m in workload_messages(kind, count, seed)]


def workload_histories(tokenizer, kind: str, count: int, seed: int = 0) -> list[list[int]]:
    """Per prompt of workload_prompts, the conversation before its last message as the chat template
    renders it (token ids, the longest run that begins the prompt's): what a live multi-turn session's
    earlier requests leave in the prefix cache. Empty for a one-message prompt (summarise, extract)."""
    out = []
    for msgs in workload_messages(kind, count, seed):
        if len([m for m in msgs if m["role"] != "system"]) < 2:
            out.append([])
            continue
        full = tokenizer.encode(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
        before = tokenizer.encode(tokenizer.apply_chat_template(msgs[:-1], tokenize=False), add_special_tokens=False)
        n = 0
        while n < min(len(full), len(before)) and full[n] == before[n]:
            n += 1
        out.append(full[:n])
    return out


def workload_messages(kind: str, count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """count conversations (chat messages) of a workload, the same for the same seed."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; known: {', '.join(WORKLOADS)}")
    make = {"code_edit": _code_edit, "agentic": _agentic, "summarise": _summarise, "extract": _extract}[kind]
    schema_rng = random.Random(f"{kind}-{seed}-schema")  # extract: one schema for the whole run
    kind_schema = _schema(schema_rng) if kind == "extract" else None
    return [make(random.Random(f"{kind}-{seed}-{i}"), kind_schema) for i in range(count)]


# ------------------------------------------------------------------------------------------ code_edit
def _module(rng: random.Random) -> tuple[str, list[str]]:
    """A 40-80 line Python module of a few small functions; returns it and its function names."""
    noun, other = rng.sample(_NOUNS, 2)
    lines = [f'"""Helpers for {noun} {rng.choice(_ADJ)} data."""', "from __future__ import annotations", "",
             "import math", "", f"LIMIT = {rng.randint(3, 97)}", ""]
    names = []
    while len(lines) < rng.randint(40, 72):
        verb, adj = rng.choice(_VERBS), rng.choice(_ADJ)
        name = f"{verb}_{adj}_{noun}s"
        if name in names:
            continue
        names.append(name)
        arg, acc, k = f"{noun}s", f"{adj}_{other}", rng.randint(2, 9)
        body = [f"def {name}({arg}: list[dict], factor: float = {rng.randint(1, 9)}.{rng.randint(0, 9)}) -> float:",
                f'    """{verb.capitalize()} the {adj} {noun}s and return their weighted {other} score."""',
                f"    {acc} = 0.0"]
        body += rng.choice([
            [f"    for item in {arg}:", f"        if item.get('{other}', 0) > LIMIT:",
             f"            {acc} += item['{other}'] * factor", "        else:", f"            {acc} -= {k}"],
            [f"    for i, item in enumerate({arg}):", f"        value = float(item.get('{adj}', i))",
             f"        {acc} += math.sqrt(abs(value)) / {k}", f"        if {acc} > LIMIT * factor:", "            break"],
            [f"    ranked = sorted({arg}, key=lambda d: d.get('{other}', 0))",
             f"    for item in ranked[:{k}]:", f"        {acc} += item.get('{adj}', 1) * factor"],
        ])
        body += [f"    return round({acc}, {rng.randint(1, 4)})", "", ""]
        lines += body
    return "\n".join(lines).rstrip() + "\n", names


def _code_edit(rng: random.Random, _: object) -> list[dict[str, str]]:
    code, names = _module(rng)
    old = rng.choice(names)
    new = old.replace(old.split("_")[0], rng.choice([v for v in _VERBS if v != old.split("_")[0]]), 1)
    edited = code.replace(old, new)
    limit = rng.randint(100, 999)
    ask = rng.choice(("Now also change LIMIT to {n}. Show the whole file again.",
                      "Next, set LIMIT to {n} and give me the complete updated file.",
                      "Please change the LIMIT constant to {n} as well and print the full module."))
    return [{"role": "user", "content": f"Here is my module:\n\n```python\n{code}```\n\nRename `{old}` to `{new}` "
                                        f"and show me the whole file."},
            {"role": "assistant", "content": f"Here is the file with `{old}` renamed to `{new}`:\n\n```python\n"
                                             f"{edited}```"},
            {"role": "user", "content": ask.format(n=limit)}]


# ------------------------------------------------------------------------------------------- agentic
_TOOLS = [
    {"name": "search_files", "description": "Find files whose contents match a pattern.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}}}},
    {"name": "read_file", "description": "Read a file's lines.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"},
                                                     "end": {"type": "integer"}}}},
    {"name": "run_tests", "description": "Run the test suite on a path.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
]


def _call(name: str, **args: object) -> str:
    return json.dumps({"name": name, "arguments": args})


def _agentic(rng: random.Random, _: object) -> list[dict[str, str]]:
    noun, verb = rng.choice(_NOUNS), rng.choice(_VERBS)
    files = [f"src/{rng.choice(_NOUNS)}/{verb}_{rng.choice(_NOUNS)}.py" for _ in range(rng.randint(3, 5))]
    system = ("You are a coding agent. Call one tool per turn by answering with a JSON object "
              '{"name": ..., "arguments": {...}} and nothing else. Tools:\n' + json.dumps(_TOOLS, indent=1))
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": f"The {noun} {verb} step fails for {rng.choice(_FIRST)}'s data set. "
                                        f"Find where `{verb}_{noun}` is defined and check the tests."},
            {"role": "assistant", "content": _call("search_files", pattern=f"def {verb}_{noun}", path="src")},
            {"role": "tool", "content": "\n".join(f"{f}:{rng.randint(5, 300)}: def {verb}_{noun}(items):"
                                                  for f in files)}]
    for f in files[:-1]:
        start = rng.randint(1, 200)
        msgs += [{"role": "assistant", "content": _call("read_file", path=f, start=start, end=start + 20)},
                 {"role": "tool", "content": "\n".join(f"{start + j}: {rng.choice(_VERBS)}({rng.choice(_NOUNS)}, "
                                                       f"{rng.randint(0, 99)})" for j in range(5))}]
    return msgs


# ----------------------------------------------------------------------------------------- summarise
def _summarise(rng: random.Random, _: object) -> list[dict[str, str]]:
    who = [f"{rng.choice(_FIRST)} {rng.choice(_LAST)}" for _ in range(3)]
    city, noun = rng.choice(_CITIES), rng.choice(_NOUNS)
    facts = [f"The {noun} team in {city} met on {rng.choice(('Monday', 'Tuesday', 'Thursday'))} to review "
             f"the quarter.",
             f"{who[0]} reported that {rng.randint(12, 95)} percent of {noun}s were processed within "
             f"{rng.randint(2, 9)} days.",
             f"\"We cut the backlog by {rng.randint(100, 900)} {noun}s, but the {rng.choice(_ADJ)} queue is "
             f"still too long,\" {who[1]} said.",
             f"The budget for the next quarter is {rng.randint(20, 90)},{rng.randint(100, 999)} euros, "
             f"{rng.randint(3, 15)} percent more than planned.",
             f"{who[2]} will {rng.choice(_VERBS)} the {rng.choice(_NOUNS)} pipeline before "
             f"{rng.choice(('March', 'June', 'October'))} {rng.randint(2, 28)}.",
             f"\"Nobody should {rng.choice(_VERBS)} a {noun} twice,\" {who[0]} added, \"and the "
             f"{rng.choice(_NOUNS)} checks stay manual until then.\"",
             f"The next review is planned in {rng.choice(_CITIES)} with {rng.randint(4, 20)} people."]
    rng.shuffle(facts)
    doc = " ".join(facts[:4]) + "\n\n" + " ".join(facts[4:])
    ask = rng.choice(("Summarise this report in three bullet points, quoting the key sentences word for word.",
                      "Give a short summary of the report below. Quote the two most important sentences exactly.",
                      "Summarize the following meeting notes; include direct quotes from it."))
    return [{"role": "user", "content": f"{ask}\n\n{doc}"}]


# ------------------------------------------------------------------------------------------- extract
def _schema(rng: random.Random) -> dict[str, str]:
    kinds = [{"customer": "full name", "city": "city", "items": "list of item names", "total": "number",
              "due": "date"},
             {"reporter": "full name", "product": "item name", "severity": "low|medium|high", "opened": "date",
              "location": "city"},
             {"buyer": "full name", "seller": "full name", "item": "item name", "quantity": "integer",
              "price": "number", "currency": "EUR|USD"}]
    return rng.choice(kinds)


def _extract(rng: random.Random, schema: dict[str, str]) -> list[dict[str, str]]:
    name = lambda: f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"  # noqa: E731
    date = f"{rng.randint(2019, 2026)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    items = rng.sample(_ITEMS, rng.randint(1, 3))
    lines = [f"Reference {rng.randint(10000, 99999)}, filed on {date} in {rng.choice(_CITIES)}.",
             f"{name()} bought {', '.join(items)} from {name()} ({rng.randint(1, 40)} units in all).",
             f"The amount is {rng.randint(10, 4000)}.{rng.randint(0, 99):02d} {rng.choice(('EUR', 'USD'))}, "
             f"due by {rng.randint(2019, 2026)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}.",
             f"{name()} reported the {rng.choice(items)} as {rng.choice(('broken', 'late', 'wrong', 'fine'))} "
             f"(severity: {rng.choice(('low', 'medium', 'high'))})."]
    rng.shuffle(lines)
    keys = json.dumps(schema, indent=1)
    return [{"role": "user", "content": f"Extract these fields from the document as a JSON object with exactly "
                                        f"these keys:\n{keys}\n\nDocument:\n" + "\n".join(lines)}]
