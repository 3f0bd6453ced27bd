"""A GGUF file's tensors under HF names, with the linear layers' weights left in their quantized blocks.

The converted folder (``model_source``) holds the config, the tokenizer and dequantized float weights; the
engine serves a GGUF model on the file's own blocks instead (``quantization="gguf"``), reading them from the
GGUF that ``kvpilot_source.json`` names. A linear layer's weight comes as two tensors: ``<layer>.qweight_type``
(the GGML type id, a 0-d int tensor) and then ``<layer>.qweight`` (``[rows, row_bytes]`` uint8: each output
row's blocks along the input, float types as their raw bytes), in HF's row order. A mixture-of-experts layer's
stacked experts come the same way per projection: ``mlp.experts.{gate,up,down}_proj.qweight`` ``[E, rows,
row_bytes]`` (llama.cpp's ``ffn_*_exps``). Everything else (norms, routers, and the embedding unless
``quantized_embeddings``) comes dequantized to float32, as the converter writes it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .model_source import SOURCE_FILE, _gguf_to_hf_name, gguf_arch, gguf_rows_as_hf

if TYPE_CHECKING:
    import torch

__all__ = ["gguf_source", "iter_gguf_weights", "FLOAT_TYPES"]

logger = logging.getLogger(__name__)

FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}  # GGML type ids of unquantized tensors
_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a converted folder came from, where it still exists; None for other folders."""
    record = folder / SOURCE_FILE
    if not record.is_file():
        return None
    try:
        fields = json.loads(record.read_text())
        source = Path(fields["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = source if source.is_absolute() else folder / source
    if not path.is_file():
        logger.warning("%s names %s, which is gone: serving the dequantized weights", record, path)
        return None
    return path


def _is_linear(hf_name: str, quantized_embeddings: bool) -> bool:
    return hf_name.endswith("_proj.weight") or (quantized_embeddings and hf_name in _EMBEDDINGS)


def _is_experts(hf_name: str) -> bool:
    return hf_name.endswith((".experts.gate_proj", ".experts.up_proj", ".experts.down_proj"))


def iter_gguf_weights(gguf_path: Path, hf_config: Any, *, quantized_embeddings: bool = True,
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors as (HF name, tensor); see the module docstring for the linear layers' pair."""
    import gguf
    import numpy as np
    import torch

    reader = gguf.GGUFReader(str(gguf_path))
    _, spec = gguf_arch(reader, str(gguf_path))
    n_head = int(hf_config.num_attention_heads)
    n_kv = int(getattr(hf_config, "num_key_value_heads", None) or n_head)
    for t in reader.tensors:
        hf_name = _gguf_to_hf_name(t.name, spec.layer_names)
        if hf_name is None:
            continue
        qtype = int(t.tensor_type)
        if spec.moe and _is_experts(hf_name):  # [E, rows, row_bytes]; float stacks as their raw bytes too
            blocks = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).copy())
            yield f"{hf_name}.qweight_type", torch.tensor(qtype)
            yield f"{hf_name}.qweight", blocks.reshape(t.data.shape[0], t.data.shape[1], -1)
            continue
        if len(t.data.shape) == 2 and _is_linear(hf_name, quantized_embeddings):
            blocks = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).copy())
            stem = hf_name.removesuffix(".weight")
            yield f"{stem}.qweight_type", torch.tensor(qtype)
            yield f"{stem}.qweight", gguf_rows_as_hf(blocks, hf_name, t.name, spec, n_head, n_kv)
            continue
        w = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).to(torch.float32)
        if hf_name.endswith(".mlp.shared_expert_gate.weight"):  # HF's [1, H]; llama.cpp may store [H]
            w = w.reshape(1, -1)
        yield hf_name, gguf_rows_as_hf(w, hf_name, t.name, spec, n_head, n_kv).contiguous()
