"""EAGLE-3 head training: TTT maths against the head's own forward, the mapping tensors, exact
resume, and the whole `augury train-draft` pipeline on a tiny learnable target, whose trained
head must be accepted by augury's engine far more often than an untrained one.

The tiny target is a random 4-layer Llama whose attention and MLP outputs are zeroed, so
its next token is a fixed function of the current one (a bigram map): greedy decoding
walks into short cycles, low-entropy text a one-layer head can learn in seconds.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from augury.models.eagle3_head import load_eagle3
from augury.models.loader import load_target
from augury.train import train_main
from augury.train.data import Sample
from augury.train.evaluate import evaluate_head
from augury.train.head import build_head, export_head, head_config
from augury.train.prompts import Prompt, builtin_prompts, make_splits
from augury.train.trainer import Trainer, TrainSettings
from augury.train.ttt import target_features, ttt_step
from augury.train.vocab import build_draft_vocab, mapping_tensors

VOCAB = 96


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # every layer passes the embedding through: logits depend on the last token only
            elif "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen))
        # next token = f(current), f a random map into ordinary ids (never EOS): row f(x) of
        # lm_head gets the normalised embedding of x, so its logit is ~H against ~sqrt(H) for others
        emb = model.model.embed_tokens.weight
        unit = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
        f = torch.randint(3, VOCAB, (VOCAB,), generator=gen)
        model.lm_head.weight.zero_().index_add_(0, f, unit)
    out = tmp_path_factory.mktemp("bigram") / "target"
    model.save_pretrained(str(out))
    return out


def _prompt_file(folder: Path, n: int) -> Path:
    rng = random.Random(0)
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"ids": [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 6))]})
                            + "\n" for _ in range(n)))
    return path


def test_ttt_step_equals_head_forward_with_ttt_mask(bigram_target: Path) -> None:
    target, tcfg = load_target(bigram_target, torch.float32, torch.device("cpu"), 64)
    head = build_head(target, head_config(tcfg, 32, (0, 1, 2)), torch.arange(0, 64, 2), 64, seed=1)
    b, n, steps = 2, 7, 4
    toks = torch.randint(0, VOCAB, (b, n + steps))
    idx = torch.arange(n)[None].expand(b, n)
    some = torch.tensor([[5, 0, 3], [6, 2, 2]])  # a subset of chains (repeats allowed), any order
    rows = torch.arange(b)[:, None]
    h = ref = torch.randn(b, n, tcfg.hidden_size)
    ctx, chain, sub_chain, ref_k, ref_v = None, [], [], [], []
    with torch.no_grad():
        for j in range(steps):
            if j == 1:
                sub = h[rows, some]
            if j >= 1:  # the same chains, unrolled alone, give the same rows
                sub, k, v = ttt_step(head, toks[rows, some + j], sub, some, j, ctx, sub_chain)
                sub_chain.append((k, v))
            h, k, v = ttt_step(head, toks[:, j : j + n], h, idx, j, ctx, chain)
            if j == 0:
                ctx = (k, v)
            else:
                chain.append((k, v))
            # reference: step-0 keys causal, step-i keys (i >= 1) only at the query's own index
            mask = torch.cat([torch.ones(n, n, dtype=torch.bool).tril()] + [torch.eye(n, dtype=torch.bool)] * j, 1)
            kv = (torch.cat(ref_k, 1), torch.cat(ref_v, 1)) if j else None
            ref, k, v = head(toks[:, j : j + n], ref, idx + j, kv, mask[None, None], False)
            ref_k.append(k)
            ref_v.append(v)
            torch.testing.assert_close(h, ref, rtol=1e-5, atol=1e-5)
            if j >= 1:
                torch.testing.assert_close(sub, ref[rows, some], rtol=1e-5, atol=1e-5)


def test_draft_vocab_and_mapping_format() -> None:
    ids = build_draft_vocab([[5, 5, 5, 9, 9, 7], [9, 3]], vocab_size=12, draft_vocab_size=4)
    assert ids.tolist() == [3, 5, 7, 9]  # the 4 most frequent, ascending
    d2t, t2d = mapping_tensors(ids, 12)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (12,)
    assert (torch.arange(4) + d2t).tolist() == [3, 5, 7, 9] and t2d.nonzero().flatten().tolist() == [3, 5, 7, 9]
    padded = build_draft_vocab([[4]], vocab_size=6, draft_vocab_size=3)  # unseen ids fill the rest
    assert padded.tolist() == [0, 1, 4]


def test_builtin_prompts_split_is_disjoint_and_stable() -> None:
    prompts = [Prompt(t) for t in builtin_prompts()]
    assert len(prompts) >= 2000 and len({p.text for p in prompts}) == len(prompts)
    a, b = make_splits(prompts, 500, seed=0), make_splits(prompts, 2000, seed=3)
    assert not {p.text for p in a["eval"]} & {p.text for p in b["train"] + b["valid"]}
    assert {p.text for p in a["eval"]} == {p.text for p in b["eval"]}  # split by hash, not by order


def test_resume_continues_exactly(bigram_target: Path, tmp_path: Path) -> None:
    target, tcfg = load_target(bigram_target, torch.float32, torch.device("cpu"), 64)
    rng = random.Random(1)
    samples = [Sample(tuple([1] + [rng.randrange(3, VOCAB) for _ in range(20)]), 3) for _ in range(24)]
    draft_ids = torch.arange(0, VOCAB, 2)
    t2d = mapping_tensors(draft_ids, VOCAB)[1]
    settings = TrainSettings(lr=1e-3, ttt_length=3, batch_tokens=84, save_every=2, epochs=2)

    def trainer(ckpt: Path) -> Trainer:
        head = build_head(target, head_config(tcfg, draft_ids.numel(), (0, 1, 2)), draft_ids, 64, seed=0)
        return Trainer(target, head, draft_ids, t2d, (0, 1, 2), samples, samples[:4], settings, ckpt)

    full = trainer(tmp_path / "a")
    assert full.run(tmp_path / "a.jsonl", show_progress=False)
    cut = trainer(tmp_path / "b")
    assert not cut.run(tmp_path / "b.jsonl", show_progress=False, stop_at_step=full.total_steps // 2 + 1)
    resumed = trainer(tmp_path / "b")
    resumed.load(tmp_path / "b" / "latest.pt")
    assert resumed.run(tmp_path / "b.jsonl", show_progress=False)
    assert resumed.step == full.step
    for (name, p), q in zip(full.head.named_parameters(), resumed.head.parameters()):
        assert torch.equal(p, q), name


def test_cached_target_features_give_the_same_loss(bigram_target: Path, tmp_path: Path) -> None:
    """Epochs after the first read the target's states from memory: the loss of a batch must be
    the one a fresh target forward gives, even when the rows were cached from other batches
    (other padding); a zero budget caches nothing."""
    target, tcfg = load_target(bigram_target, torch.float32, torch.device("cpu"), 64)
    rng = random.Random(2)
    samples = [Sample(tuple([1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 30))]), 3)
               for _ in range(12)]
    draft_ids = torch.arange(0, VOCAB, 2)
    t2d = mapping_tensors(draft_ids, VOCAB)[1]
    head = build_head(target, head_config(tcfg, draft_ids.numel(), (0, 1, 2)), draft_ids, 64, seed=0)

    def trainer(gb: float) -> Trainer:
        settings = TrainSettings(ttt_length=3, batch_tokens=200, feature_cache_gb=gb)
        return Trainer(target, head, draft_ids, t2d, (0, 1, 2), samples, samples[:3], settings, tmp_path / str(gb))

    cached, fresh = trainer(1.0), trainer(0.0)
    for i in range(0, 12, 3):  # fill the cache in batches of three
        cached._loss("train", [i, i + 1, i + 2])
    assert len(cached.cache) == 12 and cached.cache_bytes > 0
    batch = [11, 0, 5, 7]  # rows cached from different batches
    a, _ = cached._loss("train", batch)
    b, _ = fresh._loss("train", batch)
    assert not fresh.cache
    assert a.counted == b.counted and a.correct == b.correct
    assert float(a.loss.detach()) == pytest.approx(float(b.loss.detach()), rel=1e-5)
    tiny = trainer(1e-6)  # a budget smaller than one row: computed, never kept
    tiny._loss("train", batch)
    assert not tiny.cache


def test_train_draft_pipeline_beats_untrained_head(bigram_target: Path, tmp_path: Path) -> None:
    out = tmp_path / "head"
    args = ["--target", str(bigram_target), "--out", str(out), "--prompts-file", str(_prompt_file(tmp_path, 200)),
            "--num-prompts", "120", "--max-new-tokens", "24", "--temperatures", "0", "--gen-batch", "64",
            "--shard-size", "64", "--dtype", "float32", "--draft-vocab-size", "48", "--ttt-length", "4",
            "--max-seq-len", "48", "--batch-tokens", "480", "--epochs", "8", "--lr", "3e-3", "--save-every", "16",
            "--precision", "fp32", "--export-dtype", "float32", "--eval-prompts", "8", "--eval-batch1", "2",
            "--eval-max-tokens", "24", "--spec-steps", "4", "--no-progress"]
    assert train_main(args) == 0
    work = tmp_path / "head-work"

    # the export is a strict-loading SGLang/vLLM EAGLE-3 folder
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 48 and cfg["vocab_size"] == VOCAB
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    target, tcfg = load_target(bigram_target, torch.float32, torch.device("cpu"), 64)
    head = load_eagle3(out, tcfg, target.embed_tokens, torch.float32, torch.device("cpu"), 64)
    assert head.lm_head.weight.shape == (48, 32)
    # fc was trained on aux / scale; the export folds the scale in, so it reads raw features
    best = torch.load(work / "ckpt" / "best.pt", weights_only=False)
    torch.testing.assert_close(head.fc.weight, best["head"]["fc.weight"] / best["aux_scale"][None, :])

    # an untrained head (same init, no steps) measured the same way
    draft_ids = torch.load(work / "vocab.pt")["draft_ids"]
    untrained = export_head(build_head(target, head_config(tcfg, 48, (0, 1, 2)), draft_ids, 64, seed=0), tcfg,
                            draft_ids, tmp_path / "untrained", torch.float32)
    splits = make_splits([Prompt(None, tuple(json.loads(line)["ids"]))
                          for line in (tmp_path / "prompts.jsonl").read_text().splitlines()], 120, seed=0)
    before = evaluate_head(bigram_target, untrained, splits["eval"][:8], 4, 24, "float32", 0)["batch8"]
    after = json.loads((work / "eval.json").read_text())
    trained = after["batch8"]
    assert after["batch1"]["requests"] == 2 and len(trained["accept_rate_per_position"]) == 4
    assert trained["accept_length"] >= 2.5, trained
    assert json.loads((out / "config.json").read_text())["augury_acceptance"] == trained["accept_rate_per_position"]
    assert trained["accept_length"] > before["accept_length"] + 1.0, (before, trained)

    # features: the label mask never scores prompt positions or the last token
    ids = torch.tensor([[1, 5, 6, 7, 8, 0]])
    feats = target_features(target, ids, torch.tensor([5]), torch.tensor([3]), (0, 1, 2), draft_ids,
                            mapping_tensors(draft_ids, VOCAB)[1])
    assert feats.label_ok[0, :2].sum() == 0 and feats.label_ok[0, 4:].sum() == 0


def test_eval_on_the_varied_set_reports_acceptance_per_kind(tmp_path: Path) -> None:
    """The evaluation also runs the varied held-out set (kinds no training template makes) as one
    batch and splits its acceptance by kind; the split adds up to the whole."""
    from augury.models.eagle3_head import default_aux_layers
    from augury.prompts import VARIED_PROMPTS, varied_prompts
    from helpers_server import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "bpe")
    target, tcfg = load_target(folder, torch.float32, torch.device("cpu"), 64)
    draft_ids = torch.arange(tcfg.vocab_size)
    head = build_head(target, head_config(tcfg, tcfg.vocab_size, default_aux_layers(tcfg.num_layers)), draft_ids, 64, 0)
    export_head(head, tcfg, draft_ids, tmp_path / "head", torch.float32)
    varied = varied_prompts(len(VARIED_PROMPTS) * 2)
    r = evaluate_head(folder, tmp_path / "head", [Prompt("Hello there.")], 3, 6, "float32", 1, varied=varied)
    v = r["varied"]
    assert v["requests"] == len(varied) and list(v["accept_length_by_kind"]) == list(VARIED_PROMPTS)
    assert all(1.0 <= x <= 4.0 for x in v["accept_length_by_kind"].values())
    assert min(v["accept_length_by_kind"].values()) <= v["accept_length"] <= max(v["accept_length_by_kind"].values())


def test_magpie_user_turns_from_the_chat_template(tmp_path: Path) -> None:
    """The target writes user turns from its chat template's user header: kept only when complete,
    plain, sized and new; written as they come, and a rerun tops the file up."""
    import types

    from augury.models.tokenizer import load_tokenizer
    from augury.train import magpie
    from helpers_server import make_tiny_checkpoint

    tok = load_tokenizer(make_tiny_checkpoint(tmp_path / "bpe"))
    header = magpie.user_header(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert full.startswith(header + "hello") and "hello" not in header

    assert magpie.keep("How do I sort a list in Python?", "stop")
    assert not magpie.keep("How do I sort a list in Python?", "length")  # cut off, not a whole turn
    assert not magpie.keep("Hi there", "stop")  # too short
    assert not magpie.keep("Tell me <|im_start|> about it please", "stop")
    assert not magpie.keep("Объясни, как работает фотосинтез, пожалуйста", "stop")  # not Latin script

    turns = iter([("Write a poem about the sea.", "stop"), ("write a  poem about the SEA.", "stop"),  # duplicate
                  ("What is the capital of France?", "stop"), ("too short", "stop"),
                  ("Explain recursion with an example.", "length"), ("Give me three tips for sleeping well.", "stop")]
                 + [("Same question every time, again.", "stop")] * 200)
    prompts_seen = []

    def generate(prompts, params, use_tqdm=False):
        prompts_seen.extend(prompts)
        assert all(p.temperature == 1.0 and p.top_p == 0.95 for p in params)
        return [types.SimpleNamespace(text=t, finish_reason=f) for t, f in (next(turns) for _ in prompts)]

    llm = types.SimpleNamespace(tokenizer=tok, config=types.SimpleNamespace(model="tiny"), generate=generate)
    out = tmp_path / "magpie.jsonl"
    got = magpie.write_user_turns(llm, 2, out, batch=3)
    assert got == ["Write a poem about the sea.", "What is the capital of France?"]
    assert all(p == tok.encode(header, add_special_tokens=False) for p in prompts_seen)
    # a rerun asking for more keeps the file's turns and adds new ones; a model repeating itself stops it
    got = magpie.write_user_turns(llm, 10, out, batch=3, max_rounds=3)
    assert got[:3] == ["Write a poem about the sea.", "What is the capital of France?",
                       "Give me three tips for sleeping well."]
    assert got[3:] == ["Same question every time, again."]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["text"] for rec in lines] == got and {rec["source"] for rec in lines} == {"magpie:tiny"}


def test_warm_start_from_an_exported_head_reproduces_it(bigram_target: Path, tmp_path: Path) -> None:
    """--init-from an exported folder: the trainer's head computes what the exported head computes
    (its fc re-expressed for the trainer's normalised features), with the export's own vocabulary;
    exporting it again gives the same tensors."""
    from augury.train.vocab import exported_vocab

    target, tcfg = load_target(bigram_target, torch.float32, torch.device("cpu"), 64)
    rng = random.Random(3)
    samples = [Sample(tuple([1] + [rng.randrange(3, VOCAB) for _ in range(12)]), 3) for _ in range(6)]
    draft_ids = torch.arange(1, VOCAB, 3)
    t2d = mapping_tensors(draft_ids, VOCAB)[1]
    settings = TrainSettings(ttt_length=2, batch_tokens=100)
    source = build_head(target, head_config(tcfg, draft_ids.numel(), (0, 1, 2)), draft_ids, 64, seed=5)
    with torch.no_grad():
        source.fc.weight.mul_(3.0)  # something build_head would not make
    exported = export_head(source, tcfg, draft_ids, tmp_path / "exported", torch.float32)
    assert torch.equal(exported_vocab(exported), draft_ids)

    head = build_head(target, head_config(tcfg, draft_ids.numel(), (0, 1, 2)), draft_ids, 64, seed=9)
    trainer = Trainer(target, head, draft_ids, t2d, (0, 1, 2), samples, samples[:2], settings, tmp_path / "ck")
    trainer.load_exported(exported)
    again = export_head(trainer.head, tcfg, draft_ids, tmp_path / "again", torch.float32, trainer.aux_scale)
    from safetensors.torch import load_file

    a, b = load_file(str(exported / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)
    other = torch.arange(0, VOCAB, 3)  # another vocabulary: refused, not silently mixed
    bad = Trainer(target, build_head(target, head_config(tcfg, other.numel(), (0, 1, 2)), other, 64, seed=9), other,
                  mapping_tensors(other, VOCAB)[1], (0, 1, 2), samples, samples[:2], settings, tmp_path / "ck2")
    with pytest.raises(ValueError, match="draft vocabulary"):
        bad.load_exported(exported)
