"""A MoE block's routed experts on a GGUF's own blocks (``quantization="gguf"``): the loader yields each layer's
stacked ``ffn_{gate,up,down}_exps`` as ``experts.{gate,up,down}_proj.qweight_type`` / ``.qweight`` ``[E, rows,
row_bytes]`` (``common/gguf_weights.py``), and ``kernels.gguf_moe`` multiplies them as they are.

A file that keeps its experts in float (F32, F16 or BF16 stacks) gets float experts, the MoE block's dense
stacks; quantized ones become a ``GGUFExperts``. With tensor parallelism each rank takes its rows of gate and up
and its columns of down, which must fall on block boundaries.
"""

from __future__ import annotations

import torch

from kvpilot.kernels import ops
from kvpilot.kernels.ops import GGUFExperts

from .parallel import ParallelContext

__all__ = ["PROJECTIONS", "GGUFExpertsLoader"]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_KINDS = ("qweight_type", "qweight")
_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGML's unquantized tensor types


class GGUFExpertsLoader:
    """Collects one block's expert tensors as they arrive and builds its experts once all are in."""

    def __init__(self, block: str, num_experts: int, hidden: int, inter: int, parallel: ParallelContext) -> None:
        self.block, self.num_experts, self.hidden, self.inter = block, num_experts, hidden, inter
        self.start, self.size = parallel.shard(inter, "moe_intermediate_size")
        self.types: dict[str, int] = {}
        self.blocks: dict[str, torch.Tensor] = {}

    def names(self) -> set[str]:
        """The checkpoint names the experts come as (relative to the layer)."""
        return {f"{self.block}.experts.{p}.{k}" for p in PROJECTIONS for k in _KINDS}

    def load(self, proj: str, kind: str, w: torch.Tensor) -> bool:
        """Tensor ``experts.<proj>.<kind>`` in; False where it is not one of the experts'."""
        if proj not in PROJECTIONS or kind not in _KINDS:
            return False
        if kind == "qweight_type":
            qtype = int(w.reshape(-1)[0])
            if qtype not in _FLOAT_TYPES and qtype not in ops.GGUF_TYPES:
                raise RuntimeError(f"GGML type {qtype} is not one kvpilot reads")
            self.types[proj] = qtype
            return True
        if proj not in self.types:
            raise RuntimeError("qweight came without its qweight_type")
        rows, cols = (self.hidden, self.inter) if proj == "down_proj" else (self.inter, self.hidden)
        qtype = self.types[proj]
        row_bytes = cols * _FLOAT_TYPES[qtype].itemsize if qtype in _FLOAT_TYPES else ops.gguf_row_bytes(qtype, cols)
        if w.dtype != torch.uint8 or tuple(w.shape) != (self.num_experts, rows, row_bytes):
            raise RuntimeError(f"qweight {tuple(w.shape)} {w.dtype} is not [{self.num_experts}, {rows}, {row_bytes}] "
                               f"uint8 (experts of {cols} columns)")
        self.blocks[proj] = w
        return True

    def _local(self, proj: str) -> torch.Tensor:
        """This rank's part of a projection's blocks: rows of gate and up, block-aligned columns of down."""
        w, qtype = self.blocks[proj], self.types[proj]
        if self.size == self.inter:
            return w.contiguous()
        if proj != "down_proj":
            return w[:, self.start:self.start + self.size].contiguous()
        elems, nbytes = (1, _FLOAT_TYPES[qtype].itemsize) if qtype in _FLOAT_TYPES else ops.GGUF_TYPES[qtype][1:]
        if self.start % elems or self.size % elems:
            raise ValueError(f"moe_intermediate_size {self.inter} splits over the tensor-parallel ranks into "
                             f"columns {self.start}+{self.size}, which cut through the down experts' blocks of "
                             f"{elems}")
        return w[:, :, self.start // elems * nbytes:(self.start + self.size) // elems * nbytes].contiguous()

    def build(self, dtype: torch.dtype) -> GGUFExperts | tuple[torch.Tensor, torch.Tensor]:
        """The experts: a ``GGUFExperts``, or ``(w13, w2)`` in ``dtype`` for a file whose experts are all
        float; RuntimeError naming a missing projection or a mix of float and quantized stacks."""
        missing = [p for p in PROJECTIONS if p not in self.blocks]
        if missing:
            raise RuntimeError(f"{self.block}.experts: no {', '.join(missing)} in the checkpoint")
        floats = [p for p in PROJECTIONS if self.types[p] in _FLOAT_TYPES]
        local = {p: self._local(p) for p in PROJECTIONS}
        if len(floats) == len(PROJECTIONS):
            dense = {p: local[p].view(_FLOAT_TYPES[self.types[p]]).to(dtype) for p in PROJECTIONS}
            return torch.cat([dense["gate_proj"], dense["up_proj"]], dim=1), dense["down_proj"]
        if floats:
            raise RuntimeError(f"{self.block}.experts mix float and quantized stacks ({', '.join(floats)} float)")
        experts = GGUFExperts(local["gate_proj"], local["up_proj"], local["down_proj"], self.types["gate_proj"],
                              self.types["up_proj"], self.types["down_proj"], hidden=self.hidden, inter=self.size)
        experts.check()
        return experts
