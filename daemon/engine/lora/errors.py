"""The engine's LoRA errors. The daemon's edge maps them to HTTP (http_errors.py)."""

from __future__ import annotations

from ..input_processor import InputError


class LoRAAdapterError(InputError):
    """An adapter that cannot be served: a missing or unreadable file, a rank above max_lora_rank, a target
    module the base lacks or LoRA does not cover, a shape that does not fit the base. Nothing of it is
    loaded."""

    code = "invalid_lora_adapter"


class LoRANotEnabled(InputError):
    """A request named an adapter, but the engine runs without ``enable_lora``."""

    code = "lora_not_enabled"


class LoRANotFound(InputError):
    """No adapter with that name or id is loaded."""

    code = "lora_not_found"
