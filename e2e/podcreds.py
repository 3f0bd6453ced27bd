"""A pod's service-account credentials, handed over the way a kubelet does, for the pods the agent runs.

A kubelet asks the API server for a token bound to the pod (a TokenRequest on
serviceaccounts/NAME/token) and mounts it, with the CA and the namespace, at
/var/run/secrets/kubernetes.io/serviceaccount; in-cluster clients read it there. A process on this
machine cannot have that fixed path, so the agent writes the same files into the pod's folder, plus a
kubeconfig that carries them, and sets KUBECONFIG: the `kubernetes` package's loaders (the router's
`KubeClient.from_environment`) use it when there is no in-cluster config. Server and CA are the agent's
own API server's, as a pod's are its cluster's.

Only pods that name a ServiceAccount get credentials (the daemons run as `default` and never call the
API); `automountServiceAccountToken: false` turns them off, as on a cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cluster import Kube, serviceaccounts, write_kubeconfig

TOKEN_SECONDS = 3600  # a kubelet rotates the token; a run is over long before it expires


def wants_token(pod: dict[str, Any]) -> str | None:
    """The ServiceAccount whose token the pod gets, or None."""
    spec = pod.get("spec") or {}
    sa = spec.get("serviceAccountName")
    if not sa or sa == "default" or spec.get("automountServiceAccountToken") is False:
        return None
    return str(sa)


async def request_token(kube: Kube, pod: dict[str, Any], sa: str) -> str:
    """A token bound to the pod (it stops working when the pod goes), as the kubelet requests it."""
    meta = pod["metadata"]
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": TOKEN_SECONDS,
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                        "uid": meta.get("uid", "")}}}
    answer = await kube.request("POST", f"{serviceaccounts(meta['namespace'])}/{sa}/token", body=body)
    return str(answer["status"]["token"])


def _ca_fields(kube: Kube, folder: Path) -> dict[str, Any]:
    info = kube.connection()
    if info.insecure:
        return {"insecure-skip-tls-verify": True}
    if info.ca_path:
        ca = folder / "ca.crt"
        ca.write_bytes(Path(info.ca_path).read_bytes())
        return {"certificate-authority": str(ca)}
    return {}


async def mount(kube: Kube, pod: dict[str, Any], poddir: Path) -> dict[str, str]:
    """Write the pod's credentials; the environment its container gets for them ({} when none)."""
    sa = wants_token(pod)
    if sa is None:
        return {}
    token = await request_token(kube, pod, sa)
    ns = pod["metadata"]["namespace"]
    folder = poddir / "serviceaccount"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "token").write_text(token)
    (folder / "namespace").write_text(ns)
    path = write_kubeconfig(folder / "kubeconfig", kube.url, token, ns, _ca_fields(kube, folder))
    path.chmod(0o600)
    return {"KUBECONFIG": str(path)}
