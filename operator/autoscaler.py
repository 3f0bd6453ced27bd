"""The autoscaling policy: metric samples over time -> desired replicas. Pure: no I/O, time is an argument.

Signals are totals over the Ready pods; per signal the desire is ceil(total / per-replica target), and the
desire is the max over signals: KV-cache usage, batch occupancy ((running + waiting) sequences against the
daemons' max_num_seqs, what fills first when prompts are short next to the KV cache), and waiting requests
when targetWaitingRequests is set (or max_num_seqs is unknown, where 4 a pod stands in for occupancy). A
stable window smooths normal decisions; a short panic window reacts to bursts.

Scale to zero (min_replicas 0, with routers in front): load never sizes below one replica; zero comes only
from idleness, when the daemons ran and queued nothing and the routers held and proxied nothing for
scale_to_zero_after seconds. At zero, a request held by a router wakes the deployment to one replica at once,
as Knative's activator and the KEDA HTTP add-on do.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

EPS = 1e-9  # 1.4 / 0.7 must be 2 replicas, not 3


@dataclass(frozen=True)
class Policy:
    min_replicas: int = 1
    max_replicas: int = 4
    target_kv_cache_usage: float = 0.7
    target_waiting_requests: float | None = None  # optional signal; 4 a pod where max_num_seqs is unknown
    target_batch_occupancy: float = 0.5  # (running + waiting) / max_num_seqs per pod; needs max_num_seqs
    max_num_seqs: int = 0  # the daemons' --max-num-seqs, from the engine spec (0: unknown, signal off)
    stable_window: float = 120.0
    panic_window: float = 20.0
    panic_threshold: float = 2.0
    scale_down_delay: float = 300.0
    max_scale_up_rate: float = 2.0
    max_scale_down_rate: float = 2.0
    scale_to_zero_after: float = 300.0

    @classmethod
    def from_spec(cls, a: dict[str, Any], max_num_seqs: int = 0) -> Policy:
        """From a defaulted spec.autoscaling, and the daemons' --max-num-seqs for batch occupancy."""
        return cls(
            target_batch_occupancy=float(a.get("targetBatchOccupancy", 0.5)), max_num_seqs=max_num_seqs,
            min_replicas=a["minReplicas"], max_replicas=a["maxReplicas"],
            target_kv_cache_usage=float(a["targetKVCacheUsage"]),
            target_waiting_requests=None if a.get("targetWaitingRequests") is None
            else float(a["targetWaitingRequests"]),
            stable_window=float(a["stableWindowSeconds"]), panic_window=float(a["panicWindowSeconds"]),
            panic_threshold=float(a["panicThreshold"]), scale_down_delay=float(a["scaleDownDelaySeconds"]),
            max_scale_up_rate=float(a["maxScaleUpRate"]), max_scale_down_rate=float(a["maxScaleDownRate"]),
            scale_to_zero_after=float(a.get("scaleToZeroAfterSeconds", 300)),
        )

    def clamp(self, n: int) -> int:
        return min(max(n, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class PodSample:
    kv_cache_usage: float  # fraction of the pod's KV blocks in use
    waiting: float
    running: float = 0.0


@dataclass(frozen=True)
class RouterSample:
    held: float  # requests held while no daemon is ready
    inflight: float = 0.0  # requests proxied to daemons right now


@dataclass(frozen=True)
class Observation:
    samples: tuple[PodSample, ...] = ()  # one per Ready pod whose scrape worked
    failed: int = 0  # Ready pods whose scrape failed: their load is unknown, not zero
    not_ready: int = 0  # pods still starting: capacity on its way
    routers: tuple[RouterSample, ...] = ()  # one per Ready router pod whose scrape worked
    routers_failed: int = 0  # Ready router pods whose scrape failed: they may hold requests

    @property
    def ready(self) -> int:
        return len(self.samples) + self.failed

    @property
    def held(self) -> float:
        return sum(r.held for r in self.routers)

    def idle(self, current: int) -> bool:
        """Nothing anywhere: no request running or queued on a daemon, none held or in flight on a router.
        Unknown is never idle: a failed scrape, daemons that are wanted but not (yet) answering, or no router
        answering at all (then nothing could see the next request and wake the model)."""
        if not self.routers or self.routers_failed or any(r.held > 0 or r.inflight > 0 for r in self.routers):
            return False
        if current == 0:
            return True
        if self.failed or self.not_ready or not self.samples:
            return False
        return all(s.waiting <= 0 and s.running <= 0 for s in self.samples)


@dataclass(frozen=True)
class Decision:
    current: int
    desired: int
    reason: str
    panic: bool = False
    metrics_known: bool = False
    kv_total: float = 0.0  # extrapolated over all Ready pods
    waiting_total: float = 0.0
    running_total: float = 0.0
    stable_desire: int | None = None
    panic_desire: int | None = None
    sampled: int = 0
    failed: int = 0
    not_ready: int = 0
    held: float = 0.0  # over the routers that answered
    idle_for: float | None = None  # seconds of uninterrupted idleness, None when not idle

    @property
    def scaled(self) -> bool:
        return self.desired != self.current

    @property
    def mean_kv_cache_usage(self) -> float:
        ready = self.sampled + self.failed
        return self.kv_total / ready if ready else 0.0

    def message(self) -> str:
        return (f"{self.reason}: replicas {self.current} -> {self.desired}; panic={self.panic} "
                f"kv_total={self.kv_total:.2f} waiting_total={self.waiting_total:.1f} "
                f"stable_desire={self.stable_desire} panic_desire={self.panic_desire} "
                f"sampled={self.sampled} failed={self.failed} not_ready={self.not_ready} held={self.held:.0f}")


_DEFAULT_WAITING_TARGET = 4.0  # queued requests a pod where the batch size is unknown


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - EPS))


