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
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ..linear import Linear

__all__ = ["QUANTIZATION_METHODS", "QuantMethod", "ShardSlice", "get_quant_method"]


@dataclass(frozen=True)
class ShardSlice:
    """The part of one checkpoint tensor, logically ``[out, in]`` of ``ckpt_shape``, that this rank holds:
    rows ``out_start:out_start+out_size`` and columns ``in_start:in_start+in_size``, going to the layer's
    rows from ``dst_row`` on (a merged layer such as q|k|v holds several tensors one after another)."""

    ckpt_shape: tuple[int, int]
    out_start: int
    out_size: int
    in_start: int
    in_size: int
    dst_row: int


class QuantMethod(ABC):
    """Creates, loads and applies one layer's weight. One instance may serve many layers: per-layer state
    lives on the layer (its parameters and buffers)."""

    name: ClassVar[str]

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

    def process_weights_after_loading(self, layer: Linear, *, prepack: bool, keep_panels: bool) -> None:  # noqa: B027
        """Once every tensor is in: repack for the device's kernels (``prepack``: oneDNN's layout on the
        CPU; ``keep_panels``: a panel copy for small steps as well). A method may ignore either."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None) -> torch.Tensor:
        """``residual + x @ W.T + bias`` (each term where given) for this rank's weight."""

    @abstractmethod
    def weight_bytes(self, layer: Linear) -> int:
        """Bytes of the layer's weight storage on this rank, as loaded (before any repacking)."""


QUANTIZATION_METHODS: dict[str, type[QuantMethod]] = {}


def register(cls: type[QuantMethod]) -> type[QuantMethod]:
    QUANTIZATION_METHODS[cls.name] = cls
    return cls


def get_quant_method(name: str | None) -> QuantMethod:
    """The method for a ``quantization`` setting (None: unquantized); ``ValueError`` naming the known ones."""
    from . import unquantized  # noqa: F401 - registers itself

    key = name or "none"
    if key not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {sorted(QUANTIZATION_METHODS)}, got {name!r}")
    return QUANTIZATION_METHODS[key]()
