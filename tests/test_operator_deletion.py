"""Deleting an InferenceDeployment never depends on the operator: no finalizer is ever put on it, and the old
kopf finalizer of earlier versions is taken off at startup. Against the kmock emulator, which keeps objects
with finalizers in Terminating (deletionTimestamp) as an API server does."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.operator import kube
from kvpilot.operator.finalizers import LEGACY_FINALIZER, strip_legacy_finalizers, without_legacy
from operator_support.harness import CR_PATH, cluster, eventually, operator

pytestmark = pytest.mark.timeout(120)
NS = "ml"


def cr(name: str, uid: str, finalizers: list[str] | None = None) -> dict:
    meta = {"name": name, "namespace": NS, "uid": uid, "generation": 1, "resourceVersion": "1"}
    if finalizers:
        meta["finalizers"] = finalizers
    spec = {"model": {"uri": "hf://org/m"}, "autoscaling": {"enabled": True, "metricsIntervalSeconds": 1}}
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment", "metadata": meta, "spec": spec}


def path(name: str) -> str:
    return f"{CR_PATH.format(ns=NS)}/{name}"


async def test_no_finalizer_while_running_and_delete_works_with_the_operator_stopped(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k:
        with operator(monkeypatch, tmp_path, k.url):
            await k.create_cr(NS, cr("llm", "uid-1"))
            await eventually(lambda: k.deployment(NS, "llm"), what="Deployment")

            async def scaled_status():
                obj = await k.cr(NS, "llm")
                return obj if ((obj or {}).get("status") or {}).get("autoscaler") else None
            await eventually(scaled_status, what="a status from the autoscaling loop")
            await asyncio.sleep(2.5)  # a few more loop ticks and kopf cycles
            assert not (await k.cr(NS, "llm"))["metadata"].get("finalizers")
        # The operator is stopped: the delete completes at once, nothing is left in Terminating.
        await k.call("DELETE", path("llm"))
        assert await k.cr(NS, "llm") is None


async def test_startup_releases_objects_stuck_on_the_old_finalizer(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k:
        await k.create_cr(NS, cr("stuck", "uid-s", [LEGACY_FINALIZER]))
        await k.create_cr(NS, cr("kept", "uid-k", ["example.com/other", LEGACY_FINALIZER]))
        await k.call("DELETE", path("stuck"))
        stuck = await k.cr(NS, "stuck")
        assert stuck is not None and stuck["metadata"]["deletionTimestamp"]  # what the old operator left

        with operator(monkeypatch, tmp_path, k.url):
            await eventually(lambda: _gone(k, "stuck"), what="the Terminating CR to go")

            async def released():
                obj = await k.cr(NS, "kept")
                return obj if obj["metadata"].get("finalizers") == ["example.com/other"] else None
            await eventually(released, what="only the old finalizer removed")
            await eventually(lambda: k.deployment(NS, "kept"), what="the kept CR still reconciled")


async def _gone(k, name: str) -> bool:
    return await k.cr(NS, name) is None


@pytest.mark.parametrize("finalizers, expected", [
    ([LEGACY_FINALIZER], []),
    (["a/b", LEGACY_FINALIZER, "c/d"], ["a/b", "c/d"]),
    (["a/b"], None),
    (None, None),
])
def test_without_legacy(finalizers, expected):
    meta = {"finalizers": finalizers} if finalizers is not None else {}
    assert without_legacy(meta) == expected


async def test_strip_legacy_finalizers_per_namespace(tmp_path):
    import logging
    async with cluster(tmp_path) as k:
        await k.create_cr("a", {**cr("x", "u-x", [LEGACY_FINALIZER]), "metadata": {
            "name": "x", "namespace": "a", "uid": "u-x", "finalizers": [LEGACY_FINALIZER]}})
        await k.create_cr("b", {**cr("y", "u-y"), "metadata": {
            "name": "y", "namespace": "b", "uid": "u-y", "finalizers": [LEGACY_FINALIZER]}})
        await k.create_cr("a", {**cr("z", "u-z"), "metadata": {"name": "z", "namespace": "a", "uid": "u-z"}})
        async with kube.KubeClient(k.url) as client:
            assert await strip_legacy_finalizers(client, ["a"], logging.getLogger("t")) == ["a/x"]
            assert (await k.cr("b", "y"))["metadata"]["finalizers"] == [LEGACY_FINALIZER]  # not watched
            assert await strip_legacy_finalizers(client, [], logging.getLogger("t")) == ["b/y"]
            assert await strip_legacy_finalizers(client, [], logging.getLogger("t")) == []
        assert not (await k.cr("a", "x"))["metadata"].get("finalizers")
