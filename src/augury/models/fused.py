"""The whole layer stack in one C++ call (kernels/forward.cpp), where the model and the step allow.

At batch 1 the demo's decode step spent about as long in Python and ATen's per-operator work
(~12 ms: 30 layers x ~12 operators, each a Python call, a dispatch, an allocation and, for the
kernels, a thread wake-up) as in the arithmetic itself. The fused kernel runs every layer in one
OpenMP region; this module decides when it may and hands it the addresses once.

It runs when the model is a bfloat16 target whose four projections per layer are int4 linears on
the w4a8 kernel (the demo's default), GGUF's native linears (models/native.py: Q4_K on w4a8's
float32 or super-block form, Q8_0 / Q6_K / Q5_* on w8a8's general form) or dense bfloat16 linears on the bf16 kernel (models/dense.py:
quantization="none" on CPUs without native bfloat16 GEMMs), without q/k norms, on the CPU, and the step's attention is
exact rows on augury's attention kernel (decode steps and verified trees; prefill chunks take the
masked path) over a bfloat16 cache, with no gradient wanted. Everywhere else the layer-by-layer
forward runs. Both compute the same bits (tests/test_fused.py), so a step may take either.

The table holds raw addresses, built once; it goes stale when a tensor it points at moves or is
replaced. Every module whose tensors a table may read (the target's layers, norms and kernel
linears) is a `Watched` module: moving or converting one (`_apply`: `.to()`, `.float()`, ...) or
assigning a module, parameter or buffer to it bumps one global counter, and a table built at an
older count is rebuilt before its next run (one integer compared per step, no walk of the
modules). Kernel linears (`KernelModule`: models/quant.py, models/dense.py) hold their tensors in
the layout and dtype their kernel reads, so a floating conversion leaves those tensors as they are
(the module keeps computing exactly what it did; see KernelModule) and only device moves carry them.
"""
from __future__ import annotations

import ctypes

import torch

from augury.cpu import kernels as cpu_kernels
from augury.cpu import threads as cpu_threads

FIELDS = 26  # per layer: the order of kernels/forward.cpp's Field enum (two norms, four projections of 6)
# a projection's kind (forward.cpp's Kind enum): dense bfloat16 panels, int4 on the w4a8 kernel with
# bfloat16 scales, with float32 ones (Q4_K: models/native.py), int8 on w8a8's general form (Q8_0, Q6_K, Q5_*)
DENSE, W4A8 = 0, 1

_epoch = 0  # bumped whenever a Watched module moves, converts or has a module or tensor assigned


def epoch() -> int:
    """The staleness counter: a table built at an older value may hold stale addresses."""
    return _epoch


def stale() -> None:
    """Mark every fused table built so far stale (they are rebuilt on their next forward)."""
    global _epoch
    _epoch += 1


class Watched:
    """Mixin (before nn.Module) for modules whose tensors a fused table may hold: `_apply` (any
    move or conversion) and assigning a module, parameter or buffer mark every table stale. Cheap:
    none of this runs on the decode path."""

    def _apply(self, fn, *args, **kwargs):
        stale()
        return super()._apply(fn, *args, **kwargs)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if isinstance(value, (torch.Tensor, torch.nn.Module)) or name in self.__dict__.get("_modules", ()):
            stale()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        stale()


def _kernel_fn(fn, module, devices: tuple[str, ...] | None):
    """`fn` (an `_apply` conversion) as it applies to a kernel module's tensors: a conversion that
    changes a tensor's dtype leaves the tensor as it is (moving it only if `fn` also moves it);
    anything else (device moves, to_empty, share_memory) applies as usual. `devices`: the device
    types the module's packed layout serves (None: any); a move elsewhere is a ValueError."""
    def apply(t: torch.Tensor) -> torch.Tensor:
        probe = fn(t.new_empty(0))  # what fn does to a tensor of t's dtype and device
        if devices is not None and probe.device.type != t.device.type and probe.device.type not in devices:
            raise ValueError(f"{type(module).__name__} holds weights packed for a kernel that runs on "
                             f"{' or '.join(devices)}, not {probe.device.type}: build it on that device instead")
        if probe.dtype == t.dtype:
            return fn(t)
        return t if probe.device == t.device else t.to(probe.device)

    return apply


