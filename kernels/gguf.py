"""GGUF-quantized weights with backend dispatch: the weight stays a uint8 ``[rows, row_bytes]`` matrix of ggml
blocks (``gguf_reference``'s docstring has the layouts), activations stay float.

- ``linear``: ``residual + x @ W.T + bias`` with float32 products and sums, in ``x.dtype``. On the CPU the native
  kernels (``csrc/gguf_gemm_cpu.c``) multiply up to ``NATIVE_MAX_ROWS`` rows of float32 or bfloat16 x against the
  blocks directly, dequantizing each block in registers once per call (a decode step is bound by streaming the
  weight); more rows are a prefill, bound by arithmetic, so tiles of the weight are dequantized into ``x.dtype``
  by the native dequantizer and multiplied by torch's GEMM (oneDNN). With bfloat16 x that GEMM multiplies the
  weights rounded to bfloat16 (the native kernel and the reference use them in float32): results then differ
  from the reference by about bfloat16's rounding of the weights, as a bfloat16 model's dense weights would.
  CUDA tensors go to the Triton kernel (``gguf_triton``); everything else (other dtypes, no compiler) to the
  torch reference.
- ``dequantize``: the float matrix, natively on the CPU (the reference elsewhere).
- ``embedding``: the rows of ``ids`` gathered as blocks, then dequantized.

``KernelSettings.attention_backend`` forces a backend as it does for attention: ``torch`` the reference,
``triton`` the Triton kernel (on CPU tensors only under TRITON_INTERPRET=1, as the tests run it), ``cpu`` the
native kernels where they apply. Bad input (an unsupported type, a ``row_bytes`` that does not match ``cols``,
shapes that do not fit) raises ValueError on every backend.
"""

from __future__ import annotations

import ctypes
import threading
from types import ModuleType

import torch

from . import cpu_native
from . import gguf_reference as reference
from .gguf_reference import GGUF_TYPES, row_bytes
from .lazy import LazyModule
from .settings import current

__all__ = ["GGUF_TYPES", "NATIVE_MAX_ROWS", "supported", "row_bytes", "backend_for", "dequantize", "linear",
           "embedding"]

# Up to this many rows of x (by x's dtype) the native kernel multiplies against the blocks; more go through
# dequantized tiles and torch's GEMM. Measured on one AVX-512 core with SmolLM2's and larger shapes: bfloat16
# tiles run oneDNN's bfloat16 GEMM (AMX / AVX512-BF16 here), which passes the native kernel from 8-12 rows;
# float32 tiles only from ~22.
NATIVE_MAX_ROWS = {torch.float32: 20, torch.bfloat16: 8}
# Bytes of one dequantized tile of the large-M path: a few L2's worth, so the dequantized rows are still cached
# when the GEMM reads them, and enough columns per GEMM call that its fixed cost does not matter.
_TILE_BYTES = 2 << 20
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def supported(qtype: int) -> bool:
    """Whether ``qtype`` (a GGML type id) is one of ``GGUF_TYPES``."""
    return qtype in GGUF_TYPES


_TRITON = LazyModule("gguf_triton")


def _triton() -> ModuleType | None:
    return _TRITON.load()


def backend_for(t: torch.Tensor) -> str:
    """'triton', 'cpu' (the native kernels) or 'torch' (the reference) for a call on tensor ``t``."""
    forced = current().attention_backend
    if forced == "torch":
        return "torch"
    if forced == "triton" or t.is_cuda:
        if _triton() is not None:
            return "triton"
        if forced == "triton":
            raise RuntimeError("attention_backend='triton' but the GGUF Triton kernel cannot be imported")
        return "torch"
    if t.is_cpu and cpu_native.gguf_fn("gguf_gemm_packed") is not None:
        return "cpu"
    return "torch"


