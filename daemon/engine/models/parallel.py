"""Where a model's shard sits among the ranks, and the two collectives its layers need.

A ``ParallelContext`` is plain data plus the process group: a layer asks it which slice of a checkpoint
tensor is its own (``shard``) and reduces or gathers through it. With one rank (``SINGLE``) the
collectives return their input, so the single-process path pays nothing for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SINGLE", "ParallelContext"]


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the tensor- and pipeline-parallel grid (vLLM's names)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup of the tensor-parallel ranks; None with one rank

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got rank {self.tp_rank} of {self.tp_size}")
        if self.pp_size < 1 or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank must be in [0, pp_size), got rank {self.pp_rank} of {self.pp_size}")
        if self.tp_size > 1 and self.tp_group is None:
            raise ValueError(f"tensor parallelism over {self.tp_size} ranks needs a process group")

    def split(self, size: int, what: str) -> int:
        """``size`` divided among the tensor-parallel ranks; ``ValueError`` naming both numbers when it
        does not divide."""
        if size % self.tp_size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({self.tp_size})")
        return size // self.tp_size

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal slice of ``size``."""
        length = self.split(size, what)
        return self.tp_rank * length, length

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the tensor-parallel ranks (in place where there are several)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim``, in rank order."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)


SINGLE = ParallelContext()
