"""Which adapters are loaded where: a host-side LRU of adapters read from disk (``max_cpu_loras``), and the
``max_loras`` device slots whose weights the model's linear layers read in a step.

The scheduler never lets a step mix more adapters than there are slots, so ``activate`` always finds room:
it evicts the least recently used slot whose adapter the step does not need. An adapter leaves the host
LRU when newer ones push it out, or when removed; one still in a slot keeps serving from there, and one a
running sequence needs again is read from its path again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from kvpilot.kernels.ops import LoRASegments

from ..config import EngineConfig
from ..models.base import LoRABatch
from .errors import LoRAAdapterError
from .layers import LoRASlots
from .peft import LoRAAdapter, load_adapter
from .request import LoRARequest

logger = logging.getLogger("kvpilot.lora")

_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAManager:
    def __init__(self, config: EngineConfig, model: Any, *, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.dtype = dtype
        self.max_loras, self.max_rank, self.cpu_capacity = config.max_loras, config.max_lora_rank, config.cpu_loras
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slot_ids: list[int | None] = [None] * self.max_loras  # adapter id in each slot
        self.slot_of: dict[int, int] = {}
        self._requests: dict[int, LoRARequest] = {}  # the request each filled slot was loaded for
        self._slot_used = [0] * self.max_loras  # activation count at each slot's last use (LRU among slots)
        self._activations = 0
        self.layers: dict[tuple[int, str], LoRASlots] = {}
        first = getattr(model, "first_layer", 0)  # a pipeline stage holds layers first, first + 1, ...
        for local, layer in enumerate(model.layers):
            index = first + local
            for attr in _PROJECTIONS:
                proj = getattr(layer, attr, None)
                if proj is None:  # a MoE layer's MLP: adapters may not target it (peft.py refuses)
                    continue
                # this rank's part of the layer: its input columns (a row split) and output rows
                proj.lora = LoRASlots(proj.in_per_rank, proj.out_per_rank, len(proj.partitions),
                                      num_slots=self.max_loras, max_rank=self.max_rank, dtype=dtype, device=device)
                self.layers[(index, attr)] = proj.lora
        if device.type == "cuda":  # all slots now, so that the KV cache, sized next, leaves them room
            for slots in self.layers.values():
                slots.allocate()
        logger.info("LoRA: %d slots of rank %d over %d layers (%.1f MiB on %s when all are used), %d adapters in "
                    "host memory", self.max_loras, self.max_rank, len(self.layers), self.slot_bytes() / 2**20,
                    device.type, self.cpu_capacity)

    def slot_bytes(self) -> int:
        """The device slots' bytes once every layer's are made."""
        return sum(s.nbytes for s in self.layers.values())

    # ------------------------------------------------------------------ the host-side LRU

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """``request``'s adapter, read and checked unless it is loaded already (LoRAAdapterError: nothing of it
        is kept); the most recently used from now on."""
        held = self.cpu.get(request.lora_int_id)
        if held is not None:
            if held.request != request:
                raise LoRAAdapterError(f"lora_int_id {request.lora_int_id} is in use by adapter "
                                       f"{held.request.lora_name!r} ({held.request.lora_path})", param="lora_int_id")
            self.cpu.move_to_end(request.lora_int_id)
            return held
        slot = self.slot_of.get(request.lora_int_id)
        if slot is not None and self._slot_request(slot) not in (None, request):
            raise LoRAAdapterError(f"lora_int_id {request.lora_int_id} is in use by another adapter",
                                   param="lora_int_id")
        adapter = load_adapter(request, self.model, max_rank=self.max_rank, dtype=self.dtype)
        self.cpu[request.lora_int_id] = adapter
        while len(self.cpu) > self.cpu_capacity:
            evicted, _ = self.cpu.popitem(last=False)
            logger.info("LoRA adapter %d left the host cache (max_cpu_loras=%d)", evicted, self.cpu_capacity)
        logger.info("LoRA adapter %r (id %d) loaded: rank %d, %d layers, %.1f MiB", request.lora_name,
                    request.lora_int_id, adapter.rank, len(adapter.units), adapter.nbytes / 2**20)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter (its slot frees up: a running sequence that still needs it reads it again)."""
        found = self.cpu.pop(lora_int_id, None) is not None
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slot_ids[slot] = None
            self._requests.pop(slot, None)
            for layer in self.layers.values():
                layer.clear(slot)
        return found or slot is not None

    def list_ids(self) -> set[int]:
        return set(self.cpu) | set(self.slot_of)

    def holds(self, request: LoRARequest) -> bool:
        """Whether ``request``'s adapter is at hand without reading its files."""
        held = self.cpu.get(request.lora_int_id)
        if held is not None:
            return held.request == request
        slot = self.slot_of.get(request.lora_int_id)
        return slot is not None and self._slot_request(slot) == request

    # ------------------------------------------------------------------ the device slots

    def _slot_request(self, slot: int) -> LoRARequest | None:
        return self._requests.get(slot)

    def activate(self, requests: dict[int, LoRARequest]) -> dict[int, int]:
        """Put the step's adapters (by id) in slots; their slot by id."""
        if len(requests) > self.max_loras:
            raise ValueError(f"a step with {len(requests)} adapters; max_loras is {self.max_loras}")
        self._activations += 1
        for lora_id in requests:
            slot = self.slot_of.get(lora_id)
            if slot is not None:
                self._slot_used[slot] = self._activations
        for lora_id, request in requests.items():
            if lora_id in self.slot_of:
                continue
            adapter = self.add(request)
            slot = min((s for s in range(self.max_loras) if self.slot_ids[s] not in requests),
                       key=lambda s: (self.slot_ids[s] is not None, self._slot_used[s]))
            old = self.slot_ids[slot]
            if old is not None:
                del self.slot_of[old]
            for key, layer in self.layers.items():
                layer.set(slot, adapter.units.get(key, []))
            self.slot_ids[slot], self.slot_of[lora_id] = lora_id, slot
            self._requests[slot] = request
            self._slot_used[slot] = self._activations
        return {lora_id: self.slot_of[lora_id] for lora_id in requests}

    def batch(self, entry_requests: list[LoRARequest | None], rows_per_entry: np.ndarray,
              output_row_entries: np.ndarray | None) -> LoRABatch | None:
        """The step's LoRABatch (None when no entry has an adapter): each entry's rows take its adapter's
        slot; ``output_row_entries``, the entry of each output row when the last layer computes only those."""
        requests = {r.lora_int_id: r for r in entry_requests if r is not None}
        if not requests:
            return None
        slot_of = self.activate(requests)
        entry_slots = np.fromiter((-1 if r is None else slot_of[r.lora_int_id] for r in entry_requests),
                                  dtype=np.int64, count=len(entry_requests))
        rows = LoRASegments.from_row_slots(np.repeat(entry_slots, rows_per_entry))
        out = None if output_row_entries is None else LoRASegments.from_row_slots(entry_slots[output_row_entries])
        return LoRABatch(rows, out)
