"""The autoscaling loop on its own (no kopf): an index, the kmock emulator and a pod's /metrics on 127.0.0.2."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from kvpilot.operator import kube, resources
from kvpilot.operator.loop import AutoscalingLoop, index_entry
from kvpilot.operator.tick import Cr
from operator_support.harness import MetricsServer, cluster

pytestmark = pytest.mark.timeout(60)
NS = "ml"
BODY = {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "llm", "namespace": NS, "uid": "u-1", "generation": 1},
        "spec": {"model": {"uri": "hf://o/m"},
                 "autoscaling": {"enabled": True, "maxReplicas": 4, "targetKVCacheUsage": 0.5,
                                 "metricsIntervalSeconds": 30}}}


async def setup(k, metrics_port: int) -> None:
    await k.create_cr(NS, BODY)
    c = Cr.from_body(BODY)
    await k.call("POST", kube.deployments(NS), resources.render_deployment(c.meta, c.spec, 1))
    await k.add_pod(NS, "llm-a", "llm", "127.0.0.2", metrics_port, ready=True)


def make_loop(k, http, index, paused=None) -> AutoscalingLoop:
    return AutoscalingLoop(client=kube.KubeClient(k.url), http=http, index=index, locks={}, scrape_timeout=0.5,
                           period=0.1, logger=logging.getLogger("test"), paused=paused)


async def replicas(k) -> int:
    return (await k.deployment(NS, "llm"))["spec"]["replicas"]


async def test_round_scales_writes_status_and_respects_the_interval(tmp_path):
    async with cluster(tmp_path) as k, MetricsServer("127.0.0.2") as m, aiohttp.ClientSession() as http:
        await setup(k, m.port)
        m.kv = 0.95
        index = {(NS, "llm"): [index_entry(BODY)]}
        loop = make_loop(k, http, index)
        await loop.round(100.0)
        assert await replicas(k) == 2
        st = (await k.cr(NS, "llm"))["status"]
        assert st["desiredReplicas"] == 2 and st["lastScaleTime"] and st["metrics"]["sampledPods"] == 1
        assert "observedGeneration" not in st  # only reconcile claims a generation
        events = await k.items(kube.events(NS))
        assert [e["reason"] for e in events] == ["ScaledUp"]
        assert await k.get(f"{kube.pdbs(NS)}/llm") is not None  # two replicas: a PDB

        hits = m.hits
        await loop.round(110.0)  # within metricsIntervalSeconds: not due
        assert m.hits == hits
        await loop.round(130.0)
        assert m.hits == hits + 1
        await loop.client.close()


async def test_paused_by_a_peer_does_nothing_and_deleted_objects_are_forgotten(tmp_path):
    async with cluster(tmp_path) as k, MetricsServer("127.0.0.2") as m, aiohttp.ClientSession() as http:
        await setup(k, m.port)
        m.kv = 0.95
        index = {(NS, "llm"): [index_entry(BODY)]}
        is_paused = True

        async def paused() -> bool:
            return is_paused

        loop = make_loop(k, http, index, paused)
        await loop.round(100.0)
        assert m.hits == 0 and await replicas(k) == 1 and not (await k.cr(NS, "llm")).get("status")
        is_paused = False
        await loop.round(101.0)
        assert await replicas(k) == 2 and set(loop.states) == {(NS, "llm")}
        index.clear()  # kopf drops a deleted object from its index
        await loop.round(200.0)
        assert loop.states == {}
        await loop.client.close()


async def test_the_lock_keeps_a_tick_from_running_beside_a_reconcile(tmp_path):
    async with cluster(tmp_path) as k, MetricsServer("127.0.0.2") as m, aiohttp.ClientSession() as http:
        await setup(k, m.port)
        m.kv = 0.95
        loop = make_loop(k, http, {(NS, "llm"): [index_entry(BODY)]})
        lock = loop.locks.setdefault((NS, "llm"), asyncio.Lock())
        async with lock:  # what reconcile holds while it applies the Deployment
            task = asyncio.create_task(loop.round(100.0))
            await asyncio.sleep(0.3)
            assert m.hits == 0 and not task.done()
        await task
        assert await replicas(k) == 2
        await loop.client.close()


async def test_status_write_is_retried_after_a_concurrent_writer(tmp_path):
    """Another writer changes the CR between the tick's read and its status patch: the emulator answers 409
    to the stale resourceVersion, and the write reads again and lands, keeping the other writer's change."""
    from kvpilot.operator.status import now_iso
    from kvpilot.operator.tick import write_status

    async with cluster(tmp_path) as k:
        await k.create_cr(NS, BODY)
        cr_path = kube.inferencedeployment(NS, "llm")
        reads = []

        async def after_request(_session, _ctx, params) -> None:
            if params.method == "GET" and params.url.path == cr_path:
                reads.append(1)
                if len(reads) == 1:  # the other writer, between our read and our write
                    await k.call("PATCH", cr_path, {"metadata": {"labels": {"team": "a"}}})

        trace = aiohttp.TraceConfig()
        trace.on_request_end.append(after_request)
        async with aiohttp.ClientSession(trace_configs=[trace]) as session:
            client = kube.KubeClient(k.url, session=session)
            await write_status(client, Cr.from_body(BODY), deployment=None, now=now_iso())
        assert len(reads) == 2
        obj = await k.cr(NS, "llm")
        assert obj["metadata"]["labels"] == {"team": "a"}
        assert obj["status"]["url"] == "http://llm.ml.svc:8000/v1"
        assert obj["metadata"]["generation"] == 1  # neither write touched the spec


async def test_at_zero_the_loop_ticks_often_so_a_held_request_wakes_it_soon(tmp_path):
    from kvpilot.operator import routing
    body = {**BODY, "spec": {**BODY["spec"], "router": {"enabled": True},
                             "autoscaling": {**BODY["spec"]["autoscaling"], "minReplicas": 0}}}
    async with cluster(tmp_path) as k, aiohttp.ClientSession() as http:
        await k.create_cr(NS, body)
        c = Cr.from_body(body)
        await k.call("POST", kube.deployments(NS), resources.render_deployment(c.meta, c.spec, 0))
        await k.call("POST", kube.deployments(NS), routing.render_router_deployment(c.meta, c.spec))
        loop = make_loop(k, http, {(NS, "llm"): [index_entry(body)]})
        await loop.round(100.0)  # no router pod yet, so nothing is held: it stays at zero
        assert await replicas(k) == 0
        assert (await k.cr(NS, "llm"))["status"]["autoscaler"]["reason"] == "ScaledToZero"
        assert loop.states[(NS, "llm")].due == 100.0 + 1.0  # not metricsIntervalSeconds (30)
        await loop.client.close()
