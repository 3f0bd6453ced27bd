"""Domain errors of the engine bridge and the adapter registry. They say what went wrong; only http_errors.py
turns them into HTTP."""

from __future__ import annotations

from .engine.input_processor import InputError


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


# ---- adapters (LoRA). Bad names and paths are the client's input, so they are InputErrors (400 naming the
# field); an unknown adapter is the engine's LoRANotFound, which http_errors.py answers with a 404.


class LoRANameInvalid(InputError):
    """An adapter name that is empty, too long, holds characters outside the allowed set, could be read as a
    path that escapes (``..``, a leading ``/``), or is one of the base model's names."""

    code = "invalid_lora_name"


class LoRAPathNotAllowed(InputError):
    """An adapter path that resolves (symlinks followed) outside every allowed root, or a source kind the
    daemon does not read."""

    code = "lora_path_not_allowed"


class LoRAAlreadyLoaded(InputError):
    """An adapter of that name is loaded, or being loaded."""

    code = "lora_already_loaded"
