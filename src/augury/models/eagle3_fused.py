"""An EAGLE-3 head on augury's CPU kernels: one call (cpu/csrc/head.cpp) per draft level or catch-up
chunk, for every request's rows at once, instead of ~40 torch operators per level.

The call computes what Eagle3Head.forward, .logits, log_softmax and topk compute, on the same row
functions the target's fused stack uses (its linears in their own formats: int4 on w4a8, the draft
vocabulary's output layer int8 on w8a8 where quantize_head put it there, dense bfloat16 panels), with
a float32 residual stream (the torch head's is bfloat16: tests/test_head_kernels.py bounds the
difference), attention over each row's own slot list in the head's cache (draft-tree keys in a
scratch region of it), and the k best draft ids with their log-softmax values per row without a
float row going back to Python. Each row's numbers are the same bits at every ISA level, thread count
and batch.

It runs when the head is a bfloat16 head on the CPU whose linears all have kernel fields (the
quantised modes, or dense bfloat16 panels), its norms and the embedding bfloat16, and the head kernel
builds; everywhere else the torch head runs (AUGURY_CPU_KERNELS=0 forces that: the reference path).
"""
from __future__ import annotations

import numpy as np
import torch

from augury.cpu import kernels as cpu_kernels
from augury.cpu import threads as cpu_threads
from augury.models.fused import DENSE, epoch, linear_fields
from augury.models.native_embed import PackedEmbedding
from augury.models.quant import W8A8OutputLinear

NFIELDS = 40  # csrc/head.cpp's HeadField order
FUSED_W8G = 3  # forward.cpp's W8G kind: W8A8OutputLinear's panels are its general form without sub-scales


def _fields(lin) -> list[int] | None:
    """(kind, C, S, Z, X, bias) of one of the head's linears for the kernel, or None."""
    if isinstance(lin, W8A8OutputLinear):
        return [FUSED_W8G, lin.codes.data_ptr(), lin.scale.data_ptr(), 0, 0, 0]
    return linear_fields(lin)


