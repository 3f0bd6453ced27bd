"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with vLLM's bodies and plain-text answers.

load:   {lora_name, lora_path}               -> 200 "Success: LoRA adapter 'NAME' added successfully."
unload: {lora_name} or {lora_int_id} (or both) -> 200 "Success: LoRA adapter 'NAME' removed successfully."

Registered only with --allow-runtime-lora-updating (otherwise both are 404s, as in vLLM). Errors are the
registry's domain errors: a bad name, path or adapter is a 400, an unknown adapter a 404 (http_errors.py).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvpilot.common.errors import invalid

from .lora_registry import LoRARegistry
from .request_body import read_json_body
from .request_log import REQUEST_LOG_FIELDS


def _string(body: dict[str, Any], name: str, *, required: bool) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise invalid(name, f"'{name}' is required", "missing_required_parameter")
        return None
    if not isinstance(value, str):
        raise invalid(name, f"'{name}' must be a string", "invalid_type")
    return value


def _lora_int_id(body: dict[str, Any]) -> int | None:
    value = body.get("lora_int_id")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid("lora_int_id", "'lora_int_id' must be an integer >= 1", "invalid_type")
    return value


class LoRARoutes:
    def __init__(self, registry: LoRARegistry) -> None:
        self.registry = registry

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/load_lora_adapter", self.load)
        router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        body = await read_json_body(request)
        name = _string(body, "lora_name", required=True)
        path = _string(body, "lora_path", required=True)
        assert name is not None and path is not None
        request[REQUEST_LOG_FIELDS].update(lora_name=name)
        adapter = await self.registry.load(name, path)
        request[REQUEST_LOG_FIELDS].update(lora_int_id=adapter.request.lora_int_id)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await read_json_body(request)
        name = _string(body, "lora_name", required=False)
        lora_int_id = _lora_int_id(body)
        if not name and lora_int_id is None:
            raise invalid("lora_name", "either 'lora_name' or 'lora_int_id' needs to be provided.",
                          "missing_required_parameter")
        adapter = await self.registry.unload(name or None, lora_int_id)
        request[REQUEST_LOG_FIELDS].update(lora_name=adapter.name, lora_int_id=adapter.request.lora_int_id)
        return web.Response(text=f"Success: LoRA adapter '{adapter.name}' removed successfully.")
