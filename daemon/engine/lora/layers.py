"""The device side of the adapters of one linear layer: a stack of ``max_loras`` slots, each holding one
adapter's update for this layer, which ``apply`` adds to the rows of a mixed batch, grouped by slot.

A slot's units (one per partition of the layer: q|k|v, gate|up) sit side by side in rank blocks of
``max_lora_rank`` columns, so one shrink and one expand serve the whole layer (B is block-diagonal; the
zero padding costs flops only on these small matrices). The stacks are made on first use: an adapter of
q and v only never allocates the MLP's.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpilot.kernels import ops

from .peft import LoRAUnit


class LoRASlots:
    def __init__(self, in_features: int, out_features: int, num_units: int, *, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.num_units, self.num_slots, self.max_rank = num_units, num_slots, max_rank
        self.dtype, self.device = dtype, device
        self.a: torch.Tensor | None = None  # [slots, units * max_rank, in]
        self.b: torch.Tensor | None = None  # [slots, out, units * max_rank]
        # which slots hold weights for this layer; the extra last entry stands for slot -1 (the base)
        self.filled = np.zeros(num_slots + 1, dtype=bool)

    @property
    def nbytes(self) -> int:
        k = self.num_units * self.max_rank
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_slots * k * (self.in_features + self.out_features) * elem

    def allocate(self) -> None:
        if self.a is not None:
            return
        k = self.num_units * self.max_rank
        kw = {"dtype": self.dtype, "device": self.device}
        self.a = torch.zeros(self.num_slots, k, self.in_features, **kw)
        self.b = torch.zeros(self.num_slots, self.out_features, k, **kw)

    def set(self, slot: int, units: list[LoRAUnit]) -> None:
        """Slot ``slot`` holds ``units`` from now on (none: the adapter leaves this layer alone)."""
        if len(units) > self.num_units:
            raise ValueError(f"{len(units)} LoRA units for a layer of {self.num_units} partitions")
        if not units:
            self.clear(slot)
            return
        self.allocate()
        assert self.a is not None and self.b is not None
        self.a[slot].zero_()
        self.b[slot].zero_()
        for j, unit in enumerate(units):
            r, rows = unit.a.shape[0], unit.b.shape[0]
            cols = slice(j * self.max_rank, j * self.max_rank + r)
            self.a[slot, cols].copy_(unit.a)
            self.b[slot, unit.row_start:unit.row_start + rows, cols].copy_(unit.b)
        self.filled[slot] = True

    def clear(self, slot: int) -> None:
        self.filled[slot] = False

    def apply(self, y: torch.Tensor, x: torch.Tensor, segments: ops.LoRASegments) -> None:
        """Add each row's adapter update to ``y`` (the layer's output for ``x``), in place."""
        slots = segments.slots
        mask = self.filled[slots]
        if self.a is None or not mask.any():
            return
        if not (mask | (slots < 0)).all():  # an adapter that leaves this layer alone adds nothing here
            segments = ops.LoRASegments(segments.starts, np.where(mask, slots, -1))
        ops.lora_shrink_expand(y, x if x.is_contiguous() else x.contiguous(), self.a, self.b, segments)
