"""Per architecture: its HF config → a ``DecoderSpec``, and the model class the registry names.

Every builder reads only what its HF modeling file uses; a config that asks for something the decoder
does not do (another activation, bidirectional attention) is a ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from .decoder import DecoderForCausalLM
from .spec import (
    FUSED_PROJECTIONS,
    LLAMA_PROJECTIONS,
    POST_NORMS,
    PRE_NORMS,
    QK_NORMS,
    SANDWICH_NORMS,
    DecoderSpec,
    LayerSpec,
    WeightNames,
)

__all__ = [
    "LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
    "Olmo2ForCausalLM", "layer_sliding_window",
]


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "model_type", "") == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    return int(window)


def _need(config: Any, arch: str, name: str) -> Any:
    value = getattr(config, name, None)
    if value is None:
        raise ValueError(f"{arch}: config field {name!r} is missing")
    return value


def _activation(config: Any, arch: str, allowed: dict[str, str], default: str) -> str:
    field = "hidden_activation" if getattr(config, "hidden_activation", None) else "hidden_act"
    act = getattr(config, field, None) or default
    if act not in allowed:
        raise ValueError(f"{arch}: {field}={act!r} is not supported (supported: {sorted(allowed)})")
    return allowed[act]


def _per_type_rope(config: Any) -> bool:
    """Whether rope_parameters holds one dict per layer type (Gemma 3 in transformers 5)."""
    params = getattr(config, "rope_parameters", None) or {}
    types = set(getattr(config, "layer_types", None) or ())
    return bool(types) and all(isinstance(params.get(t), dict) for t in types)


def _base(config: Any, arch: str, weights: WeightNames, **options: Any) -> DecoderSpec:
    hidden = int(_need(config, arch, "hidden_size"))
    heads = int(_need(config, arch, "num_attention_heads"))
    n = int(_need(config, arch, "num_hidden_layers"))
    per_type = _per_type_rope(config)
    layer_types = getattr(config, "layer_types", None) or [None] * n
    return DecoderSpec(
        arch=arch,
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        intermediate_size=int(_need(config, arch, "intermediate_size")),
        vocab_size=int(_need(config, arch, "vocab_size")),
        eps=float(_need(config, arch, "rms_norm_eps")),
        weights=weights,
        layers=tuple(LayerSpec(sliding_window=layer_sliding_window(config, i),
                               rope_key=layer_types[i] if per_type else None) for i in range(n)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        **options,
    )


_SILU = {"silu": "silu", "swish": "silu"}
_GELU_TANH = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def llama_spec(config: Any) -> DecoderSpec:
    """Llama, Mistral, Qwen2 (q/k/v bias always, o without), SmolLM2."""
    qwen2 = getattr(config, "model_type", "llama") == "qwen2"
    bias = bool(getattr(config, "attention_bias", False))
    arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    return _base(config, arch, WeightNames(LLAMA_PROJECTIONS, PRE_NORMS),
                 qkv_bias=qwen2 or bias, o_bias=bias and not qwen2, mlp_bias=bool(getattr(config, "mlp_bias", False)),
                 activation=_activation(config, arch, _SILU, "silu"))


def qwen3_spec(config: Any) -> DecoderSpec:
    """Qwen3: Llama with per-head q/k RMSNorm, and the bias switch on all four attention projections."""
    bias = bool(getattr(config, "attention_bias", False))
    return _base(config, "Qwen3ForCausalLM", WeightNames(LLAMA_PROJECTIONS, PRE_NORMS + QK_NORMS),
                 qkv_bias=bias, o_bias=bias, qk_norm="per_head",
                 activation=_activation(config, "Qwen3ForCausalLM", _SILU, "silu"))


def _gemma(config: Any, arch: str, *, qk_norm: bool) -> DecoderSpec:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{arch}: use_bidirectional_attention=True (an encoder) is not supported")
    bias = bool(getattr(config, "attention_bias", False))
    norms = SANDWICH_NORMS + (QK_NORMS if qk_norm else ())
    return _base(config, arch, WeightNames(LLAMA_PROJECTIONS, norms),
                 qkv_bias=bias, o_bias=bias, qk_norm="per_head" if qk_norm else "none",
                 norm_placement="sandwich", norm_weight="one_plus",
                 activation=_activation(config, arch, _GELU_TANH, "gelu_pytorch_tanh"),
                 attn_scale=float(_need(config, arch, "query_pre_attn_scalar")) ** -0.5,
                 attn_soft_cap=getattr(config, "attn_logit_softcapping", None),
                 final_soft_cap=getattr(config, "final_logit_softcapping", None),
                 embed_scale=float(config.hidden_size) ** 0.5)


def gemma2_spec(config: Any) -> DecoderSpec:
    """Gemma 2: sandwich norms, (1 + w) RMSNorm, GeGLU, alternating sliding layers, logit soft-capping."""
    return _gemma(config, "Gemma2ForCausalLM", qk_norm=False)


def gemma3_spec(config: Any) -> DecoderSpec:
    """Gemma 3 (text): Gemma 2's layout with per-head q/k norms and local/global RoPE per layer type."""
    return _gemma(config, "Gemma3ForCausalLM", qk_norm=True)


def phi3_spec(config: Any) -> DecoderSpec:
    """Phi-3: Llama with fused qkv_proj and gate_up_proj checkpoint tensors, and LongRoPE."""
    return _base(config, "Phi3ForCausalLM", WeightNames(FUSED_PROJECTIONS, PRE_NORMS),
                 activation=_activation(config, "Phi3ForCausalLM", _SILU, "silu"))


def olmo2_spec(config: Any) -> DecoderSpec:
    """OLMo 2: norms after each sublayer only, and q/k RMSNorm over the whole projection."""
    bias = bool(getattr(config, "attention_bias", False))
    return _base(config, "Olmo2ForCausalLM", WeightNames(LLAMA_PROJECTIONS, POST_NORMS + QK_NORMS),
                 qkv_bias=bias, o_bias=bias, qk_norm="projection", norm_placement="post", norm_weight="float32",
                 activation=_activation(config, "Olmo2ForCausalLM", _SILU, "silu"))


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama/Mistral/Qwen2 causal LM."""

    build_spec = staticmethod(llama_spec)


class Qwen3ForCausalLM(DecoderForCausalLM):
    build_spec = staticmethod(qwen3_spec)


class Gemma2ForCausalLM(DecoderForCausalLM):
    build_spec = staticmethod(gemma2_spec)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3's text decoder, from Gemma3ForCausalLM checkpoints or the text part of multimodal ones."""

    build_spec = staticmethod(gemma3_spec)


class Phi3ForCausalLM(DecoderForCausalLM):
    build_spec = staticmethod(phi3_spec)


class Olmo2ForCausalLM(DecoderForCausalLM):
    build_spec = staticmethod(olmo2_spec)
