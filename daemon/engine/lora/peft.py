"""Reads a PEFT LoRA adapter folder and fits it to the base model's linear layers, or says why it cannot.

The folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...) and
``adapter_model.safetensors`` (or ``adapter_model.bin``) with ``...<module>.lora_A.weight`` [r, in] and
``...<module>.lora_B.weight`` [out, r] per targeted module. An adapter changes W to W + scale * B @ A, with
scale = lora_alpha / r (lora_alpha / sqrt(r) with ``use_rslora``). The result is laid out for the layers as
the base's weights are: B's rows go where the layer keeps the module's rows (its partition of q|k|v or
gate|up, this rank's share of them, the interleaved RoPE order of q and k), and the scale is folded into B.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..models.rope import permute_rope_rows
from .errors import LoRAAdapterError
from .request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# the modules an adapter may target: the attention and MLP projections (HF's names, last component)
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                     "gate_up_proj")
_UNSUPPORTED_TARGETS = {"embed_tokens": "the embedding", "lm_head": "the LM head"}
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$")
_LAYER = re.compile(r"^layers\.(?P<index>\d+)\.(?P<sub>.+)$")
# PEFT's and transformers' prefixes in front of the base model's own names
_PREFIXES = ("base_model.model.model.language_model.", "base_model.model.language_model.model.",
             "base_model.model.model.", "base_model.model.", "model.")


@dataclass(frozen=True)
class LoRAUnit:
    """One low-rank update of a linear layer: ``a`` [r, in], and ``b`` [rows, r] (scaled) for the layer's
    local output rows ``row_start .. row_start + rows``."""

    row_start: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    """An adapter read and fitted to the base: its units by (layer index, projection attribute)."""

    request: LoRARequest
    rank: int
    scale: float
    units: dict[tuple[int, str], list[LoRAUnit]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(u.a.numel() * u.a.element_size() + u.b.numel() * u.b.element_size()
                   for units in self.units.values() for u in units)


def _fail(request: LoRARequest, message: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: {message}", param="lora_path")


def read_config(request: LoRARequest) -> dict[str, Any]:
    folder = Path(request.lora_path)
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise _fail(request, f"{request.lora_path} is not a directory")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise _fail(request, f"{CONFIG_FILE} is missing in {request.lora_path}") from None
    except (OSError, ValueError) as e:
        raise _fail(request, f"{CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise _fail(request, f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(request: LoRARequest, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scale; LoRAAdapterError for what the engine does not serve."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(request, f"peft_type {peft_type!r} is not LORA")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(request, f"r must be an integer >= 1, got {r!r}")
    if r > max_rank:
        raise _fail(request, f"rank {r} is above max_lora_rank ({max_rank})")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise _fail(request, f"lora_alpha must be a number, got {alpha!r}")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"), ("fan_in_fan_out", "fan_in_fan_out")):
        if config.get(key):
            raise _fail(request, f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise _fail(request, f"bias {config['bias']!r} is not supported (only 'none')")
    saved = config.get("modules_to_save") or []
    if saved:
        raise _fail(request, f"modules_to_save {list(saved)} is not supported: an adapter may only change the "
                             f"projections {', '.join(SUPPORTED_MODULES[:7])}")
    targets = config.get("target_modules") or []
    for name in [targets] if isinstance(targets, str) else targets:
        last = str(name).rsplit(".", 1)[-1]
        if last in _UNSUPPORTED_TARGETS:
            raise _fail(request, f"LoRA on {_UNSUPPORTED_TARGETS[last]} ({name}) is not supported")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(scale)


def read_tensors(request: LoRARequest) -> dict[str, torch.Tensor]:
    folder = Path(request.lora_path)
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(os.fspath(path))
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the adapter's fault: say so
            raise _fail(request, f"{name} cannot be read: {e}") from None
        if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
            raise _fail(request, f"{name} must hold a dict of tensors")
        return loaded
    raise _fail(request, f"no adapter weights in {request.lora_path} (expected {' or '.join(WEIGHT_FILES)})")


def _module_name(request: LoRARequest, name: str) -> tuple[str, str]:
    """(module path inside the decoder, "A" or "B") of a PEFT tensor name."""
    m = _TENSOR.match(name)
    if m is None:
        if "lora_embedding" in name or "lora_magnitude" in name:
            raise _fail(request, f"{name}: embedding adapters and DoRA are not supported")
        raise _fail(request, f"{name} is not a LoRA weight (expected ...lora_A.weight or ...lora_B.weight)")
    module = m.group("module")
    for prefix in _PREFIXES:
        if module.startswith(prefix):
            module = module.removeprefix(prefix)
            break
    return module, m.group("kind")


def load_adapter(request: LoRARequest, model: Any, *, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """``request``'s adapter fitted to ``model`` (a DecoderForCausalLM), its tensors in ``dtype`` on the CPU."""
    config = read_config(request)
    rank, scale = _check_config(request, config, max_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in read_tensors(request).items():
        module, kind = _module_name(request, name)
        pairs.setdefault(module, {})[kind] = tensor
    if not pairs:
        raise _fail(request, "the adapter has no LoRA weights")
    projections = {hf: (attr, part) for hf, attr, part in model.spec.weights.projections}
    adapter = LoRAAdapter(request, rank, scale)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _fail(request, f"{module}: lora_{'A' if 'A' not in ab else 'B'} is missing")
        last = module.rsplit(".", 1)[-1]
        if last in _UNSUPPORTED_TARGETS:
            raise _fail(request, f"LoRA on {_UNSUPPORTED_TARGETS[last]} ({module}) is not supported")
        m = _LAYER.match(module)
        if m is None or m.group("sub") not in projections:
            raise _fail(request, f"target module {module} is not one of the base model's projections "
                                 f"({', '.join(hf for hf in projections)} per layer)")
        index, (attr, part) = int(m.group("index")), projections[m.group("sub")]
        if index >= model.num_layers:
            raise _fail(request, f"{module}: the base model has {model.num_layers} layers")
        local = index - getattr(model, "first_layer", 0)
        if not 0 <= local < len(model.layers):  # another pipeline stage's layer: that stage fits it
            continue
        layer = model.layers[local]
        proj = getattr(layer, attr, None)
        if proj is None:
            raise _fail(request, f"{module}: LoRA on mixture-of-experts layers is not supported")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _fail(request, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                                 "make a low-rank pair ([r, in] and [out, r])")
        if a.shape[0] > max_rank:
            raise _fail(request, f"{module}: rank {a.shape[0]} is above max_lora_rank ({max_rank})")
        if a.shape[1] != proj.in_features:
            raise _fail(request, f"{module}: lora_A has {a.shape[1]} input features, the base layer "
                                 f"{proj.in_features}")
        units = _fit(request, model, proj, attr, part, module, a, b * scale)
        adapter.units.setdefault((index, attr), []).extend(
            LoRAUnit(u.row_start, u.a.to(dtype).contiguous(), u.b.to(dtype).contiguous()) for u in units)
    return adapter


def _fit(request: LoRARequest, model: Any, proj: Any, attr: str, part: int | None, module: str,
         a: torch.Tensor, b: torch.Tensor) -> list[LoRAUnit]:
    """The units of one module: B's rows sliced and ordered as the layer keeps the module's rows, and for a
    layer split by input columns over the tensor ranks, A's columns of this rank (each rank's partial update
    is then summed with the layer's own partial output)."""
    if proj.split == "row":
        a = a[:, proj.in_start:proj.in_start + proj.in_per_rank]
    partitions = range(len(proj.partitions)) if part is None else [part]
    total = sum(proj.partitions[p][0] for p in partitions)
    if b.shape[0] != total:
        raise _fail(request, f"{module}: lora_B has {b.shape[0]} output rows, the base layer {total}")
    pieces = []
    offset = 0
    for p in partitions:
        rows, start, size = proj.partitions[p]
        rows_b = b[offset:offset + rows]
        offset += rows
        if attr == "qkv_proj" and p < 2:  # q and k rows: in the base's order
            rows_b = permute_rope_rows(rows_b, model.head_dim, model.rope_order)
        dst = sum(s for _, _, s in proj.partitions[:p])
        pieces.append((dst, rows_b[start:start + size]))
    if part is not None:
        return [LoRAUnit(pieces[0][0], a, pieces[0][1])]
    # a fused module (Phi-3's qkv_proj, gate_up_proj): one A for all partitions, their B rows stacked
    return [LoRAUnit(0, a, torch.cat([rows for _, rows in pieces]))]
