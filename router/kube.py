"""Kubernetes API access for the router: credentials from the `kubernetes` package's loaders (in-cluster
service account first, then KUBECONFIG), requests and watch streams over aiohttp."""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass
class KubeClient:
    """A thin client: the server URL, a token source, and an SSL context. One session, reused."""

    host: str
    config: Any  # kubernetes.client.Configuration (it refreshes rotated tokens)
    ssl_context: ssl.SSLContext | bool = False
    _session: aiohttp.ClientSession | None = None

    @classmethod
    def from_environment(cls) -> KubeClient:
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            # the package reads $KUBECONFIG once at import; read it now
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg)
        return cls(host=cfg.host.rstrip("/"), config=cfg, ssl_context=_ssl_context(cfg))

    def _headers(self) -> dict[str, str]:
        token = self.config.get_api_key_with_prefix("BearerToken") or self.config.get_api_key_with_prefix(
            "authorization")
        return {"Authorization": token} if token else {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.ssl_context, limit=4))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        async with self._client().get(self.host + path, params=params, headers=self._headers(),
                                      timeout=aiohttp.ClientTimeout(total=30)) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise KubeError(resp.status, text[:300])
            return json.loads(text)

    async def watch(self, path: str, params: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
        """Watch events (one JSON object a line) until the server ends the stream."""
        params = {**params, "watch": "true"}
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=None)
        async with self._client().get(self.host + path, params=params, headers=self._headers(),
                                      timeout=timeout) as resp:
            if resp.status >= 400:
                raise KubeError(resp.status, (await resp.text())[:300])
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)


def _ssl_context(cfg: Any) -> ssl.SSLContext | bool:
    if not cfg.host.startswith("https"):
        return False
    if not cfg.verify_ssl:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    return ctx


def current_namespace(default: str = "default") -> str:
    try:
        return SA_NAMESPACE_FILE.read_text().strip() or default
    except OSError:
        return default
