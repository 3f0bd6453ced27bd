"""Batched LoRA for a mixed batch: ``lora_shrink_expand`` adds, to each row of a linear layer's output, its
own adapter's low-rank update, with the rows grouped into segments by adapter (the punica/SGMV design).

Caller contract (every backend):
- ``x`` ``[T, in]`` and ``y`` ``[T, out]`` (the base layer's output, updated in place) are row-major with a
  contiguous last dim; ``lora_a`` ``[S, R, in]`` and ``lora_b`` ``[S, out, R]`` hold the adapters of the S
  device slots, zero-padded to rank R, their scale (alpha / r) folded into ``lora_b``; dtype of ``x``.
- ``segments`` splits the T rows into runs of one slot each (-1: the base model, nothing added).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import lora_reference

__all__ = ["LoRASegments", "lora_shrink_expand"]


@dataclass(frozen=True)
class LoRASegments:
    """Runs of rows with one adapter slot each: segment i is rows ``[starts[i], starts[i + 1])`` with slot
    ``slots[i]`` (-1 for the base model). Host arrays (the CPU paths loop over them without a device sync);
    ``device`` holds the same as int32 tensors on the batch's device when the backend needs them."""

    starts: np.ndarray  # int64 [N + 1], starts[0] == 0, non-decreasing
    slots: np.ndarray  # int64 [N]

    @classmethod
    def from_row_slots(cls, row_slots: np.ndarray) -> LoRASegments:
        """The runs of equal values in ``row_slots`` (one slot per row)."""
        row_slots = np.asarray(row_slots, dtype=np.int64)
        if row_slots.size == 0:
            return cls(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
        cut = np.flatnonzero(row_slots[1:] != row_slots[:-1]) + 1
        starts = np.concatenate(([0], cut, [row_slots.size])).astype(np.int64)
        return cls(starts, row_slots[starts[:-1]])

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])

    @property
    def any_adapter(self) -> bool:
        return bool((self.slots >= 0).any())

    def narrow(self, start: int, end: int) -> LoRASegments:
        """The segments of rows ``[start, end)``, renumbered from 0."""
        starts = np.clip(self.starts, start, end) - start
        keep = starts[1:] > starts[:-1]
        return LoRASegments(np.concatenate(([0], starts[1:][keep])).astype(np.int64), self.slots[keep])


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       segments: LoRASegments) -> None:
    """``y[rows] += x[rows] @ lora_a[slot].T @ lora_b[slot].T`` per segment, in place."""
    if x.shape[0] != segments.num_rows or y.shape[0] != x.shape[0]:
        raise ValueError(f"segments cover {segments.num_rows} rows, x has {x.shape[0]} and y {y.shape[0]}")
    lora_reference.lora_shrink_expand(y, x, lora_a, lora_b, segments.starts.tolist(), segments.slots.tolist())
