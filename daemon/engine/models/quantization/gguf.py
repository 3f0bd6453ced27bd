"""GGUF weights on their own blocks (vLLM's ``quantization="gguf"``): each layer keeps its rows' quantized
blocks as the file has them, and ``ops.gguf_linear`` dequantizes them in registers as it multiplies.

The type is per tensor in a GGUF file (a Q4_K_M model mixes Q4_K, Q6_K and fallbacks such as Q5_0), so a
merged layer (q|k|v, gate|up) may hold partitions of different types: it keeps one segment per run of
partitions of one type, and writes each segment's output columns. Float tensors (F32/F16/BF16) are held in
the model dtype, a float segment; other types fail the load with their name.

Checkpoint tensors per layer (``kvpilot.common.gguf_weights``): ``qweight_type`` (the GGML type id), then
``qweight`` (``[rows, row_bytes]`` uint8). A row split over tensor-parallel ranks cuts the rows' blocks, so
its column boundaries must fall on block boundaries.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from kvpilot.kernels import ops

from . import QuantMethod, ShardSlice, register

if TYPE_CHECKING:
    from ..linear import Linear

_FLOAT = -1  # a segment held dense in the model dtype
# GGML's unquantized tensor types: their rows are the raw values
_FLOAT_TYPES = {0: ("F32", torch.float32), 1: ("F16", torch.float16), 30: ("BF16", torch.bfloat16)}


def _type_name(qtype: int) -> str:
    return _FLOAT_TYPES[qtype][0] if qtype in _FLOAT_TYPES else ops.GGUF_TYPES[qtype][0]


def _row_bytes(qtype: int, cols: int) -> int:
    if qtype in _FLOAT_TYPES:
        return cols * _FLOAT_TYPES[qtype][1].itemsize
    return ops.gguf_row_bytes(qtype, cols)


def _block(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of one block; one element for the float types."""
    if qtype in _FLOAT_TYPES:
        return 1, _FLOAT_TYPES[qtype][1].itemsize
    _, elems, nbytes = ops.GGUF_TYPES[qtype]
    return elems, nbytes


