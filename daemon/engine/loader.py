"""Model sources → a local HF folder → a native model on the target device and dtype.

The sources (``EngineConfig.model``: a local HF folder, a ``.gguf`` file, ``hf://``, ``builtin://``) and
their GGUF conversion cache are kvpilot.common.model_source's, shared with the router (which loads only
the tokenizer); this module builds and loads the model from the folder it gives.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpilot.common.gguf_weights import gguf_source, iter_gguf_weights
from kvpilot.common.model_source import resolve_model_path

from .config import EngineConfig
from .models.parallel import SINGLE, ParallelContext

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .models.quantization import QuantMethod

logger = logging.getLogger(__name__)

__all__ = ["LoadedModel", "load_model", "resolve_dtype", "resolve_device"]

_DEFAULT_MAX_LEN_CAP = 8192


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: Any
    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    model_name: str
    path: Path | None = None
    quantization: str = "none"  # the quant method the linear layers run (``models.quantization``)
    weight_bytes: int = 0  # the model's weights as held on the device (``kvpilot:model_weight_bytes``)
    # this rank's place among the ranks; model, weight_bytes and the KV cache are this rank's shard
    parallel: ParallelContext = SINGLE


# ----------------------------------------------------------------------------- dtype / device


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux x86); None where there is no such file or line."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if line is None else frozenset(line.split(":", 1)[1].split())


def _cpu_prefers_bf16() -> bool:
    """CPUs with bfloat16 dot products: AMX-BF16 (tile matmuls), or AVX512-BF16. There, with the native
    bfloat16 paths and prepacked bfloat16 weights, bfloat16 runs 1.45-1.66x as fast as float32
    (bench/results/peers_w96_bf16_run*.json; CHANGELOG.md has why it was once off). Without either,
    bfloat16 on a CPU is emulated and float32 is the faster dtype."""
    flags = cpu_flags()
    if flags is not None:
        return "amx_bf16" in flags or "avx512_bf16" in flags
    import torch

    return "AMX" in str(torch.backends.cpu.get_cpu_capability()).upper()


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a valid torch device") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    import torch

    explicit = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype in explicit:
        return explicit[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype must be one of auto, {', '.join(explicit)}; got {dtype!r}")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and _cpu_prefers_bf16():
        return torch.bfloat16
    return torch.float32


# ----------------------------------------------------------------------------- load


def _iter_safetensors(folder: Path, uri: str | None = None,
                      keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors, one shard open at a time; with ``keep``, only the names it accepts (the files are
    mapped, so the others are never read: a pipeline stage reads only its own layers). With ``model.safetensors.index.json`` only the files
    its weight_map names are read: repos may also ship other *.safetensors (Mistral's consolidated.safetensors
    holds the same weights under other names). Checked before the first tensor is read, so a missing shard
    fails at once rather than after the others were copied in."""
    from safetensors import safe_open

    model = uri or str(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted({str(v) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"model {model!r}: cannot read {str(index)!r}: {e}") from e
        files = [folder / s for s in shards]
        missing = [s for s, f in zip(shards, files, strict=True) if not f.is_file()]
        if missing:
            raise ValueError(f"model {model!r}: shard {missing[0]!r} listed in {index.name} is missing from {str(folder)!r}")
    else:
        files = sorted(folder.glob("*.safetensors"))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                    if keep is None or keep(name):
                        yield name, sf.get_tensor(name)

    return tensors()


def _eos_ids(path: Path, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list | tuple):
            ids.update(int(x) for x in v if isinstance(x, int))

    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError):
            logger.warning("could not read %s", gen)
    add(getattr(hf_config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)


def _model_max_len(hf_config: Any) -> int:
    v = getattr(hf_config, "max_position_embeddings", None)
    return int(v) if v else _DEFAULT_MAX_LEN_CAP


# a checkpoint's quantization_config quant_method -> the method that runs it
_CHECKPOINT_METHODS = {"fp8": "fp8", "compressed-tensors": "fp8", "awq": "awq", "gptq": "gptq"}


def resolve_quant_method(setting: str | None, hf_config: Any, gguf_file: Path | None) -> QuantMethod:
    """The linear layers' quant method: ``setting`` (``EngineConfig.quantization``) where given, else
    what the checkpoint is: GGUF blocks for a .gguf model, its ``quantization_config``, or float.
    ``ValueError`` where the two disagree."""
    from .models.quantization import get_quant_method

    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    stored = None
    if qc:
        kind = str(qc.get("quant_method", ""))
        if kind not in _CHECKPOINT_METHODS:
            raise ValueError(f"quantization_config.quant_method {kind!r} is not supported "
                             f"(supported: {sorted(_CHECKPOINT_METHODS)})")
        stored = _CHECKPOINT_METHODS[kind]
    elif gguf_file is not None:
        stored = "gguf"
    name = _CHECKPOINT_METHODS.get(setting, setting) if setting is not None else stored or "none"
    if name == "gguf" and gguf_file is None:
        raise ValueError("quantization 'gguf' runs .gguf models on their own blocks; this model is not one")
    if stored not in (None, "gguf") and name != stored:
        raise ValueError(f"quantization {setting!r} does not match the checkpoint's {stored!r} weights")
    return get_quant_method(name, qc if stored not in (None, "gguf") else None)


def configure_kernels(config: EngineConfig) -> None:
    """Put the config's kernel switches in effect, once, before the model is built: weight prepacking and
    panel copies are decided while loading, and the kernels read these settings on every call. Settings
    that are no engine field (a test's or benchmark's build flags, Triton variants) stay as they are."""
    import dataclasses

    from kvpilot.kernels import ops

    ops.configure(dataclasses.replace(
        ops.current(),
        attention_backend=config.attention_backend,
        cpu_kernels=config.cpu_kernel,
        prepack_weights=config.prepack_weights,
        small_batch_gemm=config.small_batch_gemm,
    ))


def load_model(config: EngineConfig, parallel: ParallelContext = SINGLE) -> LoadedModel:
    """Resolve, build and load the native model for ``config`` (this rank's shard of it under ``parallel``);
    ``ValueError`` naming the uri on bad input."""
    from kvpilot.common.tokenizer import load_tokenizer

    from .model_files import load_config
    from .models import get_model_class, text_config

    t0 = time.perf_counter()
    configure_kernels(config)
    uri = config.model
    path = resolve_model_path(uri)
    try:
        hf_config = load_config(path)
    except Exception as e:
        raise ValueError(f"model {uri!r}: cannot read config.json in {str(path)!r}: {e}") from e
    model_cls = get_model_class(hf_config, uri)
    full_config, hf_config = hf_config, text_config(hf_config)  # a multimodal checkpoint's text decoder

    model_max = _model_max_len(hf_config)
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len={config.max_model_len} is larger than model {uri!r} supports ({model_max} positions)"
        )
    max_model_len = config.max_model_len or min(model_max, _DEFAULT_MAX_LEN_CAP)

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    try:
        tokenizer = load_tokenizer(path)
    except Exception as e:
        raise ValueError(f"model {uri!r}: cannot load a tokenizer from {str(path)!r}: {e}") from e

    gguf_file = gguf_source(path)
    try:
        quant_method = resolve_quant_method(config.quantization, full_config, gguf_file)
        model = model_cls(hf_config, max_model_len=max_model_len, dtype=dtype, device=device,
                          quant_method=quant_method, parallel=parallel)
    except ValueError as e:  # a config field the native model cannot follow (RoPE type, activation, ...)
        raise ValueError(f"model {uri!r}: {e}") from e
    weights = iter_gguf_weights(gguf_file, hf_config, quantized_embeddings=quant_method.quantizes_embeddings) \
        if gguf_file is not None and quant_method.name == "gguf" \
        else _iter_safetensors(path, uri, keep=getattr(model, "wants_weight", None))
    try:
        model.load_weights(weights)
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"model {uri!r}: weights in {str(path)!r} do not fit {model_cls.__name__}: {e}") from e
    model.eval()
    packed = bool(getattr(model, "prepack_weights", None) and model.prepack_weights())
    weight_bytes = model.weight_bytes()
    logger.info(
        "loaded %s (%s) from %s on %s in %s in %.1fs: %s weights, %.1f MiB%s",
        uri, model_cls.__name__, gguf_file or path, device, dtype, time.perf_counter() - t0,
        quant_method.describe(), weight_bytes / 2**20,
        ", float GEMM weights prepacked for oneDNN" if packed else "",
    )
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(path, hf_config, tokenizer) | _eos_ids(path, full_config, tokenizer),
        max_model_len=max_model_len,
        dtype=dtype,
        device=device,
        model_name=config.served_model_name or uri,
        path=path,
        quantization=quant_method.name,
        weight_bytes=weight_bytes,
        parallel=parallel,
    )
