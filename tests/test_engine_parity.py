"""augury's target model against transformers' own classes on tiny random float32 checkpoints.

Greedy generations must equal transformers' `generate` token for token (augury batched with
mixed prompt lengths, transformers one prompt at a time); logits must be close; sharded
checkpoints, both rope config styles and strict loading are checked here too.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from augury import SamplingParams
from augury.attention import PagedBackend
from augury.builder import StartupError
from augury.core.kv_cache import KVCache
from augury.models.loader import load_target
from conftest import (FAMILIES, LLAMA3_ROPE, _hf_config, _randomize, edit_config, hf_greedy, hf_logits,
                      random_prompts)

MAX_TOKENS = 24
LENGTHS = [3, 11, 6, 17]  # mixed, so the batch is padded and decode contexts differ
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def augury_logits(folder: Path, prompt: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Our model's forward over one prompt (empty paged cache): float32 logits [len(prompt), V]."""
    model, cfg = load_target(folder, dtype, torch.device("cpu"), max_len=128)
    bs = 16
    blocks = -(-len(prompt) // bs)
    kv = KVCache(cfg.num_layers, blocks + 1, bs, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
    n = len(prompt)
    attn = PagedBackend(kv.k, kv.v, bs).prepare_prefill([list(range(1, blocks + 1))], [0], [n])
    with torch.no_grad():
        hidden, _ = model(torch.tensor([prompt]), torch.arange(n)[None], attn)
        return model.logits(hidden[0])


def assert_greedy_parity(llm, reference, prompts: list[list[int]]) -> None:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        expected = hf_greedy(reference, prompt, MAX_TOKENS)
        assert out.token_ids == expected, f"prompt {i} (length {len(prompt)}) diverged from transformers"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_batched(family, tiny_checkpoint, hf_model, make_llm) -> None:
    folder = tiny_checkpoint(family)
    llm = make_llm(folder)
    assert_greedy_parity(llm, hf_model(folder), random_prompts(LENGTHS, seed=1))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, tiny_checkpoint, hf_model) -> None:
    folder = tiny_checkpoint(family)
    prompt = random_prompts([40], seed=2)[0]
    ours, ref = augury_logits(folder, prompt), hf_logits(hf_model(folder), prompt)
    assert ref.std() > 0.5, "the reference logits are flat; the test would prove little"
    torch.testing.assert_close(ours[-1], ref[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_forward_is_closer_to_float32_than_transformers_bfloat16(tmp_path) -> None:
    """Our bfloat16 forward keeps the residual stream in float32, so on a 12-layer checkpoint its
    logits sit closer to the float32 reference than transformers' own bfloat16 forward does
    (mean over four prompts: one prompt's error moves with the last bits of any kernel; measured
    0.80x of transformers' error, and 0.89x with a bfloat16 residual stream, which this fails)."""
    from transformers import AutoModelForCausalLM

    cfg = _hf_config("llama")
    cfg.num_hidden_layers = 12
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(cfg).float().eval()
    _randomize(hf, 5)
    hf.save_pretrained(str(tmp_path))
    prompts = random_prompts([60] * 4, seed=5)
    refs = [hf_logits(hf, p) for p in prompts]
    hf.to(torch.bfloat16)
    hf_err = sum((hf_logits(hf, p) - r).abs().mean().item() for p, r in zip(prompts, refs)) / len(prompts)
    ours_err = sum((augury_logits(tmp_path, p, torch.bfloat16) - r).abs().mean().item()
                   for p, r in zip(prompts, refs)) / len(prompts)
    assert hf_err > 0, "bfloat16 changed nothing; the test would prove little"
    assert ours_err < 0.85 * hf_err, f"mean |logit error|: ours {ours_err:.4f}, transformers bfloat16 {hf_err:.4f}"


def test_sharded_checkpoint_loads(tiny_checkpoint, hf_model, make_llm) -> None:
    folder = tiny_checkpoint("llama", seed=3, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the checkpoint was not sharded"
    assert not (folder / "model.safetensors").exists()
    llm = make_llm(folder)
    assert_greedy_parity(llm, hf_model(folder), random_prompts([5, 9], seed=3))


def test_sharded_checkpoint_missing_shard_is_named(tiny_checkpoint, tmp_path) -> None:
    folder = shutil.copytree(tiny_checkpoint("llama", seed=3, max_shard_size="40KB"), tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load_target(folder, torch.float32, torch.device("cpu"), 64)


# ------------------------------------------------------------------ strict loading
def _edit_weights(folder: Path, kind: str) -> tuple[str, str]:
    """Break model.safetensors one way; returns (tensor name, what the error must also say)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    if kind == "missing":
        name = "model.layers.1.mlp.up_proj.weight"
        del tensors[name]
        extra = "missing"
    elif kind == "unexpected":
        name = "model.layers.0.mlp.extra_proj.weight"
        tensors[name] = torch.zeros(4, 4)
        extra = "unexpected"
    else:
        name = "model.layers.0.self_attn.k_proj.weight"
        tensors[name] = tensors[name][:-1].clone()  # [kv*hd - 1, hidden]
        extra = "shape"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return name, extra


@pytest.mark.parametrize("kind", ["missing", "unexpected", "misshaped"])
def test_strict_loading_names_the_tensor(kind, tiny_checkpoint, tmp_path, make_llm) -> None:
    folder = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "broken")
    name, word = _edit_weights(folder, kind)
    with pytest.raises(ValueError) as err:
        load_target(folder, torch.float32, torch.device("cpu"), 64)
    assert name in str(err.value) and word in str(err.value)
    # through the public API the same message arrives, naming the start-up stage
    with pytest.raises(StartupError) as err2:
        make_llm(folder)
    assert err2.value.stage == "target" and name in str(err2.value)


def test_tied_checkpoint_may_carry_a_copy_of_lm_head(tiny_checkpoint, tmp_path, hf_model, make_llm) -> None:
    src = tiny_checkpoint("qwen2")
    folder = shutil.copytree(src, tmp_path / "tied")
    tensors = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    llm = make_llm(folder)
    assert_greedy_parity(llm, hf_model(src), random_prompts([7], seed=4))


# ------------------------------------------------------------------ rope config styles
def _to_old_style(cfg: dict, type_key: str) -> None:
    """transformers 5 writes rope_parameters; older checkpoints say rope_theta + rope_scaling."""
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    cfg["rope_scaling"] = None if rope_type == "default" else {type_key: rope_type, **params}


@pytest.mark.parametrize("family,type_key", [("llama3", "rope_type"), ("llama3", "type"), ("llama", "rope_type")])
def test_old_style_rope_config_matches_new_style(family, type_key, tiny_checkpoint, tmp_path, hf_model,
                                                 make_llm) -> None:
    new = tiny_checkpoint(family)
    old = shutil.copytree(new, tmp_path / "old")
    edit_config(old, lambda cfg: _to_old_style(cfg, type_key))
    assert "rope_parameters" not in json.loads((old / "config.json").read_text())
    prompt = random_prompts([60], seed=5)[0]
    ref = hf_logits(hf_model(new), prompt)
    # transformers reads the old style as the same model ...
    torch.testing.assert_close(hf_logits(hf_model(old), prompt), ref, atol=1e-5, rtol=1e-5)
    # ... and so must augury, from either file
    torch.testing.assert_close(augury_logits(old, prompt), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(augury_logits(new, prompt), ref, atol=1e-4, rtol=1e-4)
    assert_greedy_parity(make_llm(old), hf_model(new), random_prompts([4, 30], seed=6))


def test_rope_scaling_and_theta_are_not_ignored(tiny_checkpoint, tmp_path, hf_model) -> None:
    """Control for the tests above: the scaling and theta really change the model."""
    scaled = tiny_checkpoint("llama3")
    plain = shutil.copytree(scaled, tmp_path / "plain")
    edit_config(plain, lambda cfg: cfg.update(rope_parameters={"rope_type": "default", "rope_theta": 50000.0}))
    other_theta = shutil.copytree(scaled, tmp_path / "theta")
    edit_config(other_theta, lambda cfg: cfg["rope_parameters"].update(rope_theta=LLAMA3_ROPE["rope_theta"] * 20))
    prompt = random_prompts([60], seed=5)[0]
    base = augury_logits(scaled, prompt)
    for variant in (plain, other_theta):
        ours = augury_logits(variant, prompt)
        torch.testing.assert_close(ours, hf_logits(hf_model(variant), prompt), atol=1e-4, rtol=1e-4)
        assert (ours - base).abs().max() > 1e-2, f"{variant.name}: rope settings made no difference"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_and_mlp_bias_checkpoints(family, tmp_path, hf_model, make_llm) -> None:
    from transformers import AutoModelForCausalLM

    from conftest import _hf_config, _randomize

    cfg = _hf_config(family)
    cfg.attention_bias = True
    cfg.mlp_bias = family == "llama"
    model = AutoModelForCausalLM.from_config(cfg).float()
    _randomize(model, 7)
    model.save_pretrained(str(tmp_path))
    assert_greedy_parity(make_llm(tmp_path), hf_model(tmp_path), random_prompts([1, 8], seed=7))
