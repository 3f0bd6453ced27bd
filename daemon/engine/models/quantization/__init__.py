"""How a linear layer stores its weight and multiplies by it: vLLM's ``quant_method``.

A ``QuantMethod`` is one property of a linear layer (``models/linear.py``); the parallel split is the other,
and the two compose: the layer works out which part of each checkpoint tensor is this rank's
(``ShardSlice``, in the tensor's logical ``[out, in]`` coordinates) and the method maps that onto its own
storage, so a packed format slices its blocks and scales itself. The bias is the layer's, never quantized.
Methods register by the names ``--quantization`` takes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from ..linear import Linear

__all__ = ["QUANTIZATION_METHODS", "QuantMethod", "ShardSlice", "get_quant_method", "method_names"]


@dataclass(frozen=True)
class ShardSlice:
    """The part of one partition of a checkpoint tensor that this rank holds, in the partition's logical
    ``[out, in]`` coordinates (``ckpt_shape``): rows ``out_start:out_start+out_size`` and columns
    ``in_start:in_start+in_size``, going to the layer's rows from ``dst_row`` on (a merged layer such as
    q|k|v holds several partitions one after another).

    The tensor as stored may hold more than this partition: a fused checkpoint tensor (Phi-3's qkv_proj)
    holds it from logical row ``row_offset`` on, ``fused_rows`` rows in all. ``row_order`` (partition
    rows, or None) is the order the layer keeps them in: the layer's row i is checkpoint row
    ``row_order[i]`` (the model's interleaved RoPE rows). A method brings each of its tensors to an output-major form and calls ``take_rows``."""

    ckpt_shape: tuple[int, int]
    out_start: int
    out_size: int
    in_start: int
    in_size: int
    dst_row: int
    row_offset: int = 0
    fused_rows: int | None = None
    row_order: torch.Tensor | None = None

    @property
    def stored_rows(self) -> int:
        """The output rows of the checkpoint tensor as stored (all partitions of a fused one)."""
        return self.fused_rows if self.fused_rows is not None else self.ckpt_shape[0]

    def _order_keeps_groups(self, rows_per_entry: int) -> bool:
        if self.row_order is None:
            return True
        order = self.row_order.cpu()
        return bool(torch.equal(order // rows_per_entry, torch.arange(len(order)) // rows_per_entry))

    def take_rows(self, t: torch.Tensor, rows_per_entry: int = 1) -> torch.Tensor:
        """This rank's rows of an output-major tensor ``t`` (its dim 0 the checkpoint's output rows, or
        output groups of ``rows_per_entry`` rows, e.g. a per-block scale), in the layer's order."""
        start, size = self.row_offset, self.ckpt_shape[0]
        if t.shape[0] != -(-self.stored_rows // rows_per_entry):
            raise RuntimeError(f"checkpoint rows {t.shape[0]} != expected {self.stored_rows}"
                               + (f" / {rows_per_entry}" if rows_per_entry > 1 else ""))
        if rows_per_entry > 1:
            first, end = start + self.out_start, start + self.out_start + self.out_size
            ragged_end = end % rows_per_entry and end != self.stored_rows
            if first % rows_per_entry or ragged_end or not self._order_keeps_groups(rows_per_entry):
                raise RuntimeError(f"rows {first}:{end} cut through groups of {rows_per_entry} rows that share "
                                   "one checkpoint entry")
            return t.narrow(0, first // rows_per_entry, -(-end // rows_per_entry) - first // rows_per_entry)
        t = t.narrow(0, start, size)
        if self.row_order is not None:
            t = t.index_select(0, self.row_order.to(t.device))
        return t.narrow(0, self.out_start, self.out_size)


class QuantMethod(ABC):
    """Creates, loads and applies one layer's weight. One instance may serve many layers: per-layer state
    lives on the layer (its parameters and buffers)."""

    name: ClassVar[str]
    # whether the method also takes the token embedding and the LM head (GGUF keeps them quantized); the
    # checkpoint formats of the others leave both in float
    quantizes_embeddings: ClassVar[bool] = False

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None) -> QuantMethod:  # noqa: ARG003 - for subclasses
        """The method for a checkpoint's ``quantization_config`` (None: the method's defaults, e.g. online
        quantization of a float checkpoint); ``ValueError`` naming the field it cannot follow."""
        return cls()

    def skips(self, prefix: str) -> bool:  # noqa: ARG002 - for subclasses
        """Whether the layer named ``prefix`` (``layers.3.self_attn.o_proj``) stays unquantized in this
        checkpoint (its ``ignore`` / ``modules_to_not_convert`` lists)."""
        return False

    @abstractmethod
    def create_weights(self, layer: Linear, *, dtype: torch.dtype, device: torch.device) -> None:
        """Register the storage of the layer's ``[out_per_rank, in_per_rank]`` weight on ``layer``."""

    @abstractmethod
    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor, part: ShardSlice) -> None:
        """Copy this rank's part of checkpoint tensor ``name`` (the method's own tensor names: "weight",
        or e.g. "qweight"/"scales") in; ``RuntimeError`` naming the shapes when it does not fit."""

    def checkpoint_names(self) -> tuple[str, ...]:
        """The tensors a checkpoint holds per linear layer, e.g. ("weight",)."""
        return ("weight",)

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027
        """Once every tensor is in (``load_weights`` calls it): check that nothing is missing and repack
        into the layout the device's kernels take."""

    def prepack(self, layer: Linear, *, keep_panels: bool) -> None:  # noqa: B027
        """On the CPU, where the model prepacks (``DecoderForCausalLM.prepack_weights``): oneDNN's layout,
        and with ``keep_panels`` a panel copy for small steps as well. Float methods only; others ignore it."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None) -> torch.Tensor:
        """``residual + x @ W.T + bias`` (each term where given) for this rank's weight."""

    def native_blocks(self, layer: Linear) -> list[tuple[int, int, int, torch.Tensor]] | None:  # noqa: ARG002
        """The layer's weight as runs of GGUF blocks that ``ops.gguf_linear``'s native CPU GEMM multiplies
        as they are: ``(first output row, rows, GGML type, blocks [rows, row_bytes] uint8)`` each, covering
        every row. None where the weight is held otherwise (float, or blocks that need their activations
        permuted first): a decode step's native layers (``native_decode.py``) then leave the model to Python."""
        return None

    def native_panels(self, layer: Linear) -> torch.Tensor | None:  # noqa: ARG002
        """The float32 weight's panel copy (``ops.pack_panels``) that small steps multiply, where the layer
        keeps one; None otherwise."""
        return None

    def embed(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the layer's weight, in the model dtype: the token lookup of a method that
        ``quantizes_embeddings``."""
        raise NotImplementedError(f"{self.name} does not hold embeddings")

    def describe(self) -> str:
        """A few words for the startup log, e.g. "GGUF (Q4_1 x210, Q8_0 x1)"."""
        return self.name

    @abstractmethod
    def weight_bytes(self, layer: Linear) -> int:
        """Bytes of the layer's weight storage on this rank, as loaded (before any repacking)."""


QUANTIZATION_METHODS: dict[str, type[QuantMethod]] = {}


def register(cls: type[QuantMethod]) -> type[QuantMethod]:
    QUANTIZATION_METHODS[cls.name] = cls
    return cls


def _register_all() -> None:
    import importlib

    for module in _METHOD_MODULES:
        try:
            importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as e:  # a method module not written yet in this checkout
            if e.name != f"{__name__}.{module}":
                raise


# each registers itself on import (fp8: compressed-tensors and block-wise FP8; awq, gptq: 4-bit)
_METHOD_MODULES = ("unquantized", "gguf", "fp8", "awq", "gptq")


def get_quant_method(name: str | None, quant_config: dict[str, Any] | None = None) -> QuantMethod:
    """The method for a ``quantization`` setting (None: unquantized) and the checkpoint's
    ``quantization_config``; ``ValueError`` naming the known ones."""
    _register_all()
    key = name or "none"
    if key not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {sorted(QUANTIZATION_METHODS)}, got {name!r}")
    return QUANTIZATION_METHODS[key].from_config(quant_config)


def method_names() -> list[str]:
    _register_all()
    return sorted(QUANTIZATION_METHODS)
