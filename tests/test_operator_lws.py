"""spec.parallelism (operator/parallelism.py, operator/lws.py): one node or several, the GPUs each pod asks
for, the daemon args, the LeaderWorkerSet against its published v1 API (tests/schemas/leaderworkerset-v1.json)
and its pod templates against Kubernetes' own schemas, the Services selecting leaders only, the CRD's rules
(CEL and the operator's mirror) and the status read from an LWS."""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvpilot.daemon.args import parse_serve_args
from kvpilot.operator import crd, lws, parallelism, resources, routing, workload
from kvpilot.operator.status import get_condition, status_patch
from operator_support import crd_checks as checks

META = {"name": "llm", "namespace": "ml", "uid": "u-1", "generation": 2}
K8S_VERSION = "1.30.0"
LWS_SCHEMA = json.loads((pathlib.Path(__file__).parent / "schemas" / "leaderworkerset-v1.json").read_text())
LEADERS = {"app.kubernetes.io/name": "kvpilot-daemon", "kvpilot.io/inferencedeployment": "llm",
           "leaderworkerset.sigs.k8s.io/worker-index": "0"}
T0 = "2026-01-01T00:00:00Z"


def spec(tensor: int = 1, pipeline: int = 1, per_node: int | None = None, gpus: int = 1, **more: Any) -> dict:
    res: dict[str, Any] = {"gpus": gpus, **({"gpusPerNode": per_node} if per_node else {})}
    return crd.default_spec({"model": {"uri": "hf://org/model"}, "resources": res,
                             "parallelism": {"tensor": tensor, "pipeline": pipeline}, **more})


def two_nodes() -> dict:
    return spec(8, 2, 8)  # 16 ranks, 8 GPUs a node


def containers(obj: dict) -> dict[str, dict]:
    if obj["kind"] == "Deployment":
        return {"replica": obj["spec"]["template"]["spec"]["containers"][0]}
    t = obj["spec"]["leaderWorkerTemplate"]
    return {role: t[f"{role}Template"]["spec"]["containers"][0] for role in ("leader", "worker")}


def serve_config(args: list[str]):
    assert args[0] == "serve"
    return parse_serve_args(args[1:], environ={}).engine_config()


# --- one node or several ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tensor, pipeline, per_node, gpus, nodes, per_pod", [
    (1, 1, None, 1, 1, 1),   # as before parallelism
    (1, 1, None, 2, 1, 2),   # resources.gpus still decides with one rank
    (8, 1, None, 1, 1, 8),   # no node size: all ranks in one pod
    (4, 2, 8, 1, 1, 8),      # fits one node
    (2, 1, 8, 1, 1, 2),
    (8, 2, 8, 1, 2, 8),      # two nodes of 8
    (16, 1, 4, 1, 4, 4),
    (2, 2, 1, 1, 4, 1),
    (2, 1, 1, 0, 2, 0),      # CPU ranks over two pods: no GPU request
    (4, 1, None, 0, 1, 0),
])
def test_nodes_and_gpus_per_pod(tensor, pipeline, per_node, gpus, nodes, per_pod):
    s = spec(tensor, pipeline, per_node, gpus)
    assert crd.validate("llm", s) == []
    assert (parallelism.nodes(s), parallelism.gpus_per_pod(s)) == (nodes, per_pod)
    assert workload.kind_of(s) == ("LeaderWorkerSet" if nodes > 1 else "Deployment")
    obj = workload.render(META, s, 3)
    assert obj["kind"] == workload.kind_of(s)
    for c in containers(obj).values():
        limits = c["resources"]["limits"]
        assert limits.get("nvidia.com/gpu") == (str(per_pod) if per_pod else None)
        assert c["resources"]["requests"] == limits
        assert (limits["cpu"], limits["memory"]) == ("4", "16Gi")  # CPU sizing as before


