"""Stop strings against a scripted target: multi-token stop strings, stop strings next to (or
inside) characters split over several byte-level BPE tokens, and stop strings reached in the
middle of the tokens one speculative step commits. Nothing after the stop string is ever
shown: not in the final text, not in any streamed delta (engine steps and the HTTP server).

The target is a 1-layer Llama whose attention and MLP outputs are zero, so its greedy next
token depends on the current token only; its embedding and output rows are set so that it
walks two fixed cycles of tokens (CHAIN_A, CHAIN_B) forever. The tokenizer is a real
byte-level BPE (the `tokenizers` library: GPT-2 byte alphabet, ByteLevel decoder) whose merges
are written by hand, so that some tokens end in the middle of a UTF-8 character.

Token ids: the output keeps the token that completed the stop string (as vLLM does), also
when that token goes on past it or ends inside a character, and nothing after it.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch

from augury import LLM, SamplingParams
from conftest import assert_no_leaks
from helpers_server import ServerProcess, serve

# Each cycle is what the target generates after any of its tokens, in order, round and round.
CHAIN_A = [b"Hel", b"lo", b" wor", b"ld", b"!", b" Bye", b" now", b"."]
#   text: "Hello world! Bye now."
CHAIN_B = [b" ok", b" \xf0\x9f", b"\x91\x8d\xf0\x9f", b"\x8f\xbd", b" caf", b"\xc3", b"\xa9", b" yz\xc3", b"\xa9w",
           b" ne", b"\xcc", b"\x81?", b";"]
#   text: " ok 👍🏽 café yzéw né?;"  (👍 + skin-tone modifier over three tokens that split both
#   emoji, é as two one-byte tokens, a token "yz" + é's first byte, e + a combining acute accent)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The speculative LLM drafts a 6-token prompt-lookup chain: a step commits up to 7 tokens.
NGRAM = dict(speculative_algorithm="ngram", speculative_policy="static", speculative_num_steps=6,
             speculative_eagle_topk=1, speculative_num_draft_tokens=7)
PER_STEP = 7


def _byte_symbols() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def _sym(b: bytes) -> str:
    table = _byte_symbols()
    return "".join(table[x] for x in b)


def build_scripted_checkpoint(folder: Path) -> dict[str, list[int]]:
    """Writes the tokenizer and the target; returns each chain as token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {_sym(bytes([i])): i for i in range(256)}
    merges: list[tuple[str, str]] = []
    for token in CHAIN_A + CHAIN_B:  # each multi-byte token: merge its bytes left to right
        for k in range(2, len(token) + 1):
            if _sym(token[:k]) not in vocab:
                vocab[_sym(token[:k])] = len(vocab)
                merges.append((_sym(token[: k - 1]), _sym(token[k - 1 : k])))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[2],
                                   pad_token=SPECIALS[0])
    fast.save_pretrained(str(folder))
    chains = {"A": [vocab[_sym(t)] for t in CHAIN_A], "B": [vocab[_sym(t)] for t in CHAIN_B]}
    flat = chains["A"] + chains["B"]
    assert len(set(flat)) == len(flat) <= 64  # a bigram target: each token has one successor

    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    basis = torch.linalg.qr(torch.randn(64, 64))[0]  # orthonormal rows: one per scripted token
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()  # the residual stream stays embed(token)
        layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.normal_(0.0, 0.3)
        head.zero_()
        for i, t in enumerate(flat):
            emb[t] = basis[i]
        for chain in chains.values():  # logit 32 for the successor, exactly 0 for every other token
            for i, t in enumerate(chain):
                head[chain[(i + 1) % len(chain)]] = 4.0 * emb[t]
    model.save_pretrained(str(folder))
    return chains


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[int]]]:
    folder = tmp_path_factory.mktemp("scripted") / "model"
    return folder, build_scripted_checkpoint(folder)


def _llm(folder: Path, **kwargs) -> LLM:
    return LLM(str(folder), dtype="float32", device="cpu", log_stats_interval=0.0, **kwargs)


@pytest.fixture(scope="module")
def plain(scripted) -> LLM:
    return _llm(scripted[0], speculative_algorithm="none")


@pytest.fixture(scope="module")
def ngram(scripted) -> LLM:
    return _llm(scripted[0], **NGRAM)


@dataclass(frozen=True)
class Case:
    chain: str
    stop: tuple[str, ...]
    text: str  # the whole output text: everything before the stop string
    num_tokens: int  # up to and including the token that completed the stop string
    max_tokens: int = 40
    stop_token: int | None = None  # index in the chain of a token given as a stop token id


CASES = {
    # several BPE tokens, across steps when decoding plainly
    "two-tokens": Case("A", (" world",), "lo", 3),
    "ends-inside-a-token": Case("A", ("d! B",), "lo worl", 5),  # " Bye" completes it and goes on
    "three-tokens-to-the-step-end": Case("A", ("now.Hel",), "lo world! Bye ", 8),
    # the stop string is the first part of 👍🏽, and its last token ends inside 🏽
    "emoji-first-part": Case("B", ("👍",), " ", 2),
    "emoji-first-part-at-max-tokens": Case("B", ("👍",), " ", 2, max_tokens=2),
    "emoji-second-part": Case("B", ("🏽",), " 👍", 3),
    "char-over-two-tokens": Case("B", ("é",), " 👍🏽 caf", 6),
    "token-ends-inside-a-char": Case("B", ("yz",), " 👍🏽 café ", 7),
    "before-a-combining-accent": Case("B", ("ne",), " 👍🏽 café yzéw ", 9),
    "earliest-of-several": Case("B", ("zzz", "caf", "👍🏽"), " ", 3),
    # the stop token "ld" also completes the stop string "orld": the text is cut all the same
    "stop-token-completes-it": Case("A", ("orld",), "lo w", 3, stop_token=3),
}