class KernelModule(Watched):
    """Mixin (before nn.Module) for linears that hold a kernel's packed weights, scales and bias in
    the dtypes that kernel reads, and compute in their own `dtype` whatever the input's.

    `.to(dtype)` / `.float()` / `.half()` leave those tensors (and `dtype`) as they are; device
    moves carry them (to the device types in `kernel_devices`, where a packed layout only serves
    some). Converting them instead would feed the kernel, and a fused table built on their
    addresses, bytes of another dtype (silent garbage), and no single `dtype` change serves every
    kernel (the w4a8, w8a8 and bf16 kernels run bfloat16 only). So a converted model keeps its
    quantised layers' numbers exactly; its other tensors (embedding, norms) convert as usual."""

    kernel_devices: tuple[str, ...] | None = None

    def _apply(self, fn, *args, **kwargs):
        return super()._apply(_kernel_fn(fn, self, self.kernel_devices), *args, **kwargs)

    def fused_fields(self) -> list[int] | None:
        """The fused kernel's four fields for this linear as a layer projection, or None."""
        return None


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def linear_fields(lin) -> list[int] | None:
    """The kernel's six fields for one projection, (kind, codes, scale, zero, sub-scales, bias), from
    each kernel module's `fused_fields`: four of them, (codes, scale, zero, bias) of a w4a8 int4 linear
    in bfloat16 or (panels, 0, 0, bias) of a dense bfloat16 one on the bf16 kernel, or all six (the
    native GGUF linears, models/native.py); else None."""
    fields = getattr(lin, "fused_fields", None)
    f = fields() if callable(fields) else None
    if f is None or len(f) == 6:
        return f
    return [DENSE if f[1] == 0 else W4A8, f[0], f[1], f[2], 0, f[3]]


_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
_tp_entries: dict[str, object] = {}


def _tp_entry(kernel: cpu_kernels.Forward):
    """forward.cpp's tensor-parallel entry (augury_forward_tp) in the library `kernel` loaded, or None."""
    key = str(kernel.path)
    if key not in _tp_entries:
        try:
            fn = getattr(ctypes.CDLL(key), "augury_forward_tp")
            fn.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _P, _P, _P, _I64, _P, _P, _P,
                           _I64, _P, _P, _P, _I64, _P, _P, _I64, _P, _P, _I32, _P, _I64, _I64, _P, _I64, _I64, _I64, _P,
                           _I64]
            fn.restype = _I32
        except (OSError, AttributeError):
            fn = None
        _tp_entries[key] = fn
    return _tp_entries[key]


