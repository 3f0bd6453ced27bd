"""The LoRAAdapter controller's pure decisions (operator/lora_plan.py) and the status they become
(operator/lora_status.py): no API, no daemons, time as an argument."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator import lora_plan
from kvpilot.operator.lora_plan import FINALIZER, Adapter, Attempt, BaseView, PodView
from kvpilot.operator.lora_sources import PodLoRA
from kvpilot.operator.lora_status import changed, status_patch

NOW = 1_000_000.0
LORA = PodLoRA(True, ("/adapters/pvc/adapters",))


def adapter(name: str = "sql", uri: str = "hf://org/sql", replicas: Any = "all", created: str = "2024-01-01T00:00:00Z",
            finalizers: tuple[str, ...] = (FINALIZER,), deleted: str | None = None, **spec: Any) -> Adapter:
    meta = {"name": name, "namespace": "ml", "generation": 3, "creationTimestamp": created,
            "finalizers": list(finalizers), **({"deletionTimestamp": deleted} if deleted else {})}
    return Adapter.from_body({"metadata": meta, "spec": {"baseModel": "llm", "uri": uri, "replicas": replicas, **spec}})


def pod(name: str, *held: str, lora: PodLoRA = LORA, answers: bool = True) -> PodView:
    return PodView(name=name, url=f"http://{name}:8000", lora=lora,
                   held=frozenset(held) if answers else None, error="" if answers else "ClientConnectorError")


def base(*pods: PodView, **kw: Any) -> BaseView:
    return BaseView(exists=True, enable_lora=True, served_name="llm", template_roots=LORA.roots, pods=pods, **kw)


def decide(a: Adapter, b: BaseView, attempts: dict | None = None, busy: frozenset = frozenset(),
           now: float = NOW, owner: tuple[str, str] | None = None) -> lora_plan.Plan:
    return lora_plan.decide(a, b, owner or a.key, attempts or {}, busy, now)


def test_all_loads_where_missing_and_reports_the_holders():
    plan = decide(adapter(), base(pod("p0", "sql"), pod("p1"), pod("p2", "other")))
    assert plan.load == ("p1", "p2") and plan.unload == ()
    assert (plan.loaded, plan.desired, plan.reason) == (("p0",), 3, "Loading")
    plan = decide(adapter(), base(pod("p0", "sql"), pod("p1", "sql")))
    assert plan.load == () and plan.ready and plan.message == "loaded on 2/2 pods"


def test_the_finalizer_goes_on_first():
    plan = decide(adapter(finalizers=()), base(pod("p0")))
    assert plan.add_finalizer and plan.load == ("p0",)  # act loads only once the finalizer is written


def test_n_replicas_prefers_holders_then_pods_that_did_not_fail_then_names():
    pods = (pod("p0"), pod("p1", "sql"), pod("p2"), pod("p3", "sql"), pod("p4", "sql"))
    plan = decide(adapter(replicas=2), base(*pods))
    assert plan.targets == ("p1", "p3") and plan.unload == ("p4",) and plan.load == ()
    plan = decide(adapter(replicas=2), base(pod("p0"), pod("p1"), pod("p2")),
                  attempts={("p0", "load"): Attempt(1, NOW - 1, "boom")})
    assert plan.targets == ("p1", "p2")  # a pod whose load failed comes last
    plan = decide(adapter(replicas=5), base(pod("p0", "sql"), pod("p1", "sql")))
    assert plan.ready and plan.message == "loaded on 2/2 pods (spec.replicas 5, 2 pods can take it)"
    plan = decide(adapter(replicas=0), base(pod("p0", "sql")))
    assert plan.unload == ("p0",) and (plan.reason, plan.desired) == ("ZeroReplicas", 0)


def test_a_failed_load_waits_for_its_backoff_and_is_reported():
    attempts = {("p0", "load"): Attempt(2, NOW + 1.5, "rank 64 is above --max-lora-rank 16", "DaemonRefused")}
    plan = decide(adapter(), base(pod("p0"), pod("p1")), attempts=attempts)
    assert plan.load == ("p1",) and set(plan.failures) == {"p0"}
    assert decide(adapter(), base(pod("p0")), attempts=attempts, now=NOW + 2).load == ("p0",)
    assert [lora_plan.backoff(n) for n in (1, 2, 3, 9, 20)] == [1.0, 2.0, 4.0, 256.0, 300.0]
    again = lora_plan.failed(attempts[("p0", "load")], NOW, "again", "DaemonUnreachable")
    assert (again.failures, again.retry_at, again.reason) == (3, NOW + 4.0, "DaemonUnreachable")


def test_calls_in_flight_are_not_repeated():
    plan = decide(adapter(replicas=1), base(pod("p0"), pod("p1", "sql")),
                  busy=frozenset({("p1", "unload")}))
    assert plan.unload == ()


@pytest.mark.parametrize("view, reason", [
    (BaseView(exists=False), "BaseNotFound"),
    (BaseView(exists=True, enable_lora=False), "LoRANotEnabled"),
    (BaseView(exists=True, enable_lora=True, api_key=True), "ApiKeyRequired"),
    (base(), "NoReadyPods"),
    (base(pod("p0", answers=False)), "PodsUnreachable"),
    (base(other_pods=2), "WaitingForRollout"),
    (base(pod("p0", lora=PodLoRA(True, ()))), "WaitingForRollout"),  # a pod from before the claim was mounted
])
def test_why_nothing_loads(view, reason):
    plan = decide(adapter(uri="pvc://adapters/sql"), view)
    assert plan.reason == reason and plan.load == () and not plan.ready and plan.message


def test_a_template_without_the_folder_says_the_rollout_is_coming():
    view = BaseView(exists=True, enable_lora=True, template_roots=(), pods=(pod("p0", lora=PodLoRA(True, ())),))
    plan = decide(adapter(uri="file:///opt/sql"), view)
    assert plan.reason == "WaitingForRollout" and "pod template" in plan.message


def test_an_invalid_spec_and_name_conflicts():
    bad = adapter(uri="s3://bucket/x")
    assert decide(bad, base(pod("p0"))).reason == "InvalidSpec"
    assert decide(adapter(adapterName="llm"), base(pod("p0"))).reason == "NameConflict"  # the base's own name
    old, young = adapter("a", adapterName="sql"), adapter("b", adapterName="sql", created="2024-02-01T00:00:00Z")
    owners = lora_plan.owners([young, old])
    assert owners == {"sql": ("ml", "a")}
    plan = lora_plan.decide(young, base(pod("p0")), owners["sql"], {}, frozenset(), NOW)
    assert plan.reason == "NameConflict" and plan.load == () and "LoRAAdapter a already serves" in plan.message


def test_deletion_unloads_then_lets_go():
    deleting = adapter(deleted="2024-03-01T00:00:00Z")
    t = deleting.deleted_at
    assert t is not None
    plan = decide(deleting, base(pod("p0", "sql"), pod("p1")), now=t)
    assert plan.unload == ("p0",) and not plan.remove_finalizer and plan.load == ()
    assert decide(deleting, base(pod("p0"), pod("p1")), now=t).remove_finalizer
    # A call still running (a load that could land after the last unload) holds the finalizer.
    assert not decide(deleting, base(pod("p0")), busy=frozenset({("p0", "load")}), now=t).remove_finalizer
    # A ready pod that does not answer may still hold it: wait, but not for ever.
    silent = base(pod("p0", answers=False))
    assert not decide(deleting, silent, now=t + 1).remove_finalizer
    assert decide(deleting, silent, now=t + lora_plan.DELETE_GRACE).remove_finalizer
    # No base (or no LoRA on it): nothing to unload.
    assert decide(deleting, BaseView(exists=False), now=t).remove_finalizer
    # Someone else's name: never unloaded by this one.
    plan = lora_plan.decide(deleting, base(pod("p0", "sql")), ("ml", "other"), {}, frozenset(), t)
    assert plan.unload == () and plan.remove_finalizer


def test_deletion_timestamps_with_fractions_parse():
    assert lora_plan.parse_time("2024-03-01T00:00:00Z") == lora_plan.parse_time("2024-03-01T00:00:00.000+00:00")
    assert adapter(deleted="not a time").deleting


def test_wanted_sources_skip_invalid_adapters_and_keep_those_being_deleted():
    """A deleted adapter's folder stays until the object is gone: unloaded first, the pods roll after."""
    adapters = [adapter("a", uri="pvc://one/x"), adapter("b", uri="pvc://two/y", deleted="2024-03-01T00:00:00Z"),
                adapter("c", uri="s3://three/z"), adapter("d", uri="file:///opt/d")]
    assert lora_plan.wanted_sources(adapters).roots == ("/adapters/pvc/one", "/adapters/pvc/two", "/opt/d")