def _step_down(current: int, highest: int) -> int:
    """Where one scale-down goes: the geometric mean of the current count and the highest desire, and at
    least one pod down. A desire read on an over-provisioned fleet is low: fewer replicas run bigger batches
    that step slower, so the concurrency per pod grows faster than 1/replicas and going straight to that
    desire undershot (34 pods serving a burst read as 11 where 15 were needed). Halfway, measured again
    after a stable window, converges from above instead."""
    return min(current - 1, _ceil(math.sqrt(current * highest)))


@dataclass
class Autoscaler:
    policy: Policy
    _loads: deque[tuple[float, float, float, float]] = field(default_factory=deque)  # (t, kv, waiting, running)
    _desires: deque[tuple[float, int]] = field(default_factory=deque)  # (t, wanted replicas) for scale-down
    _since: float | None = None  # first decision: the scale-down delay needs this much history
    _panic_until: float | None = None
    _idle_since: float | None = None
    _last_down: float | None = None  # when the last scale-down was decided

    def desire(self, kv_total: float, waiting_total: float, running_total: float = 0.0) -> int:
        p = self.policy
        wanted = _ceil(kv_total / p.target_kv_cache_usage)
        if p.max_num_seqs > 0:
            # a queue is demand a pod absorbs by its batch: 9000 queued at 4 a pod asked for 2250 pods where
            # 50 would do, and the overshoot flapped (bench/results/autoscale_results.md)
            wanted = max(wanted, _ceil((running_total + waiting_total) / (p.target_batch_occupancy * p.max_num_seqs)))
        waiting_target = p.target_waiting_requests or (_DEFAULT_WAITING_TARGET if p.max_num_seqs <= 0 else None)
        if waiting_target:
            wanted = max(wanted, _ceil(waiting_total / waiting_target))
        return wanted

    def _window_desire(self, now: float, window: float) -> int:
        rows = [load for t, *load in self._loads if t > now - window]
        return self.desire(*(sum(r[i] for r in rows) / len(rows) for i in range(3)))

    def _remember(self, now: float, wanted: int) -> None:
        if self._since is None:
            self._since = now
        self._desires.append((now, wanted))
        while self._desires and self._desires[0][0] < now - self.policy.scale_down_delay:
            self._desires.popleft()

    def _track_idle(self, now: float, current: int, obs: Observation) -> float | None:
        if not obs.idle(current):
            self._idle_since = None
            return None
        if self._idle_since is None:
            self._idle_since = now
        return now - self._idle_since

    def _from_zero(self, now: float, obs: Observation, base: dict[str, Any]) -> Decision:
        """At zero there are no daemon metrics: only the routers' held requests say there is demand."""
        p = self.policy
        if obs.held > 0:
            desired, reason = p.clamp(1), "Activate"  # at once: a request is waiting
        elif obs.routers_failed:
            desired, reason = p.clamp(0), "RouterMetricsUnknown"
        else:
            desired, reason = p.clamp(0), "ScaledToZero"
        if desired and reason != "Activate":
            reason = "AtMinimum"
        self._remember(now, desired)
        return Decision(desired=desired, reason=reason, metrics_known=not obs.routers_failed, **base)

    def decide(self, now: float, current: int, obs: Observation) -> Decision:
        decision = self._decide(now, current, obs)
        p = self.policy
        if (p.min_replicas == 0 and current > 0 and decision.idle_for is not None
                and decision.idle_for >= p.scale_to_zero_after):
            self._panic_until = None
            return replace(decision, desired=0, reason="ScaleToZero", panic=False)
        return decision

    def _decide(self, now: float, current: int, obs: Observation) -> Decision:
        p = self.policy
        base = {"current": current, "sampled": len(obs.samples), "failed": obs.failed, "not_ready": obs.not_ready,
                "held": obs.held, "idle_for": self._track_idle(now, current, obs)}
        if current == 0 and (obs.routers or obs.routers_failed or p.min_replicas == 0):
            return self._from_zero(now, obs, base)
        if not obs.samples:
            # Unknown load: hold (only the user's bounds may move replicas) and block later scale-downs.
            self._remember(now, current)
            reason = "MetricsUnknown" if obs.failed else "NoReadyPods"
            return Decision(desired=p.clamp(current), reason=reason, **base)

        n = len(obs.samples)
        scale = obs.ready / n  # extrapolate the answering pods' mean to the pods that did not answer
        kv_total = sum(s.kv_cache_usage for s in obs.samples) * scale
        waiting_total = sum(s.waiting for s in obs.samples) * scale
        running_total = sum(s.running for s in obs.samples) * scale
        self._loads.append((now, kv_total, waiting_total, running_total))
        while self._loads and self._loads[0][0] <= now - p.stable_window:
            self._loads.popleft()
        stable = self._window_desire(now, p.stable_window)
        panic_desire = self._window_desire(now, p.panic_window)
        base.update(metrics_known=True, kv_total=kv_total, waiting_total=waiting_total,
                    running_total=running_total, stable_desire=stable, panic_desire=panic_desire)

        if panic_desire >= p.panic_threshold * max(current, 1):
            self._panic_until = now + p.stable_window
        panic = self._panic_until is not None and now < self._panic_until
        if not panic:
            self._panic_until = None
        wanted = max(current, panic_desire) if panic else stable
        wanted = max(wanted, 1)  # load never sizes below one replica: zero comes from idleness alone
        if obs.failed:
            wanted = max(wanted, current)  # never scale down on missing data
        # The scale-down memory keeps the short window's desire too: a burst shorter than the stable window
        # never fills its average, so remembering the stable desire alone forgot the pods a burst needed
        # before the next one came (on/off load, 2 minutes on and 4 off: 12 pods left where 15 were needed).
        self._remember(now, max(wanted, panic_desire))

        up_cap = max(math.ceil(current * p.max_scale_up_rate), current + 1)
        down_floor = math.ceil(current / p.max_scale_down_rate)
        if wanted > current:
            desired = min(wanted, up_cap)
            reason = "Panic" if panic else "ScaleUp"
        elif wanted < current:
            # Scale down to the highest desire seen over the whole delay, and only with that much history.
            highest = max(d for _, d in self._desires)
            since = now if self._since is None else self._since
            # After a scale-down, wait a stable window before the next: concurrency read on an over-provisioned
            # fleet is low (short batches step faster), so only the load measured at the new size is trusted.
            # For the same reason, while the highest desire remembered was read before that scale-down (at
            # the larger size, so it is too low), wait until a reading at this size reaches it or it ages out:
            # stepping on toward it reached 13 pods between bursts that needed 15 (on/off load).
            settling = self._last_down is not None and (
                now - self._last_down < p.stable_window
                or not any(d == highest and t > self._last_down for t, d in self._desires))
            if now - since < p.scale_down_delay or highest >= current or settling:
                desired, reason = current, "ScaleDownDelayed"
            else:
                desired, reason = max(_step_down(current, highest), down_floor), "ScaleDown"
                self._last_down = now
        else:
            desired, reason = current, ("Panic" if panic else "Steady")
        if obs.failed and desired == current:
            reason = "MetricsPartial"

        clamped = p.clamp(desired)
        if clamped != desired:
            reason = "AtMaximum" if clamped < desired else "AtMinimum"
        return Decision(desired=clamped, reason=reason, panic=panic, **base)
