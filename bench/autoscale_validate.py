"""The simulator against the demo's real run: its clients replayed closed-loop at 1-2 replicas, on the CPU calibration.

    .venv/bin/python bench/autoscale_validate.py

Reads bench/results/autoscale_validation_demo_run.json (e2e/demo.py --no-router's timeline: the marks, the
requests, pods Ready over time) and autoscale_validation_demo_daemon_log.json (the daemons' per-request log:
TTFT, latency, tokens), and runs the demo's clients as e2e/lifecycle.py runs them (e2e/load.py):
- one smoke request once the first pod is Ready;
- from "load starts" to "load stops", 10 clients that each send the next request when the last one ended
  (29-token prompts, 16 tokens out), round-robin over the Ready pods; a 429 (more than 8 queued for their
  first token: maxQueuedRequests) is retried on the next pod after the Retry-After the daemon sends
  (about one request's time, so 2 s, the client's cap);
- from "load stops" to "spec change", 2 clients of 12-token prompts with 64 tokens out.
The pods are the demo's (4 sequences, 16 KV blocks, 512 tokens a step), its autoscaling spec as its events
show it ran (the waiting signal at 4 a pod: the run predates the batch-occupancy signal), its measured cold
start and drain. Steps take the CPU step model (autoscale_stepmodel.cpu()), fitted to
bench/autoscale_stepprofile.py's profile of the demo's daemon settings: nothing from the run is fitted, so
replicas over time, TTFT and TPOT are all held out. Writes autoscale_validation.json.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autoscale_fleet import Fleet, ReplicaSpec, SimConfig  # noqa: E402
from autoscale_peers import Kvpilot  # noqa: E402
from autoscale_stepmodel import calibration_report, cpu  # noqa: E402
from autoscale_traces import Trace  # noqa: E402

from kvpilot.operator import autoscaler  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RETRY_AFTER = 2.0  # e2e/load.py caps Retry-After at 2 s; the daemons asked round(recent e2e of ~1.6 s) = 2


@dataclass
class Clients:
    """n closed-loop clients: each sends its next request when the last one ended, from start until stop."""

    n: int
    start: float
    stop: float
    prompt: int
    output: int
    next_send: list[float | None] = field(default_factory=list)  # per client; None while in flight or stopped

    def __post_init__(self) -> None:
        self.next_send = [self.start] * self.n


class ClosedLoop(Fleet):
    """The fleet with clients in place of a trace: rows are tagged with their client, which sends again when
    its request ends (or after Retry-After when every pod refused it)."""

    def __init__(self, cfg: SimConfig, policy: Kvpilot, groups: list[Clients], end: float) -> None:
        super().__init__(cfg, Trace("demo", np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), 1, end),
                         policy)
        self.groups = groups
        self.owner = [(g, i) for g in groups for i in range(g.n)]  # tag -> (group, client)

    def _arrivals(self, t: float) -> None:
        due = [(k, g.next_send[i]) for k, (g, i) in enumerate(self.owner)
               if g.next_send[i] is not None and g.next_send[i] < t + self.cfg.dt]
        if not due:
            return
        for k, _ in due:
            g, i = self.owner[k]
            g.next_send[i] = None
        tags = np.array([k for k, _ in due], dtype=np.int64)
        groups = [self.owner[k][0] for k in tags]
        self.rows.add(np.array([s for _, s in due], dtype=float), np.array([g.prompt for g in groups]),
                      np.array([g.output for g in groups]), tags)

    def _again(self, tags: np.ndarray, when: np.ndarray) -> None:
        for k, t in zip(tags.tolist(), when.tolist(), strict=True):
            g, i = self.owner[k]
            g.next_send[i] = t if t < g.stop else None

    def _finished(self, idx: np.ndarray, t_fin: np.ndarray) -> None:
        self._again(self.rows.tag[idx], t_fin)

    def _refused(self, idx: np.ndarray, t: float) -> None:
        self._again(self.rows.tag[idx], np.full(len(idx), t + self.cfg.dt + RETRY_AFTER))


def main() -> None:
    run = json.loads((RESULTS / "autoscale_validation_demo_run.json").read_text())
    log = json.loads((RESULTS / "autoscale_validation_demo_daemon_log.json").read_text())
    marks = run["marks"]
    start = marks["pod 1 ready"]  # the simulation starts with the first pod Ready
    end = marks["spec change"] - start  # the rollout after it is not autoscaling
    # the daemons log each request as it ends, in wall time; the run's clock is aligned on the first (the smoke
    # request), and a request reached its daemon its latency before it ended
    t_end = min(r["end"] for r in run["requests"])
    ts0 = min(r["ts"] for r in log)
    real = [dict(r, arrived=r["ts"] - ts0 + t_end - r["latency_s"] - start) for r in log]
    real = [r for r in real if 0 <= r["arrived"] < end]
    heavy = [r for r in real if r["completion_tokens"] == 16]
    trickle = [r for r in real if r["completion_tokens"] == 64]
    prompt_heavy = int(np.median([r["prompt_tokens"] for r in heavy]))
    prompt_trickle = int(np.median([r["prompt_tokens"] for r in trickle]))
    smoke = next(r["start"] for r in run["requests"] if r["phase"] == "smoke") - start
    groups = [
        Clients(1, smoke, smoke + 0.01, prompt_heavy, 16),  # one request, never repeated
        Clients(10, marks["load starts"] - start, marks["load stops"] - start, prompt_heavy, 16),
        Clients(2, marks["load stops"] - start, end, prompt_trickle, 64),
    ]
    cold = marks["pod 2 ready"] - marks["scaled up"]
    drain = marks["pod removed"] - marks["scaled down"]
    step = cpu()
    spec = ReplicaSpec(step=step, kv_blocks=16, block_size=16, max_batch=4, max_batched_tokens=512, max_queued=8)
    cfg = SimConfig(replica=spec, dt=0.05, cold_start=(cold, cold), drain=(drain, drain), scrape_lag=0.5,
                    routing="rr", max_replicas=2, tail=120.0, sample_every=0.5)
    policy = Kvpilot(autoscaler.Policy(min_replicas=1, max_replicas=2, stable_window=8, panic_window=4,
                                       scale_down_delay=10), interval=1.0)
    res = ClosedLoop(cfg, policy, groups, end).run()

    samples = [s for s in run["samples"] if start <= s["t"] < start + end]
    real_t = np.array([s["t"] - start for s in samples])
    real_ready = np.array([s["ready"] or 0 for s in samples], dtype=float)
    sim_ready = np.interp(real_t, np.array(res.timeline["t"]), np.array(res.timeline["ready"]))
    real_ttft = float(np.median([r["ttft_s"] for r in real]))
    real_tpot = float(np.median([(r["latency_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) for r in real]))
    sim_ttft, sim_tpot = float(np.median(res.ttft)), float(np.median(res.tpot))
    # Until the second pod starts loading, one daemon has the demo's two cores to itself; from then on two
    # daemons (one loading a model), the load generator and the operator share them, which the simulator
    # does not model (a replica is a GPU pod with hardware of its own)
    alone = (marks["load starts"] - start, marks["scaled up"] - start)

    def window(arrived: np.ndarray, ended: np.ndarray, x: np.ndarray) -> float:
        return float(np.median(x[(arrived >= alone[0]) & (ended < alone[1])]))  # requests that ran wholly inside

    real_arr = np.array([r["arrived"] for r in real])
    real_end = np.array([r["arrived"] + r["latency_s"] for r in real])
    real_tpots = np.array([(r["latency_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) for r in real])
    sim_end = res.t_arr + res.ttft + 15 * res.tpot  # the heavy requests' 16 tokens: the only ones in the window
    one_pod = {"window_s": alone, "requests_real": int(((real_arr >= alone[0]) & (real_end < alone[1])).sum()),
               "tpot_p50_real_s": window(real_arr, real_end, real_tpots),
               "tpot_p50_sim_s": window(res.t_arr, sim_end, res.tpot),
               "ttft_p50_real_s": window(real_arr, real_end, np.array([r["ttft_s"] for r in real])),
               "ttft_p50_sim_s": window(res.t_arr, sim_end, res.ttft)}
    cal = calibration_report()
    report = {
        "replay": "closed-loop: the demo's clients (10 heavy, then 2 trickle), round-robin, 429s retried",
        "requests_real": len(real), "requests_sim": len(res.ttft), "rejected_429_sim": res.rejected_full,
        "cold_start_s": cold, "drain_s": drain, "step_model": cal["cpu"],
        "step_model_fit": {"points": len(cal["cpu_points"]), "max_rel_err": cal["cpu_max_rel_err"],
                           "median_rel_err": cal["cpu_median_rel_err"]},
        "replicas_mean_abs_error": float(np.abs(sim_ready - real_ready).mean()),
        "replica_seconds_real": float(np.trapezoid(real_ready, real_t)),
        "replica_seconds_sim": float(np.trapezoid(sim_ready, real_t)),
        "ttft_p50_real_s": real_ttft, "ttft_p50_sim_s": sim_ttft, "ttft_p50_ratio": sim_ttft / real_ttft,
        "tpot_p50_real_s": real_tpot, "tpot_p50_sim_s": sim_tpot, "tpot_p50_ratio": sim_tpot / real_tpot,
        "one_daemon_on_the_host": one_pod,
        "timeline": {"t": real_t.round(2).tolist(), "real_ready": real_ready.tolist(),
                     "sim_ready": sim_ready.round(2).tolist()},
    }
    (RESULTS / "autoscale_validation.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("timeline", "step_model")}, indent=1))


if __name__ == "__main__":
    main()
