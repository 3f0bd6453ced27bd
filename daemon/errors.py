"""Domain errors of the engine bridge. They say what went wrong; only server.py turns them into HTTP."""

from __future__ import annotations


class EngineUnavailable(Exception):
    """The engine cannot take work right now."""


class EngineNotReady(EngineUnavailable):
    """The model is still loading."""

    retry_after_s = 5


class EngineDead(EngineUnavailable):
    """The engine loop crashed, the model failed to load, or the engine was stopped."""


class EngineQueueFull(EngineUnavailable):
    """Admission control: the waiting queue is full. `retry_after_s` estimates when to try again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineRejected(Exception):
    """The engine refused a request for a reason that is not the client's input (a bug or an engine fault)."""
