"""Pure functions: an InferenceDeployment (defaulted spec + metadata) -> the manifests of its children.

Nothing here talks to the API; the same input always renders the same output, which makes reconcile idempotent.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvpilot.operator import lora_sources, parallelism
from kvpilot.operator.lora_sources import NO_SOURCES, Sources
from kvpilot.operator.names import GROUP, KIND, VERSION

DAEMON_PORT = 8000
DIST_PORT = 29500  # where rank 0 (the leader of a multi-node replica) listens for the others' rendezvous
CACHE_DIR = "/cache"
PVC_MOUNT = "/models/pvc"
PRESTOP_SLEEP_SECONDS = 5  # lets endpoints drop the pod before SIGTERM starts the drain
DRAIN_MARGIN_SECONDS = 15  # SIGKILL comes this long after the daemon's own drain deadline
STARTUP_PROBE_PERIOD = 10
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
OWNER_LABEL = "kvpilot.io/inferencedeployment"
DAEMON_APP = "kvpilot-daemon"
ROUTER_APP = "kvpilot-router"
MANAGER = "kvpilot-operator"
# Set by the LeaderWorkerSet controller on every pod of a group; "0" is the leader, the only pod with the API.
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def selector_labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: DAEMON_APP, OWNER_LABEL: name}


def router_selector_labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: ROUTER_APP, OWNER_LABEL: name}


def builtin_router(spec: dict[str, Any]) -> bool:
    router = spec.get("router") or {}
    return bool(router.get("enabled")) and router.get("mode", "builtin") == "builtin"


def serving_selector_labels(name: str, spec: dict[str, Any]) -> dict[str, str]:
    """The pods that serve the OpenAI API: all daemon pods, or only the group leaders when each replica
    spans several nodes (the workers answer /health and /ready only)."""
    if parallelism.multi_node(spec):
        return {**selector_labels(name), WORKER_INDEX_LABEL: "0"}
    return selector_labels(name)


def labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), INSTANCE_LABEL: name, MANAGED_BY_LABEL: MANAGER,
            "app.kubernetes.io/component": "model-server"}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def serving_selector_string(name: str, spec: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(serving_selector_labels(name, spec).items()))


def matches_selector(pod_labels: dict[str, str] | None, name: str, spec: dict[str, Any] | None = None) -> bool:
    """Whether a pod is one of the CR's daemons; given the spec, one that serves the API (a group leader)."""
    pod_labels = pod_labels or {}
    wanted = selector_labels(name) if spec is None else serving_selector_labels(name, spec)
    return all(pod_labels.get(k) == v for k, v in wanted.items())


def owner_reference(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": meta["name"],
        "namespace": meta["namespace"],
        "labels": labels(meta["name"]),
        "ownerReferences": [owner_reference(meta)],
    }


def served_model_name(meta: dict[str, Any], spec: dict[str, Any]) -> str:
    return spec["model"].get("name") or meta["name"]


