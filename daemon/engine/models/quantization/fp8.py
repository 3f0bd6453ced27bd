"""FP8 (float8_e4m3fn) weights: vLLM's ``quantization="fp8"`` and its compressed-tensors FP8 checkpoints.

Checkpoints (``quantization_config``):

- compressed-tensors, as the published "-FP8-dynamic" / "-FP8" ones are: ``format`` "float-quantized", one
  config group whose ``weights`` are 8-bit floats with ``strategy`` "tensor" (``weight_scale`` one number) or
  "channel" (``[out, 1]``) or "block" (``block_structure``, ``weight_scale`` one per block);
  ``input_activations`` dynamic (per token), static per tensor (an ``input_scale`` per layer) or absent
  (weight-only). ``ignore`` names the layers left in float.
- ``quant_method: "fp8"`` with ``weight_block_size`` (Qwen3-FP8, DeepSeek-V3): ``weight_scale_inv`` one per
  ``[128, 128]`` block, dynamic activations; without it vLLM's own serialization: a per-tensor
  ``weight_scale`` and, with ``activation_scheme: "static"``, an ``input_scale``. ``modules_to_not_convert``
  (or ``ignored_layers``) names the float layers.
- none (``--quantization fp8`` on a float checkpoint): each rank's rows quantized at load, one scale per row.

In every case ``W[n, k] = weight[n, k] * scale`` for the scale of the row (or of its block).

Where it runs: on the CPU, ``process_weights_after_loading`` dequantizes the weight into the model dtype and
the layer runs as a float one (prepacked and all): there is no fp8 arithmetic there to gain from, so the
activations are not quantized either. On CUDA the weight stays fp8: per-row scales (tensor and channel
strategies) through ``ops.fp8_linear`` (activations quantized per token, or by the static scale, and
``torch._scaled_mm``), block scales and weight-only checkpoints through ``ops.fp8_block_linear`` (Triton,
activations as they are).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from kvpilot.kernels import ops

from . import QuantMethod, ShardSlice, register
from .unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from ..linear import Linear

Activations = Literal["dynamic", "static", "none"]

_FP8 = torch.float8_e4m3fn
# where a layer-relative HF name may sit in a checkpoint's module names (plain and multimodal)
_MODULE_PREFIXES = ("", "model.", "model.language_model.", "language_model.model.")


def module_matches(entry: str, prefix: str) -> bool:
    """Whether an ``ignore`` / ``modules_to_not_convert`` entry names the layer ``prefix``
    (``layers.3.self_attn.o_proj``): ``re:PATTERN`` matched from the start of a full module name, else a
    run of whole dotted components of it ("lm_head", "o_proj", "model.layers.3.self_attn.o_proj")."""
    names = [p + prefix for p in _MODULE_PREFIXES]
    if entry.startswith("re:"):
        return any(re.match(entry[3:], n) for n in names)
    return any(f".{entry}." in f".{n}." for n in names)


def ignore_list(qc: dict[str, Any], *keys: str) -> tuple[str, ...]:
    out: list[str] = []
    for key in keys:
        value = qc.get(key) or []
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"quantization_config.{key} must be a list of module names, got {value!r}")
        out.extend(value)
    return tuple(out)


@register
class Fp8LinearMethod(QuantMethod):
    name = "fp8"

    def __init__(self, *, serialized: bool = False, block: tuple[int, int] | None = None,
                 activations: Activations = "dynamic", scale_name: str = "weight_scale",
                 ignore: tuple[str, ...] = (), source: str = "quantized at load") -> None:
        self.serialized = serialized  # False: a float checkpoint quantized at load
        self.block = block  # (rows, columns) per weight scale; None: one scale per row
        self.activations = activations
        self.scale_name = scale_name
        self.ignore = ignore
        self.source = source
        self._float = UnquantizedLinearMethod()  # what a dequantized (CPU) layer runs

    # ------------------------------------------------------------------ config

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None) -> Fp8LinearMethod:
        if quant_config is None:
            return cls()
        kind = quant_config.get("quant_method")
        if kind == "compressed-tensors":
            return cls._compressed_tensors(quant_config)
        if kind in ("fp8", None):
            return cls._fp8(quant_config)
        raise ValueError(f"quantization_config.quant_method {kind!r} is not an FP8 checkpoint")

    @classmethod
    def _fp8(cls, qc: dict[str, Any]) -> Fp8LinearMethod:
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (only e4m3)")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not 'dynamic' or 'static'")
        ignore = ignore_list(qc, "modules_to_not_convert", "ignored_layers")
        block = qc.get("weight_block_size")
        if block is None:  # vLLM's own per-tensor serialization
            return cls(serialized=True, activations=scheme, ignore=ignore, source="vLLM fp8")
        if scheme != "dynamic":
            raise ValueError("quantization_config.activation_scheme 'static' with weight_block_size is not supported")
        return cls(serialized=True, block=_block_size(block, "weight_block_size"), activations="none",
                   scale_name="weight_scale_inv", ignore=ignore, source="block fp8")

    @classmethod
    def _compressed_tensors(cls, qc: dict[str, Any]) -> Fp8LinearMethod:
        fmt = qc.get("format", "float-quantized")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups is missing: not a compressed-tensors FP8 checkpoint")
        schemes = set()
        for name, group in groups.items():
            group_fmt = group.get("format") or fmt
            if group_fmt != "float-quantized":
                raise ValueError(f"quantization_config.format {group_fmt!r} is not supported: kvpilot reads the "
                                 "FP8 ('float-quantized') compressed-tensors checkpoints")
            schemes.add(_group_scheme(name, group))
        if len(schemes) != 1:
            raise ValueError(f"quantization_config.config_groups mix {len(schemes)} schemes; kvpilot takes one")
        ((block, activations),) = schemes
        return cls(serialized=True, block=block, activations=activations, ignore=ignore_list(qc, "ignore"),
                   source="compressed-tensors")

    def skips(self, prefix: str) -> bool:
        return any(module_matches(entry, prefix) for entry in self.ignore)

    def checkpoint_names(self) -> tuple[str, ...]:
        if not self.serialized:
            return ("weight",)
        return ("weight", self.scale_name) + (("input_scale",) if self.activations == "static" else ())

    def describe(self) -> str:
        weights = f"a scale per {self.block[0]}x{self.block[1]} block" if self.block else "a scale per row"
        acts = {"dynamic": "activations quantized per token on GPUs", "static": "static activation scales on GPUs",
                "none": "weight-only"}[self.activations]
        return f"FP8 ({self.source}; {weights}; {acts})"

    # ------------------------------------------------------------------ storage and loading

    def create_weights(self, layer: Linear, *, dtype: torch.dtype, device: torch.device) -> None:
        rows, cols = layer.out_per_rank, layer.in_per_rank
        layer.register_parameter("weight", nn.Parameter(torch.empty(rows, cols, dtype=_FP8, device=device),
                                                         requires_grad=False))
        layer.fp8_dtype = dtype  # what a dequantized weight becomes
        layer.fp8_dequantized = False
        layer.fp8_loaded_bytes = 0
        # NaN marks what no checkpoint tensor has written yet
        if self.block is None:
            layer.register_buffer("weight_scale", torch.full((rows,), float("nan"), dtype=torch.float32,
                                                             device=device))
            layer.register_buffer("scale_row", None)
        else:
            bn, bk = self.block
            _check_block_split(layer, bn, bk)
            entries = [-(-size // bn) for _, _, size in layer.partitions]
            layer.register_buffer("weight_scale", torch.full((sum(entries), -(-cols // bk)), float("nan"),
                                                             dtype=torch.float32, device=device))
            # the layer's row r is scaled by weight_scale[scale_row[r]]: each partition's blocks in turn
            first = [sum(entries[:i]) for i in range(len(entries))]
            layer.register_buffer("scale_row", torch.cat([
                first[i] + torch.arange(size) // bn for i, (_, _, size) in enumerate(layer.partitions)
            ]).to(device=device, dtype=torch.int32))
        layer.register_buffer("input_scale", torch.tensor(float("nan"), dtype=torch.float32, device=device)
                              if self.activations == "static" else None)

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor, part: ShardSlice) -> None:
        rows = slice(part.dst_row, part.dst_row + part.out_size)
        if name == "weight":
            expected = (part.stored_rows, part.ckpt_shape[1])
            if tensor.dim() != 2 or tuple(tensor.shape) != expected:
                raise RuntimeError(f"checkpoint shape {tuple(tensor.shape)} != expected {expected}")
            if self.serialized != (tensor.dtype == _FP8):
                want = "float8_e4m3fn" if self.serialized else "a float checkpoint"
                raise RuntimeError(f"weight is {tensor.dtype}, expected {want}")
            src = part.take_rows(tensor).narrow(1, part.in_start, part.in_size)
            if self.serialized:
                layer.weight.data[rows].copy_(src)
            else:  # online: this rank's rows, each with its own scale
                wq, scale = ops.fp8_quantize_weight(src.to(layer.weight.device))
                layer.weight.data[rows].copy_(wq)
                layer.weight_scale[rows] = scale
            return
        if name == self.scale_name and self.serialized:
            if self.block is None:
                layer.weight_scale[rows] = _row_scales(tensor, part)
            else:
                self._load_block_scales(layer, tensor, part)
            return
        if name == "input_scale" and self.activations == "static":
            if tensor.numel() != 1:
                raise RuntimeError(f"input_scale {tuple(tensor.shape)} is not one per-tensor scale")
            # q, k and v (gate and up) read the same input: the widest of their scales covers all of them
            layer.input_scale.copy_(torch.fmax(layer.input_scale, tensor.reshape(()).float()))
            return
        raise RuntimeError(f"FP8 layers ({self.source}) have no {name!r} tensor")

    def _load_block_scales(self, layer: Linear, tensor: torch.Tensor, part: ShardSlice) -> None:
        bn, bk = self.block  # type: ignore[misc]
        expected = (-(-part.stored_rows // bn), -(-part.ckpt_shape[1] // bk))
        if tensor.dim() != 2 or tuple(tensor.shape) != expected:
            raise RuntimeError(f"{self.scale_name} {tuple(tensor.shape)} != expected {expected} "
                               f"(one per {bn}x{bk} block)")
        src = part.take_rows(tensor, rows_per_entry=bn)
        src = src.narrow(1, part.in_start // bk, layer.weight_scale.shape[1])
        first = int(layer.scale_row[part.dst_row])
        layer.weight_scale[first:first + src.shape[0]] = src.float()

    def process_weights_after_loading(self, layer: Linear) -> None:
        missing = [n for n in ("weight_scale", "input_scale")
                   if getattr(layer, n) is not None and bool(getattr(layer, n).isnan().any())]
        if missing:  # the weight itself has no marker: the model's name check finds it missing
            raise RuntimeError(f"FP8 layer without {' or '.join(missing)} for some of its rows")
        layer.fp8_loaded_bytes = sum(t.numel() * t.element_size() for t in (
            layer.weight, layer.weight_scale, layer.scale_row, layer.input_scale) if t is not None)
        if layer.weight.device.type == "cuda":
            return
        # no fp8 arithmetic to gain from off the GPU: the model-dtype weight, and the float layer's paths
        scale = layer.weight_scale if self.block is not None else layer.weight_scale.reshape(-1, 1)
        block_k = self.block[1] if self.block is not None else layer.in_per_rank
        dense = ops.fp8_dequantize(layer.weight.data, scale, layer.scale_row, block_k, layer.fp8_dtype)
        del layer._parameters["weight"]  # noqa: SLF001 - the float weight replaces the fp8 one
        layer.register_parameter("weight", nn.Parameter(dense, requires_grad=False))
        layer.register_buffer("panels", None, persistent=False)
        for buf in ("weight_scale", "scale_row", "input_scale"):
            layer.register_buffer(buf, None)
        layer.fp8_dequantized = True

    def prepack(self, layer: Linear, *, keep_panels: bool) -> None:
        if layer.fp8_dequantized:
            self._float.prepack(layer, keep_panels=keep_panels)

    # ------------------------------------------------------------------ running

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None) -> torch.Tensor:
        if layer.fp8_dequantized:
            return self._float.apply(layer, x, bias, residual)
        if self.block is not None:
            return ops.fp8_block_linear(x, layer.weight, layer.weight_scale, layer.scale_row, self.block[1],
                                        bias, residual)
        if self.activations == "none":  # weight-only: the activations stay as they are
            return ops.fp8_block_linear(x, layer.weight, layer.weight_scale.reshape(-1, 1), None,
                                        layer.in_per_rank, bias, residual)
        return ops.fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias, residual)

    def weight_bytes(self, layer: Linear) -> int:
        if layer.fp8_loaded_bytes:  # what the checkpoint's fp8 weights take, also where the CPU dequantized
            return layer.fp8_loaded_bytes
        return sum(t.numel() * t.element_size() for t in (
            layer.weight, layer.weight_scale, layer.scale_row, layer.input_scale) if t is not None)


# ---------------------------------------------------------------------------------------------- helpers


def _block_size(value: Any, field: str) -> tuple[int, int]:
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"quantization_config.{field} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _group_scheme(name: str, group: dict[str, Any]) -> tuple[tuple[int, int] | None, Activations]:
    """(block size or None, activations) of one compressed-tensors config group; ValueError naming the
    field kvpilot cannot follow."""
    where = f"quantization_config.config_groups.{name}"
    w = group.get("weights") or {}
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise ValueError(f"{where}.weights: {w.get('num_bits')}-bit {w.get('type')} weights are not supported "
                         "(kvpilot reads 8-bit float)")
    if w.get("symmetric") is False or w.get("dynamic"):
        raise ValueError(f"{where}.weights: asymmetric or dynamic weights are not supported")
    strategy = w.get("strategy")
    if strategy in ("tensor", "channel"):
        block = None
    elif strategy == "block":
        block = _block_size(w.get("block_structure"), f"config_groups.{name}.weights.block_structure")
    else:
        raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported (tensor, channel or block)")
    a = group.get("input_activations")
    if a is None:
        return block, "none"
    if a.get("num_bits") != 8 or a.get("type") != "float":
        raise ValueError(f"{where}.input_activations: {a.get('num_bits')}-bit {a.get('type')} activations "
                         "are not supported")
    if a.get("dynamic"):
        # per token, also for a dynamic per-tensor scheme: a finer scale of the same format
        return block, "dynamic" if block is None else "none"
    if a.get("strategy") != "tensor" or block is not None:
        raise ValueError(f"{where}.input_activations: static {a.get('strategy')!r} scales are not supported "
                         "(static per-tensor with per-row weight scales only)")
    return block, "static"


def _row_scales(tensor: torch.Tensor, part: ShardSlice) -> torch.Tensor:
    """This rank's per-row scales from a per-tensor scale (one number, the same for each row: a merged
    q|k|v keeps each partition's own) or a per-channel one (``[out, 1]`` or ``[out]``)."""
    if tensor.numel() == 1:
        return tensor.reshape(1).float().expand(part.out_size)
    if tensor.numel() != part.stored_rows or tensor.dim() > 2:
        raise RuntimeError(f"weight_scale {tuple(tensor.shape)} is neither one scale nor one per row "
                           f"({part.stored_rows})")
    return part.take_rows(tensor.reshape(-1)).float()


def _check_block_split(layer: Linear, bn: int, bk: int) -> None:
    """ValueError unless each rank's rows and columns are whole weight blocks (the last may be ragged where
    the tensor ends): a block's one scale cannot be split."""
    for rows, start, size in layer.partitions:
        if start % bn or (size % bn and start + size != rows):
            raise ValueError(f"block-wise FP8 ({bn}x{bk} blocks): this rank's rows {start}:{start + size} of "
                             f"{rows} cut through a block; use a tensor_parallel_size that keeps whole blocks")
    start, size = layer.in_start, layer.in_per_rank
    if start % bk or (size % bk and start + size != layer.in_features):
        raise ValueError(f"block-wise FP8 ({bn}x{bk} blocks): this rank's columns {start}:{start + size} of "
                         f"{layer.in_features} cut through a block; use a tensor_parallel_size that keeps "
                         "whole blocks")
