"""Native model implementations and the HF ``architectures`` → class registry."""

from __future__ import annotations

from typing import Any

from torch import nn

from .archs import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GptOssForCausalLM,
    LlamaForCausalLM,
    MixtralForCausalLM,
    Olmo2ForCausalLM,
    Phi3ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)
from .base import AttentionMetadata, LoRABatch, OutputRows
from .decoder import text_config

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "LoRABatch", "OutputRows", "MODEL_REGISTRY", "get_model_class",
           "text_config"]

# HF class names in config.json "architectures" -> our implementation
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # its text decoder; images are not served
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}
# for configs without "architectures" (e.g. converted by hand): model_type -> class
_BY_MODEL_TYPE: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
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
