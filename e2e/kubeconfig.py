"""A kubeconfig -> the connection the shared client (kvpilot.operator.kube) takes: a kopf.ConnectionInfo.

Parsing is the `kubernetes` package's loader, so every form a kubeconfig may take works: a token or
tokenFile, client certificates as files or base64 data, a CA as a file or data, insecure-skip-tls-verify,
basic auth, exec plugins (kind, k3s, EKS, GKE).
"""

from __future__ import annotations

from pathlib import Path

import kopf
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config


def load(path: Path, context: str | None = None) -> kopf.ConnectionInfo:
    """Read a kubeconfig (its current context unless one is named). Certificate data goes to temporary
    files the loader writes (0600, removed at exit). A token from an exec plugin is read once: enough for
    a run of minutes, not for hours."""
    cfg = k8s_client.Configuration()
    try:
        k8s_config.load_kube_config(config_file=str(path), context=context, client_configuration=cfg,
                                    persist_config=False)
        _, active = k8s_config.list_kube_config_contexts(config_file=str(path))
    except (k8s_config.ConfigException, OSError, ValueError) as e:
        raise ValueError(f"kubeconfig {path}: {e}") from e
    scheme, token = None, None
    # The loader's key for the header value changed across versions of the package.
    auth = cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ") if " " in auth else ("Bearer", "", auth)
    return kopf.ConnectionInfo(
        server=cfg.host.rstrip("/"),
        ca_path=cfg.ssl_ca_cert or None,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file or None,
        private_key_path=cfg.key_file or None,
        default_namespace=(active.get("context") or {}).get("namespace") if context is None else None,
    )
