"""Per architecture: its HF config → a ``DecoderSpec``, and the model class the registry names.

Every builder reads only what its HF modeling file uses; a config that asks for something the decoder
does not do (another activation, bidirectional attention) is a ``ValueError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    MoESpec,
    WeightNames,
)

__all__ = [
    "LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
    "Olmo2ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
    "layer_sliding_window",
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


def _base(config: Any, arch: str, weights: WeightNames, *, moe_layers: Sequence[bool] = (),
          **options: Any) -> DecoderSpec:
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
                               rope_key=layer_types[i] if per_type else None,
                               moe=bool(moe_layers) and moe_layers[i]) for i in range(n)),
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


# ------------------------------------------------------------------ mixture of experts


def _refuse_quantized(config: Any, arch: str) -> None:
    """The MoE models load float weights only: a quantized checkpoint (gpt-oss's MXFP4 experts) is refused."""
    qc = getattr(config, "quantization_config", None)
    if qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", qc)
        raise ValueError(f"{arch}: quantization_config with quant_method={str(method)!r} is not supported "
                         "(quantized MoE checkpoints are not; use one with bfloat16/float weights)")


def _moe_common(config: Any, arch: str, experts_field: str, inter_field: str) -> dict[str, Any]:
    _refuse_quantized(config, arch)
    experts, k = int(_need(config, arch, experts_field)), int(_need(config, arch, "num_experts_per_tok"))
    if not 1 <= k <= experts:
        raise ValueError(f"{arch}: num_experts_per_tok={k} must be in [1, {experts_field}={experts}]")
    return {"num_experts": experts, "top_k": k, "intermediate_size": int(_need(config, arch, inter_field))}


def _qwen_moe_layers(config: Any, arch: str) -> list[bool]:
    """Qwen-MoE's sparse layers: every decoder_sparse_step-th one, except mlp_only_layers (HF's rule)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    experts = int(_need(config, arch, "num_experts"))
    return [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(int(config.num_hidden_layers))]


def mixtral_spec(config: Any) -> DecoderSpec:
    """Mixtral: Mistral with a block_sparse_moe of renormalized top-k SiLU experts in every layer."""
    arch = "MixtralForCausalLM"
    moe = MoESpec(**_moe_common(config, arch, "num_local_experts", "intermediate_size"), block="block_sparse_moe",
                  expert_names=("w1", "w3", "w2"), aliases=("mlp",), renormalize=True)
    return _base(config, arch, WeightNames(LLAMA_PROJECTIONS, PRE_NORMS), moe=moe,
                 moe_layers=[True] * int(_need(config, arch, "num_hidden_layers")),
                 activation=_activation(config, arch, _SILU, "silu"))


def qwen2_moe_spec(config: Any) -> DecoderSpec:
    """Qwen2-MoE: Qwen2 attention (q/k/v bias per qkv_bias), MoE layers with a sigmoid-gated shared expert."""
    arch = "Qwen2MoeForCausalLM"
    moe = MoESpec(**_moe_common(config, arch, "num_experts", "moe_intermediate_size"), block="mlp",
                  renormalize=bool(getattr(config, "norm_topk_prob", False)),
                  shared_expert_size=int(_need(config, arch, "shared_expert_intermediate_size")))
    return _base(config, arch, WeightNames(LLAMA_PROJECTIONS, PRE_NORMS), moe=moe,
                 moe_layers=_qwen_moe_layers(config, arch), qkv_bias=bool(getattr(config, "qkv_bias", True)),
                 activation=_activation(config, arch, _SILU, "silu"))


def qwen3_moe_spec(config: Any) -> DecoderSpec:
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms) and MoE layers without a shared expert."""
    arch = "Qwen3MoeForCausalLM"
    bias = bool(getattr(config, "attention_bias", False))
    moe = MoESpec(**_moe_common(config, arch, "num_experts", "moe_intermediate_size"), block="mlp",
                  renormalize=bool(getattr(config, "norm_topk_prob", False)))
    return _base(config, arch, WeightNames(LLAMA_PROJECTIONS, PRE_NORMS + QK_NORMS), moe=moe,
                 moe_layers=_qwen_moe_layers(config, arch), qkv_bias=bias, o_bias=bias, qk_norm="per_head",
                 activation=_activation(config, arch, _SILU, "silu"))


def gpt_oss_spec(config: Any) -> DecoderSpec:
    """gpt-oss: attention sinks and biases, sliding window on the layer_types' sliding layers, YaRN, and MoE
    layers with a biased router (top-k, then softmax), biased experts and the clamped SwiGLU."""
    arch = "GptOssForCausalLM"
    bias = bool(getattr(config, "attention_bias", True))
    moe = MoESpec(**_moe_common(config, arch, "num_local_experts", "intermediate_size"), block="mlp",
                  router="router", fused="gpt_oss", routing="topk_softmax", router_bias=True, expert_bias=True,
                  activation="gpt_oss", swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
                  swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)))
    # its RMSNorm scales in float32, then casts (HF keeps the norms in float32)
    return _base(config, arch, WeightNames(LLAMA_PROJECTIONS, PRE_NORMS), moe=moe,
                 moe_layers=[True] * int(_need(config, arch, "num_hidden_layers")),
                 qkv_bias=bias, o_bias=bias, attn_sinks=True, norm_weight="float32")


class MixtralForCausalLM(DecoderForCausalLM):
    build_spec = staticmethod(mixtral_spec)


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    build_spec = staticmethod(qwen2_moe_spec)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    build_spec = staticmethod(qwen3_moe_spec)


class GptOssForCausalLM(DecoderForCausalLM):
    build_spec = staticmethod(gpt_oss_spec)
