"""Modules of this package imported on first use: the Triton ones import triton, which CPU-only callers
never need and which may fail to find a usable backend."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["LazyModule"]


class LazyModule:
    """``kvpilot.kernels.<name>``, imported on the first ``load()``; None when it cannot be, and ``error``
    says why."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.module: ModuleType | None = None
        self.error: Exception | None = None

    def load(self) -> ModuleType | None:
        if self.module is None and self.error is None:
            try:
                self.module = importlib.import_module(f"{__package__}.{self.name}")
            except Exception as e:  # ImportError, or a triton without a usable backend
                self.error = e
        return self.module
