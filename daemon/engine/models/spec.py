"""What one decoder architecture is, as data: ``DecoderSpec``, built per architecture from its HF config
(``archs.py``) and consumed by the one generic decoder (``decoder.py``). Each variation among the dense
decoders is one field here, applied in one place there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# where a layer's RMSNorms sit:
#   "pre": norm -> sublayer -> + residual (Llama)
#   "sandwich": norm -> sublayer -> norm -> + residual (Gemma 2/3)
#   "post": sublayer -> norm -> + residual, no input norm (OLMo 2)
NormPlacement = Literal["pre", "sandwich", "post"]
# how an RMSNorm weight scales the normalized rows:
#   "model_dtype": cast to the model dtype, then times w (Llama)
#   "float32": times w in float32, then cast (OLMo 2)
#   "one_plus": times (1 + w) in float32, then cast (Gemma)
NormWeight = Literal["model_dtype", "float32", "one_plus"]
# q/k RMSNorm before RoPE: per head over head_dim (Qwen3, Gemma 3), or over the whole projection (OLMo 2)
QKNorm = Literal["none", "per_head", "projection"]
Activation = Literal["silu", "gelu_tanh"]
# the routed experts' activation: SiLU(gate) * up over gate|up halves, or gpt-oss's clamped SwiGLU over
# interleaved gate/up rows
ExpertActivation = Literal["silu", "gpt_oss"]
# softmax over all experts then top-k (Mixtral, Qwen-MoE), or top-k on the logits then softmax over the k (gpt-oss)
Routing = Literal["softmax_topk", "topk_softmax"]
# how a checkpoint may hold all experts of a layer in one tensor: "stacked" gate|up [E, 2I, H] and down
# [E, H, I] (transformers 5's own modules); "gpt_oss": gate/up interleaved [E, H, 2I] and down [E, I, H]
FusedExperts = Literal["stacked", "gpt_oss"]
# our layer norms, by role (HF names map onto them per architecture in WeightNames.norms)
NormRole = Literal["input_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm", "k_norm"]


@dataclass(frozen=True)
class LayerSpec:
    sliding_window: int | None = None  # a query at p sees keys p - w < k <= p
    rope_key: str | None = None  # the layer type whose rope_parameters this layer uses, where they differ per type
    moe: bool = False  # the MLP is the spec's MoE block (DecoderSpec.moe), not the dense one


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: a router (a replicated linear, ``<block>.<router>`` in checkpoints), ``top_k``
    of ``num_experts`` gated MLPs of width ``intermediate_size`` per token, and an optional shared expert
    (Qwen2-MoE: ``output += sigmoid(shared_expert_gate(x)) * shared_expert(x)``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    block: str  # the MoE module's checkpoint name inside a layer ("mlp", Mixtral: "block_sparse_moe")
    router: str = "gate"  # the router's name inside the block (gpt-oss: "router")
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert tensors (Mixtral: w1/w3/w2)
    fused: FusedExperts = "stacked"
    aliases: tuple[str, ...] = ()  # other names of the block in checkpoints (Mixtral's transformers 5 "mlp")
    routing: Routing = "softmax_topk"
    renormalize: bool = False  # the k weights divided by their sum (Mixtral; Qwen's norm_topk_prob)
    router_bias: bool = False
    expert_bias: bool = False  # per-expert gate_up and down biases (gpt-oss)
    activation: ExpertActivation = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_expert_size: int = 0  # 0: no shared expert


@dataclass(frozen=True)
class WeightNames:
    """How HF checkpoint names map onto the layers. ``projections``: per HF module inside a layer, our
    linear layer and its partition, or None for a fused tensor (Phi-3's qkv_proj, gate_up_proj) that is
    split over all the layer's partitions."""

    projections: tuple[tuple[str, str, int | None], ...]
    norms: tuple[tuple[str, NormRole], ...]


LLAMA_PROJECTIONS = (
    ("self_attn.q_proj", "qkv_proj", 0), ("self_attn.k_proj", "qkv_proj", 1), ("self_attn.v_proj", "qkv_proj", 2),
    ("self_attn.o_proj", "o_proj", 0), ("mlp.gate_proj", "gate_up_proj", 0), ("mlp.up_proj", "gate_up_proj", 1),
    ("mlp.down_proj", "down_proj", 0),
)
FUSED_PROJECTIONS = (  # Phi-3
    ("self_attn.qkv_proj", "qkv_proj", None), ("self_attn.o_proj", "o_proj", 0),
    ("mlp.gate_up_proj", "gate_up_proj", None), ("mlp.down_proj", "down_proj", 0),
)
QK_NORMS: tuple[tuple[str, NormRole], ...] = (("self_attn.q_norm", "q_norm"), ("self_attn.k_norm", "k_norm"))
PRE_NORMS: tuple[tuple[str, NormRole], ...] = (
    ("input_layernorm", "input_norm"), ("post_attention_layernorm", "pre_mlp_norm"))
SANDWICH_NORMS: tuple[tuple[str, NormRole], ...] = (
    ("input_layernorm", "input_norm"), ("post_attention_layernorm", "post_attn_norm"),
    ("pre_feedforward_layernorm", "pre_mlp_norm"), ("post_feedforward_layernorm", "post_mlp_norm"))
POST_NORMS: tuple[tuple[str, NormRole], ...] = (
    ("post_attention_layernorm", "post_attn_norm"), ("post_feedforward_layernorm", "post_mlp_norm"))


@dataclass(frozen=True)
class DecoderSpec:
    arch: str  # the HF class name, for messages
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    eps: float
    weights: WeightNames
    layers: tuple[LayerSpec, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: QKNorm = "none"
    norm_placement: NormPlacement = "pre"
    norm_weight: NormWeight = "model_dtype"
    activation: Activation = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_soft_cap: float | None = None  # tanh soft-capping of attention logits (Gemma 2)
    final_soft_cap: float | None = None  # tanh soft-capping of the output logits (Gemma 2)
    embed_scale: float | None = None  # embeddings times this, cast to the model dtype (Gemma: sqrt(hidden))
    tie_word_embeddings: bool = False
    attn_sinks: bool = False  # a learned softmax sink logit per head, ``self_attn.sinks`` (gpt-oss)
    moe: MoESpec | None = None  # the MoE block of the layers whose LayerSpec.moe is set
    extra_ignored: tuple[str, ...] = field(default=())  # checkpoint prefixes skipped silently (vision towers)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def __post_init__(self) -> None:
        mapped = {role for _, role in self.weights.norms}
        if mapped != set(self.norm_roles()):  # the HF names must cover exactly the norms the placement uses
            raise ValueError(f"{self.arch}: checkpoint norms {sorted(mapped)} != the layer's {sorted(self.norm_roles())}")
        if any(layer.moe for layer in self.layers) and self.moe is None:
            raise ValueError(f"{self.arch}: MoE layers without a MoESpec")

    def norm_roles(self) -> tuple[NormRole, ...]:
        """The RMSNorms a layer has, from the placement and the q/k norm option."""
        roles: tuple[NormRole, ...] = _PLACEMENT_ROLES[self.norm_placement]
        return roles + (("q_norm", "k_norm") if self.qk_norm != "none" else ())


_PLACEMENT_ROLES: dict[str, tuple[NormRole, ...]] = {
    "pre": ("input_norm", "pre_mlp_norm"),
    "sandwich": ("input_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm"),
    "post": ("post_attn_norm", "post_mlp_norm"),
}
