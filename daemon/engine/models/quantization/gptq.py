"""GPTQ checkpoints as AutoGPTQ and GPTQModel write them, run as Q4_1 blocks (``int4``).

Per layer: ``qweight`` int32 ``[in/8, out]`` (eight 4-bit values per int32 along the input dimension, nibble i
holding input row ``8r + i``), ``qzeros`` int32 ``[groups, out/8]`` (along the output dimension, in order),
``scales`` fp16 ``[groups, out]`` and ``g_idx`` int32 ``[in]``, each input column's group: ``i // group_size``,
or with ``desc_act`` the order GPTQ quantized the columns in, scattered. ``W = s * (q - z)``. The classic
format (``checkpoint_format`` "gptq", the default, AutoGPTQ's) stores ``z - 1``; GPTQModel's "gptq_v2" ``z``.
``quantization_config``: ``bits`` (4), ``group_size`` (-1: one group per row), ``desc_act``, ``sym``,
``checkpoint_format``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import ShardSlice, register
from .int4 import Int4LinearMethod, check_packed, check_scales, unpack_nibbles


@register
class GPTQLinearMethod(Int4LinearMethod):
    name = "gptq"
    format_name = "GPTQ"

    def __init__(self, *, zero_offset: int = 1, **kw: Any) -> None:
        super().__init__(**kw)
        self.zero_offset = zero_offset  # what the stored zero points lack: 1 in the classic format

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None) -> GPTQLinearMethod:
        if quant_config is None:
            raise ValueError("quantization 'gptq' runs GPTQ checkpoints (a quantization_config); this one is float")
        qc = quant_config
        bits = cls.config_int(qc, "bits")
        group_size = cls.config_int(qc, "group_size", default=-1)
        cls.check_config(bits, group_size)
        fmt = qc.get("checkpoint_format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format {fmt!r} is not supported ('gptq' or 'gptq_v2')")
        if qc.get("is_marlin_format"):
            raise ValueError("quantization_config.is_marlin_format: Marlin-repacked GPTQ checkpoints are not supported")
        if qc.get("dynamic"):
            raise ValueError("quantization_config.dynamic (per-module GPTQ settings) is not supported")
        if qc.get("lm_head"):
            raise ValueError("quantization_config.lm_head: a quantized LM head is not supported")
        details = (", desc_act" if qc.get("desc_act") else "") + ("" if qc.get("sym", True) else ", asymmetric")
        return cls(group_size=group_size, zero_offset=1 if fmt == "gptq" else 0, details=details)

    def checkpoint_names(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx")

    def unpack(self, name: str, tensor: torch.Tensor, part: ShardSlice) -> torch.Tensor:
        out, cols = part.stored_rows, part.ckpt_shape[1]
        groups = self.groups(cols)
        if name == "qweight":
            check_packed(name, tensor, (cols // 8, out), "GPTQ: [in/8, out]")
            # [in/8, out, 8] -> [in/8, 8, out]: nibble i of row r is input row 8r + i
            return unpack_nibbles(tensor).permute(0, 2, 1).reshape(cols, out).T
        if name == "qzeros":
            if out % 8:
                raise RuntimeError(f"qzeros: {out} output rows do not pack 8 to an int32")
            check_packed(name, tensor, (groups, out // 8), "GPTQ: [groups, out/8]")
            # the classic format's 4 bits hold z - 1, so its zero points run 1..16
            return (unpack_nibbles(tensor).reshape(groups, out) + self.zero_offset).T
        return check_scales(tensor, groups, out)
