"""4-bit weights with a scale and a zero point per group of input columns (AWQ, GPTQ), run as GGUF Q4_1
blocks by ``ops.gguf_linear`` (the native CPU kernel, Triton on CUDA).

Both formats mean ``W[n, k] = s[g, n] * (q[k, n] - z[g, n])`` for the group ``g`` of input column ``k``; they
differ in how ``q`` and ``z`` are packed into int32s, and GPTQ's groups may be scattered over the columns
(``g_idx``, desc_act). A subclass unpacks each checkpoint tensor to an output-major form (dim 0 the output
rows: ``q [out, in]``, ``z``/``s [out, groups]``); this module takes the rank's rows (``take_rows``, which also
applies the model's row order) and columns, and repacks the layer as soon as all its tensors are in (else at
``process_weights_after_loading``, which also names what is missing):

- columns sorted by group (a stable sort of ``g_idx``; none where it is in order already), so that every
  32 columns share one group, and ``apply`` permutes the activations' columns the same way;
- each 32 columns of a row become one Q4_1 block: ``d = s`` (the checkpoint's fp16 scale, exact), ``m = -s*z``
  rounded to fp16, and the 4-bit ``q`` as they are. ``d*q + m`` is then ``s*(q - z)`` up to that one rounding
  of ``m``: at most ``2^-11 |s*z|`` (half an fp16 ulp; ``z <= 16`` so under ``|s|/128``, a 128th of one
  quantization step), plus ``2^-25`` where ``s*z`` is below fp16's normal range.

A layer's group size must be a multiple of 32 (or the whole row), and a tensor-parallel rank's columns whole
blocks of 32 of one group each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvpilot.kernels import ops

from . import QuantMethod, ShardSlice
from .fp8 import module_matches

if TYPE_CHECKING:
    from ..linear import Linear

__all__ = ["Int4LinearMethod", "Q4_1", "pack_q4_1", "unpack_nibbles"]

Q4_1 = 3  # the GGML type id of the blocks the layers keep
_BLOCK = 32  # columns per Q4_1 block
_UNSET = 255  # a q or z entry no checkpoint tensor has written


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., c]`` -> uint8 ``[..., c, 8]``: nibble i (bits 4i..4i+3) of each int32 at index i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 rows (uint8 ``[N, K/32*20]``) of 4-bit values ``q [N, K]`` (uint8 0..15) with fp16 ``d`` and
    ``m`` ``[N, K/32]`` per block: ``d``, ``m`` (little-endian fp16), then 16 bytes whose byte j holds
    element j in its low nibble and element j+16 in its high one."""
    n, k = q.shape
    blocks = k // _BLOCK
    qb = q.reshape(n, blocks, _BLOCK)
    qs = qb[..., :16] | (qb[..., 16:] << 4)
    d_bytes = d.to(torch.float16).contiguous().view(torch.uint8).reshape(n, blocks, 2)
    m_bytes = m.to(torch.float16).contiguous().view(torch.uint8).reshape(n, blocks, 2)
    return torch.cat([d_bytes, m_bytes, qs], dim=-1).reshape(n, blocks * 20)