def test_one_node_renders_both_sizes_and_the_daemon_takes_them():
    s = spec(4, 2, 8)
    c = containers(resources.render_deployment(META, s, 1))["replica"]
    args = c["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert not {"--nnodes", "--node-rank", "--dist-init-addr"} & set(args)  # LWS_* or one node: the daemon's
    cfg = serve_config(args)
    assert (cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.nnodes) == (4, 2, None)
    assert [p["name"] for p in c["ports"]] == ["http"]  # no rendezvous port: the ranks meet inside the pod


def test_one_rank_renders_no_parallel_flag():
    """A spec without parallelism keeps its pod template (no rollout on an operator upgrade)."""
    plain = crd.default_spec({"model": {"uri": "hf://org/model"}})
    assert plain["parallelism"] == {"tensor": 1, "pipeline": 1} and "gpusPerNode" not in plain["resources"]
    args = resources.daemon_args(META, plain)
    assert not [a for a in args if "parallel" in a or "distributed" in a]


def test_extra_args_still_come_last():
    s = spec(2, engine={"extraArgs": ["--tensor-parallel-size", "1"]})
    args = resources.daemon_args(META, s)
    assert args[-2:] == ["--tensor-parallel-size", "1"] and args.index("--tensor-parallel-size") < len(args) - 2


# --- the LeaderWorkerSet ----------------------------------------------------------------------------------

def test_several_nodes_render_a_leader_worker_set():
    s = two_nodes()
    obj = lws.render_leader_worker_set(META, s, 3)
    assert (obj["apiVersion"], obj["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert obj["metadata"]["name"] == "llm" and obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    t = obj["spec"]["leaderWorkerTemplate"]
    assert obj["spec"]["replicas"] == 3  # groups
    assert t["size"] == 2  # 16 ranks / 8 GPUs a node
    assert t["restartPolicy"] == "RecreateGroupOnPodRestart"  # a dead rank takes the group with it
    assert obj["spec"]["startupPolicy"] == "LeaderCreated"  # the leader is Ready only once the workers joined
    assert obj["spec"]["rolloutStrategy"] == {"type": "RollingUpdate",
                                              "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}}
    leader, worker = containers(obj)["leader"], containers(obj)["worker"]
    assert leader["args"] == worker["args"]  # node count, rank and leader address come from LWS_*
    cfg = serve_config(leader["args"])
    assert (cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.nnodes, cfg.node_rank) == (8, 2, None, None)
    assert {"name": "dist", "containerPort": 29500, "protocol": "TCP"} in leader["ports"]
    assert [p["name"] for p in worker["ports"]] == ["http"]
    for c in (leader, worker):  # the workers answer /health and /ready on the same port
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        probes = {k: c[k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
        assert probes == {"startupProbe": "/health", "readinessProbe": "/ready", "livenessProbe": "/health"}
        assert {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")} == \
            {k: resources.probes(s)[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    annotations = {role: t[f"{role}Template"]["metadata"]["annotations"] for role in ("leader", "worker")}
    assert annotations["leader"]["kvpilot.io/metrics-port"] == "8000"
    assert "kvpilot.io/metrics-port" not in annotations["worker"]  # workers have no /metrics
    for role in ("leader", "worker"):
        assert resources.matches_selector(t[f"{role}Template"]["metadata"]["labels"], "llm")


def test_the_leader_worker_set_matches_the_published_v1_api():
    obj = lws.render_leader_worker_set(META, two_nodes(), 2)
    jsonschema.validate(obj, LWS_SCHEMA)
    for role in ("leaderTemplate", "workerTemplate"):  # core/v1 PodTemplateSpecs, as Kubernetes checks them
        template = {"apiVersion": "v1", "kind": "PodTemplate",
                    "metadata": {"name": f"llm-{role.lower()}", "namespace": "ml"},
                    "template": obj["spec"]["leaderWorkerTemplate"][role]}
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)


@pytest.mark.parametrize("mutate", [
    lambda o: o["spec"]["leaderWorkerTemplate"].update(size=0),
    lambda o: o["spec"]["leaderWorkerTemplate"].update(restartPolicy="RecreateGroup"),
    lambda o: o["spec"]["leaderWorkerTemplate"].pop("workerTemplate"),
    lambda o: o["spec"].update(startupPolicy="WorkersFirst"),
    lambda o: o["spec"].update(replicas=-1),
    lambda o: o["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"].update(maxSurge=0),
    lambda o: o["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"].update(maxSurge="150%"),
    lambda o: o["spec"].update(size=2),
    lambda o: o["metadata"].update(name="1llm"),
    lambda o: o.update(apiVersion="leaderworkerset.x-k8s.io/v1alpha1"),
])
def test_the_lws_schema_refuses_what_the_api_refuses(mutate):
    obj = copy.deepcopy(lws.render_leader_worker_set(META, two_nodes(), 2))
    mutate(obj)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, LWS_SCHEMA)


# --- Services select the leaders ---------------------------------------------------------------------------

def test_the_services_select_only_leaders_of_several_nodes():
    s = two_nodes()
    assert resources.render_service(META, s)["spec"]["selector"] == LEADERS
    assert routing.render_daemons_service(META, s)["spec"]["selector"] == LEADERS
    pool = spec(8, 2, 8, router={"enabled": True, "mode": "inferencePool",
                                 "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}})
    assert routing.render_inference_pool(META, pool)["spec"]["selector"]["matchLabels"] == LEADERS
    # One node: every daemon pod serves, as before.
    one = spec(4, 2, 8)
    assert resources.render_service(META, one)["spec"]["selector"] == resources.selector_labels("llm")
    assert routing.render_daemons_service(META, one)["spec"]["selector"] == resources.selector_labels("llm")
    assert resources.matches_selector(LEADERS, "llm", s)
    assert not resources.matches_selector({**LEADERS, "leaderworkerset.sigs.k8s.io/worker-index": "1"}, "llm", s)
    assert resources.matches_selector(resources.selector_labels("llm"), "llm", one)


# --- the CRD: the counts must fill whole nodes ----------------------------------------------------------

def obj(s: dict) -> dict:
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "llm"},
            "spec": s}


@pytest.mark.parametrize("tensor, pipeline, per_node, engine, message", [
    (8, 2, 8, {}, None),
    (4, 1, 8, {}, None),
    (3, 1, 4, {}, None),             # fits one node, even if not a divisor
    (3, 1, 2, {}, parallelism.GPUS_PER_NODE_MESSAGE),
    (12, 1, 8, {}, parallelism.GPUS_PER_NODE_MESSAGE),
    (6, 2, 8, {}, parallelism.GPUS_PER_NODE_MESSAGE),  # 12 ranks cannot fill whole nodes of 8
    (6, 2, 4, {}, None),             # three nodes of 4
    (1, 1, None, {"enableLora": True}, None),
    (2, 1, None, {"enableLora": True}, None),  # adapters follow the tensor split
    (1, 2, None, {"speculative": {"method": "draft_model", "numSpeculativeTokens": 2, "model": "self:2"}},
     parallelism.SPECULATIVE_MESSAGE),
    (2, 1, None, {"speculative": {"method": "ngram", "numSpeculativeTokens": 2}}, None),
])
def test_cel_rules_and_the_operators_mirror_agree(tensor, pipeline, per_node, engine, message):
    s = spec(tensor, pipeline, per_node, engine=engine)
    cel = checks.cel_errors(obj(s), crd.version_schema())
    mirror = crd.rule_errors("llm", s)
    if message is None:
        assert cel == [] and mirror == [] and crd.validate("llm", s) == []
    else:
        assert any(message in m for m in cel), cel
        assert message in mirror


@pytest.mark.parametrize("name, tensor, per_node, ok", [
    ("llm", 2, 1, True), ("llm.v2", 2, 1, False), ("7b", 2, 1, False), ("llm.v2", 2, 2, True), ("7b", 2, None, True),
])
def test_a_multi_node_name_must_suit_a_leader_worker_set(name, tensor, per_node, ok):
    s = spec(tensor, 1, per_node)
    body = {**obj(s), "metadata": {"name": name}}
    cel = checks.cel_errors(body, crd.version_schema())
    mirror = crd.rule_errors(name, s)
    assert (cel == []) == (mirror == []) == ok, (cel, mirror)
    if not ok:
        assert any(parallelism.LWS_NAME_MESSAGE in m for m in cel) and parallelism.LWS_NAME_MESSAGE in mirror


@pytest.mark.parametrize("patch, fragment", [
    ({"parallelism": {"tensor": 0}}, "spec.parallelism.tensor"),
    ({"parallelism": {"pipeline": 65}}, "spec.parallelism.pipeline"),
    ({"parallelism": {"tensor": "8"}}, "spec.parallelism.tensor"),
    ({"resources": {"gpusPerNode": 0}}, "spec.resources.gpusPerNode"),
    ({"parallelism": {"experts": 2}}, "spec.parallelism"),
])
def test_the_schema_refuses_bad_parallelism(patch, fragment):
    s = crd.default_spec({"model": {"uri": "hf://org/m"}, **patch})
    assert any(fragment in e for e in crd.schema_errors(s)), crd.schema_errors(s)
    assert checks.schema_errors(s, crd.spec_schema(), "spec.")


# --- status from the LeaderWorkerSet ---------------------------------------------------------------------

def lws_obj(replicas: int, ready: int, updated: int | None = None, progressing: str = "False") -> dict:
    return {"apiVersion": lws.API_VERSION, "kind": "LeaderWorkerSet", "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": replicas if updated is None else updated,
                       "conditions": [{"type": "Available", "status": "True" if ready else "False"},
                                      {"type": "Progressing", "status": progressing}]}}


def test_status_counts_groups_and_selects_leaders():
    st = status_patch(meta=META, spec=two_nodes(), old=None, deployment=lws_obj(2, 2), now=T0, desired=2,
                      reconciled=True, workload_kind="LeaderWorkerSet")
    assert (st["replicas"], st["readyReplicas"], st["workload"]) == (2, 2, "LeaderWorkerSet")
    ready, progressing = get_condition(st, "Ready"), get_condition(st, "Progressing")
    assert (ready["status"], ready["message"]) == ("True", "2/2 groups ready")
    # An LWS says Progressing False when no group is in progress: complete, not stalled.
    assert (progressing["status"], progressing["reason"]) == ("False", "Complete")
    assert st["selector"] == ",".join(f"{k}={v}" for k, v in sorted(LEADERS.items()))


def test_status_of_groups_still_loading_and_missing():
    st = status_patch(meta=META, spec=two_nodes(), old=None, deployment=lws_obj(2, 0, progressing="True"),
                      now=T0)
    assert get_condition(st, "Ready")["reason"] == "NoReadyPods"
    assert get_condition(st, "Ready")["message"].startswith("0/2 groups ready")
    assert get_condition(st, "Progressing")["reason"] == "RollingOut"
    assert "workload" not in st  # a tick keeps what reconcile wrote
    gone = status_patch(meta=META, spec=two_nodes(), old=None, deployment=None, now=T0)
    assert get_condition(gone, "Ready")["reason"] == "LeaderWorkerSetMissing"


def test_a_missing_lws_crd_is_a_condition():
    error = workload.LWS_ERRORS[404]
    st = status_patch(meta=META, spec=two_nodes(), old=None, deployment=None, now=T0, reconciled=True,
                      workload_error=error)
    for ctype in ("Ready", "Progressing"):
        c = get_condition(st, ctype)
        assert (c["status"], c["reason"]) == ("False", "LeaderWorkerSetCRDMissing")
        assert "install LeaderWorkerSet" in c["message"]
    assert "workload" not in st


# --- the examples ----------------------------------------------------------------------------------------

def example(name: str) -> dict:
    doc = yaml.safe_load((pathlib.Path(__file__).parents[1] / "examples" / name).read_text())
    return crd.default_spec(doc["spec"])


def test_the_two_node_example_is_a_group_of_two_pods_of_eight_gpus():
    s = example("llama-70b-2nodes.yaml")
    assert crd.validate("llama-70b", s) == []
    obj = workload.render({**META, "name": "llama-70b"}, s, 1)
    jsonschema.validate(obj, LWS_SCHEMA)
    assert obj["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert {c["resources"]["limits"]["nvidia.com/gpu"] for c in containers(obj).values()} == {"8"}
    assert serve_config(containers(obj)["leader"]["args"]).distributed_timeout == 600


def test_the_one_node_example_is_one_pod_of_eight_gpus():
    s = example("llama-70b-tp8.yaml")
    assert crd.validate("llama-70b-tp8", s) == []
    obj = workload.render({**META, "name": "llama-70b-tp8"}, s, 1)
    assert obj["kind"] == "Deployment"
    assert containers(obj)["replica"]["resources"]["limits"]["nvidia.com/gpu"] == "8"
