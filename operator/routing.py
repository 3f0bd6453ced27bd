"""Pure renderers of the routing children of an InferenceDeployment with spec.router.enabled.

builtin mode: the router's Deployment, PDB, ServiceAccount, Role and RoleBinding, and a headless Service of
the daemons whose EndpointSlices the router watches (the user-facing Service then selects the router pods).
inferencePool mode: one InferencePool (Gateway API Inference Extension, v1) over the daemon pods.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

from kvpilot.operator import resources as r

ROUTER_APP = r.ROUTER_APP
ROUTER_PORT = 8000
COLD_START_HOLD_SECONDS = 300
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
INFERENCE_POOL_PLURAL = "inferencepools"


def router_name(name: str) -> str:
    return f"{name}-router"


def daemons_service_name(name: str) -> str:
    return f"{name}-daemons"


router_selector_labels = r.router_selector_labels


def router_labels(name: str) -> dict[str, str]:
    return {**router_selector_labels(name), r.INSTANCE_LABEL: name, r.MANAGED_BY_LABEL: r.MANAGER,
            "app.kubernetes.io/component": "router"}


def router_selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(router_selector_labels(name).items()))


def matches_router(pod_labels: dict[str, str] | None, name: str) -> bool:
    pod_labels = pod_labels or {}
    return all(pod_labels.get(k) == v for k, v in router_selector_labels(name).items())


def _metadata(meta: dict[str, Any], name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": meta["namespace"], "labels": labels,
            "ownerReferences": [r.owner_reference(meta)]}


def _router_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """The metadata of every router object: one name (the router's), its labels, owned by the CR."""
    return _metadata(meta, router_name(meta["name"]), router_labels(meta["name"]))


def daemon_max_num_seqs(spec: dict[str, Any]) -> int:
    """The --max-num-seqs the daemons run with: engine.maxNumSeqs (defaulted by the CRD), unless
    engine.extraArgs repeats the flag, which comes later on their command line and so wins (argparse)."""
    value = int(spec["engine"]["maxNumSeqs"])
    extra = [str(a) for a in spec["engine"].get("extraArgs", [])]
    for i, arg in enumerate(extra):
        flag, eq, inline = arg.partition("=")
        if flag != "--max-num-seqs":
            continue
        raw = inline if eq else (extra[i + 1] if i + 1 < len(extra) else "")
        with contextlib.suppress(ValueError):  # the daemon refuses it at startup: keep the spec's value
            value = int(raw)
    return value


def router_args(meta: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    args = [
        "--host", "0.0.0.0",
        "--port", str(ROUTER_PORT),
        "--service", daemons_service_name(meta["name"]),
        "--namespace", meta["namespace"],
        "--port-name", "http",
        "--block-size", str(spec["engine"]["blockSize"]),
        # A replica running this many would queue the next one: the router sees it before a scrape does.
        "--replica-slots", str(daemon_max_num_seqs(spec)),
    ]
    uri = spec["model"]["uri"]
    if not uri.startswith("pvc://"):  # the router pod mounts no volume; there it hashes UTF-8 bytes instead
        # The model's own tokenizer makes the router's block hashes the engine's, so hit estimates are real.
        args += ["--tokenizer", uri]
    a = spec["autoscaling"]
    if a["enabled"] and a["minReplicas"] == 0:
        # A request held at zero waits out a cold start (the router's own default is 30 s), as long as
        # Knative's activator waits by default. extraArgs come later and win.
        args += ["--hold-timeout", str(COLD_START_HOLD_SECONDS)]
    return args + list(spec["router"].get("extraArgs", []))


def router_container(meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    res = spec["router"]["resources"]
    amounts = {"cpu": str(res["cpu"]), "memory": str(res["memory"])}

    def http(path: str, period: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": 3,
                "failureThreshold": failures}

    return {
        "name": "router",
        "image": spec["router"].get("image") or spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["python", "-m", "kvpilot.router"],
        "args": router_args(meta, spec),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        # /ready answers even with no daemon ready: scale-from-zero needs the router to take and hold requests.
        "readinessProbe": http("/ready", 5, 2),
        "livenessProbe": http("/health", 10, 6),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }


def router_affinity(name: str, router: dict[str, Any]) -> dict[str, Any]:
    """spec.router.affinity over the default anti-affinity: two routers on one node would fall together, so
    spread them where the scheduler can, unless the user's own podAntiAffinity says otherwise."""
    spread = {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                 "labelSelector": {"matchLabels": router_selector_labels(name)}}}
    default = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [spread]}}
    return {**default, **copy.deepcopy(router.get("affinity") or {})}