class FusedStack:
    """A TargetModel's layer stack as the fused kernel's pointer table (built once; holds the model).

    Under tensor parallelism (`model.tp`) a rank's table holds its own heads and MLP columns, and the
    row-parallel biases (added after the sum over ranks); `run` then takes forward.cpp's tensor-parallel
    entry: where the ranks share one machine, the whole stack in one call summing through shared
    memory (`Collectives.shared_exchange`); elsewhere one call per half-layer with the group's
    all-reduce between them."""

    def __init__(self, model, kernel: cpu_kernels.Forward, table: torch.Tensor, held: list[torch.Tensor]) -> None:
        cfg = model.cfg
        self.model, self.kernel, self.table = model, kernel, table
        self.tp = getattr(model, "tp", None)  # the rank's group under tensor parallelism
        self.tp_fn = _tp_entry(kernel) if self.tp is not None else None
        self.epoch = epoch()  # stale once the counter moves on (see Watched)
        self.held = held  # the tensors whose addresses the table holds, kept alive with it
        self.h, self.nh, self.nkv, self.hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.inter, self.layers, self.eps = cfg.intermediate_size, cfg.num_layers, float(cfg.rms_norm_eps)

    @staticmethod
    def build(model) -> "FusedStack | None":
        """The plan for `model`, or None where the fused kernel cannot take it."""
        cfg = model.cfg
        if cfg.qk_norm or model.norm.weight.device.type != "cpu" or model.quantization not in ("int4", "none"):
            return None
        # the kernel's shape limits (kernels/forward.cpp): widths in whole groups of 32, heads of 8..512
        if any(x % 32 for x in (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)) \
                or cfg.head_dim % 8 or cfg.head_dim > 512 or cfg.num_heads % cfg.num_kv_heads:
            return None
        sharded = getattr(model, "tp", None) is not None
        rows, held = [], []
        for layer in model.layers:
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != torch.bfloat16 or not w.is_contiguous() for w in norms):
                return None
            # a rank's row-parallel biases live beside its projections (added once, after the sum)
            after_sum = (layer.self_attn.o_bias, layer.mlp.down_bias) if sharded else (None, None)
            if any(b is not None and (b.dtype != torch.bfloat16 or not b.is_contiguous()) for b in after_sum):
                return None
            fields = [norms[0].data_ptr()]
            for i, lin in enumerate((layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                     layer.mlp.down_proj)):
                f = linear_fields(lin)
                if f is None:
                    return None
                if i in (1, 3) and after_sum[i // 2] is not None:
                    f = [*f[:5], after_sum[i // 2].data_ptr()]
                    held.append(after_sum[i // 2])
                fields += f
                if i == 1:
                    fields.append(norms[1].data_ptr())
            rows.append(fields)
            held += [*norms, *(t for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                            layer.mlp.down_proj) for t in lin.buffers() if t is not None)]
        if model.norm.weight.dtype != torch.bfloat16:
            return None
        kernel = cpu_kernels.forward()
        if kernel is None or kernel.nfields != FIELDS or sharded and _tp_entry(kernel) is None:
            return None
        held += [lin.bias for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        return FusedStack(model, kernel, torch.tensor(rows, dtype=torch.int64).contiguous(), held)

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, aux_layers: tuple[int, ...],
            aux_into: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """h [B, Q, H] float32 (the embedded tokens; updated in place); cos / sin [B, Q, 1, hd]
        bfloat16. Returns (final-norm hidden [B, Q, H] bfloat16, aux [B, Q, n*H] or None), or None
        when this step's attention is not one the kernel takes (the caller runs the layers). With
        aux_into (rows [R, n*H] bfloat16, contiguous; index [B*Q] int64) token t's features go to
        rows[index[t]] instead, and aux comes back None (see LlamaModel.forward)."""
        table = attn.fused_rows()
        b, q, hid = h.shape
        if table is None or torch.is_grad_enabled() and h.requires_grad:
            return None
        k_cache, v_cache, slot_mapping, slots, nkeys = table
        if k_cache.dtype != torch.bfloat16 or cos.dtype != torch.bfloat16 or slot_mapping.shape[0] != b * q:
            return None
        h = h.contiguous()
        cos, sin = cos.reshape(b * q, -1).contiguous(), sin.reshape(b * q, -1).contiguous()
        aux = torch.tensor(aux_layers, dtype=torch.int32)
        if aux_into is not None and aux_layers:
            aux_out, index = aux_into
            if aux_out.dtype != torch.bfloat16 or aux_out.shape[-1] != len(aux_layers) * hid \
                    or not aux_out.is_contiguous() or index.dtype != torch.int64 or index.numel() != b * q:
                raise ValueError("aux_into: rows [R, n*H] bfloat16 (contiguous) and an int64 index per token")
            index, cap = index.contiguous(), aux_out.shape[0]
        else:
            aux_out = torch.empty(b, q, len(aux_layers) * hid, dtype=torch.bfloat16) if aux_layers else None
            index, cap = None, 0
        out = torch.empty(b, q, hid, dtype=torch.bfloat16)
        args = (h.data_ptr(), b * q, hid, self.nh, self.nkv, self.hd, self.inter, self.layers, self.eps,
                self.table.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache[0].numel(),
                slot_mapping.data_ptr(), slots.data_ptr(), nkeys.data_ptr(), slots.shape[1],
                cos.data_ptr(), sin.data_ptr(), aux.data_ptr(), len(aux_layers), _addr(aux_out), _addr(index), cap,
                self.model.norm.weight.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if self.tp is not None:
            rc = self._run_sharded(args, b * q * hid)
        elif getattr(attn, "timed", True):  # the thread count by measurement (cpu/threads.py): same bits with any
            rc = cpu_threads.choice().timed(b * q, lambda n: self.kernel.run(*args[:-1], n))
        else:  # a prompt's rows (attention/paged.py's PREFILL_ROWS_MAX): the count settled nearby, untimed
            rc = self.kernel.run(*args[:-1], cpu_threads.settled(b * q))
        if rc:
            raise RuntimeError(f"the fused forward kernel failed (code {rc}: "
                               f"{'bad shapes or key counts' if rc == 1 else 'out of memory'})")
        return out, (None if index is not None else aux_out)

    def _run_sharded(self, args: tuple, n: int) -> int:
        """One rank's stack: in one call through the shared-memory exchange where it carries n floats,
        else a call per half-layer (2L + 1 in all) with the group's all-reduce of each partial between."""
        steps = 2 * self.layers + 1
        ex = self.tp.shared_exchange()
        if ex is not None and n <= ex.cap:
            rc = self.tp_fn(*args, None, 0, steps, ex.address, ex.rank, ex.size, ex.cap, ex.counter.data_ptr(),
                            ex.timeout_ms)
            if rc == 3:
                raise self.tp.failed("shared-memory exchange")
            return rc
        part = torch.empty(n, dtype=torch.float32)
        for s in range(steps):
            rc = self.tp_fn(*args, part.data_ptr(), s, s + 1, None, 0, 1, 0, None, 0)
            if rc:
                return rc
            if s < steps - 1:
                self.tp.all_reduce_(part)
        return 0
