"""One small async Kubernetes API client, shared by the operator, the tests and the e2e runs.

API (all paths are API paths such as ``/apis/apps/v1/namespaces/ml/deployments/llm``):

- ``KubeClient(server, token=None, session=None, field_manager=...)``: ``server`` is a URL, or a callable
  returning a ``kopf.ConnectionInfo`` (called lazily, and again once on a 401, for rotated tokens).
  ``KubeClient.from_kopf(settings)`` logs in like kopf does. Use ``async with`` or ``await close()``.
- ``get(path) -> dict | None`` (None on 404); ``list(collection, label_selector=..., field_selector=...)``;
  ``create(collection, obj)``; ``delete(path, grace_period=, uid=, propagation=) -> bool`` (False on 404);
  ``patch(path, body, kind="merge"|"strategic"|"json"|"apply", manager=None, force=False)``;
  ``apply(collection, manifest)``: server-side apply, creating the object where the server does not;
  ``watch(collection, label_selector=..., resource_version=...)``: an async iterator of watch events;
  ``request(method, path, ...)`` for anything else.
- ``KubeApiError(status, reason, message, method, path)`` for every answer >= 400; ``.not_found`` and
  ``.conflict`` name the two cases callers handle.
- ``retry_on_conflict(attempt, attempts=5)``: runs ``attempt()`` again on a 409; each attempt must read
  the object afresh (its resourceVersion is the precondition).
- ``label_selector(labels)``, ``collection(api_version, plural, ns)`` and the ``deployments(ns)`` & co.
  path helpers.

``Kube`` and ``ApiError`` are the older names of ``KubeClient`` and ``KubeApiError``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal, TypeVar

import aiohttp
import kopf

from kvpilot.operator.names import GROUP, LORA_PLURAL, PLURAL, VERSION

FIELD_MANAGER = "kvpilot-operator"
PatchKind = Literal["merge", "strategic", "json", "apply"]
CONTENT_TYPES: dict[str, str] = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
    "apply": "application/apply-patch+yaml",
}
T = TypeVar("T")


class KubeApiError(Exception):
    """An API answer >= 400, with the Status object's reason when the server sent one."""

    def __init__(self, status: int, reason: str = "", message: str = "", method: str = "", path: str = "") -> None:
        where = f"{method} {path}: " if method else ""
        super().__init__(f"{where}HTTP {status} {reason}: {message[:500]}".rstrip(": "))
        self.status = status
        self.reason = reason
        self.message = message
        self.method = method
        self.path = path

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @classmethod
    def from_response(cls, status: int, text: str, method: str, path: str) -> KubeApiError:
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if isinstance(body, dict) and body.get("kind") == "Status":
            return cls(status, str(body.get("reason") or ""), str(body.get("message") or ""), method, path)
        return cls(status, "", text, method, path)


def _pem(data: str | bytes) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----") else base64.b64decode(raw)


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https") or info.insecure:
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


