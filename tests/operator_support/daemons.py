"""Daemons with LoRA, played for the LoRAAdapter controller: each a MetricsServer (its own 127.0.0.x, its own
event loop) that also answers the routes of the daemon contract:

- GET /v1/models: the base model, then each loaded adapter as {"id", "parent", "root"};
- POST /v1/load_lora_adapter {"lora_name", "lora_path"}: 200 plain text; 400 with an OpenAI error body for
  a name already loaded or an adapter the test made it refuse;
- POST /v1/unload_lora_adapter {"lora_name"}: 200; 404 when not loaded.

The routes exist only with `runtime` (the daemon's --allow-runtime-lora-updating). `restart()` is a container
restart: the same pod and address, and nothing loaded. Pods are made from the live Deployment's template, as
a ReplicaSet makes them, so their args are what the operator rendered.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import aiohttp.web

from .harness import Cluster, MetricsServer


def openai_error(status: int, message: str, code: str) -> aiohttp.web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": "lora_name", "code": code}}
    return aiohttp.web.Response(status=status, text=json.dumps(body), content_type="application/json")


class FakeDaemon(MetricsServer):
    def __init__(self, host: str, base_model: str = "llm") -> None:
        super().__init__(host)
        self.base_model = base_model
        self.loaded: dict[str, str] = {}  # adapter name -> lora_path
        self.refuse: dict[str, str] = {}  # adapter name -> the message of the 400 its loads get
        self.runtime = True
        self.models_fail = False
        self.calls: list[tuple[str, dict[str, Any]]] = []  # (route, body), in order

    def restart(self) -> None:
        self.loaded.clear()

    def routes(self, app: aiohttp.web.Application) -> None:
        super().routes(app)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load)
        app.router.add_post("/v1/unload_lora_adapter", self._unload)

    async def _models(self, _request: aiohttp.web.Request) -> aiohttp.web.Response:
        if self.models_fail:
            return aiohttp.web.Response(status=503, text="engine dead")
        data = [{"id": self.base_model, "object": "model", "parent": None, "root": self.base_model}]
        data += [{"id": name, "object": "model", "parent": self.base_model, "root": path}
                 for name, path in sorted(self.loaded.items())]
        return aiohttp.web.json_response({"object": "list", "data": data})

    async def _load(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if not self.runtime:
            return aiohttp.web.Response(status=404, text="404: Not Found")
        body = await request.json()
        self.calls.append(("load", body))
        name, path = body["lora_name"], body["lora_path"]
        if name in self.refuse:
            return openai_error(400, self.refuse[name], "invalid_lora_adapter")
        if name in self.loaded:
            return openai_error(400, f"The lora adapter '{name}' has already been loaded.", "lora_already_loaded")
        self.loaded[name] = path
        return aiohttp.web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if not self.runtime:
            return aiohttp.web.Response(status=404, text="404: Not Found")
        body = await request.json()
        self.calls.append(("unload", body))
        if self.loaded.pop(body["lora_name"], None) is None:
            return openai_error(404, f"The lora adapter '{body['lora_name']}' cannot be found.", "not_found")
        return aiohttp.web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    def loads(self) -> list[str]:
        return [b["lora_name"] for route, b in self.calls if route == "load"]


async def add_daemon_pod(k: Cluster, ns: str, name: str, base: str, daemon: FakeDaemon,
                         ready: bool = True) -> dict[str, Any]:
    """A pod of the base's Deployment, with its template's spec and labels, served by `daemon`."""
    dep = await k.deployment(ns, base)
    assert dep is not None, f"no Deployment {base} yet"
    template = copy.deepcopy(dep["spec"]["template"])
    meta = template.get("metadata") or {}
    annotations = {**(meta.get("annotations") or {}), "kvpilot.io/metrics-port": str(daemon.port)}
    pod = {"apiVersion": "v1", "kind": "Pod", "spec": template["spec"],
           "metadata": {"name": name, "namespace": ns, "labels": meta.get("labels") or {}, "annotations": annotations}}
    created = await k.call("POST", f"/api/v1/namespaces/{ns}/pods", pod)
    await k.set_pod_ready(ns, name, daemon.host, ready)
    return created
