"""Applying grammar masks to a batch of logits: only the constrained rows are touched."""

from __future__ import annotations

import torch
import xgrammar as xgr

from .matcher import SequenceMatcher


class BatchMasker:
    """Fills one bitmask row per constrained sequence and applies them all in one call.

    Keeps its int32 bitmask buffer between steps (one row per logits row, 1/32 of the logits size).
    `width` is the logits width (the model's embedding rows): ids the tokenizer does not have are
    never allowed in a constrained row (see compiler.tokenizer_info)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self._bitmask = xgr.allocate_token_bitmask(1, width)

    def rows_buffer(self, rows: int) -> torch.Tensor:
        """The kept bitmask, with at least ``rows`` rows (for callers that fill rows themselves)."""
        if self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 2 * self._bitmask.shape[0]), self.width)
        return self._bitmask[:rows]

    def apply_filled(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Mask the given rows of logits with the rows of the kept bitmask that the caller filled."""
        if logits.dim() != 2 or logits.shape[1] != self.width:
            raise ValueError(f"logits must be [rows, {self.width}], got {tuple(logits.shape)}")
        apply_token_bitmask(logits, rows, self._bitmask[: logits.shape[0]])

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[SequenceMatcher]) -> list[int]:
        """Mask logits[rows[i]] with matchers[i]'s allowed tokens, in place. Returns the rows masked
        (a terminated or failed matcher leaves its row as it was)."""
        if logits.dim() != 2 or logits.shape[1] != self.width:
            raise ValueError(f"logits must be [rows, {self.width}], got {tuple(logits.shape)}")
        if not rows:
            return []
        bitmask = self.rows_buffer(logits.shape[0])
        masked = [r for r, m in zip(rows, matchers, strict=True) if m.fill_bitmask(bitmask, r)]
        if masked:
            apply_token_bitmask(logits, masked, bitmask)
        return masked


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """logits[r, j] = -inf wherever bit j of bitmask[r] is 0, for each r in rows (in place).

    xgrammar's CPU kernel on CPU tensors, its Triton kernel on CUDA ones (the bitmask is copied over)."""
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16) and logits.device.type == "cpu":
        raise TypeError(f"logits dtype {logits.dtype} is not supported")
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
