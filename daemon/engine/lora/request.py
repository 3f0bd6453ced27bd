"""``LoRARequest``: which adapter a request runs with (vLLM's class and field names).

Plain, frozen data: it travels in the scheduler's output to every rank, which loads the adapter from
``lora_path`` on demand.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: a name (what clients put in ``model``), an id > 0 unique per adapter among those loaded,
    and the PEFT folder it loads from (``adapter_config.json`` plus ``adapter_model.safetensors`` or
    ``.bin``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")

    @property
    def cache_key(self) -> tuple[str, int, str, str]:
        """What the prefix cache mixes into a sequence's first block hash: two adapters never share KV, and
        an id reused for another adapter (another name or path) does not either."""
        return ("lora", self.lora_int_id, self.lora_name, self.lora_path)
