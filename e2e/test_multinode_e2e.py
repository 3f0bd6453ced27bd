"""A replica spanning two nodes (a LeaderWorkerSet group), asserted on one recorded run of the multi-node
scenario (multinode_scenario.py):

1. `parallelism: {tensor: 1, pipeline: 2}` over `gpusPerNode: 1` is a LeaderWorkerSet of size 2, not a
   Deployment; its leader and worker pods carry the LWS labels and environment, run as two `kvpilot serve`
   processes on distinct addresses, and only the leader is behind the Service;
2. through the Service the group gives the offline engine's greedy answers (one process, one rank);
3. the worker's container dies: the whole group is recreated (new pods, new processes, the old ones gone),
   Ready again; the requests sent while it was down (and one sent at the kill, which the old leader answers
   503) complete on it with the same answers, a stream sent meanwhile too (it starts only on the new group);
4. the LWS status and its scale subresource say one group, ready, before and after; the CR goes down with the
   group and comes back Ready;
5. `parallelism: {tensor: 2}` within `gpusPerNode: 2` is a plain Deployment whose one pod runs both ranks,
   with the same answers.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from .cluster import condition
from .leaderworkerset import GROUP_INDEX_LABEL, GROUP_KEY_LABEL, NAME_LABEL, WORKER_INDEX_LABEL, hpa_selector
from .load import is_correct
from .multinode_scenario import Config, Report, cluster_limit, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def mn_run(tmp_path_factory: pytest.TempPathFactory) -> Report:
    why = cluster_limit()
    if why is not None:
        pytest.skip(why)
    workdir = Path(os.environ.get("KVPILOT_E2E_MULTINODE_WORKDIR") or tmp_path_factory.mktemp("e2e-multinode"))
    rep = asyncio.run(run(Config(workdir=workdir)))
    print(f"\nmulti-node e2e run: {rep.wall_s:.0f}s, workdir {workdir}, phases {rep.done}, errors {list(rep.errors)}")
    return rep


def _env(container: object) -> dict[str, str]:
    return container.env  # type: ignore[attr-defined]


def test_1_two_nodes_are_a_leaderworkerset_group(mn_run: Report) -> None:
    r = mn_run
    r.need("deploy")
    name = r.config.name
    assert r.deployment is None, "a multi-node replica must not also run as a Deployment"
    lwt = r.lws["spec"]["leaderWorkerTemplate"]
    assert r.lws["kind"] == "LeaderWorkerSet" and r.lws["spec"]["replicas"] == 1
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = f"{name}-0", f"{name}-0-1"
    assert set(r.group_pods) == {leader, worker}
    for pod, index in ((leader, "0"), (worker, "1")):
        labels = r.group_pods[pod]["metadata"]["labels"]
        assert labels[NAME_LABEL] == name and labels[GROUP_INDEX_LABEL] == "0"
        assert labels[WORKER_INDEX_LABEL] == index and labels[GROUP_KEY_LABEL]
    assert r.group_pods[leader]["metadata"]["labels"][GROUP_KEY_LABEL] == \
        r.group_pods[worker]["metadata"]["labels"][GROUP_KEY_LABEL]
    # Two real daemons on two addresses: the worker found the leader by LWS_LEADER_ADDRESS.
    lc, wc = r.agent.containers[leader], r.agent.containers[worker]
    assert lc.ip != wc.ip
    assert _env(wc)["LWS_LEADER_ADDRESS"] == _env(lc)["LWS_LEADER_ADDRESS"] == lc.ip
    assert (_env(lc)["LWS_GROUP_SIZE"], _env(wc)["LWS_GROUP_SIZE"]) == ("2", "2")
    assert (_env(lc)["LWS_WORKER_INDEX"], _env(wc)["LWS_WORKER_INDEX"]) == ("0", "1")
    for c in (lc, wc):
        a = c.argv
        assert a[a.index("--pipeline-parallel-size") + 1] == "2" and a[a.index("--tensor-parallel-size") + 1] == "1"
    # The Service fronts the leaders only: the worker answers /health and /ready, not the API.
    assert r.service["spec"]["selector"][WORKER_INDEX_LABEL] == "0"
    assert r.service_endpoints == [leader]


def test_2_the_group_answers_as_one_process(mn_run: Report) -> None:
    r = mn_run
    r.need("parity")
    recs = r.records("parity")
    assert len(recs) == r.config.parity_requests
    assert all(x.ok and x.pod == f"{r.config.name}-0" for x in recs), [(x.lost, x.attempts) for x in recs]
    wrong = [(x.job.key, x.text, r.expected[x.job.key]["text"]) for x in recs if not is_correct(x, r.expected)]
    assert not wrong, wrong


def test_3_a_dead_worker_recreates_the_group_and_loses_no_request(mn_run: Report) -> None:
    r = mn_run
    r.need("kill-worker")
    name = r.config.name
    assert r.killed_pod == f"{name}-0-1"
    assert [(g, why) for lws, g, why in r.recreated if lws == name] == [(0, f"pod {r.killed_pod} restarted")]
    # Same names (the StatefulSets' identities), new pods and new processes; the old ones are gone.
    assert set(r.new_uids) == set(r.killed_uids) == {f"{name}-0", r.killed_pod}
    assert all(r.new_uids[n] != r.killed_uids[n] for n in r.new_uids)
    assert all(r.new_pids[n] != r.killed_pids[n] for n in r.new_pids)
    assert r.old_alive == []
    assert r.agent.events_of(f"{name}-0", "terminating"), "the healthy leader must go with its group"
    # Sent while the Service had no endpoint; answered by the new group, correctly.
    down = r.records("while-down")
    assert len(down) == r.config.while_down - 1
    assert all(x.start >= r.marks["group down"] for x in down)
    new_leader_ready = max(e.t for e in r.agent.events_of(f"{name}-0", "ready"))  # the agent's probe saw it
    assert new_leader_ready > r.marks["group down"]
    assert all(x.ok and x.served.start >= new_leader_ready for x in down), [(x.lost, x.attempts) for x in down]
    assert all(is_correct(x, r.expected) for x in down), [(x.job.key, x.text) for x in down]
    # A stream is never retried: it completes because it had not started before the group was back.
    (stream,) = r.streams("while-down")
    want = r.expected[stream.job.key]
    assert stream.start >= new_leader_ready and stream.outcome == "completed", stream
    assert (stream.text, stream.finish_reason) == (want["text"], want["finish_reason"])
    # Sent at the kill, to the leader whose peer is gone: retried (a 503 or a refused connection before
    # the first byte) until the new group answers it.
    (at_kill,) = r.records("at-kill")
    assert at_kill.ok and is_correct(at_kill, r.expected), (at_kill.lost, at_kill.attempts)
    assert at_kill.served.start >= new_leader_ready
    after = r.records("after")
    assert len(after) == 1 and after[0].ok and is_correct(after[0], r.expected)


def test_4_lws_status_and_scale_say_one_ready_group(mn_run: Report) -> None:
    r = mn_run
    r.need("kill-worker")
    # The operator reads the group count from the LWS: the CR was Ready, went down with the group, came back.
    for cr in (r.cr_ready, r.cr_after):
        assert cr["status"]["readyReplicas"] == 1 and condition(cr, "Ready")["status"] == "True", cr["status"]
    down = [s for s in r.monitor.samples if r.marks["group down"] < s.t < r.marks["group back"]]
    assert any(s.cr_ready == 0 for s in down), "the CR never showed the group down"
    for st, scale in ((r.lws_status, r.scale), (r.lws_status_after, r.scale_after)):
        assert st["replicas"] == st["readyReplicas"] == 1, st
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1 and scale["status"]["replicas"] == 1
        assert scale["status"]["selector"] == hpa_selector(r.config.name)


def test_5_tensor_two_on_one_node_is_a_deployment(mn_run: Report) -> None:
    r = mn_run
    r.need("tensor-one-node")
    assert r.tp_lws is None
    ctr = r.tp_deployment["spec"]["template"]["spec"]["containers"][0]
    a = ctr["args"]
    assert a[a.index("--tensor-parallel-size") + 1] == "2" and a[a.index("--pipeline-parallel-size") + 1] == "1"
    c = r.agent.containers[r.tp_pod]
    assert "LWS_GROUP_SIZE" not in c.env and "--tensor-parallel-size" in c.argv
    recs = r.records("tensor-one-node")
    assert recs and all(x.ok and is_correct(x, r.expected) for x in recs), [(x.job.key, x.text, x.lost) for x in recs]
    assert r.leftover_pids == []
