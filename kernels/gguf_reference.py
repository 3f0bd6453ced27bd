"""GGUF-quantized weights in torch: the block layouts' definition, and the reference the native and Triton kernels
are tested against.

A quantized weight is what ``gguf.GGUFReader`` gives as ``tensor.data`` for a 2-D tensor: a uint8 matrix
``[rows, row_bytes]``, rows the output features, each row its blocks along the input dimension (``cols``
elements). The layouts are ggml's (little-endian, fp16 scales):

- ``Q4_0`` (32 per block, 18 bytes): ``d``, then 16 bytes whose low nibbles are elements 0-15 and high nibbles
  16-31; ``w = d * (q - 8)``.
- ``Q4_1`` (32, 20): ``d, m``, the same 16 bytes; ``w = d * q + m``.
- ``Q5_0`` (32, 22): ``d``, ``qh`` (uint32: bit j is element j's fifth bit), the 16 nibble bytes;
  ``w = d * (q - 16)``.
- ``Q5_1`` (32, 24): ``d, m, qh``, the nibbles; ``w = d * q + m``.
- ``Q8_0`` (32, 34): ``d``, 32 int8; ``w = d * q``.
- ``Q4_K`` (256, 144): ``d, dmin``, 12 bytes of eight 6-bit scales and mins (``_k_scales_mins``), 128 bytes: byte
  run ``i`` (32 bytes) holds sub-block ``2i`` in its low nibbles and ``2i+1`` in its high nibbles;
  ``w = d * sc[s] * q - dmin * mn[s]`` per 32-element sub-block ``s``.
- ``Q5_K`` (256, 176): ``d, dmin``, the 12 scale bytes, ``qh`` (32 bytes: bit ``s`` of byte ``l`` is the fifth
  bit of element ``l`` of sub-block ``s``), the 128 nibble bytes as in Q4_K; same formula.
- ``Q6_K`` (256, 210): ``ql`` (128), ``qh`` (64), 16 int8 scales, ``d``. Two halves of 128 elements, each with
  64 ``ql`` and 32 ``qh`` bytes: element ``l + 32 j`` (``l < 32``, ``j < 4``) has low 4 bits from ``ql[l]`` (j
  = 0, 2: low/high nibble) or ``ql[l + 32]`` (j = 1, 3) and high 2 bits ``(qh[l] >> 2j) & 3``;
  ``w = d * sc[e // 16] * (q - 32)``.
"""

from __future__ import annotations

import torch

__all__ = ["GGUF_TYPES", "block_shape", "row_bytes", "check_weight", "dequantize", "linear"]

# GGML type id -> (name, elements per block, bytes per block)
GGUF_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}


def block_shape(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of one block of ``qtype``; ValueError for a type this module does not implement."""
    if qtype not in GGUF_TYPES:
        names = ", ".join(f"{name}={t}" for t, (name, _, _) in GGUF_TYPES.items())
        raise ValueError(f"unsupported GGUF quantization type {qtype!r} (supported: {names})")
    _, elems, nbytes = GGUF_TYPES[qtype]
    return elems, nbytes


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one row of ``cols`` elements; ValueError when ``cols`` is not a whole number of blocks."""
    elems, nbytes = block_shape(qtype)
    if cols <= 0 or cols % elems:
        raise ValueError(f"{GGUF_TYPES[qtype][0]} rows hold whole blocks of {elems} elements; got cols={cols}")
    return cols // elems * nbytes


def check_weight(qweight: torch.Tensor, qtype: int, cols: int) -> None:
    """ValueError unless ``qweight`` is a uint8 ``[rows, row_bytes(qtype, cols)]`` matrix."""
    expected = row_bytes(qtype, cols)
    if qweight.dtype is not torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"a GGUF weight is a uint8 [rows, row_bytes] matrix; got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if qweight.shape[1] != expected:
        raise ValueError(f"{GGUF_TYPES[qtype][0]} weight of {cols} columns has row_bytes {expected}, "
                         f"got {qweight.shape[1]}")


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block, as float32 ``[blocks, 1]``."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> 32 values: the low nibbles (elements 0-15), then the high ones (16-31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes (a little-endian uint32) per block -> bit j of it, times 16, for j < 32."""
    bits = (qh.unsqueeze(2) >> torch.arange(8, dtype=torch.uint8)) & 1  # [blocks, byte, bit]: element 8*byte+bit
    return bits.reshape(qh.shape[0], 32) << 4


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block (int32 ``[blocks, 8]``):
    sub-blocks 0-3 have theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 have the
    low 4 bits in bytes 8-11 (scale: low nibble, min: high nibble) and the top 2 bits in the high 2 bits of
    bytes 0-3 (scales) and 4-7 (mins)."""
    p = packed.to(torch.int32)
    lo_sc, lo_mn, hi = p[:, 0:4], p[:, 4:8], p[:, 8:12]
    scales = torch.cat([lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)], dim=1)
    mins = torch.cat([lo_mn & 63, (hi >> 4) | ((lo_mn >> 6) << 4)], dim=1)
    return scales, mins


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return (_nibbles(b[:, 2:18]).float() - 8) * _f16(b, 0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:20]).float() * _f16(b, 0) + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6])
    return (q.float() - 16) * _f16(b, 0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8])
    return q.float() * _f16(b, 0) + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)


def _k_quant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: ``q`` [blocks, 8 sub-blocks, 32] values -> d * sc * q - dmin * mn."""
    scales, mins = _k_scales_mins(b[:, 4:16])
    d_sc = _f16(b, 0) * scales.float()  # [blocks, 8], as ggml: d * sc first
    dmin_mn = _f16(b, 2) * mins.float()
    return (d_sc.unsqueeze(2) * q.float() - dmin_mn.unsqueeze(2)).reshape(b.shape[0], 256)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [blocks, 8, 32]: run i (32 bytes) gives sub-block 2i (low nibbles) and 2i+1 (high)."""
    runs = qs.reshape(qs.shape[0], 4, 1, 32)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(qs.shape[0], 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_quant(b, _k_nibbles(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48]  # [blocks, 32]: bit s of byte l -> sub-block s, element l
    high = ((qh.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1) << 4
    return _k_quant(b, _k_nibbles(b[:, 48:176]) | high)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [blocks, half, run (ql[l] or ql[l + 32]), l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low = torch.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    q = low | (((qh >> shifts) & 3) << 4)  # [blocks, half, j, l]: element 128 * half + 32 * j + l
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [blocks, 16]: one per 16 elements
    d_sc = (_f16(b, 208) * scales).repeat_interleave(16, dim=1)
    return d_sc * (q.reshape(n, 256).float() - 32)


_DEQUANT = {2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0, 12: _q4_k, 13: _q5_k, 14: _q6_k}


def dequantize(qweight: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[rows, cols]`` in ``dtype`` (computed in float32, rounded once) from a uint8 ``[rows, row_bytes]``
    GGUF weight of type ``qtype``."""
    check_weight(qweight, qtype, cols)
    elems, nbytes = block_shape(qtype)
    rows = qweight.shape[0]
    blocks = qweight.reshape(rows * (cols // elems), nbytes)
    return _DEQUANT[qtype](blocks).reshape(rows, cols).to(dtype)


def linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T + bias`` (each term optional) for ``x [..., cols]`` and the dequantized weight ``W``
    ``[rows, cols]``: float32 products and sums, the result in ``x.dtype``."""
    cols = x.shape[-1]
    w = dequantize(qweight, qtype, cols)
    y = x.reshape(-1, cols).float() @ w.T
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.reshape(y.shape).float()
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
