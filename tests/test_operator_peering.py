"""The peering rule the autoscaling loop follows: pause while a live peer has a higher priority."""

from __future__ import annotations

import datetime

import pytest

from kvpilot.operator.peering import outranked, peering_paths

NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)


def peer(priority: int, seconds_ago: float, lifetime: int = 60) -> dict:
    seen = (NOW - datetime.timedelta(seconds=seconds_ago)).isoformat()
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen}


@pytest.mark.parametrize("peers, expected", [
    ({}, False),
    ({"me": peer(10, 1)}, False),                      # only us
    ({"me": peer(10, 1), "b": peer(20, 5)}, True),     # a live, higher peer
    ({"me": peer(10, 1), "b": peer(20, 120)}, False),  # it stopped renewing: dead
    ({"me": peer(10, 1), "b": peer(5, 1)}, False),     # lower: we are the active one
    ({"b": {"priority": 20, "lastseen": "2026-01-01T11:59:30Z"}}, True),  # kopf's default lifetime of 60 s
])
def test_outranked(peers, expected):
    assert outranked(peers, 10, NOW) is expected


def test_peering_paths():
    assert peering_paths("p", ()) == ["/apis/kopf.dev/v1/clusterkopfpeerings/p"]
    assert peering_paths("p", ("a", "b")) == ["/apis/kopf.dev/v1/namespaces/a/kopfpeerings/p",
                                              "/apis/kopf.dev/v1/namespaces/b/kopfpeerings/p"]


async def test_paused_reads_the_peering_object(tmp_path):
    from kvpilot.operator import kube
    from kvpilot.operator.peering import paused
    from operator_support.harness import cluster

    async with cluster(tmp_path) as k:
        k.emulator.resources["kopf.dev/v1/clusterkopfpeerings"] = dict(
            kind="ClusterKopfPeering", singular="clusterkopfpeering", namespaced=False,
            verbs=["get", "create", "patch"])
        async with kube.KubeClient(k.url) as client:
            assert await paused(client, "kvpilot", 10, ()) is False  # no peering object: nothing pauses
            now = datetime.datetime.now(datetime.UTC).isoformat()
            await k.call("POST", "/apis/kopf.dev/v1/clusterkopfpeerings", {
                "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvpilot"},
                "status": {"me": {"priority": 10, "lifetime": 60, "lastseen": now},
                           "other": {"priority": 50, "lifetime": 60, "lastseen": now}}})
            assert await paused(client, "kvpilot", 10, ()) is True
            assert await paused(client, "kvpilot", 99, ()) is False
