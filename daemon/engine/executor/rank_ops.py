"""What one rank does with each of the driver's messages. The driver runs the same code on its own rank as
the workers on theirs, so every rank makes the same calls, collectives included, in the same order.

A message is a tuple: ``("execute", moves, entries)`` (the block moves since the last step, then the step),
``("init_kv_cache", num_blocks, num_cpu_blocks)``, ``("warmup",)``, ``("kv_blocks",)`` (the blocks every rank
can hold: the least of the ranks' budgets), ``("weight_bytes",)`` (the sum over the ranks),
``("kv_mapped", num_blocks)``, ``("kv_mapping_when_idle",)``, ``("enable_lora",)``, ``("lora", "add" | "remove", arg)``, ``("pipeline_stats",)``, ``("noop",)`` (the driver's heartbeat to other nodes) and ``("shutdown",)``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..lora.errors import LoRAAdapterError
from ..models.parallel import ParallelContext
from ..runner import ModelRunner

__all__ = ["RankOps"]

_MOVES = ("swap_out", "swap_in", "copy_blocks")
_IDLE_AFTER_S = 0.05  # a rank this long without a message is idle: the engine has no step for it


class RankOps:
    def __init__(self, runner: ModelRunner, parallel: ParallelContext) -> None:
        self.runner = runner
        self.parallel = parallel
        self._busy = False
        self._last_message = time.monotonic()

    def busy(self) -> bool:
        """Whether this rank works or just did: a worker's KV cache maps in only while its rank idles, off the
        cores its steps use (the driver's follows the engine's own notion, see the executor)."""
        return self._busy or time.monotonic() - self._last_message < _IDLE_AFTER_S

    def apply(self, message: tuple[Any, ...]) -> Any:
        """The message's result on this rank (the step's logits on the driver, None on the others)."""
        self._busy = True
        try:
            return self._apply(message)
        finally:
            self._busy = False
            self._last_message = time.monotonic()

    def _apply(self, message: tuple[Any, ...]) -> Any:
        op, *args = message
        if op == "execute":
            moves, entries = args
            for name, pairs in moves:
                if name not in _MOVES:
                    raise ValueError(f"unknown block move {name!r}")
                getattr(self.runner, name)(pairs)
            return self.runner.execute(entries)
        if op == "init_kv_cache":
            return self.runner.init_kv_cache(*args)
        if op == "warmup":
            return self.runner.warmup()
        if op == "kv_blocks":
            return self._reduce(self.runner.num_blocks_for_budget(), torch.distributed.ReduceOp.MIN)
        if op == "weight_bytes":
            return self._reduce(self.runner.loaded.weight_bytes, torch.distributed.ReduceOp.SUM)
        if op == "kv_mapped":  # every rank waits for its own cache's first blocks, then they meet
            self.runner.wait_for_kv_cache_mapped(*args)
            return self._reduce(0, torch.distributed.ReduceOp.SUM)
        if op == "kv_mapping_when_idle":
            if not self.parallel.is_driver:
                self.runner.pause_kv_cache_mapping_while(self.busy)
            return None
        if op == "enable_lora":
            return self.runner.enable_lora()
        if op == "lora":  # add or remove an adapter: every rank's manager goes through the same changes
            method, *rest = args
            if method not in ("add", "remove"):
                raise ValueError(f"unknown LoRA call {method!r}")
            try:
                return getattr(self.runner.lora, method)(*rest)
            except LoRAAdapterError:
                if self.parallel.is_driver:
                    raise
                return None  # every rank reads the same files and fails alike: the driver reports it
        if op == "pipeline_stats":
            return self._gather(getattr(self.runner, "pipeline_stats", None))
        if op in ("noop", "shutdown"):
            return None
        raise ValueError(f"unknown message {op!r}")

    def _reduce(self, value: int, op: Any) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.parallel.cpu_group)
        return int(t.item())

    def _gather(self, value: Any) -> list[Any] | None:
        import torch.distributed as dist

        out = [None] * self.parallel.world_size if self.parallel.is_driver else None
        dist.gather_object(value, out, dst=0, group=self.parallel.cpu_group)
        return out