def _native_dequantize(qweight: torch.Tensor, qtype: int, cols: int, out: torch.Tensor) -> None:
    """Rows of ``qweight`` (rows contiguous, any row stride) into ``out`` (float32/bfloat16, last dim contiguous)."""
    fn = cpu_native.gguf_fn("gguf_dequant")
    assert fn is not None
    if qweight.shape[0] == 0:
        return
    rc = fn(qtype, qweight.data_ptr(), qweight.stride(0), qweight.shape[0], cols, out.data_ptr(), out.stride(0),
            int(out.dtype is torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the native GGUF dequantizer rejected type {qtype} with {cols} columns (rc {rc})")


def _rows_view(w: torch.Tensor) -> torch.Tensor:
    """``w`` with contiguous rows (the kernels take any row stride)."""
    return w if w.stride(1) == 1 or w.shape[1] <= 1 else w.contiguous()


def dequantize(qweight: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[rows, cols]`` in ``dtype`` from a uint8 ``[rows, row_bytes]`` GGUF weight of type ``qtype``: float32
    arithmetic, rounded once to ``dtype``."""
    reference.check_weight(qweight, qtype, cols)
    if backend_for(qweight) != "cpu":
        return reference.dequantize(qweight, qtype, cols, dtype)
    native = dtype if dtype in _NATIVE_DTYPES else torch.float32
    out = torch.empty((qweight.shape[0], cols), dtype=native)
    _native_dequantize(_rows_view(qweight), qtype, cols, out)
    return out if native is dtype else out.to(dtype)


def _check_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None,
                  residual: torch.Tensor | None, out: torch.Tensor | None) -> None:
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [..., cols], got {x.dtype} {tuple(x.shape)}")
    reference.check_weight(qweight, qtype, x.shape[-1])
    n = qweight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if residual is None and out is None:
        return
    want = (*x.shape[:-1], n)
    if residual is not None and residual.shape != want:
        raise ValueError(f"residual must be {list(want)}, got {tuple(residual.shape)}")
    if out is not None and (out.shape != want or out.dtype is not x.dtype or out.device != x.device):
        raise ValueError(f"out must be {x.dtype} {list(want)} on {x.device}, got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}")


def _as_rows(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t [..., cols]`` as a 2-D matrix with contiguous rows (a view where the layout allows)."""
    if t.dim() == 2 and (t.stride(1) == 1 or cols <= 1):
        return t  # the common case, without the cost of a new view
    t2 = t.reshape(-1, cols)
    return t2 if t2.stride(1) == 1 or cols <= 1 else t2.contiguous()


def linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T + bias`` (each term optional) for ``x [..., cols]`` and the GGUF weight ``qweight``
    (``[rows, row_bytes]``, type ``qtype``, ``cols`` = ``x.shape[-1]``): float32 products and sums, the result in
    ``x.dtype`` ``[..., rows]``. ``out`` (``x.dtype``, that shape; e.g. a column slice of a wider output)
    receives the result instead of a new tensor, and is returned. The native kernels read bias and residual in
    x's dtype (others are converted first)."""
    _check_linear(x, qweight, qtype, bias, residual, out)
    backend = backend_for(x)
    if backend == "cpu" and x.dtype in _NATIVE_DTYPES:
        y = _native_linear(x, qweight, qtype, bias, residual, out)
    else:
        if backend == "triton":
            y = _triton().linear(x, qweight, qtype, bias, residual)  # type: ignore[union-attr]
        else:
            y = reference.linear(x, qweight, qtype, bias, residual)
        if out is not None:
            out.copy_(y)
            y = out
    return y


def _native_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    k, n = x.shape[-1], qweight.shape[0]
    x2 = _as_rows(x, k)
    m = x2.shape[0]
    shape = (m, n) if x.dim() == 2 else (*x.shape[:-1], n)
    y = out if out is not None else torch.empty(shape, dtype=x.dtype)
    if m == 0 or n == 0:
        return y
    # the kernels write rows of contiguous elements at any row stride: out itself where it is such a matrix
    y2 = y if y.dim() == 2 else _matrix_view(y, m, n)
    target = y2 if y2 is not None and (y2.stride(1) == 1 or n == 1) else torch.empty((m, n), dtype=x.dtype)
    w = _rows_view(qweight)
    b = None if bias is None else bias.to(x.dtype).contiguous()
    r = None if residual is None else _as_rows(residual if residual.dtype is x.dtype else residual.to(x.dtype), n)
    if m <= NATIVE_MAX_ROWS[x.dtype]:
        fn = cpu_native.gguf_fn("gguf_gemm_packed")
        assert fn is not None
        args = _packed()
        args[:] = (qtype, w.data_ptr(), w.stride(0), n, k, x2.data_ptr(), x2.stride(0), m,
                   0 if b is None else b.data_ptr(), 0 if r is None else r.data_ptr(), 0 if r is None else r.stride(0),
                   target.data_ptr(), target.stride(0), int(x.dtype is torch.bfloat16), torch.get_num_threads())
        rc = fn(args)
        if rc == -2:
            raise MemoryError("the native GGUF GEMM could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"the native GGUF GEMM rejected type {qtype} with {k} columns (rc {rc})")
    else:
        _tiled_linear(x2, w, qtype, b, r, target)
    if target is not y2:
        y.copy_(target.view(y.shape))
    return y


_tls = threading.local()


def _packed() -> ctypes.Array:
    """This thread's int64 array for the GEMM's packed arguments (one ctypes conversion per call, not 15)."""
    a = getattr(_tls, "args", None)
    if a is None:
        a = _tls.args = (ctypes.c_int64 * 15)()
    return a


def _matrix_view(t: torch.Tensor, m: int, n: int) -> torch.Tensor | None:
    try:
        return t.view(m, n)
    except RuntimeError:  # leading dims that do not flatten into one stride
        return None


def _tiled_linear(x2: torch.Tensor, w: torch.Tensor, qtype: int, bias: torch.Tensor | None,
                  residual: torch.Tensor | None, out: torch.Tensor) -> None:
    """The large-M path: tiles of output rows of the weight dequantized into x's dtype, one torch GEMM each
    (float32 accumulation in oneDNN for bfloat16 too), bias and residual folded into it as addmm's input."""
    k, n = x2.shape[1], w.shape[0]
    tile = max(64, _TILE_BYTES // (k * x2.element_size()))
    scratch = torch.empty((min(tile, n), k), dtype=x2.dtype)
    for n0 in range(0, n, tile):
        n1 = min(n, n0 + tile)
        wt = scratch[: n1 - n0]
        _native_dequantize(w[n0:n1], qtype, k, wt)
        dst = out[:, n0:n1]
        if residual is None and bias is None:
            torch.mm(x2, wt.T, out=dst)
            continue
        add = residual[:, n0:n1] if residual is not None else bias[n0:n1]
        if residual is not None and bias is not None:
            add = add + bias[n0:n1]
        torch.addmm(add, x2, wt.T, out=dst)


def embedding(ids: torch.Tensor, qweight: torch.Tensor, qtype: int, cols: int,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[*ids.shape, cols]`` in ``dtype``: the rows ``ids`` of the GGUF weight (an embedding table), gathered as
    blocks and then dequantized."""
    reference.check_weight(qweight, qtype, cols)
    flat = ids.reshape(-1)
    # checked on the CPU only: on a GPU it would wait for the device (index_select asserts there)
    if flat.is_cpu and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= qweight.shape[0]):
        raise IndexError(f"embedding ids must lie in [0, {qweight.shape[0]}), got {int(flat.min())}..{int(flat.max())}")
    rows = qweight.index_select(0, flat.to(device=qweight.device, dtype=torch.long))
    return dequantize(rows, qtype, cols, dtype).reshape(*ids.shape, cols)
