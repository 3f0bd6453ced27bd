"""GGUF blocks for tests: the ``gguf`` package's own quantizer where it has one (the 32-weight types), and
random valid blocks for the K-quants, whose quantizers exist only in llama.cpp's C. Either way the
``gguf`` package's dequantizer is the reference the kernels and models are held to."""

from __future__ import annotations

import gguf
import numpy as np

# GGML type ids (gguf.GGMLQuantizationType) -> name
TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
K_QUANTS = {12, 13, 14}
# (offset of the fp16 scale fields, how many, their magnitude) per K-quant block, so that random blocks
# dequantize to weights of a trained model's size (|w| around 0.05) rather than fp16 noise up to 65504
_K_SCALES = {12: (0, 2, 2e-4), 13: (0, 2, 1e-4), 14: (208, 1, 5e-5)}


def block_shape(qtype: int) -> tuple[int, int]:
    """(weights, bytes) per block."""
    t = gguf.GGMLQuantizationType(qtype)
    return gguf.GGML_QUANT_SIZES[t]


def quantize(w: np.ndarray, qtype: int, rng: np.random.Generator) -> np.ndarray:
    """``w`` ``[rows, cols]`` float32 as uint8 blocks ``[rows, row_bytes]``: quantized by the ``gguf``
    package, or for the K-quants random blocks of ``w``'s shape (``w``'s values are then not used)."""
    rows, cols = w.shape
    elems, nbytes = block_shape(qtype)
    if cols % elems:
        raise ValueError(f"{TYPES[qtype]} needs columns in multiples of {elems}, got {cols}")
    if qtype not in K_QUANTS:
        return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType(qtype))
    blocks = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    offset, count, size = _K_SCALES[qtype]
    scales = (rng.uniform(0.5, 1.5, size=(rows, cols // elems, count)) * size).astype(np.float16)
    blocks[..., offset:offset + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def dequantize(blocks: np.ndarray, qtype: int) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).astype(np.float32)
