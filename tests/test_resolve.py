"""Model names resolved once, at the entry points (augury/resolve.py): a .gguf file given as the
model is converted once into the cache and runs like its Hugging Face conversion; "demo" means
its folder and the shipped head; and the layers import only downwards."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import gguf
import pytest

from augury import resolve as res
from augury.config import EngineConfig, ResolvedModel
from augury.sampling_params import SamplingParams
from test_gguf import _tiny_model, _write_gguf

SRC = Path(__file__).resolve().parents[1] / "src" / "augury"
PROMPTS = [[5, 70, 256, 257, 33], [100, 259, 12, 200, 44, 9, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AUGURY_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "files" / "Tiny-Llama.Q8_0.gguf"
    path.parent.mkdir()
    _write_gguf(_tiny_model(tied=False), path, gguf.GGMLQuantizationType.Q8_0)
    return path


def _count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    from augury.models import gguf as gguf_convert

    calls: list[Path] = []
    real = gguf_convert.convert_gguf_to_hf

    def counting(path, out, *args, **kwargs):
        calls.append(Path(path))
        return real(path, out, *args, **kwargs)

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", counting)
    return calls


def test_gguf_file_runs_like_its_hf_conversion(tiny_gguf: Path, tmp_path: Path, make_llm,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from augury.models.gguf import convert_gguf_to_hf

    reference = make_llm(convert_gguf_to_hf(tiny_gguf, tmp_path / "hf"))
    calls = _count_conversions(monkeypatch)
    llm = make_llm(tiny_gguf)
    assert len(calls) == 1
    folder = llm.resolved.target_dir
    assert folder == res.gguf_cache_dir(tiny_gguf) and folder.parent == tmp_path / "cache" / "gguf"
    assert llm.resolved.draft_dir is None and llm.engine.speculator is None
    want = [o.token_ids for o in reference.generate(PROMPTS, GREEDY, use_tqdm=False)]
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want and all(len(t) == 8 for t in got)

    # a second LLM on the same file reuses the conversion
    again = make_llm(str(tiny_gguf), speculative_algorithm="ngram")
    assert len(calls) == 1 and again.resolved.target_dir == folder
    assert [o.token_ids for o in again.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    assert sorted(p.name for p in folder.parent.iterdir()) == [".lock", folder.name]


def test_changed_gguf_file_is_converted_again(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_conversions(monkeypatch)
    first = res.resolve(EngineConfig(model=str(tiny_gguf))).target_dir
    assert res.resolve(EngineConfig(model=str(tiny_gguf))).target_dir == first and len(calls) == 1
    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "edited" a second later
    second = res.resolve(EngineConfig(model=str(tiny_gguf))).target_dir
    assert second != first and len(calls) == 2
    assert not first.exists()  # the stale conversion of the same file is removed
    assert (second / "config.json").is_file() and (second / res.GGUF_MARKER).is_file()


def test_interrupted_conversion_leaves_nothing_half_made(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from augury.models import gguf as gguf_convert

    def failing(path, out, *args, **kwargs):
        Path(out).mkdir()
        (Path(out) / "config.json").write_text("{}")
        raise ValueError("the disk filled up")

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", failing)
    with pytest.raises(ValueError, match="disk filled up"):
        res.resolve(EngineConfig(model=str(tiny_gguf)))
    cache = res.gguf_cache_dir(tiny_gguf).parent
    assert [p.name for p in cache.iterdir()] == [".lock"]


def test_demo_means_its_folder_and_the_shipped_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from augury import demo
    from augury.heads import demo_head_dir

    monkeypatch.setattr(demo, "ensure_demo_target", lambda: tmp_path / "demo-folder")
    head = demo_head_dir()
    assert res.resolve(EngineConfig()) == ResolvedModel(tmp_path / "demo-folder", head)
    assert res.resolve(EngineConfig(speculative_algorithm="ngram")).draft_dir is None
    assert res.resolve(EngineConfig(speculative_algorithm="none")).draft_dir is None
    assert res.resolve(EngineConfig(draft_model=str(tmp_path))).draft_dir == tmp_path


def test_bad_names_fail_before_anything_is_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from augury import demo

    def no_fetch() -> Path:
        raise AssertionError("nothing may be fetched")

    monkeypatch.setattr(demo, "ensure_demo_target", no_fetch)
    with pytest.raises(ValueError, match="model /no/such/model does not exist"):
        res.check(EngineConfig(model="/no/such/model"))
    with pytest.raises(ValueError, match="draft_model /no/such/head does not exist"):
        res.check(EngineConfig(draft_model="/no/such/head"))
    (tmp_path / "weights.bin").write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="is a file but not a GGUF file"):
        res.check(EngineConfig(model=str(tmp_path / "weights.bin")))
    with pytest.raises(ValueError, match="eagle3 needs an EAGLE-3 head"):
        res.check(EngineConfig(model=str(tmp_path), speculative_algorithm="eagle3"))


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


# what each package may import from augury (besides itself): each arrow points down the house of
# docs/architecture.md; the plain-data modules (config, outputs, sampling_params, sampling, stages)
# sit at the bottom and are open to all
PLAIN = ("config", "outputs", "sampling_params", "sampling", "stages")
ALLOWED = {
    "cpu": (),
    "attention": ("cpu",),
    "models": ("cpu", "attention.base", "attention.sdpa"),  # attention's interface only
    "core": (),
    "structured": (),
    "engine": ("core", "attention", "models", "cpu", "structured"),
    "speculative": ("core", "attention", "models"),
}


def _augury_imports(path: Path) -> set[str]:
    return {n.removeprefix("augury.") for n in _imports(path) if n.startswith("augury.")}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layers_import_only_downwards(package: str) -> None:
    """engine and speculative never import each other; cpu/ imports no model; models import
    attention's interface only; the shared core imports neither engine nor speculation."""
    files = sorted((SRC / package).glob("*.py"))
    assert files
    ok = (package, *ALLOWED[package], *PLAIN)
    for path in files:
        bad = sorted(n for n in _augury_imports(path)
                     if not any(n == a or n.startswith(f"{a}.") for a in ok) and n not in ("cpu", "models", "attention"))
        assert not bad, f"{path.relative_to(SRC)} imports {bad}"


def test_no_two_modules_import_each_other() -> None:
    """No import cycle between augury's modules, lazy imports inside functions included."""
    modules = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
               for p in SRC.rglob("*.py")}
    graph = {m: {n for n in _augury_imports(p) if n in modules and n != m} for m, p in modules.items()}
    for m, deps in graph.items():
        for d in deps:
            if d.startswith(m + ".") or m.startswith(d + "."):
                continue  # a package and its own modules
            assert m not in _reach(graph, d, m), f"augury.{m} and augury.{d} import each other (through a cycle)"


def _reach(graph: dict[str, set[str]], start: str, stop: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for d in graph.get(m, ()):
            if d not in seen and not (d.startswith(m + ".") or m.startswith(d + ".")):
                seen.add(d)
                todo.append(d)
    return seen


def test_no_cpp_outside_the_cpu_package() -> None:
    assert not [p for p in SRC.rglob("*") if p.suffix in (".cpp", ".h", ".cc") and "cpu" not in p.relative_to(SRC).parts]
