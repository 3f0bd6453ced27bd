"""The autoscaling policies the simulator compares: kvpilot's (imported, unchanged) and the published rules of
HPA/KEDA, AIBrix's KPA and llm-d's WVA saturation scaler, each written from its documented formula.

Every policy is `decide(now, current, view) -> desired replicas`, called every `interval` seconds with a
`View` of the Ready pods' scraped metrics. All are pure: no clock, no I/O; history lives in the object.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from kvpilot.operator import autoscaler as kvpilot_autoscaler

EPS = 1e-9


@dataclass(frozen=True)
class View:
    kv: tuple[float, ...]  # per Ready pod, 0..1
    waiting: tuple[float, ...]
    running: tuple[float, ...]
    not_ready: int = 0  # pods starting
    held: float = 0.0  # requests the routers hold (no Ready pod)
    inflight: float = 0.0  # requests the routers have in flight

    @property
    def ready(self) -> int:
        return len(self.kv)


class Policy(Protocol):
    name: str
    interval: float

    def decide(self, now: float, current: int, view: View) -> int: ...


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - EPS))


def _wake(current: int, view: View) -> int | None:
    """At zero every policy wakes to one replica on a held request (an activator in front)."""
    if current == 0:
        return 1 if view.held > 0 else 0
    return None


@dataclass
class Kvpilot:
    """operator/autoscaler.py's Autoscaler, fed the Observation operator/tick.py builds from a scrape."""

    policy: kvpilot_autoscaler.Policy
    interval: float = 10.0
    name: str = "kvpilot"
    scaler: kvpilot_autoscaler.Autoscaler | None = None

    def decide(self, now: float, current: int, view: View) -> int:
        if self.scaler is None:
            self.scaler = kvpilot_autoscaler.Autoscaler(self.policy)
        obs = kvpilot_autoscaler.Observation(
            samples=tuple(kvpilot_autoscaler.PodSample(k, w, r)
                          for k, w, r in zip(view.kv, view.waiting, view.running, strict=True)),
            not_ready=view.not_ready,
            routers=(kvpilot_autoscaler.RouterSample(held=view.held, inflight=view.inflight),))
        return self.scaler.decide(now, current, obs).desired


@dataclass
class Hpa:
    """Kubernetes HPA (KEDA drives one): desired = ceil(current * metric / target) with metric the mean over
    pods; no change within 10% of the target; scale-down to the highest recommendation of the last 300 s;
    scale-up by at most max(100%, 4 pods) per 15 s period (HPA's default behavior)."""

    target: float
    metric: str = "waiting"  # or "running"
    interval: float = 15.0
    tolerance: float = 0.1
    down_stabilization: float = 300.0
    min_replicas: int = 1
    max_replicas: int = 1000
    idle_to_zero: float = 300.0  # KEDA's cooldownPeriod, when min_replicas is 0
    name: str = "hpa"
    _recs: deque[tuple[float, int]] = field(default_factory=deque)
    _idle_since: float | None = None

    def recommend(self, current: int, view: View) -> int:
        values = view.waiting if self.metric == "waiting" else view.running
        # starting pods count as zero load (HPA's conservative rule for unready pods when scaling up)
        pods = view.ready + view.not_ready
        if pods == 0:
            return current
        ratio = sum(values) / pods / self.target
        if abs(ratio - 1.0) <= self.tolerance:
            return current
        return _ceil(current * ratio)

    def decide(self, now: float, current: int, view: View) -> int:
        woke = _wake(current, view)
        if woke is not None:
            return min(max(woke, self.min_replicas), self.max_replicas)
        busy = sum(view.waiting) + sum(view.running) + view.held + view.inflight > 0
        self._idle_since = None if busy else (now if self._idle_since is None else self._idle_since)
        if self.min_replicas == 0 and self._idle_since is not None and now - self._idle_since >= self.idle_to_zero:
            self._recs.clear()
            return 0
        rec = max(self.recommend(current, view), 1)
        self._recs.append((now, rec))
        while self._recs and self._recs[0][0] < now - self.down_stabilization:
            self._recs.popleft()
        if rec > current:
            desired = min(rec, max(2 * current, current + 4))
        else:
            desired = min(current, max(r for _, r in self._recs))
        return min(max(desired, self.min_replicas, 1), self.max_replicas)


