"""A discrete-event simulation of one InferenceDeployment's fleet: pods, router, metrics and a policy.

Events (a heap ordered by time, then kind, then insertion, so a seed fixes the run): engine slices, policy
ticks, pods becoming Ready, drains ending. Inside an engine slice of `dt` every replica runs continuous
batching in closed form: decode steps of step_s(0, D, C) each, with prompt chunks of up to
max_batched_tokens - D tokens inside every step, FIFO admission while batch slots and KV blocks last, and
preemption (recompute) of the newest sequences when the KV cache overflows. Rows are requests, or cohorts of
`weight` identical ones (autoscale_traces), kept as numpy columns so 200 replicas run in seconds.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from autoscale_peers import Policy, View
from autoscale_stepmodel import StepModel
from autoscale_traces import Trace

from kvpilot.router.picker import EndpointLoad, Picker

FREE, STARTING, READY, DRAINING = 0, 1, 2, 3
ROUTER, QUEUED, PREFILL, DECODE = -1, 0, 1, 2
# event kinds, in the order they run at one instant: pods first, then the policy sees them, then the engine
POD_READY, DRAIN_END, POLICY, SLICE = 0, 1, 2, 3


@dataclass(frozen=True)
class ReplicaSpec:
    step: StepModel
    kv_blocks: int
    block_size: int = 16
    max_batch: int = 256
    max_batched_tokens: int = 8192
    max_queued: int = 1024  # the daemon's --max-queued-requests: past it, a new request gets a 429

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size


@dataclass(frozen=True)
class SimConfig:
    replica: ReplicaSpec
    dt: float = 1.0
    cold_start: tuple[float, float] = (60.0, 180.0)  # uniform, s: image pull, weights, warm-up
    drain: tuple[float, float] = (20.0, 40.0)  # uniform, s: the graceful drain's limit
    scrape_lag: float = 5.0  # the metrics a decision sees are this old
    routing: str = "least"  # rr | least | kvpilot
    hold_timeout: float = 120.0  # a request held at the router this long is rejected
    initial_replicas: int = 1
    max_replicas: int = 1000
    tail: float = 900.0  # after the trace: no arrivals, until every request ended or this passed
    sample_every: float = 10.0
    seed: int = 0


class Rows:
    """The requests in the system, one numpy column per field."""

    COLS: dict[str, Any] = {"t_arr": float, "prompt": np.int64, "out": np.int64, "rep": np.int64,
                            "state": np.int64, "order": float, "gen": float, "ctx0": np.int64, "left": float,
                            "ft": float, "admit": np.int64, "retried": np.int64, "tag": np.int64}

    def __init__(self) -> None:
        for k, dt in self.COLS.items():
            setattr(self, k, np.zeros(0, dtype=dt))

    def __len__(self) -> int:
        return len(self.t_arr)

    def add(self, t: np.ndarray, prompt: np.ndarray, out: np.ndarray, tag: np.ndarray | None = None) -> None:
        """New requests; `tag` is the caller's (a client id in a closed loop), -1 when not given."""
        n = len(t)
        new = {"t_arr": t, "prompt": prompt, "out": out, "rep": np.full(n, -1), "state": np.full(n, ROUTER),
               "order": t.astype(float), "gen": np.zeros(n), "ctx0": prompt, "left": np.zeros(n),
               "ft": np.full(n, np.nan), "admit": np.zeros(n, dtype=np.int64), "retried": np.zeros(n, dtype=np.int64),
               "tag": np.full(n, -1) if tag is None else tag}
        for k, v in new.items():
            setattr(self, k, np.concatenate([getattr(self, k), np.asarray(v, dtype=self.COLS[k])]))

    def keep(self, mask: np.ndarray) -> None:
        for k in self.COLS:
            setattr(self, k, getattr(self, k)[mask])


