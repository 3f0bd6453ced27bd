"""Timing one kernel call at a time, for the per-call micro-benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def call_times(fn: Callable[[int], object], calls: int) -> list[float]:
    """Seconds of each of ``calls`` calls ``fn(i)``, after one untimed call (first-use costs)."""
    fn(0)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return times