def test_the_status():
    a = adapter()
    failing = {("p1", "load"): Attempt(1, NOW + 1, "rank 64 is above --max-lora-rank 16", "DaemonRefused")}
    plan = decide(a, base(pod("p0", "sql"), pod("p1")), attempts=failing)
    st = status_patch(a, plan, "2024-05-01T00:00:00Z")
    assert {k: st[k] for k in ("adapterName", "desiredReplicas", "readyReplicas", "loadedPods", "observedGeneration")} \
        == {"adapterName": "sql", "desiredReplicas": 2, "readyReplicas": 1, "loadedPods": ["p0"], "observedGeneration": 3}
    ready, failed = st["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "Loading")
    assert (failed["type"], failed["status"], failed["reason"]) == ("LoadFailed", "True", "DaemonRefused")
    assert failed["message"] == "p1: rank 64 is above --max-lora-rank 16"
    # The same plan later: nothing to write (the transition times stay).
    again = Adapter.from_body({"metadata": {"name": "sql", "namespace": "ml", "generation": 3},
                               "spec": a.spec, "status": st})
    assert not changed(again, status_patch(again, plan, "2024-05-01T00:09:00Z"))
    loaded = decide(a, base(pod("p0", "sql"), pod("p1", "sql")))
    later = status_patch(again, loaded, "2024-05-01T00:10:00Z")
    assert changed(again, later) and [c["status"] for c in later["conditions"]] == ["True", "False"]
