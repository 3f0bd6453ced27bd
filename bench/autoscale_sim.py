"""Autoscaling at fleet scale: every trace x every policy in the calibrated simulator (bench/autoscale_fleet.py).

    .venv/bin/python bench/autoscale_sim.py [--short] [--traces a,b] [--policies a,b] [--routing kvpilot|least|rr]

Writes bench/results/autoscale_results.json (metrics, the traces' seeds and settings, timelines),
autoscale_<trace>.png (replicas and queue over time for every policy) and autoscale_results.md (the table
bench/README.md quotes). The H200/Llama-8B calibration is used; `bench/autoscale_validate.py` checks the CPU one
against the demo's real run. Requests are routed by kvpilot's router picker (router/picker.py) by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autoscale_fleet import ReplicaSpec, Result, SimConfig, simulate  # noqa: E402
from autoscale_peers import Hpa, Kpa, Kvpilot, Policy, Wva  # noqa: E402
from autoscale_stepmodel import H200_KV_BLOCKS_LLAMA8B, h200  # noqa: E402
from autoscale_traces import Trace, standard  # noqa: E402

from kvpilot.operator import autoscaler, crd  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("kvpilot", "hpa_waiting", "hpa_running", "kpa", "wva")


@dataclass(frozen=True)
class Slo:
    ttft_p99: float = 2.0
    tpot_p99: float = 0.1
    window: float = 60.0  # attainment: the share of windows whose requests meet both p99 targets


def gpu_replica() -> ReplicaSpec:
    return ReplicaSpec(step=h200(), kv_blocks=H200_KV_BLOCKS_LLAMA8B, block_size=16, max_batch=256,
                       max_batched_tokens=8192)


def kvpilot_policy(min_replicas: int, max_replicas: int, max_num_seqs: int) -> autoscaler.Policy:
    """The shipped defaults, as the CRD defaults them, with the trace's bounds; max_num_seqs as
    operator/tick.py passes it (the daemons' --max-num-seqs)."""
    a = dict(crd.default_spec({"model": {"uri": "x"}})["autoscaling"])
    a.update(minReplicas=min_replicas, maxReplicas=max_replicas)
    return autoscaler.Policy.from_spec(a, max_num_seqs=max_num_seqs)


def make_policy(name: str, spec: ReplicaSpec, min_replicas: int, max_replicas: int) -> Policy:
    interval = float(crd.default_spec({"model": {"uri": "x"}})["autoscaling"]["metricsIntervalSeconds"])
    bounds = {"min_replicas": min_replicas, "max_replicas": max_replicas}
    if name == "kvpilot":
        return Kvpilot(kvpilot_policy(min_replicas, max_replicas, spec.max_batch), interval=interval)
    if name == "hpa_waiting":  # KEDA on vllm:num_requests_waiting, the same 4 a pod kvpilot targets
        return Hpa(target=4.0, metric="waiting", name=name, **bounds)
    if name == "hpa_running":  # running requests at 70% of the batch slots
        return Hpa(target=0.7 * spec.max_batch, metric="running", name=name, **bounds)
    if name == "kpa":  # concurrency (running + waiting) at 70% of the batch slots
        return Kpa(target=0.7 * spec.max_batch, **bounds)
    if name == "wva":  # llm-d's WVA does not scale to zero: at least one replica
        return Wva(min_replicas=max(1, min_replicas), max_replicas=max_replicas)
    raise ValueError(name)


def window_attainment(res: Result, slo: Slo, duration: float) -> float:
    """Share of the trace's windows (with arrivals) whose requests met TTFT p99 and TPOT p99; a rejected
    request or one still held at the end counts as an infinite TTFT."""
    edges = np.arange(0.0, duration + slo.window, slo.window)
    ttft = np.concatenate([res.ttft, np.full(len(res.rejected_t), np.inf)])
    t = np.concatenate([res.t_arr, res.rejected_t])
    tpot = np.concatenate([res.tpot, np.zeros(len(res.rejected_t))])
    idx = np.digitize(t, edges) - 1
    met = total = 0
    for i in np.unique(idx):
        sel = idx == i
        total += 1
        ok = np.quantile(ttft[sel], 0.99, method="higher") <= slo.ttft_p99
        ok &= np.quantile(tpot[sel], 0.99, method="higher") <= slo.tpot_p99
        met += int(ok)
    return met / total if total else 1.0


def summarize(res: Result, slo: Slo, duration: float) -> dict[str, Any]:
    def pct(x: np.ndarray, q: float) -> float | None:
        return float(np.quantile(x, q)) if len(x) else None

    good = ((res.ttft <= slo.ttft_p99) & (res.tpot <= slo.tpot_p99)).sum() * res.weight
    return {
        "trace": res.trace, "policy": res.policy,
        "ttft_p50": pct(res.ttft, 0.5), "ttft_p99": pct(res.ttft, 0.99),
        "tpot_p50": pct(res.tpot, 0.5), "tpot_p99": pct(res.tpot, 0.99),
        "slo_attainment": window_attainment(res, slo, duration),
        "requests_meeting_slo": float(good / max(res.arrived, 1)),
        "replica_hours": res.replica_seconds / 3600.0,
        "scale_events": res.scale_events, "direction_changes": res.direction_changes,
        "arrived": res.arrived, "finished": int(len(res.ttft) * res.weight),
        "rejected": int(len(res.rejected_t) * res.weight), "held_at_end": res.held_end,
        "preempted": res.preempted, "retried": res.retried,
    }


def run_trace(trace: Trace, policies: list[str], cfg: SimConfig, slo: Slo) -> list[tuple[dict[str, Any], Result]]:
    out = []
    for name in policies:
        policy = make_policy(name, cfg.replica, trace.min_replicas, cfg.max_replicas)
        t0 = time.perf_counter()
        res = simulate(cfg, trace, policy)
        row = summarize(res, slo, trace.duration)
        row["sim_wall_s"] = time.perf_counter() - t0
        out.append((row, res))
        print(f"{trace.name:13s} {name:12s} slo {row['slo_attainment']:.3f} rh {row['replica_hours']:8.1f} "
              f"ttft99 {row['ttft_p99'] or 0:7.2f} tpot99 {row['tpot_p99'] or 0:.3f} "
              f"ev {row['scale_events']:4d} flips {row['direction_changes']:3d} rej {row['rejected']} "
              f"({row['sim_wall_s']:.1f}s)", flush=True)
    return out


def plot(trace: Trace, results: list[Result], path: Path, one_replica_rate: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    bins = np.arange(0.0, trace.duration + 60, 60.0)
    demand = np.histogram(trace.t, bins)[0] * trace.weight / 60.0 / one_replica_rate
    a.step(bins[:-1] / 60, demand, where="post", color="black", ls="--", lw=1, label="load (replicas' worth)")
    for r in results:
        tl = r.timeline
        a.plot(np.array(tl["t"]) / 60, tl["replicas"], lw=1.2, label=r.policy)
        b.plot(np.array(tl["t"]) / 60, tl["queue"], lw=1.2, label=r.policy)
    a.set_ylabel("replicas (incl. starting)")
    b.set_ylabel("queued + held requests")
    b.set_xlabel("minutes")
    b.set_yscale("symlog")
    a.legend(fontsize=8, ncol=3)
    a.set_title(f"{trace.name}: {trace.description}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| trace | policy | SLO att. | TTFT p50 / p99 s | TPOT p50 / p99 ms | replica-h | scale events "
             "| flips | rejected / held |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [
            f"| {r['trace']} | {r['policy']} | {r['slo_attainment']:.3f} | {r['ttft_p50'] or 0:.2f} / "
            f"{r['ttft_p99'] or 0:.2f} | {1000 * (r['tpot_p50'] or 0):.0f} / {1000 * (r['tpot_p99'] or 0):.0f} "
            f"| {r['replica_hours']:.1f} | {r['scale_events']} | {r['direction_changes']} "
            f"| {r['rejected']} / {r['held_at_end']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="traces cut to a quarter (a quick look)")
    ap.add_argument("--traces", default="", help="comma-separated trace names (default all)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--routing", default="kvpilot", choices=["rr", "least", "kvpilot"],
                    help="the router: kvpilot's picker (router/picker.py), least loaded or round-robin")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tpot-slo", type=float, default=0.1)
    ap.add_argument("--out", default="autoscale_results")
    args = ap.parse_args()
    spec = gpu_replica()
    slo = Slo(args.ttft_slo, args.tpot_slo)
    traces = standard(spec.step, spec.max_batch, spec.kv_tokens, seed=args.seed, short=args.short)
    if args.traces:
        traces = [t for t in traces if t.name in args.traces.split(",")]
    from autoscale_traces import replica_rate
    one = replica_rate(spec.step, 600 * 1.377, 200 * 1.278, spec.max_batch, spec.kv_tokens)
    report: dict[str, Any] = {"replica": {**asdict(spec), "kv_tokens": spec.kv_tokens}, "slo": asdict(slo),
                              "routing": args.routing, "one_replica_rate_rps": one, "traces": {}, "rows": []}
    for trace in traces:
        peak = float(np.histogram(trace.t, np.arange(0, trace.duration + 60, 60))[0].max()) * trace.weight / 60
        cfg = SimConfig(replica=spec, routing=args.routing, max_replicas=int(2.5 * peak / one) + 10,
                        initial_replicas=max(1, trace.min_replicas, int(round(
                            (np.searchsorted(trace.t, 60.0) * trace.weight / 60.0) / one))), seed=args.seed)
        t0 = time.perf_counter()
        out = run_trace(trace, args.policies.split(","), cfg, slo)
        report["traces"][trace.name] = {
            "description": trace.description, "seed": trace.seed, "weight": trace.weight,
            "requests": trace.requests, "duration_s": trace.duration, "min_replicas": trace.min_replicas,
            "max_replicas": cfg.max_replicas, "initial_replicas": cfg.initial_replicas,
            "wall_s": time.perf_counter() - t0,
            "timelines": {res.policy: res.timeline for _, res in out}}
        report["rows"] += [row for row, _ in out]
        plot(trace, [res for _, res in out], RESULTS / f"autoscale_{trace.name}.png", one)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=1))
    (RESULTS / f"{args.out}.md").write_text(markdown(report["rows"]))
    print(markdown(report["rows"]))


if __name__ == "__main__":
    main()
