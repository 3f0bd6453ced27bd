"""Where a model's shard sits among the ranks, and the collectives its layers need.

A ``ParallelContext`` is plain data plus the process groups: a layer asks it which slice of a checkpoint
tensor is its own (``shard``) and reduces or gathers through it; the runner asks it which layers are this
pipeline stage's and sends activations between stages through it. With one rank (``SINGLE``) the
collectives return their input, so the single-process path pays nothing for them.

Ranks are laid out tensor-first: global rank = ``pp_rank * tp_size + tp_rank``, so a node that holds whole
stages keeps its tensor-parallel all-reduces inside the node. Rank 0 (stage 0, tensor rank 0) is the
driver: the engine core runs beside it and reads the step's logits there.
"""

from __future__ import annotations

import pickle
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
    tp_group: Any = None  # torch.distributed group of this stage's tensor-parallel ranks; None with one rank
    # a gloo group over every rank, for plain data (objects, the CPU control path); None with one rank. Tensor
    # point-to-point between stages goes through the default group (NCCL on CUDA, gloo on the CPU).
    cpu_group: Any = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got rank {self.tp_rank} of {self.tp_size}")
        if self.pp_size < 1 or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank must be in [0, pp_size), got rank {self.pp_rank} of {self.pp_size}")
        if self.tp_size > 1 and self.tp_group is None:
            raise ValueError(f"tensor parallelism over {self.tp_size} ranks needs a process group")

    # -- the grid

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.rank_of(self.pp_rank, self.tp_rank)

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    @property
    def is_driver(self) -> bool:
        """Global rank 0: the engine core's rank, where the step's logits end up."""
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def output_rank(self) -> int:
        """The global rank that computes the logits: the last stage's tensor rank 0."""
        return self.rank_of(self.pp_size - 1, 0)

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers this pipeline stage holds: contiguous, as even as the count allows."""
        if num_layers < self.pp_size:
            raise ValueError(f"num_hidden_layers ({num_layers}) is less than pipeline_parallel_size ({self.pp_size})")
        return range(self.pp_rank * num_layers // self.pp_size, (self.pp_rank + 1) * num_layers // self.pp_size)

    # -- splits

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

    # -- tensor-parallel collectives

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

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """The ranks' ``x`` concatenated along ``dim`` on tensor rank 0, None on the others (the logits
        only the output rank reads)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        first = self.rank_of(self.pp_rank, 0)
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(x, parts, dst=first, group=self.tp_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    # -- between pipeline stages (global ranks)

    def send(self, x: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        dist.send(x.contiguous(), dst=dst)

    def recv(self, out: torch.Tensor, src: int) -> torch.Tensor:
        import torch.distributed as dist

        dist.recv(out, src=src)
        return out

    def send_object(self, obj: Any, dst: int) -> None:
        """A picklable object to global rank ``dst`` over the CPU group (its length first)."""
        import torch.distributed as dist

        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=self.cpu_group)
        dist.send(data, dst=dst, group=self.cpu_group)

    def recv_object(self, src: int) -> Any:
        import torch.distributed as dist

        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=src, group=self.cpu_group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src=src, group=self.cpu_group)
        return pickle.loads(data.numpy().tobytes())  # noqa: S301 - from this engine's own ranks


SINGLE = ParallelContext()
