"""The mixture-of-experts layer over experts held as GGUF blocks (``moe_reference.fused_moe``'s definition, with
each expert's gate, up and down weights in their quantized blocks, as llama.cpp stores ``ffn_*_exps``).

The (token, slot) pairs are sorted by expert once and their rows gathered; then, per expert with tokens, the
GGUF GEMM (``gguf.linear``: the native CPU kernel, Triton on CUDA, the torch reference elsewhere) multiplies
its contiguous run of rows by its gate and up blocks into the two halves of one gate|up buffer, and by its
down blocks after the activation. The routing weights and the scatter-add are one pass each over all pairs.
The types may differ between the three projections (a Q4_K_M file keeps down in Q6_K on some layers).

A decode step's few rows (up to the native GGUF GEMM's row limit) with SiLU experts go to one native call
instead (csrc/moe_cpu.c, ``kvpilot_moe_gguf_packed``): the same GEMMs, sort and sums without a Python loop,
which the native decode loop also calls.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from . import cpu_native, gguf, gguf_reference
from .moe import ExpertRuns
from .moe_reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, activation, check_expert_ids

__all__ = ["GGUFExperts", "fused_moe_gguf", "native_args", "native_available"]


@dataclass(frozen=True)
class GGUFExperts:
    """One layer's experts as GGUF blocks: ``gate``/``up`` ``[E, I, row_bytes(H)]`` and ``down``
    ``[E, H, row_bytes(I)]`` uint8, each with its GGML type."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_type: int
    up_type: int
    down_type: int
    hidden: int
    inter: int

    def check(self) -> None:
        """ValueError naming the projection whose blocks do not fit ``[E, rows, row_bytes]``."""
        e = self.gate.shape[0]
        for name, t, qtype, rows, cols in (("gate", self.gate, self.gate_type, self.inter, self.hidden),
                                           ("up", self.up, self.up_type, self.inter, self.hidden),
                                           ("down", self.down, self.down_type, self.hidden, self.inter)):
            if qtype not in gguf.GGUF_TYPES:
                raise ValueError(f"{name} experts: GGML type {qtype} is not one the GGUF GEMM takes")
            want = (e, rows, gguf.row_bytes(qtype, cols))
            if t.dtype != torch.uint8 or tuple(t.shape) != want:
                raise ValueError(f"{name} experts must be uint8 {list(want)} ({gguf_reference.GGUF_TYPES[qtype][0]} "
                                 f"blocks), got {t.dtype} {tuple(t.shape)}")

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` in ``dtype``: the float layer these blocks stand for."""
        def deq(t: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
            return torch.stack([gguf.dequantize(t[e], qtype, cols, dtype) for e in range(t.shape[0])])

        w13 = torch.cat([deq(self.gate, self.gate_type, self.hidden), deq(self.up, self.up_type, self.hidden)], 1)
        return w13, deq(self.down, self.down_type, self.inter)


def fused_moe_gguf(hidden: torch.Tensor, experts: GGUFExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   *, act: str = "silu", swiglu_alpha: float = GPT_OSS_ALPHA,
                   swiglu_limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """``moe_reference.fused_moe(hidden, *experts.dequantized(), topk_weights, topk_ids)`` on the blocks
    themselves: float32 products and sums per GEMM, the activation in float32 from gate|up rounded to
    ``hidden``'s dtype, the weighted sum over the k experts in float32, rounded once."""
    if hidden.dim() != 2 or hidden.shape[1] != experts.hidden:
        raise ValueError(f"hidden must be [T, {experts.hidden}], got {tuple(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids/topk_weights must both be [{hidden.shape[0]}, k]; got {tuple(topk_ids.shape)} "
                         f"and {tuple(topk_weights.shape)}")
    inter = experts.inter
    if act == "silu" and hidden.is_cpu and hidden.dtype in gguf.NATIVE_MAX_ROWS \
            and hidden.shape[0] <= gguf.NATIVE_MAX_ROWS[hidden.dtype]:
        out = _native(hidden, experts, topk_weights, topk_ids)
        if out is not None:
            return out
    runs = ExpertRuns.of(topk_ids, experts.gate.shape[0])
    x = hidden.index_select(0, runs.rows)  # every pair's input row, grouped by expert
    gate_up = hidden.new_empty((runs.pairs, 2 * inter))
    y = hidden.new_empty((runs.pairs, experts.hidden))
    for e, lo, hi in runs.spans:
        gguf.linear(x[lo:hi], experts.gate[e], experts.gate_type, out=gate_up[lo:hi, :inter])
        gguf.linear(x[lo:hi], experts.up[e], experts.up_type, out=gate_up[lo:hi, inter:])
    a = activation(gate_up, act, swiglu_alpha, swiglu_limit).to(hidden.dtype)
    for e, lo, hi in runs.spans:
        gguf.linear(a[lo:hi], experts.down[e], experts.down_type, out=y[lo:hi])
    return runs.weighted_sum(y, topk_weights, hidden)


_ARGS = 25  # kvpilot_moe_gguf_packed's slots (csrc/moe_cpu.c), checked against the build's own count
_tls = threading.local()


def _native(hidden: torch.Tensor, experts: GGUFExperts, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor) -> torch.Tensor | None:
    """``fused_moe_gguf`` for SiLU experts in one native call; None where the kernel is not built (the caller
    takes the per-expert loop)."""
    if not native_available() or hidden.stride(1) != 1:
        return None
    fn = cpu_native.gguf_fn("moe_gguf_packed")
    assert fn is not None
    e = experts.gate.shape[0]
    check_expert_ids(topk_ids, e)
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    if not all(b.is_contiguous() for b in (experts.gate, experts.up, experts.down)):
        return None
    out = hidden.new_empty(hidden.shape)
    args = getattr(_tls, "args", None)
    if args is None:
        args = _tls.args = (ctypes.c_int64 * _ARGS)()
    args[:] = native_args(experts, hidden.dtype)
    args[0:3] = (hidden.data_ptr(), hidden.stride(0), hidden.shape[0])
    args[6:9] = (ids.shape[1], ids.data_ptr(), weights.data_ptr())
    args[22:25] = (out.data_ptr(), out.stride(0), torch.get_num_threads())
    rc = fn(args)
    if rc == -2:
        raise MemoryError("the native MoE kernel could not allocate its scratch rows")
    if rc != 0:
        raise ValueError(f"the native MoE kernel rejected the experts' blocks (rc {rc})")
    return out


def native_args(experts: GGUFExperts, dtype: torch.dtype) -> list[int]:
    """``kvpilot_moe_gguf_packed``'s argument record (csrc/moe_gguf_args.h) with the layer's own slots filled:
    the sizes, each projection's blocks and the rows' dtype; the rows, routing and output slots (0-2, 6-8 and
    22-24) are the caller's. The native decode loop keeps one per layer. The blocks must stay alive."""
    slots = [0, 0, 0, experts.hidden, experts.inter, experts.gate.shape[0], 0, 0, 0]
    for b, qtype in ((experts.gate, experts.gate_type), (experts.up, experts.up_type),
                     (experts.down, experts.down_type)):
        slots += [qtype, b.data_ptr(), b.stride(0), b.stride(1)]
    return [*slots, int(dtype is torch.bfloat16), 0, 0, 0]


def native_available() -> bool:
    """Whether the native GGUF MoE kernel is built (with the argument layout this module writes)."""
    return cpu_native.gguf_fn("moe_gguf_packed") is not None and cpu_native.moe_gguf_args() == _ARGS
