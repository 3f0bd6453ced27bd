"""bench/autoscale_*.py: the fleet simulator's pieces, kvpilot's policy inside it, and the peers' rules."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import autoscale_fleet as fleet  # noqa: E402
import autoscale_stepmodel as stepmodel  # noqa: E402
from autoscale_peers import Hpa, Kpa, Kvpilot, View, Wva  # noqa: E402
from autoscale_traces import Trace, chat_shapes, generate  # noqa: E402

from kvpilot.operator import autoscaler  # noqa: E402

# autoscale_stepprofile.py times whole engine steps of the demo's daemon settings, each shape the fastest of
# five interleaved rounds; the linear model is within 14% of every shape and 1.1% of the median one
CPU_FIT_MAX_REL_ERR = 0.15
CPU_FIT_MEDIAN_REL_ERR = 0.03


def test_cpu_step_model_reproduces_its_calibration() -> None:
    pts = stepmodel.profile_points()
    model, rows = stepmodel.fit("cpu", pts)
    assert len(rows) >= 100
    errs = [abs(float(r["rel_err"])) for r in rows]
    assert max(errs) <= CPU_FIT_MAX_REL_ERR
    assert float(np.median(errs)) <= CPU_FIT_MEDIAN_REL_ERR
    assert min(model.overhead_s, model.prefill_token_s, model.decode_seq_s, model.context_token_s) > 0
    # the shapes span what the demo runs: prompts alone, decode batches of 1-4, prompts mixed into decodes
    assert {p.decode_seqs for p in pts} >= {0, 1, 2, 3, 4}
    assert any(p.prefill_tokens and p.decode_seqs for p in pts)


def test_step_shape_tells_prefill_from_decode() -> None:
    from types import SimpleNamespace as E

    from autoscale_stepprofile import step_shape
    entries = [E(token_ids=[1] * 29, start_pos=0), E(token_ids=[5], start_pos=40), E(token_ids=[6], start_pos=9),
               E(token_ids=[7], start_pos=0)]  # a one-token prompt is a prefill
    assert step_shape(entries) == (30, 2, 41 + 10)


def test_fit_recovers_a_known_model() -> None:
    true = stepmodel.StepModel("t", 0.01, 1e-4, 2e-4, 3e-7)
    pts = [stepmodel.Point("s", p, d, c, true.step_s(p, d, c))
           for p, d, c in [(0, 4, 400), (0, 64, 6400), (0, 16, 32000), (512, 0, 0), (2048, 0, 0), (0, 1, 50)]]
    model, rows = stepmodel.fit("t", pts)
    assert max(abs(float(r["rel_err"])) for r in rows) < 1e-9
    assert model.context_token_s == pytest.approx(3e-7)


def tiny_spec() -> fleet.ReplicaSpec:
    return fleet.ReplicaSpec(step=stepmodel.StepModel("t", 0.01, 2e-5, 1e-4, 1e-7), kv_blocks=400, block_size=16,
                             max_batch=16, max_batched_tokens=1024)


def tiny_trace(seed: int = 3, rate: float = 6.0, duration: float = 300.0, min_replicas: int = 1) -> Trace:
    return generate("t", lambda t: rate + 0 * t, duration, seed, chat_shapes, min_replicas=min_replicas)


def tiny_cfg(**kw: object) -> fleet.SimConfig:
    base = {"replica": tiny_spec(), "dt": 0.5, "cold_start": (20.0, 40.0), "max_replicas": 8, "seed": 5}
    base.update(kw)
    return fleet.SimConfig(**base)  # type: ignore[arg-type]


def kvpilot(max_replicas: int = 8, min_replicas: int = 1) -> Kvpilot:
    return Kvpilot(autoscaler.Policy(min_replicas=min_replicas, max_replicas=max_replicas, stable_window=30,
                                     panic_window=10, scale_down_delay=30), interval=5.0)


def test_the_same_seed_gives_the_same_run_and_another_seed_does_not() -> None:
    a = fleet.simulate(tiny_cfg(), tiny_trace(), kvpilot())
    b = fleet.simulate(tiny_cfg(), tiny_trace(), kvpilot())
    c = fleet.simulate(tiny_cfg(seed=6), tiny_trace(seed=4), kvpilot())
    assert np.array_equal(a.ttft, b.ttft) and a.timeline == b.timeline and a.replica_seconds == b.replica_seconds
    assert not np.array_equal(a.ttft, c.ttft)


def test_the_event_queue_orders_by_time_then_kind_then_insertion() -> None:
    f = fleet.Fleet(tiny_cfg(), tiny_trace(), kvpilot())
    f.push(2.0, fleet.SLICE)
    f.push(1.0, fleet.POLICY)
    f.push(1.0, fleet.POD_READY, 3)
    f.push(1.0, fleet.POD_READY, 1)
    import heapq
    got = [heapq.heappop(f.events) for _ in range(4)]
    assert [(e[0], e[1], e[3]) for e in got] == [(1.0, fleet.POD_READY, 3), (1.0, fleet.POD_READY, 1),
                                                 (1.0, fleet.POLICY, 0), (2.0, fleet.SLICE, 0)]


@pytest.mark.parametrize("routing", ["rr", "least", "kvpilot"])
def test_every_request_finishes_is_rejected_or_is_held(routing: str) -> None:
    trace = tiny_trace(rate=12.0, duration=200.0)
    res = fleet.simulate(tiny_cfg(routing=routing, tail=60.0), trace, kvpilot())
    assert len(res.ttft) * res.weight + len(res.rejected_t) * res.weight + res.held_end == res.arrived
    assert len(res.ttft) > 0 and (res.ttft >= 0).all() and (res.tpot > 0).all()


def test_requests_wait_held_at_zero_and_are_rejected_after_the_hold_timeout() -> None:
    trace = tiny_trace(rate=2.0, duration=100.0, min_replicas=0)
    never = Hpa(target=4.0, min_replicas=0, max_replicas=0)
    res = fleet.simulate(tiny_cfg(initial_replicas=0, hold_timeout=30.0, tail=60.0), trace, never)
    assert len(res.ttft) == 0 and len(res.rejected_t) > 0
    assert len(res.rejected_t) * res.weight + res.held_end == res.arrived


def test_the_simulator_runs_operator_autoscaler(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = autoscaler.Autoscaler.decide

    def spy(self: autoscaler.Autoscaler, now: float, current: int, obs: autoscaler.Observation) -> object:
        calls.append(current)
        return real(self, now, current, obs)

    monkeypatch.setattr(autoscaler.Autoscaler, "decide", spy)
    fleet.simulate(tiny_cfg(), tiny_trace(duration=60.0), kvpilot())
    assert len(calls) >= 10


def test_the_router_picker_is_the_imported_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpilot.router import picker
    assert fleet.Picker is picker.Picker
    picks: list[int] = []
    real = picker.Picker.pick_many

    def spy(self: object, loads: list, n: int, *a: object, **kw: object) -> object:
        picks.append(n)
        return real(self, loads, n, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(picker.Picker, "pick_many", spy)
    res = fleet.simulate(tiny_cfg(routing="kvpilot"), tiny_trace(duration=30.0), kvpilot())
    assert sum(picks) >= len(res.ttft) > 0  # every routed row went through it


def test_water_fill_fills_the_least_loaded_first() -> None:
    assert fleet.water_fill(np.array([5.0, 0.0, 2.0]), 4).tolist() == [0, 3, 1]
    assert fleet.water_fill(np.array([1.0, 1.0]), 3).sum() == 3


def test_kv_overflow_preempts_the_newest() -> None:
    spec = fleet.ReplicaSpec(step=stepmodel.StepModel("t", 0.01, 1e-5, 1e-4, 1e-7), kv_blocks=20, block_size=16,
                             max_batch=8, max_batched_tokens=1024)
    trace = Trace("p", np.array([0.0, 0.1, 0.2]), np.array([100, 100, 100]), np.array([200, 200, 200]), 1, 10.0)
    res = fleet.simulate(fleet.SimConfig(replica=spec, dt=0.1, max_replicas=1, tail=100.0), trace,
                         Hpa(target=1e9, max_replicas=1))
    assert res.preempted > 0 and len(res.ttft) == 3


def view(kv: list[float], waiting: list[float], running: list[float] | None = None, not_ready: int = 0) -> View:
    return View(tuple(kv), tuple(waiting), tuple(running or [0.0] * len(kv)), not_ready)


def test_hpa_ratio_tolerance_and_scale_down_stabilization() -> None:
    h = Hpa(target=4.0)
    assert h.decide(0, 4, view([0] * 4, [8, 8, 8, 8])) == 8  # ceil(4 * 8 / 4)
    assert h.decide(15, 8, view([0] * 8, [4.3] * 8)) == 8  # 7.5% off target: inside the 10% tolerance
    assert h.decide(30, 8, view([0] * 8, [1] * 8)) == 8  # wants 2, but 8 was recommended within 300 s
    assert h.decide(316, 8, view([0] * 8, [1] * 8)) == 2  # 300 s after the last 8
    assert Hpa(target=4.0).decide(0, 2, view([0, 0], [40, 40])) == 6  # up at most max(2x, +4) a period


def test_hpa_on_running_requests() -> None:
    assert Hpa(target=100.0, metric="running").decide(0, 3, view([0] * 3, [0] * 3, [150, 150, 150])) == 5


def test_kpa_windows_panic_and_rates() -> None:
    """AIBrix's kpa.go, worked by hand with windows of 30 s (stable) and 10 s (panic), no delay window."""
    k = Kpa(target=10.0, stable_window=30.0, panic_window=10.0, delay_window=1.0)
    assert k.decide(0, 2, view([0, 0], [0, 0], [10, 10])) == 2  # stable 20 / 10
    # a burst: the panic window's raw desire (200 / 10 = 20) is >= 2x the 2 Ready pods -> panic; the stable
    # mean (20 + 200) / 2 asks for 11, clamped to 2x the Ready pods
    assert k.decide(10, 2, view([0, 0], [0, 0], [100, 100])) == 4
    assert k._panic_since == 10
    # the rates are of the Ready pods: 2 more are starting, so it does not double again to 8
    assert k.decide(20, 4, view([0, 0], [0, 0], [100, 100], not_ready=2)) == 4
    # the load is gone, but the stable window (200, 200, 0: 14 pods, clamped to 2x4 Ready) still sees it
    assert k.decide(30, 4, view([0] * 4, [0] * 4, [0] * 4)) == 8
    # stable (200, 0, 0) asks for 7, but in panic the count is the panic's highest (8): it never goes down
    assert k.decide(40, 8, view([0] * 8, [0] * 8, [0] * 8)) == 8
    # a stable window (30 s) after the panic last triggered (t=20) it ends: stable 0, floored at half the Ready
    assert k.decide(60, 8, view([0] * 8, [0] * 8, [0] * 8)) == 4
    assert k._panic_since is None and k._max_panic == 0
    calm = Kpa(target=10.0, delay_window=1.0)
    calm.decide(0, 2, view([0, 0], [0, 0], [10, 10]))
    assert calm.decide(20, 30, view([0] * 30, [0] * 30, [0] * 30)) == 15  # no panic: down, at most by half


