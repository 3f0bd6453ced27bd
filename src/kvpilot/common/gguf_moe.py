"""Mixture-of-experts GGUFs (Mixtral, Qwen2-MoE, Qwen3-MoE) back to their HF checkpoint, as transformers 5
names it: the router ``mlp.gate``, each layer's experts stacked as ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
(gate rows, then up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``, Qwen2-MoE's ``mlp.shared_expert.*`` and
``mlp.shared_expert_gate``.

llama.cpp stores the experts stacked too (``ffn_{gate,up,down}_exps``: ``[E, I, H]`` and ``[E, H, I]`` in
numpy's order), so conversion only joins gate and up. Not converted: older Mixtral GGUFs with one tensor
per expert (``blk.N.ffn_gate.E.weight``, before llama.cpp stacked them). The engine's MoE layers run float weights only, so
these models are served from the converted (dequantized) folder, never on the GGUF's blocks.

Config: transformers' GGUF loader maps qwen2moe/qwen3moe (expert_count, expert_used_count; Qwen3-MoE's
norm_topk_prob = True, as llama.cpp routes) but drops the expert widths, and maps a llama GGUF with experts
(Mixtral) to a dense LlamaConfig; both are rebuilt here from the metadata llama.cpp writes, the tensor
shapes where a key is missing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MOE_LAYER_NAMES", "QWEN2MOE_LAYER_NAMES", "join_experts", "mixtral_config", "qwen_moe_config"]

# per-layer GGUF -> HF names; the ``*_exps`` ones are joined (gate|up) by stack_experts
MOE_LAYER_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
QWEN2MOE_LAYER_NAMES = {
    **MOE_LAYER_NAMES,
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _tensor_shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> its shape in numpy's (HF's) order."""
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


def _expert_width(reader: Any, arch: str, key: str, tensor: str) -> int | None:
    """``<arch>.<key>`` where the file has it, else the input width of the first layer's ``tensor``."""
    value = _field(reader, f"{arch}.{key}")
    if value:
        return int(value)
    shapes = _tensor_shapes(reader)
    shape = next((s for n, s in shapes.items() if n.startswith("blk.") and n.endswith(f".{tensor}.weight")), None)
    return None if shape is None else int(shape[-1])


def qwen_moe_config(config: Any, reader: Any, arch: str) -> None:
    """Qwen2-/Qwen3-MoE settings transformers' GGUF loader leaves out: the experts' width
    (``expert_feed_forward_length``), the shared expert's (``expert_shared_feed_forward_length``, Qwen2-MoE),
    and every layer sparse (llama.cpp's qwen2moe/qwen3moe have a router in every layer: decoder_sparse_step 1,
    no mlp_only_layers). norm_topk_prob is what transformers
    sets: False for Qwen2-MoE (HF's default, and llama.cpp's routing), True for Qwen3-MoE (llama.cpp
    renormalizes the top-k weights; the GGUF carries no key for it)."""
    inter = _expert_width(reader, arch, "expert_feed_forward_length", "ffn_down_exps")
    if inter is not None:
        config.moe_intermediate_size = inter
    if arch == "qwen2moe":
        shared = _expert_width(reader, arch, "expert_shared_feed_forward_length", "ffn_down_shexp")
        config.shared_expert_intermediate_size = shared or 0
    config.decoder_sparse_step = 1
    config.mlp_only_layers = []


def mixtral_config(config: Any, reader: Any, arch: str) -> Any:
    """A MixtralConfig for a llama GGUF with experts, which transformers' GGUF loader reads as a dense
    LlamaConfig: the llama fields, ``expert_count`` experts of ``feed_forward_length`` (llama.cpp's Mixtral
    converter writes the expert width there), ``expert_used_count`` per token. No sliding window: Mixtral's
    HF config has none, and llama.cpp writes none for it."""
    from transformers import MixtralConfig

    fields = config.to_dict()
    keep = {k: v for k, v in fields.items() if k in MixtralConfig().to_dict() and k not in (
        "model_type", "architectures", "transformers_version", "sliding_window", "intermediate_size")}
    inter = _expert_width(reader, arch, "expert_feed_forward_length", "ffn_down_exps") \
        or int(_field(reader, f"{arch}.feed_forward_length"))
    return MixtralConfig(**keep, num_local_experts=int(_field(reader, f"{arch}.expert_count")),
                         num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count")),
                         intermediate_size=inter, sliding_window=None)


def join_experts(tensors: dict[str, Any]) -> None:
    """In place: each layer's stacked gate and up experts into ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    and the shared expert's gate as HF's ``[1, H]`` (llama.cpp may store it as ``[H]``)."""
    import torch

    for gate_name in [n for n in tensors if n.endswith(".mlp.experts.gate_proj")]:
        up_name = gate_name.removesuffix("gate_proj") + "up_proj"
        if up_name not in tensors:
            raise ValueError(f"GGUF has ffn_gate_exps but no ffn_up_exps beside it ({gate_name})")
        gate, up = tensors.pop(gate_name), tensors.pop(up_name)
        tensors[gate_name.removesuffix("gate_proj") + "gate_up_proj"] = torch.cat((gate, up), dim=1).contiguous()
    for name in [n for n in tensors if n.endswith(".mlp.shared_expert_gate.weight")]:
        tensors[name] = tensors[name].reshape(1, -1)
