"""The torch reference of the mixture-of-experts layer: the definition every MoE backend is tested against.

``fused_moe(hidden, w13, w2, topk_weights, topk_ids)`` computes, for every token t and each of its k routed
experts e = topk_ids[t, j] with weight w = topk_weights[t, j]::

    out[t] = sum_j w * (act(hidden[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])

Weights are laid out as the checkpoints of HF's Mixtral/Qwen-MoE are: ``w13 [E, 2*I, H]`` the gate and up
projections stacked per expert (rows 0..I-1 gate, I..2I-1 up) and ``w2 [E, H, I]``. Activations:

- ``"silu"``: ``silu(gate) * up`` (Mixtral, Qwen2-MoE, Qwen3-MoE).
- ``"gpt_oss"``: gpt-oss's clamped SwiGLU over *interleaved* rows (row 2i is gate i, row 2i+1 up i, as its
  checkpoint stores them): ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)``, alpha=1.702 and limit=7.0 by default. gpt-oss's experts also
  have biases (``w13_bias [E, 2*I]``, ``w2_bias [E, H]``), which every activation takes.

Arithmetic: the two GEMMs run in the input dtype (torch's CPU/GPU GEMMs accumulate 16-bit inputs in
float32), the activation in float32 from the rounded gate|up, rounded back to the input dtype before the
second GEMM (as HF's modules do); the weighted sum over the k experts accumulates in float32 and is rounded
once at the end (HF adds in the model dtype, which for k=8 in bfloat16 loses bits we need not lose).
"""

from __future__ import annotations

import torch

__all__ = [
    "ACTIVATIONS", "GPT_OSS_ALPHA", "GPT_OSS_LIMIT", "activation", "check_expert_ids", "check_moe_args", "fused_moe",
]

ACTIVATIONS = ("silu", "gpt_oss")
# gpt-oss's config (swiglu_alpha, swiglu_limit); the kernels take others as arguments
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def check_moe_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, act: str, w13_bias: torch.Tensor | None,
                   w2_bias: torch.Tensor | None) -> None:
    """Shape and dtype checks shared by every backend (no device sync: expert ids are not range-checked
    here, see ``check_expert_ids``)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {act!r}")
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    tokens, h = hidden.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"weights do not fit hidden size {h}: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
                         f"(want [E, 2I, {h}] and [E, {h}, I])")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids/topk_weights must both be [{tokens}, k]; got {tuple(topk_ids.shape)} and "
                         f"{tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_ids must be int32/int64 and topk_weights floating; got {topk_ids.dtype}, "
                         f"{topk_weights.dtype}")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"weights must have the hidden dtype {hidden.dtype}; got {w13.dtype}, {w2.dtype}")
    if w13_bias is not None and w13_bias.shape != (e, two_i):
        raise ValueError(f"w13_bias must be [{e}, {two_i}], got {tuple(w13_bias.shape)}")
    if w2_bias is not None and w2_bias.shape != (e, h):
        raise ValueError(f"w2_bias must be [{e}, {h}], got {tuple(w2_bias.shape)}")


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Out-of-range expert ids raise (a device sync: the CPU paths only)."""
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"topk_ids must lie in [0, {num_experts}); got [{int(topk_ids.min())}, "
                         f"{int(topk_ids.max())}]")


def activation(gate_up: torch.Tensor, act: str, alpha: float = GPT_OSS_ALPHA,
               limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """The gated activation of ``gate_up [rows, 2*I]`` in float32 (see the module docstring for layouts)."""
    gu = gate_up.float()
    if act == "silu":
        inter = gu.shape[1] // 2
        return torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    gate = gu[:, 0::2].clamp(max=limit)
    up = gu[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float = GPT_OSS_ALPHA,
    swiglu_limit: float = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """``[T, H]`` in the hidden dtype: loop over the experts that have tokens, gather each one's tokens,
    one GEMM per projection, weighted scatter-add."""
    act = activation
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias)
    check_expert_ids(topk_ids, w13.shape[0])
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1).float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)  # (token, slot) pairs routed to e, as t * k + j
        tokens = pairs // k
        x = hidden.index_select(0, tokens)
        gate_up = x @ w13[e].T
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].to(gate_up.dtype)
        a = _activation(gate_up, act, swiglu_alpha, swiglu_limit).to(hidden.dtype)
        y = a @ w2[e].T
        if w2_bias is not None:
            y = y + w2_bias[e].to(y.dtype)
        out.index_add_(0, tokens, y.float() * flat_weights[pairs, None])
    return out.to(hidden.dtype)


_activation = activation  # fused_moe's keyword shadows the function's name inside it
