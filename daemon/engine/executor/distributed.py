"""Joining the ranks: ``torch.distributed`` (NCCL between GPUs, gloo between CPUs) and the groups a
``ParallelContext`` needs. Nothing here moves data; the layers and the executor do."""

from __future__ import annotations

import datetime
import socket

import torch

from ..models.parallel import SINGLE, ParallelContext

__all__ = ["free_port", "init_parallel", "shutdown_parallel"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the store's rendezvous port for a one-node group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_parallel(*, tp_size: int, pp_size: int, rank: int, init_method: str, device: torch.device,
                  timeout_s: float) -> ParallelContext:
    """Join the group of ``tp_size * pp_size`` ranks as ``rank`` and make this rank's context. Every rank
    creates the same groups in the same order, as ``new_group`` requires. ``timeout_s`` bounds each
    collective: a rank that hangs fails the others instead of stalling them."""
    world = tp_size * pp_size
    if world == 1:
        return SINGLE
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank, timeout=timeout)
    # plain data always travels over gloo (NCCL moves device tensors only)
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    for stage in range(pp_size):
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)), timeout=timeout) \
            if tp_size > 1 else None
        if stage == pp_rank:
            tp_group = group
    return ParallelContext(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, tp_group=tp_group,
                           cpu_group=cpu_group)


def shutdown_parallel() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def local_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: its own GPU on a multi-GPU node, the CPU as it is."""
    if device.type == "cuda":
        return torch.device("cuda", local_rank)
    return device

