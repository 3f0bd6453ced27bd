"""The operator puts no finalizer on InferenceDeployments: deleting one never waits for the operator, and the
children go by owner-reference garbage collection. Older versions ran a kopf daemon per object, which made
kopf add its finalizer; startup takes that one off every object again."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvpilot.operator import kube

LEGACY_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"


def without_legacy(metadata: dict[str, Any]) -> list[str] | None:
    """The finalizers to keep, or None when the legacy one is not there (nothing to write)."""
    finalizers = list(metadata.get("finalizers") or [])
    if LEGACY_FINALIZER not in finalizers:
        return None
    return [f for f in finalizers if f != LEGACY_FINALIZER]


async def _strip_one(client: kube.KubeClient, path: str) -> bool:
    async def attempt() -> bool:
        obj = await client.get(path)  # afresh on every attempt: its resourceVersion is the precondition
        keep = without_legacy((obj or {}).get("metadata") or {})
        if obj is None or keep is None:
            return False
        rv = obj["metadata"].get("resourceVersion")
        meta: dict[str, Any] = {"finalizers": keep or None}  # null removes the list in a merge patch
        if rv:
            meta["resourceVersion"] = rv
        await client.patch(path, {"metadata": meta})
        return True

    return await kube.retry_on_conflict(attempt)


async def strip_legacy_finalizers(client: kube.KubeClient, namespaces: Iterable[str],
                                  logger: logging.Logger) -> list[str]:
    """Remove kopf's old finalizer from the InferenceDeployments in these namespaces (all when empty).
    Returns "namespace/name" of those it was removed from."""
    collections = [kube.inferencedeployments(ns) for ns in namespaces] or [kube.inferencedeployments()]
    stripped = []
    for coll in collections:
        for obj in await client.list(coll):
            m = obj.get("metadata") or {}
            if without_legacy(m) is None:
                continue
            if await _strip_one(client, kube.inferencedeployment(m["namespace"], m["name"])):
                stripped.append(f"{m['namespace']}/{m['name']}")
    if stripped:
        logger.info("removed the old kopf finalizer from %d InferenceDeployment(s): %s", len(stripped),
                    ", ".join(stripped))
    return stripped