def group_cumsum(keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """Running sum of vals within each run of equal (sorted) keys."""
    c = np.cumsum(vals)
    if len(c) == 0:
        return c
    starts = np.r_[True, keys[1:] != keys[:-1]]
    base = (c - vals)[starts]
    return c - base[np.cumsum(starts) - 1]


def water_fill(loads: np.ndarray, n: int) -> np.ndarray:
    """How many of n new requests each replica gets so that the least loaded fill up first."""
    lo, hi = float(loads.min()), float(loads.min()) + n + 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.maximum(0, np.floor(mid - loads)).sum() >= n:
            hi = mid
        else:
            lo = mid
    counts = np.maximum(0, np.floor(hi - loads)).astype(np.int64)
    extra = int(counts.sum()) - n
    if extra > 0:  # the level overshot: take the extras back from the most loaded takers
        takers = np.flatnonzero(counts > 0)
        for i in takers[np.argsort(-(loads[takers] + counts[takers]), kind="stable")][:extra]:
            counts[i] -= 1
    return counts


@dataclass
class Result:
    trace: str
    policy: str
    weight: int
    ttft: np.ndarray  # per finished row
    tpot: np.ndarray
    t_arr: np.ndarray  # of finished rows
    rejected_t: np.ndarray  # arrival times of rejected rows
    held_end: int  # requests still in the system at the end
    arrived: int
    replica_seconds: float
    scale_events: int
    direction_changes: int
    preempted: int
    retried: int
    rejected_full: int = 0  # of the rejected, those every replica refused with 429 (queue full)
    timeline: dict[str, list[float]] = field(default_factory=dict)


class Fleet:
    def __init__(self, cfg: SimConfig, trace: Trace, policy: Policy) -> None:
        self.cfg, self.trace, self.policy = cfg, trace, policy
        self.rng = np.random.default_rng(cfg.seed)
        self.spec = cfg.replica
        n = cfg.max_replicas * 2 + 8
        self.slot_state = np.zeros(n, dtype=np.int64)
        self.ready_at = np.zeros(n)
        self.drain_at = np.zeros(n)
        self.rows = Rows()
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = itertools.count()
        self.snapshots: deque[tuple[float, np.ndarray, np.ndarray, np.ndarray]] = deque()
        self.rr = 0
        self.next_arrival = 0
        self.admits = 0
        self.picker = Picker()
        self.w = trace.weight
        self.fin: dict[str, list[np.ndarray]] = {"ttft": [], "tpot": [], "t_arr": []}
        self.rejected: list[np.ndarray] = []
        self.replica_seconds = 0.0
        self.scale_events = 0
        self.direction_changes = 0
        self.last_dir = 0
        self.preempted = 0
        self.retried = 0
        self.rejected_full = 0
        self.timeline: dict[str, list[float]] = {k: [] for k in ("t", "replicas", "ready", "queue", "held", "kv")}
        self.next_sample = 0.0
        self.kv = np.zeros(n)
        self.waiting = np.zeros(n)
        self.running = np.zeros(n)
        self.used_blocks = np.zeros(n)
        for _ in range(cfg.initial_replicas):
            s = self._free_slot()
            self.slot_state[s] = READY

    # --- events -------------------------------------------------------------------------------------------
    def push(self, t: float, kind: int, arg: int = 0) -> None:
        heapq.heappush(self.events, (t, kind, next(self.seq), arg))

    def run(self) -> Result:
        end = self.trace.duration
        self.push(0.0, SLICE)
        self.push(self.policy.interval, POLICY)
        while self.events:
            t, kind, _, arg = heapq.heappop(self.events)
            if kind == POD_READY:
                if self.slot_state[arg] == STARTING and self.ready_at[arg] <= t:
                    self.slot_state[arg] = READY
            elif kind == DRAIN_END:
                if self.slot_state[arg] == DRAINING and self.drain_at[arg] <= t:
                    self._evict_slot(arg)
            elif kind == POLICY:
                self._policy_tick(t)
                if t < end:
                    self.push(t + self.policy.interval, POLICY)
            else:
                self._slice(t)
                if t + self.cfg.dt < end or (len(self.rows) and t < end + self.cfg.tail):
                    self.push(t + self.cfg.dt, SLICE)
                else:
                    break
        return self._result()

    # --- pods ---------------------------------------------------------------------------------------------
    def _free_slot(self) -> int:
        free = np.flatnonzero(self.slot_state == FREE)
        return int(free[0])

    def current(self) -> int:
        return int(np.isin(self.slot_state, (STARTING, READY)).sum())

    def _scale(self, t: float, desired: int) -> None:
        cur = self.current()
        desired = min(desired, self.cfg.max_replicas)
        if desired == cur:
            return
        direction = 1 if desired > cur else -1
        self.scale_events += 1
        self.direction_changes += int(self.last_dir != 0 and direction != self.last_dir)
        self.last_dir = direction
        if desired > cur:
            for _ in range(desired - cur):
                s = self._free_slot()
                self.slot_state[s] = STARTING
                self.ready_at[s] = t + self.rng.uniform(*self.cfg.cold_start)
                self.push(float(self.ready_at[s]), POD_READY, s)
            return
        k = cur - desired
        starting = np.flatnonzero(self.slot_state == STARTING)
        for s in starting[np.argsort(-self.ready_at[starting])][:k]:  # the ReplicaSet removes unready pods first
            self.slot_state[s] = FREE
            k -= 1
        ready = np.flatnonzero(self.slot_state == READY)
        load = self.waiting[ready] + self.running[ready]
        for s in ready[np.argsort(load, kind="stable")][:k]:
            self.slot_state[s] = DRAINING
            self.drain_at[s] = t + self.rng.uniform(*self.cfg.drain)
            self.push(float(self.drain_at[s]), DRAIN_END, int(s))
            r = self.rows
            back = (r.rep == s) & (r.state == QUEUED)  # a draining daemon answers 503: the router retries
            r.state[back], r.rep[back] = ROUTER, -1

    def _evict_slot(self, s: int) -> None:
        """Drain limit reached: what still runs there is cut off and retried from scratch by the router."""
        r = self.rows
        cut = r.rep == s
        self.retried += int(cut.sum()) * self.w
        r.state[cut], r.rep[cut], r.ctx0[cut], r.left[cut] = ROUTER, -1, r.prompt[cut], 0.0
        r.gen[cut] = 0.0
        r.retried[cut] += 1
        self.slot_state[s] = FREE

    # --- policy -------------------------------------------------------------------------------------------
    def _policy_tick(self, t: float) -> None:
        kv, waiting, running = self.kv, self.waiting, self.running
        for ts, k, w, r in reversed(self.snapshots):
            if ts <= t - self.cfg.scrape_lag:
                kv, waiting, running = k, w, r
                break
        ready = np.flatnonzero(self.slot_state == READY)
        r = self.rows
        held = float((r.state == ROUTER).sum()) * self.w
        view = View(kv=tuple(kv[ready].tolist()), waiting=tuple(waiting[ready].tolist()),
                    running=tuple(running[ready].tolist()), not_ready=int((self.slot_state == STARTING).sum()),
                    held=held, inflight=float((r.state != ROUTER).sum()) * self.w)
        self._scale(t, int(self.policy.decide(t, self.current(), view)))

    # --- the engine slice ---------------------------------------------------------------------------------
    def _arrivals(self, t: float) -> None:
        tr = self.trace
        hi = int(np.searchsorted(tr.t, t + self.cfg.dt, side="left"))
        if hi > self.next_arrival:
            sl = slice(self.next_arrival, hi)
            self.rows.add(tr.t[sl], tr.prompt[sl], tr.output[sl])
            self.next_arrival = hi

    def _route(self, t: float) -> None:
        r = self.rows
        todo = np.flatnonzero(r.state == ROUTER)
        if len(todo) == 0:
            return
        ready = np.flatnonzero(self.slot_state == READY)
        if len(ready) == 0:
            late = todo[t - r.t_arr[todo] > self.cfg.hold_timeout]
            if len(late):
                self.rejected.append(r.t_arr[late].copy())
                self._drop(late)
            return
        # A daemon answers 429 once max_queued requests wait for their first token; the router then tries the
        # next replica, and the client gets 429 when all refused. Room is counted in rows (cohorts of w).
        n_slots = len(self.slot_state)
        unfirst = r.rep[(r.state == QUEUED) | (r.state == PREFILL)]
        room = np.maximum(0, (self.spec.max_queued - np.bincount(unfirst, minlength=n_slots) * self.w) // self.w)
        room = room[ready]
        if self.cfg.routing == "rr":
            dest = ready[(self.rr + np.arange(len(todo))) % len(ready)]
            self.rr = (self.rr + len(todo)) % len(ready)
        elif self.cfg.routing == "least":
            inflight = np.bincount(r.rep[r.rep >= 0], minlength=n_slots)[ready].astype(float)
            open_ = room > 0
            dest = (np.repeat(ready, water_fill(np.where(open_, inflight, np.inf), len(todo))) if open_.any()
                    else np.full(len(todo), ready[0]))
        else:
            dest = self._pick(ready, len(todo))
        # the first choice keeps a request while its replica has room; the rest move on, least loaded first
        pos = np.searchsorted(ready, dest)
        order = np.argsort(pos, kind="stable")
        rank = np.empty(len(dest), dtype=np.int64)
        rank[order] = group_cumsum(pos[order], np.ones(len(dest), dtype=np.int64)) - 1
        ok = rank < room[pos]
        room = room - np.bincount(pos[ok], minlength=len(ready))
        spill = np.flatnonzero(~ok)
        if len(spill) and room.sum() > 0:
            inflight = np.bincount(r.rep[r.rep >= 0], minlength=n_slots)[ready] + np.bincount(
                pos[ok], minlength=len(ready))
            take = min(len(spill), int(room.sum()))
            counts = np.zeros(len(ready), dtype=np.int64)
            while take > int(counts.sum()):
                left = room - counts
                more = water_fill(np.where(left > 0, inflight + counts, np.inf), take - int(counts.sum()))
                counts += np.minimum(more, left)
            dest[spill[:take]] = np.repeat(ready, counts)
            ok[spill[:take]] = True
        r.rep[todo[ok]], r.state[todo[ok]] = dest[ok], QUEUED
        if not ok.all():
            refused = todo[~ok]
            self.rejected.append(r.t_arr[refused].copy())
            self.rejected_full += len(refused) * self.w
            self._refused(refused, t)
            self._drop(refused)

    def _refused(self, idx: np.ndarray, t: float) -> None:
        """Rows every replica refused (429) in the slice at t, before they are dropped: a hook for clients."""

    def _finished(self, idx: np.ndarray, t_fin: np.ndarray) -> None:
        """Rows that ended at t_fin, before they are removed: a hook for clients."""

    def _drop(self, idx: np.ndarray) -> None:
        keep = np.ones(len(self.rows), dtype=bool)
        keep[idx] = False
        self.rows.keep(keep)

    def _pick(self, ready: np.ndarray, n: int) -> np.ndarray:
        """kvpilot's router picker on this slice's n rows, one request after another (`pick_many`: the same
        decisions as n `pick` calls, each counting the last in flight); its own in-flight count is fresh, the
        scraped loads are the last slice's. The rows carry no prompt key: the simulator keeps no prefix cache
        and its prompts share none, so the picker routes by load (its cost, the load cap, the KV-full rule)."""
        inflight = np.bincount(self.rows.rep[self.rows.rep >= 0], minlength=len(self.slot_state)) * self.w
        loads = [EndpointLoad(str(s), f, run, wait, kv) for s, f, run, wait, kv in zip(
            ready.tolist(), inflight[ready].tolist(), self.running[ready].tolist(), self.waiting[ready].tolist(),
            self.kv[ready].tolist(), strict=True)]
        return np.array([int(d.endpoint) for d in self.picker.pick_many(loads, n, weight=self.w)], dtype=np.int64)

    def _admit(self) -> None:
        r, spec, w = self.rows, self.spec, self.w
        q = np.flatnonzero(r.state == QUEUED)
        if len(q) == 0:
            return
        q = q[np.lexsort((r.order[q], r.rep[q]))]
        reps = r.rep[q]
        blocks = w * -(-(r.ctx0[q] + 1) // spec.block_size)
        cum_w = group_cumsum(reps, np.full(len(q), w, dtype=np.int64))
        cum_b = group_cumsum(reps, blocks)
        running = np.bincount(r.rep[r.state >= PREFILL], minlength=len(self.slot_state)) * w
        ok = (cum_w <= spec.max_batch - running[reps]) & (cum_b <= spec.kv_blocks - self.used_blocks[reps])
        ok &= self.slot_state[reps] != DRAINING
        adm = q[ok]
        r.state[adm] = PREFILL
        r.left[adm] = w * spec.step.prefill_work_s(r.ctx0[adm].astype(float))
        r.admit[adm] = self.admits + np.arange(len(adm))
        self.admits += len(adm)
        self.used_blocks += np.bincount(r.rep[adm], weights=blocks[ok], minlength=len(self.slot_state))

    def _slice(self, t: float) -> None:
        spec, w, dt = self.spec, self.w, self.cfg.dt
        self._arrivals(t)
        self._route(t)
        self._admit()
        r, n_slots, step = self.rows, len(self.slot_state), spec.step
        if len(r):
            dec_rows = r.state == DECODE
            pre_rows = np.flatnonzero(r.state == PREFILL)
            reps_dec = r.rep[dec_rows]
            d = np.bincount(reps_dec, minlength=n_slots) * w
            c = np.bincount(reps_dec, weights=(r.prompt[dec_rows] + r.gen[dec_rows]) * w, minlength=n_slots)
            work = np.bincount(r.rep[pre_rows], weights=r.left[pre_rows], minlength=n_slots)
            dec = step.overhead_s + step.decode_seq_s * d + step.context_token_s * c
            kb = step.prefill_token_s * np.maximum(spec.max_batched_tokens - d, 64)
            n1 = dt / (dec + kb)
            cap = n1 * kb
            done = np.minimum(work, cap)
            nsteps = np.where(work >= cap, n1, (dt - work) / dec)
            rho = kb / (dec + kb)
            tokens = np.zeros(len(r))
            if len(pre_rows):
                pre_rows = pre_rows[np.lexsort((r.admit[pre_rows], r.rep[pre_rows]))]
                reps = r.rep[pre_rows]
                own = r.left[pre_rows].copy()
                cum = group_cumsum(reps, own)
                new_left = np.clip(cum - done[reps], 0.0, r.left[pre_rows])
                r.left[pre_rows] = new_left
                fin = pre_rows[new_left <= 1e-12]
                if len(fin):
                    rf = rho[r.rep[fin]]
                    # a request that arrived inside the slice cannot start its prefill before it arrived
                    ft = np.maximum(t + cum[new_left <= 1e-12] / rf, r.t_arr[fin] + own[new_left <= 1e-12] / rf)
                    ft = np.minimum(ft, t + dt)
                    first = np.isnan(r.ft[fin])
                    r.ft[fin[first]] = ft[first]
                    r.state[fin] = DECODE
                    r.gen[fin] = np.maximum(r.gen[fin], 1.0)
                    tokens[fin] = nsteps[r.rep[fin]] * (t + dt - ft) / dt
            tokens[dec_rows] = nsteps[reps_dec]
            r.gen += tokens
            self._finish(t)
            self._preempt()
        self._metrics(t)

    def _finish(self, t: float) -> None:
        r, dt = self.rows, self.cfg.dt
        done = np.flatnonzero((r.state == DECODE) & (r.gen >= r.out))
        if len(done) == 0:
            return
        per_token = dt / np.maximum(1e-9, self._nsteps_of(done))
        t_fin = np.maximum(t + dt - (r.gen[done] - r.out[done]) * per_token, r.ft[done])
        self.fin["ttft"].append(r.ft[done] - r.t_arr[done])
        self.fin["tpot"].append((t_fin - r.ft[done]) / np.maximum(r.out[done] - 1, 1))
        self.fin["t_arr"].append(r.t_arr[done].copy())
        self._finished(done, t_fin)
        keep = np.ones(len(r), dtype=bool)
        keep[done] = False
        r.keep(keep)

    def _nsteps_of(self, rows: np.ndarray) -> np.ndarray:
        """Decode steps a slice of the rows' replicas ran: recomputed from the batch it started with is
        not kept, so take the tokens each got as the step count (every decode row gets one per step)."""
        r, step, w, n = self.rows, self.spec.step, self.w, len(self.slot_state)
        dec = r.state == DECODE
        d = np.bincount(r.rep[dec], minlength=n) * w
        c = np.bincount(r.rep[dec], weights=(r.prompt[dec] + r.gen[dec]) * w, minlength=n)
        per_step = step.overhead_s + step.decode_seq_s * d + step.context_token_s * c
        return self.cfg.dt / per_step[r.rep[rows]]

    def _preempt(self) -> None:
        r, spec, w = self.rows, self.spec, self.w
        live = r.state >= PREFILL
        blocks = np.where(live, w * -(-(r.prompt + r.gen.astype(np.int64) + 1) // spec.block_size), 0)
        used = np.bincount(r.rep[live], weights=blocks[live], minlength=len(self.slot_state)).astype(float)
        for s in np.flatnonzero(used > spec.kv_blocks):
            mine = np.flatnonzero(live & (r.rep == s))
            mine = mine[np.argsort(-r.admit[mine])]  # the newest go first, as vLLM's recompute preemption
            freed = np.cumsum(blocks[mine])
            victims = mine[: int(np.searchsorted(freed, used[s] - spec.kv_blocks)) + 1]
            victims = victims[: max(len(mine) - 1, 1)] if len(mine) > 1 else victims[:0]
            r.state[victims], r.order[victims] = QUEUED, r.t_arr[victims] - 1e12  # back to the queue's head
            r.ctx0[victims] = r.prompt[victims] + r.gen[victims].astype(np.int64)
            self.preempted += len(victims) * w
            used[s] -= blocks[victims].sum()
        self.used_blocks = used

    def _metrics(self, t: float) -> None:
        r, w, n, dt = self.rows, self.w, len(self.slot_state), self.cfg.dt
        rep = np.where(r.rep >= 0, r.rep, 0)
        self.waiting = np.bincount(rep, weights=(r.state == QUEUED) * float(w), minlength=n)
        self.running = np.bincount(rep, weights=(r.state >= PREFILL) * float(w), minlength=n)
        self.kv = self.used_blocks / self.spec.kv_blocks
        self.snapshots.append((t + dt, self.kv, self.waiting, self.running))
        while len(self.snapshots) > 2 and self.snapshots[1][0] <= t + dt - self.cfg.scrape_lag - dt:
            self.snapshots.popleft()
        empty = (self.slot_state == DRAINING) & (np.bincount(rep[r.rep >= 0], minlength=n) == 0)
        self.slot_state[empty] = FREE  # a drained pod goes as soon as its last request ends
        alive = self.slot_state != FREE
        self.replica_seconds += float(alive.sum()) * dt
        if t + dt >= self.next_sample:
            self.next_sample += self.cfg.sample_every
            held = float((r.state == ROUTER).sum()) * w
            ready = self.slot_state == READY
            tl = self.timeline
            tl["t"].append(round(t + dt, 3))
            tl["replicas"].append(float(alive.sum()))
            tl["ready"].append(float(ready.sum()))
            tl["queue"].append(float(self.waiting.sum()) + held)
            tl["held"].append(held)
            tl["kv"].append(float(self.kv[ready].mean()) if ready.any() else 0.0)

    def _result(self) -> Result:
        def cat(xs: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(xs) if xs else np.zeros(0)

        return Result(self.trace.name, self.policy.name, self.w, cat(self.fin["ttft"]), cat(self.fin["tpot"]),
                      cat(self.fin["t_arr"]), cat(self.rejected), len(self.rows) * self.w, self.trace.requests,
                      self.replica_seconds, self.scale_events, self.direction_changes, self.preempted,
                      self.retried, self.rejected_full, self.timeline)


def simulate(cfg: SimConfig, trace: Trace, policy: Policy) -> Result:
    return Fleet(cfg, trace, policy).run()
