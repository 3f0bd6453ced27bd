"""Float weights: dense ``[out, in]`` as loaded, prepacked for oneDNN on the CPU, with panel copies for
steps of a few rows where the model keeps them (``linear.linear`` runs all three)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvpilot.kernels import ops

from ..linear import linear
from ..linear import prepack as prepack_weight
from . import QuantMethod, ShardSlice, register

if TYPE_CHECKING:
    from ..linear import Linear


@register
class UnquantizedLinearMethod(QuantMethod):
    name = "none"

    def create_weights(self, layer: Linear, *, dtype: torch.dtype, device: torch.device) -> None:
        weight = torch.empty(layer.out_per_rank, layer.in_per_rank, dtype=dtype, device=device)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        layer.register_buffer("panels", None, persistent=False)  # kept only for small steps

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor, part: ShardSlice) -> None:
        if name != "weight":
            raise RuntimeError(f"unquantized layers have no {name!r} tensor")
        if tensor.dim() != 2 or tuple(tensor.shape) != (part.stored_rows, part.ckpt_shape[1]):
            raise RuntimeError(f"checkpoint shape {tuple(tensor.shape)} != expected {(part.stored_rows, part.ckpt_shape[1])}")
        src = part.take_rows(tensor).narrow(1, part.in_start, part.in_size)
        layer.weight.data[part.dst_row:part.dst_row + part.out_size].copy_(src)

    def prepack(self, layer: Linear, *, keep_panels: bool) -> None:
        dense = layer.weight
        packed = prepack_weight(dense)  # a copy: the dense memory is free to take the panels below
        panels = panels_in_place(dense) if keep_panels else None
        del layer._parameters["weight"]  # noqa: SLF001 - the packed copy replaces the parameter
        layer.register_buffer("weight", packed, persistent=False)
        layer.panels = panels

    def describe(self) -> str:
        return "float"

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias, layer.panels, residual)

    def native_panels(self, layer: Linear) -> torch.Tensor | None:
        return layer.panels if layer.panels is not None and layer.panels.dtype is torch.float32 else None

    def weight_bytes(self, layer: Linear) -> int:
        return layer.weight.numel() * layer.weight.element_size()


def panels_in_place(dense: torch.Tensor) -> torch.Tensor | None:
    """``ops.pack_panels`` of a weight nothing reads densely any more, written into the weight's own pages
    where the sizes match (no padding): they are resident already, and a fresh copy would fault in the
    whole model's weights once more at start."""
    panels = ops.pack_panels(dense.detach())
    if panels is None or panels.numel() != dense.numel():
        return panels
    flat = dense.detach().view(-1)
    flat.copy_(panels.view(-1))
    return flat.view(panels.shape)