def _columns(lin) -> int:
    """The output columns the kernel computes for `lin`: every column its panels hold (16 a panel on
    the quantised kernels, 8 on the dense one)."""
    panel = 8 if _fields(lin)[0] == DENSE else 16
    return -(-lin.out_features // panel) * panel


class FusedHead:
    """An Eagle3Head as the head kernel's pointer table (rebuilt when a tensor it points at moves)."""

    def __init__(self, head, kernel: cpu_kernels.HeadKernel) -> None:
        cfg = head.cfg
        self.head, self.kernel = head, kernel
        self.h, self.nh, self.nkv, self.hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.inter, self.eps, self.vd = cfg.intermediate_size, float(cfg.rms_norm_eps), cfg.draft_vocab_size
        self.aux_width = head.fc.in_features
        self.lm_columns = _columns(head.lm_head)
        # [L, hd]: the torch head's cos[positions].to(bfloat16), as the bits of numpy rows (indexed a call)
        self.cos = head.rotary.cos.to(torch.bfloat16).view(torch.int16).numpy()
        self.sin = head.rotary.sin.to(torch.bfloat16).view(torch.int16).numpy()
        self._rows = np.arange(0, dtype=np.int64)  # 0 .. t - 1, the packed embedding's rows (_rows_at)
        self.table, self.epoch, self.held = self._table()

    @staticmethod
    def build(head) -> "FusedHead | None":
        """The plan for `head`, or None where the kernel cannot take it."""
        cfg = head.cfg
        if head.device.type != "cpu" or head.dtype != torch.bfloat16:
            return None
        if any(x % 32 for x in (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size,
                                head.fc.in_features)) or cfg.head_dim % 8 or cfg.head_dim > 512 \
                or cfg.num_heads % cfg.num_kv_heads:
            return None
        emb = head.embed  # a packed one (models/native_embed.py) hands the kernel the rows looked up
        if not isinstance(emb, PackedEmbedding) and (emb.weight.dtype != torch.bfloat16 or not emb.weight.is_contiguous()
                                                     or emb.weight.device.type != "cpu"):
            return None
        if any(_fields(lin) is None for lin in _linears(head)) or _columns(head.lm_head) % 16:
            return None  # the kernel's logit rows are whole panels of 16
        if any(n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() for n in _norms(head)):
            return None
        kernel = cpu_kernels.head()
        if kernel is None or kernel.nfields != NFIELDS:
            return None
        return FusedHead(head, kernel)

    def _table(self) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        head = self.head
        fc, qkv, o, gu, dn, lm = _linears(head)
        ln_in, hnorm, ln2, norm = _norms(head)
        row = [*_fields(fc), ln_in.weight.data_ptr(), hnorm.weight.data_ptr(), *_fields(qkv), *_fields(o),
               ln2.weight.data_ptr(), *_fields(gu), *_fields(dn), norm.weight.data_ptr(), *_fields(lm)]
        # what the addresses belong to: the modules and norm weights (compared on each call), their tensors
        held = [*_held_now(head), *(t for lin in _linears(head) for t in lin.buffers())]
        return torch.tensor(row, dtype=torch.int64), epoch(), held

    def _rows_at(self, t: int) -> np.ndarray:
        """0 .. t - 1 (int64): the rows of a call's looked-up embedding table, one array for every call."""
        if len(self._rows) < t:
            self._rows = np.arange(max(t, 2 * len(self._rows)), dtype=np.int64)
        return self._rows[:t]

    def _current(self) -> torch.Tensor:
        """The table, rebuilt where a module moved or converted (models/fused.py's counter) or one of the
        head's linears, norms or norm weights was replaced."""
        if self.epoch != epoch() or any(a is not b for a, b in zip(self.held, _held_now(self.head))):
            self.table, self.epoch, self.held = self._table()
        return self.table

    def run(self, cache_k: torch.Tensor, cache_v: torch.Tensor, tokens: np.ndarray, positions: np.ndarray,
            slot_mapping: np.ndarray, slots: np.ndarray, nkeys: np.ndarray, logit_rows: np.ndarray, k: int,
            h: torch.Tensor | None = None, aux: torch.Tensor | None = None, threads: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One call over T rows: tokens, positions, slot_mapping [T] int64; slots [T, W] int64 and nkeys [T]
        int32 (row t attends to slots[t, :nkeys[t]], its own slot last); h [T, H] float32 (the head's
        input state) or aux [T, A] bfloat16 (the target's features: h = fc(aux)); cache_k / cache_v
        [S, nkv, hd] bfloat16; threads: default cpu/threads.py's choice (the bits do not depend on it).
        Returns (the pre-norm outputs [T, H] float32, the top k draft ids [R, k] int64 and their
        log-probabilities [R, k] float32 for the rows logit_rows [R])."""
        t = len(tokens)
        # (each conversion below is skipped where the argument is already as the kernel reads it: a draft
        # level's call is ~0.2 ms of kernel on the demo, and its Python was ~80 us of ~20 small calls)
        if aux is not None:
            if aux.dtype != torch.bfloat16 or not aux.is_contiguous():
                aux = aux.to(torch.bfloat16).contiguous()
            h = torch.empty(t, self.h, dtype=torch.float32)
        elif h.dtype != torch.float32 or not h.is_contiguous():
            h = h.to(torch.float32).contiguous()
        positions = _int64(positions)
        cos, sin = self.cos[positions], self.sin[positions]  # numpy rows of the bfloat16 tables' bits
        slot_mapping, slots, rows = _int64(slot_mapping), _int64(slots), _int64(logit_rows)
        nkeys = np.ascontiguousarray(nkeys, dtype=np.int32)
        r = len(rows)
        ids = torch.empty(r, k, dtype=torch.int64)
        lp = torch.empty(r, k, dtype=torch.float32)
        if cache_k.dtype != torch.bfloat16 or cache_v.dtype != torch.bfloat16 or not cache_k.is_contiguous() \
                or not cache_v.is_contiguous():
            raise ValueError("the head kernel reads a contiguous bfloat16 cache")
        emb = self.head._modules["embed"]
        if isinstance(emb, PackedEmbedding):  # the tokens' rows alone as the table: no dense copy of it
            emb, tokens = emb.lookup(tokens.tolist()).contiguous(), self._rows_at(t)
        else:
            emb, tokens = emb.weight, _int64(tokens)
        rc = self.kernel.run(
            self._current().data_ptr(), t, self.h, self.aux_width if aux is not None else 0, self.nh, self.nkv,
            self.hd, self.inter, self.eps, None if aux is None else aux.data_ptr(), h.data_ptr(), tokens.ctypes.data,
            emb.data_ptr(), emb.shape[0], cache_k.data_ptr(), cache_v.data_ptr(), cache_k.shape[0],
            slot_mapping.ctypes.data, slots.ctypes.data, nkeys.ctypes.data, slots.shape[1] if slots.ndim == 2 else 1,
            cos.ctypes.data, sin.ctypes.data, rows.ctypes.data, r, self.lm_columns, self.vd, k, ids.data_ptr(),
            lp.data_ptr(), threads or cpu_threads.current())
        if rc:
            raise RuntimeError(f"the head kernel failed (code {rc}: "
                               f"{'bad shapes, ids or slots' if rc == 1 else 'out of memory'})")
        return h, ids, lp


def _int64(a: np.ndarray) -> np.ndarray:
    """a as a C-contiguous int64 array (itself where it is one)."""
    return a if a.dtype == np.int64 and a.flags.c_contiguous else np.ascontiguousarray(a, dtype=np.int64)


def _held_now(head) -> tuple:
    """_current's check: what _table holds of the head, its linears, norms and norm weights."""
    norms = _norms(head)
    return (*_linears(head), *norms, *(n._parameters["weight"] for n in norms))


# the head's parts read from the modules' own dicts, as nn.Module's attribute lookup finds them (that
# lookup, a Python function, took ~20 us of a ~0.3 ms call for the fourteen _current compares)
def _linears(head) -> tuple:
    m = head._modules
    mlp = m["mlp"]._modules
    return m["fc"], m["qkv_proj"], m["o_proj"], mlp["gate_up_proj"], mlp["down_proj"], m["lm_head"]


def _norms(head) -> tuple:
    m = head._modules
    return m["input_layernorm"], m["hidden_norm"], m["post_attention_layernorm"], m["norm"]
