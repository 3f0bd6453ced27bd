"""Multi-LoRA serving: PEFT adapters loaded beside the base model and applied per row, batched together.

- ``request``: ``LoRARequest`` (vLLM's names);
- ``peft``: reads and checks an adapter folder against the base model;
- ``manager``: the CPU-side LRU of loaded adapters (``max_cpu_loras``) and the device slots (``max_loras``)
  whose weights the model's linear layers read;
- ``layers``: the per-layer slot stacks and the batched shrink/expand over rows grouped by adapter.
"""

from .errors import LoRAAdapterError, LoRANotEnabled, LoRANotFound
from .request import LoRARequest

__all__ = ["LoRARequest", "LoRAAdapterError", "LoRANotEnabled", "LoRANotFound"]
