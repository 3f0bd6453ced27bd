"""Child processes in their own process groups, with one registry that can kill them all.

Every process an end-to-end run starts (operator, daemons, the reference, preStop hooks) goes through
`spawn`, so teardown can always end every group, even after a failure or a KeyboardInterrupt.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

_LIVE: dict[int, subprocess.Popen] = {}


def spawn(argv: Sequence[str], env: dict[str, str], log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(list(argv), env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, start_new_session=True)
    _LIVE[proc.pid] = proc
    return proc


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's whole process group (its pgid is its pid: start_new_session)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGTERM, wait, then SIGKILL. Returns the exit code."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    forget(proc)
    return proc.returncode


def forget(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        _LIVE.pop(proc.pid, None)


def kill_all() -> list[int]:
    """SIGKILL every group still registered; returns their pids."""
    killed = []
    for pid, proc in list(_LIVE.items()):
        if proc.poll() is None:
            signal_group(proc, signal.SIGKILL)
            killed.append(pid)
    deadline = time.monotonic() + 10
    for proc in list(_LIVE.values()):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.1, deadline - time.monotonic()))
    _LIVE.clear()
    return killed


def live() -> list[int]:
    return [pid for pid, p in _LIVE.items() if p.poll() is None]


atexit.register(kill_all)
