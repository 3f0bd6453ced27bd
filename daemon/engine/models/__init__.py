"""Native model implementations and the HF ``architectures`` → class registry."""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import AttentionMetadata, OutputRows
from .llama import LlamaForCausalLM

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "OutputRows", "MODEL_REGISTRY", "get_model_class"]

# HF class names in config.json "architectures" -> our implementation
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
# for configs without "architectures" (e.g. converted by hand): model_type -> class
_BY_MODEL_TYPE: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def get_model_class(hf_config: Any, uri: str = "") -> type[nn.Module]:
    """The native class for ``hf_config``; ``ValueError`` naming the model and its architecture otherwise."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    what = archs or [model_type]
    raise ValueError(
        f"model {uri!r}: unsupported architecture {what} (supported: {sorted(MODEL_REGISTRY)})"
    )