def parse_model_uri(uri: str) -> tuple[str, str]:
    """'pvc://claim/sub/dir' -> ('pvc', 'claim/sub/dir'); the scheme is validated by the CRD."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        raise ValueError(f"model uri without a scheme: {uri!r}")
    return scheme, rest


def model_argument(uri: str) -> str:
    """The MODEL argument of `kvpilot serve` for a model uri, as seen inside the pod."""
    scheme, rest = parse_model_uri(uri)
    if scheme == "pvc":
        _claim, _, path = rest.partition("/")
        return f"{PVC_MOUNT}/{path}".rstrip("/")
    if scheme == "file":
        return rest
    return uri  # hf:// and builtin:// are resolved by the daemon's loader


def shutdown_timeout(spec: dict[str, Any]) -> int:
    return max(1, spec["terminationGracePeriodSeconds"] - PRESTOP_SLEEP_SECONDS - DRAIN_MARGIN_SECONDS)


def daemon_args(meta: dict[str, Any], spec: dict[str, Any], lora: Sources = NO_SOURCES) -> list[str]:
    """`lora` is what the base's LoRAAdapters need (lora_sources.py); the flags come with engine.enableLora."""
    e = spec["engine"]
    args = [
        "serve", model_argument(spec["model"]["uri"]),
        "--host", "0.0.0.0",
        "--port", str(DAEMON_PORT),
        "--served-model-name", served_model_name(meta, spec),
        "--block-size", str(e["blockSize"]),
        "--max-num-seqs", str(e["maxNumSeqs"]),
        "--max-num-batched-tokens", str(e["maxNumBatchedTokens"]),
        "--dtype", e["dtype"],
        "--enable-prefix-caching" if e["enablePrefixCaching"] else "--no-enable-prefix-caching",
        "--scheduling-policy", e["schedulingPolicy"],
        "--shutdown-timeout", str(shutdown_timeout(spec)),
    ]
    if spec["model"].get("quantization"):  # omitted: the daemon runs the weights as the checkpoint stores them
        args += ["--quantization", spec["model"]["quantization"]]
    if e.get("maxModelLen"):
        args += ["--max-model-len", str(e["maxModelLen"])]
    if e.get("longPrefillTokenThreshold") is not None:  # 0 (no cap) is a value the user may write
        args += ["--long-prefill-token-threshold", str(e["longPrefillTokenThreshold"])]
    if e.get("kvCacheDtype"):
        args += ["--kv-cache-dtype", e["kvCacheDtype"]]
    if e.get("kvCacheMemory"):
        args += ["--kv-cache-memory", e["kvCacheMemory"]]
    if e.get("gpuMemoryUtilization") is not None:
        args += ["--gpu-memory-utilization", str(e["gpuMemoryUtilization"])]
    if e.get("maxQueuedRequests"):
        args += ["--max-queued-requests", str(e["maxQueuedRequests"])]
    if e.get("distributedTimeout") is not None:
        args += ["--distributed-timeout", str(e["distributedTimeout"])]
    if parallelism.world_size(spec) > 1:
        # Only the sizes: in a LeaderWorkerSet pod the daemon reads its node count, rank and the leader's
        # address from LWS_*, so leader and workers run the same args. One rank renders nothing (no rollout).
        args += ["--tensor-parallel-size", str(parallelism.tensor(spec)),
                 "--pipeline-parallel-size", str(parallelism.pipeline(spec))]
    if e.get("speculative"):
        args += ["--speculative-config", speculative_config_json(e["speculative"])]
    if spec.get("apiKeySecret"):
        args += ["--api-key", "$(KVPILOT_API_KEY)"]  # expanded by the kubelet, never stored in the spec
    args += lora_sources.daemon_args(e, lora)
    return args + list(e.get("extraArgs", []))


# spec.engine.speculative's camelCase keys -> the JSON keys of the daemon's --speculative-config (vLLM's)
SPECULATIVE_KEYS = {"method": "method", "numSpeculativeTokens": "num_speculative_tokens",
                    "promptLookupMin": "prompt_lookup_min", "promptLookupMax": "prompt_lookup_max",
                    "model": "model", "disableByBatchSize": "disable_by_batch_size"}


def speculative_config_json(speculative: dict[str, Any]) -> str:
    """spec.engine.speculative as the daemon's --speculative-config value (the fields that are set)."""
    return json.dumps({SPECULATIVE_KEYS[k]: v for k, v in speculative.items() if k in SPECULATIVE_KEYS},
                      separators=(",", ":"))


def container_resources(spec: dict[str, Any]) -> dict[str, Any]:
    r = spec["resources"]
    amounts: dict[str, Any] = {"cpu": str(r["cpu"]), "memory": str(r["memory"])}
    gpus = parallelism.gpus_per_pod(spec)
    if gpus > 0:
        amounts[r["gpuResourceName"]] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _secret_env(var: str, ref: dict[str, Any]) -> dict[str, Any]:
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}


def container_env(spec: dict[str, Any]) -> list[dict[str, Any]]:
    env = [
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
    ]
    if spec.get("hfTokenSecret"):
        env.append(_secret_env("HF_TOKEN", spec["hfTokenSecret"]))
    if spec.get("apiKeySecret"):
        env.append(_secret_env("KVPILOT_API_KEY", spec["apiKeySecret"]))
    return env + list(spec.get("env", []))


def probes(spec: dict[str, Any]) -> dict[str, Any]:
    def http(path: str, period: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
                "timeoutSeconds": 5, "failureThreshold": failures}

    return {
        # The startup probe holds the other two off while the model loads, however long that takes.
        "startupProbe": http("/health", STARTUP_PROBE_PERIOD,
                             math.ceil(spec["startupTimeoutSeconds"] / STARTUP_PROBE_PERIOD)),
        "readinessProbe": http("/ready", 5, 2),
        "livenessProbe": http("/health", 10, 6),
    }