def router_scheduling(router: dict[str, Any]) -> dict[str, Any]:
    """spec.router's nodeSelector and tolerations, set only when given. Never the daemon's spec.nodeSelector
    or spec.tolerations: those pick GPU nodes, and a CPU-only router must not take a GPU node's room."""
    return {key: copy.deepcopy(router[key]) for key in ("nodeSelector", "tolerations") if router.get(key)}


def router_pod_template(meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    name = meta["name"]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(name),
        "containers": [router_container(meta, spec)],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
        "terminationGracePeriodSeconds": 30,
        "enableServiceLinks": False,
        **router_scheduling(spec["router"]),
        "affinity": router_affinity(name, spec["router"]),
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if spec.get("imagePullSecrets"):
        pod_spec["imagePullSecrets"] = spec["imagePullSecrets"]
    annotations = {"kvpilot.io/metrics-path": "/metrics", "kvpilot.io/metrics-port": str(ROUTER_PORT)}
    return {"metadata": {"labels": router_labels(name), "annotations": annotations}, "spec": pod_spec}


def render_router_deployment(meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    name = meta["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _router_metadata(meta),
        "spec": {
            "replicas": spec["router"]["replicas"],
            "selector": {"matchLabels": router_selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": router_pod_template(meta, spec),
        },
    }


def render_router_pdb(meta: dict[str, Any]) -> dict[str, Any]:
    name = meta["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _router_metadata(meta),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": router_selector_labels(name)}},
    }


def render_daemons_service(meta: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Headless: the router reads its EndpointSlices (ready addresses) and connects to the pods directly.
    With the spec, it selects only the pods that serve the API (a multi-node replica's leader)."""
    name = meta["name"]
    selector = r.selector_labels(name) if spec is None else r.serving_selector_labels(name, spec)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(meta, daemons_service_name(name), r.labels(name)),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": [{"name": "http", "port": r.DAEMON_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_service_account(meta: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _router_metadata(meta)}


# What the router's discovery calls (router/endpoints.py): list, then watch; get for single slices. The
# operator holds exactly these itself, which is what the API server's escalation check asks of it.
ROUTER_RULES = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                 "verbs": ["get", "list", "watch"]}]


def render_role(meta: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _router_metadata(meta),
            "rules": [dict(rule) for rule in ROUTER_RULES]}


def render_role_binding(meta: dict[str, Any]) -> dict[str, Any]:
    name = meta["name"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _router_metadata(meta),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": router_name(name)},
        "subjects": [{"kind": "ServiceAccount", "name": router_name(name), "namespace": meta["namespace"]}],
    }


def render_inference_pool(meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    name = meta["name"]
    ref = spec["router"]["endpointPickerRef"]
    picker = {"name": ref["name"], "port": {"number": ref["port"]["number"]},
              "kind": ref.get("kind", "Service"), "group": ref.get("group", ""),
              "failureMode": ref.get("failureMode", "FailClose")}
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _metadata(meta, name, r.labels(name)),
        "spec": {
            "selector": {"matchLabels": r.serving_selector_labels(name, spec)},
            "targetPorts": [{"number": r.DAEMON_PORT}],
            "endpointPickerRef": picker,
        },
    }
