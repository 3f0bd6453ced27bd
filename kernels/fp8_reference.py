"""FP8 (float8_e4m3fn) weights in torch: the definition the CUDA paths (``fp8``: ``torch._scaled_mm`` and the
Triton kernel) are tested against.

A weight is ``weight`` ``[N, K]`` float8_e4m3fn with float32 scales ``scale [S, KB]``: row ``n`` of the weight
is ``weight[n, k] * scale[scale_row[n], k // block_k]``. Per-channel (and per-tensor, which the caller widens
to one scale per row) is ``scale [N, 1]``, ``block_k = K``, no ``scale_row``; block-wise FP8 (DeepSeek's and
Qwen3's 128x128 blocks) is one scale row per block of output rows, ``scale_row`` saying which is each row's.

Two products:

- ``linear`` (W8A8, per-channel weights): the activations are quantized to e4m3 per token (the row's
  ``amax / 448``, or a static per-tensor ``input_scale``), the fp8 products are summed in float32 and scaled
  by both scales at the end, as ``torch._scaled_mm`` with row-wise scales does.
- ``block_linear`` (W8A16, block weights): the weight is dequantized and multiplied by the activations as
  they are, float32 products and sums.

Both round the product to the activation dtype, then add the bias and the residual in that dtype.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "quantize", "quantize_weight", "dequantize", "linear", "finish_linear",
           "block_linear"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# the floor of a dynamic scale: an all-zero row would otherwise divide 0 by 0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as e4m3 and its float32 scales ``[M, 1]`` (``x ~ xq * scale``): per row ``amax / 448``,
    or the static per-tensor ``scale`` for every row (values past +-448 of ``x / scale`` saturate)."""
    xf = x.float()
    if scale is None:
        s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    else:
        s = scale.float().reshape(1, 1).expand(x.shape[0], 1)
    xq = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, s.contiguous()


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[N, K]`` weight as e4m3 with one float32 scale per row ``[N]`` (``amax / 448``): what
    ``--quantization fp8`` does to a float checkpoint at load."""
    wq, s = quantize(w)
    return wq, s.reshape(-1)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor | None, block_k: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` in ``dtype`` (computed in float32, rounded once) of an e4m3 weight and its scales (module
    docstring)."""
    n, k = weight.shape
    s = scale.float() if scale_row is None else scale.float().index_select(0, scale_row.long())
    if s.shape != (n, -(-k // block_k)):
        raise ValueError(f"scales {tuple(s.shape)} do not cover a [{n}, {k}] weight in blocks of {block_k} columns")
    s = s.repeat_interleave(block_k, dim=1)[:, :k] if s.shape[1] > 1 else s
    return (weight.float() * s).to(dtype)


def finish_linear(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
            residual: torch.Tensor | None) -> torch.Tensor:
    """The float32 product ``[M, N]`` rounded to ``x``'s dtype and shape, then bias and residual added."""
    y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T + bias`` with ``W = weight * weight_scale[:, None]`` (``weight_scale [N]``) and
    ``x`` quantized to e4m3 per token (or by the static ``input_scale``) first."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize(x2, input_scale)
    y = (xq.float() @ weight.float().T) * xs * weight_scale.float().reshape(1, -1)
    return finish_linear(y, x, bias, residual)


def block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor | None,
                 block_k: int, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T + bias`` for the dequantized block-scaled ``W``; ``x`` as it is."""
    w = dequantize(weight, scale, scale_row, block_k)
    y = x.reshape(-1, x.shape[-1]).float() @ w.T
    return finish_linear(y, x, bias, residual)
