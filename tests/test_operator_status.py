"""The one pure status_patch(): what the reconcile and the autoscaling loop write into status."""

from __future__ import annotations

import pytest

from kvpilot.operator import crd
from kvpilot.operator.autoscaler import Autoscaler, Observation, PodSample, Policy
from kvpilot.operator.status import get_condition, status_patch

META = {"name": "llm", "namespace": "ml", "uid": "u", "generation": 3}
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def spec(enabled: bool) -> dict:
    return crd.default_spec({"model": {"uri": "hf://o/m"}, "autoscaling": {"enabled": enabled}})


def deployment(replicas: int, ready: int) -> dict:
    return {"spec": {"replicas": replicas},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas}}


def test_reconciled_sets_observed_generation_and_the_addresses():
    st = status_patch(meta=META, spec=spec(False), old=None, deployment=deployment(2, 1), now=T0,
                      desired=2, reconciled=True)
    assert st["observedGeneration"] == 3
    assert (st["replicas"], st["readyReplicas"], st["desiredReplicas"]) == (2, 1, 2)
    assert st["selector"] == "app.kubernetes.io/name=kvpilot-daemon,kvpilot.io/inferencedeployment=llm"
    assert st["url"] == "http://llm.ml.svc:8000/v1"
    assert [c["type"] for c in st["conditions"]] == ["Ready", "Progressing", "ScalingActive"]
    assert get_condition(st, "ScalingActive")["reason"] == "AutoscalingDisabled"
    assert all(c["observedGeneration"] == 3 for c in st["conditions"])
    assert "lastScaleTime" not in st and "metrics" not in st


def test_a_tick_never_claims_the_generation():
    st = status_patch(meta=META, spec=spec(True), old=None, deployment=deployment(1, 1), now=T0)
    assert "observedGeneration" not in st
    assert st["desiredReplicas"] == 1  # the live count when nothing was decided


def test_invalid_spec_is_only_conditions():
    st = status_patch(meta=META, spec=spec(True), old=None, deployment=None, now=T0, errors=["bad uri"],
                      reconciled=True)
    assert set(st) == {"observedGeneration", "conditions"}
    assert get_condition(st, "Progressing")["reason"] == "InvalidSpec"
    assert get_condition(st, "Ready")["message"] == "bad uri"


def test_decision_fills_autoscaler_metrics_and_scale_time():
    d = Autoscaler(Policy(max_replicas=5)).decide(0.0, 1, Observation(samples=(PodSample(0.95, 2.0),)))
    st = status_patch(meta=META, spec=spec(True), old=None, deployment=deployment(2, 1), now=T1,
                      desired=d.desired, decision=d, scaled=True)
    assert st["desiredReplicas"] == d.desired == 2
    assert st["lastScaleTime"] == T1
    assert st["autoscaler"]["reason"] == d.reason and st["autoscaler"]["panic"] == d.panic
    assert st["metrics"]["kvCacheUsagePercent"] == 95 and st["metrics"]["waitingRequests"] == 2.0
    assert get_condition(st, "ScalingActive")["status"] == "True"


@pytest.mark.parametrize("old_reason, expected", [
    (None, "Waiting"),                  # nothing decided yet
    ("AutoscalingDisabled", "Waiting"),  # just enabled
    ("ScaleUp", "ScaleUp"),             # the loop's last decision stands through a reconcile
])
def test_reconcile_keeps_the_loops_scaling_condition(old_reason, expected):
    old = {}
    if old_reason:
        old = {"conditions": [{"type": "ScalingActive", "status": "True", "reason": old_reason, "message": "m",
                               "lastTransitionTime": T0}]}
    st = status_patch(meta=META, spec=spec(True), old=old, deployment=deployment(1, 0), now=T1, reconciled=True)
    assert get_condition(st, "ScalingActive")["reason"] == expected


def test_transition_time_moves_only_when_the_status_changes():
    ready = status_patch(meta=META, spec=spec(False), old=None, deployment=deployment(1, 1), now=T0)
    again = status_patch(meta=META, spec=spec(False), old=ready, deployment=deployment(1, 1), now=T1)
    assert get_condition(again, "Ready")["lastTransitionTime"] == T0
    lost = status_patch(meta=META, spec=spec(False), old=again, deployment=deployment(1, 0), now=T1)
    assert get_condition(lost, "Ready")["lastTransitionTime"] == T1