def volumes(spec: dict[str, Any], lora: Sources = NO_SOURCES) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cache = spec["modelCache"]
    empty_dir: dict[str, Any] = {"sizeLimit": cache["sizeLimit"]}
    if cache.get("medium"):
        empty_dir["medium"] = cache["medium"]
    vols = [{"name": "model-cache", "emptyDir": empty_dir}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "model-cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    scheme, rest = parse_model_uri(spec["model"]["uri"])
    if scheme == "pvc":
        claim = rest.partition("/")[0]
        vols.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": PVC_MOUNT, "readOnly": True})
    lora_vols, lora_mounts = lora_sources.volumes(spec["engine"], lora)
    return vols + lora_vols, mounts + lora_mounts


def pod_template(meta: dict[str, Any], spec: dict[str, Any], lora: Sources = NO_SOURCES,
                 role: str = "replica") -> dict[str, Any]:
    """A daemon pod. `role` is "replica" (a Deployment's pod, the whole replica), or "leader" or "worker" of
    a LeaderWorkerSet group: the same container, but only the leader listens for the rendezvous and serves
    /metrics (workers answer /health and /ready only, which the probes use)."""
    name = meta["name"]
    vols, mounts = volumes(spec, lora)
    ports = [{"name": "http", "containerPort": DAEMON_PORT, "protocol": "TCP"}]
    if role == "leader":
        ports.append({"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"})
    container = {
        "name": "daemon",
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["kvpilot"],
        "args": daemon_args(meta, spec, lora),
        "ports": ports,
        "env": container_env(spec),
        "resources": container_resources(spec),
        **probes(spec),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": vols,
        "terminationGracePeriodSeconds": spec["terminationGracePeriodSeconds"],
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"):
        if spec.get(key):
            pod_spec[key] = spec[key]
    annotations = {} if role == "worker" else {"kvpilot.io/metrics-path": "/metrics",
                                                "kvpilot.io/metrics-port": str(DAEMON_PORT)}
    return {
        "metadata": {
            "labels": {**spec.get("podLabels", {}), **labels(name)},
            "annotations": {**spec.get("podAnnotations", {}), **annotations},
        },
        "spec": pod_spec,
    }


def render_deployment(meta: dict[str, Any], spec: dict[str, Any], replicas: int,
                      lora: Sources = NO_SOURCES) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(meta),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(meta["name"])},
            # One new pod at a time and none taken away before its successor is Ready.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": spec["startupTimeoutSeconds"] + 300,
            "template": pod_template(meta, spec, lora),
        },
    }


def render_service(meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    svc = spec["service"]
    metadata = child_metadata(meta)
    if svc.get("annotations"):
        metadata["annotations"] = dict(svc["annotations"])
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": svc["type"],
            # With the builtin router the clients' Service fronts the routers; they reach the daemons
            # through the headless <name>-daemons Service (routing.py).
            "selector": (router_selector_labels(meta["name"]) if builtin_router(spec)
                         else serving_selector_labels(meta["name"], spec)),
            "ports": [{"name": "http", "port": svc["port"], "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pdb(meta: dict[str, Any], replicas: int) -> dict[str, Any] | None:
    """A PodDisruptionBudget only when there is a replica to spare; with one pod it would block node drains."""
    if replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(meta),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(meta["name"])}},
    }


def service_url(meta: dict[str, Any], spec: dict[str, Any]) -> str:
    return f"http://{meta['name']}.{meta['namespace']}.svc:{spec['service']['port']}/v1"


def reconcile_replicas(spec: dict[str, Any], live: int | None) -> int:
    """Replicas to write on reconcile. With autoscaling on, keep the live count (the autoscaler owns it),
    only clamped into [min, max]; a new Deployment starts at minReplicas, but at least 1 so that a new model
    is loaded and checked once (scale to zero comes later, from idleness)."""
    a = spec["autoscaling"]
    if not a["enabled"]:
        return spec["replicas"]
    if live is None:
        return max(a["minReplicas"], 1)
    return min(max(live, a["minReplicas"]), a["maxReplicas"])