class Int4LinearMethod(QuantMethod):
    """The shared half of AWQ and GPTQ: storage, slicing, the Q4_1 repack and the product."""

    format_name: ClassVar[str]

    def __init__(self, *, group_size: int, ignore: tuple[str, ...] = (), details: str = "") -> None:
        self.group_size = group_size  # -1: one group per row
        self.ignore = ignore
        self.details = details

    # -- the subclass's format

    def unpack(self, name: str, tensor: torch.Tensor, part: ShardSlice) -> torch.Tensor:
        """Checkpoint tensor ``name`` in output-major form (``q [out, in]``, ``z [out, groups]`` uint8,
        ``s [out, groups]`` fp16, of all the stored rows); RuntimeError naming it when the shape is not the
        format's."""
        raise NotImplementedError

    # -- shared

    @staticmethod
    def config_int(qc: dict[str, Any], *keys: str, default: int | None = None) -> int:
        """The first of ``keys`` in ``qc`` as an int; ValueError naming the field where it is missing."""
        for key in keys:
            if qc.get(key) is not None:
                return int(qc[key])
        if default is None:
            raise ValueError(f"quantization_config.{keys[0]} is missing")
        return default

    @classmethod
    def check_config(cls, bits: int, group_size: int) -> None:
        if bits != 4:
            raise ValueError(f"quantization_config.bits {bits} is not supported ({cls.format_name}: 4-bit only)")
        if group_size != -1 and (group_size <= 0 or group_size % _BLOCK):
            raise ValueError(f"quantization_config.group_size {group_size} is not supported ({cls.format_name} "
                             f"runs as Q4_1 blocks of {_BLOCK}: a multiple of {_BLOCK}, or -1)")

    def skips(self, prefix: str) -> bool:
        return any(module_matches(entry, prefix) for entry in self.ignore)

    def groups(self, in_features: int) -> int:
        size = self.group_size if self.group_size > 0 else in_features
        return -(-in_features // size)

    def group_of(self, columns: torch.Tensor, in_features: int) -> torch.Tensor:
        """The group of each input column where the columns are in order (no ``g_idx``)."""
        size = self.group_size if self.group_size > 0 else in_features
        return (columns // size).to(torch.int32)

    def describe(self) -> str:
        group = "per row" if self.group_size == -1 else f"group {self.group_size}"
        return f"{self.format_name} (4-bit, {group}{self.details}; as Q4_1 blocks)"

    def create_weights(self, layer: Linear, *, dtype: torch.dtype,  # noqa: ARG002 - Q4_1 blocks, any dtype
                       device: torch.device) -> None:
        rows, cols = layer.out_per_rank, layer.in_per_rank
        if cols % _BLOCK or layer.in_start % _BLOCK:
            raise ValueError(f"{self.format_name} layers run as Q4_1 blocks of {_BLOCK} input columns: this "
                             f"rank's columns {layer.in_start}:{layer.in_start + cols} of {layer.in_features} "
                             "are not whole blocks")
        groups = self.groups(layer.in_features)
        layer.int4_device = device
        layer.int4_g_loaded = False
        layer.int4_loaded = set()  # (tensor name, partition's first row) pairs in
        # the checkpoint's values, unpacked on the host until the layer is repacked
        layer.int4_staged = {
            "q": torch.full((rows, cols), _UNSET, dtype=torch.uint8),
            "z": torch.full((rows, groups), _UNSET, dtype=torch.uint8),
            "s": torch.full((rows, groups), float("nan"), dtype=torch.float16),
            "g": self.group_of(torch.arange(layer.in_start, layer.in_start + cols), layer.in_features),
        }
        layer.register_buffer("qweight", None)
        layer.register_buffer("act_perm", None)

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor, part: ShardSlice) -> None:
        staged = getattr(layer, "int4_staged", None)
        if staged is None:
            raise RuntimeError(f"{name}: this {self.format_name} layer is already repacked")
        if name not in self.checkpoint_names():
            raise RuntimeError(f"{self.format_name} layers have no {name!r} tensor")
        if name == "g_idx":
            staged["g"] = self.load_g_idx(tensor, part, layer)
        else:
            rows = part.take_rows(self.unpack(name, tensor.cpu(), part))
            key = {"qweight": "q", "qzeros": "z", "scales": "s"}[name]
            if key == "q":
                rows = rows.narrow(1, part.in_start, part.in_size)
            staged[key][part.dst_row:part.dst_row + part.out_size] = rows
        layer.int4_loaded.add((name, part.dst_row))
        # repacked as soon as the layer is whole: the unpacked byte a weight then lives for one layer at a time,
        # not for the whole model until load_weights ends
        if len(layer.int4_loaded) == len(self.checkpoint_names()) * len(layer.partitions):
            self.process_weights_after_loading(layer)

    def load_g_idx(self, tensor: torch.Tensor, part: ShardSlice, layer: Linear) -> torch.Tensor:
        """This rank's columns' groups from a checkpoint's ``g_idx [in]``."""
        cols = part.ckpt_shape[1]
        if tensor.dim() != 1 or tensor.shape[0] != cols or tensor.is_floating_point():
            raise RuntimeError(f"g_idx {tuple(tensor.shape)} {tensor.dtype} != expected ({cols},) int32")
        groups = self.groups(cols)
        if int(tensor.min()) < 0 or int(tensor.max()) >= groups:
            raise RuntimeError(f"g_idx holds groups {int(tensor.min())}..{int(tensor.max())} outside 0..{groups - 1}")
        local = tensor.narrow(0, part.in_start, part.in_size).to(torch.int32)
        # merged partitions (q|k|v) read the same input columns: their g_idx must agree
        if layer.int4_g_loaded and not torch.equal(local, layer.int4_staged["g"]):
            raise RuntimeError("g_idx differs between the partitions of one merged layer")
        layer.int4_g_loaded = True
        return local

    def process_weights_after_loading(self, layer: Linear) -> None:
        staged = getattr(layer, "int4_staged", None)
        if staged is None:  # repacked when its last tensor came in
            return
        q, z, s, g = staged["q"], staged["z"], staged["s"], staged["g"].long()
        for key, tensor, missing in (("qweight", q, q == _UNSET), ("qzeros", z, z == _UNSET),
                                     ("scales", s, s.isnan())):
            if bool(missing.any()):
                rows = missing.any(dim=1).nonzero().flatten()
                raise RuntimeError(f"{self.format_name} layer without {key} for rows {rows[:4].tolist()}"
                                   f"{' ...' if len(rows) > 4 else ''} of {tensor.shape[0]}")
        perm = torch.argsort(g, stable=True)
        if torch.equal(perm, torch.arange(len(g))):
            perm = None
        else:  # desc_act: groups made contiguous, the activations' columns permuted alike at apply
            q, g = q.index_select(1, perm), g.index_select(0, perm)
        block_groups = g.reshape(-1, _BLOCK)
        if not bool((block_groups == block_groups[:, :1]).all()):
            split = " (a tensor-parallel rank's share of desc_act groups)" if layer.in_per_rank != layer.in_features \
                else ""
            raise RuntimeError(f"{self.format_name}: this layer's groups are not whole blocks of {_BLOCK} input "
                               f"columns{split}, which Q4_1 blocks need")
        group = block_groups[:, 0]
        d = s.index_select(1, group)
        m = -(d.float() * z.index_select(1, group).float())  # exact in float32; the one rounding is to fp16
        packed = pack_q4_1(q, d, m.to(torch.float16))
        layer.register_buffer("qweight", packed.to(layer.int4_device), persistent=False)
        layer.register_buffer("act_perm", None if perm is None else perm.to(layer.int4_device), persistent=False)
        del layer.int4_staged

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None) -> torch.Tensor:
        if layer.act_perm is not None:
            x = x.index_select(-1, layer.act_perm)
        return ops.gguf_linear(x, layer.qweight, Q4_1, bias, residual)

    def native_blocks(self, layer: Linear) -> list[tuple[int, int, int, torch.Tensor]] | None:
        if layer.act_perm is not None or layer.qweight is None:  # desc_act permutes the activations first
            return None
        return [(0, layer.qweight.shape[0], Q4_1, layer.qweight)]

    def weight_bytes(self, layer: Linear) -> int:
        tensors = [layer.qweight, layer.act_perm] if layer.qweight is not None else \
            list(getattr(layer, "int4_staged", {}).values())
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def check_packed(name: str, tensor: torch.Tensor, shape: tuple[int, int], layout: str) -> None:
    """RuntimeError naming ``name`` unless it is an int32 tensor of ``shape``."""
    if tensor.dtype != torch.int32 or tuple(tensor.shape) != shape:
        raise RuntimeError(f"{name} {tuple(tensor.shape)} {tensor.dtype} != expected {shape} int32 ({layout})")


def check_scales(tensor: torch.Tensor, groups: int, out: int) -> torch.Tensor:
    """``scales [groups, out]`` as fp16 ``[out, groups]``; RuntimeError naming it otherwise."""
    if not tensor.is_floating_point() or tuple(tensor.shape) != (groups, out):
        raise RuntimeError(f"scales {tuple(tensor.shape)} {tensor.dtype} != expected ({groups}, {out}) float16 "
                           "(one per group and output column)")
    return tensor.to(torch.float16).T
