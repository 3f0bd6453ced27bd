"""The cluster path's connection, without a cluster: kubeconfigs with a token, client certificates as
base64 data, a CA file or data, against a real TLS server on 127.0.0.1 (certificates made with openssl);
and the clear failure when E2E_KUBECONFIG names a server that does not answer.
"""

from __future__ import annotations

import base64
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import aiohttp.web
import pytest
import yaml

from .cluster import Kube
from .kubeconfig import load
from .target import ClusterError, open_target, preflight

pytestmark = pytest.mark.timeout(60)
TOKEN = "s3cret-token"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certs(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-subj", "/CN=e2e-ca", "-days", "1", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, cn in (("server", "127.0.0.1"), ("client", "e2e-user")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={cn}", cwd=d)
        ext = ["-extfile", "san.ext"] if name == "server" else []
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "1", *ext, cwd=d)


def _kubeconfig(path: Path, server: str, cluster: dict, user: dict) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "team"}}]}))
    return path


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


@pytest.fixture
async def tls_server(tmp_path: Path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificates")
    _certs(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tmp_path / "ca.crt"))
    ctx.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")
    ctx.verify_mode = ssl.CERT_OPTIONAL  # a client certificate or a token, as an API server accepts

    async def version(request: aiohttp.web.Request) -> aiohttp.web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        who = dict(x[0] for x in peer["subject"])["commonName"] if peer else None
        if who != "e2e-user" and request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return aiohttp.web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized"}, status=401)
        return aiohttp.web.json_response({"gitVersion": "v1.30.0", "user": who or "token"})

    app = aiohttp.web.Application()
    app.router.add_get("/version", version)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"https://127.0.0.1:{port}", tmp_path
    finally:
        await runner.cleanup()


async def _version(path: Path) -> dict:
    info = load(path)
    async with Kube(lambda: info, emulated=False) as kube:
        return await preflight(kube, path)


async def test_client_certificate_data_and_ca_data(tls_server) -> None:
    url, d = tls_server
    cfg = _kubeconfig(d / "certs.yaml", url, {"certificate-authority-data": _b64(d / "ca.crt")},
                      {"client-certificate-data": _b64(d / "client.crt"), "client-key-data": _b64(d / "client.key")})
    assert (await _version(cfg))["user"] == "e2e-user"
    assert load(cfg).default_namespace == "team"


async def test_token_with_ca_file(tls_server) -> None:
    url, d = tls_server
    cfg = _kubeconfig(d / "token.yaml", url, {"certificate-authority": str(d / "ca.crt")}, {"token": TOKEN})
    assert (await _version(cfg))["user"] == "token"
    bad = _kubeconfig(d / "bad.yaml", url, {"certificate-authority": str(d / "ca.crt")}, {"token": "wrong"})
    with pytest.raises(ClusterError, match="refused"):
        await _version(bad)


async def test_unknown_ca_is_refused(tls_server) -> None:
    url, d = tls_server
    cfg = _kubeconfig(d / "noca.yaml", url, {}, {"token": TOKEN})  # the system CAs do not know ours
    with pytest.raises(ClusterError, match="no API server answers"):
        await _version(cfg)


async def test_e2e_kubeconfig_without_a_server_fails_clearly(tmp_path: Path, monkeypatch) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = _kubeconfig(tmp_path / "down.yaml", f"http://127.0.0.1:{port}", {}, {"token": TOKEN})
    monkeypatch.setenv("E2E_KUBECONFIG", str(cfg))
    with pytest.raises(ClusterError, match=r"E2E_KUBECONFIG=.*no API server answers.*unset E2E_KUBECONFIG"):
        async with open_target(tmp_path, "ns", {"cpu": "1"}):
            pass
    monkeypatch.setenv("E2E_KUBECONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ClusterError, match="no such file"):
        async with open_target(tmp_path, "ns", {"cpu": "1"}):
            pass
