"""Whether kopf's peering pauses this operator: the autoscaling loop is ours, not kopf's, so it checks itself.

kopf keeps its peers in the status of a (Cluster)KopfPeering object: {identity: {priority, lifetime, lastseen}}.
An operator pauses while a live peer has a higher priority; this mirrors that rule.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from kvpilot.operator import kube

# The group of the peering CRDs the chart installs (kopf's legacy zalando.org ones are not looked at).
PEERING_API = "kopf.dev/v1"


def outranked(peers: Mapping[str, Any], priority: int, now: datetime.datetime) -> bool:
    """True when a peer that is still alive at `now` has a higher priority than ours."""
    for info in peers.values():
        if not isinstance(info, Mapping) or int(info.get("priority", 0)) <= priority:
            continue
        lastseen = info.get("lastseen")
        if lastseen is None:
            return True  # kopf counts an entry without a time as just seen
        seen = datetime.datetime.fromisoformat(str(lastseen).replace("Z", "+00:00"))
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=datetime.UTC)
        if seen + datetime.timedelta(seconds=int(info.get("lifetime", 60))) > now:
            return True
    return False


def peering_paths(name: str, namespaces: tuple[str, ...]) -> list[str]:
    if not namespaces:
        return [f"{kube.collection(PEERING_API, 'clusterkopfpeerings')}/{name}"]
    return [f"{kube.collection(PEERING_API, 'kopfpeerings', ns)}/{name}" for ns in namespaces]


async def paused(client: kube.KubeClient, name: str, priority: int, namespaces: tuple[str, ...]) -> bool:
    """Read the peering objects; a missing one (no such CRD, or not created yet) pauses nothing, and neither
    does one we may not read (403): kopf, with the same service account, cannot use it either."""
    now = datetime.datetime.now(datetime.UTC)
    for path in peering_paths(name, namespaces):
        try:
            obj = await client.get(path)
        except kube.KubeApiError as e:
            if e.status != 403:
                raise
            continue
        if obj is not None and outranked(obj.get("status") or {}, priority, now):
            return True
    return False
