"""Tiny checkpoints for speculation tests (random targets and EAGLE-3 heads in the SGLang format), and
the verifiers tests call directly (verify_greedy, verify_sampling, fresh_uniforms: the engine calls
speculative.verifier.verify only)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from augury.speculative import verifier
from augury.speculative.tree import DraftTree

HIDDEN, VOCAB, LAYERS = 64, 256, 6


def make_target(path: Path, bigram: bool = False, seed: int = 0, vocab: int = VOCAB, layers: int = LAYERS) -> Path:
    """A tiny float32 Llama. bigram=True zeroes every o_proj and down_proj, so the residual
    stream stays embed(token) and the next token is a fixed function of the current one."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512,
                      initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    if bigram:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    return path


def _head_config(vocab: int, draft_vocab: int, heads: int, head_dim: int, inter: int, aux=None) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": heads,
        "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "target_hidden_size": HIDDEN, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if aux is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
    return cfg


def write_head(path: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def random_head(path: Path, vocab: int = VOCAB, draft_vocab: int = 200, seed: int = 1, aux=(0, 2, 3),
                fc_inputs: int = 3) -> Path:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    h, inter, hd = HIDDEN, 96, 16
    t = {
        "fc.weight": r(h, fc_inputs * h), "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": r(4 * hd, 2 * h), "midlayer.self_attn.k_proj.weight": r(4 * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(4 * hd, 2 * h), "midlayer.self_attn.o_proj.weight": r(h, 4 * hd),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.mlp.gate_proj.weight": r(inter, h), "midlayer.mlp.up_proj.weight": r(inter, h),
        "midlayer.mlp.down_proj.weight": r(h, inter), "norm.weight": torch.ones(h),
        "lm_head.weight": r(draft_vocab, h),
        "d2t": torch.zeros(draft_vocab, dtype=torch.long), "t2d": torch.zeros(vocab, dtype=torch.bool),
    }
    return write_head(path, _head_config(vocab, draft_vocab, 4, hd, inter, aux=aux), t)


def bigram_head(path: Path, target_dir: Path, draft_vocab: int = 200, seed: int = 2) -> Path:
    """A head that predicts a bigram target's next token exactly, if read faithfully.

    Attention (one head, head_dim 2H, q = a*x, k = x) is sharp on the query itself, whose
    value is embed_n(token) - hidden_norm(h); the residual h cancels, so the pre-norm output
    is embed_n(token p+1) and norm + lm_head reproduce the target's next-token choice for it.
    The draft vocabulary is a shuffled subset containing every token the target can emit,
    so d2t must be applied for any draft to be right.
    """
    from safetensors.torch import load_file

    w = load_file(str(target_dir / "model.safetensors"))
    embed, lm = w["model.embed_tokens.weight"], w["lm_head.weight"]
    vocab, h = embed.shape
    normed = embed / embed.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    image = sorted(set((normed @ lm.T).argmax(-1).tolist()))
    g = torch.Generator().manual_seed(seed)
    others = [t for t in torch.randperm(vocab, generator=g).tolist() if t not in set(image)]
    order = image + others[: draft_vocab - len(image)]
    order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
    draft_ids = torch.tensor(order)
    eye, zero = torch.eye(h), torch.zeros(h, h)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    t = {
        "fc.weight": torch.zeros(h, 3 * h), "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": 4.0 * torch.eye(2 * h),
        "midlayer.self_attn.k_proj.weight": torch.eye(2 * h),
        "midlayer.self_attn.v_proj.weight": torch.cat([torch.cat([eye, -eye], 1), torch.cat([zero, zero], 1)], 0),
        "midlayer.self_attn.o_proj.weight": torch.cat([eye, zero], 1),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.mlp.gate_proj.weight": torch.zeros(32, h), "midlayer.mlp.up_proj.weight": torch.zeros(32, h),
        "midlayer.mlp.down_proj.weight": torch.zeros(h, 32), "norm.weight": torch.ones(h),
        "lm_head.weight": lm[draft_ids], "d2t": draft_ids - torch.arange(len(order)), "t2d": t2d,
    }
    return write_head(path, _head_config(vocab, len(order), 1, 2 * h, 32), t)


def checkpoints(root: Path) -> dict[str, Path]:
    """The speculation tests' set: a random target with a random head, and a bigram target with the
    head that predicts it exactly (high acceptance)."""
    bigram = make_target(root / "bigram", bigram=True)
    return {"target": make_target(root / "target"), "head": random_head(root / "head"), "bigram": bigram,
            "bigram_head": bigram_head(root / "bigram_head", bigram)}


# ---- verifiers for tests ---------------------------------------------------------------------------

def verify_greedy(tree: DraftTree, target_logits: verifier.NodeValues) -> verifier.VerifyResult:
    """target_logits [B, N, V] (or a row function): every row verified greedily (verify at temperature 0)."""
    b = tree.batch_size
    return verifier.verify(tree, target_logits, [0.0] * b, [None] * b, [1.0] * b)


def fresh_uniforms(tree: DraftTree, rows: Sequence[int]) -> dict[int, list[float]]:
    """Uniforms from the global generator for every level of `rows`' trees (for tests without
    per-request streams, e.g. statistical ones)."""
    n = int(tree.depth.max()) + 1 if tree.depth.numel() else 1
    u = torch.rand(len(rows), n, dtype=torch.float64).tolist()
    return dict(zip(rows, u))


def verify_sampling(tree: DraftTree, target_probs: verifier.NodeValues,
                    uniforms: Sequence[Sequence[float]] | None = None) -> verifier.VerifyResult:
    """target_probs [B, N, V] (or a row function): the target's distributions at every node, already
    filtered. uniforms[b][d]: request b's uniform for its d-th new position (None: fresh_uniforms).
    verify's sampling walk without its filters."""
    rows = list(range(tree.batch_size))
    if uniforms is None:
        fresh = fresh_uniforms(tree, rows)
        uniforms = [fresh[b] for b in rows]
    walk = verifier._walk(tree, rows, verifier._rows_at(target_probs), verifier._sampling_step(uniforms))
    return verifier._result(walk, tree.batch_size)


def tokenized_checkpoints(root: Path) -> dict[str, Path]:
    """A 2-layer random target with the server tests' byte-level tokenizer ("target"), and a random
    EAGLE-3 head over its whole vocabulary ("head"): for tests that need text (grammars, bad words,
    stop strings) through plain and speculative engines."""
    from transformers import AutoTokenizer

    from helpers_server import make_tiny_checkpoint

    tok = AutoTokenizer.from_pretrained(str(make_tiny_checkpoint(root / "tok")))
    target = make_target(root / "target", vocab=len(tok), layers=2)
    tok.save_pretrained(str(target))
    return {"target": target, "head": random_head(root / "head", vocab=len(tok), draft_vocab=len(tok), aux=(0, 1, 1))}


def plain_llm(ckpts: dict[str, Path]):
    """tokenized_checkpoints' target without speculation (float32: the reference)."""
    from augury import LLM

    return LLM(str(ckpts["target"]), dtype="float32", speculative_algorithm="none", log_stats_interval=0)


def static_eagle3_llm(ckpts: dict[str, Path]):
    """tokenized_checkpoints' target drafting with its head, always the same tree (3 steps, top-2, 6 nodes)."""
    from augury import LLM

    return LLM(str(ckpts["target"]), dtype="float32", draft_model=str(ckpts["head"]), speculative_algorithm="eagle3",
               speculative_policy="static", speculative_num_steps=3, speculative_eagle_topk=2,
               speculative_num_draft_tokens=6, log_stats_interval=0, max_num_seqs=8)
