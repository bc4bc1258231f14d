"""The kernels' packed layouts of a GGUF conversion's native linears, kept beside the conversion.

Packing each linear for its kernel (cpu/kernels.py: panels of 16 columns, nibbles and scales
regrouped) took most of a start: on a Llama-3.2-1B-shaped Q4_K_M file (128k vocabulary, 2 threads),
8.4 of an 11.4 s load. The first load of a conversion writes every kernel module it built (their
tensors as the kernels read them, the few plain attributes that describe them, and the load plan's
bookkeeping) to `augury-packed-<key>.safetensors` in the conversion's folder, each tensor at a 64-byte
boundary; a later load with the same key maps the file copy-on-write and takes each tensor as a view
of its pages (`_Mapped`), reading nothing it does not touch, and builds nothing (the pages are the page
cache's, shared by every process that maps the file, as llama.cpp maps its GGUF; the weights are never
written, so no page is copied). The key covers what decides the layouts: the side file (size and
modification time), the dtype, the device, which of augury's kernels load here, and the bytes of the
code that packs (this module's PACKING_SOURCES), so a changed packing never reads an old file. A
module two paths share (a tied model's output layer and embedding hold one vocabulary matrix) is
written once and read back as one object. A file that cannot be read back in full (truncated, another
format) is removed and the load packs afresh: the model is put together only once every module was
read. Not under tensor parallelism (each rank packs its own part) and on the CPU only.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import mmap
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from augury.models.checkpoint import TensorFile, TensorWriter
from augury.models.fused import KernelModule
from augury.models.quant import INT4_FILE, INT4_INDEX, PACKED_PREFIX as PREFIX

log = logging.getLogger(__name__)

FORMAT = "augury-packed-v1"
ALIGN = 64  # each tensor's bytes in the file start at a multiple of this (a cache line): mapped in place
# the modules whose code decides a packed layout: any change to them makes a new key
PACKING_SOURCES = ("models/native.py", "models/native_load.py", "models/native_embed.py", "models/quant.py",
                   "models/dense.py", "models/fused.py", "models/packed_cache.py", "cpu/kernels.py")
_ROOT = Path(__file__).resolve().parent.parent  # the augury package
_PLAIN = (bool, int, float, str, type(None))
_MODULE_LIST = f"{nn.ModuleList.__module__}:{nn.ModuleList.__qualname__}"  # SegmentedLinear's parts


class Unsupported(ValueError):
    """A module this cache cannot describe (an attribute that is not plain data)."""


def key(folder: Path, dtype: torch.dtype, device: torch.device) -> str:
    """What decides the packed layouts of `folder`'s native linears here, hashed."""
    from augury.cpu import kernels

    h = hashlib.sha256(FORMAT.encode())
    for name in (INT4_FILE, INT4_INDEX):
        st = (folder / name).stat()
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(f"{dtype};{device.type};w4a8={kernels.w4a8() is not None};w8a8={kernels.w8a8() is not None};".encode())
    for rel in PACKING_SOURCES:
        path = _ROOT / rel
        h.update(rel.encode() + (path.read_bytes() if path.is_file() else b"absent"))
    return h.hexdigest()[:16]


def path_for(folder: Path, k: str) -> Path:
    return folder / f"{PREFIX}{k}.safetensors"


def _attr(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return {"tuple" if isinstance(value, tuple) else "list": list(value)}
    raise Unsupported(f"attribute of type {type(value).__name__}")


def _value(desc: Any) -> Any:
    if not isinstance(desc, dict):
        return desc
    if "dtype" in desc:
        dt = getattr(torch, desc["dtype"])
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"not a dtype: {desc['dtype']!r}")
        return dt
    if "device" in desc:
        return torch.device(desc["device"])
    return tuple(desc["tuple"]) if "tuple" in desc else list(desc["list"])


def _describe(module: nn.Module, prefix: str, tensors: dict[str, torch.Tensor], seen: dict[int, str]) -> dict[str, Any]:
    """module as plain data (its class, attributes, tensor slots, children), its tensors put in `tensors`;
    a module met before (`seen`: id -> the path it was first written at; a tied model's output layer and
    embedding share one) as {"same_as": that path}, its tensors written once."""
    if id(module) in seen:
        return {"same_as": seen[id(module)]}
    seen[id(module)] = prefix.removesuffix(".")
    cls = type(module)
    if not cls.__module__.startswith("augury.") and cls is not nn.ModuleList:
        raise Unsupported(f"{cls.__module__}.{cls.__qualname__} is not augury's")
    attrs = {}
    for name, value in vars(module).items():
        if not name.startswith("_") and name != "training":
            attrs[name] = _attr(value)
    slots: dict[str, dict[str, bool]] = {"buffers": {}, "params": {}}
    for kind, table in (("buffers", module._buffers), ("params", module._parameters)):
        for name, t in table.items():
            slots[kind][name] = t is not None
            if t is not None:
                if t.device.type != "cpu":
                    raise Unsupported(f"a tensor on {t.device}")
                tensors[f"{prefix}{name}"] = t.detach()
    children = {name: _describe(child, f"{prefix}{name}.", tensors, seen) for name, child in module._modules.items()
                if child is not None}
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "attrs": attrs, **slots, "children": children}


