"""spec.parallelism against spec.resources: how many ranks a replica runs, on how many nodes (pods), and how
many GPUs each pod asks for. Pure, and read from a defaulted spec that passed the CRD's rules.

A replica runs tensor * pipeline ranks, one device each. They fit one pod unless resources.gpusPerNode says a
node holds fewer; then the replica spans world / gpusPerNode pods (the CRD's rule makes that whole), which
the operator runs as one LeaderWorkerSet group (lws.py) instead of one Deployment pod.
"""

from __future__ import annotations

from typing import Any


def tensor(spec: dict[str, Any]) -> int:
    return int((spec.get("parallelism") or {}).get("tensor", 1))


def pipeline(spec: dict[str, Any]) -> int:
    return int((spec.get("parallelism") or {}).get("pipeline", 1))


def world_size(spec: dict[str, Any]) -> int:
    """Ranks in one replica: tensor * pipeline."""
    return tensor(spec) * pipeline(spec)


def nodes(spec: dict[str, Any]) -> int:
    """Pods in one replica: 1 when the ranks fit one node (or no node size is given), else world / gpusPerNode."""
    per_node = (spec.get("resources") or {}).get("gpusPerNode")
    world = world_size(spec)
    if not per_node or world <= per_node:
        return 1
    return world // int(per_node)


def multi_node(spec: dict[str, Any]) -> bool:
    return nodes(spec) > 1


def gpus_per_pod(spec: dict[str, Any]) -> int:
    """The GPUs one daemon pod requests: none on CPU (resources.gpus 0), resources.gpus with one rank (as
    before parallelism existed), else one per rank the pod runs."""
    requested = int((spec.get("resources") or {}).get("gpus", 1))
    if requested == 0 or world_size(spec) == 1:
        return requested
    return world_size(spec) // nodes(spec)


def on_one_node(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with one rank a replica: what selects the pods of a Deployment that keeps serving while a
    LeaderWorkerSet cannot be applied."""
    return {**spec, "parallelism": {"tensor": 1, "pipeline": 1}}


def rule_errors(spec: dict[str, Any]) -> list[str]:
    """The CRD's CEL rules on spec.parallelism, for the operator's own check of a defaulted spec."""
    try:
        world = world_size(spec)
    except (TypeError, ValueError):
        return []  # the schema check reports it
    errors = []
    per_node = (spec.get("resources") or {}).get("gpusPerNode")
    if isinstance(per_node, int) and per_node > 0 and world > per_node and world % per_node:
        errors.append(GPUS_PER_NODE_MESSAGE)
    e = spec.get("engine") or {}
    if world > 1 and isinstance(e.get("speculative"), dict) and e["speculative"].get("method") != "ngram":
        errors.append(SPECULATIVE_MESSAGE)
    return errors


# The messages of the CRD's rules (crds/inferencedeployment.yaml), word for word.
GPUS_PER_NODE_MESSAGE = ("parallelism.tensor * parallelism.pipeline must be at most resources.gpusPerNode (one "
                         "node) or a multiple of it (whole nodes)")
SPECULATIVE_MESSAGE = ("engine.speculative.method must be ngram with parallelism.tensor or parallelism.pipeline "
                       "above 1: the daemon refuses a draft model there")
LWS_NAME_MESSAGE = ("metadata.name must start with a letter and have no dots when replicas span several nodes: "
                    "it names the LeaderWorkerSet")
