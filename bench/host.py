"""What a benchmark's result file records about the machine it ran on."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform reports."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"
