"""The linear-layer family (``Linear``: a quant method times a parallel split) and the float GEMM it runs
on the CPU, with weights prepacked for oneDNN.

A plain ``F.linear`` on the CPU repacks the weight matrix into the GEMM kernel's panel layout on every
call, a large share of a small decode step's GEMM. oneDNN can keep the weight in its blocked layout once and
for all (what inductor's ``freezing`` does for CPU models): float32, and bfloat16 where oneDNN has bfloat16
kernels for the CPU (AVX512-BF16 or AMX), unless the engine's ``prepack_weights`` is off
(bench/results/profile_prepack.md). A packed weight is an opaque oneDNN tensor: it has a shape and a size
but no strided storage, so only ``linear`` below may read it.

Steps of a few rows only stream the weights, and oneDNN reads them well below the host's streaming rate.
There ``linear`` takes the weight's panels (``ops.pack_panels``), when the model kept them, to
``ops.panel_gemm``, up to ``small_batch_rows()`` rows (bench/results/serving_vllm_panels.md). The panels
are a second copy of each GEMM weight, so the models keep them only where ``keep_panels`` allows.

Both switches come from the kernel settings the engine configured at start (``ops.current()``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels import ops

from .parallel import SINGLE, ParallelContext
from .quantization import ShardSlice, get_quant_method

if TYPE_CHECKING:
    from ..lora.layers import LoRASlots
    from .quantization import QuantMethod

__all__ = ["Linear", "Split", "linear", "prepack_supported", "prepack", "keep_panels", "small_batch_rows"]

_PANELS_MEMORY_SHARE = 0.1  # the second copy may take up to this share of the machine's memory


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if not ops.current().prepack_weights:
        return False
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # noqa: SLF001 - oneDNN's own probe
    return dtype == torch.float32


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's layout for any row count (no batch-size hint: decode and prefill
    steps of every size share one copy)."""
    # oneDNN's linear ops are public only under these names (the ones inductor's CPU freezing calls)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)  # noqa: SLF001


def small_batch_rows() -> int:
    """Steps of up to this many rows use the panels (0: no kernel). A constant of the native build, read
    once: this is asked on every GEMM of every step."""
    return ops.panel_gemm_max_rows()


