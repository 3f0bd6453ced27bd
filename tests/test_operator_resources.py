"""Table-driven tests of the pure renderers in kvpilot.operator.resources."""

from __future__ import annotations

import copy

import pytest

from kvpilot.daemon.args import parse_serve_args
from kvpilot.operator import crd, resources

META = {"name": "llm", "namespace": "ml", "uid": "u-1"}


def spec(**overrides) -> dict:
    return crd.default_spec({"model": {"uri": "hf://org/model"}, **overrides})


def container(s: dict) -> dict:
    return resources.render_deployment(META, s, 1)["spec"]["template"]["spec"]["containers"][0]


def arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("res, limits", [
    ({"gpus": 1}, {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}),
    ({"gpus": 4, "cpu": 8, "memory": "64Gi"}, {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "4"}),
    ({"gpus": 0}, {"cpu": "4", "memory": "16Gi"}),
    ({"gpus": 2, "gpuResourceName": "amd.com/gpu"}, {"cpu": "4", "memory": "16Gi", "amd.com/gpu": "2"}),
])
def test_gpu_and_compute_limits(res, limits):
    r = container(spec(resources=res))["resources"]
    assert r["limits"] == limits
    assert r["requests"] == limits  # extended resources need requests == limits


@pytest.mark.parametrize("engine, model, expected", [
    ({}, {"uri": "hf://org/model"}, {"--block-size": "16", "--max-num-seqs": "256", "--dtype": "auto",
                                     "--served-model-name": "llm", "--scheduling-policy": "fcfs",
                                     "--max-model-len": None, "--kv-cache-memory": None,
                                     "--long-prefill-token-threshold": None, "--max-num-batched-tokens": "2048",
                                     "--kv-cache-dtype": None, "--gpu-memory-utilization": None,
                                     "--quantization": None}),
    ({"blockSize": 32, "maxNumSeqs": 8, "maxModelLen": 4096, "kvCacheMemory": "20Gi", "dtype": "bfloat16",
      "schedulingPolicy": "priority", "maxQueuedRequests": 100, "longPrefillTokenThreshold": 256,
      "kvCacheDtype": "float16", "gpuMemoryUtilization": 0.8},
     {"uri": "hf://org/model", "name": "chat", "quantization": "fp8"},
     {"--block-size": "32", "--max-num-seqs": "8", "--max-model-len": "4096", "--kv-cache-memory": "20Gi",
      "--dtype": "bfloat16", "--scheduling-policy": "priority", "--served-model-name": "chat",
      "--max-queued-requests": "100", "--long-prefill-token-threshold": "256", "--kv-cache-dtype": "float16",
      "--gpu-memory-utilization": "0.8", "--quantization": "fp8"}),
])
def test_daemon_args(engine, model, expected):
    args = container(spec(engine=engine, model=model))["args"]
    assert args[:2] == ["serve", model["uri"]]
    assert arg(args, "--port") == "8000" and arg(args, "--host") == "0.0.0.0"
    for flag, value in expected.items():
        assert arg(args, flag) == value, flag


@pytest.mark.parametrize("prefix, flag", [(True, "--enable-prefix-caching"), (False, "--no-enable-prefix-caching")])
def test_prefix_caching_flag(prefix, flag):
    args = container(spec(engine={"enablePrefixCaching": prefix}))["args"]
    assert flag in args


@pytest.mark.parametrize("engine, rendered, threshold", [
    ({}, None, 0),                                  # unset: no flag, the daemon's default (0, no cap) applies
    ({"longPrefillTokenThreshold": 0}, "0", 0),     # 0 written out is still written out
    ({"longPrefillTokenThreshold": 256}, "256", 256),
    # extraArgs come after the typed flag, so the daemon's argparse takes theirs (as for maxNumSeqs)
    ({"longPrefillTokenThreshold": 256, "extraArgs": ["--long-prefill-token-threshold", "64"]}, "256", 64),
])
def test_long_prefill_token_threshold_reaches_the_daemon(engine, rendered, threshold):
    """The rendered args as `kvpilot serve` itself parses them."""
    args = container(spec(engine=engine))["args"]
    assert arg(args, "--long-prefill-token-threshold") == rendered
    assert parse_serve_args(args[1:], environ={}).engine_config().long_prefill_token_threshold == threshold


def test_long_prefill_token_threshold_has_no_schema_default():
    assert "longPrefillTokenThreshold" not in spec()["engine"]  # absent stays absent: the daemon decides


