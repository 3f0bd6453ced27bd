"""FP8 GEMMs with backend dispatch: ``torch._scaled_mm`` and a Triton kernel on CUDA, the torch reference
elsewhere (``fp8_reference``'s docstring defines the weight layout and both products).

- ``linear`` (per-channel e4m3 weights, W8A8): on CUDA GPUs with fp8 tensor cores (compute capability 8.9 and
  up) the activations are quantized per token (or by the static input scale) and ``torch._scaled_mm`` runs
  with row-wise scales. Where it cannot (older GPUs, K or N not a multiple of 16) the weight-only Triton
  kernel runs instead, which leaves the activations unquantized.
- ``block_linear`` (block-scaled weights, W8A16): the Triton kernel on CUDA.

``KernelSettings.attention_backend`` forces a backend as it does for attention: ``torch`` the reference,
``triton`` the Triton kernel (on CPU tensors only under TRITON_INTERPRET=1, as the tests run it).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from . import fp8_reference as reference
from .lazy import LazyModule
from .settings import current

__all__ = ["quantize", "quantize_weight", "dequantize", "linear", "block_linear", "scaled_mm_linear"]

quantize = reference.quantize
quantize_weight = reference.quantize_weight
dequantize = reference.dequantize


_TRITON = LazyModule("fp8_triton")


def _triton() -> ModuleType | None:
    return _TRITON.load()


def _use_triton(x: torch.Tensor, block_k: int) -> bool:
    forced = current().attention_backend
    if forced == "torch" or not (x.is_cuda or forced == "triton"):
        return False
    mod = _triton()
    if mod is None:
        if forced == "triton":
            raise RuntimeError("attention_backend='triton' but the FP8 Triton kernel cannot be imported")
        return False
    return mod.tile_k(block_k) is not None


@functools.cache
def _has_fp8_mma(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.linear`` through ``torch._scaled_mm``: activations quantized per token, the weight as
    ``[K, N]`` column-major (its ``[N, K]`` rows transposed in place), row-wise float32 scales ``[M, 1]`` and
    ``[1, N]``. Row-wise scaling writes bfloat16 only; other dtypes are cast from it."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = reference.quantize(x2, input_scale)
    scale_b = weight_scale.float().reshape(1, -1).contiguous()
    # torch's fp8 GEMM is only public under this name (vLLM and torchao call it so)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale_b, out_dtype=torch.bfloat16)  # noqa: SLF001
    return reference.finish_linear(y, x, bias, residual)


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T + bias`` for an e4m3 ``weight [N, K]`` with one float32 scale per row
    (``weight_scale [N]``); ``input_scale`` a static activation scale (else dynamic per token)."""
    n, k = weight.shape
    if x.is_cuda and current().attention_backend != "torch":
        if _has_fp8_mma(x.device.index or 0) and k % 16 == 0 and n % 16 == 0:
            return scaled_mm_linear(x, weight, weight_scale, input_scale, bias, residual)
        if _use_triton(x, k):
            return _triton().block_linear(x, weight, weight_scale.reshape(-1, 1), None, k, bias, residual)
    return reference.linear(x, weight, weight_scale, input_scale, bias, residual)


def block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor | None,
                 block_k: int, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T + bias`` for an e4m3 ``weight [N, K]`` with block scales (``scale [S, KB]``, row
    ``n`` scaled by ``scale[scale_row[n]]``, ``block_k`` columns per scale column); ``x`` unquantized."""
    if _use_triton(x, block_k):
        return _triton().block_linear(x, weight, scale, scale_row, block_k, bias, residual)
    return reference.block_linear(x, weight, scale, scale_row, block_k, bias, residual)