@dataclass
class Kpa:
    """AIBrix KPA, as its scaler (pkg/controller/podautoscaler/scaler/kpa.go, Knative's algorithm) computes it:
    the metric summed over pods, averaged over a 180 s stable and a 60 s panic window; each desire is
    ceil(window mean / target), clamped to [floor(ready / 2), ceil(ready * 2)] with ready the Ready pods (at
    least 1); panic starts when the unclamped panic desire reaches 2x the Ready pods and ends a stable window
    after it last did; in panic the count is the highest desire of the panic (it never goes down); a
    scale-down goes only to the highest count of the scale-down delay window."""

    target: float  # per pod, in the metric's units
    metric: str = "concurrency"  # running + waiting, per pod summed
    interval: float = 15.0
    stable_window: float = 180.0
    panic_window: float = 60.0
    panic_threshold: float = 2.0
    max_up: float = 2.0
    max_down: float = 2.0
    delay_window: float = 300.0
    min_replicas: int = 1
    max_replicas: int = 1000
    name: str = "kpa"
    _samples: deque[tuple[float, float]] = field(default_factory=deque)
    _desires: deque[tuple[float, int]] = field(default_factory=deque)
    _panic_since: float | None = None
    _max_panic: int = 0  # the highest count asked for in this panic

    def total(self, view: View) -> float:
        if self.metric == "kv":
            return sum(view.kv)
        return sum(view.waiting) + sum(view.running)

    def _mean(self, now: float, window: float) -> float:
        rows = [v for t, v in self._samples if t > now - window]
        return sum(rows) / len(rows) if rows else 0.0

    def decide(self, now: float, current: int, view: View) -> int:
        woke = _wake(current, view)
        if woke is not None:
            return min(max(woke, self.min_replicas), self.max_replicas)
        self._samples.append((now, self.total(view)))
        while self._samples and self._samples[0][0] <= now - self.stable_window:
            self._samples.popleft()
        ready = max(view.ready, 1)
        # the rates are of the Ready pods: pods still starting do not let it double again
        hi, lo = math.ceil(ready * self.max_up), math.floor(ready / self.max_down)
        stable_raw = _ceil(self._mean(now, self.stable_window) / self.target)
        panic_raw = _ceil(self._mean(now, self.panic_window) / self.target)
        stable, panic_desire = min(max(stable_raw, lo), hi), min(max(panic_raw, lo), hi)
        if panic_raw / ready >= self.panic_threshold:
            self._panic_since = now
        elif self._panic_since is not None and now - self._panic_since > self.stable_window:
            self._panic_since, self._max_panic = None, 0
        desired = stable
        if self._panic_since is not None:
            self._max_panic = max(self._max_panic, stable, panic_desire)
            desired = self._max_panic
        self._desires.append((now, desired))
        while self._desires and self._desires[0][0] <= now - self.delay_window:
            self._desires.popleft()
        desired = max(d for _, d in self._desires)
        floor = self.min_replicas if self.min_replicas > 0 or self.total(view) > 0 or view.inflight else 0
        return min(max(desired, floor), self.max_replicas)


@dataclass
class Wva:
    """llm-d's workload variant autoscaler, saturation mode: a pod is saturated at KV >= 0.80 or queue >= 5;
    spare KV and spare queue are averaged over the pods that are not; +1 when none is unsaturated or spare KV
    < 0.1 or spare queue < 3; -1 only when the total load spread over N-1 pods keeps those margins."""

    interval: float = 60.0
    kv_sat: float = 0.80
    queue_sat: float = 5.0
    kv_margin: float = 0.1
    queue_margin: float = 3.0
    min_replicas: int = 1
    max_replicas: int = 1000
    name: str = "wva"

    def decide(self, now: float, current: int, view: View) -> int:  # noqa: ARG002 (stateless: a pure rule)
        woke = _wake(current, view)
        if woke is not None:
            return min(max(woke, self.min_replicas), self.max_replicas)
        if view.ready == 0:
            return current
        free = [(self.kv_sat - k, self.queue_sat - w) for k, w in zip(view.kv, view.waiting, strict=True)
                if k < self.kv_sat and w < self.queue_sat]
        if not free:
            return min(current + 1, self.max_replicas)
        spare_kv = sum(f[0] for f in free) / len(free)
        spare_q = sum(f[1] for f in free) / len(free)
        if spare_kv < self.kv_margin or spare_q < self.queue_margin:
            return min(current + 1, self.max_replicas)
        n = view.ready
        if n > 1 and current > self.min_replicas and view.not_ready == 0:
            kv_after = sum(view.kv) / (n - 1)
            q_after = sum(view.waiting) / (n - 1)
            if self.kv_sat - kv_after >= self.kv_margin and self.queue_sat - q_after >= self.queue_margin:
                return max(current - 1, self.min_replicas)
        return current
