"""The pod network plumbing on its own (netns.py): namespaces with veth pairs and 198.18.x addresses,
reachable from the host and from each other, nothing beyond; the API bridge; teardown and the sweep of a
dead run's leftovers. Skipped where namespaces cannot be made (not root, no `ip`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp.web
import pytest

from . import netns

WHY = netns.unavailable() if sys.platform == "linux" else "not Linux"
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")

CLIENT = ("import sys, urllib.request\n"
          "print(urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())\n")


def _serve(att: netns.Attachment, port: int, folder: Path) -> subprocess.Popen:
    """A tiny HTTP server inside the pod's namespace, bound to its address as the daemons are."""
    (folder / "index.html").write_text(f"hello from {att.ip}")
    return subprocess.Popen(att.wrap([sys.executable, "-m", "http.server", str(port), "--bind", att.ip,
                                      "--directory", str(folder)]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _get(url: str, deadline: float = 10.0) -> str:
    end = time.monotonic() + deadline
    while True:
        try:
            return urllib.request.urlopen(url, timeout=2).read().decode()
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def _inside(att: netns.Attachment, url: str) -> subprocess.CompletedProcess:
    return subprocess.run(att.wrap([sys.executable, "-c", CLIENT, url]), capture_output=True, text=True, timeout=20)


def test_pods_are_reachable_from_the_host_and_each_other_and_teardown_leaves_nothing(tmp_path: Path) -> None:
    net = netns.NamespaceNetwork()
    servers = []
    try:
        a, b = net.attach("a", 8000), net.attach("b", 8000)
        assert a.ip != b.ip and all(netns.ipaddress.ip_address(x.ip) in netns.POD_RANGE for x in (a, b))
        assert a.netns in netns.netns_names() and a.link in netns.link_names() and len(a.link) <= 15
        # no default route inside: a pod reaches the node and the pods, nothing else
        routes = netns._run("-n", a.netns, "route", "show")
        assert "default" not in routes and str(netns.POD_RANGE) in routes, routes
        assert f"{a.ip} dev {a.link}" in netns._run("-4", "route", "show")

        for att in (a, b):
            (tmp_path / att.ip).mkdir()
            servers.append(_serve(att, 8000, tmp_path / att.ip))
        assert _get(f"http://{a.ip}:8000/") == f"hello from {a.ip}"  # host -> pod
        assert _get(f"http://{b.ip}:8000/") == f"hello from {b.ip}"
        out = _inside(a, f"http://{b.ip}:8000/")  # pod -> pod, as the router reaches the daemons
        assert out.returncode == 0 and out.stdout.strip() == f"hello from {b.ip}", out.stderr
        # the pod's address is its own: the host's loopback is not the pod's
        assert _inside(a, "http://127.0.0.1:8000/").returncode != 0
        out = _inside(a, "http://203.0.113.1:80/")  # TEST-NET-3: refused in the pod (no route), nothing sent
        assert out.returncode != 0 and "unreachable" in out.stderr.lower(), out.stderr
    finally:
        for s in servers:
            s.kill()
            s.wait(5)
        net.close()
    left = netns.leftovers(net.tag)
    assert left == {"netns": [], "links": [], "routes": []}, left
    assert not any(net.tag in line for line in netns._run("-4", "-o", "addr", "show").splitlines())


async def _api_bridge(net: netns.NamespaceNetwork, tmp_path: Path) -> str:
    async def handler(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text=f"api saw {request.path}")
    app = aiohttp.web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        att = net.attach("router", 8000)
        await net.bridge_api(att, f"http://127.0.0.1:{port}")
        # the pod calls the URL of its kubeconfig, 127.0.0.1 of its own namespace, and reaches the host's server
        out = await asyncio.to_thread(_inside, att, f"http://127.0.0.1:{port}/version")
        return out.stdout.strip() or out.stderr
    finally:
        await runner.cleanup()


def test_the_api_servers_address_works_inside_the_pod(tmp_path: Path) -> None:
    net = netns.NamespaceNetwork()
    try:
        assert asyncio.run(_api_bridge(net, tmp_path)) == "api saw /version"
    finally:
        net.close()
    assert netns.leftovers(net.tag)["netns"] == []


def test_sweep_removes_a_dead_runs_leftovers() -> None:
    dead = next(p for p in range(0x3FFFFE, 0x3FF000, -1) if not os.path.exists(f"/proc/{p}"))
    net = netns.NamespaceNetwork(tag=netns.run_tag(dead, 3))
    net.attach("left-behind", 8000)
    netns._OPEN.remove(net)  # as if its process had been killed: nobody closes it
    assert netns.leftovers(net.tag)["netns"]
    removed = netns.sweep()
    assert any(n.startswith(netns.NS_PREFIX + net.tag) for n in removed)
    assert netns.leftovers(net.tag) == {"netns": [], "links": [], "routes": []}


def test_mode_is_chosen_once() -> None:
    mode, why = netns.choose()
    assert mode in ("netns", "loopback") and why
    assert netns.choose() == (mode, why)