def _rebuild(desc: dict[str, Any], prefix: str, f: TensorFile, built: dict[str, nn.Module]) -> nn.Module:
    """_describe's inverse; `built`: path -> each module rebuilt so far, for the "same_as" ones."""
    if "same_as" in desc:
        if desc["same_as"] not in built:
            raise ValueError(f"{prefix.removesuffix('.')} is the same module as {desc['same_as']!r}, not read yet")
        return built[desc["same_as"]]
    mod_name, _, qualname = desc["class"].partition(":")
    if not mod_name.startswith("augury.models.") and desc["class"] != _MODULE_LIST:
        raise ValueError(f"class {desc['class']!r} is not one of augury's models")
    cls = getattr(importlib.import_module(mod_name), qualname)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{desc['class']!r} is not a module")
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    built[prefix.removesuffix(".")] = module
    for name, value in desc["attrs"].items():
        object.__setattr__(module, name, _value(value))
    for name, present in desc["buffers"].items():
        module.register_buffer(name, f.get_tensor(prefix + name) if present else None)
    for name, present in desc["params"].items():
        module.register_parameter(name, nn.Parameter(f.get_tensor(prefix + name), requires_grad=False) if present else None)
    for name, child in desc["children"].items():
        module.add_module(name, _rebuild(child, f"{prefix}{name}.", f, built))
    return module


class _Mapped(TensorFile):
    """The cache file mapped copy-on-write: each tensor a view of the file's pages where it starts ALIGN-
    aligned (every one this module writes), a copy otherwise. The weights are never written, so their
    pages stay the page cache's, shared with every process that maps the file, and a start reads nothing
    it does not touch (as llama.cpp maps its GGUF); the map lives as long as a tensor views it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            self._map = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            self._map = None

    def get_tensor(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        dtype, shape, begin, end = self._entries[name]
        at = self._start + begin
        if self._map is None or rows is not None or end == begin or at % ALIGN or end + self._start > len(self._map):
            return super().get_tensor(name, rows)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=at).view(dtype).reshape(shape)


def _kernel_paths(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost kernel modules of `model` by path (what the GGUF load built), a module shared by two
    paths (a tied output layer's) under each."""
    out: dict[str, nn.Module] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, KernelModule) and not any(path.startswith(p + ".") for p in out):
            out[path] = module
    return out


def save(model: nn.Module, folder: Path, k: str, plan: dict[str, Any]) -> Path | None:
    """Writes `model`'s kernel modules and the load's `plan` (plain data) to the cache file of key k.
    Returns its path, or None where the cache cannot hold them (said at debug level) or the folder is
    not writable (a warning: the next start packs again)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    try:
        modules = {path: _describe(m, f"{path}.", tensors, seen) for path, m in _kernel_paths(model).items()}
    except Unsupported as e:
        log.debug("packed layouts not cached: %s", e)
        return None
    if not modules:
        return None
    target = path_for(folder, k)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    meta = {"format": FORMAT, "modules": json.dumps(modules), "plan": json.dumps(plan)}
    try:
        writer = TensorWriter(tmp, list(tensors), meta, align=ALIGN)
        try:
            for name, t in tensors.items():
                writer.add(name, t)
            writer.close()
        except BaseException:
            writer.abandon()
            raise
        os.replace(tmp, target)
        # earlier keys (another code version or dtype) and what a start cut short left: a temporary file
        # whose writer is gone (another process's, still writing, is left alone: two workers of a bench
        # load one model at once)
        for old in [*folder.glob(f"{PREFIX}*.safetensors"), *filter(_orphaned, folder.glob(f".{PREFIX}*.tmp"))]:
            if old != target:
                old.unlink(missing_ok=True)
    except Exception as e:  # noqa: BLE001 - the cache never fails a load: the next start packs again
        tmp.unlink(missing_ok=True)
        log.warning("could not keep the packed layouts in %s (%s: %s): the next start packs them again", folder,
                    type(e).__name__, e)
        return None
    return target


def _orphaned(tmp: Path) -> bool:
    """Whether the process that writes temporary file `tmp` (its pid before `.tmp`) is gone."""
    try:
        pid = int(tmp.name.rsplit(".", 2)[-2])
    except ValueError:
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, another user's
        return False
    return False


def load(folder: Path, k: str) -> tuple[dict[str, nn.Module], dict[str, Any]] | None:
    """(path -> module, the saved plan) from the cache file of key k, or None where there is none. A
    file that cannot be read back whole is removed (with a warning) and None returned."""
    target = path_for(folder, k)
    if not target.is_file():
        return None
    try:
        with _Mapped(target) as f:
            meta = f.metadata
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            built: dict[str, nn.Module] = {}
            modules = {path: _rebuild(desc, f"{path}.", f, built) for path, desc in json.loads(meta["modules"]).items()}
            plan = json.loads(meta["plan"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        log.warning("packed layouts in %s unreadable (%s: %s): packing afresh", target, type(e).__name__, e)
        target.unlink(missing_ok=True)
        return None
    return modules, plan


def plan_state(model: nn.Module, plan) -> dict[str, Any]:
    """native_load's plan after finish() as plain data: the linears finish() built count as covered
    (their checkpoint names are not read again; a tied output layer's name is the embedding's, which
    stays to be read), those it left dense stay left."""
    built = _kernel_paths(model)
    covered = set(plan.covered)
    for path, names in plan.left.items():
        if path in built:
            covered.update(n for n in names if n != "model.embed_tokens.weight")
    return {"sources": plan.sources, "covered": sorted(covered), "tried": sorted(plan.tried), "count": plan.count,
            "left": {p: list(n) for p, n in plan.left.items() if p not in built}}


def restore(model: nn.Module, modules: dict[str, nn.Module], state: dict[str, Any]):
    """Puts load()'s modules in `model` (on the meta device elsewhere) and returns native_load's plan
    as plan_state() saved it, for the loader to go on as after swap_in."""
    from augury.models.native_load import NativePlan

    for path, module in modules.items():
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)
    return NativePlan(dict(state["sources"]), set(state["covered"]),
                      {p: tuple(n) for p, n in state["left"].items()}, set(state["tried"]), int(state["count"]))
