"""Linear layers with weights prepacked for oneDNN on the CPU.

A plain ``F.linear`` on the CPU repacks the weight matrix into the GEMM kernel's panel layout on every
call, a large share of a small decode step's GEMM. oneDNN can keep the weight in its blocked layout once and
for all (what inductor's ``freezing`` does for CPU models): float32, and bfloat16 where oneDNN has bfloat16
kernels for the CPU (AVX512-BF16 or AMX), unless the engine's ``prepack_weights`` is off
(bench/results/profile_prepack.md). A packed weight is an opaque oneDNN tensor: it has a shape and a size
but no strided storage, so only ``linear`` below may read it.

Steps of a few rows only stream the weights, and oneDNN reads them well below the host's streaming rate.
There ``linear`` takes the weight's panels (``ops.pack_panels``), when the model kept them, to
``ops.panel_gemm``, up to ``small_batch_rows()`` rows (bench/results/serving_vllm_panels.md). The panels
are a second copy of each GEMM weight, so the models keep them only where ``keep_panels`` allows.

Both switches come from the kernel settings the engine configured at start (``ops.current()``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvpilot.kernels import ops

__all__ = ["linear", "prepack_supported", "prepack", "keep_panels", "small_batch_rows"]

_PANELS_MEMORY_SHARE = 0.1  # the second copy may take up to this share of the machine's memory


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if not ops.current().prepack_weights:
        return False
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # noqa: SLF001 - oneDNN's own probe
    return dtype == torch.float32


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's layout for any row count (no batch-size hint: decode and prefill
    steps of every size share one copy)."""
    # oneDNN's linear ops are public only under these names (the ones inductor's CPU freezing calls)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)  # noqa: SLF001


def small_batch_rows() -> int:
    """Steps of up to this many rows use the panels (0: no kernel). A constant of the native build, read
    once: this is asked on every GEMM of every step."""
    return ops.panel_gemm_max_rows()


def keep_panels(extra_bytes: int) -> bool:
    """Whether a model may keep panel copies of its packed weights (``extra_bytes`` in all) for small
    steps: the native kernel is there and the copies take at most a tenth of physical memory, unless the
    ``small_batch_gemm`` setting says always (True) or never (False)."""
    setting = ops.current().small_batch_gemm
    if setting is False or not ops.native_available():
        return False
    if setting is True:
        return True
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf figures: do not guess
        return False
    return extra_bytes <= _PANELS_MEMORY_SHARE * physical


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           panels: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that also takes a prepacked weight, and for small steps its panels when kept. With
    ``residual`` (``[rows, out]``), ``residual + F.linear(...)``: the GEMM adds it as it writes its output,
    which saves a pass over both, with the same results."""
    if panels is not None and x.shape[0] <= small_batch_rows():
        y = ops.panel_gemm(x, panels, weight.shape[0], bias, residual)
        if y is not None:
            return y
    if weight.is_mkldnn:
        if not x.is_contiguous():
            x = x.contiguous()
        if residual is not None and residual.is_contiguous() and residual.dtype == x.dtype:
            # oneDNN's binary post-op (inductor's CPU freezing fuses a residual add the same way)
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")  # noqa: SLF001
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # noqa: SLF001
    else:
        y = F.linear(x, weight, bias)
    return y if residual is None else residual + y