def _dequantize(rows: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    if qtype in _FLOAT_TYPES:
        return rows.contiguous().view(_FLOAT_TYPES[qtype][1]).reshape(rows.shape[0], cols).float()
    return ops.gguf_dequantize(rows.contiguous(), qtype, cols, torch.float32)


@dataclass
class _Segment:
    row: int  # first output row of the layer
    rows: int
    qtype: int  # GGML type id, or _FLOAT
    data: torch.Tensor  # [rows, row_bytes] uint8, or [rows, in] in the model dtype


@register
class GGUFLinearMethod(QuantMethod):
    name = "gguf"
    quantizes_embeddings: ClassVar[bool] = True

    def __init__(self) -> None:
        self.loaded_types: Counter[str] = Counter()  # for the startup log

    def create_weights(self, layer: Linear, *, dtype: torch.dtype, device: torch.device) -> None:
        layer.gguf_dtype = dtype
        layer.gguf_device = device
        layer.gguf_pending = {}  # partition's dst_row -> the type its qweight_type named
        layer.gguf_segments = []

    def checkpoint_names(self) -> tuple[str, ...]:
        return ("qweight_type", "qweight")

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor, part: ShardSlice) -> None:
        if name == "qweight_type":
            qtype = int(tensor.reshape(-1)[0])
            if qtype not in _FLOAT_TYPES and qtype not in ops.GGUF_TYPES:
                known = sorted(name for name, *_ in (*_FLOAT_TYPES.values(), *ops.GGUF_TYPES.values()))
                raise RuntimeError(f"GGML type {qtype} is not one kvpilot reads ({', '.join(known)})")
            layer.gguf_pending[part.dst_row] = qtype
            return
        if name != "qweight":
            raise RuntimeError(f"GGUF layers have no {name!r} tensor")
        if part.dst_row not in layer.gguf_pending:
            raise RuntimeError("qweight came without its qweight_type")
        qtype = layer.gguf_pending.pop(part.dst_row)
        cols = part.ckpt_shape[1]
        row_bytes = _row_bytes(qtype, cols)
        if tensor.dtype != torch.uint8 or tensor.dim() != 2 or tensor.shape[1] != row_bytes:
            raise RuntimeError(f"qweight {tuple(tensor.shape)} {tensor.dtype} is not {cols} columns of "
                               f"{_type_name(qtype)} blocks ({row_bytes} bytes per row)")
        rows = part.take_rows(tensor)
        if part.in_size != cols:  # a tensor-parallel row split: whole blocks of each row only
            block_elems, block_bytes = _block(qtype)
            if part.in_start % block_elems or part.in_size % block_elems:
                raise RuntimeError(f"columns {part.in_start}+{part.in_size} cut through "
                                   f"{_type_name(qtype)} blocks of {block_elems}")
            rows = rows.narrow(1, part.in_start // block_elems * block_bytes,
                               part.in_size // block_elems * block_bytes)
        self.loaded_types[_type_name(qtype)] += 1
        if qtype in _FLOAT_TYPES:  # llama.cpp keeps some tensors unquantized: the float GEMM runs them
            dense = _dequantize(rows, qtype, part.in_size).to(layer.gguf_dtype)
            layer.gguf_segments.append(_Segment(part.dst_row, part.out_size, _FLOAT, dense.to(layer.gguf_device)))
        else:
            data = rows.contiguous().to(layer.gguf_device)
            layer.gguf_segments.append(_Segment(part.dst_row, part.out_size, qtype, data))

    def process_weights_after_loading(self, layer: Linear) -> None:
        if layer.gguf_pending:
            raise RuntimeError(f"qweight_type without its qweight at rows {sorted(layer.gguf_pending)}")
        segments = sorted(layer.gguf_segments, key=lambda s: s.row)
        covered = sum(s.rows for s in segments)
        gaps = any(a.row + a.rows != b.row for a, b in zip(segments, segments[1:], strict=False))
        if covered != layer.out_per_rank or gaps:
            raise RuntimeError(f"GGUF rows loaded {covered} != the layer's {layer.out_per_rank}")
        merged: list[_Segment] = []
        for seg in segments:  # one kernel call per run of one type (all of a layer, in a uniform file)
            if merged and merged[-1].qtype == seg.qtype:
                last = merged[-1]
                merged[-1] = _Segment(last.row, last.rows + seg.rows, seg.qtype, torch.cat([last.data, seg.data]))
            else:
                merged.append(seg)
        layer.gguf_segments = merged
        for i, seg in enumerate(merged):  # as buffers, so that module.buffers() sees the weights
            layer.register_buffer(f"gguf_data_{i}", seg.data, persistent=False)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None) -> torch.Tensor:
        segments = layer.gguf_segments
        if len(segments) == 1:
            return _segment_linear(segments[0], x, bias, residual)
        out = torch.empty(x.shape[0], layer.out_per_rank, dtype=x.dtype, device=x.device)
        for seg in segments:
            part = slice(seg.row, seg.row + seg.rows)
            out[:, part] = _segment_linear(seg, x, None if bias is None else bias[part],
                                           None if residual is None else residual[:, part])
        return out

    def native_blocks(self, layer: Linear) -> list[tuple[int, int, int, torch.Tensor]] | None:
        segments = layer.gguf_segments
        if any(s.qtype == _FLOAT for s in segments):
            return None
        return [(s.row, s.rows, s.qtype, s.data) for s in segments]

    def embed(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        (seg,) = layer.gguf_segments  # an embedding is one tensor, so one segment
        if seg.qtype == _FLOAT:
            return F.embedding(ids, seg.data)
        return ops.gguf_embedding(ids, seg.data, seg.qtype, layer.in_per_rank, layer.gguf_dtype)

    def weight_bytes(self, layer: Linear) -> int:
        return sum(s.data.numel() * s.data.element_size() for s in layer.gguf_segments)

    def describe(self) -> str:
        kinds = ", ".join(f"{name} x{n}" for name, n in self.loaded_types.most_common())
        return f"GGUF ({kinds})" if kinds else "GGUF"


def _segment_linear(seg: _Segment, x: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor | None) -> torch.Tensor:
    if seg.qtype == _FLOAT:
        y = F.linear(x, seg.data, bias)
        return y if residual is None else residual + y
    return ops.gguf_linear(x, seg.data, seg.qtype, bias, residual)
