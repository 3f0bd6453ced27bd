"""The published on-disk layouts of quantized checkpoints, written from float weights, and dequantizers of
them written from the formats' descriptions alone (not from kvpilot's loaders), for the quantization tests.

Layouts (per linear layer ``W [out, in]``; ``W = s * (q - z)`` for the 4-bit ones):

- compressed-tensors FP8 ("-FP8-dynamic"): ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` float32
  ``[out, 1]`` (strategy "channel") or ``[1]`` ("tensor"); ``W = weight * weight_scale``.
- block FP8 (Qwen3-FP8, DeepSeek-V3): ``weight`` e4m3 and ``weight_scale_inv`` ``[ceil(out/bn), ceil(in/bk)]``,
  one per block; ``W = weight * weight_scale_inv[row // bn, col // bk]``.
- AutoAWQ GEMM: ``qweight`` int32 ``[in, out/8]``, ``qzeros`` int32 ``[in/g, out/8]``: the int32 at column c
  holds output columns 8c+0, 8c+2, 8c+4, 8c+6, 8c+1, 8c+3, 8c+5, 8c+7 in its nibbles 0 (lowest) to 7;
  ``scales`` fp16 ``[in/g, out]``.
- GPTQ (AutoGPTQ / GPTQModel): ``qweight`` int32 ``[in/8, out]``: the int32 at row r holds input rows 8r..8r+7
  in nibbles 0..7; ``qzeros`` int32 ``[groups, out/8]``, output columns 8c..8c+7 in nibbles 0..7, storing
  ``z - 1`` in the classic ("gptq", v1) format and ``z`` in "gptq_v2"; ``scales`` fp16 ``[groups, out]``;
  ``g_idx`` int32 ``[in]`` the group of each input column (with desc_act, scattered: GPTQ quantizes the
  columns in another order and numbers the groups in that order).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AWQ_NIBBLE_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds output column 8c + this[i]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Tensors = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------------------- int32 packing


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in 0..2^32-1 as the int32s of the same bits."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_along_last(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """uint 4-bit ``[r, 8c]`` -> int32 ``[r, c]``: nibble i of int32 j holds ``values[:, 8j + order[i]]``."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(order):
        word |= v[:, :, col] << (4 * i)
    return _to_int32(word)


def nibble(words: torch.Tensor, i: int) -> torch.Tensor:
    """Nibble i (bits 4i..4i+3) of each int32, as int64."""
    return (words.to(torch.int64) >> (4 * i)) & 0xF


# ----------------------------------------------------------------------------------------------- FP8


def fp8_channel(w: torch.Tensor) -> Tensors:
    """compressed-tensors "channel": one scale per output row, ``amax / 448``."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
    return {"weight": (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), "weight_scale": scale}


def fp8_tensor(w: torch.Tensor) -> Tensors:
    """compressed-tensors "tensor": one scale, shape [1]."""
    scale = (w.float().abs().amax() / E4M3_MAX).reshape(1)
    return {"weight": (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), "weight_scale": scale}


def fp8_block(w: torch.Tensor, block: tuple[int, int]) -> Tensors:
    """Block FP8: one ``weight_scale_inv`` per ``block`` of ``[rows, columns]``, ragged at the ends."""
    bn, bk = block
    out, cols = w.shape
    scales = torch.empty(-(-out // bn), -(-cols // bk))
    q = torch.empty(out, cols, dtype=FP8)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = float(tile.abs().max()) / E4M3_MAX or 1.0
            scales[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return {"weight": q, "weight_scale_inv": scales}


def dequant_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors FP8 (either strategy): the scale broadcasts over the rows it covers."""
    return weight.float() * weight_scale.float().reshape(-1, 1)


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    out = weight.float()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= float(scale_inv[i, j])
    return out


# ----------------------------------------------------------------------------------------- 4-bit groups


def _asymmetric(w: torch.Tensor, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max 4-bit quantization of each row of ``w [rows, n]``: (q, zero, fp16 scale) with
    ``w ~ s * (q - z)``; the scale is rounded to fp16 first, so ``q`` is what that scale gives."""
    lo, hi = w.min(dim=1).values.clamp(max=0), w.max(dim=1).values.clamp(min=0)
    s = ((hi - lo) / 15).clamp_min(1e-6).to(torch.float16)
    z = torch.round(-lo / s.float()).clamp(min_zero, 15)
    q = torch.round(w / s.float()[:, None] + z[:, None]).clamp(0, 15)
    return q.to(torch.int64), z.to(torch.int64), s


def _symmetric(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's sym=True: zero 8, scale ``2 * amax / 15``."""
    s = (2 * w.abs().max(dim=1).values / 15).clamp_min(1e-6).to(torch.float16)
    q = torch.round(w / s.float()[:, None] + 8).clamp(0, 15)
    return q.to(torch.int64), torch.full_like(q[:, 0], 8, dtype=torch.int64), s


def awq_gemm(w: torch.Tensor, group_size: int) -> Tensors:
    """AutoAWQ's GEMM layout of ``w [out, in]`` (asymmetric, zero points 0..15)."""
    out, cols = w.shape
    groups = cols // group_size
    q = torch.empty(cols, out, dtype=torch.int64)
    zeros = torch.empty(groups, out, dtype=torch.int64)
    scales = torch.empty(groups, out, dtype=torch.float16)
    for g in range(groups):
        part = slice(g * group_size, (g + 1) * group_size)
        gq, gz, gs = _asymmetric(w[:, part].float())  # rows: output columns
        q[part], zeros[g], scales[g] = gq.T, gz, gs
    return {"qweight": pack_along_last(q, AWQ_NIBBLE_COLUMNS), "qzeros": pack_along_last(zeros, AWQ_NIBBLE_COLUMNS),
            "scales": scales}


def _affine(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, q4_1: bool) -> torch.Tensor:
    """``s * (q - z)`` (``[in, out]`` each) as ``[out, in]`` float32; with ``q4_1`` what a GGUF Q4_1 block of
    these values holds instead: ``d * q + m`` with ``d = s`` and ``m = -s*z`` rounded to fp16."""
    s = s.float()
    w = s * q + (-(s * z)).to(torch.float16).float() if q4_1 else (q - z).float() * s
    return w.T.contiguous()


def dequant_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int, *,
                q4_1: bool = False) -> torch.Tensor:
    cols, packed = qweight.shape
    q = torch.empty(cols, packed * 8, dtype=torch.int64)
    z = torch.empty(qzeros.shape[0], packed * 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_NIBBLE_COLUMNS):
        q[:, col::8] = nibble(qweight, i)
        z[:, col::8] = nibble(qzeros, i)
    group = torch.arange(cols) // group_size
    return _affine(q, z[group], scales[group], q4_1)


