"""The LoRAAdapter controller's decisions, pure: what each base's pods hold -> which pods load or unload an
adapter, and whether its finalizer goes on or comes off. No I/O; time is an argument.

The truth is each daemon's /v1/models, read every round: a pod that restarted comes back empty and is
loaded again, a pod added by scale-out is loaded once Ready, and nothing is assumed about a pod the
operator did not see hold the adapter.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvpilot.operator import lora_crd, lora_sources
from kvpilot.operator.lora_sources import Location, PodLoRA, Sources

# Why a finalizer: unloading needs the operator to call every pod that holds the adapter, and it must know
# the adapter's name and the pods to do so. Without one the object could be gone before the operator saw the
# deletion, and the daemons would go on serving an adapter that no longer exists in the API.
FINALIZER = "kvpilot.io/unload-adapter"
BACKOFF_BASE = 1.0  # seconds before the second attempt on a pod; doubles per failure
BACKOFF_CAP = 300.0
# A ready pod whose /v1/models does not answer may still hold an adapter being deleted; the deletion waits
# this long for it to answer (or to go), then lets go rather than block the delete forever.
DELETE_GRACE = 60.0

Key = tuple[str, str]


def parse_time(text: str | None) -> float | None:
    """An RFC 3339 time as a POSIX timestamp (servers write 2024-05-01T10:00:00Z; fractions are allowed)."""
    if not text:
        return None
    try:
        t = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=datetime.UTC)).timestamp()


def _deleted_at(text: str | None) -> float | None:
    if not text:
        return None
    at = parse_time(text)
    return at if at is not None else 0.0  # being deleted all the same; long enough ago for DELETE_GRACE


@dataclass(frozen=True)
class Adapter:
    """A LoRAAdapter as last seen, defaulted."""

    namespace: str
    name: str
    spec: dict[str, Any]
    uid: str = ""
    generation: int | None = None
    created: str = ""
    deleted_at: float | None = None  # metadata.deletionTimestamp (0.0, the epoch, if it does not parse)
    finalizers: tuple[str, ...] = ()
    status: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Adapter:
        m = body.get("metadata") or {}
        return cls(namespace=m["namespace"], name=m["name"], spec=lora_crd.default_spec(body.get("spec")),
                   uid=m.get("uid", ""), generation=m.get("generation"), created=m.get("creationTimestamp") or "",
                   deleted_at=_deleted_at(m.get("deletionTimestamp")),
                   finalizers=tuple(m.get("finalizers") or ()), status=dict(body.get("status") or {}))

    @property
    def key(self) -> Key:
        return self.namespace, self.name

    @property
    def base_key(self) -> Key:
        return self.namespace, str(self.spec.get("baseModel", ""))

    @property
    def adapter_name(self) -> str:
        return lora_crd.adapter_name(self.name, self.spec)

    @property
    def errors(self) -> list[str]:
        return lora_crd.validate(self.name, self.spec)

    @property
    def location(self) -> Location:
        return lora_sources.locate(self.spec["uri"])

    @property
    def deleting(self) -> bool:
        return self.deleted_at is not None


def wanted_sources(adapters: Iterable[Adapter]) -> Sources:
    """The claims and roots a base's pods need: those of its valid adapters. One being deleted keeps its
    folder until it is gone, so the pods roll only after it has been unloaded from them."""
    return lora_sources.sources(a.spec["uri"] for a in adapters if not a.errors)


@dataclass(frozen=True)
class PodView:
    """A ready pod of the base, as this round saw it."""

    name: str
    url: str  # http://ip:port of its daemon
    lora: PodLoRA
    held: frozenset[str] | None = None  # the adapters /v1/models lists; None when it did not answer
    error: str = ""  # why /v1/models did not answer

    def holds(self, adapter_name: str) -> bool:
        return self.held is not None and adapter_name in self.held


@dataclass(frozen=True)
class BaseView:
    """The InferenceDeployment an adapter names, and its ready pods (those started with LoRA)."""

    exists: bool
    enable_lora: bool = False
    served_name: str = ""
    api_key: bool = False  # spec.apiKeySecret: the daemons want a key the operator does not read
    template_roots: tuple[str, ...] | None = None  # the Deployment's pod template; None: no Deployment yet
    pods: tuple[PodView, ...] = ()
    other_pods: int = 0  # ready pods started without runtime LoRA loading (a rollout under way)


@dataclass(frozen=True)
class Attempt:
    """The last failed call of one operation on one pod: the retry waits for retry_at."""

    failures: int
    retry_at: float
    message: str
    reason: str = "LoadFailed"


def backoff(failures: int) -> float:
    return min(BACKOFF_CAP, BACKOFF_BASE * 2 ** max(0, failures - 1))


def failed(previous: Attempt | None, now: float, message: str, reason: str) -> Attempt:
    n = (previous.failures if previous else 0) + 1
    return Attempt(failures=n, retry_at=now + backoff(n), message=message, reason=reason)


def owners(adapters: Iterable[Adapter]) -> dict[str, Key]:
    """adapter name -> the LoRAAdapter that owns it on this base: the oldest (then the first by name). The
    others with the same name get a NameConflict and never load or unload it."""
    out: dict[str, Key] = {}
    for a in sorted(adapters, key=lambda a: (a.created, a.name)):
        out.setdefault(a.adapter_name, a.key)
    return out


# Ready's reasons when nothing can be loaded; the message says what to do.
BLOCKED = ("InvalidSpec", "NameConflict", "BaseNotFound", "LoRANotEnabled", "ApiKeyRequired")


@dataclass(frozen=True)
class Plan:
    """What to do for one adapter this round, and what the status says."""

    load: tuple[str, ...] = ()
    unload: tuple[str, ...] = ()
    add_finalizer: bool = False
    remove_finalizer: bool = False
    reason: str = ""  # Ready's reason
    message: str = ""
    desired: int = 0
    loaded: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    failures: dict[str, Attempt] = field(default_factory=dict)  # target pod -> its failed load

    @property
    def ready(self) -> bool:
        return self.reason == "Loaded"


def blocked(adapter: Adapter, base: BaseView, owner: Key | None) -> tuple[str, str] | None:
    """(reason, message) when the adapter cannot be loaded anywhere, whatever the pods say."""
    if adapter.errors:
        return "InvalidSpec", "; ".join(adapter.errors)
    name = adapter.adapter_name
    if owner is not None and owner != adapter.key:
        return "NameConflict", f"LoRAAdapter {owner[1]} already serves {name!r} on {adapter.spec['baseModel']}"
    if not base.exists:
        return "BaseNotFound", f"InferenceDeployment {adapter.spec['baseModel']} does not exist in {adapter.namespace}"
    if not base.enable_lora:
        return "LoRANotEnabled", (f"InferenceDeployment {adapter.spec['baseModel']} does not enable LoRA: set "
                                  "spec.engine.enableLora true")
    if name == base.served_name:
        return "NameConflict", f"{name!r} is the base model's own name"
    if base.api_key:
        return "ApiKeyRequired", ("the base's daemons require an API key (spec.apiKeySecret), which the operator "
                                  "does not read: load the adapter with --lora-modules in engine.extraArgs")
    return None


def choose(eligible: list[PodView], name: str, count: int | None, attempts: Mapping[str, Attempt]) -> list[str]:
    """The pods that should hold the adapter: all eligible ones, or N of them, preferring pods that already
    hold it (no churn), then pods whose last load did not fail, then by name (the same answer every round)."""
    ranked = sorted(eligible, key=lambda p: (not p.holds(name), p.name in attempts, p.name))
    names = [p.name for p in ranked]
    return names if count is None else names[:count]


def waiting_reason(base: BaseView, location: Location) -> tuple[str, str]:
    """Why no pod can take the adapter now."""
    if base.template_roots is not None and not lora_sources.covered(location, base.template_roots):
        return "WaitingForRollout", "the base's pod template does not have the adapter's folder yet"
    answering = [p for p in base.pods if p.held is not None]
    if answering or base.other_pods:
        return "WaitingForRollout", "the base's pods are rolling out with the adapter's folder or the LoRA flags"
    if base.pods:
        return "PodsUnreachable", "; ".join(f"{p.name}: {p.error}" for p in base.pods)[:1000]
    return "NoReadyPods", "the base has no ready pod"


def decide(adapter: Adapter, base: BaseView, owner: Key | None, attempts: Mapping[tuple[str, str], Attempt],
           busy: frozenset[tuple[str, str]], now: float) -> Plan:
    """attempts and busy are keyed by (pod, "load" | "unload"): the failed ones, and those still running."""
    if adapter.deleting:
        return decide_deletion(adapter, base, owner, busy, now)
    add = FINALIZER not in adapter.finalizers
    why = blocked(adapter, base, owner)
    if why is not None:
        return Plan(add_finalizer=add, reason=why[0], message=why[1])
    name, location = adapter.adapter_name, adapter.location
    held = tuple(sorted(p.name for p in base.pods if p.holds(name)))
    eligible = [p for p in base.pods if p.held is not None and lora_sources.covered(location, p.lora.roots)]
    loads = {pod: a for (pod, op), a in attempts.items() if op == "load"}
    targets = choose(eligible, name, lora_crd.replicas(adapter.spec), loads)
    by_name = {p.name: p for p in base.pods}
    load = tuple(t for t in targets if not by_name[t].holds(name) and (t, "load") not in busy
                 and loads.get(t, Attempt(0, 0.0, "")).retry_at <= now)
    unloads = {pod: a for (pod, op), a in attempts.items() if op == "unload"}
    unload = tuple(p for p in held if p not in targets and (p, "unload") not in busy
                   and unloads.get(p, Attempt(0, 0.0, "")).retry_at <= now)
    failures = {t: loads[t] for t in targets if t in loads and not by_name[t].holds(name)}
    loaded = tuple(t for t in held if t in targets)
    plan = Plan(load=load, unload=unload, add_finalizer=add, desired=len(targets), loaded=held,
                targets=tuple(targets), failures=failures)
    if not targets:
        if lora_crd.replicas(adapter.spec) == 0:
            return _with(plan, "ZeroReplicas", "spec.replicas is 0: the adapter is unloaded everywhere")
        return _with(plan, *waiting_reason(base, location))
    count = lora_crd.replicas(adapter.spec)
    short = f" (spec.replicas {count}, {len(eligible)} pods can take it)" if count and count > len(targets) else ""
    if len(loaded) == len(targets):
        return _with(plan, "Loaded", f"loaded on {len(loaded)}/{len(targets)} pods{short}")
    return _with(plan, "Loading", f"loaded on {len(loaded)}/{len(targets)} pods{short}")


def _with(plan: Plan, reason: str, message: str) -> Plan:
    return replace(plan, reason=reason, message=message)


def decide_deletion(adapter: Adapter, base: BaseView, owner: Key | None, busy: frozenset[tuple[str, str]],
                    now: float) -> Plan:
    """Unload from every pod that lists the adapter; the finalizer comes off once none does."""
    if FINALIZER not in adapter.finalizers:
        return Plan(reason="Deleting")
    if owner is not None and owner != adapter.key:
        return Plan(remove_finalizer=True, reason="Deleting")  # the name is another LoRAAdapter's
    name = adapter.adapter_name
    held = tuple(sorted(p.name for p in base.pods if p.holds(name)))
    unload = tuple(p for p in held if (p, "unload") not in busy)
    silent = [p for p in base.pods if p.held is None]
    waited = now - (adapter.deleted_at or now)
    # A load still running could land after the last unload: wait for it too.
    done = not held and not busy and (not silent or waited >= DELETE_GRACE)
    return Plan(unload=unload, remove_finalizer=done, reason="Deleting", loaded=held)