def _prompt(chains: dict[str, list[int]], case: Case) -> list[int]:
    """The whole cycle, then its first token: the target goes on with the cycle's second token,
    and prompt lookup finds the continuation at once (multi-token speculative commits)."""
    chain = chains[case.chain]
    return chain + chain[:1]


def _params(chains: dict[str, list[int]], case: Case) -> SamplingParams:
    stop_ids = [chains[case.chain][case.stop_token]] if case.stop_token is not None else []
    return SamplingParams(temperature=0.0, max_tokens=case.max_tokens, stop=list(case.stop), stop_token_ids=stop_ids)


def _stream(llm: LLM, prompt: list[int], params: SamplingParams):
    """Drives engine.step() by hand: (final output, every output of the request, commit calls
    as (tokens offered, tokens kept))."""
    engine = llm.engine
    commits: list[tuple[int, int]] = []
    real_commit = engine.commit

    def spy(req, tokens, logprobs=None, sources=None):
        kept = real_commit(req, tokens, logprobs, sources)
        commits.append((len(tokens), kept))
        return kept

    engine.commit = spy
    try:
        rid = engine.add_request(prompt, params)
        outs = []
        while engine.has_unfinished_requests():
            outs.extend(o for o in engine.step() if o.request_id == rid)
    finally:
        del engine.commit
    assert_no_leaks(engine)
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs[-1], outs, commits


@pytest.mark.parametrize("spec", ["plain", "ngram"])
@pytest.mark.parametrize("name", list(CASES))
def test_stop_string_engine_steps(scripted, plain, ngram, spec: str, name: str) -> None:
    folder, chains = scripted
    case, llm = CASES[name], {"plain": plain, "ngram": ngram}[spec]
    prompt = _prompt(chains, case)
    chain = chains[case.chain]
    script = (chain[1:] + chain[:1]) * 4

    # the script is what the target says (without the stop string)
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    assert free.token_ids == script[:20]

    final, outs, commits = _stream(llm, prompt, _params(chains, case))
    assert final.finish_reason == "stop"
    assert final.text == case.text
    assert final.token_ids == script[: case.num_tokens]
    # the streamed deltas add up to exactly the final output, and never run ahead of it
    assert "".join(o.new_text for o in outs) == final.text
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    shown = ""
    for o in outs:
        shown += o.new_text
        assert o.text == shown  # a running output's text is what has been streamed so far
        assert final.text.startswith(shown)
        assert not any(s in shown for s in case.stop)
    # the same request, not streamed
    again = llm.generate(prompt, _params(chains, case), use_tqdm=False)[0]
    assert (again.text, again.token_ids, again.finish_reason) == (final.text, final.token_ids, "stop")

    if spec == "ngram":
        # prefill gives one token, then every step commits PER_STEP (every draft is right), the
        # last one cut short by the stop string unless it completed on the step's last token
        offered = [n for n, _ in commits]
        assert offered[0] == 1 and all(n == PER_STEP for n in offered[1:]), commits
        assert final.spec_stats.num_verify_steps > 0
        cut_mid_step = (case.num_tokens - 1) % PER_STEP != 0
        assert (commits[-1][1] < commits[-1][0]) == cut_mid_step, commits
    else:
        assert all(n == 1 for n, _ in commits)


def test_some_cases_stop_mid_step() -> None:
    """The speculative runs above cover a stop in the middle of one step's tokens (most cases)
    and one at its very end."""
    mid = [c for c in CASES.values() if (c.num_tokens - 1) % PER_STEP != 0]
    assert len(mid) >= 8 and len(mid) < len(CASES)


# ---------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(scripted) -> Iterator[ServerProcess]:
    args = ["--model", str(scripted[0]), "--dtype", "float32", "--max-num-seqs", "4"]
    for key, value in NGRAM.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    with serve(args) as sp:
        yield sp


@pytest.mark.parametrize("lookup", [True, False], ids=["multi-token-steps", "one-token-steps"])
@pytest.mark.parametrize("name", ["two-tokens", "ends-inside-a-token", "emoji-first-part",
                                  "emoji-first-part-at-max-tokens", "token-ends-inside-a-char",
                                  "before-a-combining-accent", "stop-token-completes-it"])
def test_stop_string_server_stream(scripted, server: ServerProcess, name: str, lookup: bool) -> None:
    """Through HTTP, streamed and not: the same text, nothing after the stop string in any chunk.
    Without an earlier occurrence to look up (a one-token prompt) steps commit one token each,
    so the stream itself must hold back the start of a stop string that later tokens complete."""
    _, chains = scripted
    case = CASES[name]
    prompt = _prompt(chains, case) if lookup else chains[case.chain][:1]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model=str(scripted[0]), prompt=prompt, max_tokens=case.max_tokens, temperature=0, stop=list(case.stop))
    if case.stop_token is not None:
        kw["extra_body"] = {"stop_token_ids": [chains[case.chain][case.stop_token]]}

    whole = client.completions.create(**kw)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].text == case.text
    assert whole.usage.completion_tokens == case.num_tokens

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == case.text
    shown = ""
    for t in texts:
        shown += t
        assert case.text.startswith(shown) and "\ufffd" not in t
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == case.num_tokens

    assert server.proc.poll() is None
