"""Where an adapter's files are: a ``lora_path`` (local path, ``file://`` or ``hf://``) -> a local folder.

Runtime loads come from API clients, so a local path is confined: it is resolved with symlinks followed and
must then lie inside one of the allowed roots (``--lora-root``), which keeps a client from making the daemon
read any folder it can name (``../../etc``, a symlink planted inside a root). ``hf://`` adapters download
into kvpilot's own cache, which the daemon controls, so they need no root. The paths an operator gives with
``--lora-modules`` are trusted as given (``roots=None``).

Blocking (realpath, downloads): the caller runs it off the event loop.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kvpilot.paths import cache_dir

from .engine.lora import LoRAAdapterError
from .errors import LoRAPathNotAllowed

__all__ = ["adapter_cache_dir", "real_roots", "resolve_adapter_source"]

PARAM = "lora_path"
MAX_SOURCE_CHARS = 4096  # PATH_MAX on Linux; longer cannot name a folder
# Only what an adapter is made of: a repository's other files (a merged model, checkpoints) can be large.
_HF_PATTERNS = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_HF_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


def adapter_cache_dir() -> Path:
    """Where hf:// adapters are downloaded: beside kvpilot's converted models."""
    return cache_dir() / "lora-adapters"


def real_roots(roots: Sequence[str]) -> tuple[str, ...]:
    """The roots as the checks compare them: absolute, symlinks resolved (a root may itself be a link)."""
    return tuple(dict.fromkeys(os.path.realpath(r) for r in roots))


def resolve_adapter_source(source: str, roots: Sequence[str] | None) -> str:
    """The local folder of an adapter. ``roots`` are real_roots() output; None trusts any local path.

    Raises LoRAPathNotAllowed (outside the roots, unknown scheme) or LoRAAdapterError (no such folder, a
    download that failed); whether a folder outside the roots exists is never revealed."""
    if not isinstance(source, str) or not source.strip():
        raise LoRAPathNotAllowed("lora_path must be a non-empty string", PARAM)
    if "\x00" in source or len(source) > MAX_SOURCE_CHARS:
        raise LoRAPathNotAllowed(f"lora_path must be a path of at most {MAX_SOURCE_CHARS} characters without "
                                 "NUL bytes", PARAM)
    if "://" in source:
        scheme, _, rest = source.partition("://")
        if scheme == "hf":
            return _download_hf(source, rest)
        if scheme != "file":
            raise LoRAPathNotAllowed(f"lora_path {source!r}: unknown scheme {scheme + '://'!r} (use a local "
                                     "path, file:// or hf://org/name[@revision])", PARAM)
        local = _file_uri_path(source)
    else:
        local = source
    return _confined_folder(source, local, roots)


def _file_uri_path(source: str) -> str:
    parts = urlsplit(source)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise LoRAPathNotAllowed(f"lora_path {source!r}: a file:// URI must name a local absolute path "
                                 "(file:///path/to/adapter)", PARAM)
    path = unquote(parts.path)
    if "\x00" in path or not path.startswith("/"):
        raise LoRAPathNotAllowed(f"lora_path {source!r}: a file:// URI must name a local absolute path", PARAM)
    return path


def _confined_folder(source: str, local: str, roots: Sequence[str] | None) -> str:
    real = os.path.realpath(local)
    if roots is not None and not any(_inside(real, root) for root in roots):
        where = ", ".join(roots) if roots else "none: start the server with --lora-root DIR to allow local paths"
        raise LoRAPathNotAllowed(f"lora_path {source!r} is outside the allowed adapter roots ({where})", PARAM)
    if not os.path.isdir(real):
        raise LoRAAdapterError(f"lora_path {source!r}: no adapter folder there (expected a folder holding "
                               "adapter_config.json and adapter_model.safetensors or .bin)", PARAM)
    return real


def _inside(real: str, root: str) -> bool:
    """`real` is `root` or below it (by whole path components: /a/bc is not inside /a/b)."""
    try:
        return os.path.commonpath([real, root]) == root
    except ValueError:  # nothing in common at all
        return False


def _download_hf(source: str, rest: str) -> str:
    repo_id, _, revision = rest.partition("@")
    if not _HF_REPO.match(repo_id) or ".." in repo_id or (revision and not _HF_REVISION.match(revision)) \
            or ".." in revision:
        raise LoRAPathNotAllowed(f"lora_path {source!r}: expected hf://org/name[@revision]", PARAM)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise LoRAAdapterError(f"lora_path {source!r}: huggingface_hub is not installed", PARAM) from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        folder = snapshot_download(repo_id, revision=revision or None, allow_patterns=_HF_PATTERNS,
                                   cache_dir=str(adapter_cache_dir()), local_files_only=offline)
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo, gated, network: the same answer
        why = "offline (HF_HUB_OFFLINE is set) and not in kvpilot's adapter cache" if offline \
            else (str(exc).splitlines() or [type(exc).__name__])[0]
        raise LoRAAdapterError(f"lora_path {source!r}: cannot get {repo_id!r} from the Hugging Face Hub: {why}",
                               PARAM) from None
    return folder
