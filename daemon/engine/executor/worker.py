"""A worker rank's process: join the ranks, load this rank's shard, then carry out the driver's messages
until it says stop. On node 0 the messages come through shared memory; on the other nodes through
torch.distributed. Any failure is reported on the error queue and ends the process: the driver then
counts the engine dead rather than waiting on a rank that is gone."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from ..config import EngineConfig
from .layout import NodeLayout
from .shm_broadcast import ShmReader

__all__ = ["WorkerSpec", "run_worker"]

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    config: EngineConfig  # num_threads is this rank's share of the node's CPUs
    rank: int
    init_method: str
    layout: NodeLayout
    reader: ShmReader | None  # None: the messages come over torch.distributed (a node other than 0)
    parent_pid: int


def rank_device(config: EngineConfig, local_rank: int) -> str:
    """The device a rank runs on: its own GPU on a multi-GPU node, else the config's."""
    from ..loader import resolve_device

    device = resolve_device(config.device)
    return f"cuda:{local_rank}" if device.type == "cuda" else str(device)


def join_ranks(config: EngineConfig, layout: NodeLayout, rank: int, init_method: str) -> tuple[Any, Any]:
    """This rank's ParallelContext, and the group that carries the driver's messages to other nodes (None on
    one node). Every rank makes the same groups in the same order."""
    import torch

    from .distributed import init_parallel

    local_rank = rank - layout.first_rank
    ctx = init_parallel(tp_size=config.tensor_parallel_size, pp_size=config.pipeline_parallel_size, rank=rank,
                        init_method=init_method, device=torch.device(rank_device(config, local_rank)),
                        timeout_s=config.distributed_timeout)
    control = None
    if layout.nnodes > 1:
        import datetime

        import torch.distributed as dist

        control = dist.new_group([0, *layout.remote_ranks], backend="gloo",
                                 timeout=datetime.timedelta(seconds=config.distributed_timeout))
    return ctx, control


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank when the process that started it dies, even by SIGKILL (a daemon
    child of multiprocessing is only stopped on its parent's orderly exit)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the ranks notice a lost driver by its broken connections
        return


def run_worker(spec: WorkerSpec, errors: Any, ready: Any) -> None:
    """The process's body (``multiprocessing`` target)."""
    _die_with_parent()
    if os.getppid() != spec.parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        _serve(spec, ready)
    except BaseException as exc:  # noqa: BLE001 - whatever ended the rank is what the driver must report
        logger.exception("rank %d failed", spec.rank)
        try:
            errors.put((spec.rank, f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(1)  # no atexit hooks: the process groups are broken, and their teardown may hang
    os._exit(0)


def _serve(spec: WorkerSpec, ready: Any) -> None:
    from ..loader import load_model
    from ..runner import ModelRunner
    from .node_channel import NodeChannelReceiver
    from .rank_ops import RankOps

    config = dataclasses.replace(spec.config, device=rank_device(spec.config, spec.rank - spec.layout.first_rank))
    ctx, control = join_ranks(config, spec.layout, spec.rank, spec.init_method)
    ops = RankOps(ModelRunner(config, load_model(config, ctx)), ctx)
    source = spec.reader.open() if spec.reader is not None else NodeChannelReceiver(control)
    ready.set()

    def alive() -> bool:  # a rank outlives neither its driver nor, on other nodes, its node's daemon
        return os.getppid() == spec.parent_pid

    while True:
        message = source.read(alive)
        if message[0] == "shutdown":
            return
        ops.apply(message)