def test_extra_args_are_appended_and_api_key_comes_from_a_secret():
    c = container(spec(engine={"extraArgs": ["--seed", "7"]}, apiKeySecret={"name": "k"}))
    assert c["args"][-2:] == ["--seed", "7"]
    assert arg(c["args"], "--api-key") == "$(KVPILOT_API_KEY)"
    env = {e["name"]: e for e in c["env"]}
    assert env["KVPILOT_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "k", "key": "api-key"}


@pytest.mark.parametrize("uri, model_arg, volume", [
    ("hf://org/model", "hf://org/model", None),
    ("builtin://smollm2-135m", "builtin://smollm2-135m", None),
    ("pvc://models/llama/8b", "/models/pvc/llama/8b", "models"),
    ("pvc://weights", "/models/pvc", "weights"),
    ("file:///opt/model", "/opt/model", None),
])
def test_model_source_pvc_vs_emptydir(uri, model_arg, volume):
    s = spec(model={"uri": uri})
    pod = resources.render_deployment(META, s, 1)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["args"][1] == model_arg
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model-cache"]["emptyDir"] == {"sizeLimit": "50Gi"}  # the cache is always an emptyDir
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    if volume is None:
        assert "model" not in vols
    else:
        assert vols["model"]["persistentVolumeClaim"] == {"claimName": volume, "readOnly": True}
        assert mounts["model"] == {"name": "model", "mountPath": "/models/pvc", "readOnly": True}


@pytest.mark.parametrize("startup, grace, failures, shutdown", [
    (1800, 120, 180, "100"),
    (60, 20, 6, "1"),
    (605, 300, 61, "280"),
])
def test_probes_and_draining(startup, grace, failures, shutdown):
    s = spec(startupTimeoutSeconds=startup, terminationGracePeriodSeconds=grace)
    pod = resources.render_deployment(META, s, 1)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= startup
    assert c["startupProbe"]["failureThreshold"] == failures
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] == grace
    assert arg(c["args"], "--shutdown-timeout") == shutdown


def test_labels_owner_refs_and_security():
    s = spec(podLabels={"team": "a", "app.kubernetes.io/name": "hijack"}, nodeSelector={"gpu": "h100"},
             tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}], priorityClassName="high",
             imagePullSecrets=[{"name": "reg"}], env=[{"name": "X", "value": "1"}],
             hfTokenSecret={"name": "hf"}, affinity={"nodeAffinity": {}})
    dep = resources.render_deployment(META, s, 3)
    svc = resources.render_service(META, s)
    pdb = resources.render_pdb(META, 3)
    for obj in (dep, svc, pdb):
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment", "name": "llm", "uid": "u-1",
            "controller": True, "blockOwnerDeletion": True}]
        assert obj["metadata"]["labels"]["kvpilot.io/inferencedeployment"] == "llm"
        assert obj["metadata"]["namespace"] == "ml"
    sel = dep["spec"]["selector"]["matchLabels"]
    tmpl = dep["spec"]["template"]
    assert all(tmpl["metadata"]["labels"][k] == v for k, v in sel.items())  # kvpilot labels win
    assert tmpl["metadata"]["labels"]["team"] == "a"
    assert svc["spec"]["selector"] == sel and pdb["spec"]["selector"]["matchLabels"] == sel
    pod = tmpl["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["priorityClassName"] == "high"
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and pod["imagePullSecrets"] == [{"name": "reg"}]
    assert pod["affinity"] == {"nodeAffinity": {}}
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["X"]["value"] == "1"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert resources.matches_selector(tmpl["metadata"]["labels"], "llm")
    assert not resources.matches_selector({"kvpilot.io/inferencedeployment": "other"}, "llm")


@pytest.mark.parametrize("replicas, has_pdb", [(0, False), (1, False), (2, True), (8, True)])
def test_pdb_only_with_a_replica_to_spare(replicas, has_pdb):
    assert (resources.render_pdb(META, replicas) is not None) == has_pdb


@pytest.mark.parametrize("autoscaling, replicas, live, expected", [
    ({"enabled": False}, 3, None, 3),
    ({"enabled": False}, 3, 7, 3),  # spec.replicas (the scale subresource) drives it
    ({"enabled": True, "minReplicas": 2, "maxReplicas": 6}, 1, None, 2),  # new: starts at min
    ({"enabled": True, "minReplicas": 2, "maxReplicas": 6}, 1, 5, 5),  # the autoscaler's value is kept
    ({"enabled": True, "minReplicas": 2, "maxReplicas": 6}, 1, 9, 6),  # clamped into the new bounds
    ({"enabled": True, "minReplicas": 2, "maxReplicas": 6}, 1, 1, 2),
])
def test_reconcile_never_reverts_the_autoscaler(autoscaling, replicas, live, expected):
    assert resources.reconcile_replicas(spec(autoscaling=autoscaling, replicas=replicas), live) == expected


def test_rendering_is_pure_and_deterministic():
    s = spec(engine={"extraArgs": ["--a"]})
    before = copy.deepcopy(s)
    assert resources.render_deployment(META, s, 2) == resources.render_deployment(META, s, 2)
    assert s == before
    svc = resources.render_service(META, spec(service={"type": "LoadBalancer", "port": 80,
                                                       "annotations": {"x": "y"}}))
    assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["ports"][0]["port"] == 80
    assert svc["spec"]["ports"][0]["targetPort"] == "http" and svc["metadata"]["annotations"] == {"x": "y"}
    assert resources.service_url(META, s) == "http://llm.ml.svc:8000/v1"
