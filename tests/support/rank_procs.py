"""The rank processes a process spawned (multiprocessing's spawn children, not its resource tracker), read
from /proc: the tests kill or stop one of them."""

from __future__ import annotations

from pathlib import Path


def spawned_ranks(parent: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == parent and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)