def label_selector(labels: Mapping[str, str]) -> str:
    """{"a": "1", "b": "2"} -> "a=1,b=2" (sorted, so the same labels give the same string)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


class KubeClient:
    def __init__(self, server: str | Callable[[], kopf.ConnectionInfo], *, token: str | None = None,
                 session: aiohttp.ClientSession | None = None, field_manager: str = FIELD_MANAGER,
                 timeout: float = 30.0) -> None:
        if isinstance(server, str):
            info = kopf.ConnectionInfo(server=server, token=token)
            self._login: Callable[[], kopf.ConnectionInfo] = lambda: info
        else:
            self._login = server
        self.field_manager = field_manager
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._given_session = session  # the caller's: used as is, never closed here
        self._owned: aiohttp.ClientSession | None = None  # ours: closed by close()
        self._active: aiohttp.ClientSession | None = None
        self._server = ""
        self._headers: dict[str, str] = {}

    @classmethod
    def from_kopf(cls, settings: kopf.OperatorSettings, **kwargs: Any) -> KubeClient:
        return cls(lambda: login(settings), **kwargs)

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _connect(self) -> aiohttp.ClientSession:
        info = self._login()
        self._server = info.server.rstrip("/")
        self._headers = {}
        if info.token:
            self._headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        elif info.username:
            self._headers["Authorization"] = aiohttp.BasicAuth(info.username, info.password or "").encode()
        if self._given_session is not None:
            self._active = self._given_session
        else:
            self._owned = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=_ssl_context(info), limit=32))
            self._active = self._owned
        return self._active

    async def close(self) -> None:
        if self._owned is not None:
            await self._owned.close()
        self._owned = self._active = None

    def _open(self) -> aiohttp.ClientSession:
        return self._active if self._active is not None else self._connect()

    async def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> Any:
        """One call; the decoded JSON answer (None when empty). Raises KubeApiError on >= 400."""
        for attempt in (1, 2):
            session = self._open()
            headers = dict(self._headers)
            data = None
            if body is not None:
                data = json.dumps(body)
                headers["Content-Type"] = content_type
            async with session.request(method, self._server + path, data=data, params=params, headers=headers,
                                       timeout=self._timeout) as resp:
                text = await resp.text()
                if resp.status == 401 and attempt == 1:  # a rotated service-account token: log in again once
                    await self.close()
                    continue
                if resp.status >= 400:
                    raise KubeApiError.from_response(resp.status, text, method, path)
                return json.loads(text) if text else None
        raise AssertionError("unreachable")

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except KubeApiError as e:
            if e.not_found:
                return None
            raise

    async def list(self, path: str, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        params = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        result = await self.request("GET", path, params=params or None)
        return list((result or {}).get("items") or [])

    async def create(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", collection, body=obj, params={"fieldManager": self.field_manager})

    async def patch(self, path: str, body: Any, kind: PatchKind = "merge", manager: str | None = None,
                    force: bool = False) -> dict[str, Any]:
        """PATCH with the given patch type. "apply" is server-side apply; force takes fields from others."""
        params = {"fieldManager": manager or self.field_manager}
        if force:
            params["force"] = "true"
        return await self.request("PATCH", path, body=body, params=params, content_type=CONTENT_TYPES[kind])

    async def merge_patch(self, path: str, body: dict[str, Any], manager: str | None = None) -> dict[str, Any]:
        return await self.patch(path, body, "merge", manager)

    async def apply(self, collection: str, manifest: dict[str, Any], manager: str | None = None) -> dict[str, Any]:
        """Server-side apply (our fields only; fields we stop setting are removed). Create if absent."""
        path = f"{collection}/{manifest['metadata']['name']}"
        try:
            return await self.patch(path, manifest, "apply", manager, force=True)
        except KubeApiError as e:
            if not e.not_found:  # an API server creates on apply; an emulator may not
                raise
        return await self.create(collection, manifest)

    async def delete(self, path: str, *, grace_period: int | None = None, uid: str | None = None,
                     propagation: str | None = None) -> bool:
        """DELETE; False when already gone. The options go in DeleteOptions: a grace period, a uid that must
        match (not a successor of the same name), and "Foreground"/"Background"/"Orphan" propagation."""
        opts: dict[str, Any] = {}
        if grace_period is not None:
            opts["gracePeriodSeconds"] = grace_period
        if uid is not None:
            opts["preconditions"] = {"uid": uid}
        if propagation is not None:
            opts["propagationPolicy"] = propagation
        body = {"apiVersion": "v1", "kind": "DeleteOptions", **opts} if opts else None
        try:
            await self.request("DELETE", path, body=body)
            return True
        except KubeApiError as e:
            if e.not_found:
                return False
            raise

    async def watch(self, path: str, label_selector: str | None = None, resource_version: str | None = None,
                    timeout_seconds: int | None = None) -> AsyncIterator[dict[str, Any]]:
        """Watch events ({"type": ..., "object": ...}) of a collection until the server ends the stream."""
        params = {"watch": "true"}
        for key, value in (("labelSelector", label_selector), ("resourceVersion", resource_version),
                           ("timeoutSeconds", timeout_seconds)):
            if value is not None:
                params[key] = str(value)
        session = self._open()
        async with session.get(self._server + path, params=params, headers=self._headers,
                               timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as resp:
            if resp.status >= 400:
                raise KubeApiError.from_response(resp.status, await resp.text(), "GET", path)
            async for line in resp.content:
                if line.strip():
                    yield json.loads(line)


async def retry_on_conflict(attempt: Callable[[], Awaitable[T]], attempts: int = 5, delay: float = 0.05) -> T:
    """Run attempt() until it does not fail with a 409 (a stale resourceVersion), at most `attempts` times."""
    for n in range(1, attempts + 1):
        try:
            return await attempt()
        except KubeApiError as e:
            if not e.conflict or n == attempts:
                raise
        await asyncio.sleep(delay * n)
    raise AssertionError("unreachable")



def collection(api_version: str, plural: str, ns: str | None = None) -> str:
    base = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    return f"{base}/namespaces/{ns}/{plural}" if ns else f"{base}/{plural}"


def _namespaced(api_version: str, plural: str) -> Callable[[str], str]:
    """The path helper of one resource kind: ns -> the collection path in that namespace."""
    def path(ns: str) -> str:
        return collection(api_version, plural, ns)
    return path


# One line a kind, so a new kind is one more row, not one more function.
deployments = _namespaced("apps/v1", "deployments")
services = _namespaced("v1", "services")
pdbs = _namespaced("policy/v1", "poddisruptionbudgets")
pods = _namespaced("v1", "pods")
serviceaccounts = _namespaced("v1", "serviceaccounts")
roles = _namespaced("rbac.authorization.k8s.io/v1", "roles")
rolebindings = _namespaced("rbac.authorization.k8s.io/v1", "rolebindings")
inferencepools = _namespaced("inference.networking.k8s.io/v1", "inferencepools")
leaderworkersets = _namespaced("leaderworkerset.x-k8s.io/v1", "leaderworkersets")
events = _namespaced("v1", "events")


def inferencedeployments(ns: str | None = None) -> str:
    return collection(f"{GROUP}/{VERSION}", PLURAL, ns)


def inferencedeployment(ns: str, name: str) -> str:
    return f"{inferencedeployments(ns)}/{name}"


def loraadapters(ns: str | None = None) -> str:
    return collection(f"{GROUP}/{VERSION}", LORA_PLURAL, ns)


def loraadapter(ns: str, name: str) -> str:
    return f"{loraadapters(ns)}/{name}"
