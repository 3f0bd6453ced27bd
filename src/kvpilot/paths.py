"""Where kvpilot keeps what it builds once per machine (converted models, compiled CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$KVPILOT_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvpilot``, else ``~/.cache/kvpilot``."""
    env = os.environ.get("KVPILOT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvpilot"