def routed_spec(router: dict) -> dict:
    return crd.default_spec({"model": {"uri": "hf://o/m"}, "router": router})


def test_builtin_router_status_and_condition():
    router = deployment(2, 1)
    st = status_patch(meta=META, spec=routed_spec({"enabled": True}), old=None, deployment=deployment(1, 1),
                      now=T0, desired=1, reconciled=True, router=router)
    assert st["router"] == {"mode": "builtin", "replicas": 2, "readyReplicas": 1}
    cond = get_condition(st, "RouterReady")
    assert (cond["status"], cond["reason"], cond["message"]) == ("True", "RouterAvailable", "1/2 router pods ready")
    assert [c["type"] for c in st["conditions"]][-1] == "RouterReady"
    down = status_patch(meta=META, spec=routed_spec({"enabled": True}), old=st, deployment=deployment(1, 1),
                        now=T1, router=deployment(2, 0))
    assert get_condition(down, "RouterReady")["reason"] == "RouterUnavailable"


def test_a_tick_reports_the_held_requests():
    from kvpilot.operator.autoscaler import RouterSample
    d = Autoscaler(Policy(min_replicas=0)).decide(0.0, 0, Observation(routers=(RouterSample(held=4.0),)))
    st = status_patch(meta=META, spec=routed_spec({"enabled": True}), old=None, deployment=deployment(0, 0),
                      now=T0, decision=d, router=deployment(2, 2))
    assert st["router"]["heldRequests"] == 4.0 and st["router"]["readyReplicas"] == 2


def test_without_the_router_deployment_a_tick_keeps_the_router_status():
    st = status_patch(meta=META, spec=routed_spec({"enabled": True}), old={"router": {"mode": "builtin"}},
                      deployment=deployment(1, 1), now=T0)
    assert "router" not in st and get_condition(st, "RouterReady") is None


def test_turning_the_router_off_removes_its_status_and_condition():
    old = status_patch(meta=META, spec=routed_spec({"enabled": True}), old=None, deployment=deployment(1, 1),
                       now=T0, reconciled=True, router=deployment(2, 2))
    st = status_patch(meta=META, spec=routed_spec({"enabled": False}), old=old, deployment=deployment(1, 1),
                      now=T1, reconciled=True)
    assert st["router"] is None  # null deletes it in the merge patch
    assert get_condition(st, "RouterReady") is None


POOL = {"enabled": True, "mode": "inferencePool", "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}


def test_inference_pool_status_and_a_missing_crd_condition():
    ok = status_patch(meta=META, spec=routed_spec(POOL), old=None, deployment=deployment(1, 1), now=T0,
                      reconciled=True)
    assert ok["router"] == {"mode": "inferencePool", "inferencePool": "llm", "replicas": 0, "readyReplicas": 0}
    assert get_condition(ok, "RouterReady")["reason"] == "InferencePoolApplied"
    missing = status_patch(meta=META, spec=routed_spec(POOL), old=ok, deployment=deployment(1, 1), now=T1,
                           reconciled=True, routing_error=("InferencePoolCRDMissing", "not installed"))
    cond = get_condition(missing, "RouterReady")
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", "InferencePoolCRDMissing", "not installed")
    tick = status_patch(meta=META, spec=routed_spec(POOL), old=missing, deployment=deployment(1, 1), now=T1)
    assert "router" not in tick and get_condition(tick, "RouterReady")["reason"] == "InferencePoolCRDMissing"


def test_switching_modes_drops_the_other_modes_fields():
    old = {"router": {"mode": "builtin", "replicas": 2, "readyReplicas": 2, "heldRequests": 0}}
    st = status_patch(meta=META, spec=routed_spec(POOL), old=old, deployment=deployment(1, 1), now=T0,
                      reconciled=True)
    assert st["router"]["heldRequests"] is None and st["router"]["inferencePool"] == "llm"


def test_scaled_to_zero_behind_the_router_says_what_wakes_it():
    st = status_patch(meta=META, spec=routed_spec({"enabled": True}), old=None, deployment=deployment(0, 0),
                      now=T0, router=deployment(2, 2))
    ready = get_condition(st, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ScaledToZero") and "router" in ready["message"]