def gptq(w: torch.Tensor, group_size: int, *, desc_act: bool = False, sym: bool = True, v1: bool = True,
         seed: int = 0) -> Tensors:
    """GPTQ's layout of ``w [out, in]`` (``group_size`` -1: one group). With ``desc_act`` the columns are
    quantized in a random order (standing in for GPTQ's Hessian order) and the groups numbered in it. The
    classic (``v1``) format cannot store a zero point of 0, so asymmetric zeros start at 1 there."""
    out, cols = w.shape
    size = cols if group_size == -1 else group_size
    groups = -(-cols // size)
    order = torch.randperm(cols, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(cols)
    g_idx = torch.empty(cols, dtype=torch.int64)
    g_idx[order] = torch.arange(cols) // size  # the j-th column quantized is in group j // size
    q = torch.empty(cols, out, dtype=torch.int64)
    zeros = torch.empty(groups, out, dtype=torch.int64)
    scales = torch.empty(groups, out, dtype=torch.float16)
    for g in range(groups):
        members = (g_idx == g).nonzero().flatten()
        gq, gz, gs = _symmetric(w[:, members].float()) if sym else _asymmetric(w[:, members].float(), int(v1))
        q[members], zeros[g], scales[g] = gq.T, gz, gs
    packed_q = torch.zeros(cols // 8, out, dtype=torch.int64)
    for i in range(8):
        packed_q |= q[i::8] << (4 * i)
    return {"qweight": _to_int32(packed_q), "qzeros": pack_along_last(zeros - int(v1)), "scales": scales,
            "g_idx": g_idx.to(torch.int32)}


def dequant_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, *,
                 v1: bool = True, q4_1: bool = False) -> torch.Tensor:
    rows, out = qweight.shape
    q = torch.empty(rows * 8, out, dtype=torch.int64)
    z = torch.empty(qzeros.shape[0], out, dtype=torch.int64)
    for i in range(8):
        q[i::8] = nibble(qweight, i)
        z[:, i::8] = nibble(qzeros, i) + int(v1)
    g = g_idx.long()
    return _affine(q, z[g], scales[g], q4_1)


# ---------------------------------------------------------------------------------------- checkpoints


def fp8_ct_config(strategy: str, dynamic: bool = True) -> dict[str, Any]:
    """compressed-tensors quantization_config of an "-FP8-dynamic" (or static "-FP8") checkpoint."""
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic,
            "strategy": "token" if dynamic else "tensor", "group_size": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts,
                                          "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                      "dynamic": False, "strategy": strategy, "group_size": None}}}}


def fp8_block_config(block: tuple[int, int]) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def awq_config(group_size: int) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def gptq_config(group_size: int, *, desc_act: bool, sym: bool, v1: bool = True) -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "lm_head": False,
            "checkpoint_format": "gptq" if v1 else "gptq_v2"}


Quantizer = Callable[[str, torch.Tensor], Tensors]  # (layer name, float weight) -> the layer's tensors
Dequantizer = Callable[[Tensors], torch.Tensor]  # the layer's tensors -> the float weight they mean


def rewrite_checkpoint(src: Path, quant_dst: Path, quantize: Quantizer, quantization_config: dict[str, Any],
                       floats: dict[Path, Dequantizer],
                       keep_float: Callable[[str], bool] = lambda _: False) -> None:
    """From the float checkpoint in ``src``: ``quant_dst`` with every decoder projection (but those
    ``keep_float`` names) in the quantized layout and ``quantization_config`` in config.json, and for each
    ``floats`` folder the same model with those weights as that dequantizer reads them, in float32."""
    from safetensors.torch import load_file, save_file

    for dst in (quant_dst, *floats):
        shutil.copytree(src, dst)
    (st,) = src.glob("*.safetensors")
    tensors = load_file(str(st))
    quant: Tensors = {}
    dense: dict[Path, Tensors] = {dst: {} for dst in floats}
    for name, w in tensors.items():
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and layer.rsplit(".", 1)[-1] in PROJECTIONS) or keep_float(layer):
            quant[name] = w
            for out in dense.values():
                out[name] = w
            continue
        parts = quantize(layer, w)
        quant.update({f"{layer}.{k}": v.contiguous() for k, v in parts.items()})
        for dst, dequantize in floats.items():
            dense[dst][name] = dequantize(parts).to(w.dtype)
    for dst, out in ((quant_dst, quant), *dense.items()):
        (dst / st.name).unlink()
        save_file(out, str(dst / st.name), metadata={"format": "pt"})
    config = json.loads((quant_dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (quant_dst / "config.json").write_text(json.dumps(config))
