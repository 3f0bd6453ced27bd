"""Llama, Mistral, Qwen2 and SmolLM2: the generic decoder (decoder.py) with Llama's spec (archs.py).

The names that used to live here stay importable from here.
"""

from __future__ import annotations

from .archs import LlamaForCausalLM, llama_spec
from .archs import layer_sliding_window as _layer_sliding_window
from .decoder import DecoderLayer as LlamaDecoderLayer
from .decoder import _rms_norm
from .linear import linear
from .rope import interleave_rope_rows, rope_inv_freq
from .rope import rotate as _rotate

__all__ = ["LlamaForCausalLM", "LlamaDecoderLayer", "llama_spec", "interleave_rope_rows", "rope_inv_freq",
           "_layer_sliding_window", "_rms_norm", "_rotate", "linear"]
