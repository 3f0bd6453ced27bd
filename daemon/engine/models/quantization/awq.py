"""AWQ checkpoints as AutoAWQ writes them (``version: "gemm"``), run as Q4_1 blocks (``int4``).

Per layer: ``qweight`` int32 ``[in, out/8]`` and ``qzeros`` int32 ``[in/group, out/8]``, eight 4-bit values
per int32 along the output dimension in AWQ's interleaved order (nibble i holds output column
``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``), and ``scales`` fp16 ``[in/group, out]``; ``W = s * (q - z)``.
``quantization_config``: ``bits`` (4), ``group_size``, ``zero_point`` (true), ``version``,
``modules_to_not_convert``; AutoAWQ's own ``w_bit`` / ``q_group_size`` names are read too.
"""

from __future__ import annotations

from typing import Any

import torch

from . import ShardSlice, register
from .fp8 import ignore_list
from .int4 import Int4LinearMethod, check_packed, check_scales, unpack_nibbles

# AWQ packs output columns (0, 2, 4, 6, 1, 3, 5, 7) into nibbles 0..7; column j is in nibble _COLUMN_NIBBLE[j]
_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[r, out/8]`` in AWQ's order -> uint8 ``[out, r]`` (output-major)."""
    nibbles = unpack_nibbles(packed)[..., list(_COLUMN_NIBBLE)]  # [r, out/8, 8] in column order
    return nibbles.reshape(packed.shape[0], -1).T


@register
class AWQLinearMethod(Int4LinearMethod):
    name = "awq"
    format_name = "AWQ"

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None) -> AWQLinearMethod:
        if quant_config is None:
            raise ValueError("quantization 'awq' runs AWQ checkpoints (a quantization_config); this one is float")
        qc = quant_config
        bits = cls.config_int(qc, "bits", "w_bit")
        group_size = cls.config_int(qc, "group_size", "q_group_size")
        cls.check_config(bits, group_size)
        if not qc.get("zero_point", True):
            raise ValueError("quantization_config.zero_point false is not supported (AWQ with zero points only)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version {version!r} is not supported (AutoAWQ's 'gemm' layout)")
        return cls(group_size=group_size, ignore=ignore_list(qc, "modules_to_not_convert"))

    def checkpoint_names(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def unpack(self, name: str, tensor: torch.Tensor, part: ShardSlice) -> torch.Tensor:
        out, cols = part.stored_rows, part.ckpt_shape[1]
        groups = self.groups(cols)
        if out % 8:
            raise RuntimeError(f"{name}: {out} output rows do not pack 8 to an int32")
        if name == "qweight":
            check_packed(name, tensor, (cols, out // 8), "AWQ: [in, out/8]")
            return unpack_awq(tensor)
        if name == "qzeros":
            check_packed(name, tensor, (groups, out // 8), "AWQ: [in/group, out/8]")
            return unpack_awq(tensor)
        return check_scales(tensor, groups, out)