def test_kpa_scale_down_delay_takes_the_max_desire_of_the_window() -> None:
    k = Kpa(target=10.0, delay_window=60.0, stable_window=30.0, panic_window=15.0)
    assert k.decide(0, 4, view([0] * 4, [0] * 4, [10] * 4)) == 4
    assert k.decide(40, 4, view([0] * 4, [0] * 4, [2.5] * 4)) == 4  # wants 1 (rate floor 2), 4 in the window
    assert k.decide(70, 4, view([0] * 4, [0] * 4, [2.5] * 4)) == 2  # window has 2s only: the rate floor 4/2


def test_wva_saturation_rules() -> None:
    w = Wva()
    assert w.decide(0, 2, view([0.85, 0.9], [0, 0])) == 3  # all saturated
    assert w.decide(0, 2, view([0.75, 0.2], [0, 0])) == 2  # spare KV (0.05 + 0.6) / 2 = 0.325: hold...
    assert w.decide(0, 2, view([0.75, 0.75], [0, 0])) == 3  # ...spare KV 0.05 < 0.1
    assert w.decide(0, 2, view([0.2, 0.2], [3, 3])) == 3  # spare queue 2 < 3
    assert w.decide(0, 3, view([0.1, 0.1, 0.1], [0, 0, 0])) == 2  # 0.3 over 2 pods: 0.15 leaves 0.65 spare
    assert w.decide(0, 3, view([0.5, 0.5, 0.5], [0, 0, 0])) == 3  # 1.5 over 2 = 0.75: spare 0.05 < 0.1
    assert w.decide(0, 3, view([0.1, 0.1, 0.1], [1.5, 1.5, 1.5])) == 3  # 4.5 over 2 leaves 2.75 < 3


