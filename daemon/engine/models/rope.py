"""Rotary position embeddings: the inverse frequencies of every RoPE type HF configs carry, and the
rotation of q/k rows (HF's two-halves layout, or interleaved pairs for the complex-multiply fast path).

Configs name their RoPE settings in ``rope_parameters`` (transformers 5), per layer type where layers
differ (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``), or in the older
``rope_theta``/``rope_scaling`` fields. An unknown type is a ``ValueError`` naming the field.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvpilot.kernels import ops

__all__ = ["rope_params", "rotary_dim", "rope_inv_freq", "rotate", "interleave_rope_rows", "rope_dim_order",
           "permute_rope_rows"]

# computed here; other static types (yarn, ...) by transformers' own functions
_NATIVE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope")


def rope_params(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of ``config`` (of its ``layer_type``'s layers where they differ per type)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict) and layer_type is None:
        for k, v in scaling.items():
            params.setdefault(k, v)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _partial_factor(config: Any, p: dict[str, Any]) -> float:
    return float(p.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0)


def rotary_dim(config: Any, head_dim: int, layer_type: str | None = None) -> int:
    """The leading dims of each head that RoPE rotates: all of them, or ``partial_rotary_factor`` of them
    (Phi-4-mini: 0.75); ``ValueError`` naming the field where that is not an even count within the head."""
    factor = _partial_factor(config, rope_params(config, layer_type))
    dim = int(head_dim * factor)
    if not 2 <= dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor={factor} gives {dim} rotary dims of a {head_dim}-dim head; "
                         f"RoPE needs an even number from 2 to {head_dim}")
    return dim


def rope_inv_freq(config: Any, head_dim: int, max_len: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] (float32; ``rotary_dim`` is head_dim unless the config rotates only
    part of each head) and the cos/sin scale for the config's RoPE type."""
    p = rope_params(config, layer_type)
    rope_type = p["rope_type"]
    field = "rope_parameters" + (f"[{layer_type!r}]" if layer_type else "") + ".rope_type"
    head_dim = rotary_dim(config, head_dim, layer_type)  # HF computes every type over the rotary dims only
    base = float(p["rope_theta"])
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    if rope_type == "dynamic":
        # NTK-aware: exact (plain RoPE) while max_len fits the original window; beyond it a base
        # fixed for max_len, since paged keys cannot be re-rotated per step as HF does
        factor = float(p.get("factor", 1.0))
        orig = int(p.get("original_max_position_embeddings") or config.max_position_embeddings)
        if max_len > orig:
            base = base * ((factor * max_len / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base**exps)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        orig = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept; the band between is blended
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = ~(wavelen < orig / high) * ~(wavelen > orig / low)
        return torch.where(mid, blended, scaled), 1.0
    if rope_type == "longrope":
        return _longrope(config, p, exps, base, max_len)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        known = sorted(set(_NATIVE_TYPES) | set(ROPE_INIT_FUNCTIONS))
        raise ValueError(f"{field}={rope_type!r} is not a known RoPE type (known: {known})")
    kwargs = {"layer_type": layer_type} if layer_type else {}
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv.float(), float(scale)


def _longrope(config: Any, p: dict[str, Any], exps: torch.Tensor, base: float,
              max_len: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE. HF picks the long or short factors per forward pass from its length; paged
    keys cannot be re-rotated, so the choice is fixed by ``max_len``: the short
    factors while every position fits the original window, else the long ones."""
    orig = int(p.get("original_max_position_embeddings") or config.original_max_position_embeddings)
    factor = float(p.get("factor") or config.max_position_embeddings / orig)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(p["long_factor"] if max_len > orig else p["short_factor"], dtype=torch.float32)
    if ext.shape != exps.shape:
        raise ValueError(f"rope_parameters long_factor/short_factor have {ext.numel()} entries, need {exps.numel()}")
    return 1.0 / (ext * base**exps), float(attention_factor)


def rotate(qk: torch.Tensor, t: int, heads: int, hd: int, cos: torch.Tensor, sin: torch.Tensor | None) -> torch.Tensor:
    """RoPE on q/k rows ``[t, heads * hd]``, returned as ``[t, heads, hd]``: on the CPU, where the native
    kernel takes them, the rows themselves rotated in place (they are a fresh projection's).

    With ``sin`` None, ``cos`` holds complex ``cos + i*sin`` and each head's dims are stored as
    interleaved (x_j, x_{j+hd/2}) pairs (``interleave_rope_rows``): the rotation is then one complex
    multiply instead of HF's seven-op rotate_half (26x less time at 2048 tokens on the CPU).
    """
    if sin is None:
        if ops.rope_(qk, cos, heads):  # float32/bfloat16 CPU rows: rotated in place, one pass
            return qk.view(t, heads, hd)
        wide = qk if qk.dtype == torch.float32 else qk.float()  # bfloat16 rows rotate in float32
        pairs = torch.view_as_complex(wide.reshape(t, heads, hd // 2, 2))
        rotated = torch.view_as_real(pairs * cos).view(t, heads, hd)
        return rotated if rotated.dtype == qk.dtype else rotated.to(qk.dtype)
    x1, x2 = qk.view(t, heads, hd).chunk(2, dim=-1)  # HF's rotate_half layout: two halves
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_dim_order(head_dim: int, rot_dim: int, interleaved: bool) -> torch.Tensor | None:
    """The order the model keeps each head's q/k dims in (``order[i]`` is checkpoint dim ``order[i]``), or None
    where that is the checkpoint's own.

    A partial rotation keeps the last ``head_dim - rot_dim`` dims as they are. Their halves are moved beside
    the rotated halves, ``[rot 1st half | pass 1st half | rot 2nd half | pass 2nd half]``, so that one
    rotation over the whole head with cos 1 and sin 0 on the passed dims (exact: ``x*1 - y*0``) is HF's
    partial one, and every kernel rotates whole heads. Interleaved rows then pair each dim of the first half
    with its partner in the second (``interleave_rope_rows``). Scores are q.k products under one permutation
    of both, so they are unchanged."""
    if rot_dim == head_dim and not interleaved:
        return None
    r, p = rot_dim // 2, (head_dim - rot_dim) // 2
    order = torch.cat([torch.arange(0, r), torch.arange(rot_dim, rot_dim + p), torch.arange(r, rot_dim),
                       torch.arange(rot_dim + p, head_dim)])
    return order.view(2, head_dim // 2).T.reshape(-1) if interleaved else order


def permute_rope_rows(w: torch.Tensor, head_dim: int, order: torch.Tensor | None) -> torch.Tensor:
    """q/k projection rows (or their bias, norm weights, LoRA B rows) of whole heads in ``order`` per head
    (``rope_dim_order``); ``w`` itself for None."""
    if order is None:
        return w
    heads = w.shape[0] // head_dim
    rows = (torch.arange(heads)[:, None] * head_dim + order[None, :]).reshape(-1)
    return w.index_select(0, rows.to(w.device))


def interleave_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k projection rows (or bias, or q/k norm weights) from HF's two-halves order to interleaved
    pairs, per head.

    Attention only ever takes q.k dot products, and both get the same permutation, so scores are
    unchanged; the K cache simply holds each head's dims in this order.
    """
    heads = w.shape[0] // head_dim
    return w.reshape(heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
