"""What the Triton GEMM-like kernels (MoE, FP8, LoRA) share: the ``tl.dot`` precision for an activation dtype.

The interpreter multiplies exactly; float32 on the GPU takes the configured precision where there are tf32
tensor cores (exact products before them, compute capability < 8.0); 16-bit inputs get the compiler's
default, which it ignores for them.
"""

from __future__ import annotations

import functools
import os

import torch

from .settings import current

# @triton.jit reads TRITON_INTERPRET when triton is imported; remember what it saw
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(t: torch.Tensor) -> str:
    """``tl.dot``'s ``input_precision`` for activations like ``t``."""
    if INTERPRET:
        return "ieee"
    if t.dtype != torch.float32:
        return "tf32"
    precision = current().triton_fp32_precision
    if precision.startswith("tf32") and _capability(t.device.index or 0) < (8, 0):
        return "ieee"
    return precision


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
