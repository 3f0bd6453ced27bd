"""The LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) that runs the replicas when each spans several nodes.

One group per replica: `size` pods (parallelism.nodes), the leader (worker index 0) running the engine core,
the API server and rank 0, the workers only their ranks. Leader and workers run the same daemon args; the
daemon reads its node count, rank and the leader's address from the LWS_* variables the controller injects.
Pure, like resources.py.
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator import parallelism, resources
from kvpilot.operator.lora_sources import NO_SOURCES, Sources

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"
# A rank that dies takes the whole group's collectives with it: every pod of the group starts again together.
RESTART_POLICY = "RecreateGroupOnPodRestart"
# Workers start with the leader, not after it is Ready: the leader is Ready only once every rank joined.
STARTUP_POLICY = "LeaderCreated"


def render_leader_worker_set(meta: dict[str, Any], spec: dict[str, Any], replicas: int,
                             lora: Sources = NO_SOURCES) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": resources.child_metadata(meta),
        "spec": {
            "replicas": replicas,
            "startupPolicy": STARTUP_POLICY,
            # As the Deployment's: one new group at a time, none taken away before its successor is Ready.
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}},
            "leaderWorkerTemplate": {
                "size": parallelism.nodes(spec),
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": resources.pod_template(meta, spec, lora, role="leader"),
                "workerTemplate": resources.pod_template(meta, spec, lora, role="worker"),
            },
        },
    }