def test_a_full_queue_answers_429_and_the_rejections_are_counted() -> None:
    # one replica that can never keep up (huge steps): past max_queued, arrivals are refused, not queued
    slow = fleet.ReplicaSpec(step=stepmodel.StepModel("slow", 5.0, 1e-3, 1e-3, 0.0), kv_blocks=400, block_size=16,
                             max_batch=4, max_batched_tokens=1024, max_queued=20)
    trace = tiny_trace(rate=5.0, duration=60.0)
    cfg = tiny_cfg(replica=slow, max_replicas=1, tail=0.0)
    f = fleet.Fleet(cfg, trace, Hpa(target=1e9, max_replicas=1))
    res = f.run()
    assert res.rejected_full > 0 and res.rejected_full == len(res.rejected_t) * res.weight
    assert max(f.timeline["queue"]) <= 20  # waiting never passes the daemon's bound
    assert len(res.ttft) * res.weight + len(res.rejected_t) * res.weight + res.held_end == res.arrived
    roomy = fleet.simulate(tiny_cfg(replica=fleet.ReplicaSpec(**{**slow.__dict__, "max_queued": 10**6}),
                                    max_replicas=1, tail=0.0), trace, Hpa(target=1e9, max_replicas=1))
    assert roomy.rejected_full == 0


