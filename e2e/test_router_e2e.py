"""Routing across replicas, asserted on one recorded run of the router scenario (router_scenario.py):

1. the operator deploys the router (real `python -m kvpilot.router` processes) and the daemons' headless
   Service; the router finds the daemons through its EndpointSlices;
2. scale to zero when idle, then requests at zero: held by the router, the operator sees held > 0 and scales
   0 -> 1, every request completes (none lost), the first one's cold-start latency is recorded;
3. a SIGKILL of the daemon mid-stream ends the stream with an SSE error event (or it completes), never a
   silent truncation;
4. the load stops: back to zero after the idle period, the last pod drained.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from . import netns
from .cluster import condition
from .lifecycle import pod_log_records
from .router_scenario import READY_ENDPOINTS, STREAM_ERRORS, Config, Report, cluster_limit, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
COMPLETE = ("length", "stop")  # max_tokens reached, or the model's end of text


@pytest.fixture(scope="module")
def router_run(tmp_path_factory: pytest.TempPathFactory) -> Report:
    why = cluster_limit()
    if why is not None:
        pytest.skip(why)
    workdir = Path(os.environ.get("KVPILOT_E2E_ROUTER_WORKDIR") or tmp_path_factory.mktemp("e2e-router"))
    rep = asyncio.run(run(Config(workdir=workdir)))
    from .monitor import plot_from_zero, plot_run

    plot_run(plot_from_zero, rep.monitor, workdir / "from-zero.png", rep.t0, rep.marks,
             "kvpilot e2e: scale from zero behind the router")
    print(f"\nrouter e2e run: {rep.wall_s:.0f}s, workdir {workdir}, phases {rep.done}, errors {list(rep.errors)}")
    return rep


def _args(dep: dict) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_1_router_deployed_and_finds_daemons_through_endpointslices(router_run: Report) -> None:
    r = router_run
    r.need("deploy")
    name = r.config.name
    dep = r.router_deployment
    ctr = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["spec"]["replicas"] == 2 and ctr["command"] == ["python", "-m", "kvpilot.router"]
    args = _args(dep)
    assert args[args.index("--service") + 1] == f"{name}-daemons" and "--hold-timeout" in args
    assert r.daemons_service["spec"]["clusterIP"] == "None"

    # The router pods carry the e2e node's toleration and nodeSelector (spec.router's own), so they land there.
    pod_spec = dep["spec"]["template"]["spec"]
    assert pod_spec["tolerations"] == [r.agent.node.toleration()] and r.agent.node.tainted
    assert pod_spec["nodeSelector"] == r.agent.node.selector()

    # Each router pod is a real router process on its own address (in its own network namespace where the
    # machine allows), with its pod's API credentials.
    assert len(r.router_pods) == 2
    for pod in r.router_pods:
        c = r.agent.containers[pod]
        assert "kvpilot.router" in c.argv and netns.is_pod_address(c.ip, r.pod_network), (c.ip, r.pod_network)
        assert Path(c.env["KUBECONFIG"]).is_file()
        logs = pod_log_records(r.config.workdir, pod)
        listening = [x for x in logs if x.get("msg") == "listening"]
        assert listening and listening[0]["host"] == c.ip and listening[0]["port"] == 8000
        # Its discovery saw the first daemon appear: the slices the agent wrote, read by the router's watch.
        seen = [x for x in logs if x.get("msg") == "endpoints" and r.first_daemon in x.get("ready", [])]
        assert seen, f"router {pod} never listed {r.first_daemon} as ready"

    daemon = r.agent.containers[r.first_daemon]
    [s] = r.daemons_slices
    [ep] = [e for e in s["endpoints"] if e["conditions"]["ready"]]
    assert ep["addresses"] == [daemon.ip] and ep["targetRef"]["name"] == r.first_daemon
    assert s["ports"] == [{"name": "http", "port": 8000, "protocol": "TCP"}]


def test_2_idle_scales_to_zero_and_a_held_request_wakes_it(router_run: Report) -> None:
    r = router_run
    r.need("to-zero", "from-zero")
    mon, marks, cfg = r.monitor, r.marks, r.config
    # the operator counts idleness from its first scrape of the Ready pod; the harness marks "model loaded"
    # when its own poll (every 0.25 s, plus the list call) sees the pod Ready, so its mark may come late by
    # up to about that much, never early (measured once: 3.82 s for a 4 s setting)
    assert marks["scaled to 0"] - marks["model loaded"] >= cfg.scale_to_zero_after - 0.5
    downs = mon.events_with("ScaledDown")
    assert downs and downs[0].message.startswith("ScaleToZero: replicas 1 -> 0"), [e.message for e in downs]

    # At the send there was no daemon at all: nothing but the router could take the request.
    t_send, first = marks["first request sent"], r.first
    last = [s for s in mon.samples if s.t <= t_send][-1]
    assert last.replicas == 0 and not last.pods, last
    assert len(r.gauges_at_send) == 2 and all(g[READY_ENDPOINTS] == 0 for g in r.gauges_at_send.values())
    # The router held it, and the operator scaled 0 -> 1 on the held count.
    assert first.first_token is not None, f"the first request got no token: {first.outcome}"
    held = [s.held or 0 for s in mon.between(t_send, first.first_token)]
    assert held and max(held) >= 1, f"the routers' held gauge never rose: {held}"
    ups = [e for e in mon.events_with("ScaledUp") if e.t >= t_send]
    assert ups and ups[0].message.startswith("Activate: replicas 0 -> 1"), [e.message for e in ups]
    assert int(re.search(r"held=(\d+)", ups[0].message).group(1)) >= 1
    woke = mon.first(lambda s: (s.replicas or 0) >= 1, after=t_send)
    ready = mon.first(lambda s: s.ready >= 1, after=t_send)
    assert woke and ready and t_send < woke.t <= ready.t <= first.first_token + 1

    # Every request completed, first try: held, not refused; the stream to its end.
    assert first.outcome == "completed" and first.finish_reason in COMPLETE and first.chunks >= 1, first
    recs = r.records("from-zero")
    assert len(recs) == cfg.burst - 1
    assert all(x.ok and len(x.attempts) == 1 and x.finish_reason in COMPLETE for x in recs), \
        [(x.lost, [a.outcome for a in x.attempts]) for x in recs]
    assert all(x.completion_tokens == x.job.max_tokens for x in recs if x.finish_reason == "length")
    lost = [x for x in r.load.records if not x.ok]
    assert not lost
    print(f"\nscale from zero: first token {first.first_token - t_send:.1f}s after the send "
          f"(0 -> 1 at +{woke.t - t_send:.1f}s, pod Ready at +{ready.t - t_send:.1f}s), "
          f"{len(recs) + 1} requests, 0 lost")


def test_3_daemon_killed_mid_stream_ends_with_an_sse_error_event(router_run: Report) -> None:
    r = router_run
    if not r.config.kill:
        pytest.skip("this run did not kill a daemon")
    r.need("mid-stream-kill")
    rec = r.kill_stream
    assert rec.chunks >= r.config.kill_after_chunks and rec.first_token < r.marks["SIGKILL mid-stream"]
    assert rec.outcome in ("error-event", "completed"), f"the stream ended as {rec.outcome!r}: {rec}"
    if rec.outcome == "error-event":
        assert rec.error["code"] == "replica_failed", rec.error
        assert sum(g.get(STREAM_ERRORS, 0) for g in r.router_gauges.values()) >= 1, r.router_gauges
    else:
        assert rec.finish_reason in COMPLETE
    crashed = r.agent.events_of(r.killed_pod, "crashed")
    assert crashed and crashed[0].detail["exit_code"] == -9
    print(f"\nmid-stream SIGKILL: stream ended as {rec.outcome} after {rec.chunks} chunks")


def test_4_load_stops_back_to_zero_after_the_idle_period(router_run: Report) -> None:
    r = router_run
    r.need("back-to-zero")
    marks, cfg = r.marks, r.config
    assert marks["scaled to 0 again"] - marks["load stops"] >= cfg.scale_to_zero_after - 0.5
    downs = [e for e in r.monitor.events_with("ScaledDown") if e.t >= marks["load stops"]]
    assert downs and downs[0].message.startswith("ScaleToZero: replicas 1 -> 0"), [e.message for e in downs]
    # The last pod went through graceful deletion and drained cleanly.
    steps = [e.what for e in r.agent.events_of(r.last_pod)]
    assert steps[-5:] == ["terminating", "prestop", "sigterm", "exited", "removed"], steps
    assert r.agent.containers[r.last_pod].exit_code == 0
    st = r.final_cr["status"]
    assert st["replicas"] == 0 and st["desiredReplicas"] == 0, st
    assert condition(r.final_cr, "Ready")["reason"] == "ScaledToZero"
    # Both routers answer and know of no daemon any more: the next request is held again.
    assert len(r.gauges_at_zero) == 2 and all(g[READY_ENDPOINTS] == 0 for g in r.gauges_at_zero.values())
    print(f"\nrouter scenario: {r.wall_s:.0f}s wall; marks "
          + ", ".join(f"{k} +{v - r.t0:.1f}s" for k, v in sorted(r.marks.items(), key=lambda kv: kv[1])))
