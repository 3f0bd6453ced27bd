"""Which ranks run where: a pure decision from the engine's settings and, in a LeaderWorkerSet pod, the
variables LWS sets. Nothing here starts a process or opens a socket."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..config import EngineConfig

__all__ = ["DEFAULT_DIST_PORT", "NodeLayout", "node_layout"]

DEFAULT_DIST_PORT = 29500  # where node 0 listens for the ranks of the other nodes (torch.distributed's usual port)


@dataclass(frozen=True)
class NodeLayout:
    """This node's share of the ``world_size`` ranks: ``ranks_per_node`` consecutive global ranks from
    ``first_rank``. ``init_addr`` is where the ranks meet: None on one node (the driver picks a free local
    port)."""

    world_size: int
    nnodes: int
    node_rank: int
    init_addr: tuple[str, int] | None

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.ranks_per_node

    @property
    def local_ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.ranks_per_node)

    @property
    def remote_ranks(self) -> list[int]:
        """The ranks on nodes other than node 0: the driver reaches them through torch.distributed."""
        return list(range(self.ranks_per_node, self.world_size))


def node_layout(config: EngineConfig, env: Mapping[str, str]) -> NodeLayout:
    """The layout ``config`` asks for; ``nnodes``, ``node_rank`` and ``dist_init_addr`` not given fall back to
    LWS_GROUP_SIZE, LWS_WORKER_INDEX and LWS_LEADER_ADDRESS. ``ValueError`` naming the setting on bad input."""
    nnodes = config.nnodes if config.nnodes is not None else _env_int(env, "LWS_GROUP_SIZE", 1)
    node_rank = config.node_rank if config.node_rank is not None else _env_int(env, "LWS_WORKER_INDEX", 0)
    world = config.world_size
    if nnodes < 1 or world % nnodes:
        raise ValueError(f"nnodes ({nnodes}) must divide tensor_parallel_size * pipeline_parallel_size ({world})")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank ({node_rank}) must be in [0, nnodes={nnodes})")
    addr = None
    if nnodes > 1:
        raw = config.dist_init_addr
        if raw is None and env.get("LWS_LEADER_ADDRESS"):
            raw = f"{env['LWS_LEADER_ADDRESS']}:{DEFAULT_DIST_PORT}"
        if raw is None:
            raise ValueError(f"nnodes={nnodes} needs dist_init_addr (host:port of node 0), or LWS_LEADER_ADDRESS")
        host, _, port = raw.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"dist_init_addr must be host:port, got {raw!r}")
        addr = (host.strip("[]"), int(port))
    return NodeLayout(world_size=world, nnodes=nnodes, node_rank=node_rank, init_addr=addr)


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {raw!r}")
    return int(raw)
