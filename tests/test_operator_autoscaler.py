"""Table-driven tests of the autoscaling policy, with simulated time (no sleeps, no I/O)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from kvpilot.operator.autoscaler import Autoscaler, Decision, Observation, PodSample, Policy, RouterSample


def obs(*kv: float, waiting: float = 0.0, failed: int = 0, not_ready: int = 0) -> Observation:
    return Observation(samples=tuple(PodSample(k, waiting) for k in kv), failed=failed, not_ready=not_ready)


def simulate(policy: Policy, load: Callable[[float], float], until: float, interval: float = 10.0,
             start: int = 1, ready_after: float = 0.0,
             failing: Callable[[float], bool] = lambda _t: False) -> list[tuple[float, int, Decision]]:
    """A tiny cluster: `load(t)` is the KV demand in whole-pod units; each Ready pod holds an equal share,
    at most 1.0. New pods become Ready `ready_after` seconds after the scale-up that made them."""
    scaler = Autoscaler(policy)
    pods: list[float] = [-1e9] * start  # the time each pod becomes Ready
    trace = []
    t = 0.0
    while t <= until:
        ready = [p for p in pods if p <= t]
        share = min(1.0, load(t) / len(ready)) if ready else 0.0
        # Demand beyond the Ready pods' KV capacity queues up: 8 waiting requests per missing pod.
        waiting = max(0.0, load(t) - len(ready)) * 8 / len(ready) if ready else 0.0
        o = Observation(failed=len(ready), not_ready=len(pods) - len(ready)) if failing(t) else \
            Observation(samples=tuple(PodSample(share, waiting) for _ in ready), not_ready=len(pods) - len(ready))
        d = scaler.decide(t, len(pods), o)
        if d.desired > len(pods):
            pods += [t + ready_after] * (d.desired - len(pods))
        elif d.desired < len(pods):
            pods = sorted(pods)[: d.desired]
        trace.append((t, len(pods), d))
        t += interval
    return trace


def replicas(trace) -> list[int]:
    return [r for _, r, _ in trace]


POLICY = Policy(min_replicas=1, max_replicas=10, target_kv_cache_usage=0.7, target_waiting_requests=4,
                stable_window=60, panic_window=10, scale_down_delay=120)


def test_ramp_up_follows_load_without_overshoot():
    trace = simulate(POLICY, lambda t: 0.5 + 4.5 * min(t, 600) / 600, until=900)
    rs = replicas(trace)
    assert rs == sorted(rs), "a ramp-up never scales down"
    assert rs[-1] == math.ceil(5.0 / 0.7)  # 8
    for t, r, _ in trace:
        assert r <= math.ceil((0.5 + 4.5 * min(t, 600) / 600) / 0.7) + 1, f"overshoot at t={t}: {r}"


def test_burst_triggers_panic_and_panic_never_scales_down():
    burst = lambda t: 0.5 if t < 200 else (6.0 if t < 260 else 0.3)  # noqa: E731
    trace = simulate(POLICY, burst, until=600)
    by_t = {t: (r, d) for t, r, d in trace}
    assert by_t[190][0] == 1
    # The first tick of the burst panics and at least doubles at once.
    r, d = by_t[200]
    assert d.panic and d.reason == "Panic" and r >= 2
    assert by_t[230][0] >= 8  # queued requests and x2 steps catch 6.0/0.7 -> 9 within three ticks
    # While the panic lasts (stable window after the last trigger), replicas never go down.
    in_panic = [(t, r) for t, r, d in trace if d.panic]
    assert [r for _, r in in_panic] == sorted(r for _, r in in_panic)
    assert replicas(trace)[-1] == 1  # long after the burst, back to the minimum


def test_oscillating_load_does_not_flap():
    wave = lambda t: 1.0 if (t // 30) % 2 == 0 else 2.5  # noqa: E731
    trace = simulate(POLICY, wave, until=1800)
    rs = replicas(trace)
    downs = sum(1 for a, b in zip(rs, rs[1:], strict=False) if b < a)
    assert downs <= 1, rs  # at most giving back the start-up overshoot
    settled = {r for t, r, _ in trace if t >= 300}
    # Each 30 s crest outlasts the panic window, so the scale-down memory keeps the pods a crest needs:
    # sized for the crests (not their mean, which left too few when one came), steady through the waves.
    assert settled == {math.ceil(2.5 / 0.7)}, rs


@pytest.mark.parametrize("observation, current, reason", [
    (obs(failed=3), 3, "MetricsUnknown"),       # every scrape failed: unknown, not zero
    (obs(), 3, "NoReadyPods"),                  # nothing to scrape yet
    (obs(0.0, failed=2), 3, "MetricsPartial"),  # one pod idle, two unknown: no scale-down
])
def test_missing_data_never_scales_down(observation, current, reason):
    p = Policy(min_replicas=1, max_replicas=10, scale_down_delay=0, stable_window=10, panic_window=5)
    scaler = Autoscaler(p)
    for t in range(0, 600, 10):
        d = scaler.decide(float(t), current, observation)
        assert d.desired == current and d.reason == reason, (t, d)


def test_scrape_outage_blocks_later_scale_down_until_a_full_delay_of_data():
    failing = lambda t: 300 <= t < 400  # noqa: E731
    trace = simulate(POLICY, lambda t: 5.0 if t < 250 else 0.2, until=900, failing=failing)
    by_t = {t: r for t, r, _ in trace}
    assert all(by_t[t] == by_t[290] for t in range(300, 400, 10)), "changed replicas without data"
    first_down_after = min(t for t, r, _ in trace if t >= 400 and r < by_t[390])
    assert first_down_after >= 400 + POLICY.scale_down_delay


def test_extrapolates_failed_pods_for_scale_up():
    d = Autoscaler(POLICY).decide(0.0, 2, obs(1.0, failed=1))  # the answering pod is full: assume both are
    assert d.kv_total == pytest.approx(2.0) and d.desired == 3


@pytest.mark.parametrize("observation, current, expected", [
    (obs(0.95), 1, 2),                   # one full pod wants 2
    (obs(0.95, not_ready=1), 2, 2),      # ...and the second is loading: hold, do not add a third
    (obs(0.95, 0.95, not_ready=1), 3, 3),
    (obs(0.95, not_ready=3), 4, 4),
])
def test_loading_pods_count_as_capacity(observation, current, expected):
    p = Policy(min_replicas=1, max_replicas=10, target_kv_cache_usage=0.7, panic_threshold=10)
    assert Autoscaler(p).decide(0.0, current, observation).desired == expected


def test_slow_model_loads_do_not_overscale():
    # Pods take 5 minutes to load. Without counting them, every tick would add more.
    trace = simulate(POLICY, lambda t: 0.9 if t < 100 else 3.0, until=1200, ready_after=300)
    assert max(replicas(trace)) <= math.ceil(3.0 / 0.7) + 1


@pytest.mark.parametrize("observation, current, policy, expected, reason", [
    (obs(1.0, 1.0, 1.0, 1.0), 4, Policy(min_replicas=1, max_replicas=5), 5, "AtMaximum"),
    (obs(0.0), 1, Policy(min_replicas=2, max_replicas=5), 2, "AtMinimum"),
    (obs(0.5), 9, Policy(min_replicas=1, max_replicas=5), 5, "AtMaximum"),  # the user lowered max
    (obs(failed=1), 1, Policy(min_replicas=3, max_replicas=5), 3, "MetricsUnknown"),
])
def test_min_max_clamps(observation, current, policy, expected, reason):
    d = Autoscaler(policy).decide(0.0, current, observation)
    assert (d.desired, d.reason if d.metrics_known else reason) == (expected, reason)


@pytest.mark.parametrize("current, load, expected", [
    (1, 10.0, 2),   # x2
    (3, 30.0, 6),   # x2
    (2, 2.0, 3),    # below x2: as wanted (1.0 each over 0.7 -> 3)
])
def test_scale_up_is_capped_per_step(current, load, expected):
    p = Policy(min_replicas=1, max_replicas=100, target_kv_cache_usage=0.7, panic_threshold=10)
    share = load / current
    d = Autoscaler(p).decide(0.0, current, obs(*([share] * current)))
    assert d.desired == expected


@pytest.mark.parametrize("current, expected", [(8, 4), (5, 3), (2, 1)])
def test_scale_down_is_capped_per_step_and_waits_for_the_delay(current, expected):
    p = Policy(min_replicas=1, max_replicas=100, stable_window=10, panic_window=5, scale_down_delay=60)
    scaler = Autoscaler(p)
    for t in range(0, 60, 10):
        d = scaler.decide(float(t), current, obs(*([0.0] * current)))
        assert d.desired == current and d.reason == "ScaleDownDelayed"
    d = scaler.decide(60.0, current, obs(*([0.0] * current)))
    assert (d.desired, d.reason) == (expected, "ScaleDown")


def test_waiting_requests_signal_and_float_targets():
    p = Policy(min_replicas=1, max_replicas=100, target_kv_cache_usage=0.7, target_waiting_requests=4,
               panic_threshold=10)
    assert Autoscaler(p).decide(0.0, 2, obs(0.1, 0.1, waiting=6)).desired == 3  # 12 waiting / 4 = 3
    assert Autoscaler(p).decide(0.0, 2, obs(0.7, 0.7)).desired == 2  # 1.4 / 0.7 is exactly 2, not 3


def test_policy_from_defaulted_spec():
    from kvpilot.operator import crd
    a = crd.default_spec({"model": {"uri": "hf://o/m"}, "autoscaling": {"maxReplicas": 9}})["autoscaling"]
    p = Policy.from_spec(a)
    assert (p.min_replicas, p.max_replicas, p.target_kv_cache_usage, p.scale_down_delay) == (1, 9, 0.7, 300.0)


# --- scale to zero (min_replicas 0, routers in front) -------------------------------------------------------

ZERO = Policy(min_replicas=0, max_replicas=4, stable_window=60, panic_window=10, scale_down_delay=120,
              scale_to_zero_after=300)
IDLE_ROUTERS = (RouterSample(held=0.0), RouterSample(held=0.0))


def routed(*kv: float, waiting: float = 0.0, running: float = 0.0, held: float = 0.0, inflight: float = 0.0,
           routers_failed: int = 0) -> Observation:
    samples = tuple(PodSample(k, waiting, running) for k in kv)
    routers = (RouterSample(held=held, inflight=inflight), RouterSample(held=0.0))
    return Observation(samples=samples, routers=routers, routers_failed=routers_failed)


def test_idle_on_daemons_and_routers_for_the_whole_period_scales_to_zero():
    scaler = Autoscaler(ZERO)
    for t in range(0, 300, 10):
        d = scaler.decide(float(t), 1, routed(0.0))
        assert d.desired == 1, (t, d)  # load alone never sizes below one
    d = scaler.decide(300.0, 1, routed(0.0))
    assert (d.desired, d.reason) == (0, "ScaleToZero") and d.idle_for == 300.0


@pytest.mark.parametrize("busy", [
    routed(0.1, running=1),             # a daemon is decoding
    routed(0.0, waiting=1),             # a daemon queues one
    routed(0.0, inflight=1),            # a router has one in flight
    routed(0.0, held=1),                # a router holds one
    routed(0.0, routers_failed=1),      # a router did not answer: it may hold requests
    Observation(samples=(PodSample(0.0, 0.0),), failed=1, routers=IDLE_ROUTERS),  # a daemon did not answer
    Observation(samples=(PodSample(0.0, 0.0),), not_ready=1, routers=IDLE_ROUTERS),  # one is loading
    Observation(samples=(PodSample(0.0, 0.0),)),  # no router answered: nothing could wake it again
])
def test_any_activity_or_unknown_restarts_the_idle_period(busy):
    scaler = Autoscaler(ZERO)
    for t in range(0, 290, 10):
        scaler.decide(float(t), 1, routed(0.0))
    assert scaler.decide(290.0, 1, busy).desired >= 1
    for t in range(300, 600, 10):  # a fresh full period from the first idle tick after it
        assert scaler.decide(float(t), 1, routed(0.0)).desired == 1, t
    assert scaler.decide(600.0, 1, routed(0.0)).desired == 0


def test_held_requests_wake_from_zero_at_once():
    scaler = Autoscaler(ZERO)
    d = scaler.decide(0.0, 0, Observation(routers=IDLE_ROUTERS))
    assert (d.desired, d.reason) == (0, "ScaledToZero") and not d.scaled
    d = scaler.decide(1.0, 0, Observation(routers=(RouterSample(held=3.0), RouterSample(held=0.0))))
    assert (d.desired, d.reason, d.held) == (1, "Activate", 3.0)  # no delay, no window to fill


def test_at_zero_an_unanswering_router_keeps_it_at_zero_and_says_so():
    d = Autoscaler(ZERO).decide(0.0, 0, Observation(routers=(RouterSample(held=0.0),), routers_failed=1))
    assert (d.desired, d.reason, d.metrics_known) == (0, "RouterMetricsUnknown", False)


def test_a_woken_replica_is_kept_for_a_full_idle_period_again():
    scaler = Autoscaler(ZERO)
    scaler.decide(0.0, 0, Observation(routers=(RouterSample(held=1.0),)))
    # Loading: the daemon is not Ready yet, the router still holds the request.
    assert scaler.decide(10.0, 1, Observation(not_ready=1, routers=(RouterSample(held=1.0),))).desired == 1
    for t in range(20, 320, 10):
        assert scaler.decide(float(t), 1, routed(0.0)).desired == 1, t
    assert scaler.decide(320.0, 1, routed(0.0)).desired == 0


def test_scale_to_zero_only_with_min_replicas_zero_and_zero_delay_works():
    p = Policy(min_replicas=1, max_replicas=4, scale_to_zero_after=0, scale_down_delay=0)
    assert Autoscaler(p).decide(0.0, 1, routed(0.0)).desired == 1
    quick = Policy(min_replicas=0, max_replicas=4, scale_to_zero_after=0)
    assert Autoscaler(quick).decide(0.0, 1, routed(0.0)).desired == 0


def test_with_min_replicas_above_zero_routers_at_zero_bring_back_the_minimum():
    p = Policy(min_replicas=2, max_replicas=4)
    d = Autoscaler(p).decide(0.0, 0, Observation(routers=IDLE_ROUTERS))
    assert (d.desired, d.reason) == (2, "AtMinimum")


def test_scale_to_zero_policy_from_spec():
    from kvpilot.operator import crd
    a = crd.default_spec({"model": {"uri": "hf://o/m"}, "autoscaling": {"minReplicas": 0},
                          "router": {"enabled": True}})["autoscaling"]
    p = Policy.from_spec(a)
    assert (p.min_replicas, p.scale_to_zero_after) == (0, 300.0)


def occupancy_obs(running: list[float], waiting: float = 0.0) -> Observation:
    return Observation(samples=tuple(PodSample(0.05, waiting, r) for r in running))


def test_batch_occupancy_signal_counts_running_and_waiting_against_max_num_seqs():
    p = Policy(min_replicas=1, max_replicas=100, target_batch_occupancy=0.5, max_num_seqs=256, panic_threshold=10)
    # 4 pods run 200 each, 56 queued per pod: (800 + 224) / (0.5 * 256) = 8 pods; KV (0.2 / 0.7) asks for 1
    assert Autoscaler(p).decide(0.0, 4, occupancy_obs([200] * 4, waiting=56)).desired == 8
    # a deep queue asks for the pods that absorb it by their batch, not one pod per targetWaitingRequests
    assert Autoscaler(p).decide(0.0, 4, occupancy_obs([256] * 4, waiting=1000)).desired == 8  # capped at 2x
    deep = Autoscaler(p).decide(0.0, 4, occupancy_obs([256] * 4, waiting=1000))
    assert deep.stable_desire == 40  # (1024 + 4000) / 128 = 39.25, where 4000 / 4 would ask for 1000
    unknown = Policy(min_replicas=1, max_replicas=2000, panic_threshold=10, max_scale_up_rate=1000)
    assert Autoscaler(unknown).decide(0.0, 4, occupancy_obs([256] * 4, waiting=1000)).desired == 1000


def test_scale_downs_are_a_stable_window_apart():
    p = Policy(min_replicas=1, max_replicas=100, stable_window=30, panic_window=5, scale_down_delay=60,
               max_num_seqs=256)
    idle = lambda n: Observation(samples=(PodSample(0.0, 0.0, 0.0),) * n)  # noqa: E731 (wants 1 at any size)
    scaler = Autoscaler(p)
    for t in range(0, 70, 10):
        d = scaler.decide(float(t), 16, idle(16))
    assert (d.desired, d.reason) == (8, "ScaleDown")
    for t in (70, 80):  # the load read at 8 pods is not a stable window (30 s) old yet
        d = scaler.decide(float(t), 8, idle(8))
        assert (d.desired, d.reason) == (8, "ScaleDownDelayed"), t
    assert scaler.decide(90.0, 8, idle(8)).desired == 4


def test_a_scale_down_waits_while_its_highest_desire_was_read_at_the_larger_size():
    """16 pods' KV (0.05 each) wanted 2 pods; read at 8 pods the same load wants 1. The 2 was read before
    the scale-down, at the larger size, so the next step waits until a reading at 8 pods reaches it or it
    leaves the scale-down delay (60 s after it was read)."""
    p = Policy(min_replicas=1, max_replicas=100, stable_window=30, panic_window=5, scale_down_delay=60,
               max_num_seqs=256)
    scaler = Autoscaler(p)
    for t in range(0, 70, 10):
        d = scaler.decide(float(t), 16, occupancy_obs([0.0] * 16))
    assert (d.desired, d.reason, d.stable_desire) == (8, "ScaleDown", 2)
    for t in range(70, 130, 10):  # a stable window passed at t=90, but the 2 read at t=60 is still remembered
        d = scaler.decide(float(t), 8, occupancy_obs([0.0] * 8))
        assert (d.desired, d.reason, d.stable_desire) == (8, "ScaleDownDelayed", 1), t
    assert scaler.decide(130.0, 8, occupancy_obs([0.0] * 8)).desired == 4


def test_batch_occupancy_from_spec_and_tick_passes_max_num_seqs():
    from kvpilot.operator import crd
    a = crd.default_spec({"model": {"uri": "hf://o/m"}})["autoscaling"]
    assert Policy.from_spec(a).max_num_seqs == 0  # unknown unless the caller knows the engine
    p = Policy.from_spec(a, max_num_seqs=64)
    assert (p.target_batch_occupancy, p.max_num_seqs) == (0.5, 64)


def test_a_set_waiting_target_adds_its_signal_beside_occupancy():
    p = Policy(min_replicas=1, max_replicas=100, max_num_seqs=256, panic_threshold=10, max_scale_up_rate=100)
    obs = occupancy_obs([100] * 4, waiting=20)  # occupancy (400 + 80) / 128 asks for 4
    assert Autoscaler(p).decide(0.0, 4, obs).desired == 4
    eager = Policy(min_replicas=1, max_replicas=100, max_num_seqs=256, panic_threshold=10, max_scale_up_rate=100,
                   target_waiting_requests=4)
    assert Autoscaler(eager).decide(0.0, 4, obs).desired == 20  # 80 waiting at 4 a pod
    from kvpilot.operator import crd
    a = crd.default_spec({"model": {"uri": "hf://o/m"}})["autoscaling"]
    assert "targetWaitingRequests" not in a and Policy.from_spec(a).target_waiting_requests is None
    assert Policy.from_spec({**a, "targetWaitingRequests": 2}).target_waiting_requests == 2.0


def test_a_scale_down_goes_halfway_geometrically_and_measures_again():
    """A desire read on an over-provisioned fleet is low (bigger batches step slower): each scale-down goes to
    the geometric mean of the count and the desire, at least one pod, a stable window apart."""
    p = Policy(min_replicas=1, max_replicas=100, stable_window=30, panic_window=5, scale_down_delay=60,
               max_num_seqs=256)
    scaler = Autoscaler(p)
    light = [48.0] * 10  # 480 running over 10 pods: (480) / (0.5 * 256) asks for 4
    for t in range(0, 70, 10):
        d = scaler.decide(float(t), 10, occupancy_obs(light))
    assert (d.desired, d.reason, d.stable_desire) == (7, "ScaleDown", 4)  # ceil(sqrt(10 * 4)), not 5 (rate floor)
    counts, current = [], 7
    for t in range(70, 400, 10):
        current = scaler.decide(float(t), current, occupancy_obs([480.0 / current] * current)).desired
        counts.append(current)
    assert sorted(set(counts), reverse=True) == [7, 6, 5, 4], counts  # sqrt(28) -> 6, sqrt(24) -> 5, then one pod
    # and a last pod always goes: 2 pods that want 1 step to 1, where the geometric mean (1.4) rounds up to 2
    two = Autoscaler(p)
    for t in range(0, 70, 10):
        d = two.decide(float(t), 2, occupancy_obs([0.0, 0.0]))
    assert (d.desired, d.reason) == (1, "ScaleDown")


def test_the_scale_down_memory_keeps_a_short_bursts_desire():
    """A burst shorter than the stable window never fills its average; the pods it needed are kept for the
    scale-down delay, so the next burst finds them."""
    p = Policy(min_replicas=1, max_replicas=100, stable_window=120, panic_window=20, scale_down_delay=300,
               max_num_seqs=256, panic_threshold=10)
    scaler = Autoscaler(p)
    d = None
    for t in range(0, 400, 10):
        burst = 200 <= t < 240  # 40 s at 8 pods' worth on 12 pods, otherwise 1 pod's worth
        running = (8 * 128 if burst else 128) / 12
        d = scaler.decide(float(t), 12, occupancy_obs([running] * 12))
        if t >= 240:
            assert d.desired >= 8, (t, d)  # without the memory: the stable desire (at most 4) let it drop
    assert d is not None and d.stable_desire is not None and d.stable_desire < 8
