"""The executor of several ranks, one process each (vLLM's multiprocess executor): the engine core and rank
0 (the driver) run in the engine's process, the other ranks of node 0 in processes it starts, those of other
nodes in processes their node's ``kvpilot serve`` starts (``NodeRanks``).

``MultiprocExecutor`` is shaped like a ``ModelRunner`` (the engine calls it the same way): each call goes to
every rank as a message, and the driver then makes the same call on its own rank. Block moves ride along
with the next step's message. A rank that dies or hangs makes every later call raise ``RankFailed``: the
engine loop stops, requests fail with the reason, and /health answers 503 so that the pod restarts.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config import EngineConfig
from ..loader import LoadedModel, load_model
from ..runner import ModelRunner, SeqBatchEntry, cpu_threads
from .distributed import free_port, shutdown_parallel
from .layout import NodeLayout
from .rank_ops import RankOps
from .shm_broadcast import ShmBroadcast
from .worker import WorkerSpec, join_ranks, rank_device, run_worker

__all__ = ["MultiprocExecutor", "NodeRanks", "RankFailed"]

logger = logging.getLogger(__name__)

_JOIN_S = 5.0  # how long a stopping rank may take before it is killed
_JOIN_POLL_S = 0.2


class RankFailed(RuntimeError):
    """A rank died, hung or failed: the engine cannot go on."""


def _rank_config(config: EngineConfig, layout: NodeLayout) -> EngineConfig:
    """The config each rank of this node runs: its share of the node's CPUs (``num_threads``, when set, is
    per rank already)."""
    if config.num_threads is not None:
        return config
    return dataclasses.replace(config, num_threads=max(1, cpu_threads() // layout.ranks_per_node))


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Spawned ranks need nothing from ``__main__`` (their target lives in this package), and importing it
    again would rerun a script's top level in each of them: hide it while they start."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    if main is not None:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


class _Workers:
    """This node's worker processes (every local rank but the driver, on node 0)."""

    def __init__(self, config: EngineConfig, layout: NodeLayout, init_method: str, ranks: range,
                 shm: ShmBroadcast | None) -> None:
        self.mp = multiprocessing.get_context("spawn")  # fork is unsafe under torch's threads
        self.errors = self.mp.Queue()
        self.ready = {rank: self.mp.Event() for rank in ranks}
        self.procs: dict[int, Any] = {}
        for i, rank in enumerate(ranks):
            spec = WorkerSpec(config=config, rank=rank, init_method=init_method, layout=layout,
                              reader=None if shm is None else shm.reader(i), parent_pid=os.getpid())
            proc = self.mp.Process(target=run_worker, args=(spec, self.errors, self.ready[rank]),
                                   name=f"kvpilot-rank-{rank}", daemon=True)
            with _main_not_reimported():
                proc.start()
            self.procs[rank] = proc

    def dead(self) -> list[str]:
        return [f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in self.procs.items() if not p.is_alive()]

    def reported(self, wait_s: float = 0.0) -> list[str]:
        """The failures the ranks reported (waiting up to ``wait_s`` for the first one)."""
        out: list[str] = []
        deadline = time.monotonic() + wait_s
        while True:
            try:
                rank, message = self.errors.get(timeout=max(0.0, deadline - time.monotonic()) if not out else 0.0)
            except (queue.Empty, OSError, EOFError):
                return out
            out.append(f"rank {rank}: {message}")

    def all_ready(self) -> bool:
        return all(event.is_set() for event in self.ready.values())

    def stop(self) -> None:
        deadline = time.monotonic() + _JOIN_S
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(1.0)


