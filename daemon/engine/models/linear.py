"""Linear layers with weights prepacked for oneDNN on the CPU.

A plain ``F.linear`` on the CPU repacks the weight matrix into the GEMM kernel's panel layout on
every call. For the small row counts of decode steps (8-256 rows against 576x3072 weights) that
repacking is a large share of the call: the weight is read and written once more for a few rows of
output. oneDNN can keep the weight in its blocked layout once and for all (what inductor's
``freezing`` does for CPU models). Measured on 2 AVX2 cores: the LM head 1.3-1.9x faster at 8-96
rows, gate/up and down 1.1-1.4x, q/k/v and o unchanged.

Only float32 on the CPU is packed (the dtype this engine picks there); ``KVPILOT_PREPACK_WEIGHTS=0``
turns it off. A packed weight is an opaque oneDNN tensor: it has a shape and a size but no strided
storage, so only ``linear`` below may read it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

__all__ = ["linear", "prepack_supported", "prepack"]

_ENV = "KVPILOT_PREPACK_WEIGHTS"


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if os.environ.get(_ENV, "").strip() == "0":
        return False
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's layout for any row count (no batch-size hint: decode and prefill
    steps of every size share one copy)."""
    # oneDNN's linear ops are public only under these names (the ones inductor's CPU freezing calls)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)  # noqa: SLF001


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that also takes a prepacked weight."""
    if weight.is_mkldnn:
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # noqa: SLF001
    return F.linear(x, weight, bias)
