"""A GGUF conversion's packed kernel layouts, kept by the first load and read back by later ones
(models/packed_cache.py): the second load packs nothing and gives the first load's modules, tensors
and tokens to the bit; a damaged file is dropped and packed afresh; a changed side file gets a new one."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from test_gguf_kquants import kquant_folder, needs_kernels  # noqa: F401 - the module-scoped fixture

from augury.cpu import kernels as cpu_kernels
from augury.models import packed_cache
from augury.models.checkpoint import TensorWriter
from augury.models.loader import load_target
from augury.models.quant import PACKED_PREFIX

CPU = torch.device("cpu")


@pytest.fixture
def folder(kquant_folder, tmp_path) -> Path:  # noqa: F811
    out = tmp_path / "hf"
    shutil.copytree(kquant_folder, out)
    for f in out.glob(f"{PACKED_PREFIX}*"):  # another test's load of the shared fixture may have kept one
        f.unlink()
    return out


def _load(folder: Path):
    return load_target(folder, torch.bfloat16, CPU, 64, quantization="auto")[0]


def _kept(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{PACKED_PREFIX}*.safetensors"))


def _no_packing(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("packed again")

    for cls, names in ((cpu_kernels.W4A8, ("pack", "pack_k")), (cpu_kernels.W8A8, ("pack", "pack6", "pack_codes"))):
        for name in names:
            if hasattr(cls, name):
                monkeypatch.setattr(cls, name, staticmethod(refuse))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    ma, mb = dict(a.named_modules()), dict(b.named_modules())
    assert list(ma) == list(mb)
    for path, m in ma.items():
        assert type(mb[path]) is type(m), path
    ta = {**dict(a.named_buffers()), **dict(a.named_parameters())}
    tb = {**dict(b.named_buffers()), **dict(b.named_parameters())}
    assert sorted(ta) == sorted(tb)
    for name, t in ta.items():
        if name.endswith("seg_table"):
            continue  # addresses, refilled when the fused table is built
        assert t.dtype == tb[name].dtype and torch.equal(t, tb[name]), name


@needs_kernels
def test_the_second_load_packs_nothing_and_gives_the_first_loads_bits(folder, monkeypatch) -> None:
    first = _load(folder)
    kept = _kept(folder)
    assert len(kept) == 1 and kept[0].stat().st_size > 0
    _no_packing(monkeypatch)
    second = _load(folder)
    assert _kept(folder) == kept
    _same(first, second)


def _mapped_files() -> list[tuple[int, int, str]]:
    out = []
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) >= 6:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[5]))
    return out


@needs_kernels
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_a_later_load_views_the_files_pages_in_place(folder) -> None:
    _load(folder)
    (kept,) = _kept(folder)
    model = _load(folder)
    maps = [(lo, hi) for lo, hi, name in _mapped_files() if name == str(kept)]
    assert maps, "the cache file is not mapped"
    tensors = [t for m in packed_cache._kernel_paths(model).values() for t in m.buffers() if t.numel()]
    assert tensors and all(any(lo <= t.data_ptr() < hi for lo, hi in maps) for t in tensors)
    assert all(t.data_ptr() % packed_cache.ALIGN == 0 for t in tensors)


@needs_kernels
def test_the_same_tokens_through_the_engine(folder) -> None:
    from augury import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run():
        llm = LLM(str(folder), dtype="bfloat16", quantization="auto", max_model_len=64,
                  speculative_algorithm="none", log_stats_interval=0.0)
        out = llm.generate([[1, 17, 33, 250]], params, use_tqdm=False)[0]
        return out.token_ids, [sorted(d.items()) for d in out.logprobs]

    packed = run()
    assert len(_kept(folder)) == 1
    assert run() == packed


@needs_kernels
def test_a_damaged_file_is_dropped_and_packed_afresh(folder, caplog) -> None:
    first = _load(folder)
    (kept,) = _kept(folder)
    size = kept.stat().st_size
    with open(kept, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level("WARNING"):
        second = _load(folder)
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    _same(first, second)
    assert _kept(folder) == [kept] and kept.stat().st_size == size  # written whole again


@needs_kernels
def test_a_changed_side_file_gets_a_new_file_in_place_of_the_old(folder) -> None:
    _load(folder)
    (old,) = _kept(folder)
    side = folder / "augury-int4.safetensors"
    st = side.stat()
    os.utime(side, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert packed_cache.key(folder, torch.bfloat16, CPU) != old.name.removeprefix(PACKED_PREFIX).split(".")[0]
    _load(folder)
    (new,) = _kept(folder)
    assert new != old and not old.exists()


def test_a_module_it_cannot_describe_keeps_nothing(tmp_path) -> None:
    from augury.models.fused import KernelModule

    class Odd(KernelModule, torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("codes", torch.zeros(4, dtype=torch.uint8))
            self.handle = object()  # not plain data

    Odd.__module__ = "augury.models.odd"  # one of augury's, so the attribute is what it cannot describe
    model = torch.nn.Module()
    model.add_module("odd", Odd())
    assert packed_cache.save(model, tmp_path, "k", {}) is None
    assert not list(tmp_path.iterdir())


@needs_kernels
def test_a_module_two_paths_share_is_written_once_and_read_back_as_one(tmp_path) -> None:
    """A tied output layer and embedding over one native linear: the file holds its tensors once, and
    the modules read back share one object again (the same tensors, not copies), with the same bits."""
    import gguf
    from safetensors import safe_open
    from test_gguf_kquants import blocks

    from augury.models import gguf_blocks
    from augury.models.native_embed import NativeOutputLinear, PackedEmbedding, output_layer

    kind, parts = gguf_blocks.decode(blocks(gguf.GGMLQuantizationType.Q6_K, 40, 256, seed=9),
                                     gguf.GGMLQuantizationType.Q6_K)
    head = output_layer(kind, lambda a, b: {k: torch.from_numpy(v[a:b]) for k, v in parts.items()}, 40,
                        torch.bfloat16, CPU)
    assert isinstance(head, NativeOutputLinear)
    model = torch.nn.Module()
    model.embed_tokens = PackedEmbedding(head.inner, 40)
    model.lm_head = head
    path = packed_cache.save(model, tmp_path, "k", {"count": 1})
    with safe_open(str(path), framework="pt") as f:
        names = sorted(k for k in f.keys() if not k.startswith(TensorWriter.PAD))  # the gaps that align tensors
    assert names == sorted(f"embed_tokens.table.{n}" for n, _ in head.inner.named_buffers())
    modules, plan = packed_cache.load(tmp_path, "k")
    assert plan == {"count": 1}
    emb, out = modules["embed_tokens"], modules["lm_head"]
    assert isinstance(out, NativeOutputLinear) and out.inner is emb.table
    ids = torch.tensor([0, 15, 16, 39, 3])
    assert torch.equal(emb(ids).view(torch.int16), model.embed_tokens(ids).view(torch.int16))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(out(x), head(x))


def test_a_save_leaves_another_live_writers_temporary_file_and_removes_a_dead_ones(tmp_path) -> None:
    import subprocess
    import sys

    from augury.models.fused import KernelModule

    class Packed(KernelModule, torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("codes", torch.arange(64, dtype=torch.uint8))

    Packed.__module__ = "augury.models.packed_test"
    model = torch.nn.Module()
    model.add_module("lin", Packed())
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        theirs = tmp_path / f".{PACKED_PREFIX}other.safetensors.{live.pid}.tmp"
        gone = tmp_path / f".{PACKED_PREFIX}other.safetensors.{dead.pid}.tmp"
        theirs.write_bytes(b"being written"), gone.write_bytes(b"cut short")
        assert packed_cache.save(model, tmp_path, "k", {}) is not None
        assert theirs.exists() and not gone.exists()
    finally:
        live.kill()
        live.wait()
