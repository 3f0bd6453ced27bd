"""Where a run happens: the kmock emulator (CI, the default) or an existing cluster (`E2E_KUBECONFIG`).

On a cluster the run needs an API server and a controller-manager, nothing else: the node agent is the
only node. It installs the CRD when the cluster lacks it, works in a namespace of its own, and removes
what it created (the namespace, its Node, the CRDs only if it installed them).

Both get the run's pod network (netns.py): a network namespace per pod where this machine can make them,
else loopback addresses, which only the emulator accepts in EndpointSlices (a real API server refuses
them), so on a cluster the router scenario needs namespaces (`router_scenario.cluster_limit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvpilot.operator.kube import KubeApiError

from . import kubeconfig, netns
from .agent import NODE_NAME
from .cluster import (
    CRD_FILES,
    CRDS,
    NAMESPACES,
    NODES,
    Kube,
    condition,
    crd_manifest,
    write_kubeconfig,
)
from .emulator import emulator
from .node import NodeSpec

ENV = "E2E_KUBECONFIG"


class ClusterError(RuntimeError):
    """The cluster named by E2E_KUBECONFIG cannot run the e2e; the message says why and what to do."""


@dataclass
class Target:
    kube: Kube
    kubeconfig: Path  # for the operator subprocess
    real: bool
    namespace: str
    node: NodeSpec
    network: netns.PodNetwork = field(default_factory=netns.LoopbackNetwork)
    installed_crds: list[str] = field(default_factory=list)  # the CRDs this run installed (and so removes)


@contextlib.asynccontextmanager
async def open_target(workdir: Path, namespace: str, capacity: dict[str, str]) -> AsyncIterator[Target]:
    """The cluster of E2E_KUBECONFIG, else the emulator; with the run's pod network, removed at the end."""
    path = os.environ.get(ENV)
    network = netns.open_network()
    try:
        if path:
            async with cluster(Path(path), namespace, capacity) as t:
                t.network = network
                yield t
            return
        # The emulator refuses loopback addresses in EndpointSlices, as a real API server does, unless the
        # pods have no other (loopback mode).
        async with emulator(loopback_endpoints=network.mode == "loopback") as kube:
            await kube.apply_crd()
            yield Target(kube, write_kubeconfig(workdir / "kubeconfig", kube.url), False, namespace,
                         NodeSpec(NODE_NAME, capacity), network)
    finally:
        network.close()


async def preflight(kube: Kube, path: Path) -> dict:
    """GET /version: a clear failure when nothing answers or the credentials are refused."""
    hint = f"Start the cluster (kind create cluster, k3s) or unset {ENV} to run on the kmock emulator."
    try:
        return await kube.request("GET", "/version")
    except KubeApiError as e:
        raise ClusterError(f"{ENV}={path}: the API server at {kube.url} refused the request: {e}") from e
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise ClusterError(f"{ENV}={path}: no API server answers at {kube.url} "
                           f"({type(e).__name__}: {e}). {hint}") from e


async def ensure_crd(kube: Kube, name: str) -> bool:
    """Install the CRD unless the cluster has it; True when this run installed it (and so removes it)."""
    if await kube.get(f"{CRDS}/{name}") is not None:
        return False
    await kube.create(CRDS, crd_manifest(name))
    for _ in range(120):  # 60 s
        c = condition(await kube.get(f"{CRDS}/{name}"), "Established")
        if c and c.get("status") == "True":
            return True
        await asyncio.sleep(0.5)
    raise ClusterError(f"the CRD {name} was created but is not Established after 60 s")


@contextlib.asynccontextmanager
async def cluster(path: Path, namespace: str, capacity: dict[str, str]) -> AsyncIterator[Target]:
    if not path.is_file():
        raise ClusterError(f"{ENV}={path}: no such file")
    try:
        info = kubeconfig.load(path)
    except ValueError as e:
        raise ClusterError(f"{ENV}: {e}") from e
    kube = Kube(lambda: info, emulated=False)
    try:
        await preflight(kube, path)
        suffix = secrets.token_hex(3)  # a run of its own, beside anything else on the cluster
        target = Target(kube, path, True, f"{namespace}-{suffix}", NodeSpec(f"kvpilot-e2e-{suffix}", capacity))
        try:
            for name in CRD_FILES:  # recorded one by one: a failure on the second still removes the first
                if await ensure_crd(kube, name):
                    target.installed_crds.append(name)
            await kube.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {
                "name": target.namespace, "labels": {"app.kubernetes.io/part-of": "kvpilot-e2e"}}})
            yield target
        finally:
            await cleanup(target)
    finally:
        await kube.close()


async def cleanup(t: Target) -> None:
    """Best effort, each step on its own: the namespace (and with it every object of the run), the Node
    (the agent deletes it too), the CRDs this run installed."""
    steps = [f"{NAMESPACES}/{t.namespace}", f"{NODES}/{t.node.name}"]
    steps += [f"{CRDS}/{name}" for name in t.installed_crds]
    for path in steps:
        with contextlib.suppress(KubeApiError, aiohttp.ClientError, TimeoutError, OSError):
            await t.kube.delete(path)
