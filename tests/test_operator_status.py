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
