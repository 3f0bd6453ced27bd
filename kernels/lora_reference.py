"""Torch reference of the batched LoRA shrink/expand (the punica/SGMV design): rows grouped into segments,
each segment one adapter's slot. The other backends match it (tests/test_lora_kernels.py)."""

from __future__ import annotations

import torch


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       starts: list[int], slots: list[int]) -> None:
    """``y[s:e] += (x[s:e] @ lora_a[slot].T) @ lora_b[slot].T`` for each segment ``[starts[i], starts[i+1])``
    with ``slots[i] >= 0``, in place; a slot of -1 (the base model) adds nothing. The shrink runs in
    ``x``'s dtype, as the base GEMM does."""
    for i, slot in enumerate(slots):
        s, e = starts[i], starts[i + 1]
        if slot < 0 or e <= s:
            continue
        t = x[s:e] @ lora_a[slot].T
        y[s:e].addmm_(t, lora_b[slot].T)