def test_the_simulator_passes_max_num_seqs_to_kvpilot() -> None:
    import autoscale_sim
    spec = autoscale_sim.gpu_replica()
    policy = autoscale_sim.make_policy("kvpilot", spec, 1, 10)
    assert isinstance(policy, Kvpilot) and policy.policy.max_num_seqs == spec.max_batch


def test_closed_loop_clients_send_again_only_when_their_request_ended() -> None:
    """The validation's replay of the demo's clients: one request in flight per client, the next sent when it
    ends, after Retry-After when every pod refused it (429), none after the clients stop."""
    import autoscale_validate as validate

    events: list[tuple[int, str, float]] = []

    class Recorded(validate.ClosedLoop):
        def _arrivals(self, t: float) -> None:
            n = len(self.rows)
            super()._arrivals(t)
            events.extend((int(k), "send", float(a)) for k, a in zip(self.rows.tag[n:], self.rows.t_arr[n:],
                                                                        strict=True))

        def _finished(self, idx: np.ndarray, t_fin: np.ndarray) -> None:
            events.extend((int(k), "end", float(f)) for k, f in zip(self.rows.tag[idx], t_fin, strict=True))
            super()._finished(idx, t_fin)

        def _refused(self, idx: np.ndarray, t: float) -> None:
            events.extend((int(k), "429", t) for k in self.rows.tag[idx])
            super()._refused(idx, t)

    spec = fleet.ReplicaSpec(step=stepmodel.StepModel("t", 0.02, 1e-4, 1e-3, 1e-6), kv_blocks=64, block_size=16,
                             max_batch=2, max_batched_tokens=256, max_queued=1)
    cfg = fleet.SimConfig(replica=spec, dt=0.05, max_replicas=1, tail=30.0)
    clients = validate.Clients(4, start=0.0, stop=20.0, prompt=10, output=20)
    Recorded(cfg, Hpa(target=1e9, max_replicas=1), [clients], end=20.0).run()
    assert {e for _, e, _ in events} == {"send", "end", "429"}  # 4 clients on 2 slots and a queue of 1
    for k in range(4):
        mine = [(e, t) for tag, e, t in events if tag == k]
        assert mine[0] == ("send", 0.0)
        for (e1, t1), (e2, t2) in zip(mine, mine[1:], strict=False):
            assert (e1 == "send") != (e2 == "send"), mine  # never two in flight, never a send from nowhere
            if e1 == "end":
                assert t2 == pytest.approx(t1)
            if e1 == "429":
                assert t2 >= t1 + validate.RETRY_AFTER
        assert all(t < 20.0 for e, t in mine if e == "send")
        assert mine[-1][0] != "send"  # every request ended or was refused: the clients stopped
