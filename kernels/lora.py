"""Batched LoRA for a mixed batch: ``lora_shrink_expand`` adds, to each row of a linear layer's output, its
own adapter's low-rank update, with the rows grouped into segments by adapter (the punica/SGMV design).

Caller contract (every backend):
- ``x`` ``[T, in]`` and ``y`` ``[T, out]`` (the base layer's output, updated in place) are row-major with a
  contiguous last dim; ``lora_a`` ``[S, R, in]`` and ``lora_b`` ``[S, out, R]`` hold the adapters of the S
  device slots, zero-padded to rank R, their scale (alpha / r) folded into ``lora_b``; dtype of ``x``.
- ``segments`` splits the T rows into runs of one slot each (-1: the base model, nothing added).
Shapes, dtypes or slots that do not fit raise ValueError on every backend.

Backends (``backend_for``): CUDA tensors go to the Triton shrink and expand kernels (``lora_triton``); float32
and bfloat16 CPU tensors to the native kernel (``csrc/lora_cpu.c``: every segment of a layer in one call) for
segments of up to ``NATIVE_MAX_ROWS`` rows, longer ones (a prefill's) to the torch reference, whose oneDNN GEMM
is faster there; everything else to the reference. ``KernelSettings.attention_backend`` forces one as it does
for attention (``triton`` on CPU tensors is how tests run it under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from . import cpu_native, lora_reference
from .lazy import LazyModule
from .settings import current

__all__ = ["NATIVE_MAX_ROWS", "LoRASegments", "backend_for", "lora_shrink_expand"]

# Up to this many rows a segment goes to the native kernel, more to torch's GEMM (oneDNN). Measured with one
# segment of SmolLM2-135M's q|k|v shape at R = 16 on 2 AVX-512 cores (bench/lora_kernels.py, torch's time
# over the kernel's): float32 is about level from 64 to 128 rows (x1.06 .. x0.98) and behind from 160 (x0.94);
# bfloat16's oneDNN GEMM (AMX) costs ~55 us more a call but less a row: the kernel leads to 128 (x1.23), is level
# at 160 and behind from 192 (x0.93). The higher end of each tie: a row gives the same bits in any segment the
# kernel takes.
NATIVE_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 160}


@dataclass(frozen=True, eq=False)
class LoRASegments:
    """Runs of rows with one adapter slot each: segment i is rows ``[starts[i], starts[i + 1])`` with slot
    ``slots[i]`` (-1 for the base model). Host arrays (the CPU paths loop over them without a device sync),
    read-only once made: what the kernels derive from them (the checked table, the device copies the GPU kernels
    read) is made on first use and kept with the object, which a step's layers share."""

    starts: np.ndarray  # int64 [N + 1], starts[0] == 0, non-decreasing
    slots: np.ndarray  # int64 [N]

    @classmethod
    def from_row_slots(cls, row_slots: np.ndarray) -> LoRASegments:
        """The runs of equal values in ``row_slots`` (one slot per row)."""
        row_slots = np.asarray(row_slots, dtype=np.int64)
        if row_slots.ndim != 1:
            raise ValueError(f"row_slots must be 1-D, got shape {row_slots.shape}")
        if row_slots.size == 0:
            return cls(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
        cut = np.flatnonzero(row_slots[1:] != row_slots[:-1]) + 1
        starts = np.concatenate(([0], cut, [row_slots.size])).astype(np.int64)
        return cls(starts, row_slots[starts[:-1]])

    @cached_property
    def table(self) -> np.ndarray:
        """starts then slots in one checked, contiguous int64 array (what the native kernel reads)."""
        starts, slots = np.asarray(self.starts), np.asarray(self.slots)
        if starts.ndim != 1 or slots.ndim != 1 or starts.size != slots.size + 1:
            raise ValueError(f"segments need starts [N + 1] and slots [N], got {starts.shape} and {slots.shape}")
        if starts[0] != 0 or (np.diff(starts) < 0).any() or (slots < -1).any():
            raise ValueError("segment starts must begin at 0 and not decrease, and slots be >= -1")
        table = np.ascontiguousarray(np.concatenate((starts, slots)), dtype=np.int64)
        table.flags.writeable = False
        return table

    @cached_property
    def table_address(self) -> int:
        """The table's address, for the native kernel (numpy's lookup costs a microsecond: once per batch)."""
        return self.table.ctypes.data

    @cached_property
    def num_segments(self) -> int:
        return (self.table.size - 1) // 2

    @cached_property
    def num_rows(self) -> int:
        return int(self.table[self.num_segments])

    @cached_property
    def any_adapter(self) -> bool:
        return bool((self.table[self.num_segments + 1:] >= 0).any())

    @cached_property
    def max_slot(self) -> int:
        return int(self.table[self.num_segments + 1:].max(initial=-1))

    @cached_property
    def max_segment_rows(self) -> int:
        """The most rows of an adapter's segment (0 without one): the GPU kernels' grid."""
        n = self.num_segments
        lengths = np.diff(self.table[: n + 1])[self.table[n + 1:] >= 0]
        return int(lengths.max(initial=0))

    @cached_property
    def lists(self) -> tuple[list[int], list[int]]:
        """starts and slots as lists (the reference's loop)."""
        n = self.num_segments
        return self.table[: n + 1].tolist(), self.table[n + 1:].tolist()

    def longer_than(self, rows: int) -> list[tuple[int, int, int]]:
        """(start, end, slot) of each segment with an adapter and more than ``rows`` rows, kept per ``rows``."""
        cache = self.__dict__.setdefault("_longer", {})
        hit = cache.get(rows)
        if hit is None:
            starts, slots = self.lists
            hit = cache[rows] = [(starts[i], starts[i + 1], slot) for i, slot in enumerate(slots)
                                 if slot >= 0 and starts[i + 1] - starts[i] > rows]
        return hit

    def device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 copies of starts and slots on ``device`` (the GPU kernels read the slot of their segment),
        made on first use per device."""
        cache = self.__dict__.setdefault("_device", {})
        hit = cache.get(device)
        if hit is None:
            n = self.num_segments
            t32 = torch.from_numpy(self.table.astype(np.int32)).to(device)
            hit = cache[device] = (t32[: n + 1], t32[n + 1:])
        return hit

    def narrow(self, start: int, end: int) -> LoRASegments:
        """The segments of rows ``[start, end)``, renumbered from 0; an end past the last row is clipped, as
        slicing does."""
        if start < 0 or end < start:
            raise ValueError(f"narrow({start}, {end}): rows must satisfy 0 <= start <= end")
        n = self.num_segments
        starts = np.clip(self.table[: n + 1], start, end) - start
        keep = starts[1:] > starts[:-1]
        return LoRASegments(np.concatenate(([0], starts[1:][keep])).astype(np.int64), self.table[n + 1:][keep])


_TRITON = LazyModule("lora_triton")
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def backend_for(t: torch.Tensor) -> str:
    """'triton', 'cpu' (the native kernel) or 'torch' (the reference) for a call on tensor ``t``."""
    forced = current().attention_backend
    if forced == "torch":
        return "torch"
    if forced == "triton" or t.is_cuda:
        if _TRITON.load() is not None:
            return "triton"
        if forced == "triton":
            raise RuntimeError(f"attention_backend='triton' but the LoRA Triton kernels cannot load: {_TRITON.error}")
        return "torch"
    if t.is_cpu and t.dtype in _NATIVE_DTYPES and cpu_native.lora_fn() is not None:
        return "cpu"
    return "torch"


def _shapes(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
            segments: LoRASegments) -> tuple[int, int, int, int, int]:
    """(T, in, out, R, S), or ValueError where the tensors do not fit together and with ``segments``. Each shape
    is read once: the engine makes ~120 of these calls per step."""
    xs, ys, sa, sb = x.shape, y.shape, lora_a.shape, lora_b.shape
    if not (len(xs) == len(ys) == 2 and len(sa) == len(sb) == 3
            and (sb[0], sb[2], xs[1], ys[1], xs[0], ys[0]) == (sa[0], sa[1], sa[2], sb[1], segments.num_rows, xs[0])
            and segments.max_slot < sa[0]):
        raise ValueError(f"lora_shrink_expand: y {tuple(ys)}, x {tuple(xs)}, lora_a {tuple(sa)} and lora_b "
                         f"{tuple(sb)} do not fit [T, out], [T, in], [S, R, in], [S, out, R] with segments of "
                         f"{segments.num_rows} rows and slots up to {segments.max_slot}")
    if not (x.dtype is y.dtype is lora_a.dtype is lora_b.dtype):
        raise ValueError(f"lora_shrink_expand needs one dtype, got y {y.dtype}, x {x.dtype}, lora_a {lora_a.dtype}, "
                         f"lora_b {lora_b.dtype}")
    return xs[0], xs[1], ys[1], sa[1], sa[0]


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       segments: LoRASegments) -> None:
    """``y[rows] += x[rows] @ lora_a[slot].T @ lora_b[slot].T`` per segment, in place."""
    shapes = _shapes(y, x, lora_a, lora_b, segments)
    if not segments.any_adapter:
        return
    backend = backend_for(x)
    if backend == "triton":
        _TRITON.module.lora_shrink_expand(y, x, lora_a, lora_b, segments)  # type: ignore[union-attr]
        return
    if backend == "cpu" and _native(y, x, lora_a, lora_b, segments, shapes):
        return
    starts, slots = segments.lists
    lora_reference.lora_shrink_expand(y, x, lora_a, lora_b, starts, slots)


_tls = threading.local()


def _packed() -> ctypes.Array:
    """This thread's int64 array for the kernel's packed arguments, made on its first call (one ctypes
    conversion per call, not 16)."""
    a = _tls.args = (ctypes.c_int64 * 16)()
    return a


def _native(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, segments: LoRASegments,
            shapes: tuple[int, int, int, int, int]) -> bool:
    """The native kernel for the segments of up to NATIVE_MAX_ROWS rows and the reference for longer ones;
    False, with nothing done, where the tensors are not what the kernel reads."""
    x_rows, x_cols = x.stride()
    y_rows, y_cols = y.stride()
    if not ((x_cols == 1 or shapes[1] <= 1) and (y_cols == 1 or shapes[2] <= 1) and y.is_cpu and lora_a.is_cpu
            and lora_b.is_cpu and lora_a.is_contiguous() and lora_b.is_contiguous()):
        return False
    dtype = x.dtype
    max_rows = NATIVE_MAX_ROWS[dtype]
    t, k, n, r, s = shapes
    args = getattr(_tls, "args", None) or _packed()
    args[:] = (y.data_ptr(), y_rows, x.data_ptr(), x_rows, lora_a.data_ptr(), lora_b.data_ptr(), t, k, n, r, s,
               segments.table_address, segments.num_segments, max_rows, dtype is torch.bfloat16,
               torch.get_num_threads())
    rc = cpu_native.lora_fn()(args)  # type: ignore[misc]
    if rc == -1:
        raise MemoryError("the native LoRA kernel could not allocate its scratch")
    if rc != 0:
        raise ValueError(f"the native LoRA kernel rejected the segments (rc {rc})")
    if segments.max_segment_rows > max_rows:  # the kernel skipped these: torch's GEMM is faster there
        for start, end, slot in segments.longer_than(max_rows):
            lora_reference.lora_shrink_expand(y, x, lora_a, lora_b, [start, end], [slot])
    return True
