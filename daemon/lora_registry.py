"""The daemon's adapters: name -> LoRARequest, and the load and unload that keep it and the engine in step.

The registry is what `model` is looked up in, so a name is in it only once the engine has the adapter, and
leaves it before the engine drops it: a request never names an adapter the engine is not holding (requests
already running with an unloaded adapter finish, the engine's promise). Ids come from a counter and are never
reused, so an id in the prefix cache or in flight always means one adapter. Lives on the event loop; not
thread-safe.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .engine.lora import LoRANotFound, LoRARequest
from .errors import LoRAAlreadyLoaded, LoRANameInvalid
from .lora_source import real_roots, resolve_adapter_source
from .served_names import ServedNames

__all__ = ["Adapter", "AdapterLoader", "LoRARegistry", "check_adapter_name"]

MAX_NAME_CHARS = 256
# Printable ASCII without spaces or commas: the metric vllm:lora_requests_info joins names with commas, and
# routers and operators put names into URLs, labels and file names. '/' only between non-empty parts (HF
# style org/name), never '.' or '..' as a part, so a name never reads as a path that escapes.
_NAME_PART = r"[A-Za-z0-9_.:@-]+"
_NAME = re.compile(rf"^{_NAME_PART}(?:/{_NAME_PART})*$")


class AdapterLoader(Protocol):
    """The engine side (AsyncEngine): the loads run on the engine thread and may take a while."""

    def check_accepting(self) -> object: ...  # EngineNotReady / EngineDead when it cannot take work
    async def load_lora(self, lora_request: LoRARequest) -> bool: ...
    async def remove_lora(self, lora_int_id: int) -> bool: ...


@dataclass(frozen=True)
class Adapter:
    request: LoRARequest
    source: str  # the lora_path as given (hf://..., file://..., a path): /v1/models' "root"
    parent: str | None = None  # --lora-modules' base_model_name (vLLM's JSON form), else the base's name

    @property
    def name(self) -> str:
        return self.request.lora_name


def check_adapter_name(name: object, base: ServedNames) -> str:
    """The name, if a client may load an adapter under it; LoRANameInvalid says why not."""
    if not isinstance(name, str) or not name:
        raise LoRANameInvalid("lora_name must be a non-empty string", "lora_name")
    if len(name) > MAX_NAME_CHARS:
        raise LoRANameInvalid(f"lora_name is {len(name)} characters long; at most {MAX_NAME_CHARS}", "lora_name")
    if not _NAME.match(name) or any(part in (".", "..") for part in name.split("/")):
        raise LoRANameInvalid(f"lora_name {name!r} is not allowed: use letters, digits and _ . : @ -, "
                              "with '/' only between parts and no '.' or '..' part", "lora_name")
    if base.accepts(name):
        raise LoRANameInvalid(f"lora_name {name!r} is a name of the base model", "lora_name")
    return name


class LoRARegistry:
    def __init__(self, loader: AdapterLoader, base: ServedNames, roots: Sequence[str] = ()) -> None:
        self.loader = loader
        self.base = base
        self.roots = real_roots(roots)
        self._adapters: dict[str, Adapter] = {}
        self._loading: set[str] = set()  # names held while their load runs: a second load is refused
        self._ids = itertools.count(1)

    def get(self, name: str) -> LoRARequest | None:
        adapter = self._adapters.get(name)
        return adapter.request if adapter is not None else None

    @property
    def adapters(self) -> list[Adapter]:
        """In load order (the order /v1/models lists them)."""
        return list(self._adapters.values())

    async def load(self, name: str, source: str, *, trusted: bool = False, parent: str | None = None) -> Adapter:
        """Resolve `source`, have the engine load and check it, then register it under `name`.

        `trusted` (the operator's --lora-modules) skips the root confinement. All or nothing: on any error
        nothing is registered and the engine holds nothing. The work runs as its own task, so a handler
        cancelled midway (client gone) cannot leave the engine holding an adapter the registry lacks."""
        self.loader.check_accepting()  # a 503 while the model loads, before any path is looked at
        check_adapter_name(name, self.base)
        if name in self._adapters or name in self._loading:
            raise LoRAAlreadyLoaded(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        self._loading.add(name)
        task = asyncio.ensure_future(self._load(name, source, trusted, parent))
        task.add_done_callback(lambda _: self._loading.discard(name))
        return await asyncio.shield(task)

    async def _load(self, name: str, source: str, trusted: bool, parent: str | None) -> Adapter:
        path = await asyncio.to_thread(resolve_adapter_source, source, None if trusted else self.roots)
        request = LoRARequest(name, next(self._ids), path)
        await self.loader.load_lora(request)  # False: already held (a racing request loaded it); fine
        adapter = Adapter(request, source, parent)
        self._adapters[name] = adapter
        return adapter

    async def unload(self, name: str | None = None, lora_int_id: int | None = None) -> Adapter:
        """Forget the adapter, then have the engine drop it. By name, by id, or both (they must agree)."""
        self.loader.check_accepting()
        adapter = self._find(name, lora_int_id)
        del self._adapters[adapter.name]  # first: no new request can select it from here on
        await self.loader.remove_lora(adapter.request.lora_int_id)  # False: the LRU had evicted it already
        return adapter

    def _find(self, name: str | None, lora_int_id: int | None) -> Adapter:
        if name is not None:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise LoRANotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")
            if lora_int_id is not None and adapter.request.lora_int_id != lora_int_id:
                raise LoRANotFound(f"The lora adapter '{name}' has id {adapter.request.lora_int_id}, not "
                                   f"{lora_int_id}.", "lora_int_id")
            return adapter
        for adapter in self._adapters.values():
            if adapter.request.lora_int_id == lora_int_id:
                return adapter
        raise LoRANotFound(f"No lora adapter has id {lora_int_id}.", "lora_int_id")
