"""A small async Kubernetes API client for the operator's own calls (children, pods, status, events).

It reuses kopf's login functions so both talk to the same server with the same credentials.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from collections.abc import Callable
from typing import Any

import aiohttp
import kopf

FIELD_MANAGER = "kvpilot-operator"


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _pem(data: str | bytes) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----") else base64.b64decode(raw)


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    if info.insecure:
        return False
    ctx = ssl.create_default_context(
        cafile=os.fspath(info.ca_path) if info.ca_path else None,
        cadata=_pem(info.ca_data).decode() if info.ca_data else None,
    )
    if info.certificate_path or info.certificate_data:
        with tempfile.TemporaryDirectory() as d:  # load_cert_chain wants files
            cert = os.fspath(info.certificate_path) if info.certificate_path else os.path.join(d, "c.pem")
            key = os.fspath(info.private_key_path) if info.private_key_path else os.path.join(d, "k.pem")
            if info.certificate_data:
                with open(cert, "wb") as f:
                    f.write(_pem(info.certificate_data))
            if info.private_key_data:
                with open(key, "wb") as f:
                    f.write(_pem(info.private_key_data))
            ctx.load_cert_chain(cert, key)
    return ctx


def login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no service account and no kubeconfig")
    return info


class Kube:
    def __init__(self, relogin: Callable[[], kopf.ConnectionInfo]) -> None:
        self._relogin = relogin
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None

    def _connect(self) -> None:
        self._info = self._relogin()
        connector = aiohttp.TCPConnector(ssl=_ssl_context(self._info), limit=32)
        headers = {}
        if self._info.token:
            headers["Authorization"] = f"{self._info.scheme or 'Bearer'} {self._info.token}"
        auth = aiohttp.BasicAuth(self._info.username, self._info.password or "") if self._info.username else None
        self._session = aiohttp.ClientSession(self._info.server.rstrip("/"), connector=connector,
                                              headers=headers, auth=auth)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, body: Any = None, params: dict[str, str] | None = None,
                      content_type: str = "application/json", _retry: bool = True) -> Any:
        if self._session is None:
            self._connect()
        assert self._session is not None
        data = json.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self._session.request(method, path, data=data, params=params, headers=headers) as resp:
            text = await resp.text()
            if resp.status == 401 and _retry:  # rotated service-account token: log in again once
                await self.close()
                return await self.request(method, path, body=body, params=params, content_type=content_type,
                                          _retry=False)
            if resp.status >= 400:
                raise ApiError(resp.status, text[:500])
            return json.loads(text) if text else None

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self.request("GET", path, params=params)
        return list((result or {}).get("items") or [])

    async def apply(self, collection: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply (our fields only; fields we stop setting are removed). Create if absent."""
        path = f"{collection}/{manifest['metadata']['name']}"
        try:
            return await self.request("PATCH", path, body=manifest, content_type="application/apply-patch+yaml",
                                      params={"fieldManager": FIELD_MANAGER, "force": "true"})
        except ApiError as e:
            if e.status != 404:  # an API server creates on apply; an emulator may not
                raise
        return await self.request("POST", collection, body=manifest, params={"fieldManager": FIELD_MANAGER})

    async def merge_patch(self, path: str, patch: dict[str, Any], manager: str = FIELD_MANAGER) -> Any:
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json",
                                  params={"fieldManager": manager})

    async def delete(self, path: str) -> bool:
        try:
            await self.request("DELETE", path)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    async def create(self, collection: str, body: dict[str, Any]) -> Any:
        return await self.request("POST", collection, body=body)


def deployments(ns: str) -> str:
    return f"/apis/apps/v1/namespaces/{ns}/deployments"


def services(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/services"


def pdbs(ns: str) -> str:
    return f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets"


def pods(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/pods"


def events(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/events"


def inferencedeployment(ns: str, name: str) -> str:
    return f"/apis/kvpilot.io/v1alpha1/namespaces/{ns}/inferencedeployments/{name}"