def keep_panels(extra_bytes: int) -> bool:
    """Whether a model may keep panel copies of its packed weights (``extra_bytes`` in all) for small
    steps: the native kernel is there and the copies take at most a tenth of physical memory, unless the
    ``small_batch_gemm`` setting says always (True) or never (False)."""
    setting = ops.current().small_batch_gemm
    if setting is False or not ops.native_available():
        return False
    if setting is True:
        return True
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf figures: do not guess
        return False
    return extra_bytes <= _PANELS_MEMORY_SHARE * physical


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           panels: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that also takes a prepacked weight, and for small steps its panels when kept. With
    ``residual`` (``[rows, out]``), ``residual + F.linear(...)``: the GEMM adds it as it writes its output,
    which saves a pass over both, with the same results."""
    if panels is not None and x.shape[0] <= small_batch_rows():
        y = ops.panel_gemm(x, panels, weight.shape[0], bias, residual)
        if y is not None:
            return y
    if weight.is_mkldnn:
        if not x.is_contiguous():
            x = x.contiguous()
        if residual is not None and residual.is_contiguous() and residual.dtype == x.dtype:
            # oneDNN's binary post-op (inductor's CPU freezing fuses a residual add the same way)
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")  # noqa: SLF001
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # noqa: SLF001
    else:
        y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


# ------------------------------------------------------------------------------------------ the layer family

Split = Literal["replicated", "column", "row"]


class Linear(nn.Module):
    """One linear layer: a quant method (how the weight is stored and multiplied, ``quantization/``) and a
    split (which part of it this rank holds). Column-split layers hold a slice of the output rows of each
    of their partitions (q|k|v, gate|up); row-split layers a slice of the input columns, and their partial
    outputs are summed over the ranks before the bias and residual go in. Build them with ``replicated``,
    ``column``, ``qkv`` or ``row``; load each checkpoint tensor whole with ``load`` (the layer takes its
    own part)."""

    def __init__(self, in_features: int, partitions: Sequence[tuple[int, int, int]], *, split: Split,
                 in_part: tuple[int, int], bias: bool = False, quant_method: QuantMethod | None = None,
                 parallel: ParallelContext = SINGLE, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        """``partitions``: per checkpoint tensor merged into this layer, (its rows, the first row this rank
        holds, how many); ``in_part``: (first input column, how many) of this rank."""
        super().__init__()
        self.in_features = in_features
        self.split = split
        self.parallel = parallel
        self.partitions = [tuple(p) for p in partitions]
        self.in_start, self.in_per_rank = in_part
        self.out_per_rank = sum(size for _, _, size in self.partitions)
        self.out_features = sum(rows for rows, _, _ in self.partitions)
        self.quant_method = quant_method if quant_method is not None else get_quant_method(None)
        device = torch.device(device)
        self.quant_method.create_weights(self, dtype=dtype, device=device)
        # a row-split layer adds the whole bias once, after the sum over ranks
        bias_rows = self.out_features if split == "row" else self.out_per_rank
        self.bias = nn.Parameter(torch.empty(bias_rows, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self.lora: LoRASlots | None = None  # the adapters' slots, when the engine serves LoRA (lora/manager.py)

    # -- constructors, one per split

    @classmethod
    def replicated(cls, in_features: int, out_features: int, **kw: Any) -> Linear:
        kw.setdefault("parallel", SINGLE)
        return cls(in_features, [(out_features, 0, out_features)], split="replicated", in_part=(0, in_features),
                   **kw)

    @classmethod
    def column(cls, in_features: int, out_sizes: Sequence[int], *, parallel: ParallelContext = SINGLE,
               what: str = "output", **kw: Any) -> Linear:
        """Output rows split evenly over the ranks, per partition (``out_sizes``: e.g. [inter, inter] for
        gate|up)."""
        parts = [(size, *parallel.shard(size, what)) for size in out_sizes]
        return cls(in_features, parts, split="column", in_part=(0, in_features), parallel=parallel, **kw)

    @classmethod
    def qkv(cls, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, *,
            parallel: ParallelContext = SINGLE, **kw: Any) -> Linear:
        """q|k|v with the query heads split over the ranks, and the KV heads too, or each KV head
        replicated on the ranks whose query heads read it when there are fewer KV heads than ranks."""
        q_start, q_heads = parallel.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= parallel.tp_size:
            kv_start, kv_heads = parallel.shard(num_kv_heads, "num_key_value_heads")
        else:
            if parallel.tp_size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size ({parallel.tp_size}) is not a multiple of "
                                 f"num_key_value_heads ({num_kv_heads})")
            kv_start, kv_heads = parallel.tp_rank * num_kv_heads // parallel.tp_size, 1
        q = (num_heads * head_dim, q_start * head_dim, q_heads * head_dim)
        kv = (num_kv_heads * head_dim, kv_start * head_dim, kv_heads * head_dim)
        return cls(hidden, [q, kv, kv], split="column", in_part=(0, hidden), parallel=parallel, **kw)

    @classmethod
    def row(cls, in_features: int, out_features: int, *, parallel: ParallelContext = SINGLE,
            what: str = "input", **kw: Any) -> Linear:
        """Input columns split evenly over the ranks; the outputs are summed over them."""
        return cls(in_features, [(out_features, 0, out_features)], split="row",
                   in_part=parallel.shard(in_features, what), parallel=parallel, **kw)

    # -- loading

    def load(self, name: str, tensor: torch.Tensor, partition: int = 0, *, row_offset: int = 0,
             fused_rows: int | None = None, row_order: torch.Tensor | None = None) -> None:
        """Checkpoint tensor ``name`` ("bias", or one of the quant method's) of partition ``partition``,
        whole; this rank's part of it goes in. A fused checkpoint tensor (``fused_rows`` output rows) holds
        the partition from row ``row_offset`` on; ``row_order`` permutes the partition's rows (``ShardSlice``)."""
        rows, start, size = self.partitions[partition]
        dst_row = sum(s for _, _, s in self.partitions[:partition])
        part = ShardSlice(ckpt_shape=(rows, self.in_features), out_start=start, out_size=size,
                          in_start=self.in_start, in_size=self.in_per_rank, dst_row=dst_row,
                          row_offset=row_offset, fused_rows=fused_rows, row_order=row_order)
        if name == "bias":
            if self.bias is None:
                raise RuntimeError("this layer has no bias")
            if tuple(tensor.shape) != (part.stored_rows,):
                raise RuntimeError(f"checkpoint shape {tuple(tensor.shape)} != expected {(part.stored_rows,)}")
            if self.split == "row":
                self.bias.data.copy_(tensor)
            else:
                self.bias.data[dst_row:dst_row + size].copy_(part.take_rows(tensor))
            return
        self.quant_method.load_weight(self, name, tensor, part)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def prepack(self, *, keep_panels: bool) -> None:
        self.quant_method.prepack(self, keep_panels=keep_panels)

    def weight_bytes(self) -> int:
        return self.quant_method.weight_bytes(self)

    # -- running

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                lora: ops.LoRASegments | None = None) -> torch.Tensor:
        """``residual + x @ W.T + bias``; for a row split over several ranks, summed over them first. With
        ``lora`` (the rows' adapter slots), each row's adapter update is added too."""
        if self.split != "row" or self.parallel.tp_size == 1:
            y = self.quant_method.apply(self, x, self.bias, residual)
            if lora is not None and self.lora is not None:
                self.lora.apply(y, x, lora)
            return y
        y = self.quant_method.apply(self, x, None, None)
        if lora is not None and self.lora is not None:  # this rank's input columns' share, summed with y's
            self.lora.apply(y, x, lora)
        y = self.parallel.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y
