"""Where LoRA adapters come from, seen from inside a daemon pod. Pure functions, shared by the Deployment's
rendering (resources.py) and the LoRAAdapter controller.

- hf://org/name is handed to the daemon as is: it downloads the adapter into its own cache.
- pvc://claim/sub/dir: the claim is mounted read-only at /adapters/pvc/<claim>; the daemon loads
  /adapters/pvc/<claim>/sub/dir.
- file:///path: a folder in the image.

A daemon loads only from the folders it was started with (--lora-root), so a local adapter needs its folder
among the pod's roots: the claim's mount point for pvc://, the adapter's own folder for file://. Roots and
mounts are fixed when a pod starts; a new one changes the pod template and so rolls the pods.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PVC_DIR = "/adapters/pvc"
VOLUME_PREFIX = "lora-"
MAX_VOLUME_NAME = 63  # volume names are DNS-1123 labels
ENABLE_FLAG = "--enable-lora"
RUNTIME_FLAG = "--allow-runtime-lora-updating"
ROOT_FLAG = "--lora-root"


@dataclass(frozen=True)
class Location:
    """One adapter as a daemon sees it."""

    lora_path: str  # the load_lora_adapter body's lora_path
    root: str | None = None  # the --lora-root the pod needs for it; None: the daemon fetches it (hf://)
    claim: str | None = None  # the PersistentVolumeClaim to mount (pvc://)


def locate(uri: str) -> Location:
    """The adapter's place in the pod. The CRD has already checked the scheme and refused `..` segments;
    normpath still keeps a path from naming anything outside its own root."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        raise ValueError(f"adapter uri without a scheme: {uri!r}")
    if scheme == "pvc":
        claim, _, sub = rest.partition("/")
        root = f"{PVC_DIR}/{claim}"
        return Location(posixpath.normpath(f"{root}/{sub}"), root, claim)
    if scheme == "file":
        path = posixpath.normpath(rest)
        return Location(path, path)
    return Location(uri)


@dataclass(frozen=True)
class Sources:
    """What a base's pods need for its adapters: the claims to mount and the daemon's roots, sorted so that
    the same adapters always render the same pod template."""

    claims: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()


NO_SOURCES = Sources()


def sources(uris: Iterable[str]) -> Sources:
    locations = [locate(u) for u in uris]
    return Sources(claims=tuple(sorted({loc.claim for loc in locations if loc.claim})),
                   roots=tuple(sorted({loc.root for loc in locations if loc.root})))


def covered(location: Location, roots: Iterable[str]) -> bool:
    """Whether a daemon started with these roots may load the adapter."""
    if location.root is None:
        return True
    return any(location.lora_path == r or location.lora_path.startswith(r.rstrip("/") + "/") for r in roots)


def daemon_args(engine: dict[str, Any], found: Sources) -> list[str]:
    """The LoRA flags of `kvpilot serve`. None without enableLora: the pods of a base that does not use LoRA
    keep the template they had, so upgrading the operator does not roll them."""
    if not engine.get("enableLora"):
        return []
    args = [ENABLE_FLAG, "--max-loras", str(engine["maxLoras"]), "--max-lora-rank", str(engine["maxLoraRank"])]
    if engine.get("maxCpuLoras") is not None:
        args += ["--max-cpu-loras", str(engine["maxCpuLoras"])]
    # The LoRAAdapter controller loads and unloads through the daemon's routes, which exist only with this.
    args.append(RUNTIME_FLAG)
    for root in found.roots:
        args += [ROOT_FLAG, root]
    return args


def volume_name(claim: str) -> str:
    name = f"{VOLUME_PREFIX}{claim}"
    if len(name) <= MAX_VOLUME_NAME:
        return name
    return f"{VOLUME_PREFIX}{hashlib.sha256(claim.encode()).hexdigest()[:16]}"


def volumes(engine: dict[str, Any], found: Sources) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The claims' volumes and read-only mounts."""
    if not engine.get("enableLora"):
        return [], []
    vols = [{"name": volume_name(c), "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
            for c in found.claims]
    mounts = [{"name": volume_name(c), "mountPath": f"{PVC_DIR}/{c}", "readOnly": True} for c in found.claims]
    return vols, mounts


@dataclass(frozen=True)
class PodLoRA:
    """What a pod's daemon was started with: whether it takes runtime loads, and its roots."""

    enabled: bool
    roots: tuple[str, ...] = ()


def flag_values(args: list[str], flag: str) -> tuple[str, ...]:
    """Every value of a repeatable flag, written `--flag value` or `--flag=value`."""
    out = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    out += [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    return tuple(out)


def daemon_container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec.get("containers") or []
    return next((c for c in containers if c.get("name") == "daemon"), containers[0] if containers else {})


def pod_lora(pod_spec: dict[str, Any] | None) -> PodLoRA:
    """From a pod's (or a pod template's) spec."""
    args = [str(a) for a in daemon_container(pod_spec or {}).get("args") or []]
    enabled = ENABLE_FLAG in args and RUNTIME_FLAG in args
    return PodLoRA(enabled=enabled, roots=tuple(sorted(set(flag_values(args, ROOT_FLAG)))))