class _LoRAOnEveryRank:
    """The ranks' LoRA managers, kept alike: an adapter is added or removed on every rank, in order with the
    steps; what is held is read from the driver's, the same as every other's."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor = executor

    def add(self, request: Any) -> Any:
        return self._executor._call(("lora", "add", request))  # noqa: SLF001 - the executor's own helper

    def remove(self, lora_int_id: int) -> bool:
        return bool(self._executor._call(("lora", "remove", lora_int_id)))  # noqa: SLF001

    def list_ids(self) -> set[int]:
        return self._executor.runner.lora.list_ids()

    def holds(self, request: Any) -> bool:
        return self._executor.runner.lora.holds(request)


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, layout: NodeLayout) -> None:
        if layout.node_rank != 0:
            raise ValueError("the engine runs on node 0; other nodes run NodeRanks")
        self.layout = layout
        self.config = _rank_config(config, layout)
        host, port = layout.init_addr or ("127.0.0.1", free_port())
        init_method = f"tcp://{host}:{port}"
        local_workers = range(1, layout.ranks_per_node)
        self._shm = ShmBroadcast(multiprocessing.get_context("spawn"), len(local_workers),
                                 timeout_s=config.distributed_timeout) if len(local_workers) else None
        self._workers = _Workers(self.config, layout, init_method, local_workers, self._shm)
        self._nodes = None
        self._moves: list[tuple[str, list[tuple[int, int]]]] = []
        self._failed: str | None = None
        self._closed = False
        try:
            driver_config = dataclasses.replace(self.config, device=rank_device(self.config, 0))
            self.parallel, control = self._join(driver_config, init_method)
            if control is not None:
                from .node_channel import NodeChannelSender

                self._nodes = NodeChannelSender(control, config.distributed_timeout)
            self.loaded: LoadedModel = load_model(driver_config, self.parallel)
            self.runner = ModelRunner(driver_config, self.loaded)
            self._ops = RankOps(self.runner, self.parallel)
            self.rank_weight_bytes = self.loaded.weight_bytes  # the driver's shard
            self.loaded.weight_bytes = self._call(("weight_bytes",))  # the engine's metrics count every rank
        except BaseException as exc:
            reasons = self._workers.reported(wait_s=2.0)
            self.shutdown()
            if isinstance(exc, ValueError):  # bad input (a size that does not divide, ...): every rank has it
                raise
            raise RankFailed("; ".join(reasons) or f"{type(exc).__name__}: {exc}") from exc
        atexit.register(self.shutdown)
        logger.info("%d ranks ready (tensor %d x pipeline %d, %d node(s))", layout.world_size,
                    config.tensor_parallel_size, config.pipeline_parallel_size, layout.nnodes)

    def _join(self, config: EngineConfig, init_method: str) -> tuple[Any, Any]:
        """``join_ranks`` for rank 0, watching this node's workers meanwhile: one that dies before it joins
        fails the start at once, where the rendezvous alone would wait out ``distributed_timeout``."""
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["joined"] = join_ranks(config, self.layout, 0, init_method)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                box["error"] = exc

        thread = threading.Thread(target=join, name="kvpilot-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_JOIN_POLL_S)
            dead = self._workers.dead()
            if dead and thread.is_alive():
                raise RankFailed("; ".join(self._workers.reported(wait_s=0.5) or dead) + " before the ranks met")
        if "error" in box:
            raise box["error"]
        return box["joined"]

    # -- the runner's interface, as the engine uses it

    lora: _LoRAOnEveryRank | None = None

    def enable_lora(self) -> None:
        self._call(("enable_lora",))
        self.lora = _LoRAOnEveryRank(self)

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block

    @property
    def last_prompt_logprobs(self) -> dict[int, Any]:
        return self.runner.last_prompt_logprobs

    def num_blocks_for_budget(self) -> int:
        """The blocks every rank can hold: the least of the ranks' budgets (each rank logs its own)."""
        return self._call(("kv_blocks",))

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self._call(("init_kv_cache", num_blocks, num_cpu_blocks))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._moves.append(("copy_blocks", list(pairs)))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._moves.append(("swap_out", list(pairs)))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._moves.append(("swap_in", list(pairs)))

    def execute(self, entries: list[SeqBatchEntry]) -> torch.Tensor:
        moves, self._moves = self._moves, []
        return self._call(("execute", moves, entries))

    def warmup(self) -> None:
        self._call(("warmup",))

    def pipeline_stats(self) -> list[Any]:
        """Each rank's ``pipeline_stats`` (None where its runner keeps none), by global rank."""
        return self._call(("pipeline_stats",))

    def wait_for_kv_cache_mapped(self, num_blocks: int | None = None) -> None:
        """Until every rank's cache has its first ``num_blocks`` blocks mapped in."""
        self._call(("kv_mapped", num_blocks))

    def pause_kv_cache_mapping_while(self, busy: Callable[[], bool]) -> None:
        """The driver's cache maps in while ``busy()`` is false; the other ranks' while they idle."""
        self._call(("kv_mapping_when_idle",))
        self.runner.pause_kv_cache_mapping_while(busy)

    def check_health(self) -> None:
        """``RankFailed`` once a rank is known gone (a worker process ended, another node's heartbeat
        failed, or a call failed), also while the engine idles."""
        if self._failed is None:
            dead = self._workers.dead()
            if dead:
                self._failed = "; ".join(self._workers.reported(wait_s=0.5) or dead)
            elif self._nodes is not None and self._nodes.failed is not None:
                self._failed = f"a node's ranks are gone: {type(self._nodes.failed).__name__}: {self._nodes.failed}"
        if self._failed is not None:
            raise RankFailed(self._failed)

    # -- messages

    def _check_workers(self) -> None:
        dead = self._workers.dead()
        if dead:
            raise RankFailed("; ".join(self._workers.reported(wait_s=0.5) or dead))

    def _call(self, message: tuple[Any, ...]) -> Any:
        if self._failed is not None:
            raise RankFailed(self._failed)
        try:
            if self._shm is not None:
                self._shm.publish(message, self._check_workers)
            if self._nodes is not None:
                self._nodes.publish(message)
            return self._ops.apply(message)
        except RankFailed as exc:
            self._failed = str(exc)
            raise
        except (RuntimeError, TimeoutError, OSError) as exc:  # a rank gone or stuck, or a failure on this one
            reasons = self._workers.reported(wait_s=2.0) or self._workers.dead()
            self._failed = "; ".join([*reasons, f"rank 0: {type(exc).__name__}: {exc}"])
            raise RankFailed(self._failed) from exc

    def shutdown(self) -> None:
        """Stop every rank of this node (those of other nodes stop when the group breaks)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._failed is None:
            with contextlib.suppress(Exception):
                if self._shm is not None:
                    self._shm.publish(("shutdown",), self._check_workers)
                if self._nodes is not None:
                    self._nodes.publish(("shutdown",))
        if self._nodes is not None:
            self._nodes.close()
        self._workers.stop()
        if self._shm is not None:
            self._shm.close()
        with contextlib.suppress(Exception):
            shutdown_parallel()


class NodeRanks:
    """The ranks of a node other than node 0: started by that node's ``kvpilot serve``, which reports
    their readiness and liveness on its probes."""

    def __init__(self, config: EngineConfig, layout: NodeLayout) -> None:
        if layout.node_rank == 0 or layout.init_addr is None:
            raise ValueError("NodeRanks runs the ranks of nodes other than node 0")
        host, port = layout.init_addr
        self._workers = _Workers(_rank_config(config, layout), layout, f"tcp://{host}:{port}", layout.local_ranks,
                                 None)

    def ready(self) -> bool:
        return self.alive() and self._workers.all_ready()

    def alive(self) -> bool:
        return not self._workers.dead()

    def failure(self) -> str | None:
        dead = self._workers.dead()
        return "; ".join(self._workers.reported() or dead) if dead else None

    def stop(self) -> None:
        for p in self._workers.procs.values():
            if p.is_alive():
                p.terminate()
        self._workers.stop()
