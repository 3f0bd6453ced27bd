"""How the engine reaches its ranks: the ``ModelRunner`` itself for one rank (today's path, unchanged), or
``MultiprocExecutor`` for several (multiproc.py)."""

from __future__ import annotations

import os

from ..config import EngineConfig
from .layout import NodeLayout, node_layout

__all__ = ["NodeLayout", "node_layout", "start_executor"]


def start_executor(config: EngineConfig):  # noqa: ANN201 - a MultiprocExecutor, shaped like a ModelRunner
    """Start every rank of node 0 and join those of the other nodes."""
    from .multiproc import MultiprocExecutor

    return MultiprocExecutor(config, node_layout(config, os.environ))
