"""decide(): the pure middle of a tick, and the loop's view of kopf's index."""

from __future__ import annotations

from kvpilot.operator.autoscaler import Observation, PodSample
from kvpilot.operator.loop import index_entry, snapshot
from kvpilot.operator.scrape import ScrapeResult
from kvpilot.operator.tick import Cr, Observed, decide


def cr(autoscaling: dict) -> Cr:
    return Cr.from_body({"metadata": {"name": "llm", "namespace": "ml", "uid": "u", "generation": 2},
                         "spec": {"model": {"uri": "hf://o/m"}, "autoscaling": autoscaling}})


def observed(c: Cr, replicas: int, *kv: float, failed: int = 0) -> Observed:
    obs = Observation(samples=tuple(PodSample(k, 0.0) for k in kv), failed=failed)
    return Observed(cr=c, deployment={"spec": {"replicas": replicas}}, scraped=ScrapeResult(obs, {}),
                    targets=len(kv) + failed)


def test_enabled_scales_and_keeps_its_history():
    c = cr({"enabled": True, "maxReplicas": 4, "targetKVCacheUsage": 0.5})
    plan, scaler = decide(observed(c, 1, 0.95), None, 0.0)
    assert (plan.current, plan.desired, plan.scale, plan.direction) == (1, 2, True, "up")
    assert scaler is not None
    plan2, scaler2 = decide(observed(c, 2, 0.1, 0.1), scaler, 10.0)
    assert scaler2 is scaler  # the same history goes on: the burst's panic still holds the replicas
    assert (plan2.desired, plan2.decision.reason, plan2.scale) == (2, "Panic", False)
    fresh, _ = decide(observed(c, 2, 0.1, 0.1), None, 10.0)
    assert (fresh.decision.panic, fresh.decision.reason) == (False, "ScaleDownDelayed")


def test_new_bounds_apply_to_the_kept_history():
    c = cr({"enabled": True, "maxReplicas": 4})
    _, scaler = decide(observed(c, 3, 0.5, 0.5, 0.5), None, 0.0)
    lowered = cr({"enabled": True, "maxReplicas": 2})
    plan, kept = decide(observed(lowered, 3, 0.5, 0.5, 0.5), scaler, 1.0)
    assert kept is scaler and (plan.desired, plan.decision.reason) == (2, "AtMaximum")


def test_disabled_never_scales_but_samples_the_load_and_drops_the_history():
    c = cr({"enabled": False})
    plan, scaler = decide(observed(c, 3, 0.9, 0.9, 0.9), None, 0.0)
    assert scaler is None and not plan.scale and plan.desired == 3 and plan.direction == "hold"
    assert plan.decision.metrics_known and round(plan.decision.mean_kv_cache_usage, 2) == 0.9


def test_the_index_keeps_copies_and_the_snapshot_defaults_specs():
    body = {"metadata": {"name": "a", "namespace": "ml", "uid": "u"}, "spec": {"model": {"uri": "hf://o/m"}},
            "status": {"big": "x"}}
    entry = index_entry(body)
    body["spec"]["model"]["uri"] = "hf://changed/later"
    assert entry["spec"]["model"]["uri"] == "hf://o/m" and "status" not in entry
    crs = snapshot({("ml", "a"): [entry]})
    assert list(crs) == [("ml", "a")]
    assert crs["ml", "a"].spec["autoscaling"]["metricsIntervalSeconds"] == crs["ml", "a"].interval == 10


def test_the_policy_gets_the_daemons_max_num_seqs():
    c = Cr.from_body({"metadata": {"name": "llm", "namespace": "ml", "uid": "u", "generation": 2},
                      "spec": {"model": {"uri": "hf://o/m"}, "engine": {"maxNumSeqs": 8},
                               "autoscaling": {"enabled": True, "maxReplicas": 10}}})
    # 2 pods, 8 running each and 8 waiting on each: (32) / (0.5 * 8) = 8 wanted, capped at 2x = 4
    obs = Observation(samples=(PodSample(0.1, 8.0, 8.0), PodSample(0.1, 8.0, 8.0)))
    o = Observed(cr=c, deployment={"spec": {"replicas": 2}}, scraped=ScrapeResult(obs, {}), targets=2)
    plan, scaler = decide(o, None, 0.0)
    assert scaler is not None and scaler.policy.max_num_seqs == 8
    assert plan.decision.stable_desire == 8 and plan.desired == 4
